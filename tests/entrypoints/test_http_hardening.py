"""What the HTTP layer bounds and keeps, against the real servers on loopback (conftest.py):
  * a body over the cap is a 413 before it is read, declared (Content-Length) or streamed (chunked);
  * a prompt far too long for the context is a 400 before it is tokenized, without stalling streams;
  * prompts are tokenized in a worker thread, to the ids the engine would compute itself;
  * an unexpected error is a well-formed 500 that leaves the keep-alive connection usable;
  * `GET /v1/videos/{id}` echoes a bounded prompt;
  * a speech request the client drops is cancelled and counted as an abort.
"""

import asyncio
import json
import threading
import time

import httpx
import pytest
from live_server import live_server


def _metric(url: str, prefix: str) -> float:
    lines = httpx.get(url + "/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(prefix))


def _aborts(url: str) -> float:
    return _metric(url, 'omnistage:request_success_total{finished_reason="abort"')


def test_body_over_the_cap_is_413_before_it_is_read(text_server):
    from omnistage.entrypoints.openai.body_limit import DEFAULT_MAX_BODY_BYTES

    big = b'{"prompt": "' + b"a" * (50 * 1000 * 1000) + b'"}'          # 50 MB, over the 32 MiB default
    with httpx.Client(base_url=text_server.url, timeout=60) as http:
        start = time.time()
        r = http.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
        elapsed = time.time() - start
        assert r.status_code == 413 and r.headers["connection"] == "close"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert str(DEFAULT_MAX_BODY_BYTES) in r.json()["error"]["message"]
        assert elapsed < 10, elapsed        # ~0.3 s here; generous for a loaded 2-core machine

        def chunks():                       # no Content-Length: counted as it streams in
            for _ in range(40):
                yield b"a" * (1 << 20)

        r = http.post("/v1/images/generations", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.headers["connection"] == "close"
        ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200        # the next request is served (on a new connection)


def test_huge_prompt_is_refused_before_tokenizing_and_streams_keep_flowing(text_server):
    gaps: list[float] = []                  # seconds between the chunks of a stream running meanwhile
    ended: list[float] = []

    def stream():
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", text_server.url + "/v1/chat/completions", json=body, timeout=60) as r:
            last = time.time()
            for line in r.iter_lines():
                if line.startswith("data:"):
                    gaps.append(time.time() - last)
                    last = time.time()
        ended.append(time.time())

    streamer = threading.Thread(target=stream)
    streamer.start()
    while not gaps:
        time.sleep(0.01)
    start = time.time()
    r = httpx.post(text_server.url + "/v1/completions", json={"prompt": "ab " * 8_000_000, "max_tokens": 2},
                   timeout=60)                                             # 24 MB: under the body cap
    refused = time.time()
    streamer.join(timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text[:300]
    assert "characters" in r.json()["error"]["message"]
    assert refused - start < 10, refused - start    # tokenizing it took 39 s before; generous when loaded
    assert ended and ended[0] > refused, "the stream was not running meanwhile"
    assert max(gaps) < 5, max(gaps)         # ~0.3 s (parsing 24 MB of JSON); every stream stalled 39 s before


def test_prompts_are_tokenized_off_the_engine_thread(text_server):
    from omnistage import SamplingParams

    tokenizer = text_server.engine.tokenizer
    threads: list[str] = []
    encode = tokenizer.encode

    def recording(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return encode(*args, **kwargs)

    prompt = "The harbour town woke slowly"
    with httpx.Client(base_url=text_server.url, timeout=60) as http:
        tokenizer.encode = recording
        try:
            comp = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0}).json()
            chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}],
                                                           "max_tokens": 4}).json()
        finally:
            del tokenizer.encode
    assert comp["usage"]["completion_tokens"] == 8 and chat["usage"]["completion_tokens"] >= 1
    assert len(threads) >= 2 and "omnistage-engine" not in threads, threads

    async def direct():                     # the engine tokenizing the text itself: the same ids and text
        outs = [o async for o in text_server.engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0))]
        return outs[-1]

    final = asyncio.run(direct())
    assert len(final.prompt_token_ids) == comp["usage"]["prompt_tokens"]
    assert final.outputs[0].text == comp["choices"][0]["text"]


def test_unexpected_errors_are_500s_on_a_reusable_connection(text_server):
    from omnistage.entrypoints.openai.api_server import build_app

    app = build_app(text_server.engine, "tiny-llama")

    @app.post("/v1/test-only/fail")
    async def fail() -> dict:               # stands for any bug a request may hit
        raise RuntimeError("a bug")

    with live_server(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        for _ in range(20):                 # the connection used to be dropped under the next request
            r = http.post("/v1/test-only/fail", json={})
            assert r.status_code == 500 and r.headers.get("connection") != "close"
            assert r.json()["error"]["type"] == "internal_server_error"
            ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            assert ok.status_code == 200


def test_video_job_echoes_a_bounded_prompt(video_server):
    from omnistage.entrypoints.openai.serving_videos import PROMPT_ECHO_CHARS

    prompt = "a boat on a lake, " * 1000
    with httpx.Client(base_url=video_server.url, timeout=60) as http:
        job = http.post("/v1/videos", json={"prompt": prompt, "size": "48x32", "num_frames": 1,
                                            "num_inference_steps": 1}).json()
        assert job["prompt"] == prompt[:PROMPT_ECHO_CHARS]
        deadline = time.time() + 30
        while (got := http.get(f"/v1/videos/{job['id']}").json())["status"] not in ("completed", "failed"):
            assert time.time() < deadline
            time.sleep(0.05)
        assert got["status"] == "completed" and got["prompt"] == prompt[:PROMPT_ECHO_CHARS]
        listed = http.get("/v1/videos").json()["data"]
        assert all(len(j["prompt"]) <= PROMPT_ECHO_CHARS for j in listed)
        assert http.delete(f"/v1/videos/{job['id']}").json()["deleted"]


LONG_SPEECH = " ".join(["Good morning. The harbour town woke slowly, and the market filled with voices."] * 20)


@pytest.mark.parametrize("stream_format", [None, "sse"])
def test_dropped_speech_is_cancelled_and_counted_as_an_abort(text_server, stream_format):
    engine, url = text_server.engine, text_server.url
    before = _aborts(url)
    body = {"input": LONG_SPEECH, "voice": "joe", "response_format": "pcm"}
    if stream_format is None:               # the whole file: the client gives up while it is synthesized
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/audio/speech", json=body, timeout=0.5)
    else:                                   # a stream: the client leaves after the first event
        with httpx.stream("POST", url + "/v1/audio/speech", json=dict(body, stream_format="sse"), timeout=60) as r:
            assert json.loads(next(line for line in r.iter_lines() if line.startswith("data:"))[5:])["type"] \
                == "speech.audio.delta"
    deadline = time.time() + 20             # synthesizing all of it takes ~10 s; the abort lands in ~1
    while _aborts(url) < before + 1 or engine.stats()["tts:num_running"]:
        assert time.time() < deadline, (_aborts(url) - before, engine.stats())
        time.sleep(0.1)
    assert _aborts(url) == before + 1
