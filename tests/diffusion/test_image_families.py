"""Each image family on a tiny fp32 checkpoint: our engine's pixels equal diffusers' `pipe()` for the
same prompt / settings / seed; several requests batched together equal each run alone and really
share forwards; aborts take effect between steps."""

from __future__ import annotations

import pytest
import torch

from omnistage.config import EngineConfig
from omnistage.diffusion.engine import DiffusionEngine
from omnistage.models.registry import diffusion_family
from omnistage.params import DiffusionParams

from diffusion_testutil import max_pixel_diff, reference_pipe

# kind -> (pipe() kwargs, DiffusionParams kwargs, inputs extras) for one CFG-on reference run
CASES = {
    "qwen-image": (dict(true_cfg_scale=3.0, negative_prompt="blurry"), dict(true_cfg_scale=3.0),
                   {"negative_prompt": "blurry"}),
    "flux": (dict(guidance_scale=4.5), dict(guidance_scale=4.5), {}),
    "flux-schnell": (dict(guidance_scale=0.0), dict(), {}),
    "sd3": (dict(guidance_scale=5.0, negative_prompt="blurry"), dict(guidance_scale=5.0),
            {"negative_prompt": "blurry"}),
    "z-image": (dict(guidance_scale=4.0, negative_prompt="blurry"), dict(guidance_scale=4.0),
                {"negative_prompt": "blurry"}),
}
SIZE = dict(height=32, width=32)
ENGINES: dict[str, DiffusionEngine] = {}


def engine(tiny_dir, kind: str) -> DiffusionEngine:
    if kind not in ENGINES:
        ENGINES[kind] = DiffusionEngine(tiny_dir(kind), diffusion_family(tiny_dir(kind)),
                                        EngineConfig(device="cpu", dtype="float32", max_num_seqs=8))
    return ENGINES[kind]


@pytest.mark.parametrize("kind", list(CASES))
def test_matches_diffusers_pipeline(tiny_dir, kind):
    pipe_kw, params_kw, extra = CASES[kind]
    pipe = reference_pipe(tiny_dir(kind))
    ref = pipe(prompt="a red cube on a table", num_inference_steps=3,
               generator=torch.Generator("cpu").manual_seed(11), **SIZE, **pipe_kw).images[0]
    eng = engine(tiny_dir, kind)
    out = eng.generate({"r": ({"prompt": "a red cube on a table", **extra},
                              DiffusionParams(seed=11, num_inference_steps=3, **SIZE, **params_kw))})["r"]
    assert out.finished and len(out.images) == 1 and out.progress == 1.0
    assert out.images[0].size == (32, 32)
    assert max_pixel_diff(out.images[0], ref) <= 2


@pytest.mark.parametrize("kind", list(CASES))
def test_batched_requests_equal_each_alone(tiny_dir, kind):
    _, params_kw, extra = CASES[kind]
    eng = engine(tiny_dir, kind)
    reqs = {
        "a": ({"prompt": "a red cube", **extra}, DiffusionParams(seed=1, num_inference_steps=2, **SIZE, **params_kw)),
        "b": ({"prompt": "two green spheres in the rain", **extra},
              DiffusionParams(seed=2, num_inference_steps=4, **SIZE, **params_kw)),
        "c": ({"prompt": "a blue sky", **extra}, DiffusionParams(seed=3, num_inference_steps=3, **SIZE, **params_kw)),
    }
    alone = {rid: eng.generate({rid: r})[rid] for rid, r in reqs.items()}
    eng.runner.max_batch_tasks = 0
    together = eng.generate(reqs)
    assert eng.runner.max_batch_tasks == 3          # the three really shared forwards
    for rid in reqs:
        assert max_pixel_diff(together[rid].images[0], alone[rid].images[0]) <= 2, rid
    assert max_pixel_diff(together["a"].images[0], together["b"].images[0]) > 2


def test_num_outputs_per_prompt_matches_diffusers(tiny_dir):
    pipe = reference_pipe(tiny_dir("flux"))
    refs = pipe(prompt="a cat", num_inference_steps=2, num_images_per_prompt=2, guidance_scale=3.0,
                generator=torch.Generator("cpu").manual_seed(5), **SIZE).images
    out = engine(tiny_dir, "flux").generate(
        {"r": ("a cat", DiffusionParams(seed=5, num_inference_steps=2, guidance_scale=3.0,
                                        num_outputs_per_prompt=2, **SIZE))})["r"]
    assert len(out.images) == 2
    for ours, ref in zip(out.images, refs):
        assert max_pixel_diff(ours, ref) <= 2


def test_abort_between_steps_and_progress(tiny_dir):
    eng = engine(tiny_dir, "flux")
    eng.add_request("keep", "a cat", DiffusionParams(seed=1, num_inference_steps=4, **SIZE))
    eng.add_request("drop", "a dog", DiffusionParams(seed=2, num_inference_steps=4, **SIZE))
    first = {o.request_id: o for o in eng.step()}
    assert first["keep"].output.progress == pytest.approx(0.25) and not first["keep"].finished
    eng.abort("drop")
    finals = {}
    while eng.has_unfinished():
        for o in eng.step():
            assert o.request_id != "drop" or o.finish_reason == "abort"
            if o.finished:
                finals[o.request_id] = o
    assert finals["drop"].finish_reason == "abort" and not finals["drop"].output.images
    assert finals["keep"].output.images and finals["keep"].finish_reason == "stop"
    assert eng.stats()["num_running"] == 0


def test_bad_sizes_are_rejected_with_the_field_name(tiny_dir):
    eng = engine(tiny_dir, "flux")
    with pytest.raises(ValueError, match="height"):
        eng.add_request("x", "a cat", DiffusionParams(height=30, width=32))
    with pytest.raises(ValueError, match="width"):
        eng.add_request("y", "a cat", DiffusionParams(height=32, width=100000))
    with pytest.raises(ValueError, match="height"):
        eng.check_params(DiffusionParams(height=33))
    eng.check_params(DiffusionParams(height=64, width=32))
    assert not eng.has_unfinished()


def test_mixed_resolutions_interleave_and_match_alone(tiny_dir):
    eng = engine(tiny_dir, "flux")
    reqs = {"small": ("a cat", DiffusionParams(seed=4, num_inference_steps=3, height=32, width=32)),
            "wide": ("a cat", DiffusionParams(seed=4, num_inference_steps=3, height=32, width=48)),
            "small2": ("a dog", DiffusionParams(seed=5, num_inference_steps=3, height=32, width=32))}
    alone = {rid: eng.generate({rid: r})[rid] for rid, r in reqs.items()}
    eng.runner.max_batch_tasks = 0
    together = eng.generate(reqs)
    assert eng.runner.max_batch_tasks == 2            # the two 32x32 share; 32x48 runs in its own forwards
    assert together["wide"].images[0].size == (48, 32)
    for rid in reqs:
        assert max_pixel_diff(together[rid].images[0], alone[rid].images[0]) <= 2, rid


def test_scheduler_module_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, omnistage.diffusion.scheduler; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
