"""Triton fused MoE behind `moe.fused_moe` (CUDA; the Triton interpreter runs it on CPU tensors in tests).

In: x [T, H], w13 [E, 2I, H] ([gate | up] per expert), w2 [E, H, I], routing weights and ids [T, K].
Out: [T, H] = sum over a row's K experts of weight * down(SiLU(gate) * up).

  align(topk_ids, E, BLOCK_M)   the T*K (row, slot) pairs sorted by expert, each expert's run padded to a
                                multiple of BLOCK_M with a pad index (T*K); one expert id per block, and the
                                padded total. Plain torch ops on the device of fixed output sizes
                                (T*K + E*(BLOCK_M-1)), so no host sync: CUDA graphs capture it.
  align_one_launch(...)         the same in one launch (`_align_kernel`, one program), what `fused_moe` runs up
                                to ALIGN_PAIRS pairs: a prefill step runs eagerly, and align's ~20 ops cost
                                more host time there than the GEMMs take on the GPU
  _gate_up_kernel               grid (blocks of sorted pairs, column blocks of I): one launch for all experts;
                                each program loads its block's x rows (gathered through the sorted index),
                                the expert's gate and up tiles, and stores SiLU(gate) * up in the model dtype
                                at the pair's slot of an [T*K, I] buffer
  _down_kernel                  grid (blocks of sorted pairs, column blocks of H): the same grouped GEMM over
                                that buffer and w2, times the pair's routing weight, stored per pair [T*K, H]
  the K slots of each row are then summed (a [T, K, H] sum; deterministic, no atomics).

The launch shapes are `triton_moe_tiles.SortedTiles` (the table per BLOCK_M, else the defaults). The decode
sizes (T*K <= SMALL_PAIRS) run `triton_moe_small` instead.

Arithmetic is float32 in the tiles; results are rounded to the model dtype where the reference rounds
(the product SiLU(gate) * up, the weighted down output), so the two differ by the order of sums only.
"""

from __future__ import annotations

import torch

from omnistage.layers.triton_moe_tiles import SortedTiles, sorted_tiles

try:
    import triton
    import triton.language as tl
