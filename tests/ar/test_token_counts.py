"""The device-side token counts of penalized sequences (ar/token_counts.py), kept incrementally from
each step's sampled ids, equal the per-row formula over the sequences' histories at every step:
many steps, sampled and greedy rows, repetition / presence / frequency penalties mixed with rows
without any, async scheduling (queued ids), a KV pool small enough to preempt (recomputed
sequences keep their counts), an aborted request, and slots reused by later requests."""

from collections import Counter

import torch
from penalty_testutil import penalized

from omnistage.ar import runner as runner_mod
from omnistage.ar.engine import AREngine
from omnistage.ar.sampler import _apply_penalties
from omnistage.ar.token_counts import TokenCounts
from omnistage.config import EngineConfig
from omnistage.models.loader import load_causal_lm
from omnistage.params import SamplingParams

WORKLOAD = [
    ("rep", "Rain again", SamplingParams(max_tokens=30, temperature=0.9, seed=1, repetition_penalty=1.3,
                                         ignore_eos=True)),
    ("freq", "The harbour town", SamplingParams(max_tokens=26, temperature=1.0, seed=2, frequency_penalty=0.4,
                                                presence_penalty=0.3, ignore_eos=True)),
    ("both", "A quiet morning", SamplingParams(max_tokens=28, temperature=0, repetition_penalty=0.8,
                                               frequency_penalty=0.2, ignore_eos=True)),
    ("plain", "Numbers:", SamplingParams(max_tokens=24, temperature=0.7, seed=4, ignore_eos=True)),
    ("aborted", "Long road ahead", SamplingParams(max_tokens=40, temperature=0, presence_penalty=0.5,
                                                  ignore_eos=True)),
]
LATER = [("late", "Once upon a time", SamplingParams(max_tokens=12, temperature=0.8, seed=5,
                                                     repetition_penalty=1.2, ignore_eos=True))]


def test_incremental_counts_equal_the_history_formula_through_preemption(tiny_models, monkeypatch):
    checks = []                                 # (sequences, their lengths then, batch, logits) per sampled step
    prepare, sample = TokenCounts.prepare, runner_mod.sample

    def watched_prepare(self, seqs, flags, pending):
        checks.append([list(seqs), [len(q.token_ids) for q in seqs]])
        return prepare(self, seqs, flags, pending)

    def watched_sample(logits, batch, *args):
        if batch.token_counts is not None:
            checks[-1] += [batch, logits.clone()]
        return sample(logits, batch, *args)

    monkeypatch.setattr(TokenCounts, "prepare", watched_prepare)
    monkeypatch.setattr(runner_mod, "sample", watched_sample)
    cfg = EngineConfig(device="cpu", dtype="float32", block_size=4, num_kv_blocks=26, max_num_seqs=8)
    engine = AREngine(tiny_models["llama"], cfg, loader=load_causal_lm)
    for rid, prompt, params in WORKLOAD:
        engine.add_request(rid, prompt, params)
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None
        steps += 1
        if steps == 7:
            engine.abort("aborted")
        if steps == 12:                         # takes a slot another request gave back
            for rid, prompt, params in LATER:
                engine.add_request(rid, prompt, params)
    assert engine.scheduler.num_preemptions > 0 and engine._steps > 30
    assert not engine.runner.counts.slots    # every slot was freed

    for seqs, lengths, batch, logits in checks:
        # the ids each row had then, read now that every queued placeholder holds its real id
        prompts = [q.token_ids[:q.prompt_len] for q in seqs]
        outputs = [q.token_ids[q.prompt_len:n] for q, n in zip(seqs, lengths)]
        prompt_seen, counts = batch.token_counts
        for i, p in enumerate(batch.params):
            if not p.needs_penalties:
                assert not prompt_seen[i].any() and not counts[i].any()
                continue
            want = torch.zeros(counts.shape[1])
            for t, k in Counter(outputs[i]).items():
                want[t] = k
            assert torch.equal(counts[i], want)
            assert set(prompt_seen[i].nonzero().flatten().tolist()) == set(prompts[i])
        assert torch.allclose(_apply_penalties(logits.clone(), batch), penalized(logits, batch.params, prompts, outputs),
                              atol=1e-6)
