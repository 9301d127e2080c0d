"""One Triton kernel for a sampled draw with temperature, top-k and top-p (CUDA; the Triton interpreter
runs it on CPU tensors in tests). Stage process, inside the code predictor's frame graph.

In: float32 logits [S, V] (V <= `MOST_VOCAB`), per-row temperature [S], top-k [S] (-1: all), top-p
[S], and Exp(1) noise [S, V]. Out: [S] long, each row's argmax of p / noise over the tokens top-k and
top-p keep (p: the row's softmax over them) -- the exponential race of `predictor.pick_ref`, which is the
PyTorch reference (`torch.topk` + masks + softmax, a dozen launches per sub-step at 8-64 rows).

One program per row holds the whole row: it sorts it once in registers (`tl.sort`, no global
memory), takes the row's mass above each sorted position from one prefix sum, and from it the
smallest kept logit t; the kept tokens are those >= t, and the winner is the argmax of
exp(x - max) / noise over them (the softmax's normaliser does not move an argmax). The same tokens
survive as in the reference except where two logits tie exactly at the cut (there the reference
keeps the lower id and this keeps both), and the sums are in another order, so a draw whose
top-p mass lands within rounding of the cut may differ.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:                                  # CPU-only installs
    triton = None

MOST_VOCAB = 4096                                    # widest row one program holds


if triton is not None:
    @triton.jit
    def _pick_kernel(x_ptr, temp_ptr, k_ptr, p_ptr, noise_ptr, out_ptr, stride_x, stride_n, vocab,
                     BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < vocab
        x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=float("-inf")) / tl.load(temp_ptr + row)
        k = tl.load(k_ptr + row)
        k = tl.where((k > 0) & (k < vocab), k, vocab)
        top_p = tl.load(p_ptr + row)
        ranked = tl.sort(x, descending=True)         # ranked[i]: the (i+1)-th largest logit
        best = tl.max(x, axis=0)
        in_k = cols < k
        e = tl.where(in_k, tl.exp(ranked - best), 0.0)
        total = tl.sum(e, axis=0)
        before = (tl.cumsum(e, axis=0) - e) / total   # probability above each ranked position
        kept = in_k & ((before < top_p) | (cols == 0))
        cut = tl.min(tl.where(kept, ranked, float("inf")), axis=0)
        noise = tl.load(noise_ptr + row * stride_n + cols, mask=inside, other=1.0)
        score = tl.where(inside & (x >= cut), tl.exp(x - best) / noise, -1.0)
        tl.store(out_ptr + row, tl.argmax(score, axis=0).to(tl.int64))


def fits(logits: torch.Tensor) -> bool:
    """Whether `pick_top_k_top_p` takes rows like `logits`' (Triton installed, V <= MOST_VOCAB)."""
    return triton is not None and logits.shape[-1] <= MOST_VOCAB


def pick_top_k_top_p(logits: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     noise: torch.Tensor) -> torch.Tensor:
    """[S] long sampled ids (see the module docstring); every argument on one device."""
    s, v = logits.shape
    out = torch.empty(s, dtype=torch.long, device=logits.device)
    if s == 0:
        return out
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    n = noise if noise.stride(-1) == 1 else noise.contiguous()
    block = triton.next_power_of_2(v)
    _pick_kernel[(s,)](x, temp.float().contiguous(), top_k.to(torch.int32).contiguous(),
                       top_p.float().contiguous(), n, out, x.stride(0), n.stride(0), v,
                       BLOCK=block, num_warps=4 if block <= 1024 else 8)
    return out
