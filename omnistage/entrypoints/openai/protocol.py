"""Request and response schemas of the OpenAI-compatible API (pydantic, API-server process).

Requests: `CompletionRequest` (/v1/completions) and `ChatCompletionRequest` (/v1/chat/completions)
with OpenAI's fields plus vLLM's extra sampling fields, `logit_bias`, and the structured-output
fields (`response_format` json_object / json_schema, vLLM's `structured_outputs`; chat also
`tools` / `tool_choice`, assistant `tool_calls` and `tool` messages). Known OpenAI / vLLM fields
the server does not implement (`UNSUPPORTED`) are a 400 naming them unless they hold their no-op
value (`best_of: 1`); other unknown fields are ignored, so newer clients keep working. Every request schema of the server derives from `RequestBody`, which refuses
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

from omnistage.params import ParamError, SamplingParams, StructuredOutputsParams

_INT64 = 2**63
# Request fields that map one to one onto SamplingParams fields.
_SHARED_FIELDS = ("n", "temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty", "top_k",
                  "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos", "skip_special_tokens",
                  "logit_bias")
_GUIDED = "vLLM's older guided_* fields are not supported; use structured_outputs"
# OpenAI / vLLM request fields not implemented -> (values that change nothing, what the 400 adds)
UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "best_of": ((None, 1), "n > 1 gives several samples"),
    "use_beam_search": ((None, False), ""),
    "length_penalty": ((None, 1, 1.0), "it applies to beam search only"),
    "include_stop_str_in_output": ((None, False), ""),
    "prompt_logprobs": ((None,), ""),
    "allowed_token_ids": ((None,), "logit_bias or structured_outputs can restrict tokens"),
    "bad_words": ((None, []), ""),
    "truncate_prompt_tokens": ((None,), ""),
    "spaces_between_special_tokens": ((None, True), ""),
    "logits_processors": ((None,), ""),
    "return_tokens_as_token_ids": ((None, False), ""),
    "priority": ((None, 0), ""),
    "guided_json": ((None,), _GUIDED), "guided_regex": ((None,), _GUIDED), "guided_choice": ((None,), _GUIDED),
    "guided_grammar": ((None,), _GUIDED), "guided_json_object": ((None,), _GUIDED),
    "guided_decoding_backend": ((None,), _GUIDED), "guided_whitespace_pattern": ((None,), _GUIDED),
    "functions": ((None,), "use tools"), "function_call": ((None,), "use tool_choice"),
    "prediction": ((None,), ""), "web_search_options": ((None,), ""), "reasoning_effort": ((None,), ""),
    "verbosity": ((None,), ""), "store": ((None, False), ""),
    "continue_final_message": ((None, False), ""), "add_generation_prompt": ((None, True), ""),
    "chat_template": ((None,), "the model's own template is used; chat_template_kwargs sets its variables"),
    "documents": ((None,), ""), "mm_processor_kwargs": ((None,), ""),
}
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")


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
    continuous_usage_stats: StrictBool = False  # with include_usage: every chunk carries the usage so far (vLLM)


class JsonSchemaFormat(RequestBody):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: Optional[str] = None                  # the schema's name (informative)
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(None, alias="schema")   # the JSON schema itself
    strict: Optional[StrictBool] = None         # the answer always follows the schema here, strict or not


class ResponseFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None   # with type json_schema


class _SamplingRequest(RequestBody):
    """Fields shared by both endpoints. None means "not given": SamplingParams' default applies.
    Unknown fields are kept (`model_extra`) only to refuse the `UNSUPPORTED` ones."""

    model_config = ConfigDict(extra="allow")

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
    logit_bias: Optional[dict[str, float]] = None   # token id (as a string) -> bias in [-100, 100]
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[dict[str, Any]] = None   # vLLM's: one of json / regex / choice / grammar / json_object

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every stream chunk (`stream_options.continuous_usage_stats` with `include_usage`)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def check_supported(self) -> None:
        """`ParamError` naming the first `UNSUPPORTED` field set to a value that would change the answer."""
        for name, value in (self.model_extra or {}).items():
            known = UNSUPPORTED.get(name)
            if known is not None and value not in known[0]:
                raise ParamError(name, f"{name} is not supported by this server" + (f"; {known[1]}" if known[1] else ""))

    def structured(self) -> Optional[StructuredOutputsParams]:
        """`response_format` or `structured_outputs` as the engine's params (None: free text)."""
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            if self.structured_outputs is not None:
                raise ParamError("structured_outputs", "structured_outputs and response_format cannot both be set")
            if fmt.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise ParamError("response_format", "response_format of type json_schema must have "
                                                    "json_schema.schema, a JSON schema object")
            return StructuredOutputsParams(json=fmt.json_schema.json_schema)
        if self.structured_outputs is None:
            return None
        unknown = [k for k in self.structured_outputs if k not in STRUCTURED_KEYS]
        if unknown:
            raise ParamError(f"structured_outputs.{unknown[0]}", f"structured_outputs.{unknown[0]} is not supported; "
                                                                 f"the keys are {', '.join(STRUCTURED_KEYS)}")
        return StructuredOutputsParams(**self.structured_outputs)

    def _sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int],
                         defaults: Optional[dict] = None,
                         structured: Optional[StructuredOutputsParams] = None) -> SamplingParams:
        """Raises `ParamError` naming the SamplingParams field (see `field_names`). `defaults`: the
        model's generation-config defaults (SamplingParams fields), under what the request sets."""
        self.check_supported()
        given = {name: getattr(self, name) for name in _SHARED_FIELDS}
        given = {k: v for k, v in given.items() if v is not None}
        return SamplingParams(**{**(defaults or {}), **given}, max_tokens=max_tokens, logprobs=logprobs,
                              structured_outputs=structured or self.structured())

    def _structured_names(self) -> dict[str, str]:
        """Engine field -> request field for a grammar that came from response_format."""
        if self.response_format is None or self.response_format.type == "text":
            return {}
        return {f"structured_outputs.{k}": "response_format" for k in ("json", "json_object")} | {
            "structured_outputs": "response_format"}


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
        return {"prompt_token_ids": "prompt"} | self._structured_names()


