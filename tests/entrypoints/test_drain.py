"""Graceful drain: `omnistage serve` as a subprocess (a tiny LM, its TTS stage in its own process)
gets SIGTERM with 32 streams in flight: every stream finishes with `[DONE]`, a new request meanwhile
gets 503 + `Connection: close`, the process exits 0 and leaves no stage process or stage folder
behind. In-process: a stream still running when `--drain-timeout` runs out is cut with an error
event, and the server stops."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

STREAMS = 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    """Pids of the processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def _stream(client: httpx.AsyncClient, url: str, started: list, i: int) -> list[str]:
    """The `data:` payloads of one streamed chat completion; marks `started[i]` at the first one."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"Tell story {i}."}], "stream": True,
            "max_tokens": 96, "ignore_eos": True, "temperature": 0}
    events = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                events.append(line[5:].strip())
                started[i] = True
    return events


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_drains_32_streams_then_exits_0_and_cleans_up(tiny_models, tmp_path):
    pytest.importorskip("piper")
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text("stages:\n  tts:\n    runner: process\n")
    tmp = tmp_path / "tmp"                      # the server's TMPDIR: its stage folders land here
    tmp.mkdir()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "omnistage.entrypoints.cli", "serve", tiny_models["llama"], "--port", str(port),
         "--device", "cpu", "--dtype", "float32", "--served-model-name", "tiny", "--deploy-config", str(deploy),
         "--drain-timeout", "120", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, encoding="utf-8",
        env={**os.environ, "TMPDIR": str(tmp), "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "server did not come up"
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        stage_pids = _children(proc.pid)
        assert stage_pids and any(n.startswith("omnistage-stage-") for n in os.listdir(tmp))

        async def scenario():
            started = [False] * STREAMS
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
                tasks = [asyncio.ensure_future(_stream(client, url, started, i)) for i in range(STREAMS)]
                while not all(started):
                    assert not any(t.done() for t in tasks), "a stream ended before SIGTERM"
                    await asyncio.sleep(0.01)
                proc.send_signal(signal.SIGTERM)
                async with httpx.AsyncClient(timeout=30) as fresh:
                    while (health := await fresh.get(url + "/health")).status_code == 200:
                        await asyncio.sleep(0.01)
                    refused = await fresh.post(url + "/v1/chat/completions", json={
                        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
                in_flight = sum(not t.done() for t in tasks)
                return health, refused, in_flight, await asyncio.gather(*tasks)

        health, refused, in_flight, streams = asyncio.run(scenario())
        assert health.status_code == 503 and health.headers["connection"] == "close"
        assert refused.status_code == 503 and refused.headers["connection"] == "close"
        assert refused.json()["error"]["code"] == "shutting_down"
        assert in_flight > 0                    # the refusals came while streams were still running
        for events in streams:
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert all("error" not in c for c in chunks), chunks[-1]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert not [p for p in stage_pids if _alive(p)], "stage processes left behind"
    assert not [n for n in os.listdir(tmp) if n.startswith("omnistage-stage-")], "stage folders left behind"


def test_streams_still_running_at_the_drain_timeout_are_cut_with_an_error_event(tiny_models):
    from omnistage.entrypoints.async_omni import AsyncOmni
    from omnistage.entrypoints.openai.api_server import build_app
    from omnistage.entrypoints.openai.drain import draining_server

    engine = AsyncOmni(tiny_models["llama"], device="cpu", dtype="float32")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = draining_server(build_app(engine, "tiny"), engine, 0.5, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    body = {"model": "tiny", "prompt": "Once", "stream": True, "max_tokens": 500, "ignore_eos": True}
    try:
        deadline = time.time() + 30
        while not server.started:
            assert time.time() < deadline and thread.is_alive()
            time.sleep(0.02)
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    events.append(line[5:].strip())
                    if len(events) == 1:
                        server.handle_exit(signal.SIGTERM, None)   # what the SIGTERM handler calls
        thread.join(timeout=30)
        assert not thread.is_alive() and not engine.is_running
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "drain timeout 0.5 s" in error["message"] and error["code"] == "engine_dead"
        assert len(events) < 500                # cut, not finished
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
        engine.close()
