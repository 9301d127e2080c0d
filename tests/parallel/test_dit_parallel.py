"""DiT parallelism on CPU ranks over gloo (fp32): Ulysses, Ring, Ulysses x Ring, CFG-parallel and DiT
tensor parallel each give the one-process engine's latents for the same seeds, on the tiny FLUX and Wan
checkpoints; bad options are refused at start-up naming the option.

Each parallel engine is the real `DiffusionEngine` with `parallel_config`: this test process is rank 0
(scheduler, solver, decode), the other ranks are spawned processes that load the same folder. Two
requests with different prompts and seeds run batched in one forward. Tolerance: 5e-5 absolute on
latents of magnitude ~3 (sums in another order; measured ~1e-6), images within one uint8 level.

Starting a world of ranks is what costs here (each rank imports torch and diffusers on the 2-core
machine), so each world is started once and checked for everything it can show: FLUX x Ulysses 2
is checked through `Omni` (the user-facing form), Wan x Ulysses 2 also refuses a size that does not
split.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnistage.config import DiffusionParallelConfig, EngineConfig
from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.pipelines.flux import FluxFamily
from omnistage.diffusion.pipelines.sd3 import SD3Family
from omnistage.diffusion.pipelines.wan import WanFamily
from omnistage.params import DiffusionParams, ParamError

ATOL = 5e-5
FAMILIES = {"flux": FluxFamily, "wan": WanFamily}
# FLUX runs true CFG (negative prompt + true_cfg_scale), Wan classic CFG: CFG-parallel has two branches
PARAMS = {"flux": DiffusionParams(height=16, width=16, num_inference_steps=2, seed=1, true_cfg_scale=2.0),
          "wan": DiffusionParams(height=16, width=16, num_frames=5, num_inference_steps=2, seed=1,
                                 guidance_scale=3.0)}


PROMPTS = {"a": {"prompt": "a red cat", "negative_prompt": "blurry"},
           "b": {"prompt": "a blue dog", "negative_prompt": "dark"}}
SEEDS = {"a": 1, "b": 7}


def _keep_latents(engine: DiffusionEngine) -> dict:
    """request id -> rank 0's final latents, recorded right before the VAE from now on."""
    latents = {}
    decode = engine.family.decode_batch

    def keep(tasks):
        for task in tasks:
            latents[task.request_id] = task.latents.clone()
        return decode(tasks)

    engine.family.decode_batch = keep
    return latents


def _pixels(out) -> np.ndarray:
    return np.asarray(out.video.frames if out.video is not None else out.images[0]).astype(np.int16)


def _generate(engine: DiffusionEngine, kind: str) -> dict:
    """request id -> (final latents, images / frames as uint8) for two batched requests."""
    latents = _keep_latents(engine)
    out = engine.generate({rid: (PROMPTS[rid], PARAMS[kind].clone(seed=SEEDS[rid])) for rid in PROMPTS})
    return {rid: (latents[rid], _pixels(o)) for rid, o in out.items()}


def _assert_equal(got: dict, want: dict) -> None:
    """Same latents (ATOL) and pixels (one uint8 level) per request as the one-process run."""
    for rid, (latents, pixels) in want.items():
        torch.testing.assert_close(got[rid][0], latents, atol=ATOL, rtol=0)
        assert np.abs(got[rid][1] - pixels).max() <= 1


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """tiny_dir(kind) -> folder of that tiny diffusers checkpoint, built once for this module."""
    from omnistage.testing.diffusion import DIFFUSION_TINY_BUILDERS

    built = {}

    def get(kind):
        if kind not in built:
            built[kind] = DIFFUSION_TINY_BUILDERS[kind](str(tmp_path_factory.mktemp(kind)))
        return built[kind]

    return get


def _engine(tiny_dir, kind: str, parallel=None) -> DiffusionEngine:
    return DiffusionEngine(tiny_dir(kind), FAMILIES[kind],
                           EngineConfig(device="cpu", dtype="float32", parallel_config=parallel))


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """kind -> the one-process engine's results."""
    done = {}

    def get(kind):
        if kind not in done:
            done[kind] = _generate(_engine(tiny_dir, kind), kind)
        return done[kind]

    return get


