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

from dataclasses import dataclass
from typing import Any, Optional, Protocol, runtime_checkable

from omnistage.outputs import RequestOutput


@dataclass
class HiddenStates:
    """Rows an AR stage computed this step for a request that asked for them (`return_hidden_states`)."""

    start: int                                  # position of the first row
    hidden: Any                                 # last hidden states after the final norm [n, H] (device tensor)
    inputs: Any                                 # the rows fed to the first layer [n, H] (embeddings + conditioning)


@dataclass
class StageError:
    """Why a stage dropped a request; the orchestrator fails only that request with it."""

    message: str
    fatal: bool = False                         # the stage went down under it (its process died): a 503, not a 400


@dataclass
class StageOutput:
    """What a stage says of one request after a step; `output` is cumulative, the rest is this step's."""

    request_id: str
    output: RequestOutput                       # cumulative result of this stage for the request
    finished: bool                              # no more outputs for this request from this stage
    hidden: Optional[HiddenStates] = None       # AR: hidden-state rows of this step (for downstream stages)
    audio_chunk: Any = None                     # codec: float32 samples added this step (numpy [n]; empty when none)
    videos: Optional[list] = None               # diffusion: every video of the request (`VideoOutput`s), when done
    timings: Optional[dict[str, float]] = None  # diffusion: seconds per phase, when done
    finish_reason: Optional[str] = None         # diffusion: "stop" | "abort" | "error" on the last output
    error: Optional[StageError] = None          # the request failed in this stage


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
