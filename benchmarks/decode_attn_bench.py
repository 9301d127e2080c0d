"""Paged decode attention (`layers/triton_attention.py`) on one GPU: error, time per call, floor.

Run on the GPU machine:  PYTHONPATH=$PWD python benchmarks/decode_attn_bench.py   (~40 s on an H200)

Shapes, bf16, KV blocks of 16 tokens, random cache, qkv rows and rotary angles, each row's blocks scattered:
the Qwen3-Omni-30B-A3B thinker's attention (32 query / 4 KV heads of 128, q / k RMSNorm) and, in a second
table, Qwen2.5-1.5B's (12 / 2 heads of 128, no norm). Per (batch, context) the thinker table prints
  err / peak   `paged_decode_attention` (q rotated, cache written) vs the SDPA reference path
               (`attention.attend` with Triton off), beside the reference's largest value
  combine, comb r2, one prog   us per call of that kernel alone: runs of >= 1 or 2 KV blocks merged by the
               combine launch, one program over the whole context
  rot+dec      today's decode step before the fused entry: `fused.rotary_and_cache` (norms, rotary, KV write)
               then `paged_decode_attention`
  fused, ferr, cerr  `rope_decode_attention` (raw qkv rows: norms, rotary and KV write in the decode kernel)
               as OMNISTAGE_PDL says (`layers/pdl.py`, default on: decode and combine PDL-launched), `no pdl`
               the same with programmatic dependent launch off,
               and its max abs error vs `rotary_and_cache` + `attend` on the reference path: the output
               (its scale: `peak`) and the cache after (values ~N(0, 1), peak ~4.5: one bf16 step there is
               0.03; the reference rounds the rotation three times, the kernel once)
  floor        the K and V bytes read at 4 TB/s
Times are replayed from CUDA graphs (16 calls per graph, median of 5 replays). The dense table prints the
rot+dec, fused, ferr and cerr columns only.
"""

from __future__ import annotations

import torch

from omnistage.layers import fused, pdl, triton_attention
from omnistage.layers.attention import AttentionMetadata, attend, rope_attend
from omnistage.layers.norm import RMSNorm

BS = 16
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


def reference(fn):
    """fn() on the PyTorch reference path (fused kernels and the Triton decode off)."""
    saved, saved_triton = fused.ENABLED, triton_attention.triton
    fused.ENABLED, triton_attention.triton = False, None
    try:
        return fn()
    finally:
        fused.ENABLED, triton_attention.triton = saved, saved_triton


def without_pdl(fn):
    """fn() with programmatic dependent launch off."""
    saved, pdl.ENABLED = pdl.ENABLED, False
    try:
        return fn()
    finally:
        pdl.ENABLED = saved


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


