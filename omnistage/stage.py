"""The interface every stage engine offers to the orchestrator (runs in the stage's process).

A stage engine is the same loop whatever it computes: `add_request` queues work, `step` runs one
schedule -> run -> update round and returns what changed, `abort` drops a request at the next step
boundary. The AR engine, the diffusion engine and the codec engines all implement it, so the
orchestrator never knows which kind of stage it drives.

Optional verbs, looked up with `getattr`:
  * `add_input(request_id, piece)`: more input for a request added with an unfinished streamed
    input (a `Streamable` whose `finished` is False). Only stages with it can sit at the receiving
    end of a streaming edge.
  * `add_inputs(items)`: `add_input` for each (request_id, piece) of `items`, returning per item None
    or why it was refused (the orchestrator hands over a step's pieces for one stage this way when
    the stage has it; a shared stage then orders them after the adapters' device work once).
  * `check_params(params)`: raise `ValueError` for params this stage cannot serve (unknown voice),
    so that a request is refused before any upstream stage spends work on it.
  * `params_type`: the params class of the stage, built from a stage's default params in the spec.

`add_each` adds a batch of requests to an engine one by one, each refusal its request's own;
`add_inputs_each` hands an engine a batch of streamed pieces the same way.

The AR stage's messages are here too: `ARPrompt` (what starts a request; `ARPrompt.of` converts the
plain string, token-id list or dict a user passes), `ExtraRows` (a streamed piece of rows added to
its generated positions, through `add_input`) and `HiddenStates` (what it reports per step).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Protocol, runtime_checkable

from omnistage.outputs import RequestOutput
from omnistage.params import ParamError

_PROMPT_FORMS = "a string, token ids, or a dict with 'prompt' or 'prompt_token_ids'"


@dataclass
class ARPrompt:
    """The input that starts one AR request: text or token ids, and optional embedding-level inputs.

    Tensors may sit on any device; the AR engine moves them to its own. P is the prompt's length in
    tokens (of `prompt_token_ids`, or of `prompt` once tokenized).
    """

    prompt: Optional[str] = None                # prompt text: tokenized by the stage unless token ids are given
    prompt_token_ids: Optional[list[int]] = None  # prompt token ids; with them, `prompt` is only reported
    add_special_tokens: bool = True             # tokenizing `prompt` adds the tokenizer's special tokens (BOS)
    prompt_embeds: Any = None                   # [P, H] rows fed instead of the prompt tokens' embeddings (tensor)
    mrope_positions: Any = None                 # [3, P] multimodal-rope positions (t, h, w) of the prompt (int tensor)
    mrope_delta: int = 0                        # with mrope_positions: generated position p is rotated as p + delta
    layer_embeds: Any = None                    # [L, P, H] rows added to the prompt's hidden states after decoder layers 0..L-1 (deepstack; tensor)
    return_hidden_states: bool = False          # report every computed row as `StageOutput.hidden`; n = 1
    stream_extra: bool = False                  # generated position P + j adds streamed row j (`ExtraRows`); n = 1
    extra_rows: Any = None                      # [k, H] rows added to generated positions P..P+k-1, given up front; n = 1
    extra_pad: Any = None                       # with extra_rows: [H] row added to every later generated position
    frame_feedback: bool = False                # the model's `frame_head` feeds each sampled token's frame row to the next position; n = 1
    context_frames: Any = None                  # frame-head talkers: [T, G] frames (every codebook) the audio continues, reported as `RequestOutput.context_frames` (Base cloning: the reference's codes)

    def __post_init__(self) -> None:
        if self.prompt is None and self.prompt_token_ids is None:
            raise ValueError(f"a prompt must be {_PROMPT_FORMS}")

    @classmethod
    def of(cls, inputs: Any) -> "ARPrompt":
        """A user's prompt as an `ARPrompt`: a string, a list of token ids, a dict of these fields, or one already."""
        if isinstance(inputs, ARPrompt):
            return inputs
        if isinstance(inputs, str):
            return cls(prompt=inputs)
        if isinstance(inputs, (list, tuple)):
            return cls(prompt_token_ids=list(inputs))
        if isinstance(inputs, dict):
            allowed = list(cls.__dataclass_fields__)
            unknown = sorted(set(inputs) - set(allowed))
            if unknown:
                raise ParamError("prompt", f"prompt has unknown fields {unknown}; allowed: {allowed}")
            return cls(**inputs)
        raise ValueError(f"a prompt must be {_PROMPT_FORMS}, got {type(inputs).__name__}")


