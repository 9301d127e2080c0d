"""`omnistage bench` options and run loop (the bench process).

In: the command line (`add_bench_args` defines it, named as vLLM's `vllm bench serve` names its
options). Out: on stdout, the summary table (`results.format_table`); with `--out` / `--result-file`,
the summary as JSON; a progress bar on stderr. A run first sends one test request (not counted: a
server that refuses the workload fails fast, with its answer), then `num_prompts` requests, each
after its arrival gap (`--request-rate`), at most `--max-concurrency` in flight. Exit status 0 when
every request succeeded, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import sys
import time
from typing import Any

from omnistage.entrypoints.bench.results import RequestResult, format_table, summarize
from omnistage.entrypoints.bench.workload import (BACKENDS, SPEECH_FORMATS, TASKS, BenchConfig, arrival_gaps,
                                                  load_prompts)


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", default=None, choices=TASKS, help="what to send (default: chat)")
    p.add_argument("--backend", "--endpoint-type", dest="backend", default=None, choices=sorted(BACKENDS),
                   help="vLLM's name for the task (openai = completions, openai-chat = chat)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (with or without /v1)")
    p.add_argument("--endpoint", default=None, help="route to call (default: the task's, e.g. /v1/chat/completions)")
    p.add_argument("--model", default=None,
                   help="model id to send (default: the server's first); with --offline a local folder "
                        "(default: the embedded SmolLM2)")
    p.add_argument("--api-key", default=None, help="bearer key (default: $OPENAI_API_KEY or $OMNISTAGE_API_KEY)")
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send (default: 100)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no cap)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default: inf = all at once)")
    p.add_argument("--random-input-len", type=int, default=128, help="words (about tokens) per random prompt")
    p.add_argument("--random-output-len", type=int, default=128, help="max_tokens per text request")
    p.add_argument("--dataset-path", default=None, help="prompts: a .txt (one per line) or .jsonl (prompt field)")
    p.add_argument("--temperature", type=float, default=0.0, help="text tasks: sampling temperature (default: 0)")
    p.add_argument("--ignore-eos", action="store_true", help="text tasks: always generate --random-output-len tokens")
    p.add_argument("--voice", default=None, help="speech: voice name")
    p.add_argument("--audio-format", default="wav", choices=SPEECH_FORMATS, help="speech: response_format")
    p.add_argument("--size", default=None, help="images / videos: WIDTHxHEIGHT")
    p.add_argument("--num-inference-steps", type=int, default=None, help="images / videos: denoising steps")
    p.add_argument("--num-frames", type=int, default=None, help="videos: frames per clip")
    p.add_argument("--poll-interval", type=float, default=0.25, help="videos: seconds between job reads")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--out", "--result-file", dest="out", default=None, metavar="FILE.json",
                   help="write the summary as JSON here")
    p.add_argument("--save-detailed", action="store_true", help="JSON: every request's own numbers too")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.add_argument("--offline", action="store_true",
                   help="run the workload through AsyncOmni in this process (engine options as for serve)")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    if args.task and args.backend and BACKENDS[args.backend] != args.task:
        raise ValueError(f"--task {args.task} and --backend {args.backend} disagree; give one")
    task = args.task or (BACKENDS[args.backend] if args.backend else "chat")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("OMNISTAGE_API_KEY")
    names = {f.name for f in dataclasses.fields(BenchConfig)} - {"task", "api_key", "seed"}
    seed = args.seed if getattr(args, "seed", None) is not None else 0     # --seed is the engine options' one
    return BenchConfig(task=task, api_key=api_key, seed=seed,
                       **{k: getattr(args, k) for k in names if hasattr(args, k)})


class _Progress:
    """tqdm on stderr, or nothing."""

    def __init__(self, total: int, disabled: bool):
        self.bar = None
        if not disabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, file=sys.stderr, unit="req", dynamic_ncols=True)

    def update(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def run(cfg: BenchConfig, sender: Any, disable_progress: bool = False) -> tuple[list[RequestResult], float]:
    """The test request, then the run: (each request's result, the run's wall time in seconds)."""
    prompts = load_prompts(cfg)
    gaps = arrival_gaps(cfg.num_prompts, cfg.request_rate, cfg.seed)
    await sender.start()
    try:
        test = await sender.send(prompts[0])
        if not test.ok:
            raise ValueError(f"the test request failed: {test.error}")
        gate = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        progress = _Progress(cfg.num_prompts, disable_progress)

        async def one(prompt: str) -> RequestResult:
            if gate is None:
                res = await sender.send(prompt)
            else:
                async with gate:
                    res = await sender.send(prompt)
            progress.update()
            return res

        started = time.perf_counter()
        tasks = []
        for prompt, gap in zip(prompts, gaps):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.ensure_future(one(prompt)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
        progress.close()
        return list(results), duration
    finally:
        await sender.close()


def cmd_bench(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
        if cfg.offline:
            from omnistage.entrypoints.bench.offline import OfflineSender
            from omnistage.entrypoints.common import engine_kwargs_from_args

            kwargs = {"device": args.device, "dtype": args.dtype, **engine_kwargs_from_args(args)}
            sender = OfflineSender(cfg, kwargs)
        else:
            from omnistage.entrypoints.bench.client import HTTPSender

            sender = HTTPSender(cfg)
        results, duration = asyncio.run(run(cfg, sender, args.disable_tqdm))
    except (ValueError, OSError) as e:          # bad options, an unreadable dataset, a refused test request
        raise SystemExit(f"omnistage bench: {e}") from e
    config = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "api_key"}
    config["model"] = getattr(sender, "model", None) or cfg.model
    config["request_rate"] = "inf" if math.isinf(cfg.request_rate) else cfg.request_rate   # JSON has no inf
    summary = summarize(results, duration, config, args.save_detailed)
    where = "offline (AsyncOmni)" if cfg.offline else cfg.base_url
    print(format_table(summary, f"omnistage bench: {cfg.task}, {where}"))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2, default=float)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0 if summary["failed"] == 0 else 1
