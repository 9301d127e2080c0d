"""`omnistage serve` end to end: the real `openai` client against uvicorn on loopback.

One server per module (a tiny random Qwen2 checkpoint on CPU, float32, API key on) runs in a
background thread; tests talk to it over HTTP only, and read `engine.stats()` to check that
aborted requests gave their KV blocks back.
"""

import asyncio
import json
import re
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from live_server import live_server

API_KEY = "test-key"
NAME = "tiny-qwen2"
PROMPTS = ["The harbour town woke", "A language model reads", "In the workshop, the old", "What is two plus"]
FAMILIES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "request_success_total",
            "e2e_request_latency_seconds", "time_to_first_token_seconds", "inter_token_latency_seconds",
            "prompt_tokens_total", "generation_tokens_total", "num_preemptions_total",
            "prefix_cache_queries_total", "prefix_cache_hits_total"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from omnistage.entrypoints.async_omni import AsyncOmni
    from omnistage.entrypoints.openai.api_server import build_app
    from omnistage.testing.llm import make_tiny_lm

    model = make_tiny_lm(str(tmp_path_factory.mktemp("server") / "qwen2"), "qwen2")
    engine = AsyncOmni(model, device="cpu", dtype="float32")
    app = build_app(engine, NAME, api_key=API_KEY)
    with live_server(app) as url:
        yield SimpleNamespace(url=url, engine=engine, model=model, metrics=app.state.metrics)
    engine.close()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


def _chat(client, prompt, **kw):
    return client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}], **kw)


def _metric(server, line_prefix: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_prefix))


def _wait_idle(server, timeout=5.0):
    """Every request gone from the engine, its KV blocks back in the pool, no metrics state left."""
    deadline = time.time() + timeout
    while True:
        stats = server.engine.stats()
        if (stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0
                and server.metrics.num_tracked == 0):
            return
        assert time.time() < deadline, f"request not freed: {stats}"
        time.sleep(0.05)


def test_health_and_models(server, client):
    assert httpx.get(server.url + "/health").status_code == 200    # no key needed outside /v1
    models = client.models.list().data
    assert [m.id for m in models] == [NAME]


def test_chat_and_completion_with_usage(client):
    chat = _chat(client, "What is the capital of France?", max_tokens=12, temperature=0)
    choice = chat.choices[0]
    assert chat.object == "chat.completion" and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")
    assert 0 < chat.usage.completion_tokens <= 12 and chat.usage.prompt_tokens > 5
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens

    comp = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert comp.choices[0].finish_reason == "length" and comp.usage.completion_tokens == 10
    assert comp.usage.total_tokens == comp.usage.prompt_tokens + 10


def test_streaming_equals_non_streaming(client):
    for prompt in PROMPTS[:2]:
        full = _chat(client, prompt, max_tokens=20, temperature=0)
        chunks = list(_chat(client, prompt, max_tokens=20, temperature=0, stream=True,
                            stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == full.choices[0].message.content
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] == full.choices[0].finish_reason and not any(finishes[:-1])
        counts = {"prompt_tokens_details"}     # the repeat of the prompt is served from the prefix cache
        assert chunks[-1].choices == [] and chunks[-1].usage.model_dump(exclude=counts) == \
            full.usage.model_dump(exclude=counts)
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= full.usage.prompt_tokens_details.cached_tokens

        comp = client.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0)
        stream = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0,
                                                stream=True))
        assert "".join(c.choices[0].text for c in stream) == comp.choices[0].text
        assert stream[-1].choices[0].finish_reason == comp.choices[0].finish_reason


def test_n2_seeded_stream_and_usage(client):
    kw = dict(max_tokens=12, temperature=1.0, seed=7, n=2, extra_body={"ignore_eos": True})
    full = _chat(client, PROMPTS[1], **kw)
    assert sorted(c.index for c in full.choices) == [0, 1]
    assert full.usage.completion_tokens == 24
    texts = {0: "", 1: ""}
    finished = {}
    for chunk in _chat(client, PROMPTS[1], stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert finished == {0: "length", 1: "length"}
    assert texts == {c.index: c.message.content for c in full.choices}   # same seed, same tokens


def test_stop_string(client):
    base = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    match = re.search(r"[A-Za-z]{2}", base[3:])
    assert match, f"no ASCII letters to stop on in {base!r}"
    stop = match.group(0)
    want = base[: base.find(stop)]
    for stream in (False, True):
        res = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=24, temperature=0,
                                        stop=[stop], stream=stream, extra_body={"ignore_eos": True})
        if stream:
            chunks = list(res)
            text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, reason = res.choices[0].text, res.choices[0].finish_reason
        assert text == want and stop not in text and reason == "stop"


