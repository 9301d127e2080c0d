"""Stage outputs over a process boundary as deltas: only what a request's lists gained since the last send.

A stage's `StageOutput.output` is cumulative (every token id, frame code and logprob so far), and an AR
stage sends one per running request per step, so encoding it whole costs O(answer so far) per request per
step (a Qwen3-TTS talker at 64 rows: most of its host time). `DeltaPacker` (the stage process, in
`stage_client._serve`) replaces each list of an output that only grew since the request's last sent output
-- `prompt_token_ids`, and per completion `token_ids`, `codes`, `logprobs` -- by its new tail, leaves
out a `context_frames` that is the same object as before, and says so in `StageOutputs.deltas`;
`DeltaUnpacker` (the orchestrator's process, in `StageClient`) puts the cumulative lists back, so the
orchestrator, the edge adapters and the entry points see the same outputs as in-process. A list that
changed otherwise (shorter, or a different item where the last one sent was) goes whole. Every output gets lists of its own (a
consumer may keep an earlier output). Per request, both sides keep the last lists until the request
finishes or is aborted (`forget`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from omnistage.stage import StageOutput

_LISTS = ("token_ids", "codes", "logprobs")     # a completion's append-only lists


def _tail(new: Optional[list], old: Optional[list]) -> tuple[int, Optional[list]]:
    """(how many leading items the receiver already has, what to send). The lists of a request's
    outputs only grow (every engine's do); one that got shorter or whose item at the old end differs
    is sent whole (an O(1) check: a full comparison per list per step is what this module saves)."""
    n = len(old) if old else 0
    if new is None or n == 0 or len(new) < n or new[n - 1] != old[-1]:
        return 0, new
    return n, new[n:]


class DeltaPacker:
    """The sending side (stage process): the last lists sent per request."""

    def __init__(self):
        self._sent: dict[str, RequestOutputLists] = {}

    def pack(self, outs: list[StageOutput]) -> tuple[list[StageOutput], dict, dict]:
        """(outputs to send, their `StageOutputs.deltas`, the state to `commit` once they are sent)."""
        packed, deltas, state = [], {}, {}
        for out in outs:
            req = out.output
            lists = RequestOutputLists.of(req)
            old = self._sent.get(out.request_id)
            state[out.request_id] = None if out.finished else lists
            if old is None or req is None or len(old.completions) != len(req.outputs):
                packed.append(out)
                continue
            keep_prompt, prompt = _tail(req.prompt_token_ids, old.prompt)
            same_context = req.context_frames is not None and req.context_frames is old.context
            entry = {"prompt": keep_prompt, "context": same_context, "outputs": []}
            comps = []
            for comp, before in zip(req.outputs, old.completions):
                kept, fields = [], {}
                for name, prev in zip(_LISTS, before):
                    n, fields[name] = _tail(getattr(comp, name), prev)
                    kept.append(n)
                entry["outputs"].append(kept)
                comps.append(_with(comp, fields))
            deltas[out.request_id] = entry
            short = _with(req, {"prompt_token_ids": prompt, "outputs": comps,
                                "context_frames": None if same_context else req.context_frames})
            packed.append(_with(out, {"output": short}))
        return packed, deltas, state

    def commit(self, state: dict) -> None:
        for rid, lists in state.items():
            if lists is None:
                self._sent.pop(rid, None)
            else:
                self._sent[rid] = lists

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)


class DeltaUnpacker:
    """The receiving side (`StageClient`): the cumulative lists per request, rebuilt from deltas."""

    def __init__(self):
        self._have: dict[str, RequestOutputLists] = {}

    def unpack(self, outs: list[StageOutput], deltas: dict, held: Optional[set] = None) -> list[StageOutput]:
        """The cumulative outputs; a delta of a request forgotten here (aborted while the output was on
        its way: nobody reads it) is dropped. `held`: the requests still wanted (None: all); the lists
        of others are not kept."""
        full = []
        for out in outs:
            entry = deltas.get(out.request_id)
            if entry is not None:
                if out.request_id not in self._have:
                    continue
                out = self._restore(out, entry)
            if out.finished or (held is not None and out.request_id not in held):
                self._have.pop(out.request_id, None)
            elif out.output is not None:
                self._have[out.request_id] = RequestOutputLists.of(out.output)
            full.append(out)
        return full

    def _restore(self, out: StageOutput, entry: dict) -> StageOutput:
        have = self._have[out.request_id]
        req = out.output
        comps = []
        for comp, kept, before in zip(req.outputs, entry["outputs"], have.completions):
            fields = {name: _joined(prev, n, getattr(comp, name)) for name, n, prev in zip(_LISTS, kept, before)}
            comps.append(_with(comp, fields))
        whole = _with(req, {"prompt_token_ids": _joined(have.prompt, entry["prompt"], req.prompt_token_ids),
                            "outputs": comps, "context_frames": have.context if entry["context"] else req.context_frames})
        return _with(out, {"output": whole})

    def forget(self, request_id: str) -> None:
        self._have.pop(request_id, None)

    def clear(self) -> None:
        self._have.clear()


def _with(obj: Any, fields: dict) -> Any:
    """A shallow copy of a dataclass with `fields` changed (`dataclasses.replace` runs `__init__`: a few
    times slower, per output per step)."""
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    new.__dict__.update(fields)
    return new


def _joined(prev: Optional[list], kept: int, tail: Optional[list]) -> Optional[list]:
    if kept == 0:
        return tail
    return prev[:kept] + (tail or [])


@dataclasses.dataclass
class RequestOutputLists:
    """The lists of one request's last output that a delta refers to (the objects, not copies)."""
    prompt: list                                # RequestOutput.prompt_token_ids
    context: Any                                # RequestOutput.context_frames
    completions: list                           # per completion: (token_ids, codes, logprobs)

    @classmethod
    def of(cls, req) -> "RequestOutputLists":
        if req is None:
            return cls([], None, [])
        return cls(req.prompt_token_ids, req.context_frames,
                   [tuple(getattr(c, name) for name in _LISTS) for c in req.outputs])
