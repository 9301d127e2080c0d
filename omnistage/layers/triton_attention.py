"""Triton paged-decode attention for CUDA (one new token per sequence, GQA-aware, split context).

In: q [B, H, D] (one row per sequence), the paged KV cache, block tables and context lengths. Out: [B, H, D].
Runs in the stage process, inside the decode CUDA graphs. Two entries, one kernel:
  paged_decode_attention   q already rotated, this step's k and v already in the cache
  rope_decode_attention    this step's raw q, k, v rows (the qkv output), cos / sin rows, slots and optional
                           q / k RMSNorm weights: what `fused.rotary_and_cache` does, done in the decode kernel

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

With raw rows, every program normalises and rotates its head group's q in registers (cheap next to its K/V
reads, and no q round trip through memory). The new token's k and v are never read from the cache: the
program whose split holds the last position makes them (k: norm + rotary), stores them into the token's
slot for later steps and seeds its online softmax with them; every program's cache loads are masked to
the positions before it. Rounding follows `triton_fused`'s rotary kernel, so the result equals
`rotary_and_cache` + `paged_decode_attention` up to float32 summation order. At batch 1 a program is one
chain of memory latencies (context length -> table entry -> K, V), so the program orders its work around
it: the raw rows, cos / sin and norm weights are loaded first (they depend on nothing), and the norms and
rotary run while the first table entry loads (H200, thinker bs1: q work placed before the chain measured
5.03 us per decode launch, the kernel fed rotated q 3.65; this order is not measured on a GPU yet).

With programmatic dependent launch (`pdl`, on by default on sm_90+) both launches are PDL-launched. Fed raw
rows, the decode kernel follows the kernel that wrote them (on a decode-only step the qkv GEMM) and nothing it
reads besides those rows is that kernel's: each program loads the context length, its run's first table entry,
slot, cos / sin and norm weights before its gdc_wait, so that much of the chain can overlap the GEMM's end, and
the rows with the first K, V block after it. Fed rotated q (the cache's last position written by the kernel
before), it waits first of all. Either way it then lets the
combine launch start; the combine programs read the context length, wait, and only then read the partials
(or return: every program waits, layers/pdl.py's rule 2). With PDL off the kernels are as before.
"""

from __future__ import annotations

import torch