@dataclass
class ExtraRows:
    """A streamed piece for an AR request added with `stream_extra` (`add_input`): rows for its next
    generated positions, in order; the request's positions wait until their row has arrived."""

    rows: Any = None                            # [k, H] rows added to the next k generated positions (tensor; k >= 0)
    finished: bool = False                      # no rows follow: every later position adds `pad`
    pad: Any = None                             # [H] row added past the stream's end; due by the finished piece


@dataclass
class HiddenStates:
    """Rows an AR stage computed this step for a request that asked for them (`return_hidden_states`)."""

    start: int                                  # position of the first row
    hidden: Any                                 # last hidden states after the final norm [n, H], or after layer `report_layer` of a model that declares one (device tensor)
    inputs: Any                                 # the rows fed to the first layer [n, H] (embeddings + conditioning)


@dataclass
class StageError:
    """Why a stage dropped a request; the orchestrator fails only that request with `exception()`."""

    message: str
    fatal: bool = False                         # the stage went down under it (its process died): a 503
    refused: bool = False                       # the stage refused the request's input or params: a 400
    field: Optional[str] = None                 # with refused: the param it names (`ParamError.field`)

    def exception(self) -> Exception:
        """The typed error the request fails with: `StageDeadError` (the stage died), `ParamError` /
        `ValueError` (refused input) or `RequestFailedError` (it failed at run time; the stage serves on)."""
        if self.fatal:
            return StageDeadError(self.message)
        if self.refused:
            return ParamError(self.field, self.message) if self.field else ValueError(self.message)
        return RequestFailedError(self.message)


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

    @classmethod
    def failed(cls, request_id: str, error: StageError) -> "StageOutput":
        """The last output of a request the stage dropped: finished, nothing produced, `error` says why."""
        return cls(request_id, RequestOutput(request_id, finished=True), True, error=error)


class StageDeadError(RuntimeError):
    """A request failed because a stage holding it went down (its process died); the stage restarts."""


class RequestFailedError(RuntimeError):
    """A stage failed one request at run time (its forward, encode or decode raised on that request's
    inputs); the request fails with this message, the stage and every other request go on."""


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


SCALARS = (int, float, bool, str, type(None))   # message fields that hold no arrays (edge pieces' control fields)
_FIELDS: dict[type, tuple[str, ...]] = {}       # dataclass type -> its field names


def message_fields(obj: Any) -> tuple[str, ...]:
    """The field names of a dataclass instance (looked up once per type: `dataclasses.fields` on every
    edge piece was slow); () for anything else."""
    names = _FIELDS.get(type(obj))
    if names is None:
        dc = dataclasses.is_dataclass(obj) and not isinstance(obj, type)
        names = _FIELDS[type(obj)] = tuple(f.name for f in dataclasses.fields(obj)) if dc else ()
    return names


def add_inputs_each(engine: Any, items: list[tuple[str, Any]]) -> list[Optional[Exception]]:
    """`engine.add_input(request_id, piece)` for each (request_id, piece) of `items`, in order; per
    item None or why the engine refused that piece (the others are taken all the same)."""
    return _each(engine.add_input, items)


def add_each(engine: Any, requests: list) -> list[Optional[Exception]]:
    """`engine.add_request(*args)` for each args of `requests`, all before its next step; per request
    None (taken) or why the engine refused it (a bad request: the others are taken all the same)."""
    return _each(engine.add_request, requests)


def _each(call, argss: list) -> list[Optional[Exception]]:
    """`call(*args)` for each args of `argss`, in order; per call None or the exception it raised."""
    errors: list[Optional[Exception]] = []
    for args in argss:
        try:
            call(*args)
        except Exception as e:
            errors.append(e)
        else:
            errors.append(None)
    return errors
