"""Fused small-M GEMVs for decode steps (CUDA; the Triton interpreter runs
them on CPU tensors in tests; `reference` is the PyTorch maths everywhere else).

In: activation rows x [M, K] (bf16 / fp16, M <= MAX_M: a decode step's tokens), a weight w [N, K] in x's
dtype or float8_e4m3fn with one float32 scale per output row, an optional bias, and what rides along:
  prologue  `residual`: h = x + residual first (h is also returned: the residual stream), and/or
            `norm_weight`: RMSNorm(h) * norm_weight (each program recomputes the row's norm: the row
            is only hidden-size long)
  epilogue  `gated`: w holds [gate | up] rows and the output is silu(gate) * up (each program owns the
            gate and the up rows of its columns); `add`: out + add (the residual add after o / down)
Out: [M, N] (gated: [M, N / 2]) in x's dtype, and h with `residual`. Called by models/llama.py's decoder
layers, in the stage process.

A decoder layer at M <= MAX_M (models/llama.py) picks per linear: qkv with the residual add + input RMSNorm
prologue (+ bias), then `Attention._attend` (rotary, KV write, paged attention), o alone (its residual add
rides in the next norm: the post-attention RMSNorm, or the MoE router launch), the dense MLP as gate_up with
the residual add + RMSNorm prologue and SiLU*mul, down + residual.

How the weight is read at bandwidth: each program owns BLOCK_N output columns and one of SPLIT_K slices
of K, so a small-N matrix (o, down: N = hidden) still gives every SM several programs. With SPLIT_K > 1
each program stores its float32 partial sums and takes a ticket from a per-column-block counter; the
program that takes the last ticket adds the SPLIT_K partials in slice order (deterministic: the same
sum whichever program finishes last), runs the epilogue and resets the counter to 0 (so a CUDA graph
replays it as captured). M == 1 multiplies and reduces on CUDA cores; M > 1 uses `tl.dot` on a 16-row
tile (rows masked, never padded in memory). FP8 weights take the same kernel: converted in registers,
scaled per output row after the sum, so they read half the bytes. No host syncs; the grid depends only
on the shapes (captured in the AR engine's decode graphs). Tiles: `TILES` (triton_decode_tiles.py: an H200 sweep of
benchmarks/decode_layer_bench.py --sweep) or `tiles`' rule.

Rounding follows the unfused path (what the model runs on CPU and for M > MAX_M): h, the normed rows,
the linear's output, silu(gate) and the sums are rounded to x's dtype where the unfused path stores
them, so outputs differ from `reference` by float32 summation order only.

Which linears take it (`chooses`, per linear, its rows and its fusion): `OMNISTAGE_DECODE_KERNELS`, read at
import into `ENABLED`: "0" never (False), "1" always where `serves` (True), unset by the table (None): only
where the `TILES` entry of (M, N, K, weight bytes, fusion) was measured faster than cuBLAS plus the launches
the fusion replaces. Session 7, run 2 (benchmarks/RESULTS.md, Qwen2.5-1.5B, one layer in a CUDA graph): a
whole fused layer was slower (60.3 vs 56.2 us at M = 1 in bf16; ~0.7x at M = 2..8; at M = 1 qkv 6.5 us vs
cuBLAS 4.4, gate_up 24.6 vs 16.8, down 12.1 vs 9.6 + its reduce; o 4.0 vs 6.2), hence the per-linear table.
Session 9, run 4 (the Qwen3-Omni thinker, bf16): at M = 1 qkv with the norm prologue 10.0 us vs 7.9 (norm
kernel + cuBLAS), o 8.1 vs 7.7; only o at M = 2, 4 wins (6.9 vs 7.4 / 7.2), so the thinker's bs1 step stays unfused.
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.layers import fused
from omnistage.layers.fp8_linear import Fp8Linear
from omnistage.layers.triton_decode_tiles import TILES

try:
    import triton
    import triton.language as tl
except ImportError:                             # CPU-only installs: the unfused path
    triton = None

_MODES = {"0": False, "1": True, "": None}


def _mode(value: str) -> Optional[bool]:
    """`OMNISTAGE_DECODE_KERNELS` -> `ENABLED`."""
    if value not in _MODES:
        raise ValueError(f"OMNISTAGE_DECODE_KERNELS must be 0 (never), 1 (always) or unset (by the measured "
                         f"tiles table), got {value!r}")
    return _MODES[value]


# False: never; True: always where `serves`; None: where `TILES` says the fused launch is faster
ENABLED = _mode(os.environ.get("OMNISTAGE_DECODE_KERNELS", ""))
MAX_M = 8                                       # rows these kernels serve (decode steps up to batch 8)
MAX_SPLIT = 16                                  # most K slices per column block


def reference(x: torch.Tensor, w: torch.Tensor, scale: Optional[torch.Tensor] = None,
              bias: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None,
              norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6, gated: bool = False,
              add: Optional[torch.Tensor] = None):
    """The unfused path's maths: the same arguments and results as `decode_gemv`."""
    h = x if residual is None else x + residual
    xn = h if norm_weight is None else fused.rms_norm_ref(h, norm_weight, eps).to(x.dtype)
    wf = w.float() if scale is None else w.float() * scale.float()
    y = xn.float() @ wf.t()
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    if add is not None:
        y = y + add
    return y if residual is None else (y, h)


