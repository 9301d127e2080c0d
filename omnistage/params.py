"""Request parameters: what a user asks of one stage.

`SamplingParams` keeps vLLM's field names so callers of vLLM know it on day one (its
`structured_outputs` is a `StructuredOutputsParams`: the grammar an answer must follow, compiled
and enforced by the AR engine, `ar/structured.py`); `DiffusionParams` carries the image / video
generation knobs. Both validate in `__post_init__` and raise `ParamError` (a
`ValueError` carrying the field's name) naming the field and the allowed range; the HTTP layer turns
that into a 400.
"""

from __future__ import annotations

import json as _json
import math
from dataclasses import dataclass, replace
from typing import Optional, Union

_GREEDY_EPS = 1e-5


class ParamError(ValueError):
    """A request parameter out of range; `field` names it as the engine knows it (the HTTP layer
    maps it to the name the user sent and answers 400)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def check_param(cond: bool, name: str, allowed: str, value) -> None:
    """Raises `ParamError` "NAME must be ALLOWED, got VALUE" unless `cond`."""
    if not cond:
        raise ParamError(name, f"{name} must be {allowed}, got {value!r}")


LOGIT_BIAS_LIMIT = 100.0                        # |bias| at most, as OpenAI allows
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """vLLM's `structured_outputs`: exactly one of the first five fields says what the answer must be."""

    json: Optional[Union[str, dict]] = None     # a JSON schema (kept as its JSON text) the answer satisfies
    regex: Optional[str] = None                 # a regular expression the whole answer matches
    choice: Optional[list[str]] = None          # the answer is exactly one of these strings
    grammar: Optional[str] = None               # an EBNF (GBNF-style) grammar whose `root` rule the answer follows
    json_object: Optional[bool] = None          # True: any JSON object (not any JSON value)
    # JSON kinds: no whitespace between elements; otherwise at most `WHITESPACE_RUN` characters per gap,
    # so a weak model cannot pad an answer with whitespace until max_tokens
    disable_any_whitespace: bool = False

    WHITESPACE_RUN = 16

    def __post_init__(self) -> None:
        field = "structured_outputs"
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        check_param(len(given) == 1, field, f"an object with exactly one of {', '.join(STRUCTURED_KINDS)}",
                    given or "none of them")
        if isinstance(self.json, dict):
            self.json = _json.dumps(self.json)
        if self.json is not None:
            check_param(isinstance(self.json, str), f"{field}.json", "a JSON schema object", type(self.json).__name__)
            try:
                schema = _json.loads(self.json)
            except ValueError:
                schema = None
            check_param(isinstance(schema, (dict, bool)), f"{field}.json", "a JSON schema object", self.json[:80])
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            check_param(v is None or (isinstance(v, str) and v != ""), f"{field}.{name}", "a non-empty string", v)
        if self.choice is not None:
            check_param(isinstance(self.choice, list) and self.choice and all(isinstance(c, str) for c in self.choice),
                        f"{field}.choice", "a non-empty list of strings", self.choice)
        check_param(self.json_object in (None, True, False), f"{field}.json_object", "true or false", self.json_object)
        check_param(isinstance(self.disable_any_whitespace, bool), f"{field}.disable_any_whitespace", "true or false",
                    self.disable_any_whitespace)

    @property
    def kind(self) -> str:
        """Which of `STRUCTURED_KINDS` this is."""
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> str:
        """Equal for requests that compile to the same grammar (the compile cache's key)."""
        return _json.dumps([self.kind, getattr(self, self.kind), self.disable_any_whitespace])


# generation_config.json keys read as request defaults (vLLM's `--generation-config auto`) -> the
# SamplingParams field each sets; `max_new_tokens` is the stage's default answer cap (see
# `EngineConfig.default_max_tokens`), not a SamplingParams field.
GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(generation_config: dict, source: str = "generation config") -> dict:
    """HF generation-config keys (those of GENERATION_CONFIG_KEYS that are set) -> SamplingParams
    field -> value, checked by SamplingParams' own rules; `source` names where they came from in
    errors. Unknown keys are ignored (a model's file carries many), None values too."""
    out = {GENERATION_CONFIG_KEYS[k]: v for k, v in generation_config.items()
           if k in GENERATION_CONFIG_KEYS and v is not None}
    try:
        SamplingParams(**out)
    except ParamError as e:
        raise ValueError(f"{source}: {e}") from None
    return out


