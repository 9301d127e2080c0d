"""8-bit attention (SageAttention-style; any process, CPU or CUDA): INT8 QK^T with per-block scales, PV in 16 bits.

In: q [B, H, Sq, D], k / v [B, H, Sk, D] (the layout of `F.scaled_dot_product_attention`), an
optional softmax scale. Out: [B, H, Sq, D] in q's dtype. Lossy by design (opt-in: `SAGE_ATTN`).

The maths, shared by both paths (`quantize` runs once, before either):
  1. k is smoothed: its mean over the sequence (per batch, head, channel) is subtracted. Softmax is
     unchanged (q . mean(k) is the same for every key of a query row) and the int8 range is spent
     on what differs between keys.
  2. q and k are quantized per block of BLOCK_M / BLOCK_N tokens of one head: scale = amax / 127,
     int8 = round(x / scale).
  3. S = (q_int8 . k_int8^T) * scale_q * scale_k * softmax_scale, summed exactly in int32 (a
     float32 sum of int8 products is exact too: at D <= 256 it stays under 2^24).
  4. P = softmax(S) in float32, rounded to v's 16-bit dtype, O = P . V accumulated in float32.
`reference` computes this with whole-row softmax in PyTorch; the Triton kernel (CUDA) computes it
with the online (flash) softmax, so the two differ only in where P is rounded: checked by tests
(CPU) and benchmarks/check_cuda.py (GPU).
"""

from __future__ import annotations

from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:                                  # CPU-only installs
    triton = None

BLOCK_M = 128                # query tokens per scale block (= the kernel's query tile)
BLOCK_N = 64                 # key tokens per scale block (= the kernel's key tile)


def _block_quant(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, H, S, D] -> (int8 [B, H, S, D], float32 scales [B, H, ceil(S / block)])."""
    b, h, s, d = x.shape
    pad = -s % block
    xp = torch.nn.functional.pad(x.float(), (0, 0, 0, pad)).view(b, h, (s + pad) // block, block, d)
    scale = xp.abs().amax(dim=(-1, -2)).clamp_min(1e-8) / 127.0
    q = torch.round(xp / scale[..., None, None]).clamp_(-127, 127).to(torch.int8)
    return q.view(b, h, s + pad, d)[:, :, :s], scale


def quantize(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 1-2: (q_int8, q_scale, k_int8, k_scale) of smoothed k."""
    k = k - k.float().mean(dim=2, keepdim=True).to(k.dtype)
    q8, sq = _block_quant(q, BLOCK_M)
    k8, sk = _block_quant(k, BLOCK_N)
    return q8, sq, k8, sk


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
    """Steps 1-4 in plain PyTorch (CPU tests; any device)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q8, sq, k8, sk = quantize(q, k)
    sq_tok = sq.repeat_interleave(BLOCK_M, dim=-1)[..., : q.shape[2]]
    sk_tok = sk.repeat_interleave(BLOCK_N, dim=-1)[..., : k.shape[2]]
    s = (q8.float() @ k8.float().transpose(-1, -2)) * (sq_tok[..., :, None] * sk_tok[..., None, :] * scale)
    p = torch.softmax(s, dim=-1).to(_pv_dtype(v))
    return (p.float() @ v.to(p.dtype).float()).to(q.dtype)


def _pv_dtype(v: torch.Tensor) -> torch.dtype:
    """P and V in 16 bits: v's own dtype when it is one, else float16."""
    return v.dtype if v.dtype in (torch.float16, torch.bfloat16) else torch.float16


def kernel_supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    d = q.shape[-1]
    return (triton is not None and q.is_cuda and d in (16, 32, 64, 128, 256) and k.shape[-1] == d
            and v.shape[-1] == d and q.shape[:2] == k.shape[:2] == v.shape[:2])


def sage_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
    """The Triton kernel where it runs (CUDA, head dim a power of two), else `reference`."""
    if not kernel_supports(q, k, v):
        return reference(q, k, v, scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q8, sq, k8, sk = quantize(q, k)
    return torch.ops.omnistage.sage_fwd(q8, sq, k8, sk, v.to(_pv_dtype(v)).contiguous(), float(scale)).to(q.dtype)


if triton is not None:
    @triton.jit
    def _sage_kernel(q_ptr, qs_ptr, k_ptr, ks_ptr, v_ptr, o_ptr, sm_scale, Sq, Sk, NQB, NKB,
                     sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sob, soh, sos,
                     H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b, h = bh // H, bh % H
        rows = pid_m * BM + tl.arange(0, BM)
        cols = tl.arange(0, D)
        q = tl.load(q_ptr + b * sqb + h * sqh + rows[:, None] * sqs + cols[None, :], mask=rows[:, None] < Sq, other=0)
        q_scale = tl.load(qs_ptr + bh * NQB + pid_m)
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        LOG2E: tl.constexpr = 1.4426950408889634
        for kb in range(0, NKB):
            keys = kb * BN + tl.arange(0, BN)
            kmask = keys < Sk
            k = tl.load(k_ptr + b * skb + h * skh + keys[None, :] * sks + cols[:, None], mask=kmask[None, :], other=0)
            k_scale = tl.load(ks_ptr + bh * NKB + kb)
            s = tl.dot(q, k, out_dtype=tl.int32).to(tl.float32) * (q_scale * k_scale * sm_scale * LOG2E)
            s = tl.where(kmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + b * svb + h * svh + keys[:, None] * svs + cols[None, :], mask=kmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(o_ptr + b * sob + h * soh + rows[:, None] * sos + cols[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=rows[:, None] < Sq)


@torch.library.custom_op("omnistage::sage_fwd", mutates_args=())
def _sage_fwd(q8: torch.Tensor, sq: torch.Tensor, k8: torch.Tensor, sk: torch.Tensor, v: torch.Tensor,
              scale: float) -> torch.Tensor:
    """The kernel as an opaque op, so that torch.compile'd blocks call it without tracing Triton."""
    b, h, s_q, d = q8.shape
    s_k = k8.shape[2]
    out = torch.empty(b, h, s_q, d, device=q8.device, dtype=v.dtype)
    sq, sk = sq.contiguous(), sk.contiguous()
    grid = (triton.cdiv(s_q, BLOCK_M), b * h)
    _sage_kernel[grid](q8, sq, k8, sk, v, out, scale, s_q, s_k, sq.shape[-1], sk.shape[-1],
                       *q8.stride()[:3], *k8.stride()[:3], *v.stride()[:3], *out.stride()[:3],
                       H=h, D=d, BM=BLOCK_M, BN=BLOCK_N, num_warps=8, num_stages=3)
    return out


@_sage_fwd.register_fake
def _(q8, sq, k8, sk, v, scale):
    return torch.empty(q8.shape, device=q8.device, dtype=v.dtype)
