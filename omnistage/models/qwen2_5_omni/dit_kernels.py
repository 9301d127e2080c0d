"""Triton kernels of `dit_fused.FusedDiT` (code2wav's DiT evaluation on CUDA, in the code2wav stage's
engine, whatever process runs it), each with the PyTorch computation it replaces on a CPU.

  rope_first_head(qkv, rot): q's and k's first head rotated in place, pairs interleaved as the
      checkpoint stores them; qkv [rows, frames, 3, heads, d] (the q|k|v GEMM's output), rot
      [rows, frames, 1, d / 2] complex64 (e^(i f) per frame). One program per frame.
  block_attention(qkv, lengths, back, ahead, block) -> [rows, frames, heads x d]: the DiT's
      block-local attention read straight from the q|k|v GEMM's output: a query in DiT block j of a
      row sees the keys of blocks j - back .. j + ahead that lie before the row's length
      `lengths[row]` (int32 [rows]); a query past the length sees only itself (as
      `FusedDiT.masks`). One program per (row, block, head): its 24 queries against at most
      (back + 1 + ahead) x 24 keys, scores and softmax in float32, probabilities rounded to the
      value dtype for the second product (as a flash kernel does). Measured on an H200 (8 steady
      rows, 7B shape), cuDNN's flash SDPA on those 24-query problems was a third of each
      evaluation's GPU time (75 us per layer): its 64 x 128 tiles are mostly padding here, and the
      problems arrive as a batch of rows x blocks x heads.
tests/models/qwen2_5_omni/test_code2wav_kernels.py runs both under Triton's interpreter against the
PyTorch paths.
"""

from __future__ import annotations

import torch

from omnistage.layers.triton_fused import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _rope_first_head_kernel(qkv_ptr, rot_ptr, stride_token, stride_qk, HALF: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)   # row * frames + frame
        i = tl.arange(0, HALF)
        cos = tl.load(rot_ptr + token * 2 * HALF + 2 * i)
        sin = tl.load(rot_ptr + token * 2 * HALF + 2 * i + 1)
        for which in tl.static_range(2):        # q, then k
            head = qkv_ptr + token * stride_token + which * stride_qk
            even = tl.load(head + 2 * i).to(tl.float32)
            odd = tl.load(head + 2 * i + 1).to(tl.float32)
            tl.store(head + 2 * i, (even * cos - odd * sin).to(qkv_ptr.dtype.element_ty))
            tl.store(head + 2 * i + 1, (odd * cos + even * sin).to(qkv_ptr.dtype.element_ty))

    @triton.jit
    def _block_attention_kernel(qkv_ptr, len_ptr, out_ptr, frames, blocks, heads, scale,
                                BACK: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr,
                                BQ: tl.constexpr, BK: tl.constexpr, D: tl.constexpr):
        pid = tl.program_id(0)                  # row * blocks + block
        head = tl.program_id(1)
        row = pid // blocks
        j = pid % blocks
        length = tl.load(len_ptr + row)
        qi = tl.arange(0, BQ)
        ki = tl.arange(0, BK)
        d = tl.arange(0, D)
        qf = j * BLOCK + qi                     # query frames
        kf = (j - BACK) * BLOCK + ki            # key frames
        q_ok = (qi < BLOCK) & (qf < frames)
        k_ok = (ki < WIDTH * BLOCK) & (kf >= 0) & (kf < frames)
        token = 3 * heads * D                   # elements per frame of qkv
        base = qkv_ptr + row.to(tl.int64) * frames * token + head * D
        q = tl.load(base + qf[:, None].to(tl.int64) * token + d[None, :], mask=q_ok[:, None], other=0.0)
        k = tl.load(base + heads * D + kf[:, None].to(tl.int64) * token + d[None, :], mask=k_ok[:, None], other=0.0)
        v = tl.load(base + 2 * heads * D + kf[:, None].to(tl.int64) * token + d[None, :], mask=k_ok[:, None],
                    other=0.0)
        scores = tl.dot(q, tl.trans(k)) * scale
        valid_q = (qf < length)[:, None]
        keep = tl.where(valid_q, (k_ok & (kf < length))[None, :], kf[None, :] == qf[:, None])
        scores = tl.where(keep, scores, float("-inf"))
        top = tl.max(scores, axis=1)
        top = tl.where(top == float("-inf"), 0.0, top)   # lanes past the window (not stored)
        p = tl.exp(scores - top[:, None])
        total = tl.sum(p, axis=1)
        o = tl.dot(p.to(v.dtype), v) / tl.where(total == 0, 1.0, total)[:, None]
        out = out_ptr + row.to(tl.int64) * frames * heads * D + head * D
        tl.store(out + qf[:, None].to(tl.int64) * heads * D + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=q_ok[:, None])


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def served(head_dim: int) -> bool:
    """Whether the kernels serve this head size: a power of two >= 16 (Triton's block shapes; the
    caller checks for CUDA and Triton, `layers.fused.use_triton`)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def rope_first_head(qkv: torch.Tensor, rot: torch.Tensor) -> None:
    rows, frames, _, heads, d = qkv.shape
    table = torch.view_as_real(rot.expand(rows, frames, 1, d // 2).contiguous())
    _rope_first_head_kernel[(rows * frames,)](qkv, table, qkv.stride(1), qkv.stride(2), HALF=d // 2)


def block_attention(qkv: torch.Tensor, lengths: torch.Tensor, back: int, ahead: int, block: int) -> torch.Tensor:
    rows, frames, _, heads, d = qkv.shape
    blocks = -(-frames // block)
    out = torch.empty(rows, frames, heads * d, dtype=qkv.dtype, device=qkv.device)
    width = back + 1 + ahead
    _block_attention_kernel[(rows * blocks, heads)](
        qkv, lengths, out, frames, blocks, heads, d ** -0.5, BACK=back, WIDTH=width, BLOCK=block,
        BQ=_pow2(block), BK=_pow2(width * block), D=d)
    return out
