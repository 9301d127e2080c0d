"""Structured outputs, tool calls and logit_bias over HTTP: the real `openai` client against the
live server of this folder (a tiny random Llama, CPU). A random model writes garbage unless
constrained, so a constrained answer that parses and validates (`jsonschema`) is the check."""

import json

import jsonschema
import openai
import pytest

# small: the tools are shown in a prompt of at most 512 tokens (xgrammar's strict mode: no other keys)
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(text_server):
    with openai.OpenAI(base_url=text_server.url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


def chat(client, text_server, **kw):
    kw = {"messages": ASK, "max_tokens": 80, "temperature": 0, **kw}
    return client.chat.completions.create(model=text_server.name, **kw)


def stream_chat(client, text_server, **kw):
    """(content, {index: {"id", "name", "arguments"}}, finish_reason) accumulated from the chunks."""
    content, calls, finish = "", {}, None
    for chunk in chat(client, text_server, stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or d.id
                call["name"] += (d.function.name or "") if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = choice.finish_reason or finish
    return content, calls, finish


def test_response_format_json_schema_and_json_object(client, text_server):
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}
    res = chat(client, text_server, response_format=fmt, n=2, temperature=1.0, seed=7)
    for choice in res.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    content, calls, finish = stream_chat(client, text_server, response_format=fmt)
    assert finish == "stop" and not calls
    assert content == chat(client, text_server, response_format=fmt).choices[0].message.content
    jsonschema.validate(json.loads(content), SCHEMA)
    close = {str(t): 100 for t in text_server.engine.tokenizer.encode("}")}   # the random model closes at once
    obj = chat(client, text_server, response_format={"type": "json_object"}, logit_bias=close)
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_structured_outputs_on_completions(client, text_server):
    res = client.completions.create(model=text_server.name, prompt="The capital of France is", max_tokens=20,
                                    temperature=0, extra_body={"structured_outputs": {"choice": ["Paris", "Rome"]}})
    assert res.choices[0].text in ("Paris", "Rome") and res.choices[0].finish_reason == "stop"
    res = client.completions.create(model=text_server.name, prompt="Two plus two is", max_tokens=20, temperature=0,
                                    extra_body={"structured_outputs": {"regex": "[0-9]{2}-[a-z]{3}"}})
    assert len(res.choices[0].text) == 6 and res.choices[0].text[2] == "-"


def test_named_tool_choice_gives_the_declared_arguments(client, text_server):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    res = chat(client, text_server, tools=TOOLS[:1], tool_choice=choice)
    msg = res.choices[0].message
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_") and not msg.content
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    content, calls, finish = stream_chat(client, text_server, tools=TOOLS[:1], tool_choice=choice)
    assert content == "" and finish == "stop"
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == call.function.arguments


def test_required_tool_choice(client, text_server):
    res = chat(client, text_server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    choice = res.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])


def test_auto_tool_calls_are_parsed_from_the_answer_and_streamed(client, text_server):
    # the random model is made to write a Qwen / Hermes tool call: the parser, not the model, is tested
    forced = {"regex": r'Sure\. <tool_call>\n\{"name": "get_weather", "arguments": '
                       r'\{"city": "(Paris|Rome)", "days": [1-9]\}\}\n</tool_call>'}
    res = chat(client, text_server, tools=TOOLS[:1], max_tokens=150,
               extra_body={"structured_outputs": forced})
    msg = res.choices[0].message
    assert msg.content == "Sure. " and res.choices[0].finish_reason == "tool_calls"
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    content, calls, finish = stream_chat(client, text_server, tools=TOOLS[:1], max_tokens=150,
                                          extra_body={"structured_outputs": forced})
    assert (content, finish) == ("Sure. ", "tool_calls")
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == json.loads(call.function.arguments)
    plain = chat(client, text_server, tools=TOOLS[:1], tool_choice="none", max_tokens=8)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "length"


def test_tool_messages_go_through_the_template(client, text_server):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 31 C"}]
    res = chat(client, text_server, messages=history, tools=TOOLS[:1], tool_choice="none", max_tokens=4)
    with_tools = res.usage.prompt_tokens
    res = chat(client, text_server, messages=history, max_tokens=4)
    assert with_tools > res.usage.prompt_tokens > 30                # the tools and the call are in the prompt


@pytest.mark.parametrize("kw,param", [
    ({"extra_body": {"best_of": 2}}, "best_of"),
    ({"extra_body": {"use_beam_search": True}}, "use_beam_search"),
    ({"extra_body": {"guided_json": {"type": "object"}}}, "guided_json"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "structural_tag"}}, "response_format"),
    ({"extra_body": {"structured_outputs": {"regex": "a("}}}, "structured_outputs.regex"),
    ({"extra_body": {"structured_outputs": {"whitespace_pattern": " "}}}, "structured_outputs.whitespace_pattern"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_refusals_name_the_field(client, text_server, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, text_server, max_tokens=4, **kw)
    assert e.value.param == param, e.value.body
    assert "/project" not in e.value.message


def test_completions_refuse_best_of(client, text_server):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=text_server.name, prompt="hi", max_tokens=4, best_of=3)
    assert e.value.param == "best_of"
    ok = client.completions.create(model=text_server.name, prompt="hi", max_tokens=4, best_of=1)
    assert ok.choices[0].text is not None
