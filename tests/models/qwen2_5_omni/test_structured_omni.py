"""Structured outputs on the Qwen2.5-Omni thinker (tiny checkpoint, fp32, CPU): the thinker is an AR
stage like any other, so its text follows the grammar; tools are refused by its own chat renderer."""

import json

import pytest

from omnistage.params import ParamError, SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def test_thinker_text_follows_the_grammar(omni_dir):
    from omnistage import Omni

    with Omni(omni_dir, device="cpu", dtype="float32") as omni:
        messages = [{"role": "user", "content": "Answer in JSON."}]
        params = SamplingParams(max_tokens=40, temperature=0,
                                structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
        (out,) = omni.chat(messages, params, modalities=["text"])
        assert json.loads(out.outputs[0].text) in ({"ok": True}, {"ok": False})
        assert out.outputs[0].finish_reason == "stop"
        with pytest.raises(ParamError) as e:
            omni.render_chat(messages, None, [{"type": "function", "function": {"name": "f"}}])
        assert e.value.field == "tools"
