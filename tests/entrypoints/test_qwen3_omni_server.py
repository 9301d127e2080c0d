"""Qwen3-Omni end to end on the tiny checkpoint: thinker -> talker -> code2wav offline against
transformers' generate, and over HTTP with the real openai client (chat with audio in and out,
whole and streamed; voices)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from omnistage.params import SamplingParams

NEW = 6                                         # thinker tokens
TALKER = 10                                     # talker frames at most
MESSAGES = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello there, say something"}]}]


@pytest.fixture(scope="module")
def q3_dir(tmp_path_factory):
    from omnistage.testing.qwen3_omni import make_tiny_qwen3_omni

    return make_tiny_qwen3_omni(str(tmp_path_factory.mktemp("q3_server")))


def _wav_base64(seconds: float = 0.5) -> str:
    import soundfile as sf

    t = np.arange(int(16000 * seconds)) / 16000
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 16000, format="WAV")
    return base64.b64encode(buf.getvalue()).decode()


def test_pipeline_audio_equals_transformers_generate(q3_dir):
    from omnistage import Omni
    from omnistage.testing.qwen3_omni import load_reference

    ref = load_reference(q3_dir)
    with Omni(q3_dir, device="cpu", dtype="float32") as omni:
        spec = omni.orchestrator.spec
        assert [s.name for s in spec.stages] == ["thinker", "talker", "code2wav"]
        prompt = dict(omni.render_chat(MESSAGES), modalities=["text", "audio"], voice="Ethan")
        thinker = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
        talker = SamplingParams(**{**spec.stage("talker").params, "temperature": 0, "max_tokens": TALKER,
                                   "repetition_penalty": 1.0})
        out = omni.generate(prompt, thinker, sampling_params_list=[thinker, talker, None], use_tqdm=False)[0]
    ids = torch.tensor([prompt["prompt_token_ids"]])
    with torch.no_grad():
        seqs, wav = ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), speaker="Ethan",
                                 thinker_max_new_tokens=NEW, thinker_do_sample=False, talker_do_sample=False,
                                 talker_max_new_tokens=TALKER, talker_repetition_penalty=1.0)
    assert out.outputs[0].token_ids == seqs[0, ids.shape[1]:].tolist()
    wav = wav.reshape(-1).numpy()
    got = out.audio.samples
    assert out.audio.sample_rate == 24000 and np.abs(wav).max() > 1e-3
    # transformers decodes the frames before the last sampled one; ours has that frame too unless
    # the talker stopped on codec eos (its frame is dropped): the common samples agree
    assert got.shape[0] in (wav.shape[0], wav.shape[0] + 1920)
    np.testing.assert_allclose(got[:wav.shape[0]], wav, atol=1e-4)


def test_openai_client_chat_with_audio_in_and_out_whole_and_streamed(q3_dir):
    import httpx
    import openai
    import soundfile as sf
    from live_server import live_server

    from omnistage.entrypoints.async_omni import AsyncOmni
    from omnistage.entrypoints.openai.api_server import build_app

    # the talker samples (transformers' defaults); a random tiny one may not say codec eos soon
    engine = AsyncOmni(q3_dir, device="cpu", dtype="float32",
                       deploy_config={"stages": {"talker": {"params": {"max_tokens": TALKER}}}})
    try:
        with live_server(build_app(engine, "tiny-q3"), timeout=120) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            messages = [{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": _wav_base64(), "format": "wav"}},
                {"type": "text", "text": "Answer me."}]}]
            reply = client.chat.completions.create(model="tiny-q3", messages=messages, max_tokens=NEW,
                                                   temperature=0, modalities=["text", "audio"],
                                                   audio={"voice": "chelsie", "format": "wav"},
                                                   extra_body={"ignore_eos": True})
            message = reply.choices[0].message
            samples, rate = sf.read(io.BytesIO(base64.b64decode(message.audio.data)), dtype="float32")
            assert rate == 24000 and samples.size >= 1920 and message.audio.transcript == message.content
            assert reply.usage.completion_tokens == NEW

            stream = client.chat.completions.create(model="tiny-q3", messages=messages, max_tokens=NEW,
                                                    temperature=0, modalities=["text", "audio"],
                                                    audio={"voice": "chelsie", "format": "pcm"}, stream=True,
                                                    extra_body={"ignore_eos": True})
            text, pcm = [], []
            for chunk in stream:
                if not chunk.choices:
                    continue
                delta = chunk.choices[0].delta
                text.append(delta.content or "")
                data = getattr(getattr(delta, "audio", None), "data", None)
                if data:
                    pcm.append(base64.b64decode(data))
            assert "".join(text) == message.content and len(pcm) >= 1
            assert sum(len(p) for p in pcm) // 2 == samples.size

            with pytest.raises(openai.BadRequestError, match="voice must be one of"):
                client.chat.completions.create(model="tiny-q3", messages=MESSAGES, max_tokens=2,
                                               modalities=["text", "audio"], audio={"voice": "nobody", "format": "wav"})
            voices = httpx.get(f"{url}/v1/audio/voices", timeout=30).json()
            listed = voices.get("voices", voices.get("data", voices))
            assert {"aiden", "chelsie", "ethan"} <= {v["id"] if isinstance(v, dict) else v for v in listed}
    finally:
        engine.close()