except ImportError:                                  # CPU-only installs
    triton = None


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """topk_ids [T, K] -> (sorted_ids int32 [P], block_expert int32 [P // block_m], padded_total int32 [1])
    where P = T*K + E*(block_m-1) rounded up to block_m; entries past an expert's pairs hold T*K."""
    n = topk_ids.numel()
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    first = torch.cumsum(counts, 0) - counts                   # unpadded start of each expert's pairs
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    dest = starts[expert_of] + torch.arange(n, device=dev) - first[expert_of]
    size = -(-(n + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.full((size,), n, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, size, block_m, device=dev)
    block_expert = torch.searchsorted(ends, block_start, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, block_expert, ends[-1:].to(torch.int32)


ALIGN_PAIRS = 4096                               # T*K at most for `align_one_launch` (one program walks the pairs)


def align_one_launch(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """`align` in one launch (`_align_kernel`, one program): the same three tensors, element for element.
    A prefill step runs eagerly, where align's ~20 torch ops cost more host time than the GEMMs take."""
    n = topk_ids.numel()
    size = -(-(n + num_experts * (block_m - 1)) // block_m) * block_m
    dev = topk_ids.device
    sorted_ids = torch.empty(size, dtype=torch.int32, device=dev)
    block_expert = torch.empty(size // block_m, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)
    _align_kernel[(1,)](topk_ids.reshape(-1).contiguous(), sorted_ids, block_expert, total, n, num_experts, size,
                        BLOCK_M=block_m, BLOCK_P=64, BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_F=1024,
                        num_warps=4)
    return sorted_ids, block_expert, total


def _block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per tile: small at decode sizes (few pairs per expert), larger once experts fill up."""
    per_expert = num_pairs / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


if triton is not None:
    @triton.jit
    def _align_kernel(ids_ptr, sorted_ptr, expert_ptr, total_ptr, num_pairs, num_experts, size,
                      BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_F: tl.constexpr):
        # one program, `align`'s steps: per-expert counts (one-hot sums over chunks of BLOCK_P pairs), the
        # padded runs' starts and ends (cumsum), the pad fill, each pair at its expert's start plus its rank
        # among the expert's earlier pairs (a cumsum of the one-hot down the chunk, plus the running counts:
        # a stable order, as argsort's), then each block's expert (the ends at or below its first row)
        es = tl.arange(0, BLOCK_E)
        ps = tl.arange(0, BLOCK_P)
        counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
        for p0 in range(0, num_pairs, BLOCK_P):
            e = tl.load(ids_ptr + p0 + ps, mask=(p0 + ps) < num_pairs, other=BLOCK_E).to(tl.int32)
            counts += tl.sum((e[:, None] == es[None, :]).to(tl.int32), axis=0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, axis=0)
        starts = ends - padded
        tl.store(total_ptr, tl.sum(padded, axis=0))
        fs = tl.arange(0, BLOCK_F)
        for f0 in range(0, size, BLOCK_F):
            tl.store(sorted_ptr + f0 + fs, tl.zeros((BLOCK_F,), dtype=tl.int32) + num_pairs, mask=(f0 + fs) < size)
        tl.debug_barrier()                      # the pad fill before any pair overwrites its slot
        seen = tl.zeros((BLOCK_E,), dtype=tl.int32)
        for p0 in range(0, num_pairs, BLOCK_P):
            p_ok = (p0 + ps) < num_pairs
            e = tl.load(ids_ptr + p0 + ps, mask=p_ok, other=BLOCK_E).to(tl.int32)
            hot = (e[:, None] == es[None, :]).to(tl.int32)
            before = tl.cumsum(hot, axis=0) - hot + seen[None, :]     # the expert's pairs ahead of this one
            dest = tl.sum(hot * (starts[None, :] + before), axis=1)
            tl.store(sorted_ptr + dest, p0 + ps, mask=p_ok)
            seen += tl.sum(hot, axis=0)
        real_end = tl.where(es < num_experts, ends, 2147483647)
        for b0 in range(0, size // BLOCK_M, BLOCK_P):
            bs = b0 + ps
            first = bs * BLOCK_M
            expert = tl.sum((real_end[None, :] <= first[:, None]).to(tl.int32), axis=1)
            tl.store(expert_ptr + bs, tl.minimum(expert, num_experts - 1), mask=bs < size // BLOCK_M)

    @triton.jit
    def _gate_up_kernel(x_ptr, w_ptr, out_ptr, sorted_ptr, expert_ptr, total_ptr, num_pairs, top_k, hidden, inter,
                        stride_x, stride_we, stride_wn, stride_out,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PRECISION: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if pid_m * BLOCK_M >= tl.load(total_ptr):
            return
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + rows)
        valid = pair < num_pairs
        token = (pair // top_k).to(tl.int64)
        expert = tl.load(expert_ptr + pid_m).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < inter
        ks = tl.arange(0, BLOCK_K)
        w_base = w_ptr + expert * stride_we
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k_ok = (k0 + ks) < hidden
            a = tl.load(x_ptr + token[:, None] * stride_x + (k0 + ks)[None, :],
                        mask=valid[:, None] & k_ok[None, :], other=0.0)
            wmask = k_ok[:, None] & col_ok[None, :]
            wg = tl.load(w_base + cols[None, :] * stride_wn + (k0 + ks)[:, None], mask=wmask, other=0.0)
            wu = tl.load(w_base + (cols + inter)[None, :] * stride_wn + (k0 + ks)[:, None], mask=wmask, other=0.0)
            acc_g = tl.dot(a, wg, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, wu, acc_u, input_precision=PRECISION)
        dt = out_ptr.dtype.element_ty
        # rounded where the reference stores: gate-up output, silu(gate), the product
        g = acc_g.to(dt).to(tl.float32)
        u = acc_u.to(dt).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(out_ptr + pair.to(tl.int64)[:, None] * stride_out + cols[None, :], (s * u).to(dt),
                 mask=valid[:, None] & col_ok[None, :])

    @triton.jit
    def _down_kernel(h_ptr, w_ptr, out_ptr, weight_ptr, sorted_ptr, expert_ptr, total_ptr, num_pairs, inter, hidden,
                     stride_h, stride_we, stride_wn, stride_out,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PRECISION: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if pid_m * BLOCK_M >= tl.load(total_ptr):
            return
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + rows)
        valid = pair < num_pairs
        pair64 = pair.to(tl.int64)
        expert = tl.load(expert_ptr + pid_m).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < hidden
        ks = tl.arange(0, BLOCK_K)
        w_base = w_ptr + expert * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k_ok = (k0 + ks) < inter
            a = tl.load(h_ptr + pair64[:, None] * stride_h + (k0 + ks)[None, :],
                        mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_base + cols[None, :] * stride_wn + (k0 + ks)[:, None],
                        mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        dt = out_ptr.dtype.element_ty
        rw = tl.load(weight_ptr + pair64, mask=valid, other=0.0).to(dt).to(tl.float32)
        y = acc.to(dt).to(tl.float32) * rw[:, None]
        tl.store(out_ptr + pair64[:, None] * stride_out + cols[None, :], y.to(dt), mask=valid[:, None] & col_ok[None, :])


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, block_m: int | None = None, tiles: SortedTiles | None = None) -> torch.Tensor:
    """See the module docstring; shapes as `moe.fused_moe`. `block_m` overrides the tile height (tests),
    `tiles` the launch shapes (None: `triton_moe_tiles.sorted_tiles` of this shape)."""
    t, k = topk_ids.shape
    e, two_i, h = w13.shape
    inter = two_i // 2
    n = t * k
    x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    bm = block_m or _block_m(n, e)
    tiles = tiles or sorted_tiles(bm, h, inter)
    sorted_ids, block_expert, total = (align_one_launch if n <= ALIGN_PAIRS else align)(topk_ids, e, bm)
    mid = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    # float32 models get float32 products (TF32 would change greedy ids of small models); bf16 / fp16 ignore it
    precision = "ieee" if x.dtype == torch.float32 else None
    grid = (sorted_ids.numel() // bm, triton.cdiv(inter, tiles.up_n))
    _gate_up_kernel[grid](x, w13, mid, sorted_ids, block_expert, total, n, k, h, inter,
                          x.stride(0), w13.stride(0), w13.stride(1), mid.stride(0),
                          BLOCK_M=bm, BLOCK_N=tiles.up_n, BLOCK_K=tiles.up_k, PRECISION=precision,
                          num_warps=tiles.up_warps, num_stages=tiles.up_stages)
    out = torch.empty(n, h, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    grid = (sorted_ids.numel() // bm, triton.cdiv(h, tiles.down_n))
    _down_kernel[grid](mid, w2, out, weights, sorted_ids, block_expert, total, n, inter, h,
                       mid.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
                       BLOCK_M=bm, BLOCK_N=tiles.down_n, BLOCK_K=tiles.down_k, PRECISION=precision,
                       num_warps=tiles.down_warps, num_stages=tiles.down_stages)
    return out.view(t, k, h).sum(dim=1)
