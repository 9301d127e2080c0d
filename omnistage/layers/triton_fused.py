"""Triton kernels behind `fused.py` (CUDA; the Triton interpreter runs them on CPU tensors in tests).

  rms_norm          one program per row: optional residual add, RMSNorm, weight (PDL-launched where `pdl`
                    is on: it waits first of all, so the kernel before it, e.g. the MoE down launch,
                    lets it launch early)
  rotary_and_cache  one program per token: every q and k head (optional per-head RMSNorm, then
                    the rotation), the rotated k and the v rows stored into their KV-cache slot
  silu_and_mul      a 2-D grid over (row, column block) of [gate | up]

Arithmetic is float32. Where the PyTorch reference stores a tensor in the model dtype (the residual
sum, the normed rows before the weight, silu(gate)) the kernels round there too, so they differ from
it only by the order of float32 sums (and, in the rotation, by rounding once instead of thrice).
"""

from __future__ import annotations

import torch

from omnistage.layers import pdl
from omnistage.layers.pdl import gdc_launch_dependents, gdc_wait

try:
    import triton
    import triton.language as tl
except ImportError:                                  # CPU-only installs
    triton = None


if triton is not None:
    @triton.jit
    def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_ptr, stride_x, stride_r, stride_out, stride_res, n, eps,
                         BLOCK: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr = False):
        if PDL:                                      # x and the residual come from the kernel before
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        dt = x.dtype
        if HAS_RES:
            x = (x.to(tl.float32) + tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)).to(dt)
            tl.store(res_ptr + row * stride_res + cols, x, mask=mask)
        h = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(h * h, axis=0) / n + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = (h * rstd).to(dt).to(tl.float32) * w
        tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    # Not shared with triton_attention's `_norm_rope` (the same norm + rotation): this loads each head's halves
    # itself, padded to powers of two (any head count and D), while `_norm_rope` takes whole [G, D] rows its
    # caller loaded ahead of the KV-block latency chain (D a power of two) and sums each norm in one reduction;
    # one helper would move those loads or change that float32 summation order (results, not only layout).
    @triton.jit
    def _rope_heads(ptr, w_ptr, eps, c1, c2, s1, s2, NH: tl.constexpr, NHP: tl.constexpr, D: tl.constexpr,
                    HALF: tl.constexpr, HALFP: tl.constexpr, NORM: tl.constexpr):
        """Rotated halves of NH heads of D at `ptr` (heads D apart), and their offsets and mask."""
        h = tl.arange(0, NHP)
        i = tl.arange(0, HALFP)
        m = (h < NH)[:, None] & (i < HALF)[None, :]
        off = h[:, None] * D + i[None, :]
        x1 = tl.load(ptr + off, mask=m, other=0.0)
        dt = x1.dtype
        x1 = x1.to(tl.float32)
        x2 = tl.load(ptr + off + HALF, mask=m, other=0.0).to(tl.float32)
        if NORM:
            rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)[:, None]
            w1 = tl.load(w_ptr + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
            w2 = tl.load(w_ptr + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
            x1 = ((x1 * rstd).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
            x2 = ((x2 * rstd).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
        o1 = x1 * c1[None, :] - x2 * s1[None, :]
        o2 = x2 * c2[None, :] + x1 * s2[None, :]
        return o1.to(dt), o2.to(dt), off, m

    @triton.jit
    def _rotary_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, kc_ptr, vc_ptr, slot_ptr,
                       qw_ptr, kw_ptr, q_eps, k_eps, stride_q, stride_k, stride_v, stride_cs,
                       H: tl.constexpr, KVH: tl.constexpr, HP: tl.constexpr, KVHP: tl.constexpr, D: tl.constexpr,
                       DP: tl.constexpr, HALF: tl.constexpr, HALFP: tl.constexpr, NORM: tl.constexpr,
                       WRITE: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, HALFP)
        im = i < HALF
        c1 = tl.load(cos_ptr + t * stride_cs + i, mask=im, other=0.0)
        c2 = tl.load(cos_ptr + t * stride_cs + HALF + i, mask=im, other=0.0)
        s1 = tl.load(sin_ptr + t * stride_cs + i, mask=im, other=0.0)
        s2 = tl.load(sin_ptr + t * stride_cs + HALF + i, mask=im, other=0.0)
        o1, o2, off, m = _rope_heads(q_ptr + t * stride_q, qw_ptr, q_eps, c1, c2, s1, s2, H, HP, D, HALF, HALFP, NORM)
        tl.store(qo_ptr + t * (H * D) + off, o1, mask=m)
        tl.store(qo_ptr + t * (H * D) + off + HALF, o2, mask=m)
        o1, o2, off, m = _rope_heads(k_ptr + t * stride_k, kw_ptr, k_eps, c1, c2, s1, s2, KVH, KVHP, D, HALF, HALFP,
                                     NORM)
        tl.store(ko_ptr + t * (KVH * D) + off, o1, mask=m)
        tl.store(ko_ptr + t * (KVH * D) + off + HALF, o2, mask=m)
        if WRITE:
            slot = tl.load(slot_ptr + t).to(tl.int64) * (KVH * D)
            tl.store(kc_ptr + slot + off, o1.to(kc_ptr.dtype.element_ty), mask=m)
            tl.store(kc_ptr + slot + off + HALF, o2.to(kc_ptr.dtype.element_ty), mask=m)
            h = tl.arange(0, KVHP)
            d = tl.arange(0, DP)
            vm = (h < KVH)[:, None] & (d < D)[None, :]
            voff = h[:, None] * D + d[None, :]
            v = tl.load(v_ptr + t * stride_v + voff, mask=vm, other=0.0)
            tl.store(vc_ptr + slot + voff, v.to(vc_ptr.dtype.element_ty), mask=vm)

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        dt = g.dtype
        g = g.to(tl.float32)
        u = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
        y = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u
        tl.store(out_ptr + row * inter + cols, y.to(dt), mask=mask)


def _warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, N] with unit column stride (a view when the layout allows)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    shape, n = x.shape, x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    block = triton.next_power_of_2(n)
    if x2.shape[0] == 0:
        return out.view(shape) if residual is None else (out.view(shape), residual + x)
    if residual is None:
        _rms_norm_kernel[(x2.shape[0],)](x2, x2, weight, out, out, x2.stride(0), 0, out.stride(0), 0, n, eps,
                                         BLOCK=block, HAS_RES=False, num_warps=_warps(block), **pdl.launch(x2))
        return out.view(shape)
    r2 = _rows(residual)
    res = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, out, res, x2.stride(0), r2.stride(0), out.stride(0),
                                     res.stride(0), n, eps, BLOCK=block, HAS_RES=True, num_warps=_warps(block),
                                     **pdl.launch(x2))
    return out.view(shape), res.view(shape)


def head_rows(x: torch.Tensor) -> torch.Tensor:
    """[T, heads, D] with heads D apart and unit stride inside a head (QKV-output views already are)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def rotary_and_cache(q, k, v, cos, sin, cache, slots, q_norm=None, k_norm=None):
    q, k, v = head_rows(q), head_rows(k), head_rows(v)
    t, h, d = q.shape
    kvh = k.shape[1]
    cos, sin = cos.contiguous(), sin.contiguous()
    qo = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    ko = torch.empty(t, kvh, d, dtype=k.dtype, device=k.device)
    if t == 0:
        return qo, ko
    write = cache is not None
    kc, vc = (cache[0], cache[1]) if write else (ko, ko)
    norm = q_norm is not None
    qw, kw = (q_norm.weight, k_norm.weight) if norm else (q, q)
    half = d // 2
    _rotary_kernel[(t,)](
        q, k, v, cos, sin, qo, ko, kc, vc, slots if write else q, qw, kw,
        q_norm.eps if norm else 0.0, k_norm.eps if norm else 0.0,
        q.stride(0), k.stride(0), v.stride(0), cos.stride(0),
        H=h, KVH=kvh, HP=triton.next_power_of_2(h), KVHP=triton.next_power_of_2(kvh), D=d,
        DP=triton.next_power_of_2(d), HALF=half, HALFP=triton.next_power_of_2(half), NORM=norm, WRITE=write,
        num_warps=4)
    return qo, ko


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    x2 = _rows(x)
    inter = x2.shape[1] // 2
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](x2, out, x2.stride(0), inter, BLOCK=block,
                                                                      num_warps=4)
    return out.view(*x.shape[:-1], inter)
