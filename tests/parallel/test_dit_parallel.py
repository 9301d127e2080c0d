"""DiT parallelism on CPU ranks over gloo (fp32): Ulysses, Ring, Ulysses x Ring, CFG-parallel and DiT
tensor parallel each give the one-process engine's latents for the same seeds, on the tiny FLUX and Wan
checkpoints; bad options are refused at start-up naming the option.

Each parallel engine is the real `DiffusionEngine` with `parallel_config`: this test process is rank 0
(scheduler, solver, decode), the other ranks are spawned processes that load the same folder. Two
requests with different prompts and seeds run batched in one forward. Tolerance: 5e-5 absolute on
latents of magnitude ~3 (sums in another order; measured ~1e-6), images within one uint8 level.
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


def _generate(engine: DiffusionEngine, kind: str) -> dict:
    """request id -> (final latents, images / frames as uint8) for two batched requests."""
    latents = {}
    decode = engine.family.decode_batch

    def keep(tasks):                      # observe rank 0's latents right before the VAE
        for task in tasks:
            latents[task.request_id] = task.latents.clone()
        return decode(tasks)

    engine.family.decode_batch = keep
    p = PARAMS[kind]
    out = engine.generate({"a": ({"prompt": "a red cat", "negative_prompt": "blurry"}, p),
                           "b": ({"prompt": "a blue dog", "negative_prompt": "dark"}, p.clone(seed=7))})
    pixels = {rid: np.asarray(o.video.frames if o.video is not None else o.images[0]).astype(np.int16)
              for rid, o in out.items()}
    return {rid: (latents[rid], pixels[rid]) for rid in out}


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


CASES = [("flux", {"ulysses_degree": 2}), ("flux", {"ring_degree": 2}), ("flux", {"cfg_parallel_size": 2}),
         ("flux", {"tensor_parallel_size": 2}),
         ("wan", {"ulysses_degree": 2}), ("wan", {"ring_degree": 2}), ("wan", {"cfg_parallel_size": 2}),
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
    want = reference(kind)
    for rid, (latents, pixels) in want.items():
        torch.testing.assert_close(got[rid][0], latents, atol=ATOL, rtol=0)
        assert np.abs(got[rid][1] - pixels).max() <= 1


def test_sizes_that_do_not_split_are_refused(tiny_dir):
    engine = _engine(tiny_dir, "wan", {"ulysses_degree": 2})
    try:
        with pytest.raises(ParamError) as err:     # 3 latent frames x 2 x 2 patches = 12 tokens: splits;
            engine.check_params(PARAMS["wan"].clone(height=4, width=4, num_frames=1))   # 1 x 1 x 1 does not
        assert err.value.field == "height" and "ulysses_degree x ring_degree = 2" in str(err.value)
    finally:
        engine.close()


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
    """The user-facing form: `Omni(model, parallel_config=...)` gives the one-process images."""
    from omnistage.entrypoints.omni import Omni

    p = PARAMS["flux"]
    with Omni(tiny_dir("flux"), device="cpu", dtype="float32", parallel_config={"ulysses_degree": 2}) as omni:
        assert omni.orchestrator.stages["dit"].ranks.workers.alive()
        outs = omni.generate([{"prompt": "a red cat", "negative_prompt": "blurry"},
                              {"prompt": "a blue dog", "negative_prompt": "dark"}], [p, p.clone(seed=7)],
                             use_tqdm=False)
    want = reference("flux")
    for rid, out in zip("ab", outs):
        assert np.abs(np.asarray(out.images[0]).astype(np.int16) - want[rid][1]).max() <= 1
