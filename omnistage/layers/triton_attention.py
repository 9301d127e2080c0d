"""Triton paged-decode attention for CUDA (one new token per sequence, GQA-aware, split context).

In: q [B, H, D] (one row per sequence), the paged KV cache, block tables and context lengths. Out: [B, H, D].
Runs in the stage process, inside the decode CUDA graphs.

Grid (sequence, KV head, split). A sequence's context is cut into runs of at least MIN_RUN KV blocks,
at most NSPLIT of them (the run length follows the real context, read on the device); each program
walks its run of the block table with an online softmax, serving all query heads of its KV head with
tensor-core dots (the head group is padded to 16 rows). A context of one run is finished in its
program: the output is stored directly. Longer contexts write a partial (max, sum, weighted values)
triple per run, merged by a combine launch (one program per sequence and query head, its splits in one
vector load). A merge inside the decode launch (the last program of a (sequence, KV head) to take a
ticket merging all runs) was measured slower than decode + combine at every batch and context on an
H200 (64 rows x 256 tokens: 41.7 vs 21.4 us; batch 1 x 256: 28.7 vs 5.6), so there is none. NSPLIT
depends only on the batch size (enough programs to fill the GPU: a batch-1 decode spreads its context
over up to 64 programs, a 256-row batch uses 1-2 per sequence), so the grid and the merge are static
under CUDA graphs while the work per program follows the context; programs past the context's runs
exit at once. Must give the same result as the SDPA reference path in attention.py.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:                                  # CPU-only installs
    triton = None

MAX_SPLITS = 64                                      # context splits per (sequence, KV head) at most
MIN_RUN = 1                                          # KV blocks per split at least (see the module docstring)
PROGRAMS_PER_SM = 4                                  # programs the split count aims for, per multiprocessor
_SM_COUNT: dict = {}


if triton is not None:
    @triton.jit(do_not_specialize=["stride_bt"])      # the table width changes from step to step
    def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, m_ptr, l_ptr, acc_ptr, out_ptr, scale,
                             stride_bt, H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                             D: tl.constexpr, BS: tl.constexpr, NSPLIT: tl.constexpr, MIN_RUN: tl.constexpr,
                             IEEE: tl.constexpr):
        b = tl.program_id(0)
        kh = tl.program_id(1)
        sp = tl.program_id(2)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        t = tl.arange(0, BS)
        gmask = g < G
        ctx = tl.load(ctx_ptr + b)
        nblocks = tl.cdiv(ctx, BS)
        run, used = _runs(nblocks, NSPLIT, MIN_RUN)       # splits past `used` have no blocks: they exit
        if sp >= used:
            return
        first = sp * run
        last = tl.minimum(first + run, nblocks)
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
        out_off = b * H * D + (kh * G + g)[:, None] * D + d[None, :]
        if used == 1:                                    # a short context: the whole of it in this program
            tl.store(out_ptr + out_off, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=gmask[:, None])
        else:
            base = (b * KVH + kh) * NSPLIT
            tl.store(m_ptr + (base + sp) * G_PAD + g, m)
            tl.store(l_ptr + (base + sp) * G_PAD + g, l)
            tl.store(acc_ptr + ((base + sp) * G_PAD + g)[:, None] * D + d[None, :], acc)

    @triton.jit
    def _runs(nblocks, NSPLIT: tl.constexpr, MIN_RUN: tl.constexpr):
        """(KV blocks per split, splits that get blocks) of a context of `nblocks` blocks."""
        run = tl.cdiv(nblocks, tl.minimum(NSPLIT, tl.cdiv(nblocks, MIN_RUN)))
        return run, tl.cdiv(nblocks, run)

    @triton.jit
    def _combine_kernel(m_ptr, l_ptr, acc_ptr, ctx_ptr, out_ptr, H: tl.constexpr, KVH: tl.constexpr,
                        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                        NSPLIT: tl.constexpr, MIN_RUN: tl.constexpr):
        # one program per (sequence, query head): all of its splits in one vector load, no loop; a context of
        # one split was stored by its decode program
        b = tl.program_id(0)
        hq = tl.program_id(1)
        kh = hq // G
        gi = hq % G
        sp = tl.arange(0, NSPLIT)
        d = tl.arange(0, D)
        _, used = _runs(tl.cdiv(tl.load(ctx_ptr + b), BS), NSPLIT, MIN_RUN)
        if used == 1:
            return
        on = sp < used
        off = ((b * KVH + kh) * NSPLIT + sp) * G_PAD + gi
        m = tl.load(m_ptr + off, mask=on, other=float("-inf"))
        w = tl.where(on, tl.exp(m - tl.max(m, axis=0)), 0.0)
        total = tl.sum(w * tl.load(l_ptr + off, mask=on, other=0.0), axis=0)
        acc = tl.load(acc_ptr + off[:, None] * D + d[None, :], mask=on[:, None], other=0.0)
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
                           ctx_lens: torch.Tensor, scale: float, min_run: int = MIN_RUN) -> torch.Tensor:
    """q [B, H, D]; cache [2, blocks, BS, KVH, D]; block_tables [B, W]; ctx_lens [B] -> [B, H, D]. `min_run`:
    KV blocks per split at least (a context of at most that many blocks runs in one program per KV head)."""
    bsz, h, d = q.shape
    kvh, bs = cache.shape[3], cache.shape[2]
    g = h // kvh
    g_pad = max(16, triton.next_power_of_2(g))
    nsplit = num_splits(bsz, kvh, block_tables.shape[1], q.device)
    m = torch.empty(bsz, kvh, nsplit, g_pad, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(bsz, kvh, nsplit, g_pad, d, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    _paged_decode_kernel[(bsz, kvh, nsplit)](
        q.contiguous(), cache[0], cache[1], block_tables, ctx_lens, m, l, acc, out, scale,
        block_tables.stride(0), H=h, KVH=kvh, G=g, G_PAD=g_pad, D=d, BS=bs, NSPLIT=nsplit, MIN_RUN=min_run,
        IEEE=q.dtype == torch.float32, num_warps=4)
    if nsplit > 1:                                   # else every context is one run, stored by its program
        _combine_kernel[(bsz, h)](m, l, acc, ctx_lens, out, H=h, KVH=kvh, G=g, G_PAD=g_pad, D=d, BS=bs,
                                  NSPLIT=nsplit, MIN_RUN=min_run, num_warps=4)
    return out
