"""The interface every stage engine offers to the orchestrator (runs in the stage's process).

A stage engine is the same loop whatever it computes: `add_request` queues work, `step` runs one
schedule -> run -> update round and returns what changed, `abort` drops a request at the next step
boundary. The AR engine, the diffusion engine and the codec engines all implement it, so the
orchestrator never knows which kind of stage it drives.

Optional verbs, looked up with `getattr`:
  * `add_input(request_id, piece)`: more input for a request added with an unfinished streamed
    input (a `Streamable` whose `finished` is False). Only stages with it can sit at the receiving
    end of a streaming edge.
  * `check_params(params)`: raise `ValueError` for params this stage cannot serve (unknown voice),
    so that a request is refused before any upstream stage spends work on it.
  * `params_type`: the params class of the stage, built from a stage's default params in the spec.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, runtime_checkable

from omnistage.outputs import RequestOutput


@dataclass
class StageOutput:
    request_id: str
    output: RequestOutput                       # cumulative result of this stage for the request
    finished: bool                              # no more outputs for this request from this stage
    data: dict[str, Any] = field(default_factory=dict)  # payload for downstream stages (hidden states, codes);
    # data["fatal"] (a message) means the stage lost the request (its process died): the request fails


class StageDeadError(RuntimeError):
    """A request failed because a stage holding it went down (its process died); the stage restarts."""


@runtime_checkable
class Streamable(Protocol):
    """A typed stage input that can arrive in pieces (sentences, codec tokens, hidden-state rows).

    Adapters return the cumulative input for everything upstream has produced so far; the
    orchestrator forwards the units it has not sent yet with `slice`.
    """

    finished: bool                              # upstream will add no more units
    # Optional: `head_units` (int), the most units the piece that starts the downstream request
    # (`add_request`) may hold; the rest of what is ready follows at once through `add_input`.

    def __len__(self) -> int: ...               # units available so far

    def slice(self, start: int, end: int, finished: bool) -> "Streamable": ...


class StageEngine(Protocol):
    def add_request(self, request_id: str, inputs: Any, params: Any, arrival_time: Optional[float] = None) -> None: ...

    def step(self) -> list[StageOutput]: ...

    def abort(self, request_id: str) -> None: ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> dict[str, float]: ...
