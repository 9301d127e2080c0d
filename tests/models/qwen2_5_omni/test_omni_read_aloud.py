"""Read aloud on Qwen2.5-Omni: /v1/audio/speech (real openai client, wav and streamed pcm) and
`Omni.speak` feed the thinker the text as its answer and the talker speaks it.

What the talker got is read at the thinker -> talker edge: the thinker-side ids of the rows it was
given as the answer equal the tokenized `input`, its prompt holds one row per thinker prompt
position before them (+ voice and bos rows), and its streamed rows are one per further text token
(+ the tts_eos row).
"""

import io

import numpy as np
import openai
import pytest
import soundfile as sf
from omni_testutil import openai_client

from omnistage.codec.speech import TTSParams

DEPLOY = {"stages": {"talker": {"params": {"max_tokens": 24}}}}   # keep the random talker short
TEXT = "Hello there, read this aloud."
EDGE = ("thinker", "talker")


@pytest.fixture(scope="module")
def async_omni(omni_dir):
    from omnistage.entrypoints.async_omni import AsyncOmni

    engine = AsyncOmni(omni_dir, device="cpu", dtype="float32", deploy_config=DEPLOY)
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
        assert rate == 24000 and samples.size > 0 and np.isfinite(samples).all()
        check_talker_got_the_text(seen, tokenizer, TEXT)

        with client.audio.speech.with_streaming_response.create(
                model="tiny-omni", input=TEXT, voice="Ethan", response_format="pcm",
                extra_body={"stream_format": "audio", "initial_codec_chunk_frames": 4}) as resp:
            pieces = [p for p in resp.iter_bytes() if p]
        pcm = np.frombuffer(b"".join(pieces), dtype="<i2")
        assert pcm.size > 0
        check_talker_got_the_text(seen, tokenizer, TEXT)

        for body, field in (({"speed": 2.0}, "speed"), ({"voice": "Nobody"}, "voice"),
                            ({"task_type": "VoiceDesign", "instructions": "calm"}, "task_type"),
                            ({"initial_codec_chunk_frames": 0}, "initial_codec_chunk_frames")):
            args = {"voice": "Ethan", **body}
            with pytest.raises(openai.BadRequestError, match=field):
                client.audio.speech.create(model="tiny-omni", input=TEXT, voice=args.pop("voice"),
                                           extra_body=args)
        assert not seen


def test_offline_speak_on_an_omni_folder(omni_dir):
    from omnistage import Omni

    with Omni(omni_dir, device="cpu", dtype="float32", deploy_config=DEPLOY) as omni:
        seen = record_talker_inputs(omni.orchestrator)
        (out,) = omni.speak(TEXT, TTSParams(voice="Chelsie"), use_tqdm=False)
        assert out.audio.sample_rate == 24000 and out.audio.samples.size > 0
        check_talker_got_the_text(seen, omni.tokenizer, TEXT)
        with pytest.raises(ValueError, match="speed"):
            omni.speak(TEXT, TTSParams(speed=1.5), use_tqdm=False)