class ContentPart(RequestBody):
    model_config = ConfigDict(extra="allow")
    type: str                                   # "text", "image_url", "input_audio", ...
    text: Optional[str] = None


class FunctionCall(RequestBody):
    name: str
    arguments: str                              # the arguments as a JSON text (OpenAI's shape)


class ToolCall(RequestBody):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestBody):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]   # OpenAI's roles
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None  # assistant: the calls it made
    tool_call_id: Optional[str] = None          # tool: the call this message answers


class FunctionDefinition(RequestBody):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema of the arguments object
    strict: Optional[StrictBool] = None


class ToolDefinition(RequestBody):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestBody):
    name: str


class NamedToolChoice(RequestBody):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = None            # deprecated OpenAI spelling of max_completion_tokens
    max_completion_tokens: Optional[int] = None  # None: up to the context length
    logprobs: Optional[StrictBool] = False
    top_logprobs: Optional[int] = None          # alternatives per token when logprobs is true, [0, 20]
    modalities: Optional[list[str]] = None      # output modalities: ["text"] or ["text", "audio"] (speech models, cascades)
    audio: Optional[dict[str, Any]] = None      # with "audio" in modalities: {"voice": name, "format": wav | pcm | flac | mp3 | opus | aac}
    initial_codec_chunk_frames: Optional[int] = None  # with audio: codec frames of the first streamed chunk; None = by load
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[ToolDefinition]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None   # default: auto with tools
    parallel_tool_calls: Optional[StrictBool] = None   # false: at most one call per answer

    def to_sampling_params(self, defaults: Optional[dict] = None,
                           structured: Optional[StructuredOutputsParams] = None) -> SamplingParams:
        """`defaults`: the model's generation-config defaults; `structured`: the grammar of a forced tool
        call (`tool_calls.ToolPlan`), if any. None for max tokens: the engine's answer cap (the model's
        max_new_tokens), else up to the context."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs must be used with logprobs set to true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, defaults,
                                     structured)

    def field_names(self) -> dict[str, str]:
        """Engine field -> the request field the user set, for error messages."""
        names = {"logprobs": "top_logprobs", "prompt": "messages", "prompt_token_ids": "messages",
                 **self._structured_names()}
        if self.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        return names


# ---- responses --------------------------------------------------------------------------------
class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Response):
    cached_tokens: int = 0                      # prompt tokens whose KV came from the prefix cache


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None


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


class ToolCallOut(_Response):
    id: str                                     # "call_<hex>"
    type: Literal["function"] = "function"
    function: dict[str, str]                    # {"name": ..., "arguments": JSON text}


class ChatMessageOut(_Response):
    role: str = "assistant"
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCallOut]] = None   # the calls the answer makes, when tools were given
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
    # {"role": "assistant"} first, then {"content": "..."} / {"audio": {...}} / {"tool_calls": [{index, id, ...}]}
    delta: dict[str, Any]
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
