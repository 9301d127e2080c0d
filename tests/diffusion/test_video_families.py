"""Wan text-to-video (2.1, 2.2 two experts) and image-to-video on tiny fp32 checkpoints: our frames
equal diffusers' `pipe()` frames for the same seed; batched requests equal each alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from diffusion_testutil import frames_uint8, max_pixel_diff, reference_pipe
from omnistage.config import EngineConfig
from omnistage.diffusion.engine import DiffusionEngine
from omnistage.models.registry import diffusion_family
from omnistage.params import DiffusionParams

SIZE = dict(height=32, width=32, num_frames=5)
ENGINES: dict[str, DiffusionEngine] = {}


def engine(tiny_dir, kind: str) -> DiffusionEngine:
    if kind not in ENGINES:
        ENGINES[kind] = DiffusionEngine(tiny_dir(kind), diffusion_family(tiny_dir(kind)),
                                        EngineConfig(device="cpu", dtype="float32", max_num_seqs=8))
    return ENGINES[kind]


def start_image() -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8))


@pytest.mark.parametrize("kind", ["wan", "wan2.2", "wan-i2v"])
def test_matches_diffusers_pipeline(tiny_dir, kind):
    extra = {}
    if kind == "wan-i2v":
        pytest.importorskip("ftfy", reason="diffusers' WanImageToVideoPipeline needs ftfy for its prompt cleaning")
        extra = {"image": start_image()}
    pipe = reference_pipe(tiny_dir(kind))
    ref = pipe(prompt="a cat surfing", negative_prompt="blurry", guidance_scale=4.0, num_inference_steps=4,
               generator=torch.Generator("cpu").manual_seed(3), output_type="np", **SIZE, **extra).frames[0]
    out = engine(tiny_dir, kind).generate(
        {"r": ({"prompt": "a cat surfing", "negative_prompt": "blurry", **extra},
               DiffusionParams(seed=3, guidance_scale=4.0, num_inference_steps=4, **SIZE))})["r"]
    frames = out.video.frames
    assert frames.dtype == np.uint8 and frames.shape == (5, 32, 32, 3) and out.video.fps == 16
    assert max_pixel_diff(frames, frames_uint8(ref)) <= 2


@pytest.mark.parametrize("kind", ["wan", "wan2.2"])
def test_batched_requests_equal_each_alone(tiny_dir, kind):
    eng = engine(tiny_dir, kind)
    reqs = {rid: ({"prompt": p}, DiffusionParams(seed=s, num_inference_steps=n, guidance_scale=3.0, **SIZE))
            for rid, p, s, n in [("a", "waves", 1, 2), ("b", "a fox running in snow", 2, 4), ("c", "rain", 3, 3)]}
    alone = {rid: eng.generate({rid: r})[rid] for rid, r in reqs.items()}
    eng.runner.max_batch_tasks = 0
    together = eng.generate(reqs)
    assert eng.runner.max_batch_tasks >= 2
    for rid in reqs:
        assert max_pixel_diff(together[rid].video.frames, alone[rid].video.frames) <= 2, rid


def test_i2v_requires_an_image(tiny_dir):
    with pytest.raises(ValueError, match="image"):
        engine(tiny_dir, "wan-i2v").add_request("x", {"prompt": "a cat"}, DiffusionParams(**SIZE))
