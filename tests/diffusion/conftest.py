"""Shared fixtures: tiny diffusers checkpoints built once per session, engines, and pixel comparison."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

_BUILT: dict[str, str] = {}


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """tiny_dir(kind) -> folder of a tiny random pipeline of that kind, saved in the diffusers layout."""
    from omnistage.testing.diffusion import DIFFUSION_TINY_BUILDERS

    def get(kind: str) -> str:
        if kind not in _BUILT:
            _BUILT[kind] = DIFFUSION_TINY_BUILDERS[kind](str(tmp_path_factory.mktemp(kind)))
        return _BUILT[kind]

    return get
