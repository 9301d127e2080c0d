"""Structured outputs and logit_bias in the AR engine, on a tiny random LM (CPU, fp32).

References on the same weights: transformers `generate` with xgrammar's own HF logits processor
(greedy ids identical), transformers' `sequence_bias` for logit_bias, xgrammar's
`apply_token_bitmask_inplace` for our batched mask; constrained answers of the random model must
parse and validate (`jsonschema`).
"""

import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr
from transformers import AutoModelForCausalLM, AutoTokenizer
from xgrammar.contrib.hf import LogitsProcessor

from omnistage.ar.engine import AREngine
from omnistage.ar.sampler import apply_token_bitmask
from omnistage.config import EngineConfig
from omnistage.models.loader import load_causal_lm
from omnistage.params import ParamError, SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object",
          # a pattern, not maxLength: xgrammar 0.2.8's maxLength strings admit raw control characters
          "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}
PROMPT = "The harbour town woke slowly."


@pytest.fixture(scope="module")
def eng(tiny_models):
    return AREngine(tiny_models["qwen2"], EngineConfig(device="cpu", dtype="float32", block_size=8),
                    loader=load_causal_lm)


@pytest.fixture(scope="module")
def hf(tiny_models):
    """transformers' tokenizer and model of the same checkpoint."""
    path = tiny_models["qwen2"]
    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def run(engine, items):
    """items: [(prompt, SamplingParams)] -> final RequestOutputs, in order (all in one batch)."""
    for i, (prompt, params) in enumerate(items):
        engine.add_request(str(i), prompt, params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                done[out.request_id] = out.output
    return [done[str(i)] for i in range(len(items))]


def so(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


def test_json_schema_answers_validate_and_plain_rows_are_untouched(eng):
    plain = SamplingParams(max_tokens=12, temperature=0)
    alone = run(eng, [(PROMPT, plain)])[0].outputs[0].token_ids
    outs = run(eng, [(PROMPT, SamplingParams(max_tokens=120, temperature=0, structured_outputs=so(json=SCHEMA))),
                     (PROMPT, plain),
                     (PROMPT, SamplingParams(max_tokens=120, temperature=1.0, seed=3, n=2,
                                             structured_outputs=so(json=SCHEMA, disable_any_whitespace=True)))])
    assert outs[1].outputs[0].token_ids == alone                 # a constrained neighbour changes nothing
    answers = [outs[0].outputs[0]] + outs[2].outputs
    for comp in answers:
        assert comp.finish_reason == "stop", comp
        jsonschema.validate(json.loads(comp.text), SCHEMA)
    for comp in outs[2].outputs:                                 # no free whitespace: separators ", " and ": "
        assert comp.text == json.dumps(json.loads(comp.text), ensure_ascii=False), comp.text


def test_greedy_ids_match_transformers_with_xgrammar(eng, hf):
    tok, model = hf
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=model.config.vocab_size,
                                              stop_token_ids=sorted(eng.eos_ids))
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), max_whitespace_cnt=16)
    ids = tok.encode(PROMPT)
    ref = model.generate(torch.tensor([ids]), max_new_tokens=80, do_sample=False,
                         logits_processor=[LogitsProcessor(compiled)])[0, len(ids):].tolist()
    ours = run(eng, [(PROMPT, SamplingParams(max_tokens=80, temperature=0, structured_outputs=so(json=SCHEMA)))])
    assert ours[0].outputs[0].token_ids == ref


def test_regex_choice_grammar_and_json_object(eng):
    bias = {t: 100.0 for t in eng.tokenizer.encode("}")}   # the random model closes the object at once
    outs = run(eng, [
        (PROMPT, SamplingParams(max_tokens=40, temperature=0, structured_outputs=so(regex=r"[0-9]{3}-[a-z]{2}"))),
        (PROMPT, SamplingParams(max_tokens=40, temperature=0, structured_outputs=so(choice=["Paris", "café \"x\""]))),
        (PROMPT, SamplingParams(max_tokens=40, temperature=0,
                                structured_outputs=so(grammar='root ::= "yes" | "no" | ("maybe " [0-9])'))),
        (PROMPT, SamplingParams(max_tokens=40, temperature=0, logit_bias=bias,
                                structured_outputs=so(json_object=True)))])
    texts = [o.outputs[0].text for o in outs]
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", texts[0])
    assert texts[1] in ("Paris", "café \"x\"")
    assert re.fullmatch(r"yes|no|maybe [0-9]", texts[2])
    assert isinstance(json.loads(texts[3]), dict)
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def test_bad_grammars_are_param_errors(eng):
    for kw, field in [(dict(json={"type": "nope"}), "structured_outputs.json"),
                      (dict(regex="a("), "structured_outputs.regex"),
                      (dict(grammar="root ::= ("), "structured_outputs.grammar")]:
        with pytest.raises(ParamError) as e:
            eng.add_request("bad", PROMPT, SamplingParams(structured_outputs=so(**kw)))
        assert e.value.field == field and "/project" not in str(e.value), str(e.value)
    with pytest.raises(ParamError) as e:
        eng.add_request("bad", PROMPT, SamplingParams(logit_bias={10_000: 1.0}))
    assert e.value.field == "logit_bias"
    assert not eng.has_unfinished()


def test_a_dead_end_grammar_fails_alone(eng):
    eng.add_request("empty", PROMPT, SamplingParams(structured_outputs=so(regex=r"a[^\s\S]")))   # dead after "a"
    eng.add_request("plain", PROMPT, SamplingParams(max_tokens=4, temperature=0))
    finished = {}
    while eng.has_unfinished():
        finished.update({o.request_id: o for o in eng.step() if o.finished})
    err = finished["empty"].error
    assert err.refused and err.field == "structured_outputs" and "admits no answer" in err.message
    assert finished["plain"].error is None and len(finished["plain"].output.outputs[0].token_ids) == 4


def test_logit_bias_matches_transformers_sequence_bias(eng, hf):
    tok, model = hf
    ids = tok.encode(PROMPT)
    free = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    bias = {free[0]: -100.0, free[1]: -5.0, 40: 3.5}
    ref = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                         sequence_bias={(t,): b for t, b in bias.items()})[0, len(ids):].tolist()
    ours = run(eng, [(PROMPT, SamplingParams(max_tokens=8, temperature=0, logit_bias=bias))])
    assert ours[0].outputs[0].token_ids == ref and ref != free


def test_bitmask_matches_xgrammar_kernel():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 100, generator=g)
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, 4), generator=g, dtype=torch.int32)
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, bitmask, vocab_size=100)
    assert torch.equal(apply_token_bitmask(logits, bitmask), ref)


def test_params_validation():
    for kw, field in [(dict(logit_bias={"x": 1}), "logit_bias"), (dict(logit_bias={"3": 101}), "logit_bias"),
                      (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs"),
                      (dict(structured_outputs={}), "structured_outputs"),
                      (dict(structured_outputs={"choice": []}), "structured_outputs.choice")]:
        with pytest.raises(ParamError) as e:
            SamplingParams(**kw)
        assert e.value.field == field
    assert SamplingParams(logit_bias={"3": -100}).logit_bias == {3: -100.0}


def test_extreme_repetition_penalty_keeps_the_grammar(eng):
    # a tiny penalty divides seen logits to +inf: softmax would be NaN and pick a masked token (found by the fuzz)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=0, repetition_penalty=1e-300,
                            structured_outputs=so(choice=["yes", "no"]))
    (out,) = run(eng, [(PROMPT, params)])
    assert out.outputs[0].text in ("yes", "no")
