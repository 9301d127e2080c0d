"""GPU check of the decode graphs' lm_head + argmax (ar/cuda_graphs.py) on mixed batches.

A tiny random fp32 Llama runs one mixed workload: plain greedy rows (their ids come from the
graph's argmax when a step has nothing else), and rows that need the full sampler (logprobs,
a repetition penalty, min_tokens bans, a seeded sampled row with a stop string, n=2), which send
their steps through `sampler.sample` over the graph's logits. It runs with graphs (async scheduling
on and off) against the same device without graphs (every request: ids, text, finish reasons,
largest logprob difference), and the eager run against the CPU (greedy rows: the CPU's random
numbers differ). Exit status 1 when any differ.

    PYTHONPATH=$PWD python benchmarks/ar_graph_head_check.py [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from omnistage.params import SamplingParams

WORKLOAD = {
    **{f"greedy{i}": (p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
       for i, p in enumerate(["Hello", "café naïve 日本語", "One two three four five six seven"])},
    "logprobs": ("The harbour town", SamplingParams(max_tokens=12, temperature=0, logprobs=3, ignore_eos=True)),
    "penalty": ("Rain again", SamplingParams(max_tokens=16, temperature=0, repetition_penalty=1.3, ignore_eos=True)),
    "banned": ("Numbers:", SamplingParams(max_tokens=10, min_tokens=6, temperature=0)),
    "stop": ("Once upon a time", SamplingParams(max_tokens=20, temperature=0.8, seed=3, stop=["e"])),
    "n2": ("A quiet morning", SamplingParams(max_tokens=14, temperature=1.0, seed=11, n=2)),
}


def run(path: str, device: str, **cfg) -> dict:
    from omnistage.ar.engine import AREngine
    from omnistage.config import EngineConfig
    from omnistage.models.loader import load_causal_lm

    engine = AREngine(path, EngineConfig(device=device, dtype="float32", block_size=8, max_num_seqs=16, **cfg),
                      loader=load_causal_lm)
    for rid, (prompt, params) in WORKLOAD.items():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.output
    return done


def compare(got: dict, ref: dict, rids) -> tuple[bool, float]:
    same, worst = True, 0.0
    for rid in rids:
        for a, b in zip(got[rid].outputs, ref[rid].outputs):
            same &= (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (b.token_ids, b.text, b.finish_reason,
                                                                              b.stop_reason)
            for x, y in zip(a.logprobs or (), b.logprobs or ()):
                worst = max(worst, abs(x.chosen.logprob - y.chosen.logprob))
    return same, worst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    from omnistage.testing.llm import make_tiny_lm

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_lm(tmp, "llama")
        eager = run(path, args.device, cuda_graphs=False)       # the reference: the same device, no graphs
        cpu = run(path, "cpu")
        unseeded = [rid for rid, (_, p) in WORKLOAD.items() if p.greedy]   # the CPU draws other random numbers
        rows = {"graphs, async vs eager": (run(path, args.device), eager, list(WORKLOAD)),
                "graphs, sync vs eager": (run(path, args.device, async_scheduling=False), eager, list(WORKLOAD)),
                "eager vs CPU (greedy rows)": (eager, cpu, unseeded)}
        ok = True
        print(f"\n| {args.device}, tiny Llama fp32, mixed batch | ids, text, finish equal | max logprob diff |")
        print("|---|---|---|")
        for name, (got, ref, rids) in rows.items():
            same, worst = compare(got, ref, rids)
            ok &= same
            print(f"| {name} | {same} | {worst:.2e} |")
    sys.exit(0 if ok else 1)

if __name__ == "__main__":
    main()
