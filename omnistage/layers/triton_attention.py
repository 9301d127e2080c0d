"""Triton paged-decode attention for CUDA (one new token per sequence, GQA-aware, split context).

Grid: (sequence, KV head, split). A sequence's context is cut into NSPLIT equal runs of KV blocks
(the run length follows the real context, read on the device); each program walks its run of the
block table with an online softmax, serving all query heads of its KV head with tensor-core dots
(the head group is padded to 16 rows), and writes a partial (max, sum, weighted values) triple; a
small combine step (one program per sequence and query head, its splits in one vector load) merges
the runs that exist. NSPLIT depends only on the batch size (enough
programs to fill the GPU: a batch-1 decode spreads its context over up to 64 programs, a 256-row
batch uses 1-2 per sequence), so the grid is static under CUDA graphs while the work per program
follows the context.
Must give the same result as the SDPA reference path in attention.py.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:                                  # CPU-only installs
    triton = None

MAX_SPLITS = 64                                      # context splits per (sequence, KV head) at most
PROGRAMS_PER_SM = 4                                  # programs the split count aims for, per multiprocessor
_SM_COUNT: dict = {}


if triton is not None:
    @triton.jit(do_not_specialize=["stride_bt"])      # the table width changes from step to step
    def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, m_ptr, l_ptr, acc_ptr, scale, stride_bt,
                             H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                             D: tl.constexpr, BS: tl.constexpr, NSPLIT: tl.constexpr, IEEE: tl.constexpr):
        b = tl.program_id(0)
        kh = tl.program_id(1)
        sp = tl.program_id(2)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        t = tl.arange(0, BS)
        gmask = g < G
        ctx = tl.load(ctx_ptr + b)
        nblocks = tl.cdiv(ctx, BS)
        run = tl.cdiv(nblocks, NSPLIT)                   # blocks per split; splits past the context are empty
        first = sp * run
        last = tl.minimum(first + run, nblocks)
        part_off = ((b * KVH + kh) * NSPLIT + sp) * G_PAD + g
        q = tl.load(q_ptr + b * H * D + (kh * G + g)[:, None] * D + d[None, :], mask=gmask[:, None], other=0.0)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        l = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        for j in range(first, last):
            blk = tl.load(bt_ptr + b * stride_bt + j).to(tl.int64)
            kv_off = blk * (BS * KVH * D) + t[:, None] * (KVH * D) + kh * D + d[None, :]
            k = tl.load(k_ptr + kv_off)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale
            s = tl.where((j * BS + t < ctx)[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            v = tl.load(v_ptr + kv_off)
            l = l * alpha + tl.sum(p, axis=1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        tl.store(m_ptr + part_off, m)
        tl.store(l_ptr + part_off, l)
        tl.store(acc_ptr + part_off[:, None] * D + d[None, :], acc)

    @triton.jit
    def _combine_kernel(m_ptr, l_ptr, acc_ptr, ctx_ptr, out_ptr, H: tl.constexpr, KVH: tl.constexpr,
                        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                        NSPLIT: tl.constexpr):
        # one program per (sequence, query head): all of its splits in one vector load, no loop
        b = tl.program_id(0)
        hq = tl.program_id(1)
        kh = hq // G
        gi = hq % G
        sp = tl.arange(0, NSPLIT)
        d = tl.arange(0, D)
        nblocks = tl.cdiv(tl.load(ctx_ptr + b), BS)
        used = sp < tl.cdiv(nblocks, tl.cdiv(nblocks, NSPLIT))   # splits that got blocks
        off = ((b * KVH + kh) * NSPLIT + sp) * G_PAD + gi
        m = tl.load(m_ptr + off, mask=used, other=float("-inf"))
        w = tl.where(used, tl.exp(m - tl.max(m, axis=0)), 0.0)
        total = tl.sum(w * tl.load(l_ptr + off, mask=used, other=0.0), axis=0)
        acc = tl.load(acc_ptr + off[:, None] * D + d[None, :], mask=used[:, None], other=0.0)
        out = tl.sum(w[:, None] * acc, axis=0) / total
        tl.store(out_ptr + b * H * D + hq * D + d, out.to(out_ptr.dtype.element_ty))


def available(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Tensor-core dots need head_dim and block size to be powers of two of at least 16."""
    d, bs = q.shape[-1], cache.shape[2]
    return (triton is not None and q.is_cuda and d >= 16 and d & (d - 1) == 0 and bs >= 16
            and bs & (bs - 1) == 0)


def num_splits(batch: int, kv_heads: int, width: int, device: torch.device) -> int:
    """Context splits per (sequence, KV head): a power of two giving about PROGRAMS_PER_SM programs
    per multiprocessor, at most MAX_SPLITS and at most the block-table width."""
    if device not in _SM_COUNT:
        _SM_COUNT[device] = (torch.cuda.get_device_properties(device).multi_processor_count
                             if device.type == "cuda" else 8)
    want = -(-PROGRAMS_PER_SM * _SM_COUNT[device] // (batch * kv_heads))
    return max(1, min(MAX_SPLITS, triton.next_power_of_2(want), triton.next_power_of_2(width)))


def paged_decode_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                           ctx_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, D]; cache [2, blocks, BS, KVH, D]; block_tables [B, W]; ctx_lens [B] -> [B, H, D]."""
    bsz, h, d = q.shape
    kvh, bs = cache.shape[3], cache.shape[2]
    g = h // kvh
    g_pad = max(16, triton.next_power_of_2(g))
    nsplit = num_splits(bsz, kvh, block_tables.shape[1], q.device)
    m = torch.empty(bsz, kvh, nsplit, g_pad, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(bsz, kvh, nsplit, g_pad, d, dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(bsz, kvh, nsplit)](
        q.contiguous(), cache[0], cache[1], block_tables, ctx_lens, m, l, acc, scale, block_tables.stride(0),
        H=h, KVH=kvh, G=g, G_PAD=g_pad, D=d, BS=bs, NSPLIT=nsplit, IEEE=q.dtype == torch.float32, num_warps=4)
    out = torch.empty_like(q)
    _combine_kernel[(bsz, h)](m, l, acc, ctx_lens, out, H=h, KVH=kvh, G=g, G_PAD=g_pad, D=d, BS=bs, NSPLIT=nsplit,
                                num_warps=4)
    return out
