"""What a benchmark run sends: its settings (`BenchConfig`), its prompts and its arrival times
(the `omnistage bench` process).

In: the parsed `omnistage bench` options. Out: `BenchConfig` (checked: a bad option raises
`ValueError` naming it and its allowed values), `load_prompts` -> `num_prompts` prompt texts
(random words, or the lines / JSONL records of `--dataset-path`, cycled), and `arrival_gaps` ->
seconds to wait before each request (all zero for `--request-rate inf`, else exponential gaps:
Poisson arrivals at that rate). The same seed gives the same prompts and gaps.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from typing import Optional

TASKS = ("chat", "completions", "speech", "images", "videos")
# vLLM's `--backend` names -> our task
BACKENDS = {"openai-chat": "chat", "openai-chat-omni": "chat", "openai": "completions", "vllm": "completions",
            "openai-audio-speech": "speech", "openai-images": "images", "openai-videos": "videos"}
ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "speech": "/v1/audio/speech",
             "images": "/v1/images/generations", "videos": "/v1/videos"}
SPEECH_FORMATS = ("wav", "flac", "mp3", "opus", "aac")   # formats whose length the bench can decode

# Common English words: most are one token in any BPE vocabulary, so N words are about N tokens.
_WORDS = ("the of and to in is was for on that with as by at from his her this an be had not are but "
          "or have one they which were all their there been has more when who will would no if out so "
          "said what up its about into than them can only other new some could time these two may then "
          "do first any my now such like our over man me even most made after also did many before must "
          "through back years where much your way well down should because each just those people how "
          "too little state good very make world still own see men work long get here between both life "
          "being under never day same another know while last might us great old year off come since "
          "against go came right used take three house light water river town market morning harbour "
          "voice story garden window letter street music table winter summer city road paper friend").split()


@dataclass
class BenchConfig:
    """One run's settings (the `omnistage bench` options, checked once)."""

    task: str = "chat"                          # one of TASKS
    base_url: str = "http://127.0.0.1:8000"     # the server, without /v1 (HTTP runs)
    endpoint: Optional[str] = None              # route to call; None: the task's (ENDPOINTS)
    model: Optional[str] = None                 # model id sent (HTTP; None: the server's first) / folder (offline)
    api_key: Optional[str] = None               # sent as `Authorization: Bearer KEY` when set
    num_prompts: int = 100                      # requests in the run (the test request not counted)
    max_concurrency: Optional[int] = None       # requests in flight at most; None: unbounded
    request_rate: float = math.inf              # requests per second (Poisson); inf: all at once
    random_input_len: int = 128                 # words per random prompt (about as many tokens)
    random_output_len: int = 128                # max_tokens per request (text tasks)
    dataset_path: Optional[str] = None          # .txt (a prompt per line) or .jsonl (prompt / text / input field)
    seed: int = 0                               # prompts and arrival gaps
    temperature: float = 0.0                    # text tasks
    ignore_eos: bool = False                    # text tasks: generate all random_output_len tokens
    voice: Optional[str] = None                 # speech: voice name; None: the server's default
    audio_format: str = "wav"                   # speech: response_format (SPEECH_FORMATS)
    size: Optional[str] = None                  # images / videos: "WxH"; None: the model's default
    num_inference_steps: Optional[int] = None   # images / videos: denoising steps; None: the model's default
    num_frames: Optional[int] = None            # videos: frames; None: the model's default
    poll_interval: float = 0.25                 # videos: seconds between job status reads
    timeout: float = 600.0                      # seconds one request may take
    offline: bool = False                       # run the workload through AsyncOmni in this process

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"--task must be one of {', '.join(TASKS)}, got {self.task!r}")
        for name in ("num_prompts", "random_input_len", "random_output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {self.request_rate}")
        if self.audio_format not in SPEECH_FORMATS:
            raise ValueError(f"--audio-format must be one of {', '.join(SPEECH_FORMATS)}, got {self.audio_format!r}")
        if self.size is not None:
            parts = self.size.lower().split("x")
            if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
                raise ValueError(f"--size must be WIDTHxHEIGHT, e.g. 512x512, got {self.size!r}")
        if not 0 < self.poll_interval <= 10 or not self.timeout > 0:
            raise ValueError("--poll-interval must be in (0, 10] and --timeout > 0")
        self.base_url = self.base_url.rstrip("/").removesuffix("/v1")

    @property
    def route(self) -> str:
        return self.endpoint or ENDPOINTS[self.task]

    @property
    def width_height(self) -> tuple[Optional[int], Optional[int]]:
        if self.size is None:
            return None, None
        w, h = (int(p) for p in self.size.lower().split("x"))
        return w, h


def random_prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(words)) for _ in range(n)]


def _dataset_prompts(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip()]
    if not path.endswith((".jsonl", ".json")):
        return lines
    prompts = []
    for i, line in enumerate(lines):
        record = json.loads(line)
        if isinstance(record, str):
            prompts.append(record)
            continue
        text = next((record[k] for k in ("prompt", "text", "input") if isinstance(record.get(k), str)), None)
        if text is None:
            raise ValueError(f"--dataset-path {path}: line {i + 1} has no \"prompt\", \"text\" or \"input\" string")
        prompts.append(text)
    return prompts


def load_prompts(cfg: BenchConfig) -> list[str]:
    """`num_prompts` prompts: the dataset's (cycled, in order), or random words."""
    if cfg.dataset_path is None:
        return random_prompts(cfg.num_prompts, cfg.random_input_len, cfg.seed)
    found = _dataset_prompts(cfg.dataset_path)
    if not found:
        raise ValueError(f"--dataset-path {cfg.dataset_path} holds no prompts")
    return [found[i % len(found)] for i in range(cfg.num_prompts)]


def arrival_gaps(n: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait before each of n requests: 0 for rate inf, else exponential (Poisson arrivals)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed + 1)
    return [rng.expovariate(rate) for _ in range(n)]
