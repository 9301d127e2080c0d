"""AR tensor parallelism on CPU over gloo: TP=2 greedy ids equal TP=1 (fp32) for tiny Llama / Qwen2 /
Qwen3 (through the engine and through `Omni`) and the tiny Qwen2.5-Omni thinker (token ids, and prompt
embeddings with multimodal-rope positions); sizes that cannot work fail at start-up naming
tensor_parallel_size; a killed rank fails the stage's requests with an error naming it (no hang).

Each TP=2 engine starts a second process (slow on the 2-core machine). The engine-level comparisons
(`tp_worlds.both`) run in a one-worker process pool, submitted by the module's first test, so they
start while this process runs the server and `Omni` ones; the shared `Omni` serves the equality and
the killed-rank tests (the latter last among its users).
"""

import multiprocessing as mp
import os
import signal
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch
from tp_worlds import GREEDY, PROMPTS, both, engine, run

from omnistage.ar.engine import AREngine
from omnistage.config import EngineConfig
from omnistage.models.loader import load_causal_lm
from omnistage.params import SamplingParams
from omnistage.stage import ARPrompt

WORLD_TIMEOUT_S = 900           # one TP=1 + TP=2 comparison on a loaded 2-core machine


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory):
    from omnistage.testing.qwen2_5_omni import make_tiny_qwen2_5_omni

    return make_tiny_qwen2_5_omni(str(tmp_path_factory.mktemp("omni") / "tiny-qwen2_5_omni"))


def _thinker_prompts() -> list:
    """Token ids, and a prompt of embedding rows with 3-D rope positions (rank 0 broadcasts the rows)."""
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(6, 64, generator=g)
    mrope = torch.tensor([[0, 1, 2, 2, 2, 3], [0, 1, 2, 3, 3, 4], [0, 1, 2, 2, 3, 5]])
    return [[5, 17, 33, 48, 2, 9, 11],
            ARPrompt(prompt_token_ids=[1] * 6, prompt_embeds=embeds, mrope_positions=mrope, mrope_delta=-1)]


@pytest.fixture(scope="module")
def worlds(tiny_models, omni_dir):
    """name -> the future of its `both` results (TP=1 and TP=2 engines in a pool worker)."""
    from omnistage.models.qwen2_5_omni.stages import load_thinker

    pool = ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn"))
    # A small KV pool for Qwen3: sequences are preempted and re-allocated (their tables cross again whole)
    stories = [f"Story number {i}: once upon a time there was a small robot who" for i in range(6)]
    try:
        yield {"qwen3": pool.submit(both, tiny_models["qwen3"], stories,
                                    params=SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                                    block_size=4, num_kv_blocks=24, enable_prefix_caching=False),
               "qwen2": pool.submit(both, tiny_models["qwen2"], PROMPTS),
               "thinker": pool.submit(both, omni_dir, _thinker_prompts(), load_thinker)}
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _both(worlds, name: str) -> dict:
    got = worlds[name].result(timeout=WORLD_TIMEOUT_S)
    assert got["ranks"] and got["num_heads"] == 2       # rank 0 holds half of the 4 heads
    return got


@pytest.mark.slow
def test_server_tp2_completions_equal_tp1(worlds, tiny_models):
    """`AsyncOmni(..., tensor_parallel_size=2)` behind the real app on loopback, asked by the openai client.
    (Asks for `worlds` first, so that the engine-level comparisons start in the pool meanwhile.)"""
    from live_server import live_server
    from openai import OpenAI

    from omnistage.entrypoints.async_omni import AsyncOmni
    from omnistage.entrypoints.openai.api_server import build_app

    one = engine(tiny_models["llama"], 1)
    one.add_request("r", PROMPTS[1], GREEDY)
    want = []
    while one.has_unfinished():
        want += [o.output.outputs[0].text for o in one.step() if o.finished]
    omni = AsyncOmni(tiny_models["llama"], device="cpu", dtype="float32", tensor_parallel_size=2)
    try:
        with live_server(build_app(omni, "tiny-tp"), timeout=120) as url:
            client = OpenAI(base_url=f"{url}/v1", api_key="x", timeout=120)
            got = client.completions.create(model="tiny-tp", prompt=PROMPTS[1], max_tokens=12, temperature=0)
        assert [got.choices[0].text] == want
    finally:
        omni.close()


@pytest.fixture(scope="module")
def omni_tp2(tiny_models):
    from omnistage.entrypoints.omni import Omni

    omni = Omni(tiny_models["llama"], device="cpu", dtype="float32", tensor_parallel_size=2, block_size=8,
                max_num_batched_tokens=16)
    yield omni
    omni.close()


def _stage(omni) -> AREngine:
    return omni.orchestrator.stages[omni.orchestrator.spec.main_stage.name]


def test_omni_tp2_greedy_equals_tp1_llama(omni_tp2, tiny_models):
    want = run(engine(tiny_models["llama"], 1), PROMPTS)
    outs = omni_tp2.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert _stage(omni_tp2).runner.ranks.workers.alive()


def test_killed_rank_fails_requests_with_its_name(omni_tp2):
    """Last on the shared Omni: kills rank 1 mid-stream; the requests fail naming it, at once after."""
    eng = _stage(omni_tp2)
    proc = eng.runner.ranks.workers.procs[0]
    eng.add_request("k", "Hello", SamplingParams(max_tokens=50, temperature=0))
    eng.step()
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(60)
    with pytest.raises(Exception, match=r"rank\(s\) \[1\] died"):
        omni_tp2.generate(["Hello again"], GREEDY, use_tqdm=False)
    with pytest.raises(Exception, match=r"rank\(s\) \[1\] died"):
        omni_tp2.generate(["and again"], GREEDY, use_tqdm=False)


@pytest.mark.slow
def test_engine_tp2_greedy_equals_tp1_qwen2(worlds):
    got = _both(worlds, "qwen2")
    assert got["got"] == got["want"]


@pytest.mark.slow
def test_engine_tp2_greedy_equals_tp1_qwen3_with_preemption(worlds):
    """A small KV pool: sequences are preempted and re-allocated (their tables cross again whole)."""
    got = _both(worlds, "qwen3")
    assert got["got"] == got["want"] and got["num_preemptions"] > 0


@pytest.mark.slow
def test_qwen2_5_omni_thinker_tp2_equals_tp1(worlds):
    """Token ids, and a prompt of embedding rows with 3-D rope positions (rank 0 broadcasts the rows)."""
    got = _both(worlds, "thinker")
    assert got["got"] == got["want"]


def test_bad_sizes_name_the_option(tiny_models):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide num_attention_heads=4.*\[1, 2, 4\]"):
        engine(tiny_models["llama"], 3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs 2 CUDA devices.*tensor_parallel_size <= "):
            AREngine(tiny_models["llama"], EngineConfig(device="cuda", dtype="float32", tensor_parallel_size=2),
                     loader=load_causal_lm)


def test_cli_flag_reaches_the_engine_config():
    from omnistage.entrypoints.cli import _check_engine_options, build_parser
    from omnistage.entrypoints.common import engine_kwargs_from_args

    args = build_parser().parse_args(["serve", "m", "--tensor-parallel-size", "2"])
    assert engine_kwargs_from_args(args)["tensor_parallel_size"] == 2
    with pytest.raises(SystemExit, match="tensor_parallel_size must be >= 1"):
        _check_engine_options(build_parser().parse_args(["serve", "m", "--tensor-parallel-size", "0"]))