class Case:
    """One (shape, batch, context): cache, tables, this step's raw qkv rows, rotary rows, norms, metadata."""

    def __init__(self, h: int, kvh: int, d: int, qk_norm: bool, b: int, ctx: int, dev: str = "cuda",
                 dtype: torch.dtype = torch.bfloat16):
        width = -(-ctx // BS)
        self.scale = d ** -0.5
        self.cache = torch.randn(2, b * width + 1, BS, kvh, d, device=dev, dtype=dtype)
        self.tables = torch.randperm(b * width, device=dev).view(b, width)
        self.ctx = torch.full((b,), ctx, device=dev, dtype=torch.long)
        qkv = torch.randn(b, (h + 2 * kvh) * d, device=dev, dtype=dtype)
        q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
        self.qkv = q.view(b, h, d), k.view(b, kvh, d), v.view(b, kvh, d)
        ang = 10 * torch.randn(b, d // 2, device=dev)
        self.rope = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        self.norms = (None, None)
        if qk_norm:
            self.norms = tuple(RMSNorm(d).to(dev, dtype) for _ in range(2))
            for n in self.norms:
                n.weight.data.uniform_(0.5, 1.5)
        slots = self.tables[:, (ctx - 1) // BS] * BS + (ctx - 1) % BS
        self.meta = AttentionMetadata(slot_mapping=slots, num_decodes=b, decode_block_tables=self.tables,
                                      decode_ctx_lens=self.ctx)

    def today(self, cache: torch.Tensor) -> torch.Tensor:
        q, k = fused.rotary_and_cache(*self.qkv, *self.rope, cache, self.meta.slot_mapping, *self.norms)
        return triton_attention.paged_decode_attention(q, cache, self.tables, self.ctx, self.scale)

    def fused(self, cache: torch.Tensor) -> torch.Tensor:
        return triton_attention.rope_decode_attention(*self.qkv, *self.rope, cache, self.meta.slot_mapping,
                                                      self.tables, self.ctx, self.scale, *self.norms)

    def fused_errors(self) -> tuple[float, float]:
        """Max abs error of the output and of the cache after, vs the reference path."""
        ref_cache, got_cache = self.cache.clone(), self.cache.clone()
        ref = reference(lambda: rope_attend(*self.qkv, *self.rope, ref_cache, self.meta, self.scale, *self.norms))
        return err(self.fused(got_cache), ref), err(got_cache, ref_cache)


def thinker_table() -> None:
    print("Qwen3-Omni thinker attention: 32 / 4 heads of 128, q/k norm, bf16")
    print(f"{'batch':>5} {'ctx':>5} {'err':>8} {'peak':>6} " + " ".join(f"{label:>9}" for label, _ in VARIANTS)
          + f" {'rot+dec':>8} {'fused':>7} {'no pdl':>7} {'ferr':>8} {'cerr':>8} {'floor':>6}  (us, CUDA graphs)")
    for b in BATCHES:
        for ctx in CONTEXTS:
            c = Case(32, 4, 128, True, b, ctx)
            q = c.qkv[0].contiguous()
            ref = reference(lambda: attend(q, q, q, c.cache, c.meta, c.scale))
            got = triton_attention.paged_decode_attention(q, c.cache, c.tables, c.ctx, c.scale)
            times = [per_call_us(lambda r=r: triton_attention.paged_decode_attention(
                q, c.cache, c.tables, c.ctx, c.scale, r)) for _, r in VARIANTS]
            today, fused_us = per_call_us(lambda: c.today(c.cache)), per_call_us(lambda: c.fused(c.cache))
            no_pdl = without_pdl(lambda: per_call_us(lambda: c.fused(c.cache)))
            floor_us = b * ctx * 4 * 128 * 2 * 2 / 4e12 * 1e6
            print(f"{b:>5} {ctx:>5} {err(got, ref):>8.1e} {ref.float().abs().max().item():>6.2f} "
                  + " ".join(f"{t:>9.2f}" for t in times)
                  + f" {today:>8.2f} {fused_us:>7.2f} {no_pdl:>7.2f} "
                  + " ".join(f"{e:>8.1e}" for e in c.fused_errors())
                  + f" {floor_us:>6.2f}")
    print(f"(default MIN_RUN = {triton_attention.MIN_RUN}; OMNISTAGE_PDL here: {pdl.ENABLED})")


def dense_table() -> None:
    print("Qwen2.5-1.5B attention: 12 / 2 heads of 128, no q/k norm, bf16")
    print(f"{'batch':>5} {'ctx':>5} {'rot+dec':>8} {'fused':>7} {'ferr':>8} {'cerr':>8} {'floor':>6}  (us, CUDA graphs)")
    for b in BATCHES:
        for ctx in CONTEXTS[1:3]:
            c = Case(12, 2, 128, False, b, ctx)
            today, fused_us = per_call_us(lambda: c.today(c.cache)), per_call_us(lambda: c.fused(c.cache))
            floor_us = b * ctx * 2 * 128 * 2 * 2 / 4e12 * 1e6
            print(f"{b:>5} {ctx:>5} {today:>8.2f} {fused_us:>7.2f} "
                  + " ".join(f"{e:>8.1e}" for e in c.fused_errors()) + f" {floor_us:>6.2f}")


def main() -> None:
    torch.manual_seed(0)
    thinker_table()
    dense_table()


if __name__ == "__main__":
    main()