if triton is not None:
    @triton.jit
    def _rows_in(x_ptr, r_ptr, rm, k, mask, stride_x, stride_r, HAS_RES: tl.constexpr):
        """x rows (plus the residual, rounded) [BLOCK_M, BLOCK_K]."""
        x = tl.load(x_ptr + rm[:, None] * stride_x + k[None, :], mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(r_ptr + rm[:, None] * stride_r + k[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        return x

    @triton.jit
    def _partial(x, w_ptr, rn, k, w_mask, stride_w, USE_DOT: tl.constexpr):
        w = tl.load(w_ptr + rn[:, None] * stride_w + k[None, :], mask=w_mask, other=0.0)
        if USE_DOT:
            return tl.dot(x, tl.trans(w.to(x.dtype)))
        return tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)

    @triton.jit
    def _finish(acc, acc2, scale_ptr, bias_ptr, add_ptr, out_ptr, rm, rn, up, m_ok, n_ok, stride_add,
                stride_out, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                HAS_ADD: tl.constexpr):
        """Scale, bias (the linear's output rounded), then silu(gate) * up, + add; store."""
        dt = out_ptr.dtype.element_ty
        if HAS_SCALE:
            acc = acc * tl.load(scale_ptr + rn, mask=n_ok, other=0.0)[None, :]
            if GATED:
                acc2 = acc2 * tl.load(scale_ptr + up, mask=n_ok, other=0.0)[None, :]
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc2 = acc2 + tl.load(bias_ptr + up, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y = acc.to(dt).to(tl.float32)
        mask = m_ok[:, None] & n_ok[None, :]
        if GATED:
            y = (y / (1.0 + tl.exp(-y))).to(dt).to(tl.float32) * acc2.to(dt).to(tl.float32)
        if HAS_ADD:
            y = y.to(dt).to(tl.float32) + tl.load(add_ptr + rm[:, None] * stride_add + rn[None, :], mask=mask,
                                                  other=0.0).to(tl.float32)
        tl.store(out_ptr + rm[:, None] * stride_out + rn[None, :], y.to(dt), mask=mask)

    # M and SPLIT_K are not specialized on: one compile serves every decode batch bucket and K split of a shape
    @triton.jit(do_not_specialize=["M", "SPLIT_K"])
    def _decode_gemv_kernel(x_ptr, r_ptr, h_ptr, nw_ptr, w_ptr, scale_ptr, bias_ptr, add_ptr, out_ptr, part_ptr,
                            count_ptr, M, N, K, SPLIT_K, eps, stride_x, stride_r, stride_h, stride_w, stride_add,
                            stride_out, HAS_RES: tl.constexpr, NORM: tl.constexpr, HAS_SCALE: tl.constexpr,
                            HAS_BIAS: tl.constexpr, GATED: tl.constexpr, HAS_ADD: tl.constexpr,
                            USE_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)   # output columns
        rm = tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < N
        m_ok = rm < M
        up = rn + N                                     # GATED: the up row of each gate row
        if NORM:                                        # the whole rows' mean square, in every program
            ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + rk
                xm = m_ok[:, None] & (k < K)[None, :]
                h = _rows_in(x_ptr, r_ptr, rm, k, xm, stride_x, stride_r, HAS_RES).to(tl.float32)
                ss += tl.sum(h * h, axis=1)
            rstd = tl.rsqrt(ss / K + eps)
        k_per = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_lo = pid_k * k_per
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, tl.minimum(K, k_lo + k_per), BLOCK_K):
            k = k0 + rk
            k_ok = k < K
            xm = m_ok[:, None] & k_ok[None, :]
            x = _rows_in(x_ptr, r_ptr, rm, k, xm, stride_x, stride_r, HAS_RES)
            if HAS_RES:                                 # h = x + residual, stored once: by the first column block
                tl.store(h_ptr + rm[:, None] * stride_h + k[None, :], x, mask=xm & (pid_n == 0))
            if NORM:
                dt = x.dtype
                nw = tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
                x = ((x.to(tl.float32) * rstd[:, None]).to(dt).to(tl.float32) * nw[None, :]).to(dt)
            w_mask = n_ok[:, None] & k_ok[None, :]
            acc += _partial(x, w_ptr, rn, k, w_mask, stride_w, USE_DOT)
            if GATED:
                acc2 += _partial(x, w_ptr, up, k, w_mask, stride_w, USE_DOT)
        if SPLIT_K == 1:
            _finish(acc, acc2, scale_ptr, bias_ptr, add_ptr, out_ptr, rm, rn, up, m_ok, n_ok, stride_add,
                    stride_out, HAS_SCALE, HAS_BIAS, GATED, HAS_ADD)
        else:
            # partials [SPLIT_K, 2, BLOCK_M, N] float32; the last program of the column block reduces them
            tile = rm[:, None] * N + rn[None, :]
            pmask = m_ok[:, None] & n_ok[None, :]
            slab = 2 * BLOCK_M * N
            tl.store(part_ptr + pid_k * slab + tile, acc, mask=pmask)
            if GATED:
                tl.store(part_ptr + pid_k * slab + BLOCK_M * N + tile, acc2, mask=pmask)
            tl.debug_barrier()                          # every thread's partials before the ticket
            ticket = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
            if ticket == SPLIT_K - 1:
                tl.debug_barrier()
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in range(0, SPLIT_K):
                    acc += tl.load(part_ptr + s * slab + tile, mask=pmask, other=0.0, cache_modifier=".cg")
                    if GATED:
                        acc2 += tl.load(part_ptr + s * slab + BLOCK_M * N + tile, mask=pmask, other=0.0,
                                        cache_modifier=".cg")
                _finish(acc, acc2, scale_ptr, bias_ptr, add_ptr, out_ptr, rm, rn, up, m_ok, n_ok,
                        stride_add, stride_out, HAS_SCALE, HAS_BIAS, GATED, HAS_ADD)
                tl.atomic_xchg(count_ptr + pid_n, 0)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4                                # the interpreter: small grids, split-K still exercised
    return torch.cuda.get_device_properties(device).multi_processor_count


_OWN = SimpleNamespace()                        # owner of the tickets of calls that pass none
_COUNTER_SLOTS = 1 << 14                         # column blocks a launch may have (7B gate_up at 4 per block: 4736)


def counters(owner, device: torch.device) -> torch.Tensor:
    """`owner`'s split-K tickets, one int32 per column block, zero between launches (each launch resets its
    own). Its launches run one after another on one stream, so one buffer serves all of them; callers that
    may run side by side (stages sharing a GPU, each on its own stream) pass different owners. Made on
    the first call (the decode graphs' warm-up steps run before capture)."""
    if "_decode_counters" not in owner.__dict__:
        owner._decode_counters = {}             # device -> tickets (a plain attribute: no state_dict entry)
    if device not in owner._decode_counters:
        owner._decode_counters[device] = torch.zeros(_COUNTER_SLOTS, dtype=torch.int32, device=device)
    return owner._decode_counters[device]


def fusion(norm: bool = False, bias: bool = False, gated: bool = False, add: bool = False) -> str:
    """The `TILES` key's name of what rides in a launch: the present parts joined by "+" in this order
    ("" for the GEMV alone). `norm`: the RMSNorm prologue (with or without the residual add)."""
    return "+".join(name for name, on in (("norm", norm), ("bias", bias), ("gated", gated), ("add", add)) if on)


def tiles(m: int, n: int, k: int, weight_bytes: int, two: bool, sms: int,
          parts: str = "") -> tuple[int, int, int, bool, int, int]:
    """(BLOCK_N, BLOCK_K, SPLIT_K, use_dot, num_warps, num_stages) for an [m, k] x [n, k]^T product (n:
    the weight's rows; `two`: each output column reads two of them, gate and up; `parts`:
    `fusion`'s name of the launch). The swept `TILES` entry when there is one; else M == 1: CUDA-core reduce over 8 weight rows (4 pairs when
    `two`) and 1 KiB of each row per step; M > 1: a 16-row `tl.dot` tile of 16 columns and 512 B of each
    row per step; then the fewest K slices (a power of two, each at least two K steps) that give every SM
    4 programs (1.5B down_proj at M = 1: 4 slices, 768 programs)."""
    hit = TILES.get((m, n, k, weight_bytes, parts))
    if hit is not None:
        return hit.config
    use_dot = m > 1
    cols = n // 2 if two else n
    block_n = 16 if use_dot else (4 if two else 8)
    block_k = max(16, min((512 if use_dot else 1024) // weight_bytes, triton.next_power_of_2(k)))
    blocks = triton.cdiv(cols, block_n)
    split = 1
    while split < MAX_SPLIT and blocks * split < 4 * sms and k >= 4 * split * block_k:
        split *= 2
    return block_n, block_k, split, use_dot, 4, 2


def decode_gemv(x: torch.Tensor, w: torch.Tensor, scale: Optional[torch.Tensor] = None,
                bias: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None,
                norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6, gated: bool = False,
                add: Optional[torch.Tensor] = None, config: Optional[tuple] = None,
                tickets: Optional[torch.Tensor] = None):
    """x [M, K] (M <= MAX_M), w [N, K] contiguous (x's dtype with scale None, or fp8 with `scale` [N, 1] float32),
    bias [N], residual [M, K], norm_weight [K], add [M, N or N / 2] or None -> out [M, N] ([M, N / 2] gated),
    and with `residual` (out, x + residual). `config`: `tiles`' tuple, overriding it (the tile sweep).
    `tickets`: `counters(owner, device)` of the caller (None: this module's own, for callers that never run
    on two streams at once)."""
    m, k = x.shape
    n = w.shape[0]
    if m > MAX_M or w.shape[1] != k or (gated and n % 2):
        raise ValueError(f"decode_gemv: x {tuple(x.shape)} and w {tuple(w.shape)} need M <= {MAX_M}, equal K "
                         "and (gated) an even N")
    x = x if x.stride(-1) == 1 else x.contiguous()
    cols = n // 2 if gated else n                   # the output's columns
    out = torch.empty(m, cols, device=x.device, dtype=x.dtype)
    h = torch.empty_like(x) if residual is not None else x
    r = residual if residual is None or residual.stride(-1) == 1 else residual.contiguous()
    a = add if add is None or add.stride(-1) == 1 else add.contiguous()
    parts = fusion(norm_weight is not None, bias is not None, gated, add is not None)
    block_n, block_k, split, use_dot, warps, stages = config or tiles(m, n, k, w.element_size(), gated,
                                                                      _num_sms(x.device), parts)
    block_m = 16 if use_dot else triton.next_power_of_2(m)
    grid = (triton.cdiv(cols, block_n), split)
    part = torch.empty(split * 2 * block_m * cols if split > 1 else 1, device=x.device, dtype=torch.float32)
    count = counters(_OWN, x.device) if tickets is None else tickets
    if grid[0] > count.numel():
        raise ValueError(f"decode_gemv: {grid[0]} column blocks, more than the {count.numel()} split-K counters")
    _decode_gemv_kernel[grid](
        x, x if r is None else r, h, x if norm_weight is None else norm_weight, w, w if scale is None else scale,
        w if bias is None else bias, x if a is None else a, out, part, count, m, cols, k, split, eps, x.stride(0),
        0 if r is None else r.stride(0), h.stride(0), w.stride(0), 0 if a is None else a.stride(0), out.stride(0),
        HAS_RES=r is not None, NORM=norm_weight is not None, HAS_SCALE=scale is not None, HAS_BIAS=bias is not None,
        GATED=gated, HAS_ADD=a is not None, USE_DOT=use_dot, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages)
    return out if residual is None else (out, h)


def weights(linear: nn.Module) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(weight, per-row scale or None, bias or None) of an `nn.Linear` or `Fp8Linear`."""
    if isinstance(linear, Fp8Linear):
        return linear.weight_fp8, linear.weight_scale, linear.bias
    return linear.weight, None, linear.bias


def serves(x: torch.Tensor, *linears: nn.Module) -> bool:
    """Whether the fused kernels can run rows like `x` through `linears`: CUDA with Triton (fused.ENABLED),
    at most MAX_M 16-bit rows, every linear a plain `nn.Linear` in x's dtype or an `Fp8Linear` (tensor-parallel
    shards are other types: they keep the unfused path)."""
    if not (fused.use_triton(x) and x.dim() == 2 and 0 < x.shape[0] <= MAX_M
            and x.dtype in (torch.bfloat16, torch.float16)):
        return False
    for lin in linears:
        if type(lin) is nn.Linear:
            if lin.weight.dtype != x.dtype or not lin.weight.is_contiguous():
                return False
        elif type(lin) is not Fp8Linear:
            return False
    return True


def chooses(x: torch.Tensor, linear: nn.Module, parts: str) -> bool:
    """Whether rows like `x` go through `linear` with the fusion `parts` (`fusion`'s name) in one
    `decode_gemv` launch: never with `ENABLED` False; where `serves`, always with True, and with None (the
    default) where its `TILES` entry was measured faster than the unfused path."""
    if ENABLED is False or not serves(x, linear):
        return False
    if ENABLED:
        return True
    w = weights(linear)[0]
    hit = TILES.get((x.shape[0], w.shape[0], w.shape[1], w.element_size(), parts))
    return hit is not None and hit.unfused_us is not None and hit.us < hit.unfused_us
