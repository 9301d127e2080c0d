"""Read aloud on Qwen3-Omni: /v1/audio/speech (real openai client, wav and streamed pcm) and
`Omni.speak` feed the thinker the text as its answer and the talker speaks it, in a speaker named in
any case; a bad voice or an unsupported field is a 400 naming it; /v1/capabilities lists speech.

What the talker got is read at the thinker -> talker edge: the thinker-side ids of the rows it was
given as the answer equal the tokenized `input`, its prompt holds one row per user-turn position,
three assistant-header rows and six special rows (the last one S_3 + codec bos), and its streamed
rows are one per further prompt position (+ the tts_eos row). The tiny tokenizer spells the
assistant header in more than three tokens: as in transformers, its tail counts as the answer's start.
Offline, the same ids sent as a chat prompt that the thinker continues give the talker the same
prompt rows and first streamed row.
"""

from __future__ import annotations

import io

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
import torch

from omnistage.codec.speech import TTSParams
from omnistage.params import SamplingParams

FRAMES = 6                                      # talker frames: codec eos is barred, so exactly these
TEXT = "Hello there, read this aloud."
EDGE = ("thinker", "talker")


@pytest.fixture(scope="module")
def q3_dir(tmp_path_factory):
    from omnistage.testing.qwen3_omni import make_tiny_qwen3_omni

    return make_tiny_qwen3_omni(str(tmp_path_factory.mktemp("q3_read")))


@pytest.fixture(scope="module")
def deploy(q3_dir):
    from omnistage.models.qwen3_omni.thinker import omni_config

    config = omni_config(q3_dir)
    bad = [config.talker_config.codec_eos_token_id]   # the talker masks the ids it never samples itself
    return {"stages": {"talker": {"params": {"max_tokens": FRAMES, "bad_token_ids": bad}}}}


def record_talker_inputs(orch) -> dict:
    """Wraps the thinker -> talker adapter: request id -> (thinker ids, read_aloud_from, talker input)."""
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
    a = len(ids) - 1 - ids[::-1].index(ids[0])                      # the last <|im_start|>: assistant's
    assert start >= a + 3                                           # the text follows the header
    # user turn (a positions) + S_0..S_2 + nothink, think bos/eos, speaker, tts_bos, S_3 + bos
    assert len(talker.prompt.prompt_token_ids) == a + 3 + 6
    assert talker.finished and len(talker) == 1 + (len(ids) - a - 4) + 1   # S_4 .. the end + tts_eos
    seen.clear()


def test_speech_route_reads_the_input_aloud_wav_and_streamed_pcm(q3_dir, deploy):
    from live_server import live_server

    from omnistage.entrypoints.async_omni import AsyncOmni
    from omnistage.entrypoints.openai.api_server import build_app
    from omnistage.entrypoints.openai.serving_speech import ChatAudio

    engine = AsyncOmni(q3_dir, device="cpu", dtype="float32", deploy_config=deploy)
    try:
        seen = record_talker_inputs(engine.orchestrator)
        with live_server(build_app(engine, "tiny-q3"), timeout=120) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
            wav = client.audio.speech.create(model="tiny-q3", input=TEXT, voice="Ethan", response_format="wav")
            samples, rate = sf.read(io.BytesIO(wav.content), dtype="float32")
            assert rate == 24000 and samples.size > 0 and np.isfinite(samples).all()
            check_talker_got_the_text(seen, engine.tokenizer, TEXT)

            with client.audio.speech.with_streaming_response.create(
                    model="tiny-q3", input=TEXT, voice="AIDEN", response_format="pcm",
                    extra_body={"stream_format": "audio"}) as resp:
                pieces = [p for p in resp.iter_bytes() if p]
            pcm = np.frombuffer(b"".join(pieces), dtype="<i2")
            assert pcm.size == samples.size                         # the same number of frames spoken
            check_talker_got_the_text(seen, engine.tokenizer, TEXT)

            for body, field in (({"voice": "Nobody"}, "voice"), ({"speed": 2.0}, "speed"),
                                ({"task_type": "VoiceDesign", "instructions": "calm"}, "task_type"),
                                ({"initial_codec_chunk_frames": 4}, "initial_codec_chunk_frames")):
                args = {"voice": "ethan", **body}
                with pytest.raises(openai.BadRequestError, match=field) as err:
                    client.audio.speech.create(model="tiny-q3", input=TEXT, voice=args.pop("voice"),
                                               extra_body=args)
                assert err.value.body["param"] == field
            assert not seen

            caps = httpx.get(f"{url}/v1/capabilities", timeout=30).json()
            assert caps["speech"] is not None
        # chat audio takes a speaker in any case as well, and hands the talker its id
        assert ChatAudio.from_request(engine, ["text", "audio"], {"voice": "Chelsie"}).voice == "chelsie"
    finally:
        engine.close()


def test_offline_speak(q3_dir, deploy):
    from omnistage import Omni

    with Omni(q3_dir, device="cpu", dtype="float32", deploy_config=deploy) as omni:
        seen = record_talker_inputs(omni.orchestrator)
        (out,) = omni.speak(TEXT, TTSParams(voice="Chelsie"), use_tqdm=False)
        assert out.audio.sample_rate == 24000 and out.audio.samples.size > 0
        ((ids, _, read),) = seen.values()
        check_talker_got_the_text(seen, omni.tokenizer, TEXT)
        # the same ids as a chat prompt the thinker continues: the talker's prompt and first streamed
        # row are the same rows, so read-aloud conditions the talker as a thinker that wrote the text
        omni.generate({"prompt_token_ids": ids, "modalities": ["text", "audio"], "voice": "chelsie"},
                      SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        ((_, start, chat),) = seen.values()
        assert start is None and torch.equal(chat.prompt.prompt_embeds, read.prompt.prompt_embeds)
        assert torch.equal(chat.rows[0], read.rows[0])
        with pytest.raises(ValueError, match="speed"):
            omni.speak(TEXT, TTSParams(speed=1.5), use_tqdm=False)
