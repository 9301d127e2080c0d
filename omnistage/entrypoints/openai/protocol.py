"""Request and response schemas of the OpenAI-compatible API (pydantic, API-server process).

Requests: `CompletionRequest` (/v1/completions) and `ChatCompletionRequest` (/v1/chat/completions)
with OpenAI's fields plus vLLM's extra sampling fields; unknown fields are ignored, so newer
clients keep working. Every request schema of the server derives from `RequestBody`, which refuses
text no UTF-8 encoder accepts (a lone surrogate, `\\ud800` in JSON, anywhere in a field's value)
with a 400 naming the field, before anything is stored or tokenized. Types are checked here (a
wrong type is a 400; booleans are strict, `"yes"` is not one); value ranges are checked once, by
`SamplingParams`, whose `ParamError` names the field it rejects. Responses and stream
chunks mirror OpenAI's objects; `stop_reason` (the stop string or token id that ended a choice) is
vLLM's extra.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationInfo, field_validator

from omnistage.params import ParamError, SamplingParams

_INT64 = 2**63
# Request fields that map one to one onto SamplingParams fields.
_SHARED_FIELDS = ("n", "temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty", "top_k",
                  "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos", "skip_special_tokens")


def unencodable_text(value: Any, path: str) -> Optional[str]:
    """The path (`messages[0].content`) of the first string (or dict key) in a parsed JSON value
    that UTF-8 cannot encode, i.e. one holding a lone surrogate; None when there is none. Iterative:
    deeply nested values cannot exhaust the stack."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return where
        elif isinstance(item, dict):
            for key, sub in reversed(list(item.items())):
                stack.append((sub, f"{where}.{key}" if isinstance(key, str) else where))
                stack.append((key, where))
        elif isinstance(item, (list, tuple)):
            stack.extend((sub, f"{where}[{i}]") for i, sub in reversed(list(enumerate(item))))
    return None


class RequestBody(BaseModel):
    """Base of every request schema: unknown fields ignored, unencodable text refused per field."""

    model_config = ConfigDict(extra="ignore")

    @field_validator("*", mode="before")
    @classmethod
    def _encodable(cls, value: Any, info: ValidationInfo) -> Any:
        where = unencodable_text(value, info.field_name)
        if where is not None:
            raise ValueError(f"text must be valid Unicode; {where} holds a lone surrogate (such as \\ud800)")
        return value


class StreamOptions(RequestBody):
    include_usage: StrictBool = False           # one more chunk at the end, with usage, no choices


class _SamplingRequest(RequestBody):
    """Fields shared by both endpoints. None means "not given": SamplingParams' default applies."""

    model: Optional[str] = None                 # None: the served model
    n: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = Field(None, ge=-_INT64, lt=_INT64)
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # vLLM's extra sampling fields
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Optional[int] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: Optional[StrictBool] = None
    skip_special_tokens: Optional[StrictBool] = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int],
                         defaults: Optional[dict] = None) -> SamplingParams:
        """Raises `ParamError` naming the SamplingParams field (see `field_names`). `defaults`: the
        model's generation-config defaults (SamplingParams fields), under what the request sets."""
        given = {name: getattr(self, name) for name in _SHARED_FIELDS}
        given = {k: v for k, v in given.items() if v is not None}
        return SamplingParams(**{**(defaults or {}), **given}, max_tokens=max_tokens, logprobs=logprobs)


class CompletionRequest(_SamplingRequest):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16              # OpenAI's default for completions
    logprobs: Optional[int] = None              # top alternatives per token, [0, 20]
    echo: Optional[StrictBool] = False          # not supported: a 400 when true
    suffix: Optional[str] = None                # not supported: a 400 when set

    def to_sampling_params(self, defaults: Optional[dict] = None) -> SamplingParams:
        return self._sampling_params(self.max_tokens, self.logprobs, defaults)

    def field_names(self) -> dict[str, str]:
        """Engine field -> the request field the user set, for error messages."""
        return {"prompt_token_ids": "prompt"}


class ContentPart(RequestBody):
    model_config = ConfigDict(extra="allow")
    type: str                                   # "text", "image_url", "input_audio", ...
    text: Optional[str] = None


class ChatMessage(RequestBody):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]   # OpenAI's roles
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = None            # deprecated OpenAI spelling of max_completion_tokens
    max_completion_tokens: Optional[int] = None  # None: up to the context length
    logprobs: Optional[StrictBool] = False
    top_logprobs: Optional[int] = None          # alternatives per token when logprobs is true, [0, 20]
    modalities: Optional[list[str]] = None      # output modalities: ["text"] or ["text", "audio"] (speech models, cascades)
    audio: Optional[dict[str, Any]] = None      # with "audio" in modalities: {"voice": name, "format": wav | pcm | flac}
    chat_template_kwargs: Optional[dict[str, Any]] = None

    def to_sampling_params(self, defaults: Optional[dict] = None) -> SamplingParams:
        """None for max tokens: the engine's answer cap (the model's max_new_tokens), else up to the context."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs must be used with logprobs set to true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, defaults)

    def field_names(self) -> dict[str, str]:
        """Engine field -> the request field the user set, for error messages."""
        names = {"logprobs": "top_logprobs", "prompt": "messages", "prompt_token_ids": "messages"}
        if self.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        return names


# ---- responses --------------------------------------------------------------------------------
class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "omnistage"
    max_model_len: Optional[int] = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CompletionLogProbs(_Response):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(_Response):
    content: Optional[list[ChatTokenLogprob]] = None


class ChatMessageOut(_Response):
    role: str = "assistant"
    content: Optional[str] = None
    audio: Optional[dict[str, Any]] = None      # {id, data: base64 file, expires_at, transcript} when audio was asked for


class ChatChoice(_Response):
    index: int
    message: ChatMessageOut
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatStreamChoice(_Response):
    index: int
    delta: dict[str, Any]                       # {"role": "assistant"} first, then {"content": "..."} / {"audio": {...}}
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[UsageInfo] = None
