"""Per-sequence token counts on the device, for repetition / presence / frequency penalties (stage process).

In: the sequences of a step that sample with penalties (their prompt ids once, their output ids as
they grow), and each step's sampled ids (a device tensor). Out: per sampling row, a row of
`prompt_seen` [V] bool (ids in its prompt) and of `output_counts` [V] float32 (times each id was
generated), gathered for the step in one index op (`TokenCounts.view`), which the sampler turns into
the penalties (`sampler._apply_penalties`: the same values as from the whole history).

The counts are kept, not rebuilt: a sequence's slot gets its prompt ids once, and each step's
sampled ids are added on the device right after sampling (`add_sampled`: one scatter, no host
value, so a step queued ahead needs nothing from the host). Each slot records how many of its output
ids it holds; ids it lacks (its first step, or ids added outside a sampling step) are uploaded in
one copy for the whole step, a trailing placeholder (async scheduling) taken from the queued step's
device ids. A preempted sequence keeps its slot (its ids are recomputed, not changed); a finished
or aborted one frees it (`release`). Slot 0 is all zeros: rows without penalties read it.
"""

from __future__ import annotations

from typing import Optional

import torch

from omnistage.ar.sampler import to_device
from omnistage.ar.sequence import PLACEHOLDER


class TokenCounts:
    """Prompt-id masks and output-id counts per sequence slot, on one device."""

    def __init__(self, vocab: int, device: torch.device):
        self.vocab = vocab
        self.device = device
        self.prompt_seen = torch.zeros(0, vocab, dtype=torch.bool, device=device)     # [slots, V]
        self.output_counts = torch.zeros(0, vocab, dtype=torch.float32, device=device)  # [slots, V]
        self.slots: dict[str, int] = {}         # seq_id -> its slot (>= 1)
        self.counted: dict[str, int] = {}       # seq_id -> output ids its slot holds (the first ones)
        self.free: list[int] = []               # slots to reuse

    def _slot(self, seq_id: str) -> tuple[int, bool]:
        """(the sequence's slot, whether it is new)."""
        slot = self.slots.get(seq_id)
        if slot is not None:
            return slot, False
        if not self.free:
            old = self.prompt_seen.shape[0]
            new = max(8, 2 * old)
            self.prompt_seen = torch.cat([self.prompt_seen, self.prompt_seen.new_zeros(new - old, self.vocab)])
            self.output_counts = torch.cat([self.output_counts, self.output_counts.new_zeros(new - old, self.vocab)])
            self.free = list(range(new - 1, max(old, 1) - 1, -1))
        slot = self.free.pop()
        self.slots[seq_id] = slot
        self.counted[seq_id] = 0
        return slot, True

    def lacks(self, seqs: list, penalized: list[bool]) -> bool:
        """Whether `prepare` must upload ids for these rows (else it needs no `pending`)."""
        return any(on and self.counted.get(q.seq_id) != len(q.token_ids) - q.prompt_len
                   for q, on in zip(seqs, penalized))

    def prepare(self, seqs: list, penalized: list[bool], pending: Optional[torch.Tensor]) -> torch.Tensor:
        """[S] long on the device: each row's slot (0 for rows without penalties), after uploading what
        the penalized rows' slots lack. `pending` [S]: the queued step's id for rows whose last token
        is a PLACEHOLDER (None when none is)."""
        rows, prompt_at, output_at, held = [], [], [], []
        v = self.vocab
        for i, (q, on) in enumerate(zip(seqs, penalized)):
            if not on:
                rows.append(0)
                continue
            slot, new = self._slot(q.seq_id)
            rows.append(slot)
            ids = q.token_ids
            if new:
                prompt_at.extend(slot * v + t for t in ids[:q.prompt_len])
            have, total = self.counted[q.seq_id], len(ids) - q.prompt_len
            if have > total:                    # ids went away (never, today): count them afresh
                self.output_counts[slot] = 0
                have = 0
            for t in ids[q.prompt_len + have:]:
                if t == PLACEHOLDER:
                    held.append((len(output_at), i))
                    t = 0                        # row * vocab until the queued id is added on the device
                output_at.append(slot * v + t)
            self.counted[q.seq_id] = total
        if prompt_at:
            self.prompt_seen.view(-1)[to_device(prompt_at, self.device)] = True
        if output_at:
            at = to_device(output_at, self.device)
            if held:
                where, row = zip(*held)
                at[to_device(list(where), self.device)] += pending[to_device(list(row), self.device)]
            self.output_counts.view(-1).index_add_(0, at, torch.ones(len(output_at), device=self.device))
        return to_device(rows, self.device)

    def add_sampled(self, seqs: list, slots: torch.Tensor, penalized: list[bool], token_ids: torch.Tensor) -> None:
        """Counts each penalized row's sampled id (device tensor [S]) in its slot: the id its sequence
        appends next."""
        at = slots * self.vocab + token_ids
        if not all(penalized):
            keep = [i for i, on in enumerate(penalized) if on]
            at = at[to_device(keep, self.device)]
        self.output_counts.view(-1).index_add_(0, at, torch.ones(at.shape[0], device=self.device))
        for q, on in zip(seqs, penalized):
            if on:
                self.counted[q.seq_id] += 1

    def view(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt_seen [S, V] bool, output_counts [S, V] float32) of the step's rows."""
        return self.prompt_seen[slots], self.output_counts[slots]

    @torch.inference_mode()                     # the tables are made in the step's inference mode
    def release(self, seq_id: str) -> None:
        slot = self.slots.pop(seq_id, None)
        if slot is None:
            return
        del self.counted[seq_id]
        self.prompt_seen[slot] = False
        self.output_counts[slot] = 0
        self.free.append(slot)
