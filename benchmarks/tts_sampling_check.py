"""The code predictor's sampling kernel on the GPU (prints a table; exits 1 when ids differ).

`layers/triton_sampling.py` (one Triton program per row: top-k, top-p and the exponential-race draw
from a sort in registers) against its PyTorch reference `predictor.pick_ref` (torch.topk of the 50
largest + masks + softmax, what the CPU tests run) on the same logits and noise, at the 1.7B code
predictor's codebook (V = 2048): ids equal at 1, 8 and 64 rows with top-k 50 and top-p 1.0 / 0.8;
then us per call of each under a CUDA graph (15 calls per replay: a frame's sub-steps, as the
predictor's frame graph runs them).

    PYTHONPATH=. python benchmarks/tts_sampling_check.py
"""

from __future__ import annotations

import sys
import time

import torch


def _time(fn, reps: int = 20) -> float:
    """ms per call of fn (after one warm-up call)."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t) / reps


def check_sampling() -> int:
    """The code predictor's sampling kernel (`layers/triton_sampling.py`) against its reference
    `predictor.pick_ref` (torch.topk of the 50 largest + masks) on the same logits and noise: ids equal at
    1, 8, 64 rows (V = 2048, the 1.7B codebook), top-k 50 with top-p 1.0 and 0.8; then us per call
    under a CUDA graph (how the frame graph runs them), kernel vs reference."""
    from omnistage.layers.triton_sampling import pick_top_k_top_p
    from omnistage.models.qwen3_tts.predictor import pick_ref

    bad = 0
    g = torch.Generator(device="cuda").manual_seed(0)
    print("| rows | top-p | ids equal | kernel us | reference us |")
    print("|---|---|---|---|---|")
    for n in (1, 8, 64):
        for top_p in (1.0, 0.8):
            logits = torch.randn(n, 2048, device="cuda", generator=g) * 3
            temp = torch.full((n,), 0.9, device="cuda")
            top_k = torch.full((n,), 50, device="cuda", dtype=torch.long)
            top_ps = torch.full((n,), top_p, device="cuda")
            noise = torch.empty(n, 2048, device="cuda").exponential_(generator=g)
            ref = pick_ref(logits, temp, top_k, top_ps, noise, k_most=50)
            got = pick_top_k_top_p(logits, temp, top_k, top_ps, noise)
            equal = bool(torch.equal(got, ref))
            bad += not equal
            times = []
            for fn in (lambda: pick_top_k_top_p(logits, temp, top_k, top_ps, noise),
                       lambda: pick_ref(logits, temp, top_k, top_ps, noise, k_most=50)):
                graph = torch.cuda.CUDAGraph()
                fn()
                torch.cuda.synchronize()
                with torch.cuda.graph(graph):
                    for _ in range(15):             # a frame's sub-steps
                        fn()
                times.append(1e3 * _time(graph.replay) / 15)
            print(f"| {n} | {top_p} | {equal} | {times[0]:.1f} | {times[1]:.1f} |")
    return bad


if __name__ == "__main__":
    sys.exit(1 if check_sampling() else 0)
