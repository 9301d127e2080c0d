"""The speech HTTP surface beyond OpenAI's: vLLM-Omni's extension fields, usage headers, the voice
library, the WebSocket stream and the batch route, end to end: the real `openai` client, httpx and
the `websockets` client against uvicorn on loopback, serving a tiny random LM cascaded into the
Piper TTS stage (the bundled real voice, plus `joe-flat`: the same voice without sampling noise,
so equal text gives equal samples)."""

import base64
import io
import json
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
from live_server import live_server

pytest.importorskip("piper")
websockets_sync = pytest.importorskip("websockets.sync.client")

NAME = "tiny-cascade"
DEPLOY = {"stages": {"tts": {"options": {"voices": {
    "joe-flat": {"voice": "joe", "noise_scale": 0.0, "noise_w_scale": 0.0}}}}}}
TEXT = "The harbour town woke slowly. Then the market filled with voices!"
PCM_TOLERANCE = 1                               # PCM16 steps: the WS audio equals the whole answer's


def _wav(seconds: float, rate: int = 16000) -> bytes:
    from omnistage.io.audio import encode_audio

    t = np.arange(int(seconds * rate)) / rate
    return encode_audio((0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), rate, "wav")


@pytest.fixture(scope="module")
def engine(tiny_models):
    from omnistage.entrypoints.async_omni import AsyncOmni

    engine = AsyncOmni(tiny_models["llama"], device="cpu", dtype="float32", deploy_config=DEPLOY)
    yield engine
    engine.close()


def _app(engine, voice_dir, **kw):
    from omnistage.entrypoints.openai.api_server import build_app
    from omnistage.entrypoints.openai.serving_speech import SpeechOptions

    return build_app(engine, NAME, speech_options=SpeechOptions(speaker_samples_dir=str(voice_dir)), **kw)


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    voice_dir = tmp_path_factory.mktemp("voices")
    with live_server(_app(engine, voice_dir), timeout=120) as url:
        yield SimpleNamespace(url=url, engine=engine, voice_dir=voice_dir)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0, timeout=120) as c:
        yield c


