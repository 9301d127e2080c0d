"""Async scheduling (ar/engine.py): queueing step N+1 before step N's ids are read changes no
output. The same mixed workload runs with `async_scheduling` on and off (tiny random Llama, CPU,
fp32): greedy and seeded sampling, stop strings, min/max tokens, n > 1, a penalty request that
forces synchronous steps in between, a request aborted mid-way, a KV pool small enough to preempt."""

from omnistage.ar.engine import AREngine
from omnistage.config import EngineConfig
from omnistage.models.loader import load_causal_lm
from omnistage.params import SamplingParams

WORKLOAD = [
    ("greedy", "The harbour town", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)),
    ("seeded", "A quiet morning", SamplingParams(max_tokens=17, temperature=0.9, top_p=0.9, seed=7)),
    ("stop", "Once upon a time", SamplingParams(max_tokens=30, temperature=0.8, seed=3, stop=["e"])),
    ("n2", "The harbour town", SamplingParams(max_tokens=9, temperature=1.0, seed=11, n=2)),
    ("minmax", "Numbers:", SamplingParams(max_tokens=5, min_tokens=3, temperature=0)),
    ("penalty", "Rain again", SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.3)),
    ("aborted", "Long road ahead", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)),
]


def _run(path, async_on: bool, num_kv_blocks=None) -> tuple[dict, int, int]:
    cfg = EngineConfig(device="cpu", dtype="float32", block_size=4, async_scheduling=async_on,
                       num_kv_blocks=num_kv_blocks, max_num_seqs=8)
    engine = AREngine(path, cfg, loader=load_causal_lm)
    for rid, prompt, params in WORKLOAD:
        engine.add_request(rid, prompt, params)
    finals, steps, overlapped = {}, 0, 0
    while engine.has_unfinished():
        outs = engine.step()
        steps += 1
        overlapped += engine._pending is not None
        if steps == 6:
            engine.abort("aborted")
        for out in outs:
            assert out.error is None
            if out.finished:
                finals[out.request_id] = [(c.token_ids, c.text, c.finish_reason) for c in out.output.outputs]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks   # nothing leaked
    return finals, overlapped, engine.scheduler.num_preemptions


def test_async_scheduling_changes_no_output(tiny_models):
    sync, none, _ = _run(tiny_models["llama"], False)
    got, overlapped, _ = _run(tiny_models["llama"], True)
    assert none == 0 and overlapped > 5           # the async path really ran (not while "penalty" runs)
    assert got == sync
    assert "aborted" not in got and set(got) == {rid for rid, *_ in WORKLOAD} - {"aborted"}


def test_async_scheduling_with_preemption(tiny_models):
    sync, _, _ = _run(tiny_models["llama"], False, num_kv_blocks=24)
    got, overlapped, preempted = _run(tiny_models["llama"], True, num_kv_blocks=24)
    assert overlapped > 0 and preempted > 0 and got == sync


def test_a_last_token_by_max_tokens_gets_no_extra_step(tiny_models):
    """A sequence whose queued token is its last by max_tokens is not scheduled again: a
    one-token request costs one model step (its time to first token is not one step longer)."""
    for async_on in (False, True):
        cfg = EngineConfig(device="cpu", dtype="float32", async_scheduling=async_on)
        engine = AREngine(tiny_models["llama"], cfg, loader=load_causal_lm)
        engine.add_request("one", "The harbour town", SamplingParams(max_tokens=1, temperature=0))
        engine.add_request("three", "A quiet morning", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o.output for o in engine.step() if o.finished})
        assert engine._steps == 3 and len(done["three"].outputs[0].token_ids) == 3
