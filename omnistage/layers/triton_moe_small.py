"""Triton MoE decode kernels behind `moe.routed_moe` at T*K <= SMALL_PAIRS (CUDA; the Triton interpreter runs
them on CPU tensors in tests). Runs in the stage process, inside the decode CUDA graphs.

In: x [T, H], the router weight gate [E, H], w13 [E, 2I, H] ([gate | up] per expert), w2 [E, H, I] (or,
for `fused_moe_small`, routing weights and ids [T, K]). Out: [T, H] = sum over a row's K experts of
weight * down(SiLU(gate) * up), as `triton_moe.fused_moe` (the sorted grouped GEMM for larger steps).

Decode sizes (T*K <= SMALL_PAIRS, `fused_moe_small`) skip the sort and align: few rows per expert make
the grouped GEMM's tiles mostly padding, and align's torch ops cost more launches than the GEMMs.
  _pair_gate_up_kernel          grid (T*K pairs, column blocks of I, slices of H): the pair's expert id read
                                from topk_ids, gate | up GEMV over its x row, SiLU(gate) * up stored [T*K, I];
                                with several slices (split-K: more, shorter weight streams in flight) each
                                stores float32 partials and the last to take the column block's ticket adds
                                them in slice order (deterministic) and stores the product
  _token_down_kernel            grid (T, column blocks of H, slices of I; split-K as gate-up): per token, all K
                                experts' down rows in one
                                [K, BLOCK_N, BLOCK_K] tile per step (K experts' loads in flight at once),
                                times the routing weights, summed over the slots in float32 and stored
                                once [T, H] (the weighted sum fused; deterministic, no atomics)
  _router_kernel                grid (T, blocks of `route_r` experts): the router GEMV x @ gate^T (logits rounded
                                to the model dtype, as nn.Linear stores them, into a float32 [T, E] scratch);
                                the program that takes the token's last ticket (one int32 per token, reset by
                                it, so CUDA graphs replay it as captured) reads the row back and routes it
                                (`_top_k`, `route`'s code): the expert ids and weights for the next two launches
  routed_moe_small(x, gate, ...)   router, gate-up, down: three launches for the whole block (with a shared
                                expert's output and gate logit, the down launch also adds sigmoid(gate) * shared;
                                with `prenorm` the router launch also runs the residual add + RMSNorm before it)
  route(logits, top_k, norm)    one program per row: float32 softmax over the experts, the top k (`_top_k`:
                                every expert's rank in one comparison of all pairs; descending, ties to the
                                lower index, as torch.topk orders distinct values), the renormalisation; one
                                launch for what takes torch four or five.
With programmatic dependent launch (`pdl`, the rules in its docstring; on by default on sm_90+) the block's
three launches are chained: each lets the next launch early (gdc_launch_dependents) right after its own
gdc_wait. The router (after the o projection, which writes x) loads its first gate rows before its wait
(with the mean square over several K steps it waits first); gate-up reads nothing before its wait; down loads
its expert ids before its wait (the router's, finished: gate-up triggers only after its wait) and gate-up's
rows after it. So the launch latency and these loads overlap the launch before; down also lets the kernel
after it (the next layer's input RMSNorm) launch early.
The decode launch shapes (`SmallTiles`, triton_moe_tiles.py) are timed on the device at start-up by
`moe_tune` (candidates around `TUNED`, an H200 sweep of `benchmarks/moe_bench.py`, or `small_tiles`'
rule: column tiles narrow enough for ~4 programs per SM, since a decode MoE layer is a weight read,
75 MB at T=1 for the 30B-A3B thinker, and only many loads in flight on every SM reach copy bandwidth).

Arithmetic is float32 in the tiles; results are rounded to the model dtype where the reference rounds
(the router logits, the product SiLU(gate) * up, the weighted down output), so the two differ by the
order of sums only.
"""

from __future__ import annotations

import os

import torch

from omnistage.layers import pdl, triton_decode, triton_gemv
from omnistage.layers.pdl import gdc_launch_dependents, gdc_wait
from omnistage.layers.triton_moe_tiles import SmallTiles, small_tiles

