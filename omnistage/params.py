"""Request parameters: what a user asks of one stage.

`SamplingParams` keeps vLLM's field names so callers of vLLM know it on day one; `DiffusionParams`
carries the image / video generation knobs. Both validate in `__post_init__` and raise `ValueError`
naming the field and the allowed range; the HTTP layer turns that into a 400.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Union

_GREEDY_EPS = 1e-5


def _check(cond: bool, name: str, allowed: str, value) -> None:
    if not cond:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass
class SamplingParams:
    n: int = 1                                  # completions per prompt
    temperature: float = 1.0                    # 0 means greedy
    top_p: float = 1.0                          # nucleus mass kept, (0, 1]
    top_k: int = 0                              # keep the k most likely tokens; 0 or -1 = all
    min_p: float = 0.0                          # drop tokens below min_p * p(max)
    max_tokens: Optional[int] = 16              # new tokens at most; None = up to max_model_len
    min_tokens: int = 0                         # EOS / stop ids are masked until this many tokens
    stop: Optional[Union[str, list[str]]] = None  # stop strings, never included in the text
    stop_token_ids: Optional[list[int]] = None  # extra ids that end generation (kept in token_ids)
    ignore_eos: bool = False                    # keep going past EOS
    bad_token_ids: Optional[list[int]] = None   # ids never sampled (HF suppress_tokens)
    seed: Optional[int] = None                  # per-request generator: same tokens whatever the batch
    presence_penalty: float = 0.0               # subtract once per generated token present, [-2, 2]
    frequency_penalty: float = 0.0              # subtract per occurrence in generated tokens, [-2, 2]
    repetition_penalty: float = 1.0             # HF-style over prompt + generated tokens, > 0
    logprobs: Optional[int] = None              # top alternatives per generated token, [0, 20]
    skip_special_tokens: bool = True            # drop special tokens from the text

    MAX_LOGPROBS = 20

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_token_ids = list(self.bad_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        _check(isinstance(self.n, int) and 1 <= self.n <= 128, "n", "an integer in [1, 128]", self.n)
        _check(self.temperature >= 0, "temperature", ">= 0", self.temperature)
        _check(0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "-1, 0 or a positive integer", self.top_k)
        _check(0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
               "max_tokens", "a positive integer", self.max_tokens)
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", ">= 0", self.min_tokens)
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", f"<= max_tokens ({self.max_tokens})",
                   self.min_tokens)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings", self.stop)
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]", self.presence_penalty)
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        _check(0 < self.repetition_penalty <= 2, "repetition_penalty", "in (0, 2]", self.repetition_penalty)
        _check(self.logprobs is None or 0 <= self.logprobs <= self.MAX_LOGPROBS, "logprobs",
               f"in [0, {self.MAX_LOGPROBS}]", self.logprobs)
        _check(self.seed is None or isinstance(self.seed, int), "seed", "an integer", self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def stop_hold(self) -> int:
        """Characters of streamed text held back: a stop string may still be completing in them."""
        return max(map(len, self.stop)) - 1 if self.stop else 0

    def clone(self, **changes) -> "SamplingParams":
        return replace(self, **changes)


@dataclass
class DiffusionParams:
    height: Optional[int] = None                # pixels; None = the model's default
    width: Optional[int] = None                 # pixels; None = the model's default
    num_frames: Optional[int] = None            # video models only
    fps: Optional[int] = None                   # video models only: frames per second of the MP4
    num_inference_steps: Optional[int] = None   # denoising steps; None = the model's default
    guidance_scale: Optional[float] = None      # classic CFG or embedded guidance, model-dependent
    true_cfg_scale: Optional[float] = None      # Qwen-Image style true CFG (needs a negative prompt)
    negative_prompt: Optional[str] = None
    seed: Optional[int] = None                  # torch.Generator("cpu").manual_seed(seed) semantics
    num_outputs_per_prompt: int = 1

    def __post_init__(self) -> None:
        for name in ("height", "width", "num_frames", "fps", "num_inference_steps"):
            v = getattr(self, name)
            _check(v is None or (isinstance(v, int) and v >= 1), name, "a positive integer", v)
        for name in ("guidance_scale", "true_cfg_scale"):
            v = getattr(self, name)
            _check(v is None or v >= 0, name, ">= 0", v)
        _check(isinstance(self.num_outputs_per_prompt, int) and 1 <= self.num_outputs_per_prompt <= 16,
               "num_outputs_per_prompt", "an integer in [1, 16]", self.num_outputs_per_prompt)
        _check(self.seed is None or isinstance(self.seed, int), "seed", "an integer", self.seed)

    def clone(self, **changes) -> "DiffusionParams":
        return replace(self, **changes)
