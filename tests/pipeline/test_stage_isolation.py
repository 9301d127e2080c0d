"""A stage whose step raises fails only the requests it holds, in the orchestrator and in a stage
process; the other stages and requests go on (tiny random LM -> Piper cascade on CPU; the failures
are forced on real engines)."""

import pytest
import zmq

from omnistage.codec.speech import TTSParams
from omnistage.params import SamplingParams
from omnistage.pipeline import wire
from omnistage.stage import StageOutput

PARAMS = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def cascade(tiny_models):
    pytest.importorskip("piper")
    from omnistage import Omni

    with Omni(tiny_models["llama"], device="cpu", dtype="float32") as omni:
        yield omni


def _drain(orch) -> tuple[dict, dict]:
    finals, errors = {}, {}
    while orch.has_unfinished():
        for out in orch.step():
            if out.finished:
                finals[out.request_id] = out
        errors.update(orch.pop_errors())
    return finals, errors


def test_a_stage_whose_step_raises_fails_only_its_requests(cascade):
    orch = cascade.orchestrator
    tts = orch.stages["tts"]
    orch.add_request("alone", "The harbour town", PARAMS)
    alone, _ = _drain(orch)

    step = tts.step

    def broken_step():                          # the TTS engine's step breaks, as a whole, once it holds both
        if "audio" not in tts.requests:
            return step()
        del tts.step
        raise RuntimeError("forced step failure")

    tts.step = broken_step
    orch.add_request("speech", "Good morning. " * 24, TTSParams(), entry_stage="tts")  # still speaking then
    orch.add_request("text", "The harbour town", PARAMS)
    orch.add_request("audio", {"prompt": "The harbour town", "modalities": ["text", "audio"]}, PARAMS)
    finals, errors = _drain(orch)
    assert set(errors) == {"audio", "speech"}   # the two the TTS stage held
    assert all("forced step failure" in str(e) for e in errors.values())
    assert set(finals) == {"text"}              # the LM stage stepped on: the text-only request is whole
    assert finals["text"].outputs[0].token_ids == alone["alone"].outputs[0].token_ids
    assert not tts.has_unfinished() and not orch.routes

    orch.add_request("again", "Good morning.", TTSParams(), entry_stage="tts")   # the stage serves on
    finals, errors = _drain(orch)
    assert errors == {} and len(finals["again"].audio.samples) > 0


def test_stage_process_loop_fails_held_requests_and_unsendable_outputs(cascade):
    """`stage_client._step` / `_send_outputs`, the stage process's step handling, on the real TTS engine."""
    from omnistage.pipeline.stage_client import _send_outputs, _step

    tts = cascade.orchestrator.stages["tts"]
    held = set()
    for rid in ("x", "y"):
        tts.add_request(rid, "Good morning.", None)
        held.add(rid)

    def broken_update(batch, audio):           # the engine's step breaks as a whole
        raise RuntimeError("forced")

    tts.scheduler.update = broken_update
    try:
        outs = _step(tts, held, "tts")
    finally:
        del tts.scheduler.update
    assert [(o.request_id, o.finished, "forced" in o.error.message) for o in outs] == [("x", True, True),
                                                                                      ("y", True, True)]
    assert not held and not tts.has_unfinished()

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://stage-out")
    push.connect("inproc://stage-out")
    try:
        tts.add_request("good", "Hi.", None)
        held = {"good", "unsendable"}
        outs = _step(tts, held, "tts")
        unsendable = StageOutput("unsendable", outs[0].output, False, audio_chunk=object())
        _send_outputs(push, tts, outs + [unsendable], held)
        got = [o for _ in range(2) for o in wire.decode(pull.recv()).outputs]
    finally:
        ctx.destroy(linger=0)
    assert got[0].request_id == "good" and got[0].finished and len(got[0].audio_chunk) > 0
    assert got[1].request_id == "unsendable" and got[1].finished and "cannot cross" in got[1].error.message
    assert held == set()
