"""HTTP senders of `omnistage bench`: one request to any OpenAI-compatible server, timed (bench process).

In: a `BenchConfig` and one prompt. Out: a `RequestResult`. Chat and completions stream (SSE, parsed
here: `data: {json}` lines up to `data: [DONE]`) with `stream_options.include_usage`, so TTFT is
the first chunk with text, ITL the gaps between chunks with text and the token counts come from the
usage chunk (the number of text chunks when a server sends no usage). Speech asks for a byte stream
(`stream_format: "audio"`): TTFP is the first audio byte after a WAV header, and the returned audio is
decoded for its length (the RTF's denominator). Images are one POST each (latency; no server streams
their steps). Videos are jobs: POST, then the job is polled every `poll_interval` s, recording when it
left "queued" and each `progress` it reported, and its MP4 is downloaded.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator, Optional

import httpx

from omnistage.entrypoints.bench.results import RequestResult
from omnistage.entrypoints.bench.workload import BenchConfig

_WAV_HEADER = 44                                # bytes before the first sample of a PCM16 WAV


class HTTPSender:
    """Sends the config's task to its server; one `httpx.AsyncClient` for the whole run."""

    def __init__(self, cfg: BenchConfig):
        self.cfg = cfg
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        limits = httpx.Limits(max_connections=cfg.max_concurrency or cfg.num_prompts + 1, max_keepalive_connections=64)
        self.http = httpx.AsyncClient(base_url=cfg.base_url, headers=headers, limits=limits,
                                      timeout=httpx.Timeout(cfg.timeout, connect=30.0))
        self.model: Optional[str] = cfg.model

    async def start(self) -> None:
        """Finds the model id when none was given (the server's first in /v1/models)."""
        if self.model is None:
            try:
                r = await self.http.get("/v1/models")
                r.raise_for_status()
                self.model = r.json()["data"][0]["id"]
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
                raise ValueError(f"cannot read the model id from {self.cfg.base_url}/v1/models ({e}); "
                                 "is the server up? (or pass --model)") from e

    async def close(self) -> None:
        await self.http.aclose()

    async def send(self, prompt: str) -> RequestResult:
        res = RequestResult(start=time.perf_counter())
        try:
            await asyncio.wait_for(getattr(self, f"_{self.cfg.task}")(prompt, res), self.cfg.timeout)
            res.ok = not res.error
        except asyncio.TimeoutError:
            res.error = f"timed out after {self.cfg.timeout:g} s"
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:   # a bad answer fails alone
            res.error = f"{type(e).__name__}: {e}"[:300]
        res.latency = res.latency or time.perf_counter() - res.start
        return res

    # ---- text ---------------------------------------------------------------------------------
    def _text_body(self) -> dict[str, Any]:
        cfg = self.cfg
        body = {"model": self.model, "max_tokens": cfg.random_output_len, "temperature": cfg.temperature,
                "stream": True, "stream_options": {"include_usage": True}}
        if cfg.ignore_eos:
            body["ignore_eos"] = True
        return body

    async def _chat(self, prompt: str, res: RequestResult) -> None:
        body = {**self._text_body(), "messages": [{"role": "user", "content": prompt}]}
        await self._stream_text(body, res, lambda c: (c.get("delta") or {}).get("content")
                                or (c.get("delta") or {}).get("reasoning_content"))

    async def _completions(self, prompt: str, res: RequestResult) -> None:
        await self._stream_text({**self._text_body(), "prompt": prompt}, res, lambda c: c.get("text"))

    async def _stream_text(self, body: dict, res: RequestResult, text_of) -> None:
        last, pieces, usage = None, 0, None
        async for event in self._sse(body):
            now = time.perf_counter()
            if event.get("usage"):
                usage = event["usage"]
            if any(text_of(c) for c in event.get("choices") or []):
                pieces += 1
                if last is None:
                    res.ttft = now - res.start
                else:
                    res.itl.append(now - last)
                last = now
        res.latency = time.perf_counter() - res.start
        res.output_tokens = usage["completion_tokens"] if usage else pieces
        res.prompt_tokens = usage["prompt_tokens"] if usage else 0
        if res.ttft is None:
            res.error = "the stream carried no text"

    async def _sse(self, body: dict) -> AsyncIterator[dict]:
        async with self.http.stream("POST", self.cfg.route, json=body) as r:
            if r.status_code != 200:
                raise ValueError(f"HTTP {r.status_code}: {(await r.aread())[:200].decode(errors='replace')}")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise ValueError(f"error event: {str(event['error'])[:200]}")
                yield event

    # ---- media --------------------------------------------------------------------------------
    async def _speech(self, prompt: str, res: RequestResult) -> None:
        from omnistage.io.audio_av import audio_duration

        body = {"model": self.model, "input": prompt, "response_format": self.cfg.audio_format,
                "stream_format": "audio"}
        if self.cfg.voice:
            body["voice"] = self.cfg.voice
        skip = _WAV_HEADER if self.cfg.audio_format == "wav" else 0
        data = bytearray()
        async with self.http.stream("POST", self.cfg.route, json=body) as r:
            if r.status_code != 200:
                raise ValueError(f"HTTP {r.status_code}: {(await r.aread())[:200].decode(errors='replace')}")
            async for piece in r.aiter_bytes():
                data += piece
                if res.ttfp is None and len(data) > skip:
                    res.ttfp = time.perf_counter() - res.start
        res.latency = time.perf_counter() - res.start
        res.output_bytes = len(data)
        res.audio_seconds = await asyncio.to_thread(audio_duration, bytes(data))
        if not res.audio_seconds:
            res.error = "the response held no audio"

    def _media_body(self, prompt: str) -> dict[str, Any]:
        cfg = self.cfg
        body: dict[str, Any] = {"model": self.model, "prompt": prompt}
        if cfg.size:
            body["size"] = cfg.size
        if cfg.num_inference_steps:
            body["num_inference_steps"] = cfg.num_inference_steps
        if cfg.seed is not None:
            body["seed"] = cfg.seed
        return body

    async def _images(self, prompt: str, res: RequestResult) -> None:
        r = await self.http.post(self.cfg.route, json={**self._media_body(prompt), "n": 1,
                                                        "response_format": "b64_json"})
        res.latency = time.perf_counter() - res.start
        if r.status_code != 200:
            raise ValueError(f"HTTP {r.status_code}: {r.text[:200]}")
        res.output_bytes = len(r.json()["data"][0]["b64_json"]) * 3 // 4

    async def _videos(self, prompt: str, res: RequestResult) -> None:
        body = self._media_body(prompt)
        if self.cfg.num_frames:
            body["num_frames"] = self.cfg.num_frames
        r = await self.http.post(self.cfg.route, json=body)
        if r.status_code != 200:
            raise ValueError(f"HTTP {r.status_code}: {r.text[:200]}")
        job = r.json()
        while True:
            now = time.perf_counter() - res.start
            if job["status"] != "queued" and res.queue_time is None:
                res.queue_time = now
            if not res.progress or res.progress[-1][1] != job.get("progress", 0):
                res.progress.append((now, float(job.get("progress", 0))))
            if job["status"] == "failed":
                res.error = f"job failed: {str(job.get('error'))[:200]}"
                return
            if job["status"] == "completed":
                break
            await asyncio.sleep(self.cfg.poll_interval)
            r = await self.http.get(f"{self.cfg.route}/{job['id']}")
            r.raise_for_status()
            job = r.json()
        content = await self.http.get(f"{self.cfg.route}/{job['id']}/content")
        content.raise_for_status()
        res.latency = time.perf_counter() - res.start
        res.output_bytes = len(content.content)
