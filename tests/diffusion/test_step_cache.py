"""Step caches (tea_cache, cache_dit) and the VAE options on tiny fp32 checkpoints (CPU).

A threshold of 0 gives pixels identical to an engine without a cache; a threshold skips steps
(counted per request and in `stats()`) and stays close to the uncached image; requests with
different cache settings batched into shared forwards equal each run alone; with the cache
installed every family still equals diffusers' `pipe()`. VAE: tiling equals diffusers' tiled
decode; requests finishing together decode in one VAE call and equal each decoded alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnistage.config import EngineConfig
from omnistage.diffusion.engine import DiffusionEngine
from omnistage.models.registry import diffusion_family
from omnistage.params import DiffusionParams, ParamError

from diffusion_testutil import frames_uint8, max_pixel_diff, reference_pipe

SIZE = dict(height=32, width=32)
OFF = {"tea_cache": {"rel_l1_thresh": 0.0}, "cache_dit": {"residual_diff_threshold": 0.0}}
# settings under which the tiny random models skip most steps (their changes between steps are small)
ON = {"tea_cache": {"rel_l1_thresh": 1.0}, "cache_dit": {"residual_diff_threshold": 1.0, "max_warmup_steps": 1}}
ENGINES: dict[tuple, DiffusionEngine] = {}


def engine(tiny_dir, kind: str, **options) -> DiffusionEngine:
    key = (kind, repr(sorted(options.items())))
    if key not in ENGINES:
        path = tiny_dir(kind)
        ENGINES[key] = DiffusionEngine(path, diffusion_family(path),
                                       EngineConfig(device="cpu", dtype="float32", **options))
    return ENGINES[key]


def pixels(out) -> np.ndarray:
    return np.asarray(out.video.frames if out.video is not None else out.images[0])


def run(eng, prompt="a red cube", **params):
    return eng.generate({"r": (prompt, DiffusionParams(**{**SIZE, **params}))})["r"]


@pytest.mark.parametrize("backend", ["tea_cache", "cache_dit"])
@pytest.mark.parametrize("kind", ["flux", "wan2.2"])   # wan2.2: two experts, the cache restarts at the switch
def test_threshold_zero_equals_no_cache_exactly(tiny_dir, kind, backend):
    extra = {"num_frames": 5} if kind.startswith("wan") else {}
    plain = run(engine(tiny_dir, kind), seed=3, num_inference_steps=4, **extra)
    cached = run(engine(tiny_dir, kind, cache_backend=backend), seed=3, num_inference_steps=4,
                 cache_config=OFF[backend], **extra)
    assert cached.metrics.cached_steps == 0
    assert np.array_equal(pixels(cached), pixels(plain))


@pytest.mark.parametrize("backend", ["tea_cache", "cache_dit"])
def test_threshold_skips_steps_counted_and_stays_close(tiny_dir, backend):
    plain = run(engine(tiny_dir, "flux"), seed=4, num_inference_steps=6)
    eng = engine(tiny_dir, "flux", cache_backend=backend, cache_config=ON[backend])   # server-wide setting
    before = eng.stats()["num_cached_steps"]
    cached = run(eng, seed=4, num_inference_steps=6)
    assert 0 < cached.metrics.cached_steps < 6
    assert eng.stats()["num_cached_steps"] - before == cached.metrics.cached_steps
    assert max_pixel_diff(pixels(cached), pixels(plain)) <= 10       # of 255: close, not equal (lossy)
    assert not eng.cache.states                                       # per-request state left with the request


@pytest.mark.parametrize("backend", ["tea_cache", "cache_dit"])
def test_different_settings_batched_together_equal_each_alone(tiny_dir, backend):
    eng = engine(tiny_dir, "flux", cache_backend=backend)
    reqs = {"skips": ("a red cube", DiffusionParams(seed=1, num_inference_steps=6, cache_config=ON[backend], **SIZE)),
            "exact": ("two green spheres", DiffusionParams(seed=2, num_inference_steps=4, cache_config=OFF[backend],
                                                           **SIZE)),
            "default": ("a blue sky", DiffusionParams(seed=5, num_inference_steps=5, **SIZE))}
    alone = {rid: eng.generate({rid: r})[rid] for rid, r in reqs.items()}
    eng.runner.max_batch_tasks = 0
    together = eng.generate(reqs)
    assert eng.runner.max_batch_tasks == 3                            # they shared forwards
    assert together["skips"].metrics.cached_steps > 0 and together["exact"].metrics.cached_steps == 0
    for rid in reqs:
        assert together[rid].metrics.cached_steps == alone[rid].metrics.cached_steps, rid
        assert max_pixel_diff(pixels(together[rid]), pixels(alone[rid])) <= 2, rid


FAMILIES = {   # kind -> (pipe() kwargs, DiffusionParams kwargs, prompt extras) with CFG on
    "qwen-image": (dict(true_cfg_scale=3.0, negative_prompt="blurry"), dict(true_cfg_scale=3.0),
                   {"negative_prompt": "blurry"}),
    "flux": (dict(guidance_scale=4.5), dict(guidance_scale=4.5), {}),
    "sd3": (dict(guidance_scale=5.0, negative_prompt="blurry"), dict(guidance_scale=5.0), {"negative_prompt": "blurry"}),
    "z-image": (dict(guidance_scale=4.0, negative_prompt="blurry"), dict(guidance_scale=4.0),
                {"negative_prompt": "blurry"}),
    "wan": (dict(guidance_scale=5.0, negative_prompt="blurry", num_frames=5, output_type="np"),
            dict(guidance_scale=5.0, num_frames=5), {"negative_prompt": "blurry"}),
}


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_every_family_with_the_cache_installed_equals_diffusers_and_skips(tiny_dir, kind):
    pipe_kw, params_kw, extra = FAMILIES[kind]
    out = reference_pipe(tiny_dir(kind))(prompt="a red cube", num_inference_steps=3,
                                         generator=torch.Generator("cpu").manual_seed(11), **SIZE, **pipe_kw)
    ref = frames_uint8(out.frames[0]) if kind == "wan" else out.images[0]
    eng = engine(tiny_dir, kind, cache_backend="tea_cache")
    prompt = {"prompt": "a red cube", **extra}
    ours = eng.generate({"r": (prompt, DiffusionParams(seed=11, num_inference_steps=3, cache_config=OFF["tea_cache"],
                                                       **SIZE, **params_kw))})["r"]
    assert max_pixel_diff(pixels(ours), ref) <= 2
    skipping = eng.generate({"s": (prompt, DiffusionParams(seed=11, num_inference_steps=5, cache_config=ON["tea_cache"],
                                                           **SIZE, **params_kw))})["s"]
    assert skipping.metrics.cached_steps > 0 and pixels(skipping).shape == pixels(ours).shape


def test_bad_cache_settings_name_the_option(tiny_dir):
    eng = engine(tiny_dir, "flux", cache_backend="tea_cache")
    with pytest.raises(ParamError, match=r"cache_config.rel_l1_thresh must be a number in \[0, 10\]") as e:
        eng.check_params(DiffusionParams(cache_config={"rel_l1_thresh": 11}))
    assert e.value.field == "cache_config.rel_l1_thresh"
    with pytest.raises(ParamError, match="allowed: rel_l1_thresh, coefficients"):
        eng.add_request("x", "a cat", DiffusionParams(cache_config={"residual_diff_threshold": 0.1}))
    with pytest.raises(ParamError, match="needs a server started with a cache backend"):
        engine(tiny_dir, "flux").check_params(DiffusionParams(cache_config={"rel_l1_thresh": 0.1}))
    dit = engine(tiny_dir, "flux", cache_backend="cache_dit")
    with pytest.raises(ParamError, match="below the denoiser's"):
        dit.check_params(DiffusionParams(cache_config={"Fn_compute_blocks": 2, "Bn_compute_blocks": 1}))
    assert not eng.has_unfinished() and not eng.cache.states
    with pytest.raises(ValueError, match="cache_backend must be one of tea_cache, cache_dit"):
        EngineConfig(cache_backend="teacache")
    with pytest.raises(ValueError, match="cache_config.max_warmup_steps must be an integer"):
        EngineConfig(cache_backend="cache_dit", cache_config={"max_warmup_steps": 0.5})


def test_vae_tiling_equals_diffusers_tiled_decode(tiny_dir):
    big = dict(height=64, width=64)             # latents 32x32 > the tiny VAE's 16-latent tile: tiles really run
    pipe = reference_pipe(tiny_dir("flux"))
    pipe.vae.enable_tiling()
    ref = pipe(prompt="a red cube", num_inference_steps=2, generator=torch.Generator("cpu").manual_seed(7),
               guidance_scale=3.0, **big).images[0]
    params = DiffusionParams(seed=7, num_inference_steps=2, guidance_scale=3.0, **big)
    tiled = engine(tiny_dir, "flux", vae_use_tiling=True).generate({"r": ("a red cube", params)})["r"]
    untiled = engine(tiny_dir, "flux").generate({"r": ("a red cube", params)})["r"]
    assert max_pixel_diff(pixels(tiled), ref) <= 2
    assert max_pixel_diff(pixels(tiled), pixels(untiled)) > 0          # the option took effect


@pytest.mark.parametrize("kind", ["flux", "wan"])
def test_requests_finishing_together_decode_in_one_vae_call(tiny_dir, kind):
    eng = engine(tiny_dir, kind)
    extra = {"num_frames": 5} if kind == "wan" else {}
    reqs = {rid: (prompt, DiffusionParams(seed=seed, num_inference_steps=2, num_outputs_per_prompt=n, **SIZE, **extra))
            for rid, prompt, seed, n in (("a", "a red cube", 1, 1), ("b", "a dog", 2, 1 if kind == "wan" else 2),
                                         ("c", "a hat", 3, 1))}
    alone = {rid: eng.generate({rid: r})[rid] for rid, r in reqs.items()}
    calls, decode = [], eng.family.decode_batch
    eng.family.decode_batch = lambda tasks: calls.append(len(tasks)) or decode(tasks)
    try:
        together = eng.generate(reqs)
    finally:
        del eng.family.decode_batch
    assert calls == [3]
    for rid in reqs:
        ours = [together[rid].video.frames] if kind == "wan" else together[rid].images
        ref = [alone[rid].video.frames] if kind == "wan" else alone[rid].images
        assert len(ours) == len(ref) == reqs[rid][1].num_outputs_per_prompt
        for a, b in zip(ours, ref):
            assert max_pixel_diff(a, b) <= 1, rid
