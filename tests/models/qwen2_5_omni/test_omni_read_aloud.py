"""Read aloud on Qwen2.5-Omni: /v1/audio/speech (real openai client, wav and streamed pcm) and
`Omni.speak` feed the thinker the text as its answer and the talker speaks it; the audio SLO
metrics (underruns) count a forced slow stage on the live server's /metrics, and the late stream
still finishes whole.

What the talker got is read at the thinker -> talker edge: the thinker-side ids of the rows it was
given as the answer equal the tokenized `input`, its prompt holds one row per thinker prompt
position before them (+ voice and bos rows), and its streamed rows are one per further text token
(+ the tts_eos row).
"""

import base64
import io
import time

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
from omni_testutil import openai_client

from prometheus_client.parser import text_string_to_metric_families

from omnistage.codec.speech import TTSParams
from omnistage.outputs import AudioTiming
from omnistage.testing.qwen2_5_omni import CODEC_BOS, CODEC_EOS, CODEC_PAD

CODES = 24                                      # the random talker never stops: 24 codes, 0.48 s
SAMPLES = CODES * 480
TEXT = "Hello there, read this aloud."
EDGE = ("thinker", "talker")


@pytest.fixture(scope="module")
def deploy(omni_dir):
    from omnistage.models.qwen2_5_omni.pipeline import talker_params
    from omnistage.models.qwen2_5_omni.stages import omni_config

    bad = talker_params(omni_config(omni_dir))["bad_token_ids"] + [CODEC_PAD, CODEC_BOS, CODEC_EOS]
    return {"stages": {"talker": {"params": {"max_tokens": CODES, "bad_token_ids": bad}}}}


@pytest.fixture(scope="module")
def async_omni(omni_dir, deploy):
    from omnistage.entrypoints.async_omni import AsyncOmni

    engine = AsyncOmni(omni_dir, device="cpu", dtype="float32", deploy_config=deploy)
    yield engine
    engine.close()


def record_talker_inputs(orch) -> dict:
    """Wraps the thinker -> talker adapter (the module's engines are its own): request id ->
    (thinker ids, read_aloud_from, talker input)."""
    adapter, seen = orch.adapters[EDGE], {}

    def record(out, ctx):
        x = adapter(out, ctx)
        if x is not None:
            seen[out.request_id] = (list(out.output.prompt_token_ids), ctx.fields.get("read_aloud_from"), x)
        return x

    record.upstream_inputs = adapter.upstream_inputs
    orch.adapters[EDGE] = record
    return seen


def check_talker_got_the_text(seen: dict, tokenizer, text: str) -> None:
    text_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ((ids, start, talker),) = seen.values()
    assert ids[start:] == text_ids                                  # the answer the talker was given
    assert len(talker.prompt.prompt_token_ids) == start + 2         # prompt rows + voice + bos (T(g_0))
    assert talker.finished and len(talker) == 1 + (len(text_ids) - 1) + 1   # g_1..g_{n-1} + tts_eos
    seen.clear()


def test_speech_route_reads_the_input_aloud_wav_and_streamed_pcm(async_omni):
    tokenizer = async_omni.tokenizer
    seen = record_talker_inputs(async_omni.orchestrator)
    with openai_client(async_omni) as client:
        wav = client.audio.speech.create(model="tiny-omni", input=TEXT, voice="Ethan", response_format="wav")
        samples, rate = sf.read(io.BytesIO(wav.content), dtype="float32")
        assert rate == 24000 and samples.shape == (SAMPLES,) and np.isfinite(samples).all()
        check_talker_got_the_text(seen, tokenizer, TEXT)

        with client.audio.speech.with_streaming_response.create(
                model="tiny-omni", input=TEXT, voice="Ethan", response_format="pcm",
                extra_body={"stream_format": "audio", "initial_codec_chunk_frames": 4}) as resp:
            pieces = [p for p in resp.iter_bytes() if p]
        pcm = np.frombuffer(b"".join(pieces), dtype="<i2")
        assert pcm.size == SAMPLES
        check_talker_got_the_text(seen, tokenizer, TEXT)

        for body, field in (({"speed": 2.0}, "speed"), ({"voice": "Nobody"}, "voice"),
                            ({"task_type": "VoiceDesign", "instructions": "calm"}, "task_type"),
                            ({"initial_codec_chunk_frames": 0}, "initial_codec_chunk_frames")):
            args = {"voice": "Ethan", **body}
            with pytest.raises(openai.BadRequestError, match=field):
                client.audio.speech.create(model="tiny-omni", input=TEXT, voice=args.pop("voice"),
                                           extra_body=args)
        assert not seen


