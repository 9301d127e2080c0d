"""Tool calls of /v1/chat/completions: what `tools` + `tool_choice` ask of the engine, and the
model's text turned into `tool_calls` (event-loop thread of the API server).

In: a `ChatCompletionRequest`'s `tools`, `tool_choice` and `parallel_tool_calls`, the name of the
model's tool-call format (`tool_parser_for`: from its chat template, else its registry entry), and
each choice's text as it streams. Out: a `ToolPlan` (which grammar, if any, the answer follows)
and, per choice, a `ToolStream` that splits text into content and tool calls, as deltas.

  * `tool_choice` "none" (or no tools): plain text; the tools are still shown to the template.
  * "auto" (the default with tools): free text, parsed by the model's format: "hermes" (Qwen /
    Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, between
    content) or "llama3_json" (Llama 3.x: the whole answer is `{"name": ..., "parameters": {...}}`,
    several separated by ";", optionally after `<|python_tag|>`).
  * "required": the answer is constrained to a JSON array of `{"name", "parameters"}` objects, one
    per call (at most one when `parallel_tool_calls` is false).
  * a named function: the answer is constrained to that function's `parameters` schema and is its
    `arguments`; it streams as argument deltas; finish_reason stays "stop" (as vLLM answers).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from omnistage.entrypoints.openai.errors import OpenAIError
from omnistage.entrypoints.openai.protocol import ChatCompletionRequest, ToolCallOut
from omnistage.params import StructuredOutputsParams

PARSERS = ("hermes", "llama3_json")
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
_HERMES_START, _HERMES_END = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


def tool_parser_for(chat_template: Optional[str], declared: Optional[str]) -> Optional[str]:
    """The model's tool-call format: what its chat template writes, else its registry entry's `tool_parser`."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:              # Mistral's format: not parsed here
        return None
    if _HERMES_START in template:
        return "hermes"
    if _PYTHON_TAG in template or "ipython" in template:
        return "llama3_json"
    return declared


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolPlan:
    mode: str                                   # "none" | "auto" | "required" | "named"
    tools: list[dict]                           # the request's tools, as plain dicts (what templates read)
    parser: Optional[str] = None                # with "auto": one of PARSERS
    name: Optional[str] = None                  # with "named": the function to call
    parallel: bool = True                       # more than one call per answer allowed

    @classmethod
    def of(cls, req: ChatCompletionRequest, parser: Optional[str]) -> "ToolPlan":
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
        parallel = req.parallel_tool_calls is not False
        if choice != "none" and not tools:
            raise OpenAIError(400, "tool_choice needs tools", param="tool_choice")
        if not isinstance(choice, str):
            names = [t["function"]["name"] for t in tools]
            if choice.function.name not in names:
                raise OpenAIError(400, f"tool_choice names function {choice.function.name!r}; the tools are "
                                       f"{', '.join(names)}", param="tool_choice")
            plan = cls("named", tools, name=choice.function.name, parallel=parallel)
        elif choice == "required":
            plan = cls("required", tools, parallel=parallel)
        else:
            plan = None
        if plan is not None:                    # a forced call has its own grammar
            if (req.response_format is not None and req.response_format.type != "text") or req.structured_outputs:
                raise OpenAIError(400, "a required or named tool_choice cannot be combined with response_format "
                                       "or structured_outputs", param="tool_choice")
            return plan
        if choice == "auto" and parser is None:
            raise OpenAIError(400, "this model has no known tool-call format, so tool_choice \"auto\" cannot be "
                                   "parsed; use \"required\" or a named function", param="tool_choice")
        return cls(choice, tools, parser=parser if choice == "auto" else None, parallel=parallel)

    def grammar(self) -> Optional[StructuredOutputsParams]:
        """The grammar forced calls follow (None for "none" / "auto"); compact JSON, as the arguments
        are for programs, and a weak model cannot pad them with whitespace."""
        if self.mode == "named":
            fn = next(t["function"] for t in self.tools if t["function"]["name"] == self.name)
            return StructuredOutputsParams(json=fn.get("parameters") or _ANY_OBJECT, disable_any_whitespace=True)
        if self.mode == "required":
            calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                       "parameters": t["function"].get("parameters") or _ANY_OBJECT},
                      "required": ["name", "parameters"]} for t in self.tools]
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        return None

    def stream(self) -> Optional["ToolStream"]:
        """A fresh parser for one choice (None when text stays text)."""
        return None if self.mode == "none" else ToolStream(self)


