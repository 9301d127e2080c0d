"""Continuous-batching scheduler of the AR engine (runs in the stage's process; no torch).

Every step it picks the tokens to compute under a token budget (`max_num_batched_tokens`) and a
sequence cap (`max_num_seqs`): running sequences first (one decode token each, or the next chunk
of a long prompt), then waiting sequences first-come-first-served, whose prompts may be split
into chunks (chunked prefill) and start from cached prefix blocks. When the KV pool runs dry the
most recently admitted running sequence is preempted: its blocks are released and it goes back to
the front of the queue to be recomputed later (its full blocks usually survive in the prefix cache).

In: `Sequence`s (add), sampled token ids per sequence (update). Out: `SchedulerOutput` per step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from omnistage.ar.kv_cache import BlockManager
from omnistage.ar.sequence import PLACEHOLDER, SeqStatus, Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int                         # tokens computed for this sequence this step
    start: int                                  # position of the first of them (= computed before)

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the known tokens, so the step yields a new token."""
        return self.start + self.num_new_tokens == len(self.seq.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # in batch order
    preempted: list[Sequence] = field(default_factory=list)      # sent back to the queue this step
    num_batched_tokens: int = 0                                  # sum of num_new_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free_seq(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        # 1. Running sequences keep their place; preempt from the back when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = _computable(seq, budget)
            if n == 0:                                   # waiting for streamed inputs: keep its blocks
                i += 1
                continue
            need = self.bm.blocks_needed(seq, n)
            while not self.bm.can_allocate(need):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != SeqStatus.RUNNING:
                break
            if need:                                     # most decode steps fit in the last block
                self.bm.allocate(seq, n)
            out.scheduled.append(ScheduledSeq(seq, n, seq.num_computed_tokens))
            budget -= n
            i += 1

        # 2. Waiting sequences, first come first served, while nothing had to be preempted.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting[0]
            cached = self.bm.match_prefix(seq)
            n = _computable(seq, budget)
            if n == 0 or not self.bm.can_allocate(self.bm.blocks_needed(seq, n)):
                self.bm.free_seq(seq)
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            self.bm.allocate(seq, n)
            seq.status = SeqStatus.RUNNING
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = cached
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n, seq.num_computed_tokens))
            budget -= n

        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> None:
        """Advance computed counts and append the token sampled for each sequence that sampled."""
        bs = self.bm.block_size
        for s in out.scheduled:
            seq = s.seq
            if seq.status != SeqStatus.RUNNING:      # aborted while the step ran
                continue
            seq.num_computed_tokens = done = s.start + s.num_new_tokens
            if done // bs > len(seq.block_hashes):   # a block filled up this step
                self.bm.commit_full_blocks(seq)
            token = sampled.get(seq.seq_id)
            if token is not None:
                seq.token_ids.append(token)

    def finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        if seq.status == SeqStatus.FINISHED:
            return
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free_seq(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    def abort(self, seq: Sequence) -> None:
        self.finish(seq, "abort")


def _computable(seq: Sequence, budget: int) -> int:
    """Tokens of the sequence that may run now: what is left to compute, within the budget, as far
    as its streamed inputs have arrived (`Conditioning.max_computable`). None when its last token is
    a queued step's (`PLACEHOLDER`) and that token is its last by `max_tokens` whatever its value."""
    last = seq.params.max_tokens
    if seq.token_ids[-1] == PLACEHOLDER and last is not None and seq.num_output_tokens >= last:
        return 0
    n = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
    return n if seq.cond is None else seq.cond.max_computable(seq.num_computed_tokens, n)
