"""The decoder layer's elementwise work, one function per fused step (stage process, CPU or CUDA).

Each function is the one entry point the models call. On CUDA (with Triton) it runs one Triton
kernel from `triton_fused.py`; elsewhere it runs the plain PyTorch body written here, which is the
reference: the CPU path, and what the kernels are checked against (tests/layers, check_cuda.py).

  rms_norm(x, weight, eps, residual=None)   x [..., N] -> normed x, or (normed x + residual, x + residual)
  rotary_and_cache(q, k, v, cos, sin, cache, slots, q_norm, k_norm)
                                            optional per-head RMSNorm (Qwen3), rotary on q and k,
                                            this step's k and v into their KV-cache slots -> q, k
                                            (a decode-only CUDA step does all of it inside the decode
                                            attention kernel instead: `attention.rope_attend`)
  silu_and_mul(x)                           x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]

The references round to the model dtype after each PyTorch op, as the unfused model always did;
the kernels compute each step in float32 and round where the reference stores a tensor
(the residual, the normed rows) or once at the end, so in bfloat16 they differ from the reference
by rounding only. `ENABLED` is read from `OMNISTAGE_FUSED_KERNELS` ("0": off) at import; benchmarks
flip it to compare against the unfused path in one run.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F

from omnistage.layers import triton_fused

ENABLED = os.environ.get("OMNISTAGE_FUSED_KERNELS", "1") != "0"


def use_triton(x: torch.Tensor) -> bool:
    """Whether the CUDA kernels serve tensors like `x` (CUDA, Triton installed, not switched off)."""
    return ENABLED and x.is_cuda and triton_fused.triton is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None):
    """RMSNorm in float32, cast back, times `weight`. With `residual`, normalises `x + residual` and
    also returns that sum (the residual stream after this block)."""
    if use_triton(x):
        return triton_fused.rms_norm(x, weight, eps, residual)
    if residual is not None:
        x = x + residual
        return rms_norm_ref(x, weight, eps), x
    return rms_norm_ref(x, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rotary_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     cache: Optional[torch.Tensor], slots: Optional[torch.Tensor],
                     q_norm=None, k_norm=None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k and v [T, KVH, D] (rows may be strided views of one QKV output); cos, sin [T, D]
    float32, one row per token (multimodal rope picks each row's angles before this); cache
    [2, blocks, block_size, KVH, D] and slots [T] (None: no write). `q_norm` / `k_norm`: RMSNorm
    modules applied per head before the rotation (Qwen3), or None. -> rotated q, k."""
    if use_triton(q):
        return triton_fused.rotary_and_cache(q, k, v, cos, sin, cache, slots, q_norm, k_norm)
    if q_norm is not None:
        q, k = rms_norm_ref(q, q_norm.weight, q_norm.eps), rms_norm_ref(k, k_norm.weight, k_norm.eps)
    q, k = rotary_ref(q, k, cos, sin)
    if cache is not None:
        write_kv(cache, k, v, slots)
    return q, k


def rotary_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    cos = cos.to(q.dtype)[:, None, :]
    sin = sin.to(q.dtype)[:, None, :]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """cache [2, num_blocks, block_size, KVH, D]; k, v [T, KVH, D]; slots [T] (block * block_size + offset)."""
    flat = cache.view(2, -1, *cache.shape[-2:])
    flat[0].index_copy_(0, slots, k)
    flat[1].index_copy_(0, slots, v)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""
    if use_triton(x):
        return triton_fused.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