@dataclass
class ToolStream:
    """One choice's text -> (content delta, tool-call deltas), fed as it streams; feeding the whole
    text at once with `final` gives the non-streaming answer."""

    plan: ToolPlan
    calls: list[ToolCallOut] = field(default_factory=list)   # the calls found so far, complete
    held: str = ""                              # text not yet given out (it may belong to a call)
    inside: bool = False                        # hermes: between <tool_call> and </tool_call>
    as_content: bool = False                    # llama3_json / required: the answer turned out to be text

    @property
    def called(self) -> bool:
        return bool(self.calls)

    @property
    def finish_reason(self) -> Optional[str]:
        """What replaces a "stop" finish reason: "tool_calls" when calls were made (not for a named function)."""
        return "tool_calls" if self.calls and self.plan.mode != "named" else None

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        mode = self.plan.mode
        if mode == "named":
            return "", self._named(text)
        if mode == "auto" and self.plan.parser == "hermes":
            content, found = self._hermes(text, final)
        else:
            content, found = self._whole_json(text, final)
        if not self.plan.parallel:
            found = found[:max(0, 1 - len(self.calls))]
        start = len(self.calls)
        self.calls += found
        return content, [{"index": start + i, **c.model_dump()} for i, c in enumerate(found)]

    def _named(self, text: str) -> list[dict]:
        if not self.calls:
            self.calls.append(ToolCallOut(id=new_call_id(), function={"name": self.plan.name, "arguments": ""}))
            first = self.calls[0].model_dump()
            first["function"]["arguments"] = text
            self.calls[0].function["arguments"] = text
            return [{"index": 0, **first}]
        self.calls[0].function["arguments"] += text
        return [{"index": 0, "function": {"arguments": text}}] if text else []

    def _hermes(self, text: str, final: bool) -> tuple[str, list[ToolCallOut]]:
        buf, content, found = self.held + text, [], []
        while True:
            if not self.inside:
                i = buf.find(_HERMES_START)
                if i >= 0:
                    content.append(buf[:i])
                    buf, self.inside = buf[i + len(_HERMES_START):], True
                    continue
                keep = 0 if final else _partial_suffix(buf, _HERMES_START)
                content.append(buf[:len(buf) - keep])
                buf = buf[len(buf) - keep:]
                break
            j = buf.find(_HERMES_END)
            if j < 0 and not final:
                break
            body, buf = (buf[:j], buf[j + len(_HERMES_END):]) if j >= 0 else (buf, "")
            self.inside = False
            call = _call(body, "arguments")
            if call is None:                    # not a call after all: it stays text
                content.append(_HERMES_START + body + (_HERMES_END if j >= 0 else ""))
            else:
                found.append(call)
            if j < 0:
                break
        self.held = buf
        return "".join(content), found

    def _whole_json(self, text: str, final: bool) -> tuple[str, list[ToolCallOut]]:
        """The whole answer is the calls (llama3_json, "required"); held until it ends, text when not."""
        if self.as_content:
            return text, []
        self.held += text
        head = self.held.lstrip()
        looks_like_call = (not head or head.startswith(("{", "[")) or head.startswith(_PYTHON_TAG)
                           or _PYTHON_TAG.startswith(head))
        if not looks_like_call:
            self.as_content = True
        elif final:
            found = _required(head) if self.plan.mode == "required" else _llama_calls(head)
            if found:
                self.held = ""
                return "", found
            self.as_content = True
        else:
            return "", []
        out, self.held = self.held, ""
        return out, []


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (it may complete next time)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _call(body: str, args_key: str) -> Optional[ToolCallOut]:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    return _call_of(obj, args_key)


def _call_of(obj: Any, args_key: str) -> Optional[ToolCallOut]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCallOut(id=new_call_id(), function={"name": obj["name"], "arguments": text})


def _llama_calls(text: str) -> list[ToolCallOut]:
    """`{"name": ..., "parameters": {...}}` objects separated by ";" (after an optional python tag)."""
    text = text.removeprefix(_PYTHON_TAG).strip()
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(text):
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return []
        call = _call_of(obj, "parameters")
        if call is None:
            return []
        calls.append(call)
        while pos < len(text) and text[pos] in "; \n\t":
            pos += 1
    return calls


def _required(text: str) -> list[ToolCallOut]:
    try:
        items = json.loads(text)
    except ValueError:
        return []
    calls = [_call_of(item, "parameters") for item in items] if isinstance(items, list) else []
    return calls if calls and all(c is not None for c in calls) else []
