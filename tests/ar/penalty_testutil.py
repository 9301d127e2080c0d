"""Penalty checks' shared pieces (CPU): rows' histories as the engine's device-side token counts
(`ar/token_counts.TokenCounts`, what the sampler's penalties read), and the penalty formula applied
row by row over those histories (the reference the counts' penalties must equal)."""

from __future__ import annotations

from typing import Optional

import torch

from omnistage.ar.sequence import PLACEHOLDER, Sequence
from omnistage.ar.token_counts import TokenCounts
from omnistage.params import SamplingParams


def counts_of(params: list[SamplingParams], prompts: list[list[int]], outputs: list[list[int]], vocab: int,
              pending: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`SamplingBatch.token_counts` of rows with these prompt / output ids (an output may end in a
    PLACEHOLDER: `pending` [S] holds the id it stands for), through `TokenCounts.prepare` as the runner
    calls it."""
    seqs = []
    for i, (p, prompt, out) in enumerate(zip(params, prompts, outputs)):
        seq = Sequence(f"s{i}", f"s{i}", 0, prompt, p, arrival_time=0.0)
        seq.token_ids += out
        seqs.append(seq)
    counts = TokenCounts(vocab, torch.device("cpu"))
    return counts.view(counts.prepare(seqs, [p.needs_penalties for p in params], pending))


def penalized(logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]],
              outputs: list[list[int]], pending: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The penalties row by row: repetition over prompt + output ids, presence / frequency over output
    ids (a PLACEHOLDER read from `pending`)."""
    want = logits.clone()
    for i, p in enumerate(params):
        out = [int(pending[i]) if t == PLACEHOLDER else t for t in outputs[i]]
        if p.repetition_penalty != 1:
            for t in set(prompts[i] + out):
                x = want[i, t]
                want[i, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for t in set(out):
            want[i, t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    return want