try:
    import triton
    import triton.language as tl
except ImportError:                                  # CPU-only installs
    triton = None


if triton is not None:
    @triton.jit
    def _pair_gate_up_kernel(x_ptr, w_ptr, out_ptr, ids_ptr, part_ptr, count_ptr, hidden, inter, stride_x,
                             stride_we, stride_wn, stride_out, TOP_K: tl.constexpr, SPLIT: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr,
                             PDL: tl.constexpr = False):
        pair = tl.program_id(0)
        pid_n = tl.program_id(1)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < inter
        token = pair // TOP_K
        if PDL:                                 # the router's ids (and rows) complete; then down may launch
            gdc_wait()
            gdc_launch_dependents()
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        x_row = x_ptr + token.to(tl.int64) * stride_x
        w_base = w_ptr + expert * stride_we
        ks = tl.arange(0, BLOCK_K)
        k_per = tl.cdiv(tl.cdiv(hidden, SPLIT), BLOCK_K) * BLOCK_K    # this program's slice of H
        k_lo = tl.program_id(2) * k_per
        acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in tl.range(k_lo, tl.minimum(hidden, k_lo + k_per), BLOCK_K, loop_unroll_factor=UNROLL):
            k_ok = (k0 + ks) < hidden          # unrolled: more loads in flight
            a = tl.load(x_row + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
            wmask = col_ok[:, None] & k_ok[None, :]
            wg = tl.load(w_base + cols[:, None] * stride_wn + (k0 + ks)[None, :], mask=wmask, other=0.0)
            wu = tl.load(w_base + (cols + inter)[:, None] * stride_wn + (k0 + ks)[None, :], mask=wmask, other=0.0)
            acc_g += tl.sum(wg.to(tl.float32) * a[None, :], axis=1)
            acc_u += tl.sum(wu.to(tl.float32) * a[None, :], axis=1)
        out = out_ptr + pair.to(tl.int64) * stride_out + cols
        if SPLIT == 1:
            _silu_mul_store(acc_g, acc_u, out, col_ok)
        else:
            # float32 partials [SPLIT, 2, pairs * I]; the last of the column block's SPLIT programs (ticket)
            # adds them in slice order, stores, and resets the ticket
            slab = tl.num_programs(0) * inter
            at = part_ptr + tl.program_id(2) * 2 * slab + pair * inter + cols
            tl.store(at, acc_g, mask=col_ok)
            tl.store(at + slab, acc_u, mask=col_ok)
            tl.debug_barrier()
            ticket_at = count_ptr + pair * tl.num_programs(1) + pid_n
            if tl.atomic_add(ticket_at, 1, sem="acq_rel") == SPLIT - 1:
                acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
                acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
                for sp in range(0, SPLIT):
                    at = part_ptr + sp * 2 * slab + pair * inter + cols
                    acc_g += tl.load(at, mask=col_ok, other=0.0, cache_modifier=".cg")
                    acc_u += tl.load(at + slab, mask=col_ok, other=0.0, cache_modifier=".cg")
                _silu_mul_store(acc_g, acc_u, out, col_ok)
                tl.atomic_xchg(ticket_at, 0)

    @triton.jit
    def _silu_mul_store(acc_g, acc_u, out, col_ok):
        dt = out.dtype.element_ty
        g = acc_g.to(dt).to(tl.float32)         # rounded where the reference stores, as in _gate_up_kernel
        u = acc_u.to(dt).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(out, (s * u).to(dt), mask=col_ok)

    @triton.jit
    def _token_down_kernel(h_ptr, w_ptr, out_ptr, weight_ptr, ids_ptr, shared_ptr, gate_ptr, part_ptr, count_ptr,
                           top_k, inter, hidden, stride_h, stride_we, stride_wn, stride_out, stride_s, stride_g,
                           SHARED: tl.constexpr, SPLIT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr = False,
                           PREFETCH: tl.constexpr = False):
        # all K slots of the token in one [slots, BLOCK_N, BLOCK_K] tile: K experts' loads in flight at once;
        # SPLIT > 1: this program's slice of I, float32 partials, the last slice (ticket) finishes
        token = tl.program_id(0)
        pid_n = tl.program_id(1)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < hidden
        slots = tl.arange(0, BLOCK_S)
        s_ok = slots < top_k
        pair = (token * top_k + slots).to(tl.int64)
        expert = tl.load(ids_ptr + pair, mask=s_ok, other=0).to(tl.int64)   # the router's: complete (see the docstring)
        h_rows = h_ptr + pair * stride_h
        w_rows = w_ptr + expert * stride_we
        ks = tl.arange(0, BLOCK_K)
        k_per = tl.cdiv(tl.cdiv(inter, SPLIT), BLOCK_K) * BLOCK_K
        k_lo = tl.program_id(2) * k_per
        acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
        start = k_lo
        if PDL:
            if PREFETCH:                        # the first weight tile needs only the ids: in flight before the wait
                kk = k_lo + ks
                k_ok = kk < inter
                w = tl.load(w_rows[:, None, None] + cols[None, :, None] * stride_wn + kk[None, None, :],
                            mask=s_ok[:, None, None] & col_ok[None, :, None] & k_ok[None, None, :], other=0.0)
            gdc_wait()                          # gate-up's rows complete; the next kernel may launch
            gdc_launch_dependents()
            if PREFETCH:
                a = tl.load(h_rows[:, None] + kk[None, :], mask=s_ok[:, None] & k_ok[None, :], other=0.0)
                acc += tl.sum(w.to(tl.float32) * a.to(tl.float32)[:, None, :], axis=2)
                start = k_lo + BLOCK_K
        for k0 in tl.range(start, tl.minimum(inter, k_lo + k_per), BLOCK_K, loop_unroll_factor=UNROLL):
            kk = k0 + ks
            k_ok = kk < inter
            a = tl.load(h_rows[:, None] + kk[None, :], mask=s_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows[:, None, None] + cols[None, :, None] * stride_wn + kk[None, None, :],
                        mask=s_ok[:, None, None] & col_ok[None, :, None] & k_ok[None, None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * a.to(tl.float32)[:, None, :], axis=2)
        if SPLIT == 1:
            _down_finish(acc, out_ptr, weight_ptr, shared_ptr, gate_ptr, token, pair, cols, col_ok, s_ok, stride_out,
                         stride_s, stride_g, SHARED)
        else:
            tile = part_ptr + ((tl.program_id(2) * tl.num_programs(0) + token) * BLOCK_S + slots)[:, None] * hidden \
                + cols[None, :]
            slab = tl.num_programs(0) * BLOCK_S * hidden
            tl.store(tile, acc, mask=col_ok[None, :])
            tl.debug_barrier()
            ticket_at = count_ptr + token * tl.num_programs(1) + pid_n
            if tl.atomic_add(ticket_at, 1, sem="acq_rel") == SPLIT - 1:
                acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
                for sp in range(0, SPLIT):
                    acc += tl.load(tile + (sp - tl.program_id(2)) * slab, mask=col_ok[None, :], other=0.0,
                                   cache_modifier=".cg")
                _down_finish(acc, out_ptr, weight_ptr, shared_ptr, gate_ptr, token, pair, cols, col_ok, s_ok,
                             stride_out, stride_s, stride_g, SHARED)
                tl.atomic_xchg(ticket_at, 0)

    @triton.jit
    def _down_finish(acc, out_ptr, weight_ptr, shared_ptr, gate_ptr, token, pair, cols, col_ok, s_ok, stride_out,
                     stride_s, stride_g, SHARED: tl.constexpr):
        """The K slots' down rows [slots, BLOCK_N] times their weights, summed (+ the shared term), stored."""
        dt = out_ptr.dtype.element_ty
        rw = tl.load(weight_ptr + pair, mask=s_ok, other=0.0).to(dt).to(tl.float32)
        y = (acc.to(dt).to(tl.float32) * rw[:, None]).to(dt).to(tl.float32)   # per slot, as the reference rounds
        total = tl.sum(y, axis=0).to(dt)
        if SHARED:                              # + sigmoid(gate logit) * the shared expert's row, rounded as torch
            g = tl.load(gate_ptr + token.to(tl.int64) * stride_g).to(tl.float32)
            sh = tl.load(shared_ptr + token.to(tl.int64) * stride_s + cols, mask=col_ok, other=0.0).to(tl.float32)
            sig = (1.0 / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
            total = (total.to(tl.float32) + (sig * sh).to(dt).to(tl.float32)).to(dt)
        tl.store(out_ptr + token.to(tl.int64) * stride_out + cols, total, mask=col_ok)

    @triton.jit
    def _top_k(z, es, ok, TOP_K: tl.constexpr, NORM: tl.constexpr, BLOCK_S: tl.constexpr):
        """One row's router logits z float32 [BLOCK_E] (at experts `es`, `ok`: real ones) -> (weights float32
        [BLOCK_S], expert ids int32 [BLOCK_S]), slots past TOP_K zero: float32 softmax, the top k, the
        renormalisation when NORM. Expert i's rank is #(p_j > p_i) + #(p_j == p_i, j < i), all of them from one
        [BLOCK_E, BLOCK_E] comparison (no chain of TOP_K argmax reductions); the experts ranked below TOP_K go to
        slot rank: descending, ties to the lower index, what repeated argmax(tie_break_left) picked. Each slot's
        id and weight are the one ranked expert's (a sum of it and zeros: exact). Both tiles put the experts
        compared against (j) and the experts gathered along axis 0: sm_90 compiles keep that axis in each
        thread's registers (4 warps: 936 SASS instructions, 25 shuffles; the transpose needed 1680 and 281)."""
        z = tl.where(ok, z, -float("inf"))
        e = tl.exp(z - tl.max(z, axis=0))
        p = tl.where(ok, e / tl.sum(e, axis=0), -1.0)   # below every probability: ranked after every real expert
        ahead = (p[:, None] > p[None, :]) | ((p[:, None] == p[None, :]) & (es[:, None] < es[None, :]))   # [j, i]
        rank = tl.sum(ahead.to(tl.int32), axis=0)
        slots = tl.arange(0, BLOCK_S)
        hit = (rank[:, None] == slots[None, :]) & (slots < TOP_K)[None, :]      # [BLOCK_E, BLOCK_S]
        weights = tl.sum(tl.where(hit, p[:, None], 0.0), axis=0)
        ids = tl.sum(tl.where(hit, es[:, None], 0), axis=0)
        if NORM:
            weights = weights / tl.sum(weights, axis=0)
        return weights, ids

    @triton.jit
    def _store_route(weights_ptr, ids_ptr, row, weights, ids, TOP_K: tl.constexpr, BLOCK_S: tl.constexpr):
        slots = tl.arange(0, BLOCK_S)
        base = row.to(tl.int64) * TOP_K
        tl.store(weights_ptr + base + slots, weights, mask=slots < TOP_K)
        tl.store(ids_ptr + base + slots, ids.to(tl.int64), mask=slots < TOP_K)

    @triton.jit
    def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_l, TOP_K: tl.constexpr,
                      NORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr):
        row = tl.program_id(0)
        es = tl.arange(0, BLOCK_E)
        ok = es < num_experts
        z = tl.load(logits_ptr + row.to(tl.int64) * stride_l + es, mask=ok, other=0.0).to(tl.float32)
        weights, ids = _top_k(z, es, ok, TOP_K, NORM, BLOCK_S)
        _store_route(weights_ptr, ids_ptr, row, weights, ids, TOP_K, BLOCK_S)

    @triton.jit
    def _router_kernel(x_ptr, r_ptr, nw_ptr, h_ptr, xn_ptr, g_ptr, logits_ptr, weights_ptr, ids_ptr, count_ptr,
                       num_experts, hidden, eps, stride_x, stride_r, stride_g, NORMED: tl.constexpr,
                       SINGLE: tl.constexpr,
                       TOP_K: tl.constexpr, NORM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False):
        # grid (token, blocks of BLOCK_R experts): each program's router logits (x @ gate^T, rounded to the
        # model dtype as nn.Linear stores them) go to a float32 [T, E] scratch; the program that takes
        # the token's last ticket reads the whole row back, routes it and resets the ticket to 0.
        # NORMED: x is RMSNorm(x + residual) * nw first (each program recomputes the row's mean square;
        # the first column of programs stores h = x + residual and the normed row, rows [T, H] contiguous)
        if PDL and NORMED and not SINGLE:       # the mean square below reads the rows first
            gdc_wait()                          # (the kernel before, the o projection, writes x)
            gdc_launch_dependents()             # gate-up may launch (it waits for this grid)
        token = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = rows < num_experts
        ks = tl.arange(0, BLOCK_K)
        dt = x_ptr.dtype.element_ty
        x_row = x_ptr + token.to(tl.int64) * stride_x
        r_row = r_ptr + token.to(tl.int64) * stride_r
        rstd = eps * 0.0
        if NORMED and not SINGLE:               # SINGLE (one K step): the mean square below, from the same loads
            ss = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for k0 in range(0, hidden, BLOCK_K):
                k_ok = (k0 + ks) < hidden
                hv = _residual_sum(x_row, r_row, k0 + ks, k_ok, dt)
                ss += hv * hv
            rstd = tl.rsqrt(tl.sum(ss, axis=0) / hidden + eps)
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k_ok = (k0 + ks) < hidden
            w = tl.load(g_ptr + rows[:, None] * stride_g + (k0 + ks)[None, :], mask=r_ok[:, None] & k_ok[None, :],
                        other=0.0)              # first: in flight while the row is normed
            if PDL and (SINGLE or not NORMED):
                if k0 == 0:                     # the first gate rows (weights) before the wait, x after it
                    gdc_wait()
                    gdc_launch_dependents()
            if NORMED:                          # rounded as fused.rms_norm_ref: h, h * rstd, then times the weight
                hv = _residual_sum(x_row, r_row, k0 + ks, k_ok, dt)
                if SINGLE:
                    rstd = tl.rsqrt(tl.sum(hv * hv, axis=0) / hidden + eps)
                nw = tl.load(nw_ptr + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
                a = (nw * (hv * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
                if tl.program_id(1) == 0:
                    out_at = token.to(tl.int64) * hidden + k0 + ks
                    tl.store(h_ptr + out_at, hv.to(dt), mask=k_ok)
                    tl.store(xn_ptr + out_at, a.to(dt), mask=k_ok)
            else:
                a = tl.load(x_row + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
            acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
        row_base = logits_ptr + token.to(tl.int64) * num_experts
        tl.store(row_base + rows, acc.to(dt).to(tl.float32), mask=r_ok)
        tl.debug_barrier()                              # every thread's logits before the ticket
        ticket = tl.atomic_add(count_ptr + token, 1, sem="acq_rel")
        if ticket == tl.num_programs(1) - 1:
            es = tl.arange(0, BLOCK_E)
            ok = es < num_experts
            z = tl.load(row_base + es, mask=ok, other=0.0, cache_modifier=".cg")
            weights, ids = _top_k(z, es, ok, TOP_K, NORM, BLOCK_S)
            _store_route(weights_ptr, ids_ptr, token, weights, ids, TOP_K, BLOCK_S)
            tl.atomic_xchg(count_ptr + token, 0)

    @triton.jit
    def _residual_sum(x_row, r_row, ks, k_ok, dt):
        """(x + residual) rounded to the model dtype, as float32."""
        x = tl.load(x_row + ks, mask=k_ok, other=0.0).to(tl.float32)
        r = tl.load(r_row + ks, mask=k_ok, other=0.0).to(tl.float32)
        return (x + r).to(dt).to(tl.float32)


SMALL_PAIRS = 64                                # T*K at most for `fused_moe_small` (decode sizes)
ROUTER_ROWS = 64                                # T at most for `small_route` before the sorted kernels (moe.py)


# OMNISTAGE_MOE_DOWN_PREFETCH ("1" default, "0" off; with PDL only): the down launch loads its first weight tile
# before its gdc_wait (the weights depend only on the router's expert ids, complete by then), so that tile's
# latency overlaps gate-up's tail.
DOWN_PREFETCH = os.environ.get("OMNISTAGE_MOE_DOWN_PREFETCH", "1") == "1"


def _with_prefetch(launch: dict) -> dict:
    return {**launch, "PREFETCH": True} if launch and DOWN_PREFETCH else launch


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe.route` in one launch (see the module docstring): (weights float32 [T, K], ids int64 [T, K])."""
    t, e = router_logits.shape
    logits = router_logits.contiguous()
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    _route_kernel[(t,)](logits, weights, ids, e, logits.stride(0), TOP_K=top_k, NORM=bool(norm_topk_prob),
                        BLOCK_E=triton.next_power_of_2(e), BLOCK_S=triton.next_power_of_2(top_k))
    return weights, ids


def fused_moe_small(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, tiles: SmallTiles | None = None) -> torch.Tensor:
    """`fused_moe` without the sort (see the module docstring); `tiles` None: `small_tiles` of this shape."""
    t, k = topk_ids.shape
    tiles = tiles or small_tiles(t, k, w13.shape[2], w2.shape[2], triton_gemv._num_sms(x.device))
    mid = small_gate_up(x, w13, topk_ids, tiles)
    return small_down(mid, w2, topk_weights, topk_ids, tiles)


def routed_moe_small(x: torch.Tensor, gate: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
                     norm_topk_prob: bool, tiles: SmallTiles | None = None,
                     shared: tuple[torch.Tensor, torch.Tensor] | None = None,
                     prenorm: tuple[torch.Tensor, torch.Tensor, float] | None = None):
    """The router (x @ gate^T, gate [E, H]) with softmax and top-k, then `fused_moe_small`: three launches.
    `shared` = (a shared expert's output [T, H], its gate logits [T, 1]): the down launch also adds
    sigmoid(gate) * shared. `prenorm` = (residual, RMSNorm weight, eps): the block runs on RMSNorm(x +
    residual), normed inside the router launch, and returns (out, x + residual)."""
    t = x.shape[0]
    tiles = tiles or small_tiles(t, top_k, w13.shape[2], w2.shape[2], triton_gemv._num_sms(x.device))
    routed = small_route(x, gate, top_k, norm_topk_prob, tiles, prenorm)
    weights, ids = routed[:2]
    rows = x if prenorm is None else routed[2]
    out = small_down(small_gate_up(rows, w13, ids, tiles), w2, weights, ids, tiles, shared)
    return out if prenorm is None else (out, routed[3])


def small_route(x: torch.Tensor, gate: torch.Tensor, top_k: int, norm_topk_prob: bool, tiles: SmallTiles,
                prenorm: tuple[torch.Tensor, torch.Tensor, float] | None = None):
    """`moe.route(x @ gate^T, ...)` in one launch (`_router_kernel`): (weights float32 [T, K], ids int64 [T, K]).
    With `prenorm` = (residual [T, H], RMSNorm weight [H], eps) the rows are RMSNorm(x + residual) first:
    (weights, ids, normed rows [T, H], x + residual [T, H])."""
    t, h = x.shape
    e = gate.shape[0]
    x, gate = x.contiguous(), gate.contiguous()
    logits = torch.empty(t, e, dtype=torch.float32, device=x.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=x.device)
    if prenorm is not None:
        residual, norm_weight, eps = prenorm
        residual = residual.contiguous()
        hsum, normed = torch.empty_like(x), torch.empty_like(x)
    else:
        residual, norm_weight, eps, hsum, normed = x, x, 0.0, x, x
    block_k = min(tiles.route_k, triton.next_power_of_2(h))
    _router_kernel[(t, triton.cdiv(e, tiles.route_r))](
        x, residual, norm_weight, hsum, normed, gate, logits, weights, ids, triton_decode.counters(gate, x.device), e,
        h, float(eps), x.stride(0), residual.stride(0), gate.stride(0), NORMED=prenorm is not None,
        SINGLE=block_k >= h, TOP_K=top_k, NORM=bool(norm_topk_prob), BLOCK_R=tiles.route_r, BLOCK_K=block_k,
        BLOCK_E=triton.next_power_of_2(e), BLOCK_S=triton.next_power_of_2(top_k), num_warps=tiles.route_warps,
        **pdl.launch(x))
    return (weights, ids) if prenorm is None else (weights, ids, normed, hsum)


def small_gate_up(x: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor, tiles: SmallTiles) -> torch.Tensor:
    """`fused_moe_small`'s first launch: SiLU(gate) * up of every (token, slot) pair [T*K, I] (with
    `tiles.up_split` > 1 each program sums a slice of H; the last of a column block's slices finishes it)."""
    t, k = topk_ids.shape
    inter, h = w13.shape[1] // 2, w13.shape[2]
    x, w13 = x.contiguous(), w13.contiguous()
    mid = torch.empty(t * k, inter, dtype=x.dtype, device=x.device)
    grid = (t * k, triton.cdiv(inter, tiles.up_n), tiles.up_split)
    split = tiles.up_split > 1
    part = torch.empty(tiles.up_split * 2 * t * k * inter if split else 1, dtype=torch.float32, device=x.device)
    tickets = triton_decode.counters(w13, x.device) if split else part
    if split and grid[0] * grid[1] > tickets.numel():
        raise ValueError(f"small_gate_up: {grid[0] * grid[1]} column blocks, more than {tickets.numel()} tickets")
    _pair_gate_up_kernel[grid](
        x, w13, mid, topk_ids.reshape(-1).contiguous(), part, tickets, h, inter, x.stride(0), w13.stride(0),
        w13.stride(1), mid.stride(0), TOP_K=k, SPLIT=tiles.up_split, BLOCK_N=tiles.up_n, BLOCK_K=tiles.up_k,
        UNROLL=tiles.up_unroll, num_warps=tiles.up_warps, **pdl.launch(x))
    return mid


def small_down(mid: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
               tiles: SmallTiles, shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """`fused_moe_small`'s second launch: per token, the K down GEMVs times their weights, summed [T, H]
    (plus sigmoid(gate) * shared, see `routed_moe_small`)."""
    t, k = topk_ids.shape
    h, inter = w2.shape[1], w2.shape[2]
    w2 = w2.contiguous()
    out = torch.empty(t, h, dtype=mid.dtype, device=mid.device)
    rows, gate = shared if shared is not None else (out, out)
    grid = (t, triton.cdiv(h, tiles.down_n), tiles.down_split)
    split = tiles.down_split > 1
    slots = triton.next_power_of_2(k)
    part = torch.empty(tiles.down_split * t * slots * h if split else 1, dtype=torch.float32, device=mid.device)
    tickets = triton_decode.counters(w2, mid.device) if split else part
    if split and grid[0] * grid[1] > tickets.numel():
        raise ValueError(f"small_down: {grid[0] * grid[1]} column blocks, more than {tickets.numel()} tickets")
    _token_down_kernel[grid](
        mid, w2, out, topk_weights.reshape(-1).contiguous(), topk_ids.reshape(-1).contiguous(), rows, gate, part,
        tickets, k, inter, h, mid.stride(0), w2.stride(0), w2.stride(1), out.stride(0), rows.stride(0),
        gate.stride(0), SHARED=shared is not None, SPLIT=tiles.down_split, BLOCK_S=slots, BLOCK_N=tiles.down_n,
        BLOCK_K=tiles.down_k, UNROLL=tiles.down_unroll, num_warps=tiles.down_warps,
        **_with_prefetch(pdl.launch(mid)))
    return out