# (FLUX and Wan with {"ulysses_degree": 2}: test_omni_parallel_config, test_wan_ulysses_...)
CASES = [("flux", {"ring_degree": 2}), ("flux", {"cfg_parallel_size": 2}), ("flux", {"tensor_parallel_size": 2}),
         ("wan", {"ring_degree": 2}), ("wan", {"cfg_parallel_size": 2}),
         ("wan", {"tensor_parallel_size": 2}),
         ("flux", {"ulysses_degree": 2, "ring_degree": 2}), ("wan", {"ulysses_degree": 2, "ring_degree": 2})]


@pytest.mark.parametrize("kind,parallel", CASES, ids=[f"{k}-" + "-".join(f"{n.split('_')[0]}{v}" for n, v in p.items())
                                                      for k, p in CASES])
def test_parallel_equals_one_process(tiny_dir, reference, kind, parallel):
    engine = _engine(tiny_dir, kind, parallel)
    try:
        assert engine.ranks is not None and engine.ranks.workers.alive()
        got = _generate(engine, kind)
        assert engine.runner.max_batch_tasks == 2            # both requests shared each forward
    finally:
        engine.close()
    _assert_equal(got, reference(kind))


def test_wan_ulysses_equals_one_process_and_refuses_sizes_that_do_not_split(tiny_dir, reference):
    engine = _engine(tiny_dir, "wan", {"ulysses_degree": 2})
    try:
        assert engine.ranks is not None and engine.ranks.workers.alive()
        got = _generate(engine, "wan")
        assert engine.runner.max_batch_tasks == 2
        with pytest.raises(ParamError) as err:     # 3 latent frames x 2 x 2 patches = 12 tokens: splits;
            engine.check_params(PARAMS["wan"].clone(height=4, width=4, num_frames=1))   # 1 x 1 x 1 does not
        assert err.value.field == "height" and "ulysses_degree x ring_degree = 2" in str(err.value)
    finally:
        engine.close()
    _assert_equal(got, reference("wan"))


@pytest.mark.parametrize("kind,parallel,words", [
    ("flux", {"ulysses_degree": 4}, "ulysses_degree x tensor_parallel_size = 4 must divide"),
    ("wan", {"tensor_parallel_size": 3}, "must divide"),
    ("flux", {"ring_degree": 3}, "must divide the 512 tokens"),
])
def test_sizes_the_model_cannot_take_are_refused(tiny_dir, kind, parallel, words):
    with pytest.raises(ValueError, match=words):
        _engine(tiny_dir, kind, parallel)


def test_family_without_a_plan_is_refused(tiny_dir):
    with pytest.raises(ValueError, match=r"ulysses_degree=2: SD3Family does not support it .* set ulysses_degree=1"):
        DiffusionEngine(tiny_dir("sd3"), SD3Family, EngineConfig(device="cpu", dtype="float32",
                                                                 parallel_config={"ulysses_degree": 2}))


@pytest.mark.parametrize("options,words", [
    (dict(parallel_config={"ulysses": 2}), "unknown keys"),
    (dict(parallel_config={"cfg_parallel_size": 3}), "cfg_parallel_size must be 1 or 2"),
    (dict(parallel_config={"ring_degree": 0}), "ring_degree must be an integer >= 1"),
    (dict(parallel_config={"ulysses_degree": 2}, cache_backend="tea_cache"), "cannot run with cache_backend"),
])
def test_bad_options(options, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig(**options)
    assert DiffusionParallelConfig(2, 2, 2, 1).world_size == 8


def test_omni_parallel_config(tiny_dir, reference):
    """The user-facing form: `Omni(model, parallel_config=...)` (FLUX, Ulysses 2) gives the one-process
    engine's latents and images, both requests batched in each forward."""
    from omnistage.entrypoints.omni import Omni

    with Omni(tiny_dir("flux"), device="cpu", dtype="float32", parallel_config={"ulysses_degree": 2}) as omni:
        engine = omni.orchestrator.stages["dit"]
        assert engine.ranks is not None and engine.ranks.workers.alive()
        latents = _keep_latents(engine)
        outs = omni.generate([PROMPTS[rid] for rid in PROMPTS],
                             [PARAMS["flux"].clone(seed=SEEDS[rid]) for rid in PROMPTS], use_tqdm=False)
        assert engine.runner.max_batch_tasks == 2
    got = {rid: (latents[out.request_id], _pixels(out)) for rid, out in zip(PROMPTS, outs)}
    _assert_equal(got, reference("flux"))
