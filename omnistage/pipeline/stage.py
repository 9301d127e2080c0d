"""The interface every stage engine offers to the orchestrator (runs in the stage's process).

A stage engine is the same loop whatever it computes: `add_request` queues work, `step` runs one
schedule -> run -> update round and returns what changed, `abort` drops a request at the next step
boundary. The AR engine, the diffusion engine and the codec engines all implement it, so the
orchestrator never knows which kind of stage it drives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from omnistage.outputs import RequestOutput


@dataclass
class StageOutput:
    request_id: str
    output: RequestOutput                       # cumulative result of this stage for the request
    finished: bool                              # no more outputs for this request from this stage
    data: dict[str, Any] = field(default_factory=dict)  # payload for downstream stages (hidden states, codes)


class StageEngine(Protocol):
    def add_request(self, request_id: str, inputs: Any, params: Any, arrival_time: Optional[float] = None) -> None: ...

    def step(self) -> list[StageOutput]: ...

    def abort(self, request_id: str) -> None: ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> dict[str, float]: ...
