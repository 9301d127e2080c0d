"""Token sampling on the device that holds the logits (stage process, CPU or CUDA).

In: float32 logits [S, V] for the S sequences that sample this step, and a `SamplingInputs` holding
their parameters as device tensors (the runner gathers them per step from its per-sequence rows, in
the step's one upload; ar/step_inputs.py) plus host-side flags that pick the paths. Out: the chosen
token ids [S] and, when asked for, log-probabilities of the model's raw distribution (chosen token +
top-k). No per-row Python except one noise draw per seeded row; the caller moves the result to the
host once per step.

Random choice uses the exponential race (argmax of p / E with E ~ Exp(1)), which samples from p
exactly. A seeded sequence draws its E from its own generator, so its tokens do not depend on
what else is in the batch. Those draws stay one call per seeded row: a batched draw would give other
numbers than the per-row draws the sequence made so far (torch's generators promise no such identity).

Top-k / top-p: with every sampling row's k at most `TOPK_FAST_MAX` the filter works on `topk(kmax)`
instead of a sort of the whole vocabulary (`_top_k_top_p_fast`); otherwise on the full sort
(`_top_k_top_p_sorted`, the reference). Both keep the same tokens: the prefix of the descending order
whose length the same rank / mass rule gives, equal logits at the cut taken lowest index first (the
order of the stable sort that CUDA's large-vocabulary sort is; CPU's sort orders equal values
arbitrarily).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from omnistage.ar.step_inputs import F_FREQ, F_GREEDY, F_MIN_P, F_PRES, F_REP, F_TEMP, F_TOP_P

TOPK_FAST_MAX = 1024                            # largest k the top-k path serves; above it, the full sort


@dataclass
class SamplingInputs:
    params: torch.Tensor                        # [S, NUM_F] float32: step_inputs.F_* columns per row
    all_greedy: bool                            # every row greedy: argmax only
    filter_k: int = 0                           # 0: no top-k / top-p; > 0: top-k path with this kmax; -1: full sort
    top_k: Optional[torch.Tensor] = None        # [S] long: k per row (V for none), when filter_k != 0
    any_min_p: bool = False
    any_repetition: bool = False                # some row has repetition_penalty != 1
    any_presence_frequency: bool = False        # some row has presence / frequency penalty != 0
    counts: Optional[torch.Tensor] = None       # [S, V] float32: generated-token counts, when penalties
    prompt_seen: Optional[torch.Tensor] = None  # [S, V] bool: prompt tokens, when repetition penalties
    banned: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (rows, ids) masked this step
    unseeded: Optional[torch.Tensor] = None     # [U] long: rows drawing from the default generator; None: all
    num_unseeded: int = 0
    seeded: list[tuple[int, torch.Generator]] = field(default_factory=list)  # (row, generator), sampled rows


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                     # [S] long
    chosen_logprobs: Optional[torch.Tensor] = None  # [S] float32, when any row asked for logprobs
    top_ids: Optional[torch.Tensor] = None      # [S, K] long
    top_logprobs: Optional[torch.Tensor] = None  # [S, K] float32


def _apply_penalties(logits: torch.Tensor, s: SamplingInputs) -> torch.Tensor:
    """HF-style repetition penalty over prompt + generated tokens, then presence / frequency over generated.
    Rows without a penalty read zero counts and factor 1, which leave their logits bit for bit."""
    p = s.params
    if s.any_repetition:
        seen = s.prompt_seen | (s.counts > 0)
        r = p[:, F_REP:F_REP + 1]
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    if s.any_presence_frequency:
        counts = s.counts
        logits = logits - p[:, F_FREQ:F_FREQ + 1] * counts - p[:, F_PRES:F_PRES + 1] * (counts > 0).float()
    return logits


def _top_k_top_p_sorted(logits: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    v = logits.shape[-1]
    ranks = torch.arange(v, device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    mass_before = probs.cumsum(-1) - probs                         # probability above each token
    drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False                                             # always keep the best token
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def _top_k_top_p_fast(logits: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor, kmax: int) -> torch.Tensor:
    """Same tokens as `_top_k_top_p_sorted` for rows with k <= kmax, from the kmax largest values only."""
    vals = logits.topk(kmax, dim=-1).values                        # descending: a full sort's first kmax values
    ranks = torch.arange(kmax, device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    probs = vals.masked_fill(drop, float("-inf")).softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False
    kept = (~drop).sum(-1, keepdim=True)                           # the kept prefix's length
    last = vals.gather(-1, kept - 1)                               # its smallest value
    # Tokens above `last` are kept; of those equal to it, as many as the prefix holds, lowest index first.
    room = kept - (vals > last).sum(-1, keepdim=True)
    tie = logits == last
    keep = (logits > last) | (tie & (tie.cumsum(-1, dtype=torch.int32) <= room))
    return logits.masked_fill(~keep, float("-inf"))


def _filter(logits: torch.Tensor, s: SamplingInputs) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks (-inf for dropped tokens)."""
    logits = logits / s.params[:, F_TEMP:F_TEMP + 1]
    if s.filter_k > 0:
        logits = _top_k_top_p_fast(logits, s.top_k, s.params[:, F_TOP_P], min(s.filter_k, logits.shape[-1]))
    elif s.filter_k < 0:
        logits = _top_k_top_p_sorted(logits, s.top_k, s.params[:, F_TOP_P])
    if s.any_min_p:
        probs = logits.softmax(-1)
        threshold = s.params[:, F_MIN_P:F_MIN_P + 1] * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def sample(logits: torch.Tensor, s: SamplingInputs, default_generator: Optional[torch.Generator] = None,
           num_logprobs: int = -1) -> SamplerOutput:
    """num_logprobs: the largest `logprobs` asked for in the batch, -1 when nobody asked."""
    out = SamplerOutput(token_ids=torch.empty(0))
    if num_logprobs >= 0:
        raw = logits.log_softmax(-1)
        if num_logprobs > 0:
            out.top_logprobs, out.top_ids = raw.topk(num_logprobs, dim=-1)
    if s.banned is not None:
        logits = logits.index_put(s.banned, torch.tensor(float("-inf"), device=logits.device))
    if s.any_repetition or s.any_presence_frequency:
        logits = _apply_penalties(logits, s)
    greedy_ids = logits.argmax(-1)
    if s.all_greedy:
        out.token_ids = greedy_ids
    else:
        probs = _filter(logits, s).softmax(-1)
        rows, v = probs.shape
        if s.num_unseeded == rows:
            noise = torch.empty(rows, v, device=probs.device).exponential_(generator=default_generator)
        else:
            noise = torch.empty_like(probs)
            if s.num_unseeded:
                noise[s.unseeded] = torch.empty(s.num_unseeded, v, device=probs.device).exponential_(
                    generator=default_generator)
        for i, g in s.seeded:
            noise[i].exponential_(generator=g)
        sampled = (probs / noise).argmax(-1)
        out.token_ids = torch.where(s.params[:, F_GREEDY] != 0, greedy_ids, sampled)
    if num_logprobs >= 0:
        out.chosen_logprobs = raw.gather(-1, out.token_ids[:, None])[:, 0]
    return out
