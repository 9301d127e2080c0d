"""Every Triton kernel of `omnistage.layers` against its PyTorch reference (any process, CPU or CUDA).

`kernel_errors(device)` -> {check name: [max abs error, largest |reference| value]}, on random inputs: the fused
elementwise kernels (`triton_fused`), the varlen prefill attention (`triton_prefill`, three
chunks with and without cached context after two decode rows, GQA; its own plan and a CUDA graph's
static one with empty chunks and padding tiles), the paged decode attention
(`triton_attention`, a batch and a lone row, also fed raw qkv rows: norms, rotary and KV write in the
kernel) and the 8-bit attention (`quant_attention`, 16-bit
dtypes). benchmarks/check_cuda.py runs
it on CUDA; tests/layers runs it on CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1`
set before triton is imported: `python -m omnistage.layers.kernel_check`), which cannot do
bfloat16 dots, so there the attention check takes float16.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
import torch.nn.functional as F

from omnistage.layers import fused, quant_attention, triton_attention, triton_fused, triton_prefill
from omnistage.layers.attention import AttentionMetadata, PrefillChunk, attend, rope_attend


class _Norm:
    """What the kernels read of an RMSNorm module."""

    def __init__(self, weight: torch.Tensor, eps: float = 1e-6):
        self.weight, self.eps = weight, eps


def _err(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    return [(a.float() - b.float()).abs().max().item(), b.float().abs().max().item()]


def _worst(*errs: list[float]) -> list[float]:
    return max(errs, key=lambda e: e[0] / e[1])


def kernel_errors(device: str, dtypes=(torch.float32, torch.bfloat16), attn_dtypes=None,
                  big: bool = False, decode_only: bool = False) -> dict[str, list[float]]:
    """[max abs error, largest |reference|] of each kernel vs its reference. `big` adds model-sized shapes (7B: hidden 3584,
    28 / 4 heads of 128); `decode_only`: the paged decode attention checks alone."""
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, dtype=torch.float32, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(dtype).to(device)

    errs: dict[str, list[float]] = {}
    heads = [(12, 2, 64, 16), (4, 4, 32, 8)] + ([(28, 4, 128, 16)] if big else [])
    for dtype in () if decode_only else dtypes:
        tag = str(dtype).split(".")[-1]
        n, inter = (3584, 18944) if big else (96, 80)
        x, r, w = rnd(7, n, dtype=dtype), rnd(7, n, dtype=dtype), 1 + rnd(n, dtype=dtype, scale=0.1)
        errs[f"rms_norm {tag}"] = _err(triton_fused.rms_norm(x, w, 1e-6), fused.rms_norm_ref(x, w, 1e-6))
        out, res = triton_fused.rms_norm(x, w, 1e-6, r)
        errs[f"rms_norm+residual {tag}"] = _worst(_err(out, fused.rms_norm_ref(x + r, w, 1e-6)), _err(res, x + r))
        gu = rnd(5, 2 * inter, dtype=dtype)
        gate, up = gu.chunk(2, dim=-1)
        errs[f"silu_and_mul {tag}"] = _err(triton_fused.silu_and_mul(gu), F.silu(gate) * up)
        for h, kvh, d, bs in heads:
            errs.update(_rotary_errors(h, kvh, d, bs, dtype, device, rnd, g))
    for dtype in attn_dtypes or dtypes:
        for h, kvh, d, bs in heads:
            key = f"prefill attention {str(dtype).split('.')[-1]} H{h}/{kvh} D{d} bs{bs}"
            if not decode_only:
                errs[key] = _prefill_error(h, kvh, d, bs, dtype, device, rnd, g)
            if bs >= 16:                                  # the decode kernel's tensor-core dots need it
                key = f"decode attention {str(dtype).split('.')[-1]} H{h}/{kvh} D{d} bs{bs}"
                errs[key] = _decode_error(h, kvh, d, bs, dtype, device, rnd, g)
                for norm in (False, True):
                    errs[f"rope decode attention{'+qk_norm' if norm else ''} {key[17:]}"] = _rope_decode_error(
                        h, kvh, d, bs, dtype, device, rnd, g, norm)
        if dtype in (torch.float16, torch.bfloat16) and not decode_only:    # 8-bit attention: P and V are 16-bit by design
            q, k, v = (rnd(2, 3, 150, 64, dtype=dtype) for _ in range(3))
            q8, sq, k8, sk = quant_attention.quantize(q, k)
            got = torch.ops.omnistage.sage_fwd(q8, sq, k8, sk, v, 0.125)
            errs[f"sage attention {str(dtype).split('.')[-1]} D64"] = _err(got, quant_attention.reference(q, k, v))
    return errs


def _rotary_errors(h, kvh, d, bs, dtype, device, rnd, g) -> dict[str, list[float]]:
    t = 9
    qkv = rnd(t, (h + 2 * kvh) * d, dtype=dtype)
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)      # strided views, as the model passes them
    q, k, v = q.view(t, h, d), k.view(t, kvh, d), v.view(t, kvh, d)
    ang = 10 * rnd(t, d // 2)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    tag = str(dtype).split(".")[-1]
    errs = {}
    for norm in (False, True):
        qn, kn = (_Norm(1 + rnd(d, dtype=dtype, scale=0.1)), _Norm(1 + rnd(d, dtype=dtype, scale=0.1))) \
            if norm else (None, None)
        caches = [torch.zeros(2, 4, bs, kvh, d, dtype=dtype, device=device) for _ in range(2)]
        slots = torch.randperm(4 * bs, generator=g)[:t].to(device)
        got = triton_fused.rotary_and_cache(q, k, v, cos, sin, caches[0], slots, qn, kn)
        qr, kr = (fused.rms_norm_ref(q, qn.weight, qn.eps), fused.rms_norm_ref(k, kn.weight, kn.eps)) if norm else (q, k)
        qr, kr = fused.rotary_ref(qr, kr, cos, sin)
        fused.write_kv(caches[1], kr, v, slots)
        key = f"rotary_and_cache{'+qk_norm' if norm else ''} {tag} H{h}/{kvh} D{d}"
        errs[key] = _worst(_err(got[0], qr), _err(got[1], kr), _err(caches[0], caches[1]))
    return errs


def _decode_error(h, kvh, d, bs, dtype, device, rnd, g) -> list[float]:
    """Paged decode attention of a 5-row batch and of one row alone (the split counts differ: a lone
    row spreads its context over more programs, leaving some splits empty) vs the SDPA path: contexts of
    one run (stored by their program) and of several (merged by the combine launch), runs of >= 1 and 2
    blocks; the lone row also with one program over its whole context (`min_run` 16)."""
    nb = 40
    cache = rnd(2, nb, bs, kvh, d, dtype=dtype)
    ctx = torch.tensor([1, 7, bs, 2 * bs + 1, 13 * bs - 3], device=device)
    tables = torch.stack([torch.randperm(nb, generator=g)[:13] for _ in range(5)]).to(device)
    q = rnd(5, h, d, dtype=dtype)
    worst = []
    for rows, min_run in ((slice(0, 5), 1), (slice(4, 5), 1), (slice(0, 5), 2), (slice(4, 5), 16)):
        meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long, device=device),
                                 num_decodes=q[rows].shape[0], decode_block_tables=tables[rows],
                                 decode_ctx_lens=ctx[rows])
        saved, fused.ENABLED = fused.ENABLED, False
        saved_triton, triton_attention.triton = triton_attention.triton, None
        try:
            ref = attend(q[rows], q[rows], q[rows], cache, meta, d ** -0.5)
        finally:
            fused.ENABLED, triton_attention.triton = saved, saved_triton
        got = triton_attention.paged_decode_attention(q[rows], cache, tables[rows], ctx[rows], d ** -0.5, min_run)
        worst.append(_err(got, ref))
    return _worst(*worst)


def _rope_decode_error(h, kvh, d, bs, dtype, device, rnd, g, norm: bool) -> list[float]:
    """`triton_attention.rope_decode_attention` (raw qkv rows -> q / k norms, rotary, KV write, decode attention)
    vs `fused.rotary_and_cache` + `attend` on the reference path: the output and the cache after, for the
    contexts and splits of `_decode_error` but `min_run` 2 (the new token first in its block, alone in its
    split, a context of one token). Each row its own blocks: a row's new slot is in no other row's context."""
    nb, width = 70, 13
    qkv = rnd(5, (h + 2 * kvh) * d, dtype=dtype)
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q, k, v = q.view(5, h, d), k.view(5, kvh, d), v.view(5, kvh, d)
    ang = 10 * rnd(5, d // 2)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    qn, kn = (_Norm(1 + rnd(d, dtype=dtype, scale=0.1)), _Norm(1 + rnd(d, dtype=dtype, scale=0.1))) if norm \
        else (None, None)
    cache = rnd(2, nb, bs, kvh, d, dtype=dtype)
    ctx = torch.tensor([1, 7, bs, 2 * bs + 1, 13 * bs - 3], device=device)
    tables = torch.randperm(nb, generator=g)[:5 * width].view(5, width).to(device)
    pos = ctx - 1
    slots = tables[torch.arange(5, device=device), pos // bs] * bs + pos % bs
    worst = []
    for rows, min_run in ((slice(0, 5), 1), (slice(4, 5), 1), (slice(4, 5), 16)):
        meta = AttentionMetadata(slot_mapping=slots[rows], num_decodes=q[rows].shape[0],
                                 decode_block_tables=tables[rows], decode_ctx_lens=ctx[rows])
        ref_cache, got_cache = cache.clone(), cache.clone()
        saved, fused.ENABLED = fused.ENABLED, False
        saved_triton, triton_attention.triton = triton_attention.triton, None
        try:
            ref = rope_attend(q[rows], k[rows], v[rows], cos[rows], sin[rows], ref_cache, meta, d ** -0.5, qn, kn)
        finally:
            fused.ENABLED, triton_attention.triton = saved, saved_triton
        got = triton_attention.rope_decode_attention(q[rows], k[rows], v[rows], cos[rows], sin[rows], got_cache,
                                                     slots[rows], tables[rows], ctx[rows], d ** -0.5, qn, kn, min_run)
        worst += [_err(got, ref), _err(got_cache, ref_cache)]
    return _worst(*worst)


def _prefill_error(h, kvh, d, bs, dtype, device, rnd, g) -> list[float]:
    nb = 40
    cache = rnd(2, nb, bs, kvh, d, dtype=dtype)
    chunks = [(5, 37), (20, 20), (70, 70 + 3 * bs + 2), (1, 2 * bs + 1)]   # (q_len, ctx_len)
    ndec = 2
    t = ndec + sum(q for q, _ in chunks)
    q, k, v = rnd(t, h, d, dtype=dtype), rnd(t, kvh, d, dtype=dtype), rnd(t, kvh, d, dtype=dtype)
    perm = torch.randperm(nb, generator=g).tolist()
    prefills, slots, row, used = [], [], ndec, 0
    for q_len, ctx in chunks:
        blocks = perm[used:used + -(-ctx // bs)]
        used += len(blocks)
        prefills.append(PrefillChunk(row, q_len, ctx, torch.tensor(blocks, device=device)))
        slots += [blocks[p // bs] * bs + p % bs for p in range(ctx - q_len, ctx)]
        row += q_len
    tables = torch.tensor([perm[used:used + 2], perm[used + 2:used + 4]], device=device)
    slots = [perm[used] * bs + 3, perm[used + 3] * bs + 1] + slots
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots, device=device), num_decodes=ndec,
                             decode_block_tables=tables, decode_ctx_lens=torch.tensor([4, bs + 2], device=device),
                             prefills=prefills)
    fused.write_kv(cache, k, v, meta.slot_mapping)
    saved, fused.ENABLED = fused.ENABLED, False
    try:
        ref = attend(q, k, v, cache, meta, d ** -0.5)
    finally:
        fused.ENABLED = saved
    bm = triton_prefill.block_m(dtype)
    # the same chunks through a CUDA graph's static plan: two empty chunk slots, padding tiles
    slots_c, tiles = len(prefills) + 2, triton_prefill.max_tiles(t, len(prefills) + 2, bm) + 3
    tables = [p.block_table.tolist() for p in prefills]
    host = np.zeros(triton_prefill.static_size(slots_c, tiles, sum(map(len, tables))), dtype=np.int32)
    triton_prefill.fill_static(host, slots_c, tiles, bm, [(p.q_start, p.q_len, p.ctx_len - p.q_len) for p in prefills],
                               tables)
    errs = []
    for plan in (meta.plan_prefills(bm, q.device),
                 triton_prefill.static_plan(torch.from_numpy(host).to(device), slots_c, tiles, bm)):
        out = torch.full_like(q, float("nan"))                   # every prefill row must be written
        triton_prefill.prefill_attention(q, k, v, cache, plan, d ** -0.5, out)
        errs.append(_err(out[ndec:], ref[ndec:]))
    return _worst(*errs)


def limit(name: str) -> float:
    """Error allowed relative to the reference's largest value: float32 to rounding; bfloat16 and
    float16 to about two units in the last place (the kernels round fewer times than the reference)."""
    return 1e-5 if "float32" in name else 2e-2 if "bfloat16" in name else 4e-3


if __name__ == "__main__":
    print(json.dumps(kernel_errors(sys.argv[1] if len(sys.argv) > 1 else "cpu",
                                   attn_dtypes=(torch.float32, torch.float16))))
