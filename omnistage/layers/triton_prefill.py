"""Varlen prefill attention over the paged KV cache: one Triton launch for all prefill chunks of a step.

In: the step's rotated q [T, H, D] and fresh k, v [T, KVH, D], the KV cache [2, blocks, block_size,
KVH, D] (this step's k, v already written), and a `PrefillPlan` built once per forward from the
runner's `PrefillChunk` list. Out: the chunks' rows of `out` [T, H, D].

Grid: (query tile, query head). A tile is BLOCK_M rows of one chunk. Its program runs a
flash-attention loop with an online softmax (exp2, float32 accumulators) over the chunk's cached
context first -- read through the sequence's block table, no mask but the context length -- and then
over the chunk's own keys from the fresh k, v rows, causal. GQA: query head h reads KV head
h // (H // KVH). Must equal the SDPA reference loop in attention.py.

A prefill CUDA graph (ar/prefill_graphs.py) needs a plan of fixed size: `static_plan` views one int32
buffer as the info and the concatenated block tables (sized for a bucket's most chunks and tiles),
`fill_static` writes a step's chunks into its host copy; the chunk and tile counts are the maxima, the
chunks past the real ones empty and the tiles past the real ones at a row past their chunk, so their
programs return at once.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:                                  # CPU-only installs
    triton = None


if triton is not None:
    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        if IEEE:
            r = tl.dot(a, b, input_precision="ieee")
        else:
            r = tl.dot(a, b)
        return r

    # The chunk and tile counts change every step: not specialised on (one compiled kernel serves all).
    @triton.jit(do_not_specialize=["num_chunks", "num_tiles"])
    def _prefill_kernel(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, o_ptr, bt_ptr, info_ptr, qk_scale,
                        stride_q, stride_k, stride_v, stride_o, num_chunks, num_tiles,
                        KVH: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        tile = tl.program_id(0)
        h = tl.program_id(1)
        kh = h // G
        c = tl.load(info_ptr + 4 * num_chunks + tile)
        m0 = tl.load(info_ptr + 4 * num_chunks + num_tiles + tile)
        q_start = tl.load(info_ptr + c)
        q_len = tl.load(info_ptr + num_chunks + c)
        if m0 >= q_len:                             # a padding tile of a graph's static plan (`fill_static`)
            return
        cached = tl.load(info_ptr + 2 * num_chunks + c)
        bt_start = tl.load(info_ptr + 3 * num_chunks + c)
        rm = m0 + tl.arange(0, BLOCK_M)
        rn = tl.arange(0, BLOCK_N)
        rd = tl.arange(0, D)
        m_ok = rm < q_len
        rows = (q_start + rm).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_q + h * D + rd[None, :], mask=m_ok[:, None], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        # 1) the cached context (positions before the chunk): every query row sees all of it
        for n0 in range(0, cached, BLOCK_N):
            n = n0 + rn
            n_ok = n < cached
            blk = tl.load(bt_ptr + bt_start + n // BS, mask=n_ok, other=0).to(tl.int64)
            kv = blk * (BS * KVH * D) + (n % BS) * (KVH * D) + kh * D
            k = tl.load(kc_ptr + kv[:, None] + rd[None, :], mask=n_ok[:, None], other=0.0)
            s = _dot(q, tl.trans(k), IEEE) * qk_scale
            s = tl.where(n_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(vc_ptr + kv[:, None] + rd[None, :], mask=n_ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
            m_i = m_new
        # 2) the chunk's own keys, causal; key 0 is visible to every row, so no row stays empty
        hi = tl.minimum(q_len, m0 + BLOCK_M)
        for n0 in range(0, hi, BLOCK_N):
            n = n0 + rn
            n_ok = n < q_len
            krows = (q_start + n).to(tl.int64)
            k = tl.load(k_ptr + krows[:, None] * stride_k + kh * D + rd[None, :], mask=n_ok[:, None], other=0.0)
            s = _dot(q, tl.trans(k), IEEE) * qk_scale
            s = tl.where((n[None, :] <= rm[:, None]) & n_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + krows[:, None] * stride_v + kh * D + rd[None, :], mask=n_ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(o_ptr + rows[:, None] * stride_o + h * D + rd[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=m_ok[:, None])


@dataclass
class PrefillPlan:
    """Kernel-ready description of a step's prefill chunks (built once per forward, on the device)."""
    info: torch.Tensor            # int32 [4C + 2NT]: q_start, q_len, cached len, block-table start per chunk;
    #                               then the chunk and first row of each query tile
    block_tables: torch.Tensor    # long (int32 in a static plan) [sum of the chunks' table lengths], the tables
    #                               one after another
    num_chunks: int               # C
    num_tiles: int                # NT
    block_m: int                  # query rows per tile


def available(q: torch.Tensor) -> bool:
    """Tensor-core dots need a power-of-two head_dim of at least 16."""
    d = q.shape[-1]
    return triton is not None and q.is_cuda and d >= 16 and d & (d - 1) == 0


