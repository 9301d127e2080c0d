"""The AR engine's per-request host work is isolated: a request whose detokenizing or output
building raises fails alone, its KV blocks are freed, and the batch it ran in goes on unchanged
(tiny random Llama, CPU, greedy)."""

from omnistage.ar.engine import AREngine
from omnistage.config import EngineConfig
from omnistage.models.loader import load_causal_lm
from omnistage.params import SamplingParams

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _engine(path) -> AREngine:
    return AREngine(path, EngineConfig(device="cpu", dtype="float32", block_size=8), loader=load_causal_lm)


def _run(engine) -> tuple[dict, dict]:
    finals, errors = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.error is not None:
                errors[out.request_id] = out.error
            elif out.finished:
                finals[out.request_id] = out.output
    return finals, errors


def test_a_request_whose_detokenizer_raises_fails_alone(tiny_models):
    engine = _engine(tiny_models["llama"])
    engine.add_request("alone", "The harbour town", PARAMS)
    alone, _ = _run(engine)

    for rid in ("a", "bad", "b"):
        engine.add_request(rid, "The harbour town", PARAMS)
    steps = {"n": 0}
    detok = engine.requests["bad"].seqs[0].detok
    update = detok.update

    def poisoned(ids):                          # e.g. a token the tokenizer cannot turn into text
        steps["n"] += 1
        if steps["n"] == 4:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "forced")
        return update(ids)

    detok.update = poisoned
    finals, errors = _run(engine)
    assert set(errors) == {"bad"} and "UnicodeDecodeError" in errors["bad"].message and not errors["bad"].fatal
    assert set(finals) == {"a", "b"}
    for out in finals.values():                 # the bystanders are exactly what they are alone
        assert out.outputs[0].token_ids == alone["alone"].outputs[0].token_ids
        assert out.outputs[0].text == alone["alone"].outputs[0].text
    assert not engine.requests and engine.block_manager.usage == 0


def test_a_request_whose_output_cannot_be_built_fails_alone(tiny_models):
    engine = _engine(tiny_models["llama"])
    engine.add_request("ok", "Hello", PARAMS)
    engine.add_request("bad", "Hello", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2))
    engine.requests["bad"].seqs[0].logprobs = None   # its logprobs list is gone: building its output raises
    finals, errors = _run(engine)
    assert set(errors) == {"bad"} and set(finals) == {"ok"}
    assert len(finals["ok"].outputs[0].token_ids) == 12
    assert engine.block_manager.usage == 0
