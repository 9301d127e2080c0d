"""Token sampling on the device that holds the logits (stage process, CPU or CUDA).

In: float32 logits [S, V] for the S sequences that sample this step, and a `SamplingBatch`
describing their parameters (with, when a row is constrained, a packed token bitmask from
`ar/structured.py`). Order: banned ids, `logit_bias`, penalties, the grammar mask, then greedy /
temperature, top-k, top-p, min-p. Out: the chosen token ids [S] and, when asked for, log-probabilities
of the model's raw distribution (chosen token + top-k). All work stays on the device; the caller
moves the result to the host once per step.

Random choice uses the exponential race (argmax of p / E with E ~ Exp(1)), which samples from p
exactly; a seeded sequence's tokens do not depend on what else is in the batch. E comes one of two
ways. With `SamplingBatch.keys` (the AR runner on CUDA) it is counter-based
(`layers/triton_sampling.exp_noise`): a pure function of the row's key and the token id, the key made
on the host from a seeded sequence's seed and its count of sampled tokens (`row_keys`), or drawn at
random for an unseeded row, so every row draws in one launch and only where it is read. Without keys
(the CPU) a seeded row draws V values from its own `torch.Generator` in order (as `torch.multinomial`
does on the CPU: seeded runs equal reference packages that sample that way, e.g. qwen-tts) and the
unseeded rows draw together. When every sampled row has 0 < top_k <= `MOST_CANDIDATES`, the rows
take `torch.topk` of the batch's largest k and race among those candidates (`race_candidates`: one
launch on CUDA) instead of sorting the whole vocabulary; the draw is the full row's (every other
token has probability 0). Other batches sort (top-p over all tokens) and race over the full row. Per-row parameters go to the device
from pinned memory and every branch is decided on the host, so sampling never waits for the device
(the engine may have queued the next step already).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from omnistage.ar.staging import upload
from omnistage.layers.triton_sampling import MOST_CANDIDATES, exp_noise, race_candidates
from omnistage.params import SamplingParams


@dataclass
class SamplingBatch:
    params: list[SamplingParams]                # one per sampling row
    # per-row generator of a seeded row without `keys` (and a frame head's: the Qwen3-TTS code predictor),
    # else None; may be empty (no row seeded)
    generators: list[Optional[torch.Generator]] = field(default_factory=list)
    banned: list[list[int]] = field(default_factory=list)  # per row: ids masked this step (min_tokens)
    # int32 [S, ceil(V / 32)] on the logits' device: bit j of word i set = token 32 i + j allowed; None = no grammar
    token_bitmask: Optional[torch.Tensor] = None
    # (prompt_seen [S, V] bool, output_counts [S, V] float32): the rows' ids as the engine keeps them on the
    # device (ar/token_counts.py, `TokenCounts.view`), which penalties read; needed when a row has
    # penalties, else None
    token_counts: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    # int64 [S] counter-based noise keys (`triton_sampling.row_keys`: a seeded row's from its seed and draw
    # count); None: noise from `generators` (seeded rows) and the sampler's default generator
    keys: Optional[np.ndarray] = None

    @property
    def all_greedy(self) -> bool:
        return all(p.greedy for p in self.params)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                     # [S] long
    chosen_logprobs: Optional[torch.Tensor] = None  # [S] float32, when any row asked for logprobs
    top_ids: Optional[torch.Tensor] = None      # [S, K] long
    top_logprobs: Optional[torch.Tensor] = None  # [S, K] float32


def to_device(values: list, device: torch.device, dtype=None) -> torch.Tensor:
    """A host list (or numpy array) as a device tensor, copied from the thread's persistent pinned
    ring (`ar/staging.py`) so the host neither waits for the device's queued work (a copy from
    pageable memory would) nor pins memory per call. The sampler's per-row values and the runner's
    step inputs both go this way."""
    return upload(values, device, dtype)


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """[S] long: each row's most likely token (the greedy choice, in `sample` and inside decode graphs)."""
    return logits.argmax(-1)


def plain_greedy(p: SamplingParams, banned: list[int]) -> bool:
    """A row whose token is `greedy_ids` of its raw logits: greedy, and no banned ids (`banned`: the
    row's this step), bias or penalties change its logits, no logprobs are read. (A grammar's mask
    is the caller's to rule out.)"""
    return p.greedy and not banned and not p.logit_bias and not p.needs_penalties and p.logprobs is None