def test_logprobs(client):
    chat = _chat(client, PROMPTS[0], max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)   # greedy picks the best

    comp = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == comp.usage.completion_tokens
    assert lp.text_offset == sorted(lp.text_offset) and all(1 <= len(t) <= 3 for t in lp.top_logprobs)

    chunks = list(_chat(client, PROMPTS[0], max_tokens=8, temperature=0, logprobs=True, stream=True))
    streamed = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert streamed == pytest.approx([e.logprob for e in content])


def test_errors_keep_the_server_serving(server, client):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert e.value.param == "model"
    for kw, param in [({"temperature": -1}, "temperature"), ({"top_p": 2}, "top_p"),
                      ({"max_tokens": 100_000}, "max_tokens"), ({"max_tokens": 100_000, "stream": True}, "max_tokens"),
                      ({"n": 0}, "n"), ({"extra_body": {"top_k": "x"}}, "top_k")]:
        with pytest.raises(openai.BadRequestError) as e:
            res = _chat(client, "hi", **kw)
            list(res) if kw.get("stream") else None
        assert e.value.param == param, (kw, e.value.body)
    with pytest.raises(openai.BadRequestError, match="does not read images"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])

    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    for body in (b'{"model": "tiny-qwen2", "prompt": "hi", "max_tokens": ', b"not json at all", b"[1, 2]"):
        r = httpx.post(server.url + "/v1/completions", content=body, headers=headers)
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer no"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"

    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "two plus two?"}]
    ok = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": parts}], max_tokens=4)
    assert ok.usage.completion_tokens >= 1
    _wait_idle(server)


def test_64_concurrent_streams_match_solo(server, client):
    solo = {p: _chat(client, p, max_tokens=16, temperature=0).choices[0].message.content for p in PROMPTS}

    async def one(aclient, prompt):
        text = ""
        async for chunk in await aclient.chat.completions.create(
                model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=16, temperature=0,
                stream=True):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
        return prompt, text

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                                      timeout=60) as aclient:
            return await asyncio.gather(*(one(aclient, PROMPTS[i % len(PROMPTS)]) for i in range(64)))

    results = asyncio.run(main())
    assert len(results) == 64
    for prompt, text in results:
        assert text == solo[prompt]
    _wait_idle(server)


def _long_request(stream: bool) -> dict:
    return {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 480,
            "ignore_eos": True, "temperature": 0, "stream": stream}


def test_disconnect_mid_stream_frees_the_request(server):
    aborts = _metric(server, 'omnistage:request_success_total{finished_reason="abort"')
    lengths = _metric(server, 'omnistage:request_success_total{finished_reason="length"')
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/chat/completions", json=_long_request(True),
                         headers=headers) as r:
            assert r.status_code == 200
            first = next(line for line in r.iter_lines() if line.startswith("data:"))
            assert json.loads(first[5:])["object"] == "chat.completion.chunk"
    _wait_idle(server)
    assert _metric(server, "omnistage:num_requests_running") == 0
    assert _metric(server, 'omnistage:request_success_total{finished_reason="abort"') == aborts + 1
    assert _metric(server, 'omnistage:request_success_total{finished_reason="length"') == lengths


def test_disconnect_while_waiting_frees_the_request(server):
    aborts = _metric(server, 'omnistage:request_success_total{finished_reason="abort"')
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=_long_request(False), headers=headers, timeout=0.3)
    _wait_idle(server)
    assert _metric(server, 'omnistage:request_success_total{finished_reason="abort"') == aborts + 1


def test_metrics_families(server, client):
    client.completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=4)
    text = httpx.get(server.url + "/metrics").text
    for family in FAMILIES:
        assert f"omnistage:{family}" in text, family
    assert _metric(server, "omnistage:generation_tokens_total") > 0
    assert _metric(server, "omnistage:time_to_first_token_seconds_count") > 0


def test_engine_down_is_503(server):
    from fastapi.testclient import TestClient

    from omnistage.entrypoints.async_omni import AsyncOmni
    from omnistage.entrypoints.openai.api_server import build_app

    engine = AsyncOmni(server.model, device="cpu", dtype="float32", num_kv_blocks=8)
    engine.close()
    with TestClient(build_app(engine, NAME)) as http:
        assert http.get("/health").status_code == 503
        r = http.post("/v1/completions", json={"model": NAME, "prompt": "hi"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def test_reset_prefix_cache_needs_the_api_key(server):
    assert httpx.post(server.url + "/reset_prefix_cache", timeout=30).status_code == 401
    ok = httpx.post(server.url + "/reset_prefix_cache", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert ok.status_code == 200