def block_m(dtype: torch.dtype) -> int:
    return 32 if dtype == torch.float32 else 64


def make_plan(prefills, block_m: int, device: torch.device) -> PrefillPlan:
    """`prefills`: attention.PrefillChunk list (q_start, q_len, ctx_len, block_table)."""
    starts, lens, cached, bt_starts, tile_chunk, tile_row = [], [], [], [], [], []
    offset = 0
    for c, p in enumerate(prefills):
        starts.append(p.q_start)
        lens.append(p.q_len)
        cached.append(p.ctx_len - p.q_len)
        bt_starts.append(offset)
        offset += p.block_table.numel()
        for m0 in range(0, p.q_len, block_m):
            tile_chunk.append(c)
            tile_row.append(m0)
    info = torch.tensor(starts + lens + cached + bt_starts + tile_chunk + tile_row, dtype=torch.int32)
    tables = prefills[0].block_table if len(prefills) == 1 else torch.cat([p.block_table for p in prefills])
    return PrefillPlan(info.to(device, non_blocking=True), tables, len(prefills), len(tile_chunk), block_m)


PAD_ROW = 1 << 30                                    # first row of a padding tile: past every chunk's rows


def max_tiles(tokens: int, chunks: int, block_m: int) -> int:
    """Query tiles that `chunks` chunks of `tokens` rows in all can need (each chunk ends in a partial tile)."""
    return min(tokens, -(-tokens // block_m) + chunks - 1)


def static_size(chunks: int, tiles: int, table_entries: int) -> int:
    """int32 entries of a static plan's buffer: the info of `chunks` chunks and `tiles` tiles, then the tables."""
    return 4 * chunks + 2 * tiles + table_entries


def static_plan(buf: torch.Tensor, chunks: int, tiles: int, block_m: int) -> PrefillPlan:
    """A plan over `buf` (int32, `static_size` long, on the device): its info first, the concatenated block
    tables after; `chunks` / `tiles` fixed (what a graph captures), the contents written by `fill_static`."""
    head = 4 * chunks + 2 * tiles
    return PrefillPlan(buf[:head], buf[head:], chunks, tiles, block_m)


def fill_static(buf: np.ndarray, chunks: int, tiles: int, block_m: int,
                spans: list[tuple[int, int, int]], tables: list[list[int]]) -> int:
    """Writes a step's plan into `buf` (int32 host memory laid out as `static_plan`'s) and returns the
    entries written (what needs copying). `spans`: (q_start, q_len, cached) per chunk, at most `chunks`;
    `tables`: each chunk's block ids (at least its context's blocks). Chunks past them get q_len 0;
    tiles past the real ones point at chunk 0 from row `PAD_ROW`: the kernel's programs return at once."""
    n = len(spans)
    info = buf[:4 * chunks + 2 * tiles]
    info[:4 * chunks] = 0
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=n)
    if n:
        info[0:n], info[chunks:chunks + n], info[2 * chunks:2 * chunks + n] = np.array(spans, dtype=np.int32).T
        info[3 * chunks:3 * chunks + n] = np.cumsum(lens) - lens
    per = [-(-q // block_m) for _, q, _ in spans]
    real = sum(per)
    if real > tiles:
        raise ValueError(f"{real} query tiles do not fit a static plan of {tiles}")
    tile_chunk, tile_row = info[4 * chunks:4 * chunks + tiles], info[4 * chunks + tiles:]
    tile_chunk[:real] = np.repeat(np.arange(n, dtype=np.int32), per)
    tile_row[:real] = np.concatenate([np.arange(k, dtype=np.int32) * block_m for k in per]) if n else []
    tile_chunk[real:], tile_row[real:] = 0, PAD_ROW
    head, total = 4 * chunks + 2 * tiles, int(lens.sum())
    if total:
        buf[head:head + total] = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32, count=total)
    return head + total


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, plan: PrefillPlan,
                      scale: float, out: torch.Tensor) -> None:
    """Writes the prefill rows of out [T, H, D]; q, out: head rows D apart; k, v [T, KVH, D] likewise."""
    h, d = q.shape[1], q.shape[2]
    kvh, bs = cache.shape[3], cache.shape[2]
    for x in (q, k, v, out):
        assert x.stride(2) == 1 and x.stride(1) == d, "heads must be D apart with unit stride inside"
    fp32 = q.dtype == torch.float32
    _prefill_kernel[(plan.num_tiles, h)](
        q, k, v, cache[0], cache[1], out, plan.block_tables, plan.info, scale * 1.4426950408889634,
        q.stride(0), k.stride(0), v.stride(0), out.stride(0), plan.num_chunks, plan.num_tiles,
        KVH=kvh, G=h // kvh, D=d, BS=bs, BLOCK_M=plan.block_m, BLOCK_N=32 if fp32 else 64, IEEE=fp32,
        num_warps=4, num_stages=1 if fp32 else 2)
