"""Helpers shared by the diffusion tests (reference pipelines, pixel comparison)."""

from __future__ import annotations

import numpy as np


def reference_pipe(path: str):
    import torch
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(path, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def max_pixel_diff(a, b) -> int:
    a, b = np.asarray(a).astype(np.int32), np.asarray(b).astype(np.int32)
    assert a.shape == b.shape, (a.shape, b.shape)
    return int(np.abs(a - b).max())


def frames_uint8(video) -> np.ndarray:
    """A diffusers 'np' video [T, H, W, 3] in [0, 1] -> uint8, rounding like our engine."""
    return (np.asarray(video) * 255).round().astype(np.uint8)
