"""256 concurrent mixed clients for several rounds: nothing lost, no 5xx, memory flat.

The real servers on loopback (uvicorn threads of this process): a tiny random LM cascaded into the
Piper TTS stage (text completions, streamed chat, speech) and a tiny FLUX pipeline (images). Each
round sends 256 requests at once from one asyncio client pool; the first round warms the
allocators up, and the process's resident memory after the last round must stay within a stated
bound of what it was after the first."""

import asyncio
import json

import httpx
import pytest
from live_server import live_server

pytest.importorskip("piper")

CLIENTS = 256
ROUNDS = 3
RSS_GROWTH_BOUND_MB = 150                       # after warm-up; the whole process (both servers, all models)


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.fixture(scope="module")
def servers(tiny_models, tmp_path_factory):
    from omnistage.entrypoints.async_omni import AsyncOmni
    from omnistage.entrypoints.openai.api_server import build_app
    from omnistage.testing import make_tiny

    flux_dir = make_tiny(str(tmp_path_factory.mktemp("mixed-flux")), "flux")[0]
    text = AsyncOmni(tiny_models["qwen2"], device="cpu", dtype="float32")
    image = AsyncOmni(flux_dir, device="cpu", dtype="float32")
    try:
        with live_server(build_app(text, "tiny-text")) as text_url, live_server(build_app(image, "tiny-flux")) as image_url:
            yield text_url, image_url
    finally:
        text.close()
        image.close()


async def _completion(client: httpx.AsyncClient, url: str, i: int) -> bool:
    r = await client.post(url + "/v1/completions", json={"model": "tiny-text", "prompt": f"Request {i}:",
                                                         "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    return r.status_code == 200 and len(r.json()["choices"][0]["text"]) > 0


async def _chat_stream(client: httpx.AsyncClient, url: str, i: int) -> bool:
    body = {"model": "tiny-text", "messages": [{"role": "user", "content": f"Hello {i}"}], "max_tokens": 8,
            "stream": True, "ignore_eos": True}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return False
        events = [line[5:].strip() async for line in r.aiter_lines() if line.startswith("data:")]
    chunks = [json.loads(e) for e in events[:-1]]
    return events[-1] == "[DONE]" and not any("error" in c for c in chunks) \
        and chunks[-1]["choices"][0]["finish_reason"] == "length"


async def _speech(client: httpx.AsyncClient, url: str, i: int) -> bool:
    r = await client.post(url + "/v1/audio/speech", json={"model": "tiny-text", "voice": "joe", "input": f"Call {i}.",
                                                          "response_format": "pcm"})
    return r.status_code == 200 and len(r.content) > 2 * 22050 // 10       # at least 0.1 s of audio


async def _image(client: httpx.AsyncClient, url: str, i: int) -> bool:
    r = await client.post(url + "/v1/images/generations",
                          json={"model": "tiny-flux", "prompt": f"a boat {i}", "size": "32x32", "seed": i,
                                "num_inference_steps": 2, "response_format": "b64_json"})
    return r.status_code == 200 and len(r.json()["data"]) == 1


# per 16 clients: 9 completions, 4 streamed chats, 2 speech requests, 1 image
_MIX = [_completion] * 9 + [_chat_stream] * 4 + [_speech] * 2 + [_image]


async def _round(text_url: str, image_url: str) -> list[bool]:
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        jobs = [_MIX[i % len(_MIX)](client, image_url if _MIX[i % len(_MIX)] is _image else text_url, i)
                for i in range(CLIENTS)]
        return await asyncio.gather(*jobs)


def test_256_mixed_clients_for_several_rounds_lose_nothing_and_memory_stays_flat(servers):
    text_url, image_url = servers
    after = []
    for _ in range(ROUNDS):
        results = asyncio.run(_round(text_url, image_url))
        assert sum(results) == CLIENTS, f"{CLIENTS - sum(results)} of {CLIENTS} requests failed or were lost"
        after.append(_rss_mb())
    growth = after[-1] - after[0]
    print(f"RSS after each round (MB): {[round(m) for m in after]}; growth after warm-up {growth:.0f} MB")
    assert growth < RSS_GROWTH_BOUND_MB, after
