"""Paged decode attention (`layers/triton_attention.py`, one launch) on one GPU: error, time per call, floor.

Run on the GPU machine:  PYTHONPATH=$PWD python benchmarks/decode_attn_bench.py   (~30 s on an H200)

Shape: the Qwen3-Omni-30B-A3B thinker's attention (32 query / 4 KV heads of 128, KV blocks of 16 tokens),
bf16, random cache and queries, each row's blocks scattered. Per (batch, context) it prints the max abs
error against the SDPA reference path (`attention.attend` with Triton off) beside the reference's peak,
the us per call replayed from a CUDA graph for each variant -- runs of >= 1 or 2 blocks merged by the
combine launch, one program over the whole context -- and the floor: the K and V bytes read at 4 TB/s.
"""

from __future__ import annotations

import torch

from omnistage.layers import fused, triton_attention
from omnistage.layers.attention import AttentionMetadata, attend

H, KVH, D, BS = 32, 4, 128, 16
BATCHES = (1, 8, 64)
CONTEXTS = (64, 256, 1024, 4096)
# (label, min_run): runs of >= 1 or 2 blocks, or one program over the whole context
VARIANTS = (("combine", 1), ("comb r2", 2), ("one prog", 1 << 20))
CALLS = 16                                      # calls per graph


def per_call_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / CALLS)
    return sorted(times)[len(times) // 2]


def main() -> None:
    torch.manual_seed(0)
    dev = "cuda"
    print(f"{'batch':>5} {'ctx':>5} {'err':>8} {'peak':>6} "
          + " ".join(f"{label:>9}" for label, _ in VARIANTS) + f" {'floor':>6}  (us, CUDA graphs)")
    for b in BATCHES:
        for ctx in CONTEXTS:
            width = -(-ctx // BS)
            cache = torch.randn(2, b * width + 1, BS, KVH, D, device=dev, dtype=torch.bfloat16)
            tables = torch.randperm(b * width, device=dev)[:b * width].view(b, width)
            ctx_lens = torch.full((b,), ctx, device=dev, dtype=torch.long)
            q = torch.randn(b, H, D, device=dev, dtype=torch.bfloat16)
            meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long, device=dev), num_decodes=b,
                                     decode_block_tables=tables, decode_ctx_lens=ctx_lens)
            saved, saved_triton = fused.ENABLED, triton_attention.triton
            fused.ENABLED, triton_attention.triton = False, None
            try:
                ref = attend(q, q, q, cache, meta, D ** -0.5)
            finally:
                fused.ENABLED, triton_attention.triton = saved, saved_triton
            got = triton_attention.paged_decode_attention(q, cache, tables, ctx_lens, D ** -0.5)
            err = (got.float() - ref.float()).abs().max().item()
            times = [per_call_us(lambda r=r: triton_attention.paged_decode_attention(
                q, cache, tables, ctx_lens, D ** -0.5, r)) for _, r in VARIANTS]
            floor_us = b * ctx * KVH * D * 2 * 2 / 4e12 * 1e6
            print(f"{b:>5} {ctx:>5} {err:>8.1e} {ref.float().abs().max().item():>6.2f} "
                  + " ".join(f"{t:>9.2f}" for t in times) + f" {floor_us:>6.2f}")
    print(f"(default MIN_RUN = {triton_attention.MIN_RUN})")


if __name__ == "__main__":
    main()
