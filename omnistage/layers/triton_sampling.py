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

The AR sampler's noise and candidate race (`ar/sampler.py`) live here too:
  * `exp_noise` / `exp_noise_ref`: counter-based Exp(1) draws. A row's draw for token t is a pure
    function of the row's 32-bit key (from its seed and how many tokens it has sampled: `row_keys`, on
    the host) and t: u = (hash(key, t) >> 8 + 0.5) / 2^24, E = -log(u). So seeded rows of a batch draw
    in one launch (no generator per row), a row's tokens do not depend on the batch, and the draw for a
    few candidate tokens equals the full row's at those tokens. The hash is two rounds of a 32-bit
    integer mixer (xorshift-multiply, constants 0x7feb352d / 0x846ca68b) over (t + 0x9e3779b9) and the
    key, computed in int64 with 16-bit halves of each constant so no product overflows (the same
    arithmetic in PyTorch, numpy and Triton, bit for bit).
  * `race_candidates` / `race_candidates_ref`: a draw among each row's top-K candidates (values sorted
    descending, already divided by the temperature, and their ids; `torch.topk`'s output): the row's k,
    top-p and min-p masks over them, then the exponential race argmax(p / E) with E from `exp_noise` at
    the candidates' ids. Equal to the race over the full row when every token outside the candidates has
    probability 0 after top-k (K >= the row's k). One program per row (CUDA), `race_candidates_ref` on
    the CPU.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:                                  # CPU-only installs
    triton = None

MOST_VOCAB = 4096                                    # widest row one program holds
MOST_CANDIDATES = 256                                # widest candidate row `race_candidates` takes (top-k)
MASK32 = 0xFFFFFFFF
MIX_A, MIX_B = 0x7FEB352D, 0x846CA68B                # the mixer's multipliers
TOKEN_SALT = 0x9E3779B9                              # added to a token id before it is mixed


def _mul32_ref(x, c: int):
    """(x * c) mod 2^32 for x in [0, 2^32) (int64 tensor or numpy array), no product above 2^48."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def mix32_ref(x):
    """The 32-bit mixer on int64 values in [0, 2^32) (torch or numpy)."""
    x = x ^ (x >> 16)
    x = _mul32_ref(x, MIX_A)
    x = x ^ (x >> 15)
    x = _mul32_ref(x, MIX_B)
    return x ^ (x >> 16)


def row_keys(seeds, draws):
    """int64 numpy [S] noise keys in [0, 2^32) from 64-bit seeds (any ints >= 0) and draw counters [S]
    (a sequence's tokens sampled so far): the host side of `exp_noise`."""
    import numpy as np

    seeds = np.asarray(seeds, dtype=np.uint64)
    lo = (seeds & np.uint64(MASK32)).astype(np.int64)
    hi = (seeds >> np.uint64(32)).astype(np.int64)
    draws = np.asarray(draws, dtype=np.int64) & MASK32
    return mix32_ref(draws ^ mix32_ref(hi ^ mix32_ref(lo)))


def exp_noise_ref(keys: torch.Tensor, ids: torch.Tensor, hashed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float32 [S, N] Exp(1) draws of rows keyed `keys` (int64 [S]) at token ids `ids` (int64 [S, N] or
    [N]): the PyTorch reference of the kernels' noise. `hashed`: the ids' first mix, when the caller
    keeps it (`_token_hashes`)."""
    if hashed is None:
        hashed = mix32_ref((ids.long() + TOKEN_SALT) & MASK32)
    h = mix32_ref(hashed ^ keys.long()[:, None])
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216)
    return -torch.log(u)


@functools.lru_cache(maxsize=8)
def _token_hashes(vocab: int, device: torch.device) -> torch.Tensor:
    """The first mix of every token id (it does not depend on the row): the full-row reference path's."""
    return mix32_ref((torch.arange(vocab, device=device) + TOKEN_SALT) & MASK32)


def race_candidates_ref(vals: torch.Tensor, ids: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                        min_p: torch.Tensor, keys: Optional[torch.Tensor], noise: Optional[torch.Tensor] = None
                        ) -> torch.Tensor:
    """[S] long: each row's draw among its candidates (see the module docstring); vals float32 [S, K]
    sorted descending, ids [S, K], top_k [S] (-1 / 0 / >= K: all K), top_p [S], min_p [S], and either
    keys [S] (`exp_noise` at the ids) or the candidates' Exp(1) noise [S, K]."""
    s, width = vals.shape
    cols = torch.arange(width, device=vals.device)
    k = torch.where((top_k > 0) & (top_k < width), top_k, width)
    in_k = cols[None, :] < k[:, None]
    v = vals.masked_fill(~in_k, float("-inf"))
    e = torch.where(in_k, torch.exp(v - v[:, :1]), 0.0)
    before = (e.cumsum(-1) - e) / e.sum(-1, keepdim=True)
    kept = in_k & (((before < top_p[:, None]) & (e >= min_p[:, None])) | (cols[None, :] == 0))
    score = torch.where(kept, e / (exp_noise_ref(keys, ids) if noise is None else noise), -1.0)
    return ids.gather(1, score.argmax(-1, keepdim=True))[:, 0].long()


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


    @triton.jit
    def _mul32(x, C: tl.constexpr):
        return (x * (C & 0xFFFF) + (((x * (C >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF

    @triton.jit
    def _mix32(x):
        x = x ^ (x >> 16)
        x = _mul32(x, 0x7FEB352D)
        x = x ^ (x >> 15)
        x = _mul32(x, 0x846CA68B)
        return x ^ (x >> 16)

    @triton.jit
    def _exp_noise(key, ids):
        h = _mix32(_mix32((ids.to(tl.int64) + 0x9E3779B9) & 0xFFFFFFFF) ^ key)
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216)
        return -tl.log(u)

    @triton.jit(do_not_specialize=["stride_o", "vocab"])
    def _noise_kernel(key_ptr, out_ptr, stride_o, vocab, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        key = tl.load(key_ptr + row)
        tl.store(out_ptr + row * stride_o + cols, _exp_noise(key, cols), mask=cols < vocab)

    # one compiled variant per (BLOCK, KEYED): the ints are not specialised, and `launch_race` passes
    # only tensors it allocated (aligned) or the caller's aligned rows (see `launch_race`)
    @triton.jit(do_not_specialize=["stride_v", "stride_i", "stride_n", "width"])
    def _race_kernel(vals_ptr, ids_ptr, k_ptr, p_ptr, minp_ptr, key_ptr, noise_ptr, out_ptr, stride_v, stride_i,
                     stride_n, width, BLOCK: tl.constexpr, KEYED: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        k = tl.load(k_ptr + row).to(tl.int32)         # top-k as float32 (exact up to 2^24)
        k = tl.where((k > 0) & (k < width), k, width)
        in_k = cols < k
        v = tl.load(vals_ptr + row * stride_v + cols, mask=in_k, other=float("-inf"))
        best = tl.max(v, axis=0)
        e = tl.where(in_k, tl.exp(v - best), 0.0)
        before = (tl.cumsum(e, axis=0) - e) / tl.sum(e, axis=0)
        kept = in_k & (((before < tl.load(p_ptr + row)) & (e >= tl.load(minp_ptr + row))) | (cols == 0))
        ids = tl.load(ids_ptr + row * stride_i + cols, mask=in_k, other=0).to(tl.int64)
        if KEYED:
            noise = _exp_noise(tl.load(key_ptr + row), ids)
        else:
            noise = tl.load(noise_ptr + row * stride_n + cols, mask=in_k, other=1.0)
        score = tl.where(kept, e / noise, -1.0)
        win = tl.argmax(score, axis=0)
        tl.store(out_ptr + row, tl.sum(tl.where(cols == win, ids, 0), axis=0))


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


def exp_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 [S, vocab] Exp(1) draws of rows keyed `keys` (int64 [S], on the device) at every token:
    one launch on CUDA, `exp_noise_ref` elsewhere."""
    if triton is None or not keys.is_cuda:
        return exp_noise_ref(keys, None, _token_hashes(vocab, keys.device))
    return launch_noise(keys, vocab)


def launch_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """`exp_noise`'s kernel on any tensors Triton runs on (the interpreter's CPU tensors in tests)."""
    out = torch.empty(keys.shape[0], vocab, device=keys.device)
    if keys.shape[0]:
        block = 1024
        _noise_kernel[(keys.shape[0], triton.cdiv(vocab, block))](keys.long().contiguous(), out, out.stride(0),
                                                                  vocab, BLOCK=block, num_warps=4)
    return out


def race_candidates(vals: torch.Tensor, ids: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor, keys: Optional[torch.Tensor], noise: Optional[torch.Tensor] = None
                    ) -> torch.Tensor:
    """`race_candidates_ref` in one launch on CUDA (K <= MOST_CANDIDATES); the reference elsewhere."""
    if triton is None or not vals.is_cuda or vals.shape[1] > MOST_CANDIDATES:
        return race_candidates_ref(vals, ids, top_k, top_p, min_p, keys, noise)
    return launch_race(vals, ids, top_k, top_p, min_p, keys, noise)


def launch_race(vals: torch.Tensor, ids: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, keys: Optional[torch.Tensor], noise: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
    """`race_candidates`' kernel on any tensors Triton runs on (the interpreter's CPU tensors in tests)."""
    s, width = vals.shape
    out = torch.empty(s, dtype=torch.long, device=vals.device)
    if s == 0:
        return out
    v = _aligned(vals.float())
    i = _aligned(ids)
    n = v if noise is None else _aligned(noise.float())              # (unread when keyed)
    k = _aligned(keys.long()) if keys is not None else i             # (unread when not keyed)
    _race_kernel[(s,)](v, i, _aligned(top_k.float()), _aligned(top_p.float()), _aligned(min_p.float()), k, n, out,
                       v.stride(0), i.stride(0), n.stride(0), width, BLOCK=race_block(width), KEYED=noise is None,
                       num_warps=1 if width <= 64 else 2)
    return out


def race_block(width: int) -> int:
    """The race kernel's BLOCK (its one compile-time size) for `width` candidates."""
    return max(triton.next_power_of_2(width), 16)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous at a 16-byte aligned address (Triton compiles a variant per pointer alignment: a
    row of a packed upload sits at an offset that depends on the batch size)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def warm_race(device: torch.device) -> None:
    """Compiles the race kernel (counter-based noise) for every BLOCK a top-k up to MOST_CANDIDATES gives,
    and the noise kernel (the AR engine's start-up warm-up), so no request waits for a compile (H200:
    a first sampled talker step at a new batch size waited ~0.2 s for one)."""
    width = 1
    while width <= MOST_CANDIDATES:
        vals = torch.zeros(1, width, device=device)
        ids = torch.zeros(1, width, dtype=torch.long, device=device)
        ones = torch.ones(1, device=device)
        launch_race(vals, ids, ones, ones, ones * 0, torch.zeros(1, dtype=torch.long, device=device))
        width = race_block(width) * 2
    launch_noise(torch.zeros(1, dtype=torch.long, device=device), 16)   # the full-row path's noise
