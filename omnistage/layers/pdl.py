"""Programmatic dependent launch (PDL, sm_90+) for the Triton kernels of `omnistage.layers` (any process: the
kernel modules import it; it launches nothing itself).

In: the tensor a launch runs on. Out: `launch(t)`, the extra launch options of a PDL-aware kernel (the kernel's
`PDL` constexpr and Triton's `launch_pdl`), and `gdc_wait` / `gdc_launch_dependents` for the kernels to call.

Why: a decode step is hundreds of short kernels in one CUDA graph, and each kernel boundary leaves the GPU idle
for about half a microsecond (launch, the previous grid's drain). With PDL the next kernel is launched while
the previous one still runs; its programs do what does not depend on it and then wait in the kernel.

Rules every PDL-aware kernel here follows:
  1. A kernel launched with `launch_pdl=True` may start before the previous kernel in the stream has finished.
     It calls gdc_wait() before it reads anything the previous kernel writes AND before it writes anything the
     previous kernel may still read (scratch, tickets, its output buffer).
  2. Every program of a PDL-launched kernel executes gdc_wait(), also programs that exit early. A kernel
     completes when its programs do, so only then does its completion imply the previous kernel's: a kernel
     launched after it without PDL (a cuBLAS GEMM) waits for it alone and would otherwise read unfinished data.
  3. gdc_launch_dependents() in the earlier kernel only lets the next one launch early (its programs become
     resident and wait, or run what precedes their wait); placing it early, even first, is safe as long as the
     next kernel waits. Without it the next kernel launches as the earlier one's programs exit.
  So, by 2, when every PDL-launched kernel waits in every program, a finished kernel implies all kernels before
  it finished. A kernel whose predecessor was launched without PDL, or triggers only after its own gdc_wait (as
  every kernel here does), starts only once every kernel before that predecessor has finished: before its own
  wait it may read what those kernels wrote, just not what the predecessor writes. The MoE down launch reads
  the router's expert ids so (gate-up waits, then triggers); the paged decode kernel fed raw qkv rows reads the
  context lengths and its block-table entry so (the qkv GEMM before it writes only the rows).

Switch: `OMNISTAGE_PDL`, read at import into `ENABLED` (benchmarks may flip it; launches read it): "1" (the
default) on, "0" off (the kernels launch as before PDL existed: no `PDL` constexpr, no `launch_pdl`).
`disable(reason)` turns it off for the rest of the process: the shared layout does, before it builds its stages,
where two stages' kernels run side by side on one GPU (pipeline/shared.py says why). On only
where Triton has gdc_wait / gdc_launch_dependents and for CUDA tensors on an NVIDIA GPU of compute capability
9.0 or more (griddepcontrol is sm_90 PTX). Under Triton's interpreter (`TRITON_INTERPRET=1`: CPU tests) the two
calls are no-ops -- it runs one program at a time, each launch after the last -- and `launch` is on for CPU
tensors too, so the tests run the kernels' PDL branches (not PDL itself: that needs the GPU).
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

try:
    import triton
except ImportError:                                  # CPU-only installs
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
gdc_wait = gdc_launch_dependents = None
if triton is not None and INTERPRET:
    import triton.language as tl  # noqa: F401  (the interpreter runs a jit function only where tl is visible)

    @triton.jit
    def gdc_wait():                                  # the interpreter runs launches in order: nothing to wait for
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass
elif triton is not None:
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:                              # a Triton without programmatic dependent launch
        pass


def _mode(value: str) -> bool:
    """`OMNISTAGE_PDL` -> whether PDL is wanted."""
    if value not in ("0", "1"):
        raise ValueError(f"OMNISTAGE_PDL must be 1 (programmatic dependent launch, the default) or 0 (off), "
                         f"got {value!r}")
    return value == "1"


ENABLED = _mode(os.environ.get("OMNISTAGE_PDL", "1")) and gdc_wait is not None
_CAPABLE: dict[int, bool] = {}                       # CUDA device index -> sm_90+ NVIDIA GPU


def on(t: torch.Tensor) -> bool:
    """Whether kernels on `t` take the PDL path (see the module docstring)."""
    if not ENABLED:
        return False
    if not t.is_cuda:
        return INTERPRET
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if index not in _CAPABLE:
        _CAPABLE[index] = torch.version.hip is None and torch.cuda.get_device_capability(index) >= (9, 0)
    return _CAPABLE[index]


def launch(t: torch.Tensor) -> dict:
    """The launch options of a PDL-aware kernel on `t`: its `PDL` constexpr and `launch_pdl`, or none when off."""
    return dict(PDL=True, launch_pdl=True) if on(t) else {}


def disable(reason: str) -> None:
    """PDL off from now on in this process (kernels launched and graphs captured after this call launch without
    it); logs `reason` once."""
    global ENABLED
    if ENABLED:
        ENABLED = False
        logger.info("programmatic dependent launch off: %s", reason)
