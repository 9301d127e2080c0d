"""One bad request fails only itself, and one long speech input cannot starve the other streams:
the real server on loopback (httpx), a tiny random LM cascaded into the Piper TTS stage (inline).

The poison inputs: a NUL in a speech input, a lone surrogate in a speech input, a chat whose model
output contains a NUL on its way to the TTS stage (steered: the sampling seed is searched for
over HTTP until the tiny model writes a NUL byte), and a codec decode that fails (forced: the TTS
model raises for one sentence, whichever batch it is in)."""

import base64
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
from live_server import live_server

pytest.importorskip("piper")

NAME = "tiny-poison"
POISON = "Poison pill sentence."                # the forced decode failure's sentence
MARKED = "a\u0301" * 2000                       # 2000 combining marks, no space or clause mark


@pytest.fixture(scope="module")
def server(tiny_models):
    from omnistage.entrypoints.async_omni import AsyncOmni
    from omnistage.entrypoints.openai.api_server import build_app

    engine = AsyncOmni(tiny_models["llama"], device="cpu", dtype="float32")
    model = engine.orchestrator.stages["tts"].model
    decode = model.decode

    def failing_decode(states, chunks):         # a codec model that breaks on one request's chunk
        if any(POISON in c for c in chunks):
            raise RuntimeError("forced codec decode failure")
        return decode(states, chunks)

    model.decode = failing_decode
    with live_server(build_app(engine, NAME)) as url:
        yield SimpleNamespace(url=url, engine=engine)
    engine.close()


def _post(url: str, path: str, body: dict, **kw) -> httpx.Response:
    # encoded here (ASCII JSON escapes), so lone surrogates reach the server as the JSON text "\ud800"
    return httpx.post(url + path, content=json.dumps(body).encode(), headers={"content-type": "application/json"},
                      timeout=180, **kw)


def _sse(url: str, path: str, body: dict) -> list[str]:
    """The `data:` payloads of a streamed response, in order."""
    with httpx.stream("POST", url + path, json=body, timeout=180) as r:
        assert r.status_code == 200, r.read()
        return [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]