from omnistage.layers import pdl, triton_fused
from omnistage.layers.pdl import gdc_launch_dependents, gdc_wait

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
    def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, m_ptr, l_ptr, acc_ptr, out_ptr, scale, stride_bt,
                             stride_q, kn_ptr, vn_ptr, stride_kn, stride_vn, cos_ptr, sin_ptr, stride_cs, slot_ptr,
                             qw_ptr, kw_ptr, q_eps, k_eps, H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr,
                             G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, NSPLIT: tl.constexpr,
                             MIN_RUN: tl.constexpr, ROPE: tl.constexpr, NORM: tl.constexpr, IEEE: tl.constexpr,
                             PDL: tl.constexpr = False):
        if PDL and not ROPE:                             # first: q and the cache come from the kernels before
            gdc_wait()
            gdc_launch_dependents()                      # the combine launch may start (it waits)
        b = tl.program_id(0)
        kh = tl.program_id(1)
        sp = tl.program_id(2)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        t = tl.arange(0, BS)
        gmask = g < G
        ctx = tl.load(ctx_ptr + b)
        q_rows = q_ptr + b * stride_q + (kh * G + g)[:, None] * D
        k_row = kn_ptr + b * stride_kn + kh * D
        v_row = vn_ptr + b * stride_vn + kh * D
        dd = d[None, :]                                  # every [D] row as [1, D]: one layout with q's rows
        swap = (dd + D // 2) % D                         # rotate-half: each element's partner
        if ROPE:
            if not PDL:
                # this step's raw rows first: their loads need nothing else, so their latency hides behind the
                # context's (context length -> table entry -> K, V); see the module docstring
                qx, qs, kx, ks, vn = _raw_rows(q_rows, k_row, v_row, gmask, dd, swap)
            slot = tl.load(slot_ptr + b).to(tl.int64) * (KVH * D) + kh * D + dd
            cs = tl.load(cos_ptr + b * stride_cs + dd)
            sn = tl.load(sin_ptr + b * stride_cs + dd)
            if NORM:
                qw, qws = tl.load(qw_ptr + dd).to(tl.float32), tl.load(qw_ptr + swap).to(tl.float32)
                kw, kws = tl.load(kw_ptr + dd).to(tl.float32), tl.load(kw_ptr + swap).to(tl.float32)
            else:
                qw, qws, kw, kws = cs, cs, cs, cs        # unused
        nblocks = tl.cdiv(ctx, BS)
        run, used = _runs(nblocks, NSPLIT, MIN_RUN)       # splits past `used` have no blocks: they exit
        first = sp * run
        if ROPE:
            cached = ctx - 1                             # the new token's k and v come from registers (below)
        else:
            cached = ctx
        bt_row = bt_ptr + b * stride_bt
        if PDL and ROPE:
            # the context before the wait: the kernel before this launch (the qkv GEMM) writes only this step's
            # rows, and what the kernels before it wrote is complete (layers/pdl.py), so context length -> table
            # entry can overlap its end; then the rows and the first K, V block load together. (The block's loads
            # would not stay in flight across the wait: sm_90 compiles finish them, shared-memory stores
            # included, before it, so the rows' latency would follow the whole chain.) Splits past `used`: a
            # masked load (their run starts past the table's real entries)
            blk = tl.load(bt_row + first, mask=sp < used, other=0)
            gdc_wait()                                   # every program, also those that return below
            gdc_launch_dependents()
            qx, qs, kx, ks, vn = _raw_rows(q_rows, k_row, v_row, gmask, dd, swap)
        if sp >= used:
            return
        last = tl.minimum(first + run, nblocks)
        if not PDL or not ROPE:
            blk = tl.load(bt_row + first)                # the run's first block: the q work runs while it loads
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        l = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        if ROPE:
            # every program rotates its head group's q; the new token's k and v (its last position) never come
            # from the cache: the program whose split holds that position makes them, stores them into the
            # token's slot for later steps and starts its softmax with them
            q = _norm_rope(qx, qs, qw, qws, q_eps, cs, sn, dd, D, NORM)
            if sp == used - 1:
                kn = _norm_rope(kx, ks, kw, kws, k_eps, cs, sn, dd, D, NORM)
                tl.store(k_ptr + slot, kn.to(k_ptr.dtype.element_ty))
                tl.store(v_ptr + slot, vn.to(v_ptr.dtype.element_ty))
                m = tl.sum(q.to(tl.float32) * kn.to(tl.float32), axis=1) * scale
                l = tl.full([G_PAD], 1.0, tl.float32)
                acc = acc + vn.to(tl.float32)
        else:
            q = tl.load(q_rows + dd, mask=gmask[:, None], other=0.0)
        k, v, on = _kv_block(k_ptr, v_ptr, blk, first, kh, cached, t, d, KVH, D, BS)
        m, l, acc = _online_softmax(q, k, v, on, m, l, acc, scale, IEEE)
        for j in range(first + 1, last):
            k, v, on = _kv_block(k_ptr, v_ptr, tl.load(bt_row + j), j, kh, cached, t, d, KVH, D, BS)
            m, l, acc = _online_softmax(q, k, v, on, m, l, acc, scale, IEEE)
        out_off = b * H * D + (kh * G + g)[:, None] * D + d[None, :]
        if used == 1:                                    # a short context: the whole of it in this program
            tl.store(out_ptr + out_off, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=gmask[:, None])
        else:
            base = (b * KVH + kh) * NSPLIT
            tl.store(m_ptr + (base + sp) * G_PAD + g, m)
            tl.store(l_ptr + (base + sp) * G_PAD + g, l)
            tl.store(acc_ptr + ((base + sp) * G_PAD + g)[:, None] * D + d[None, :], acc)

    @triton.jit
    def _raw_rows(q_rows, k_row, v_row, gmask, dd, swap):
        """This step's raw rows: the head group's q [G_PAD, D] and the KV head's k [1, D], each also with its halves
        exchanged (`swap`: the rotate-half partners), and its v [1, D]."""
        qx = tl.load(q_rows + dd, mask=gmask[:, None], other=0.0)
        qs = tl.load(q_rows + swap, mask=gmask[:, None], other=0.0)
        return qx, qs, tl.load(k_row + dd), tl.load(k_row + swap), tl.load(v_row + dd)

    @triton.jit
    def _kv_block(k_ptr, v_ptr, blk, j, kh, cached, t, d, KVH: tl.constexpr, D: tl.constexpr, BS: tl.constexpr):
        """Cache block `blk`, the `j`-th of a sequence: K and V [BS, D] of KV head `kh` at positions < `cached`
        (0 past them), and that mask [BS]."""
        off = blk.to(tl.int64) * (BS * KVH * D) + t[:, None] * (KVH * D) + kh * D + d[None, :]
        on = j * BS + t < cached
        return (tl.load(k_ptr + off, mask=on[:, None], other=0.0), tl.load(v_ptr + off, mask=on[:, None], other=0.0),
                on)

    @triton.jit
    def _online_softmax(q, k, v, on, m, l, acc, scale, IEEE: tl.constexpr):
        """(max, sum, weighted values) of the head group's rows after one more block of keys (`on`: its real ones)."""
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(on[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l, acc

    @triton.jit
    def _norm_rope(x, xs, w, ws, eps, c, s, d, D: tl.constexpr, NORM: tl.constexpr):
        """Head rows x [..., D] -> per-head RMSNorm (NORM: weights w) and rotary, rounded to x's dtype as
        `triton_fused`'s rotary kernel does. xs, ws: x and w with their halves exchanged; c, s: the token's
        cos, sin [D] float32."""
        dt = x.dtype
        x = x.to(tl.float32)
        xs = xs.to(tl.float32)
        if NORM:
            rstd = tl.rsqrt(tl.sum(x * x, axis=-1, keep_dims=True) / D + eps)
            x = ((x * rstd).to(dt).to(tl.float32) * w).to(dt).to(tl.float32)
            xs = ((xs * rstd).to(dt).to(tl.float32) * ws).to(dt).to(tl.float32)
        return (x * c + tl.where(d < D // 2, -xs, xs) * s).to(dt)

    @triton.jit
    def _runs(nblocks, NSPLIT: tl.constexpr, MIN_RUN: tl.constexpr):
        """(KV blocks per split, splits that get blocks) of a context of `nblocks` blocks."""
        run = tl.cdiv(nblocks, tl.minimum(NSPLIT, tl.cdiv(nblocks, MIN_RUN)))
        return run, tl.cdiv(nblocks, run)

    @triton.jit
    def _combine_kernel(m_ptr, l_ptr, acc_ptr, ctx_ptr, out_ptr, H: tl.constexpr, KVH: tl.constexpr,
                        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                        NSPLIT: tl.constexpr, MIN_RUN: tl.constexpr, PDL: tl.constexpr = False):
        # one program per (sequence, query head): all of its splits in one vector load, no loop; a context of
        # one split was stored by its decode program
        b = tl.program_id(0)
        hq = tl.program_id(1)
        kh = hq // G
        gi = hq % G
        sp = tl.arange(0, NSPLIT)
        d = tl.arange(0, D)
        # the context length before the wait: the decode launch triggers only after its own wait, so what the
        # kernels before it wrote is complete (layers/pdl.py)
        _, used = _runs(tl.cdiv(tl.load(ctx_ptr + b), BS), NSPLIT, MIN_RUN)
        if PDL:                                          # every program, also those that return below
            gdc_wait()
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
    """q [B, H, D] (rotated, this step's k and v already in the cache); cache [2, blocks, BS, KVH, D];
    block_tables [B, W]; ctx_lens [B] -> [B, H, D]. `min_run`: KV blocks per split at least (a context of at
    most that many blocks runs in one program per KV head)."""
    q = q.contiguous()
    return _launch(q, q.shape[1] * q.shape[2], cache, block_tables, ctx_lens, scale, min_run)


def rope_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          cache: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor, ctx_lens: torch.Tensor,
                          scale: float, q_norm=None, k_norm=None, min_run: int = MIN_RUN) -> torch.Tensor:
    """`fused.rotary_and_cache` then `paged_decode_attention` in the decode kernel: q [B, H, D], k and v [B, KVH, D],
    this step's raw rows (may be strided views of one qkv output); cos, sin [B, D] float32; slots [B]: the new
    token's cache slot, its context's last position; q_norm / k_norm: RMSNorm modules (Qwen3) or None -> [B, H, D]."""
    q, k, v = triton_fused.head_rows(q), triton_fused.head_rows(k), triton_fused.head_rows(v)
    cos, sin = cos.contiguous(), sin.contiguous()
    rope = (k, v, k.stride(0), v.stride(0), cos, sin, cos.stride(0), slots)
    return _launch(q, q.stride(0), cache, block_tables, ctx_lens, scale, min_run, rope, q_norm, k_norm)


def _launch(q, stride_q, cache, block_tables, ctx_lens, scale, min_run, rope=None, q_norm=None,
            k_norm=None) -> torch.Tensor:
    """The decode launch (`rope`: the new token's k, v, their row strides, cos, sin, their row stride, slots; None:
    q is rotated and the cache written already) and the combine launch."""
    bsz, h, d = q.shape
    kvh, bs = cache.shape[3], cache.shape[2]
    g = h // kvh
    g_pad = max(16, triton.next_power_of_2(g))
    nsplit = num_splits(bsz, kvh, block_tables.shape[1], q.device)
    m = torch.empty(bsz, kvh, nsplit, g_pad, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(bsz, kvh, nsplit, g_pad, d, dtype=torch.float32, device=q.device)
    out = torch.empty(bsz, h, d, dtype=q.dtype, device=q.device)
    norm = q_norm is not None
    new = rope if rope is not None else (q, q, 0, 0, q, q, 0, q)     # placeholders the kernel does not read
    _paged_decode_kernel[(bsz, kvh, nsplit)](
        q, cache[0], cache[1], block_tables, ctx_lens, m, l, acc, out, scale, block_tables.stride(0), stride_q, *new,
        q_norm.weight if norm else q, k_norm.weight if norm else q, q_norm.eps if norm else 0.0,
        k_norm.eps if norm else 0.0, H=h, KVH=kvh, G=g, G_PAD=g_pad, D=d, BS=bs, NSPLIT=nsplit, MIN_RUN=min_run,
        ROPE=rope is not None, NORM=norm, IEEE=q.dtype == torch.float32, num_warps=4, **pdl.launch(q))
    if nsplit > 1:                                   # else every context is one run, stored by its program
        _combine_kernel[(bsz, h)](m, l, acc, ctx_lens, out, H=h, KVH=kvh, G=g, G_PAD=g_pad, D=d, BS=bs,
                                  NSPLIT=nsplit, MIN_RUN=min_run, num_warps=4, **pdl.launch(q))
    return out
