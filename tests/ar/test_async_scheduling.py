"""Async scheduling (ar/engine.py): queueing step N+1 before step N's ids are read changes no
output. The same mixed workload runs with `async_scheduling` on and off (tiny random Llama, CPU,
fp32): greedy and seeded sampling, stop strings, min/max tokens, n > 1, a penalty request (queued
ahead too: the queued id is read on the device), a request aborted mid-way, a KV pool small enough
to preempt; and conditioned sequences (prompt embeddings, streamed rows, hidden-state reports)."""

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


def _run_conditioned(path, async_on: bool, num_kv_blocks=None) -> tuple[dict, dict, int, int]:
    """A talker-like and a thinker-like workload on one engine: prompt embeddings with rows streamed
    in as the answer runs (some steps wait for them), hidden-state reports, a repetition penalty and
    seeded sampling. Returns (request -> token ids, request -> every reported hidden row, steps
    overlapped, preemptions)."""
    import torch

    from omnistage.stage import ARPrompt, ExtraRows

    cfg = EngineConfig(device="cpu", dtype="float32", block_size=4, async_scheduling=async_on, max_num_seqs=8,
                       max_num_batched_tokens=16, num_kv_blocks=num_kv_blocks)
    engine = AREngine(path, cfg, loader=load_causal_lm)
    h = engine.model.embed_tokens.weight.shape[1]
    g = torch.Generator().manual_seed(0)
    rows = {rid: torch.randn(12, h, generator=g) * 0.5 for rid in ("talker-a", "talker-b")}
    pad = torch.randn(h, generator=g) * 0.5
    talker = SamplingParams(max_tokens=14, temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=2.0, seed=5,
                            ignore_eos=True)
    for i, rid in enumerate(rows):
        embeds = torch.randn(6 + i, h, generator=g)
        engine.add_request(rid, ARPrompt(prompt_token_ids=[1] * (6 + i), prompt_embeds=embeds, stream_extra=True),
                           talker)
        engine.add_input(rid, ExtraRows(rows[rid][:3]))
    engine.add_request("thinker", ARPrompt(prompt_token_ids=list(range(3, 40)), return_hidden_states=True),
                       SamplingParams(max_tokens=10, temperature=0, repetition_penalty=1.2))
    engine.add_request("plain", "The harbour town", SamplingParams(max_tokens=12, temperature=0, frequency_penalty=-2.0,
                                                                    presence_penalty=-2.0))
    finals, hidden, overlapped, step = {}, {}, 0, 0
    while engine.has_unfinished():
        step += 1
        if step % 3 == 0:                       # the streamed rows arrive a few at a time, the last with its pad
            for rid, r in rows.items():
                sent = engine.requests[rid].seqs[0].cond.num_extra if rid in engine.requests else len(r)
                if sent < len(r):
                    engine.add_input(rid, ExtraRows(r[sent:sent + 3], finished=sent + 3 >= len(r), pad=pad))
        for out in engine.step():
            assert out.error is None
            if out.hidden is not None:
                hidden.setdefault(out.request_id, []).append((out.hidden.start, out.hidden.hidden.clone()))
            if out.finished:
                finals[out.request_id] = out.output.outputs[0].token_ids
        overlapped += engine._pending is not None
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return finals, hidden, overlapped, engine.scheduler.num_preemptions


def test_conditioned_rows_with_async_scheduling_change_no_output(tiny_models):
    """Sequences with prompt embeddings, streamed rows, hidden-state reports and penalties are queued
    ahead too (the talker and thinker of an omni model), and give the same ids and hidden rows."""
    import torch

    sync, sync_hidden, none, _ = _run_conditioned(tiny_models["llama"], False)
    got, got_hidden, overlapped, _ = _run_conditioned(tiny_models["llama"], True)
    assert none == 0 and overlapped > 5
    assert got == sync and set(got) == {"talker-a", "talker-b", "thinker", "plain"}
    assert [s for s, _ in got_hidden["thinker"]] == [s for s, _ in sync_hidden["thinker"]]
    torch.testing.assert_close(torch.cat([t for _, t in got_hidden["thinker"]]),
                               torch.cat([t for _, t in sync_hidden["thinker"]]), rtol=0, atol=0)


def test_conditioned_rows_with_async_scheduling_and_preemption(tiny_models):
    """The same with a KV pool small enough to preempt: recomputed rows (prompt embeddings, streamed
    rows) give the same ids, and a preempted thinker reports every position's row."""
    import torch

    sync, sync_hidden, _, _ = _run_conditioned(tiny_models["llama"], False, num_kv_blocks=20)
    got, got_hidden, overlapped, preempted = _run_conditioned(tiny_models["llama"], True, num_kv_blocks=20)
    assert overlapped > 0 and preempted > 0 and got == sync
    # preemptions fall on other steps (a queued token holds a slot), so rows are reported again from
    # other positions; each position's row is the same
    rows = [_rows_by_position(h["thinker"]) for h in (got_hidden, sync_hidden)]
    assert rows[0].keys() == rows[1].keys() == set(range(37 + 9))
    for pos, row in rows[0].items():
        torch.testing.assert_close(row, rows[1][pos], rtol=1e-5, atol=1e-5)


def _rows_by_position(reports) -> dict:
    """position -> its hidden row, from (start, rows) reports (a recomputed position's last report)."""
    return {start + i: row for start, rows in reports for i, row in enumerate(rows)}


def test_penalties_read_a_queued_token_from_the_device():
    """A row whose output ends in the queued step's placeholder is penalized as if the host had its id."""
    import torch

    from penalty_testutil import counts_of

    from omnistage.ar.sampler import SamplingBatch, sample
    from omnistage.ar.sequence import PLACEHOLDER

    logits = torch.zeros(2, 16)
    logits[:, 5] = 1.0                          # token 5 wins unless it is penalized (it was the last one)
    params = [SamplingParams(temperature=0, repetition_penalty=2.0), SamplingParams(temperature=0, presence_penalty=2.0)]

    def pick(outputs, pending=None):
        batch = SamplingBatch(params, [None, None], token_counts=counts_of(params, [[1, 2], [1, 2]], outputs, 16,
                                                                         pending))
        return sample(logits.clone(), batch).token_ids.tolist()

    known = pick([[3, 5], [3, 5]])
    assert known != [5, 5]
    assert pick([[3, PLACEHOLDER], [3, PLACEHOLDER]], torch.tensor([5, 5])) == known
