"""Inputs beyond token ids for one AR step (stage process, CPU or CUDA).

Some stages are fed embeddings: an omni thinker's prompt carries encoder outputs merged into its
embedding rows and 3-D multimodal-rope positions; a talker adds one streamed vector from the
upstream stage to each generated row. This module turns the per-sequence conditioning held on
`Sequence` into the step's `inputs_embeds` rows and position tensor, in the runner's row order.
"""

from __future__ import annotations

import torch

from omnistage.ar.scheduler import ScheduledSeq
from omnistage.ar.sequence import Sequence


def needs_embeds(order: list[ScheduledSeq]) -> bool:
    """True when some sequence's rows are not just the embedding of its token ids (or must be reported)."""
    return any(s.seq.prompt_embeds is not None or s.seq.stream_extra or s.seq.return_hidden for s in order)


def positions(order: list[ScheduledSeq]) -> tuple[list[int], list[list[int]] | None]:
    """1-D positions of every row and, when a multimodal-rope prompt is being prefilled, 3-D rows."""
    flat: list[int] = []
    for s in order:
        seq = s.seq
        flat += [p + (seq.position_delta if p >= seq.prompt_len else 0)
                 for p in range(s.start, s.start + s.num_new_tokens)]
    if not any(s.seq.mrope_positions is not None and s.start < s.seq.prompt_len for s in order):
        return flat, None
    rows: list[list[int]] = [[], [], []]
    i = 0
    for s in order:
        seq, a, b = s.seq, s.start, s.start + s.num_new_tokens
        for p in range(a, b):
            if seq.mrope_positions is not None and p < seq.prompt_len:
                for r in range(3):
                    rows[r].append(int(seq.mrope_positions[r, p]))
            else:
                for r in range(3):
                    rows[r].append(flat[i])
            i += 1
    return flat, rows


def extra_rows(seq: Sequence, i: int, j: int) -> torch.Tensor:
    """Streamed rows i..j-1 of a sequence (the pad row past the end of a finished stream)."""
    if len(seq.extra_chunks) > 1:
        seq.extra_chunks = [torch.cat(seq.extra_chunks)]
    have = seq.extra_chunks[0] if seq.extra_chunks else None
    got = have[i:min(j, seq.num_extra)] if have is not None and i < seq.num_extra else None
    missing = j - max(i, seq.num_extra)
    if missing <= 0:
        return got
    pad = seq.pad_embed[None].expand(missing, -1)
    return pad if got is None else torch.cat([got, pad.to(got)])


def apply(x: torch.Tensor, order: list[ScheduledSeq]) -> None:
    """Overwrite prompt rows given as embeddings and add streamed rows, in place on x [T, H]."""
    row = 0
    for s in order:
        seq, a, b = s.seq, s.start, s.start + s.num_new_tokens
        p_len = seq.prompt_len
        if seq.prompt_embeds is not None and a < p_len:
            e = min(b, p_len)
            x[row:row + e - a] = seq.prompt_embeds[a:e].to(x)
        if seq.stream_extra and b > p_len:
            lo = max(a, p_len)
            x[row + lo - a:row + b - a] += extra_rows(seq, lo - p_len, b - p_len).to(x)
        row += s.num_new_tokens
