"""The AR sampler on CUDA: the top-k candidate race against the full-vocabulary path, checked and timed.

    python benchmarks/sampling_bench.py

For rows like Qwen2.5-Omni's talker (vocab 8448: temperature 0.9, top-k 40, top-p 0.8, repetition
penalty 1.05, 255 banned ids, seeded) and a text LM's (vocab 151936, top-k 50, top-p 0.9), at 1 / 8 / 64 /
256 rows: (1) the ids `sampler.sample` draws on the GPU (candidate race, one Triton launch) equal the
CPU reference's (`race_candidates_ref` over the same logits and keys) and the full-vocabulary path's
(sort-based top-k / top-p over every token, then the race over the whole row); (2) host microseconds
per call and GPU microseconds per call (CUDA events over 50 calls) of both paths.
"""

import time

import numpy as np
import torch

from omnistage.ar.sampler import SamplingBatch, _filter, candidates, sample
from omnistage.layers.triton_sampling import exp_noise, race_candidates_ref, row_keys
from omnistage.params import SamplingParams


def full_path(logits, b):
    probs = _filter(logits, b).softmax(-1)
    return (probs / exp_noise(torch.from_numpy(b.keys).to(logits.device), logits.shape[1])).argmax(-1)


def timed(fn, n=50):
    if not torch.cuda.is_available():           # a CPU smoke run: host time only
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6, float("nan")
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host, start.elapsed_time(end) / n * 1e3


def main():
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = ["| rows | vocab | params | candidate ids = CPU ref | = full path | candidate host us | candidate GPU us "
            "| full host us | full GPU us |", "|---|---|---|---|---|---|---|---|---|"]
    cases = [("talker", 8448, SamplingParams(temperature=0.9, top_k=40, top_p=0.8, seed=1,
                                              bad_token_ids=list(range(8193, 8448)))),
             ("text", 151936, SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=1))]
    for name, vocab, p in cases:
        for s in (1, 8, 64, 256):
            if dev.type == "cpu" and s > 8:
                continue
            g = torch.Generator(device=dev).manual_seed(s)
            logits = torch.randn(s, vocab, device=dev, generator=g) * 3
            params = [p.clone(seed=i) for i in range(s)]
            keys = row_keys(list(range(s)), [5] * s)
            banned = [p.bad_token_ids] * s
            b = SamplingBatch(params, keys=keys, banned=banned)
            assert candidates(params, vocab) == 40 if name == "talker" else 50
            got = sample(logits.clone(), b).token_ids
            masked = logits.clone()
            if p.bad_token_ids:
                masked[:, p.bad_token_ids] = float("-inf")
            cpu = masked.cpu()
            temp = torch.tensor([q.temperature for q in params])
            vals, ids = (cpu / temp[:, None]).topk(candidates(params, vocab), dim=-1)
            ref = race_candidates_ref(vals, ids, torch.tensor([q.top_k for q in params]),
                                      torch.tensor([q.top_p for q in params]), torch.zeros(s), torch.from_numpy(keys))
            full = full_path(masked, b)
            same_ref = int((got.cpu() == ref).sum())
            same_full = int((got == full).sum())
            ch, cg = timed(lambda: sample(logits, b))
            fh, fg = timed(lambda: full_path(masked, b))
            rows.append(f"| {s} | {vocab} | {name} | {same_ref}/{s} | {same_full}/{s} | {ch:.0f} | {cg:.0f} | "
                        f"{fh:.0f} | {fg:.0f} |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
