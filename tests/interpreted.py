"""Runs a Python command line under Triton's interpreter (`TRITON_INTERPRET=1`, set before triton is
imported, so the Triton kernels run on CPU tensors) and returns the JSON its last stdout line prints.
Used by the kernel tests that check a Triton kernel against its PyTorch reference on the CPU."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_in_interpreter(*args: str, **env: str):
    """`python *args` from the repository root under the interpreter (extra environment `env`); skips
    without triton, fails with the child's stderr when it exits non-zero."""
    pytest.importorskip("triton")
    run = subprocess.run([sys.executable, *args], env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT, **env),
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
