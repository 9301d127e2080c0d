"""What third-party benchmark clients (AIPerf, vLLM's `bench serve`) expect of a server, checked on
the real server on loopback (a tiny random Llama on CPU): `usage.prompt_tokens_details.cached_tokens`
from the prefix cache, `POST /reset_prefix_cache`, `stream_options.continuous_usage_stats` and
`HEAD /metrics`."""

import json
import threading

import httpx

# about 60 tokens of the tiny tokenizer: several full KV blocks of 16 tokens
LONG = ("The harbour town woke slowly, and the market filled with voices. Fishermen sorted the night's "
        "catch while the bakers opened their doors to the first customers of the morning.")


def _completion(url: str, prompt: str = LONG, **kw) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0, **kw},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _sse(url: str, route: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", url + route, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                events.append(json.loads(line[5:]))
    return events


def _reset(url: str) -> None:
    r = httpx.post(url + "/reset_prefix_cache", timeout=60)
    assert r.status_code == 200, r.text


def test_cached_tokens_reported_and_reset_drops_them(text_server):
    url = text_server.url
    _reset(url)
    first = _completion(url)["usage"]
    assert first["prompt_tokens"] > 40 and first["prompt_tokens_details"] == {"cached_tokens": 0}
    again = _completion(url)["usage"]
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert cached % 16 == 0 and first["prompt_tokens"] - 16 <= cached < first["prompt_tokens"]
    # streamed chat reports it too, in the usage chunk
    body = {"messages": [{"role": "user", "content": LONG}], "max_tokens": 3, "temperature": 0,
            "stream_options": {"include_usage": True}}
    _sse(url, "/v1/chat/completions", body)
    usage = _sse(url, "/v1/chat/completions", body)[-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 32
    _reset(url)
    assert _completion(url)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_reset_prefix_cache_leaves_requests_in_flight_intact(text_server):
    url = text_server.url
    expected = _completion(url, max_tokens=40)["choices"][0]["text"]
    got: dict = {}

    def stream():
        got["events"] = _sse(url, "/v1/completions", {"prompt": LONG, "max_tokens": 40, "temperature": 0})

    worker = threading.Thread(target=stream)
    worker.start()
    for _ in range(5):
        _reset(url)
    worker.join(timeout=120)
    assert "".join(e["choices"][0]["text"] for e in got["events"] if e["choices"]) == expected


def test_continuous_usage_stats_put_usage_in_every_chunk(text_server):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    for route, body in (("/v1/completions", {"prompt": "The harbour town"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]})):
        events = _sse(text_server.url, route, {**body, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                                               "stream_options": opts})
        assert all(e.get("usage") for e in events)
        done = [e["usage"]["completion_tokens"] for e in events]
        assert done == sorted(done) and done[-1] == 8 and events[-1]["choices"] == []
        assert all(e["usage"]["total_tokens"] == e["usage"]["prompt_tokens"] + e["usage"]["completion_tokens"]
                   for e in events)
        # without continuous_usage_stats only the last chunk has usage
        plain = _sse(text_server.url, route, {**body, "max_tokens": 8, "temperature": 0,
                                              "stream_options": {"include_usage": True}})
        assert [bool(e.get("usage")) for e in plain] == [False] * (len(plain) - 1) + [True]


def test_head_metrics_is_200(text_server):
    r = httpx.head(text_server.url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.content == b""
    assert r.headers["content-type"].startswith("text/plain")
