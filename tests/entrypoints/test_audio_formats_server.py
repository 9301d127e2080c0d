"""mp3 / opus / aac from `/v1/audio/speech` and chat audio on the real server (a tiny random Llama
cascaded into the Piper voice, on loopback). The returned bytes are decoded with PyAV and their
length compared with the WAV answer to the same text: within 25% (Piper samples its phoneme
durations, so two syntheses of one text differ by a few percent; a wrong sample rate or a lost
chunk is off by far more)."""

import base64
import json

import httpx
import pytest

from omnistage.io.audio_av import audio_duration

pytest.importorskip("piper")
TEXT = "Good morning. The harbour town woke slowly, and the market filled with voices."


@pytest.fixture(scope="module")
def speech(text_server):
    if text_server.engine.speech_stage is None:
        pytest.skip("no speech stage")
    return text_server


def _speech(url: str, fmt: str, **kw) -> httpx.Response:
    r = httpx.post(url + "/v1/audio/speech", json={"input": TEXT, "voice": "joe", "response_format": fmt, **kw},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r


@pytest.fixture(scope="module")
def wav_seconds(speech) -> float:
    return audio_duration(_speech(speech.url, "wav").content)


@pytest.mark.parametrize("fmt,media", [("mp3", "audio/mpeg"), ("opus", "audio/ogg"), ("aac", "audio/aac")])
def test_speech_file_and_byte_stream(speech, wav_seconds, fmt, media):
    r = _speech(speech.url, fmt)
    assert r.headers["content-type"].startswith(media)
    assert abs(audio_duration(r.content) - wav_seconds) < 0.25 * wav_seconds
    with httpx.stream("POST", speech.url + "/v1/audio/speech", timeout=120,
                      json={"input": TEXT, "voice": "joe", "response_format": fmt, "stream_format": "audio"}) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith(media)
        pieces = [p for p in s.iter_bytes() if p]
    assert abs(audio_duration(b"".join(pieces)) - wav_seconds) < 0.25 * wav_seconds


def test_chat_audio_in_opus_whole_and_streamed(speech):
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 12, "temperature": 0,
            "modalities": ["text", "audio"], "audio": {"voice": "joe", "format": "opus"}}
    r = httpx.post(speech.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    audio = r.json()["choices"][0]["message"]["audio"]
    whole = audio_duration(base64.b64decode(audio["data"]))
    data = b""
    with httpx.stream("POST", speech.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as s:
        for line in s.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                for choice in json.loads(line[5:])["choices"]:
                    data += base64.b64decode((choice["delta"].get("audio") or {}).get("data", ""))
    streamed = audio_duration(data)
    assert whole > 0.2 and abs(streamed - whole) < 0.25 * whole


def test_unknown_format_names_the_field(speech):
    r = httpx.post(speech.url + "/v1/audio/speech", json={"input": TEXT, "response_format": "ogg"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert "mp3, opus, aac" in r.json()["error"]["message"]
