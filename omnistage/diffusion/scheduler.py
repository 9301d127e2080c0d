"""Step-level continuous batching for the diffusion engine (no torch; runs in the stage's process).

In: `add(entry)` for each new request (its compatibility key, batch rows, tokens per row, step count),
`abort(request_id)`, and after every forward `update(DiffusionRunnerOutput)`. Out: per `schedule()` a
`DiffusionSchedulerOutput` naming the requests to admit (encode prompt + prepare latents) and the ONE
group of requests whose next denoising step shares a forward.

Policy, in four lines:
- admission is first come first served while fewer than `max_num_seqs` requests are in flight;
- requests are compatible when their keys are equal (same model/expert, latent shape, CFG layout);
  they share a forward whatever their timesteps;
- the group is the one holding the request that has waited longest since it last ran (so shape
  groups take turns and none starves); it is filled oldest-first up to `max_num_seqs` requests and
  `max_num_batched_tokens` tokens (a lone request always runs, however large);
- aborts take effect at the next `schedule()`: an aborted request is never in a group again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Optional


@dataclass
class SchedEntry:
    request_id: str
    key: Hashable                               # compatibility key of the request's next forward
    num_rows: int                               # batch rows per forward (images x CFG branches)
    tokens_per_row: int                         # latent tokens per row (token budget unit)
    num_steps: int                              # denoising steps in total
    steps_done: int = 0                         # steps already run
    arrival: int = 0                            # admission order (set by the scheduler)
    last_run: int = -1                          # schedule() round it last ran or was admitted in

    @property
    def tokens(self) -> int:
        return self.num_rows * self.tokens_per_row


@dataclass
class DiffusionSchedulerOutput:
    admit: list[str] = field(default_factory=list)    # newly admitted: encode + prepare before the forward
    denoise: list[str] = field(default_factory=list)  # requests sharing this step's forward, oldest first
    key: Optional[Hashable] = None              # the group's compatibility key
    num_rows: int = 0                           # total batch rows of the forward
    num_tokens: int = 0                         # total latent tokens of the forward

    @property
    def is_empty(self) -> bool:
        return not self.admit and not self.denoise


@dataclass
class DiffusionRunnerOutput:
    stepped: list[str] = field(default_factory=list)  # requests that advanced exactly one step
    next_keys: dict[str, Hashable] = field(default_factory=dict)  # req_id -> key of its next forward
    failed: dict[str, str] = field(default_factory=dict)  # req_id -> error message (dropped)


class DiffusionScheduler:
    def __init__(self, max_num_seqs: int = 8, max_num_batched_tokens: int = 1 << 20):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[SchedEntry] = deque()
        self.running: dict[str, SchedEntry] = {}
        self._round = 0
        self._arrivals = 0

    # -- the four verbs ---------------------------------------------------------------------------
    def add(self, entry: SchedEntry) -> None:
        entry.arrival = self._arrivals
        self._arrivals += 1
        self.waiting.append(entry)

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is; True when it was known."""
        if self.running.pop(request_id, None) is not None:
            return True
        for e in self.waiting:
            if e.request_id == request_id:
                self.waiting.remove(e)
                return True
        return False

    def schedule(self) -> DiffusionSchedulerOutput:
        self._round += 1
        out = DiffusionSchedulerOutput()
        while self.waiting and len(self.running) < self.max_num_seqs:
            e = self.waiting.popleft()
            e.last_run = self._round - 1
            self.running[e.request_id] = e
            out.admit.append(e.request_id)
        if not self.running:
            return out
        order = sorted(self.running.values(), key=lambda e: (e.last_run, e.arrival))
        key = order[0].key
        for e in order:
            if e.key != key or len(out.denoise) >= self.max_num_seqs:
                continue
            if out.denoise and out.num_tokens + e.tokens > self.max_num_batched_tokens:
                continue
            out.denoise.append(e.request_id)
            out.num_rows += e.num_rows
            out.num_tokens += e.tokens
            e.last_run = self._round
        out.key = key
        return out

    def update(self, result: DiffusionRunnerOutput) -> list[str]:
        """Apply one forward's result; returns the requests that finished denoising (now removed)."""
        finished = []
        for rid in result.failed:
            self.running.pop(rid, None)
        for rid in result.stepped:
            e = self.running.get(rid)
            if e is None:  # aborted while it ran
                continue
            e.steps_done += 1
            if rid in result.next_keys:
                e.key = result.next_keys[rid]
            if e.steps_done >= e.num_steps:
                del self.running[rid]
                finished.append(rid)
        return finished

    # -- introspection ----------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)
