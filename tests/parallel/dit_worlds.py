"""One parallel DiT world per call, for tests/parallel/test_dit_parallel.py.

In: a tiny diffusers folder, its kind ("flux" | "wan") and a `parallel_config` dict. Out: what the
test asserts on -- the other ranks alive, the largest batched forward, each request's final latents
and uint8 pixels, and (asked for) the `ParamError` of a size that does not split.

Which process runs it: `run_world` runs in a worker of the test module's process pool (spawned, not
daemonic), which is rank 0 of the world (scheduler, solver, decode); the engine spawns ranks 1..N-1
from there. Two workers run two worlds at once: starting a world is mostly one rank importing torch
and diffusers on one core, so the 2-core CI machine's other core would otherwise wait. The
one-process reference (`generate` on an engine without `parallel_config`) runs in the test process.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from omnistage.config import EngineConfig
from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.pipelines.flux import FluxFamily
from omnistage.diffusion.pipelines.wan import WanFamily
from omnistage.params import DiffusionParams, ParamError

ATOL = 5e-5
FAMILIES = {"flux": FluxFamily, "wan": WanFamily}
# FLUX runs true CFG (negative prompt + true_cfg_scale), Wan classic CFG: CFG-parallel has two branches
PARAMS = {"flux": DiffusionParams(height=16, width=16, num_inference_steps=2, seed=1, true_cfg_scale=2.0),
          "wan": DiffusionParams(height=16, width=16, num_frames=5, num_inference_steps=2, seed=1,
                                 guidance_scale=3.0)}
# two requests with different prompts and seeds, batched in one forward
PROMPTS = {"a": {"prompt": "a red cat", "negative_prompt": "blurry"},
           "b": {"prompt": "a blue dog", "negative_prompt": "dark"}}
SEEDS = {"a": 1, "b": 7}


def engine(folder: str, kind: str, parallel: Optional[dict] = None) -> DiffusionEngine:
    return DiffusionEngine(folder, FAMILIES[kind], EngineConfig(device="cpu", dtype="float32",
                                                                parallel_config=parallel))


def _keep_latents(eng: DiffusionEngine) -> dict:
    """request id -> rank 0's final latents, recorded right before the VAE from now on."""
    latents = {}
    decode = eng.family.decode_batch

    def keep(tasks):
        for task in tasks:
            latents[task.request_id] = task.latents.clone()
        return decode(tasks)

    eng.family.decode_batch = keep
    return latents


def _pixels(out) -> np.ndarray:
    return np.asarray(out.video.frames if out.video is not None else out.images[0]).astype(np.int16)


def generate(eng: DiffusionEngine, kind: str) -> dict:
    """request id -> (final latents, images / frames as uint8) for the two batched requests."""
    latents = _keep_latents(eng)
    out = eng.generate({rid: (PROMPTS[rid], PARAMS[kind].clone(seed=SEEDS[rid])) for rid in PROMPTS})
    return {rid: (latents[rid], _pixels(o)) for rid, o in out.items()}


def _generate_with_omni(folder: str, parallel: dict) -> dict:
    """The user-facing form, `Omni(model, parallel_config=...)`: what `run_world` returns."""
    from omnistage.entrypoints.omni import Omni

    with Omni(folder, device="cpu", dtype="float32", parallel_config=parallel) as omni:
        eng = omni.orchestrator.stages["dit"]
        alive = eng.ranks is not None and eng.ranks.workers.alive()
        latents = _keep_latents(eng)
        outs = omni.generate([PROMPTS[rid] for rid in PROMPTS],
                             [PARAMS["flux"].clone(seed=SEEDS[rid]) for rid in PROMPTS], use_tqdm=False)
        batch = eng.runner.max_batch_tasks
    results = {rid: (latents[out.request_id], _pixels(out)) for rid, out in zip(PROMPTS, outs)}
    return {"alive": alive, "max_batch_tasks": batch, "results": results, "split_error": None}


def run_world(folder: str, kind: str, parallel: dict, via_omni: bool = False, split_check: bool = False) -> dict:
    """Start the world, generate the two requests, close it. Returns {"alive": the other ranks were
    running, "max_batch_tasks": largest forward (tasks), "results": request id -> (latents, pixels),
    "split_error": (field, message) of the ParamError for a size that does not split (split_check),
    None when it was not asked or not raised}."""
    if via_omni:
        return _generate_with_omni(folder, parallel)
    eng = engine(folder, kind, parallel)
    try:
        alive = eng.ranks is not None and eng.ranks.workers.alive()
        results = generate(eng, kind)
        split_error = None
        if split_check:     # 3 latent frames x 2 x 2 patches = 12 tokens: splits; 1 x 1 x 1 does not
            try:
                eng.check_params(PARAMS[kind].clone(height=4, width=4, num_frames=1))
            except ParamError as e:
                split_error = (e.field, str(e))
        return {"alive": alive, "max_batch_tasks": eng.runner.max_batch_tasks, "results": results,
                "split_error": split_error}
    finally:
        eng.close()


def assert_equal(got: dict, want: dict) -> None:
    """Same latents (ATOL) and pixels (one uint8 level) per request as the one-process run."""
    for rid, (latents, pixels) in want.items():
        torch.testing.assert_close(got[rid][0], latents, atol=ATOL, rtol=0)
        assert np.abs(got[rid][1] - pixels).max() <= 1