def _chat_stream(url: str, audio: bool, max_tokens: int) -> dict:
    body = {"model": NAME, "messages": [{"role": "user", "content": "Tell me about the harbour"}],
            "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0}
    if audio:
        body.update(modalities=["text", "audio"], audio={"voice": "joe", "format": "pcm"})
    data = _sse(url, "/v1/chat/completions", body)
    assert data[-1] == "[DONE]" and not any('"error"' in d for d in data), data[-3:]
    chunks = [json.loads(d) for d in data[:-1]]
    choices = [c for chunk in chunks for c in chunk["choices"]]
    assert choices[-1]["finish_reason"] == "length"
    pcm = b"".join(base64.b64decode(c["delta"]["audio"]["data"]) for c in choices if c["delta"].get("audio"))
    return {"text": "".join(c["delta"].get("content") or "" for c in choices), "audio_bytes": len(pcm)}


def _speech_stream(url: str, text: str) -> float:
    data = _sse(url, "/v1/audio/speech", {"model": NAME, "voice": "joe", "input": text, "response_format": "pcm",
                                          "stream_format": "sse"})
    events = [json.loads(d) for d in data]
    assert events[-1]["type"] == "speech.audio.done", events[-1]
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    return len(pcm) / 2 / 22050


def _nul_seed(url: str) -> int:
    """A sampling seed whose tiny-model answer contains a NUL byte (its token exists: byte-level BPE)."""
    for base in range(0, 400, 8):
        r = _post(url, "/v1/chat/completions", {
            "model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64, "n": 8,
            "seed": base, "temperature": 1.0, "ignore_eos": True})
        for choice in r.json()["choices"]:
            if "\x00" in choice["message"]["content"]:
                return base + choice["index"]
    pytest.fail("no seed in [0, 400) made the tiny model write a NUL")


def test_poison_requests_fail_only_themselves(server):
    url = server.url
    seed = _nul_seed(url)
    nul_chat = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64, "seed": seed,
                "temperature": 1.0, "ignore_eos": True, "modalities": ["text", "audio"],
                "audio": {"voice": "joe", "format": "wav"}}
    speech = {"model": NAME, "voice": "joe", "response_format": "pcm"}
    poisons = {
        "nul": lambda: _post(url, "/v1/audio/speech", {**speech, "input": "Hello\u0000 world."}),
        "surrogate": lambda: _post(url, "/v1/audio/speech", {**speech, "input": "Hello \ud800 world."}),
        "nul_chat": lambda: _post(url, "/v1/chat/completions", nul_chat),
        "decode": lambda: _post(url, "/v1/audio/speech", {**speech, "input": POISON}),
    }
    good = ([lambda: _chat_stream(url, audio=False, max_tokens=32)] * 10
            + [lambda: _chat_stream(url, audio=True, max_tokens=16)] * 5
            + [lambda: _speech_stream(url, "Good morning. The harbour town woke slowly.")] * 5)
    with ThreadPoolExecutor(len(good) + len(poisons)) as pool:
        goods = [pool.submit(g) for g in good]
        time.sleep(0.3)                         # the good streams are under way
        bad = {name: pool.submit(p) for name, p in poisons.items()}
        results = [g.result() for g in goods]   # each raises if its stream did not complete
        bad = {name: f.result() for name, f in bad.items()}

    assert all(r["text"] for r in results[:15]) and all(r["audio_bytes"] > 0 for r in results[10:15])
    assert all(0.8 < s < 8.0 for s in results[15:]), results[15:]
    # sanitized and spoken, or refused as a 400 naming `input`: never a failure of anything else
    for name in ("nul", "surrogate"):
        r = bad[name]
        assert r.status_code == 200 and 0.3 < len(r.content) / 2 / 22050 < 3 \
            or r.status_code == 400 and r.json()["error"]["param"] == "input", (name, r.status_code, r.text)
    r = bad["nul_chat"]
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert "\x00" in message["content"] and len(base64.b64decode(message["audio"]["data"])) > 44
    r = bad["decode"]                           # the one request that really fails, alone
    assert r.status_code >= 500 and "forced codec decode failure" in r.json()["error"]["message"], r.text
    assert httpx.get(url + "/health").status_code == 200
    assert 0.5 < _speech_stream(url, "Back again.") < 4


def test_speech_input_with_nothing_speakable_is_a_400(server):
    for text in ("\u0000\u0001\u0002", "** __ ``", "\u200b\ufeff", "\ud800\udc00\ud800"[::2]):
        r = _post(server.url, "/v1/audio/speech", {"model": NAME, "voice": "joe", "input": text})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", (text, r.text)


def test_a_long_unbroken_speech_input_does_not_starve_chat_streams(server):
    """2000 combining marks with no boundary used to be one sentence, one forward: seconds of engine
    time in which chat streams got nothing. Now each engine step speaks a bounded piece, and the
    bound is: while it is spoken, no chat stream waits between two of its tokens more than half
    the speech's synthesis time (it would be all of it with one forward), nor 10 s (2 CPU cores
    shared with other jobs: unloaded the gap is ~0.5 s, heavily loaded up to ~6 s)."""
    url, stop, gaps = server.url, threading.Event(), []

    def chats():                                # back-to-back chat streams; gaps between tokens of one stream
        while not stop.is_set():
            body = {"model": NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32,
                    "stream": True, "ignore_eos": True}
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=180) as r:
                last = None
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        now = time.monotonic()
                        if last is not None:
                            gaps.append((last, now))
                        last = now

    thread = threading.Thread(target=chats)
    thread.start()
    try:
        time.sleep(0.5)
        start = time.monotonic()
        r = httpx.post(url + "/v1/audio/speech", json={"model": NAME, "voice": "joe", "input": MARKED,
                                                       "response_format": "pcm"}, timeout=300)
        end = time.monotonic()
    finally:
        stop.set()
        thread.join(timeout=120)
    assert r.status_code == 200 and len(r.content) / 2 / 22050 > 10     # all of it was spoken
    synthesis = end - start
    during = [b - a for a, b in gaps if b > start and a < end]
    assert len(during) > 5
    print(f"2000-mark speech: {synthesis:.1f} s; largest chat token gap meanwhile {max(during):.2f} s")
    assert max(during) < min(synthesis / 2, 10.0), (max(during), synthesis)
