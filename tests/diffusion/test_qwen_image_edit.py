"""Qwen-Image-Edit on a tiny fp32 checkpoint (saved and reloaded): our engine's pixels equal diffusers'
`QwenImageEditPipeline()` for the same input image / prompt / seed; two edits with different seeds share
forwards and equal each run alone; the output size follows the input image's aspect ratio."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.config import EngineConfig
from omnistage.diffusion.engine import DiffusionEngine
from omnistage.models.registry import diffusion_family
from omnistage.params import DiffusionParams

from diffusion_testutil import max_pixel_diff, reference_pipe

SIZE = dict(height=64, width=64)
CFG = dict(true_cfg_scale=3.0)


def _image(w=40, h=24, seed=0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def edit(tiny_dir):
    path = tiny_dir("qwen-image-edit")
    return path, DiffusionEngine(path, diffusion_family(path), EngineConfig(device="cpu", dtype="float32", max_num_seqs=8))


@pytest.fixture(scope="module")
def alone(edit):
    """Request "a" run alone (also the diffusers comparison)."""
    _, eng = edit
    req = ({"prompt": "make the cube red", "negative_prompt": "blurry", "image": _image()},
           DiffusionParams(seed=11, num_inference_steps=2, **SIZE, **CFG))
    return req, eng.generate({"a": req})["a"]


def test_matches_diffusers_pipeline(edit, alone):
    path, _ = edit
    pipe = reference_pipe(path)
    ref = pipe(image=_image(), prompt="make the cube red", negative_prompt="blurry", num_inference_steps=2,
               generator=torch.Generator("cpu").manual_seed(11), **SIZE, **CFG).images[0]
    _, out = alone
    assert out.finished and len(out.images) == 1 and out.images[0].size == (64, 64)
    assert max_pixel_diff(out.images[0], ref) <= 2


def test_two_edits_batch_and_equal_each_alone(edit, alone):
    _, eng = edit
    req_a, out_a = alone
    req_b = ({"images": [_image(seed=1)], "prompt": "add a green sphere", "negative_prompt": "dark"},
             DiffusionParams(seed=2, num_inference_steps=2, **SIZE, **CFG))
    out_b = eng.generate({"b": req_b})["b"]
    eng.runner.max_batch_tasks = 0
    together = eng.generate({"a": req_a, "b": req_b})
    assert eng.runner.max_batch_tasks == 2              # the two edits really shared forwards
    assert max_pixel_diff(together["a"].images[0], out_a.images[0]) <= 2
    assert max_pixel_diff(together["b"].images[0], out_b.images[0]) <= 2
    assert max_pixel_diff(together["a"].images[0], together["b"].images[0]) > 2


def test_default_size_follows_input_aspect_and_image_is_required(edit):
    _, eng = edit
    task = eng.family.new_task("s", {"prompt": "x", "image": _image(40, 24)}, DiffusionParams())
    assert (task.params.width, task.params.height) == (1312, 800)   # 1024^2 pixels at 40:24, multiples of 32
    with pytest.raises(ValueError, match="image"):
        eng.add_request("no-image", {"prompt": "x"}, DiffusionParams(**SIZE))
    with pytest.raises(ValueError, match="image"):
        eng.add_request("two", {"prompt": "x", "images": [_image(), _image()]}, DiffusionParams(**SIZE))
    assert eng.takes_image and not eng.has_unfinished()
