"""Decode-size linears on one GPU: which call reads a bf16 weight fastest at M = 1..8 rows.

For the Qwen3-Omni thinker's attention linears (qkv 5120 x 2048, o 2048 x 4096) and the Qwen2.5-1.5B ones it
prints the GPU time of one call (20 calls on 20 distinct weights captured in one CUDA graph, so the weights
come from HBM, not L2, as in a decode step) for:
  linear  F.linear(x, W), W [N, K] (what the layers run today: cuBLAS picks its kernel, often split-K)
  mm_t    x @ Wt, Wt [K, N] contiguous (the transposed layout: cuBLAS' other kernel family)
  mv      torch.mv(W, x[0]) (M = 1 only: cuBLAS gemv)
  triton  layers/triton_gemv.gemv on the bf16 weight (its rule tiles)
beside the floor (weight bytes / copy bandwidth measured in the same run). No model code changes.

    PYTHONPATH=$PWD python benchmarks/linear_layouts.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gemv_bench import copy_bandwidth, graph_us

SHAPES = {"thinker qkv": (5120, 2048), "thinker o": (2048, 4096), "1.5B qkv": (2048, 1536), "1.5B o": (1536, 1536),
          "1.5B gate_up": (17920, 1536), "1.5B down": (1536, 8960)}
CALLS = 20


def main() -> None:
    from omnistage.layers import triton_gemv

    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    print("| linear (N x K) | M | linear us | mm_t us | mv us | triton us | floor us |")
    print("|---|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(CALLS)]
        wts = [w.t().contiguous() for w in ws]
        for m in (1, 2, 4, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"linear": graph_us(lambda i: F.linear(x, ws[i])),
                   "mm_t": graph_us(lambda i: x @ wts[i]),
                   "mv": graph_us(lambda i: torch.mv(ws[i], x[0])) if m == 1 else None,
                   "triton": graph_us(lambda i: triton_gemv.gemv(x, ws[i]))}
            ref = F.linear(x.float(), ws[0].float())
            err = max((x @ wts[0]).float().sub(ref).abs().max().item(), triton_gemv.gemv(x, ws[0]).float().sub(ref).abs().max().item())
            cells = " | ".join("-" if v is None else f"{v:.2f}" for v in row.values())
            print(f"| {name} ({n} x {k}) | {m} | {cells} | {2 * n * k / bw * 1e6:.2f} |  (max err {err:.1e})")
        del ws, wts
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