def test_offline_speak_on_an_omni_folder(omni_dir, deploy):
    from omnistage import Omni

    with Omni(omni_dir, device="cpu", dtype="float32", deploy_config=deploy) as omni:
        seen = record_talker_inputs(omni.orchestrator)
        (out,) = omni.speak(TEXT, TTSParams(voice="Chelsie"), use_tqdm=False)
        assert out.audio.sample_rate == 24000 and out.audio.samples.shape == (SAMPLES,)
        timing = out.metrics.audio                  # what the benchmark reads
        assert timing.seconds == pytest.approx(CODES * 0.02) and set(out.metrics.stage_audio) == {"code2wav"}
        check_talker_got_the_text(seen, omni.tokenizer, TEXT)
        with pytest.raises(ValueError, match="speed"):
            omni.speak(TEXT, TTSParams(speed=1.5), use_tqdm=False)


def test_audio_timing_counts_when_playback_runs_dry():
    t = AudioTiming()
    t.add(10.0, 0.5)                            # plays 10.0 .. 10.5
    t.add(10.4, 0.5)                            # in time: plays on to 11.0
    assert (t.underruns, t.underrun_s) == (0, 0.0)
    t.add(11.3, 1.0)                            # 0.3 s dry, then plays 11.3 .. 12.3
    t.add(12.0, 0.0)                            # nothing new: no event
    t.add(12.5, 0.25)                           # 0.2 s dry
    assert t.underruns == 2 and t.underrun_s == pytest.approx(0.5) and t.seconds == pytest.approx(2.25)
    assert (t.first_audio_time, t.last_audio_time) == (10.0, 12.5)


def samples_of(text: str, name: str) -> dict:
    """{(stage label): value} of one metric family's samples (`name` with its suffix)."""
    return {s.labels.get("stage"): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == name}


def test_underruns_of_a_slow_stage_show_on_metrics_and_the_stream_finishes(async_omni):
    code2wav = async_omni.orchestrator.stages["code2wav"].model
    decode = code2wav.decode

    def slow(states, chunks):                   # every chunk comes 0.5 s late: far more than 4 codes (80 ms) last
        time.sleep(0.5)
        return decode(states, chunks)

    code2wav.decode = slow
    try:
        with openai_client(async_omni) as client:
            with client.audio.speech.with_streaming_response.create(
                    model="tiny-omni", input=TEXT, voice="Ethan", response_format="pcm",
                    extra_body={"stream_format": "audio", "initial_codec_chunk_frames": 4}) as resp:
                pcm = b"".join(resp.iter_bytes())
            assert len(pcm) == 2 * SAMPLES       # late, but whole: never dropped
            text = httpx.get(str(client.base_url).replace("/v1/", "/metrics")).text
    finally:
        del code2wav.decode
    for stage in ("pipeline", "code2wav"):
        assert samples_of(text, "omnistage:audio_underruns_total")[stage] >= 1
        assert samples_of(text, "omnistage:audio_underrun_seconds_total")[stage] > 0.3
        assert samples_of(text, "omnistage:audio_underrun_s_count")[stage] == 1
        assert samples_of(text, "omnistage:audio_ttfp_s_count")[stage] == 1
        assert samples_of(text, "omnistage:audio_rtf_count")[stage] == 1


def test_chat_first_chunk_field_reaches_code2wav(async_omni):
    """Chat's top-level `initial_codec_chunk_frames` sizes the first audio chunk of a spoken answer."""
    messages = [{"role": "user", "content": "Tell me a story."}]
    with openai_client(async_omni) as client:
        stream = client.chat.completions.create(
            model="tiny-omni", messages=messages, max_tokens=8, temperature=0, stream=True,
            modalities=["text", "audio"], audio={"voice": "Ethan", "format": "pcm"},
            extra_body={"initial_codec_chunk_frames": 3})
        deltas = [c.choices[0].delta.model_dump() for c in stream if c.choices]
        sizes = [len(base64.b64decode(d["audio"]["data"])) // 2 for d in deltas if (d.get("audio") or {}).get("data")]
        assert sizes[0] == 3 * 480 and sum(sizes) == SAMPLES
        with pytest.raises(openai.BadRequestError, match="initial_codec_chunk_frames"):
            client.chat.completions.create(model="tiny-omni", messages=messages, max_tokens=2,
                                           modalities=["text", "audio"], audio={"voice": "Ethan", "format": "wav"},
                                           extra_body={"initial_codec_chunk_frames": 0})
