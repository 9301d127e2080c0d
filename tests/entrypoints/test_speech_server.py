"""Speech over HTTP end to end: the real `openai` client against uvicorn on loopback, serving a tiny
random LM cascaded into the Piper TTS stage (the bundled real voice plus a slower preset of it)."""

import base64
import io
import json
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import openai
import pytest
from live_server import live_server

pytest.importorskip("piper")
sf = pytest.importorskip("soundfile")

NAME = "tiny-cascade"
TEXT = "Good morning. The harbour town woke slowly, and the market filled with voices."
SHORT = "The harbour town woke slowly."
DEPLOY = {"stages": {"tts": {"options": {"voices": {"joe-slow": {"voice": "joe", "length_scale": 1.5}}}}}}


@pytest.fixture(scope="module")
def server(tiny_models):
    from omnistage.entrypoints.async_omni import AsyncOmni
    from omnistage.entrypoints.openai.api_server import build_app

    engine = AsyncOmni(tiny_models["llama"], device="cpu", dtype="float32", deploy_config=DEPLOY)
    app = build_app(engine, NAME)
    with live_server(app) as url:
        yield SimpleNamespace(url=url, engine=engine)
    engine.close()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0, timeout=120) as c:
        yield c


def _decode(data: bytes, fmt: str = "wav"):
    if fmt == "pcm":
        import numpy as np

        return np.frombuffer(data, "<i2").astype("float32") / 32767, 22050
    return sf.read(io.BytesIO(data), dtype="float32")


def _seconds(data: bytes, fmt: str = "wav") -> float:
    samples, rate = _decode(data, fmt)
    assert rate == 22050 and len(samples) > 0
    return len(samples) / rate


def test_voices_and_speech_files(client, server):
    voices = httpx.get(server.url + "/v1/audio/voices").json()["data"]
    assert {v["id"] for v in voices} == {"joe", "joe-slow"} and voices[0]["sample_rate"] == 22050
    audio = client.audio.speech.create(model=NAME, voice="joe", input=TEXT, instructions="Speak calmly.")
    assert 2.5 < _seconds(audio.content) < 9.0             # 13 words of English
    for fmt in ("pcm", "flac"):
        audio = client.audio.speech.create(model=NAME, voice="joe", input=SHORT, response_format=fmt)
        assert 0.8 < _seconds(audio.content, fmt) < 4.0


def test_speech_streams_raw_bytes_and_sse_events(client):
    with client.audio.speech.with_streaming_response.create(
            model=NAME, voice="joe", input=TEXT, response_format="wav", stream_format="audio") as r:
        assert r.headers["content-type"].startswith("audio/wav")
        raw = b"".join(r.iter_bytes())
    assert 2.5 < _seconds(raw) < 9.0
    events = []
    with client.audio.speech.with_streaming_response.create(
            model=NAME, voice="joe", input=TEXT, response_format="pcm", stream_format="sse") as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "speech.audio.done" and set(kinds[:-1]) == {"speech.audio.delta"} and len(kinds) >= 3
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert 2.5 < _seconds(pcm, "pcm") < 9.0
    usage = events[-1]["usage"]
    assert usage["input_tokens"] > 20 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_speech_bad_requests_name_the_field(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.speech.create(model=NAME, voice="alloy", input="Hi.")
    assert "['joe', 'joe-slow']" in e.value.message and e.value.body["param"] == "voice"
    for kw, param in (({"speed": 9.0}, "speed"), ({"response_format": "wma"}, "response_format")):
        with pytest.raises(openai.BadRequestError) as e:
            client.audio.speech.create(model=NAME, voice="joe", input="Hi.", **kw)
        assert e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                       modalities=["text", "audio"], audio={"voice": "nobody", "format": "wav"})


def test_concurrent_speech_with_different_voices_and_speeds(client):
    jobs = [(voice, speed) for voice in ("joe", "joe-slow") for speed in (0.8, 1.0, 1.5, 2.0)]

    def one(job):
        voice, speed = job
        return _seconds(client.audio.speech.create(model=NAME, voice=voice, input=SHORT, speed=speed).content)

    with ThreadPoolExecutor(len(jobs)) as pool:
        got = dict(zip(jobs, pool.map(one, jobs)))
    for speed in (0.8, 1.0, 1.5, 2.0):           # each request got its own voice: the slow preset is longer
        assert 1.2 < got["joe-slow", speed] / got["joe", speed] < 1.9, got
    assert got["joe", 0.8] > got["joe", 1.0] > got["joe", 1.5] > got["joe", 2.0]


def _chat_prompt_with_early_sentence(client) -> str:
    """A prompt whose greedy tiny-LM answer completes a sentence long before it ends."""
    from omnistage.codec.speech import split_sentences

    for prompt in ("Hello", "Please answer", "What is two plus two?", "Tell me about the harbour", "Hi there"):
        text = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}],
                                              max_tokens=60, temperature=0, extra_body={"ignore_eos": True}
                                              ).choices[0].message.content
        if split_sentences(text[:-40], final=False)[0]:
            return prompt
    pytest.fail("no candidate prompt produced an early sentence end")


def test_chat_audio_whole_and_streamed(client):
    prompt = _chat_prompt_with_early_sentence(client)
    kw = dict(model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=60, temperature=0,
              modalities=["text", "audio"], audio={"voice": "joe", "format": "wav"},
              extra_body={"ignore_eos": True})
    reply = client.chat.completions.create(**kw).choices[0]
    audio = reply.message.audio
    assert audio.transcript == reply.message.content and audio.id and audio.expires_at > time.time()
    chat_seconds = _seconds(base64.b64decode(audio.data))
    # Consistent with the transcript: the same text spoken through /v1/audio/speech lasts as long.
    alone = _seconds(client.audio.speech.create(model=NAME, voice="joe", input=audio.transcript).content)
    assert 0.7 < chat_seconds / alone < 1.4, (chat_seconds, alone)

    order, wav, text = [], b"", ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            delta = choice.delta
            if delta.audio is not None:
                order.append("audio")
                wav += base64.b64decode(delta.audio.data or "")
            if delta.content:
                order.append("text")
                text += delta.content
            if choice.finish_reason:
                order.append("finish")
    assert text == reply.message.content and order[-1] == "finish"
    last_text = len(order) - 1 - order[::-1].index("text")
    assert order.index("audio") < last_text         # speech started before the text was finished
    assert 0.7 < _seconds(wav) / alone < 1.4


def test_edge_transfer_metrics_count_the_cascade(client, server):
    before = _edge_pieces(server.url)
    client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Say something."}],
                                   max_tokens=20, modalities=["text", "audio"], audio={"voice": "joe", "format": "wav"},
                                   extra_body={"ignore_eos": True})
    after = _edge_pieces(server.url)
    assert after > before                           # the LM's sentences crossed the llm -> tts edge
    text = httpx.get(server.url + "/metrics").text
    assert 'omnistage:edge_transfer_seconds_total{' in text and 'edge="llm->tts"' in text


def _edge_pieces(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("omnistage:edge_transfer_pieces_total{") and 'edge="llm->tts"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0
