"""`CodecScheduler`: which chunks of which codec requests run this step (a codec stage's process; no torch).

In: `add(request)` with a `CodecRequest` (the codec model's state of the request, the key of the
settings it may share a decode under, whether its input is complete); `ready(request)`, given at
construction, says what a request's next chunk is, or None when it waits for input or has nothing
left. Out: `schedule()` -> a `CodecBatch`: the next chunk of up to `max_batch` ready requests that
share the batch key of the first of them -- requests with no audio yet first (a listener waits for
its first chunk; the others have audio playing), in arrival order, then the rest oldest-served first
(round-robin; with `first_alone`, a batch with first chunks holds nothing else); `update(batch, audio)`
appends each decoded chunk to its request, moves the served requests to the back of the queue and
returns a `CodecReport` for every request that changed (served, or finished without a chunk);
finished requests leave the scheduler. `abort(request_id)` drops a request.

A request finishes when its input is complete and `ready` has no chunk left for it. Chunks and
audio are opaque here (a model's description of a chunk, a numpy array), so the scheduler is tested
with fake ones (tests/codec/test_scheduler.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional, Sequence

from omnistage.outputs import RequestMetrics


@dataclass
class CodecRequest:
    """One request of a codec stage: what the scheduler orders and the engine reports."""

    request_id: str
    state: Any                                  # the codec model's state of the request (`CodecModel.new_state`)
    batch_key: Hashable = None                  # requests with equal keys may share one decode (code2wav: ODE settings)
    input_done: bool = False                    # the last input piece has arrived
    chunks: list = field(default_factory=list)  # audio of each decoded chunk, in order (float32 samples)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.time()))


@dataclass
class CodecBatch:
    """What one step decodes: one chunk each for up to `max_batch` requests that share a batch key."""

    requests: list[CodecRequest] = field(default_factory=list)  # least recently served first
    chunks: list[Any] = field(default_factory=list)             # per request: its next chunk, as `ready` gave it

    def __len__(self) -> int:
        return len(self.requests)


@dataclass
class CodecReport:
    """A request that changed this step, for the engine to turn into a `StageOutput`."""

    request: CodecRequest                       # its `chunks` hold all of its audio so far
    chunk: Any                                  # audio decoded for it this step; None when it only finished
    finished: bool                              # no more outputs: the request has left the scheduler


class CodecScheduler:
    def __init__(self, ready: Callable[[CodecRequest], Optional[Any]], max_batch: int, first_alone: bool = False):
        """`first_alone`: a batch with a first chunk takes first chunks only (code2wav: a first chunk's
        short window then decodes in a small batch instead of padded into a full one of later chunks)."""
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        self.ready = ready
        self.max_batch = max_batch
        self.first_alone = first_alone
        # Insertion order is the round-robin order: a served request moves to the back.
        self.requests: dict[str, CodecRequest] = {}

    def add(self, request: CodecRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request

    def schedule(self) -> CodecBatch:
        """The ready chunks of this step, all with the batch key of the first ready request: first
        chunks before later ones, then the least recently served."""
        batch = CodecBatch()
        for req in sorted(self.requests.values(), key=lambda r: bool(r.chunks)):   # stable: keeps queue order
            if len(batch) == self.max_batch:
                break
            if batch.requests and req.batch_key != batch.requests[0].batch_key:
                continue
            if self.first_alone and batch.requests and req.chunks and not batch.requests[0].chunks:
                break                           # sorted: no first chunk follows
            chunk = self.ready(req)
            if chunk is not None:
                batch.requests.append(req)
                batch.chunks.append(chunk)
        return batch

    def update(self, batch: CodecBatch, audio: Sequence[Any]) -> list[CodecReport]:
        """Takes the decoded audio of `batch` (one entry per request, in order); returns what changed,
        in queue order after the served requests moved to the back."""
        now = time.time()
        served: dict[str, Any] = {}
        for req, chunk in zip(batch.requests, audio, strict=True):
            req.chunks.append(chunk)
            req.metrics.first_scheduled_time = req.metrics.first_scheduled_time or now
            req.metrics.first_token_time = req.metrics.first_token_time or now
            self.requests[req.request_id] = self.requests.pop(req.request_id)
            served[req.request_id] = chunk
        reports = []
        for req in list(self.requests.values()):
            finished = req.input_done and self.ready(req) is None
            if not finished and req.request_id not in served:
                continue
            if finished:
                req.metrics.finished_time = now
                del self.requests[req.request_id]
            reports.append(CodecReport(req, served.get(req.request_id), finished))
        return reports

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def num_ready(self) -> int:
        """Requests with a chunk to decode now (the rest wait for input)."""
        return sum(1 for req in self.requests.values() if self.ready(req) is not None)
