"""Triton paged-decode attention for CUDA (one new token per sequence, GQA-aware).

One program per (sequence, KV head) walks the sequence's block table with an online softmax and
serves all query heads of that KV head, so each cached key/value is read once per step. It reads
only `ctx_len` tokens whatever the padded table width, which keeps CUDA-graph replays cheap.
Must give the same result as the SDPA reference path in attention.py.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:                                  # CPU-only installs
    triton = None


if triton is not None:
    @triton.jit
    def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, out_ptr, scale, stride_bt,
                             H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                             D: tl.constexpr, BS: tl.constexpr):
        b = tl.program_id(0)
        kh = tl.program_id(1)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        t = tl.arange(0, BS)
        gmask = g < G
        q_off = b * H * D + (kh * G + g)[:, None] * D + d[None, :]
        q = tl.load(q_ptr + q_off, mask=gmask[:, None], other=0.0).to(tl.float32)
        ctx = tl.load(ctx_ptr + b)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        l = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        for j in range(0, tl.cdiv(ctx, BS)):
            blk = tl.load(bt_ptr + b * stride_bt + j).to(tl.int64)
            kv_off = blk * (BS * KVH * D) + t[:, None] * (KVH * D) + kh * D + d[None, :]
            k = tl.load(k_ptr + kv_off).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
            s = tl.where((j * BS + t < ctx)[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            v = tl.load(v_ptr + kv_off).to(tl.float32)
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        out = acc / l[:, None]
        tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])


def available(q: torch.Tensor) -> bool:
    d = q.shape[-1]
    return triton is not None and q.is_cuda and d & (d - 1) == 0


def paged_decode_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                           ctx_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, D]; cache [2, blocks, BS, KVH, D]; block_tables [B, W]; ctx_lens [B] -> [B, H, D]."""
    bsz, h, d = q.shape
    kvh, bs = cache.shape[3], cache.shape[2]
    g = h // kvh
    out = torch.empty_like(q)
    q = q.contiguous()
    _paged_decode_kernel[(bsz, kvh)](q, cache[0], cache[1], block_tables, ctx_lens, out, scale,
                                     block_tables.stride(0), H=h, KVH=kvh, G=g,
                                     G_PAD=max(triton.next_power_of_2(g), 1), D=d, BS=bs, num_warps=4)
    return out
