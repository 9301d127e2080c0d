"""The messages between a `StageClient` and its stage process (both processes import this module).

Client -> stage process, on the command socket: `InitStage` once, then `CallStage` (the engine runs
one of its methods between two steps) until `StopStage`. Stage process -> client, on the output
socket: `StageReady` or `StageFatal` once, then `StageOutputs` after each step that produced some and
`CallReply` for every call that asked for an answer. All are dataclasses of an omnistage module, so
`pipeline.wire` carries them as they are; they live apart from `stage_client` because the stage
process runs that module as `__main__`, where class paths would not name it.

A refusal crosses the boundary as a `CallError`, which rebuilds on the client's side the exception
an in-process engine would have raised: a `ParamError` keeps its field, so the HTTP layer names it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from omnistage.params import ParamError
from omnistage.spec import StageSpec
from omnistage.stage import StageOutput


# ---- client -> stage process ----------------------------------------------------------------------
@dataclass
class InitStage:
    """The first command: build this stage's engine."""

    spec: StageSpec                             # the stage to build (`pipeline.build.build_engine(spec)`)


@dataclass
class CallStage:
    """Run `engine.<method>(*args)` between two steps."""

    seq: int                                    # > 0: answer with a `CallReply` of this seq; 0: one-way
    method: str                                 # a `StageEngine` verb: add_request, add_input, abort, check_params;
                                                # add_requests: args is [[add_request's args] per request]
    args: list                                  # its positional arguments


@dataclass
class StopStage:
    """Leave the serving loop; the stage process exits."""


# ---- stage process -> client ----------------------------------------------------------------------
@dataclass
class StageStarting:
    """A step of the stage process's start-up (its build's log lines), sent until it is ready, so that a
    start that fails or takes too long says where it was."""

    message: str                                # e.g. "code2wav: capturing 36 ODE graphs ..."


@dataclass
class StageReady:
    """The engine is built; what the client offers and reads once, at start."""

    params_type: Optional[str]                  # "module:qualname" of the engine's params class; None = none
    methods: list[str]                          # the optional verbs the engine has (add_input, check_params, voices)
    voices: Optional[list]                      # `engine.voices()` ([{id, name, ...}]); None = no voices
    max_model_len: Optional[int]                # AR engines: the context length in tokens
    tokenizer: Optional[str]                    # folder the engine's tokenizer came from (`name_or_path`)
    attributes: dict = field(default_factory=dict)   # plain attributes entry points read (output_kind, ...)


@dataclass
class StageFatal:
    """The engine could not be built; the stage process exits."""

    message: str                                # repr of the exception


@dataclass
class StageOutputs:
    """What one engine step produced."""

    outputs: list[StageOutput]                  # one per request that changed this step
    stats: dict[str, float]                     # `engine.stats()` after the step
    # request id -> how its output's lists continue the last one sent (`pipeline/output_deltas.py`); absent: whole
    deltas: dict = field(default_factory=dict)


@dataclass
class CallError:
    """Why a `CallStage` failed in the stage process."""

    message: str                                # str() of the exception
    bad_request: bool                           # a ValueError (the caller's request is wrong): else a RuntimeError
    field: Optional[str] = None                 # the request field a `ParamError` names; None = none

    @classmethod
    def of(cls, error: Exception) -> "CallError":
        return cls(str(error), isinstance(error, ValueError), error.field if isinstance(error, ParamError) else None)

    def exception(self) -> Exception:
        """The exception to raise in the client: ParamError, ValueError or RuntimeError."""
        if self.field is not None:
            return ParamError(self.field, self.message)
        return ValueError(self.message) if self.bad_request else RuntimeError(self.message)


@dataclass
class CallReply:
    """The answer to a `CallStage` with seq > 0."""

    seq: int                                    # the call's seq
    result: Any = None                          # what the method returned (None when it failed)
    error: Optional[CallError] = None           # None: the call succeeded


Command = Union[InitStage, CallStage, StopStage]
Answer = Union[StageReady, StageFatal, StageOutputs, CallReply]
