"""DiT parallelism on CPU ranks over gloo (fp32): Ulysses, Ring, Ulysses x Ring, CFG-parallel and DiT
tensor parallel each give the one-process engine's latents for the same seeds, on the tiny FLUX and Wan
checkpoints; bad options are refused at start-up naming the option.

Each parallel engine is the real `DiffusionEngine` with `parallel_config`; its rank 0 (scheduler,
solver, decode) is a worker of this module's process pool, the other ranks are processes it spawns
that load the same folder (`dit_worlds.py`). Two requests with different prompts and seeds run
batched in one forward. Tolerance: 5e-5 absolute on latents of magnitude ~3 (sums in another order;
measured ~1e-6), images within one uint8 level.

Starting a world of ranks is what costs here (each rank imports torch and diffusers), so every world
starts once, as soon as the module's first test asks, two at a time (one per core), while this
process computes the references; each test then asserts on its world's results. Each world shows
all it can: FLUX x Ulysses 2 runs through `Omni` (the user-facing form), Wan x Ulysses 2 also
refuses a size that does not split.
"""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor

import pytest
from dit_worlds import assert_equal, engine, generate, run_world

from omnistage.config import DiffusionParallelConfig, EngineConfig
from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.pipelines.sd3 import SD3Family

WORLD_TIMEOUT_S = 900           # one world's start, generation and close on a loaded 2-core machine

# (kind, parallel_config); FLUX and Wan x Ulysses 2 run in test_omni_... and test_wan_ulysses_...
CASES = [("flux", {"ring_degree": 2}), ("flux", {"cfg_parallel_size": 2}), ("flux", {"tensor_parallel_size": 2}),
         ("wan", {"ring_degree": 2}), ("wan", {"cfg_parallel_size": 2}), ("wan", {"tensor_parallel_size": 2}),
         ("flux", {"ulysses_degree": 2, "ring_degree": 2}), ("wan", {"ulysses_degree": 2, "ring_degree": 2})]
OMNI = ("flux", {"ulysses_degree": 2})
SPLIT = ("wan", {"ulysses_degree": 2})


def _case_id(kind: str, parallel: dict) -> str:
    return f"{kind}-" + "-".join(f"{n.split('_')[0]}{v}" for n, v in parallel.items())


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


@pytest.fixture(scope="module")
def worlds(tiny_dir):
    """case id -> the future of its world's `run_world` results; all submitted at once, the 4-rank
    worlds first (the longest first finishes soonest in all)."""
    jobs = {_case_id(*OMNI): (*OMNI, True, False), _case_id(*SPLIT): (*SPLIT, False, True)}
    jobs.update({_case_id(k, p): (k, p, False, False) for k, p in CASES})
    order = sorted(jobs, key=lambda cid: -DiffusionParallelConfig(**jobs[cid][1]).world_size)
    pool = ProcessPoolExecutor(max_workers=2, mp_context=mp.get_context("spawn"))
    try:
        futures = {cid: pool.submit(run_world, tiny_dir(jobs[cid][0]), *jobs[cid]) for cid in order}
        yield futures
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """kind -> the one-process engine's results (computed here while the pool runs the worlds)."""
    done = {}

    def get(kind):
        if kind not in done:
            done[kind] = generate(engine(tiny_dir(kind), kind), kind)
        return done[kind]

    return get


def _world(worlds, kind: str, parallel: dict) -> dict:
    """Its world's results, checked for what every world must show."""
    got = worlds[_case_id(kind, parallel)].result(timeout=WORLD_TIMEOUT_S)
    assert got["alive"]                             # the other ranks ran
    assert got["max_batch_tasks"] == 2              # both requests shared each forward
    return got


@pytest.mark.parametrize("kind,parallel", CASES, ids=[_case_id(k, p) for k, p in CASES])
def test_parallel_equals_one_process(worlds, reference, kind, parallel):
    assert_equal(_world(worlds, kind, parallel)["results"], reference(kind))


def test_wan_ulysses_equals_one_process_and_refuses_sizes_that_do_not_split(worlds, reference):
    got = _world(worlds, *SPLIT)
    assert_equal(got["results"], reference("wan"))
    assert got["split_error"] is not None, "a 4x4, 1-frame Wan request was not refused under ulysses_degree=2"
    field, message = got["split_error"]
    assert field == "height" and "ulysses_degree x ring_degree = 2" in message


def test_omni_parallel_config(worlds, reference):
    """The user-facing form: `Omni(model, parallel_config=...)` (FLUX, Ulysses 2) gives the one-process
    engine's latents and images, both requests batched in each forward."""
    assert_equal(_world(worlds, *OMNI)["results"], reference("flux"))


@pytest.mark.parametrize("kind,parallel,words", [
    ("flux", {"ulysses_degree": 4}, "ulysses_degree x tensor_parallel_size = 4 must divide"),
    ("wan", {"tensor_parallel_size": 3}, "must divide"),
    ("flux", {"ring_degree": 3}, "must divide the 512 tokens"),
])
def test_sizes_the_model_cannot_take_are_refused(tiny_dir, kind, parallel, words):
    with pytest.raises(ValueError, match=words):
        engine(tiny_dir(kind), kind, parallel)


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