OUTPUT_KINDS = ("cumulative", "final_only")   # SamplingParams.output_kind


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
    logit_bias: Optional[dict[int, float]] = None  # token id -> added to its logit, [-100, 100]
    structured_outputs: Optional[StructuredOutputsParams] = None  # the grammar the answer follows, or None
    # "cumulative": an output after every step; "final_only": only the finished one (the engine then
    # detokenizes once at the end unless stop strings need the text each step). `Omni.generate` sets it.
    output_kind: str = "cumulative"

    MAX_LOGPROBS = 20

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_token_ids = list(self.bad_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        check_param(isinstance(self.n, int) and 1 <= self.n <= 128, "n", "an integer in [1, 128]", self.n)
        check_param(self.temperature >= 0 and math.isfinite(self.temperature), "temperature", "a finite number >= 0",
                    self.temperature)
        check_param(0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        check_param(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "-1, 0 or a positive integer", self.top_k)
        check_param(0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        check_param(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
               "max_tokens", "a positive integer", self.max_tokens)
        check_param(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", ">= 0", self.min_tokens)
        if self.max_tokens is not None:
            check_param(self.min_tokens <= self.max_tokens, "min_tokens", f"<= max_tokens ({self.max_tokens})",
                   self.min_tokens)
        check_param(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings", self.stop)
        for name in ("stop_token_ids", "bad_token_ids"):    # the upper bound is the model's vocabulary size
            bad = [t for t in getattr(self, name) if not (isinstance(t, int) and t >= 0)]
            check_param(not bad, name, "token ids (integers >= 0)", bad[:4])
        check_param(-2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]", self.presence_penalty)
        check_param(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        check_param(0 < self.repetition_penalty <= 2, "repetition_penalty", "in (0, 2]", self.repetition_penalty)
        check_param(self.logprobs is None or 0 <= self.logprobs <= self.MAX_LOGPROBS, "logprobs",
               f"in [0, {self.MAX_LOGPROBS}]", self.logprobs)
        check_param(self.seed is None or isinstance(self.seed, int), "seed", "an integer", self.seed)
        check_param(self.output_kind in OUTPUT_KINDS, "output_kind", f"one of {list(OUTPUT_KINDS)}", self.output_kind)
        self.logit_bias = _logit_bias(self.logit_bias)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        check_param(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
                    "structured_outputs", "a StructuredOutputsParams", type(self.structured_outputs).__name__)

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


def _logit_bias(bias) -> Optional[dict[int, float]]:
    """{token id: bias} with int keys (JSON gives them as strings), or None when empty."""
    if not bias:
        return None
    check_param(isinstance(bias, dict), "logit_bias", "an object mapping token ids to numbers", bias)
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isdigit() else key
        check_param(isinstance(token, int) and not isinstance(token, bool) and token >= 0, "logit_bias",
                    "keyed by token ids (integers >= 0)", key)
        check_param(isinstance(value, (int, float)) and not isinstance(value, bool)
                    and -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT, "logit_bias",
                    f"values in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]", {key: value})
        out[token] = float(value)
    return out


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
    cache_config: Optional[dict] = None         # step-cache settings over the server's (e.g. {"rel_l1_thresh": 0.3});
    # the engine checks keys and ranges against its cache backend (config.CACHE_BACKENDS)

    def __post_init__(self) -> None:
        check_param(self.cache_config is None or isinstance(self.cache_config, dict), "cache_config",
                    "an object of cache settings", self.cache_config)
        for name in ("height", "width", "num_frames", "fps", "num_inference_steps"):
            v = getattr(self, name)
            check_param(v is None or (isinstance(v, int) and v >= 1), name, "a positive integer", v)
        for name in ("guidance_scale", "true_cfg_scale"):
            v = getattr(self, name)
            check_param(v is None or (v >= 0 and math.isfinite(v)), name, "a finite number >= 0", v)
        check_param(isinstance(self.num_outputs_per_prompt, int) and 1 <= self.num_outputs_per_prompt <= 16,
               "num_outputs_per_prompt", "an integer in [1, 16]", self.num_outputs_per_prompt)
        check_param(self.seed is None or isinstance(self.seed, int), "seed", "an integer", self.seed)

    def clone(self, **changes) -> "DiffusionParams":
        return replace(self, **changes)
