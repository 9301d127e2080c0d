"""Small-M GEMV / skinny GEMM for decode steps (CUDA; the Triton interpreter runs it on CPU tensors in tests).

In: activations x [M, K] (bf16 / fp16; M <= MAX_M rows, a decode step's tokens), a weight w [N, K]
(float8_e4m3fn with one float32 scale per output row, or the activations' own dtype with no scale),
an optional bias [N]. Out: x @ (w * scale)^T + bias [M, N] in x's dtype, accumulated in float32.

Why: at M = 1..16 a linear layer is a weight read. `torch._scaled_mm` (W8A8) wants M padded to 16 and
quantizes the activations first (extra kernels per layer), and cuBLAS' bf16 GEMV leaves the small
matrices (qkv, o at 5-6 MB) far from copy bandwidth. This kernel reads every weight byte once:
each program owns BLOCK_N whole output columns and walks all of K (no split-K, so no atomics, no
second reduce launch, and a deterministic sum); `tiles` picks BLOCK_N and the K step per shape
(M = 1: the fastest of an H200 tile sweep; M > 1: enough programs per SM). FP8 weights are W8A16: the weight is converted to the activations' dtype
in registers and scaled per output row after the K loop; the activations stay bf16 (no activation
quantization: at small M the bytes are all in the weight, so W8A16 halves them like W8A8 would,
with less error). M == 1 multiplies and reduces on CUDA cores; 2 <= M <= 16 uses `tl.dot` on one
16-row tile (masked rows, never padded in memory).

The launch has no host syncs and its grid depends only on (M, N, K), so it is captured in the AR
engine's decode CUDA graphs like any kernel. `reference` is the same maths in PyTorch.

Also here, for the W8A8 regime above MAX_M rows: `quantize_rows(x)`, the per-token FP8 quantization
of the activations (fp8_linear.quantize_rows' maths) in one launch instead of ~6 elementwise
kernels per linear layer (which a 64- or 256-row decode graph would otherwise replay 4 x layers times).
Checked against the references under Triton's interpreter by tests/ar/test_fp8.py and on the GPU
(with timings against cuBLAS and the bandwidth floor) by benchmarks/gemv_bench.py.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:                             # CPU-only installs: `reference` is the path
    triton = None

MAX_M = 16                                      # rows this kernel serves; above, a GEMM (cuBLAS / _scaled_mm) wins
_TARGET_PROGRAMS_PER_SM = 2                      # enough programs in flight to keep every SM's loads busy


def reference(x: torch.Tensor, w: torch.Tensor, scale: Optional[torch.Tensor] = None,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x @ (w * scale)^T + bias in float32, cast to x's dtype (scale [N, 1] or None)."""
    wf = w.float() if scale is None else w.float() * scale.float()
    out = x.float() @ wf.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


if triton is not None:
    # M is not specialized on (1, multiples of 16): one compile serves every decode batch bucket of a shape
    @triton.jit(do_not_specialize=["M"])
    def _gemv_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                     HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < N
        m_ok = rm < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            k_ok = k < K
            w = tl.load(w_ptr + rn[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            if USE_DOT:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))
            else:
                acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        if HAS_SCALE:
            acc = acc * tl.load(scale_ptr + rn, mask=n_ok, other=0.0)[None, :]
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


if triton is not None:
    @triton.jit
    def _quantize_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, stride_qm, FP8_MAX: tl.constexpr,
                         BLOCK_K: tl.constexpr):
        row = tl.program_id(0)
        rk = tl.arange(0, BLOCK_K)
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + row * stride_xm + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / FP8_MAX
        tl.store(scale_ptr + row, scale)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + row * stride_xm + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
            tl.store(q_ptr + row * stride_qm + k0 + rk, q.to(q_ptr.dtype.element_ty), mask=k0 + rk < K)


def quantize_rows(x: torch.Tensor, fp8_max: float = 448.0, out_dtype: torch.dtype = torch.float8_e4m3fn
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (last dim contiguous) -> (x / scale clamped to +-448 [M, K] in `out_dtype`, float32 scales
    [M, 1] = amax / 448 per row). `out_dtype` float32 keeps the values before the FP8 cast (tests: the
    Triton interpreter's float32 -> float8 cast mis-rounds values just below a power of two)."""
    m, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    q = torch.empty(m, k, device=x.device, dtype=out_dtype)
    scale = torch.empty(m, 1, device=x.device, dtype=torch.float32)
    _quantize_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), FP8_MAX=fp8_max,
                           BLOCK_K=min(1024, max(16, triton.next_power_of_2(k))), num_warps=4)
    return q, scale


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1                                # the interpreter: any grid is fine
    return torch.cuda.get_device_properties(device).multi_processor_count


def tiles(m: int, n: int, k: int, weight_bytes: int, sms: int) -> tuple[int, int, int, bool, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, use_dot, num_warps, num_stages) for an [m, k] x [n, k]^T product.
    M == 1: 1 KiB of each weight row per K step and narrow N tiles (4 rows; 8 once that still gives
    ~4 programs per SM), the fastest of `benchmarks/gemv_bench.py --sweep` on an H200 for every
    Qwen2.5-1.5B decoder shape (e.g. down_proj 25.3 -> 9.3 us against the first tiles' choice);
    M > 1: a 16-row `tl.dot` tile, 128-byte rows of weight per K step and the widest N tile that
    still gives `_TARGET_PROGRAMS_PER_SM` programs per SM."""
    if m == 1:
        block_k = max(16, min(1024 // weight_bytes, triton.next_power_of_2(k)))
        block_n = 8 if triton.cdiv(n, 8) >= 4 * sms else 4
        return 1, block_n, block_k, False, 4, (4 if block_n == 8 else 2)
    block_k = max(16, min(128 // weight_bytes, triton.next_power_of_2(k)))
    block_n = 128
    while block_n > 16 and triton.cdiv(n, block_n) < _TARGET_PROGRAMS_PER_SM * sms:
        block_n //= 2
    return 16, block_n, block_k, True, 4, 4


def gemv(x: torch.Tensor, w: torch.Tensor, scale: Optional[torch.Tensor] = None,
         bias: Optional[torch.Tensor] = None, config: Optional[tuple[int, int, int, int]] = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_M, last dim contiguous), w [N, K] contiguous (fp8 with `scale` [N, 1] float32,
    or x's dtype with scale None), bias [N] or None -> [M, N] in x's dtype. `config` (BLOCK_N, BLOCK_K,
    num_warps, num_stages) overrides the tile choice (benchmarks/gemv_bench.py --sweep)."""
    m, k = x.shape
    n = w.shape[0]
    if m > MAX_M or w.shape[1] != k:
        raise ValueError(f"gemv: x {tuple(x.shape)} and w {tuple(w.shape)} need M <= {MAX_M} and equal K")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    block_m, block_n, block_k, use_dot, warps, stages = tiles(m, n, k, w.element_size(), _num_sms(x.device))
    if config is not None:
        block_n, block_k, warps, stages = config
    grid = (triton.cdiv(n, block_n),)
    _gemv_kernel[grid](x, w, scale if scale is not None else w, bias if bias is not None else w, out,
                       m, n, k, x.stride(0), w.stride(0), out.stride(0),
                       HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, USE_DOT=use_dot,
                       BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return out