def _apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Repetition penalty over each row's prompt and output ids, presence / frequency penalties over its
    output ids, from the engine's device-side counts (`token_counts`)."""
    if b.token_counts is None:
        raise ValueError("rows with penalties need SamplingBatch.token_counts (ar/token_counts.py)")
    prompt_seen, counts = b.token_counts
    dev = logits.device
    if any(p.repetition_penalty != 1 for p in b.params):
        rep = to_device([p.repetition_penalty for p in b.params], dev)
        r = rep[:, None]
        seen = (prompt_seen | (counts > 0)) & (r != 1)   # the counts hold rows of frequency penalties too
        # a tiny penalty would push a logit to +inf, and softmax to NaN (a masked token could win)
        boosted = (logits / r).clamp(max=torch.finfo(logits.dtype).max)
        logits = torch.where(seen, torch.where(logits > 0, boosted, logits * r), logits)
    if any(p.presence_penalty != 0 or p.frequency_penalty != 0 for p in b.params):
        pres = to_device([p.presence_penalty for p in b.params], dev)
        freq = to_device([p.frequency_penalty for p in b.params], dev)
        logits = logits - freq[:, None] * counts - pres[:, None] * (counts > 0).float()
    return logits


def _apply_logit_bias(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    rows = [i for i, p in enumerate(b.params) for _ in (p.logit_bias or ())]
    cols = [t for p in b.params for t in (p.logit_bias or ())]
    vals = [v for p in b.params for v in (p.logit_bias or {}).values()]
    dev = logits.device
    return logits.index_put((to_device(rows, dev), to_device(cols, dev)),
                            to_device(vals, dev, logits.dtype), accumulate=True)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """-inf for the tokens a row's packed bitmask leaves out (one batched op, any device)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(bitmask.shape[0], -1)[:, :logits.shape[-1]]
    return logits.masked_fill(allowed == 0, float("-inf"))


def filter_values(params: list[SamplingParams], device: torch.device):
    """Per-row (temperature [S], top-k [S] or None, top-p [S] or None) on `device`, for
    `filter_logits`; top-k and top-p are None when no row filters."""
    temp = to_device([1.0 if p.greedy else p.temperature for p in params], device)
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if not (any(k > 0 for k in top_k) or any(p < 1 for p in top_p)):
        return temp, None, None
    return temp, to_device([k if k > 0 else -1 for k in top_k], device), to_device(top_p, device)


def filter_logits(logits: torch.Tensor, temp: torch.Tensor, top_k: Optional[torch.Tensor] = None,
                  top_p: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Temperature, then top-k (-1: all) and top-p masks (-inf for dropped tokens), from per-row
    device tensors only (no host values, so a CUDA graph may hold it)."""
    logits = logits / temp[:, None]
    if top_k is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        v = logits.shape[-1]
        ranks = torch.arange(v, device=logits.device)[None, :]
        drop = ranks >= torch.where(top_k > 0, top_k, v)[:, None]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        mass_before = probs.cumsum(-1) - probs                         # probability above each token
        drop |= mass_before >= top_p[:, None]
        drop[:, 0] = False                                             # always keep the best token
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def _filter(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks (-inf for dropped tokens)."""
    logits = filter_logits(logits, *filter_values(b.params, logits.device))
    if any(p.min_p > 0 for p in b.params):
        min_p = to_device([p.min_p for p in b.params], logits.device)
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, float("-inf"))
    return logits


def sample(logits: torch.Tensor, b: SamplingBatch, default_generator: Optional[torch.Generator] = None,
           num_logprobs: int = -1) -> SamplerOutput:
    """num_logprobs: the largest `logprobs` asked for in the batch, -1 when nobody asked.
    `default_generator`: where unkeyed rows' random keys come from (None: torch's default)."""
    out = SamplerOutput(token_ids=torch.empty(0))
    if num_logprobs >= 0:
        raw = logits.log_softmax(-1)
        if num_logprobs > 0:
            out.top_logprobs, out.top_ids = raw.topk(num_logprobs, dim=-1)
    if any(b.banned):
        where = to_device(_banned_index(b.banned), logits.device)
        logits = logits.index_put((where[0], where[1]), logits.new_full((), float("-inf")))
    if any(p.logit_bias for p in b.params):
        logits = _apply_logit_bias(logits, b)
    if any(p.needs_penalties for p in b.params):
        logits = _apply_penalties(logits, b)
    if b.token_bitmask is not None:
        logits = apply_token_bitmask(logits, b.token_bitmask)
    if b.all_greedy:
        out.token_ids = greedy_ids(logits)
    else:
        out.token_ids = _draw(logits, b, default_generator)
    if num_logprobs >= 0:
        out.chosen_logprobs = raw.gather(-1, out.token_ids[:, None])[:, 0]
    return out


def candidates(params: list[SamplingParams], vocab: int) -> int:
    """How many top tokens per row the batch's sampled rows race among (`race_candidates`): the largest
    top_k when every sampled row has 0 < top_k <= MOST_CANDIDATES; 0 when some row needs the full row."""
    ks = [p.top_k for p in params if not p.greedy]
    if not ks or min(ks) <= 0 or max(ks) > MOST_CANDIDATES:
        return 0
    return min(max(ks), vocab)


def _draw(logits: torch.Tensor, b: SamplingBatch, generator: Optional[torch.Generator]) -> torch.Tensor:
    """[S] sampled ids of a batch with at least one sampled row (greedy rows take their argmax)."""
    dev = logits.device
    s, vocab = logits.shape
    keys = noise = None
    if b.keys is not None:                      # counter-based noise, made where it is read
        keys = to_device(b.keys, dev, torch.long)
    else:                                       # the generators' Exp(1) streams, V draws per row
        noise = _generator_noise(s, vocab, b.generators, dev, generator)
    width = candidates(b.params, vocab)
    if width:
        # rows: temperature, top-k (greedy rows: 1, their argmax), top-p, min-p in one copy, each row of
        # the block padded to 4 floats (16 bytes: the kernel's pointers stay aligned whatever S is)
        values = np.zeros((4, -(-s // 4) * 4), dtype=np.float32)
        values[:, :s] = [[1.0 if p.greedy else p.temperature for p in b.params],
                         [1 if p.greedy else p.top_k for p in b.params],
                         [p.top_p for p in b.params], [p.min_p for p in b.params]]
        rows = to_device(values, dev)[:, :s]
        vals, ids = (logits / rows[0][:, None]).topk(width, dim=-1)
        return race_candidates(vals, ids, rows[1], rows[2], rows[3], keys,
                               None if noise is None else noise.gather(1, ids))
    probs = _filter(logits, b).softmax(-1)
    sampled = (probs / (exp_noise(keys, vocab) if noise is None else noise)).argmax(-1)
    if not any(p.greedy for p in b.params):
        return sampled
    greedy_rows = to_device([p.greedy for p in b.params], dev)
    return torch.where(greedy_rows, greedy_ids(logits), sampled)


def _generator_noise(s: int, vocab: int, generators: list, dev: torch.device,
                     default: Optional[torch.Generator]) -> torch.Tensor:
    """[S, V] Exp(1) draws: a seeded row's from its own generator (V in order: `torch.multinomial`'s race
    on the CPU draws the same, so seeded CPU runs equal reference packages that sample that way), the
    other rows' in one draw from `default`."""
    noise = torch.empty(s, vocab, device=dev)
    unseeded = [i for i in range(s) if i >= len(generators) or generators[i] is None]
    if len(unseeded) == s:
        return noise.exponential_(generator=default)
    if unseeded:
        draws = torch.empty(len(unseeded), vocab, device=dev)
        noise[to_device(unseeded, dev)] = draws.exponential_(generator=default)
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    return noise


_BANNED: dict[int, tuple[list, np.ndarray]] = {}     # id(list) -> (the list, its ids as int64)


def _banned_index(banned: list[list[int]]) -> np.ndarray:
    """int64 [2, N]: (row, id) of every banned id; a row's list (often the same `bad_token_ids` list
    every step) is converted once."""
    arrays = []
    for ids in banned:
        hit = _BANNED.get(id(ids))
        if hit is None or hit[0] is not ids or len(hit[1]) != len(ids):
            if len(_BANNED) > 4096:
                _BANNED.clear()
            hit = _BANNED[id(ids)] = (ids, np.asarray(ids, dtype=np.int64))
        arrays.append(hit[1])
    lens = [len(a) for a in arrays]
    return np.stack([np.repeat(np.arange(len(arrays), dtype=np.int64), lens), np.concatenate(arrays)])
