"""Adaptive LayerNorm with a gated residual in front, one fused step of a DiT block (stage process,
CPU or CUDA).

  ada_norm(x, shift, scale, eps, residual=None, gate=None, out_dtype=None)
      x [..., N]; shift, scale, gate [N] (one modulation vector for every row, as a DiT whose rows
      share the time step has); with `residual`: h = residual + gate * x, else h = x; returns
      (h, LayerNorm(h) * (1 + scale) + shift in `out_dtype`) -- the residual stream after the
      previous sub-block and the modulated input of the next one.

The LayerNorm has no affine weights (the modulation is its affine part). On CUDA (Triton installed,
`fused.ENABLED`) it is one Triton kernel, one program per row, every step in float32, rounded where
the reference stores a tensor (h, the output); elsewhere the plain PyTorch body below, which is the
reference (CPU path; tests/layers/test_ada_norm.py checks the kernel against it under Triton's
interpreter). The residual stream is float32 here (`h` keeps the promoted dtype of residual and x).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from omnistage.layers.fused import use_triton
from omnistage.layers.triton_fused import _rows, _warps, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _ada_norm_kernel(x_ptr, r_ptr, g_ptr, shift_ptr, scale_ptr, h_ptr, out_ptr, stride_x, stride_r,
                         n, eps, BLOCK: tl.constexpr, HAS_RES: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            gate = tl.load(g_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            h = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32) + gate * h
            h = h.to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + row * n + cols, h, mask=mask)
            h = h.to(tl.float32)
        mean = tl.sum(h, axis=0) / n
        d = tl.where(mask, h - mean, 0.0)
        rstd = tl.rsqrt(tl.sum(d * d, axis=0) / n + eps)
        scale = tl.load(scale_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        shift = tl.load(shift_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = d * rstd * (1.0 + scale) + shift
        tl.store(out_ptr + row * n + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def ada_norm(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None, gate: Optional[torch.Tensor] = None,
             out_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, modulated LayerNorm of h): see the module docstring."""
    if (residual is None) != (gate is None):
        raise ValueError("ada_norm takes residual and gate together")
    if use_triton(x):
        return _ada_norm_triton(x, shift, scale, eps, residual, gate, out_dtype)
    return ada_norm_ref(x, shift, scale, eps, residual, gate, out_dtype)


def ada_norm_ref(x, shift, scale, eps, residual=None, gate=None, out_dtype=None):
    """The PyTorch reference: transformers' DiT block arithmetic, op by op."""
    h = x if residual is None else residual + gate * x
    y = F.layer_norm(h, h.shape[-1:], eps=eps) * (1 + scale) + shift
    return h, y.to(out_dtype or y.dtype)


def _ada_norm_triton(x, shift, scale, eps, residual, gate, out_dtype):
    shape, n = x.shape, x.shape[-1]
    x2 = _rows(x)
    h_dtype = x.dtype if residual is None else torch.promote_types(residual.dtype, x.dtype)
    out = torch.empty(x2.shape, dtype=out_dtype or torch.promote_types(h_dtype, scale.dtype), device=x.device)
    block = triton.next_power_of_2(n)
    if x2.shape[0] == 0:
        return (x if residual is None else residual + gate * x), out.view(shape)
    if residual is None:
        _ada_norm_kernel[(x2.shape[0],)](x2, x2, scale, shift.contiguous(), scale.contiguous(), x2, out,
                                         x2.stride(0), 0, n, eps,
                                         BLOCK=block, HAS_RES=False, num_warps=_warps(block))
        return x, out.view(shape)
    r2 = _rows(residual)
    h = torch.empty(x2.shape, dtype=h_dtype, device=x.device)
    _ada_norm_kernel[(x2.shape[0],)](x2, r2, gate.contiguous(), shift.contiguous(), scale.contiguous(), h, out,
                                     x2.stride(0), r2.stride(0), n, eps, BLOCK=block, HAS_RES=True,
                                     num_warps=_warps(block))
    return h.view(shape), out.view(shape)