def _pcm(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i2").astype(np.int32)


def test_extension_fields_a_piper_voice_cannot_honour_are_400s_naming_them(client):
    wav = base64.b64encode(_wav(1.0)).decode()
    cases = [
        ({"task_type": "Base"}, "task_type", "['CustomVoice']"),
        ({"task_type": "Singing"}, "task_type", "CustomVoice"),
        ({"language": "Klingon"}, "language", "en_US"),
        ({"ref_audio": "data:audio/wav;base64," + wav}, "ref_audio", "clones"),
        ({"ref_audio": "!!not base64!!"}, "ref_audio", "base64"),
        ({"ref_audio": base64.b64encode(b"RIFF garbage" * 50).decode()}, "ref_audio", "decoded"),
        ({"ref_audio": base64.b64encode(_wav(31.0, 8000)).decode()}, "ref_audio", "30 seconds"),
        ({"ref_audio": "http://127.0.0.1:9/voice.wav"}, "ref_audio", "--allowed-media-domains"),
        ({"ref_text": "Hello there."}, "ref_text", "clones"),
        ({"x_vector_only_mode": True}, "x_vector_only_mode", "clones"),
        ({"max_new_tokens": 64}, "max_new_tokens", "not supported"),
        ({"max_new_tokens": 0}, "max_new_tokens", "[1, 16384]"),
        ({"initial_codec_chunk_frames": 4}, "initial_codec_chunk_frames", "not supported"),
        ({"voice": "nobody"}, "voice", "joe-flat"),
    ]
    for extra, param, says in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.audio.speech.create(model=NAME, voice=extra.pop("voice", "joe"), input="Hi.", extra_body=extra)
        assert e.value.body["param"] == param and says in e.value.message, (extra, e.value.body)
    ok = client.audio.speech.with_raw_response.create(
        model=NAME, voice="joe", input="Hi.", extra_body={"task_type": "CustomVoice", "language": "en_US"})
    assert ok.status_code == 200


def test_usage_headers_and_stream_true_as_sse_or_raw_audio(client):
    raw = client.audio.speech.with_raw_response.create(model=NAME, voice="joe-flat", input=TEXT,
                                                       response_format="pcm")
    h = raw.headers
    frames = len(raw.content) // 2 // 256
    assert int(h["x-vllm-omni-output-tokens"]) == frames and int(h["x-vllm-omni-input-text-tokens"]) > 20
    assert int(h["x-vllm-omni-total-tokens"]) == int(h["x-vllm-omni-input-tokens"]) + frames
    assert h["x-vllm-omni-input-audio-tokens"] == "0"
    events = []
    with client.audio.speech.with_streaming_response.create(
            model=NAME, voice="joe-flat", input=TEXT, response_format="pcm", extra_body={"stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
    assert events[-1]["type"] == "speech.audio.done" and {e["type"] for e in events[:-1]} == {"speech.audio.delta"}
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert pcm == raw.content                   # no noise: the streamed answer is the whole one
    usage = events[-1]["usage"]
    assert usage["output_tokens"] == frames and usage["input_token_details"]["audio_tokens"] == 0
    with client.audio.speech.with_streaming_response.create(
            model=NAME, voice="joe-flat", input=TEXT, response_format="pcm", stream_format="audio",
            extra_body={"stream": True}) as r:
        assert r.headers["content-type"].startswith("audio/pcm")
        assert b"".join(r.iter_bytes()) == raw.content


def _upload(url: str, name: str, audio: bytes, **fields):
    data = {"name": name, **fields}
    return httpx.post(url + "/v1/audio/voices", data=data, files={"audio_sample": ("me.wav", audio, "audio/wav")},
                      timeout=60)


def test_voice_upload_list_use_delete_and_restore_after_restart(client, server, engine):
    r = _upload(server.url, "alice", _wav(2.0), consent="I, Alice, agree.", ref_text="Hello from Alice.",
                speaker_description="calm")
    assert r.status_code == 201, r.text
    assert r.json()["name"] == "alice" and r.json()["seconds"] == 2.0 and r.json()["uploaded"] is True
    listed = httpx.get(server.url + "/v1/audio/voices").json()
    by_id = {v["id"]: v for v in listed["data"]}
    assert {"joe", "joe-flat", "alice"} <= set(by_id) and by_id["alice"]["ref_text"] == "Hello from Alice."
    assert by_id["joe"]["uploaded"] is False and listed["capabilities"]["clones"] is False
    with pytest.raises(openai.BadRequestError) as e:        # Piper lists it but cannot speak with it
        client.audio.speech.create(model=NAME, voice="alice", input="Hi.")
    assert e.value.body["param"] == "voice" and "does not clone" in e.value.message
    for name, audio, fields, param in (
            ("bob", _wav(1.0), {}, "consent"),
            ("../evil", _wav(1.0), {"consent": "yes"}, "name"),
            ("joe", _wav(1.0), {"consent": "yes"}, "name"),
            ("alice", _wav(1.0), {"consent": "yes"}, "name"),
            ("carol", b"not audio at all" * 10, {"consent": "yes"}, "audio_sample"),
            ("dave", _wav(31.0, 8000), {"consent": "yes"}, "audio_sample")):
        bad = _upload(server.url, name, audio, **fields)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (name, bad.text)
    assert len(list(server.voice_dir.iterdir())) == 1        # one file per voice, nothing from the failures

    with live_server(_app(engine, server.voice_dir), timeout=120) as url2:   # a restarted server
        again = {v["id"]: v for v in httpx.get(url2 + "/v1/audio/voices").json()["data"]}
        assert again["alice"]["ref_text"] == "Hello from Alice." and again["alice"]["sample_rate"] == 16000
        assert httpx.delete(url2 + "/v1/audio/voices/alice").json()["deleted"] is True
    assert httpx.delete(server.url + "/v1/audio/voices/alice").status_code == 200   # this one still had it
    assert httpx.delete(server.url + "/v1/audio/voices/alice").status_code == 404
    assert "alice" not in {v["id"] for v in httpx.get(server.url + "/v1/audio/voices").json()["data"]}
    assert list(server.voice_dir.iterdir()) == []


def _session(url: str, messages: list, headers=None) -> tuple[list, list]:
    """Sends `messages` over the WebSocket route and reads until it closes: (events, (sentence, bytes))."""
    events, frames = [], []
    with websockets_sync.connect(url.replace("http", "ws") + "/v1/audio/speech/stream",
                                 additional_headers=headers, open_timeout=60) as ws:
        for m in messages:
            ws.send(m if isinstance(m, (bytes, str)) else json.dumps(m))
        for msg in ws:
            if isinstance(msg, bytes):
                frames.append((events[-1]["sentence_index"], msg))
            else:
                events.append(json.loads(msg))
    return events, frames


def test_websocket_speaks_sentences_as_they_complete_and_matches_the_whole_answer(client, server):
    pieces = ["The harbour to", "wn woke slowly.", " Then the mar", "ket filled with voices!"]
    messages = [{"type": "session.config", "voice": "joe-flat", "format": "pcm"}]
    messages += [{"type": "input.text", "text": p} for p in pieces]
    messages += [{"type": "input.done"}, {"type": "session.close"}]
    events, frames = _session(server.url, messages)
    kinds = [e["type"] for e in events]
    assert kinds == ["audio.start", "audio.done", "audio.start", "audio.done", "session.done"], events
    assert [e["text"] for e in events if e["type"] == "audio.start"] == \
        ["The harbour town woke slowly.", "Then the market filled with voices!"]
    assert events[0]["sample_rate"] == 22050 and {i for i, _ in frames} == {0, 1}
    streamed = _pcm(b"".join(f for _, f in frames))
    whole = _pcm(client.audio.speech.create(model=NAME, voice="joe-flat", input=TEXT, response_format="pcm").content)
    assert len(streamed) == len(whole) and np.abs(streamed - whole).max() <= PCM_TOLERANCE
    assert events[1]["usage"]["output_tokens"] > 0 and events[-1]["sentences"] == 2


def test_websocket_errors_keep_the_session_and_the_api_key_guards_the_handshake(server, engine):
    events, frames = _session(server.url, [
        {"type": "session.config", "voice": "nobody"},
        {"type": "session.config", "format": "flac"},
        {"type": "session.config", "task_type": "Base"},
        {"type": "dance"},
        {"type": "input.text", "text": 5},
        b"\x00\x01 binary",
        "not json",
        {"type": "session.config", "voice": "joe-flat", "speed": 2.0},
        {"type": "input.text", "text": "Short one."},
        {"type": "session.close"}])
    errors = [e["error"]["param"] for e in events if e["type"] == "error"]
    assert errors == ["voice", "response_format", "task_type", "type", "text", None, None], events
    assert [e["type"] for e in events[7:]] == ["audio.start", "audio.done", "session.done"] and frames
    assert events[7]["sentence_index"] == 0 and events[7]["format"] == "pcm"

    events, frames = _session(server.url, [{"type": "session.config", "voice": "joe", "format": "wav"},
                                           {"type": "input.text", "text": "One. Two."}, {"type": "session.close"}])
    starts = [i for i, (sentence, _) in enumerate(frames) if i == 0 or frames[i - 1][0] != sentence]
    assert len(starts) == 2 and all(frames[i][1][:4] == b"RIFF" for i in starts)   # a WAV stream per sentence

    from websockets.exceptions import InvalidStatus

    with live_server(_app(engine, server.voice_dir, api_key="sekrit"), timeout=120) as url:
        with pytest.raises(InvalidStatus):
            _session(url, [{"type": "session.close"}])
        events, _ = _session(url, [{"type": "session.close"}], headers={"Authorization": "Bearer sekrit"})
        assert events == [{"type": "session.done", "sentences": 0}]


def test_batch_fans_out_and_one_bad_item_fails_alone(server, client):
    body = {"model": NAME, "voice": "joe-flat", "response_format": "pcm",
            "items": [{"input": "First item."}, {"input": "Second item.", "speed": 9.0},
                      {"input": "Third item.", "voice": "joe", "response_format": "wav"}, {"input": ""}]}
    r = httpx.post(server.url + "/v1/audio/speech/batch", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["total"] == 4 and out["succeeded"] == 2 and out["failed"] == 2 and out["id"]
    res = out["results"]
    assert [x["index"] for x in res] == [0, 1, 2, 3] and [x["status"] for x in res] == \
        ["succeeded", "failed", "succeeded", "failed"]
    assert res[1]["error"]["param"] == "speed" and res[3]["error"]["param"] == "input"
    assert res[0]["media_type"] == "audio/pcm" and res[2]["media_type"] == "audio/wav"
    alone = client.audio.speech.create(model=NAME, voice="joe-flat", input="First item.", response_format="pcm")
    assert base64.b64decode(res[0]["audio_data"]) == alone.content and res[0]["usage"]["output_tokens"] > 0
    import soundfile as sf

    assert sf.read(io.BytesIO(base64.b64decode(res[2]["audio_data"])))[1] == 22050
    for bad in ({"items": []}, {"items": [{"input": "x"}] * 33}, {"voice": "joe"}):
        r = httpx.post(server.url + "/v1/audio/speech/batch", json=bad, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "items"


def test_a_tts_stage_in_its_own_process_declares_and_enforces_the_same(tiny_models, tmp_path):
    """`runner: process`: capabilities come over StageReady, checks (reference audio included, through
    shared memory) over the check channel, before any work; nothing is left in /dev/shm by them."""
    import os

    from omnistage.entrypoints.async_omni import AsyncOmni

    deploy = {"stages": {"tts": {"runner": "process", **DEPLOY["stages"]["tts"]}}}
    engine = AsyncOmni(tiny_models["llama"], device="cpu", dtype="float32", deploy_config=deploy)
    try:
        with live_server(_app(engine, tmp_path), timeout=120) as url:
            listed = httpx.get(url + "/v1/audio/voices").json()
            assert listed["capabilities"] == {"task_types": ["CustomVoice"], "languages": ["Auto", "en_US"],
                                              "clones": False, "fields": []}
            assert _upload(url, "alice", _wav(3.0), consent="yes", ref_text="Hi.").status_code == 201
            shm = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
            for body, param in (({"voice": "alice"}, "voice"), ({"voice": "joe", "ref_text": "Hi."}, "ref_text")):
                r = httpx.post(url + "/v1/audio/speech", json={"input": "Hello there.", **body}, timeout=60)
                assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            if os.path.isdir("/dev/shm"):
                assert set(os.listdir("/dev/shm")) <= shm
            r = httpx.post(url + "/v1/audio/speech", json={"input": "Hello there.", "voice": "joe-flat",
                                                           "response_format": "pcm"}, timeout=120)
            assert r.status_code == 200 and len(r.content) > 22050
    finally:
        engine.close()
