"""Tool-call parsing of model text (entrypoints/openai/tool_calls.py) on hand-written answers:
streamed in small pieces it gives the same content and calls as parsed at once."""

import json

import pytest

from omnistage.entrypoints.openai.protocol import ChatCompletionRequest
from omnistage.entrypoints.openai.tool_calls import ToolPlan, tool_parser_for

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "g"}}]


def plan(parser="hermes", **kw) -> ToolPlan:
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS, **kw)
    return ToolPlan.of(req, parser)


def parse(p: ToolPlan, text: str, piece: int):
    """(content, [(name, arguments object)], finish reason) from `text` fed `piece` characters at a time."""
    stream = p.stream()
    content, calls = "", {}
    pieces = [text[i:i + piece] for i in range(0, len(text), piece)] or [""]
    for k, part in enumerate(pieces):
        c, deltas = stream.feed(part, final=k == len(pieces) - 1)
        content += c
        for d in deltas:
            entry = calls.setdefault(d["index"], {"name": "", "arguments": ""})
            entry["name"] += d.get("function", {}).get("name") or ""
            entry["arguments"] += d.get("function", {}).get("arguments") or ""
    out = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    return content, out, stream.finish_reason


HERMES = ('Let me check. <tool_call>\n{"name": "f", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>{"name": "g", "arguments": {}}</tool_call>')


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_hermes_calls_between_content(piece):
    content, calls, finish = parse(plan(), HERMES, piece)
    assert content == "Let me check. \n" and finish == "tool_calls"
    assert calls == [("f", {"city": "Paris"}), ("g", {})]


@pytest.mark.parametrize("piece", [1, 1000])
def test_hermes_text_that_is_no_call_stays_text(piece):
    text = "a < b and <tool_call>not json</tool_call> end <tool"
    assert parse(plan(), text, piece) == (text, [], None)
    assert parse(plan(), "x <tool_call>{\"name\": \"f\", \"arguments\": {}}", piece)[1] == [("f", {})]  # cut off


def test_parallel_false_keeps_the_first_call():
    assert parse(plan(parallel_tool_calls=False), HERMES, 5)[1] == [("f", {"city": "Paris"})]


@pytest.mark.parametrize("piece", [2, 1000])
def test_llama3_json(piece):
    text = '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}'
    assert parse(plan("llama3_json"), text, piece) == ("", [("f", {"x": 1}), ("g", {})], "tool_calls")
    assert parse(plan("llama3_json"), "Hello there {", piece) == ("Hello there {", [], None)
    assert parse(plan("llama3_json"), '{"not": "a call"}', piece) == ('{"not": "a call"}', [], None)


def test_named_and_required():
    named = plan(tool_choice={"type": "function", "function": {"name": "g"}})
    assert named.grammar().json == '{"type": "object"}' and named.grammar().disable_any_whitespace
    assert parse(named, '{"a": [1, 2]}', 4) == ("", [("g", {"a": [1, 2]})], None)
    required = plan(tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(required.grammar().json)
    assert schema["maxItems"] == 1 and [s["properties"]["name"]["const"] for s in schema["items"]["anyOf"]] == ["f", "g"]
    assert parse(required, '[{"name": "f", "parameters": {"k": true}}]', 7) == ("", [("f", {"k": True})], "tool_calls")


def test_format_from_the_template_then_the_registry():
    assert tool_parser_for("... <tool_call> ...", "llama3_json") == "hermes"
    assert tool_parser_for("{{ '<|python_tag|>' }}", None) == "llama3_json"
    assert tool_parser_for("[TOOL_CALLS]", "llama3_json") is None
    assert tool_parser_for(None, "hermes") == "hermes"
