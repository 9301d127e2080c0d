"""POST /v1/chat/completions (event-loop thread of the API server).

In: a `ChatCompletionRequest`; message content is a string or a list of parts, of which text
models read only the text parts (joined with newlines) and refuse media parts with a 400; models
that read media (`AsyncOmni.media_types`, e.g. Qwen2.5-Omni: image, audio and video) get image_url /
input_audio / audio_url / video_url parts decoded (`chat_media`, base64 only) and rendered off the
event loop.
The messages' text is bounded in characters first; then they go through the model's chat renderer
(`AsyncOmni.render_chat`) and the tokenizer, both in a worker thread. `chat_template_kwargs` are
variables for the template: names that `apply_chat_template` itself takes (`tokenize`,
`chat_template`, ...) are refused with a 400, and a template that fails on them says so without
Python internals. Out: a `ChatCompletionResponse` with usage, or an SSE stream of
`chat.completion.chunk`s: a role chunk per choice, content deltas, `finish_reason` on each choice's
last chunk, an optional usage chunk (with `continuous_usage_stats`, usage so far in every chunk),
then `[DONE]`. With `"modalities": ["text", "audio"]` (a
pipeline with a speech stage) the message gains `audio` and the stream `delta.audio` chunks
(`serving_speech.ChatAudio`). Logprobs use the chat shape `{content: [{token, logprob, bytes,
top_logprobs}]}`. With `tools` the template is shown them, assistant `tool_calls` (arguments
decoded to objects, as Hugging Face templates expect) and `tool` messages are rendered, and each
choice's text goes through a `tool_calls.ToolStream`: the message gains `tool_calls`, the stream
`delta.tool_calls` (`tool_calls.py` says which `tool_choice` does what).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import time
import uuid
from contextlib import aclosing
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from jinja2 import TemplateError

from omnistage.entrypoints.openai import chat_media
from omnistage.entrypoints.openai.errors import OpenAIError, bad_request
from omnistage.entrypoints.openai.protocol import (ChatChoice, ChatChoiceLogprobs, ChatCompletionChunk,
                                                   ChatCompletionRequest, ChatCompletionResponse, ChatMessage,
                                                   ChatMessageOut, ChatStreamChoice, ChatTokenLogprob,
                                                   TopLogprob)
from omnistage.entrypoints.openai.serving_engine import (DeltaTracker, OpenAIServing, clamp_logprob, usage_of)
from omnistage.entrypoints.openai.serving_speech import ChatAudio
from omnistage.entrypoints.openai.tool_calls import ToolPlan, ToolStream, tool_parser_for
from omnistage.outputs import Logprob, RequestOutput, TokenLogprobs
from omnistage.params import ParamError

logger = logging.getLogger(__name__)

# content part type -> what the model would have to read
_MEDIA_PARTS = {"image_url": "images", "input_image": "images", "image": "images", "input_audio": "audio",
                "audio_url": "audio", "audio": "audio", "video_url": "video", "video": "video"}


def _template_arguments(tokenizer) -> set[str]:
    """Names `apply_chat_template` takes itself: as chat_template_kwargs they would clash with or
    change what the server passes (the messages, `tokenize=False`, the template)."""
    method = getattr(tokenizer, "apply_chat_template", None)
    names = {"conversation", "messages", "tokenize", "chat_template", "add_generation_prompt", "return_dict"}
    if method is not None:
        names |= {p.name for p in inspect.signature(method).parameters.values()
                  if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return names


def _check_template_kwargs(kwargs: Optional[dict], tokenizer) -> None:
    if not kwargs:
        return
    reserved = _template_arguments(tokenizer)
    for key in kwargs:
        if not key.isidentifier() or key in reserved:
            raise OpenAIError(400, f"chat_template_kwargs: {key[:40]!r} cannot be set; its keys are variables of "
                                   "the chat template (identifiers such as \"enable_thinking\"), not arguments "
                                   "of the renderer", param="chat_template_kwargs")


def _text_chars(message: ChatMessage) -> int:
    content = message.content
    if isinstance(content, list):
        return sum(len(part.text or "") for part in content if part.type == "text")
    return len(content or "")


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of the GPT-2 byte-level alphabet: the printable character standing for each byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


class _TokenBytes:
    """Raw bytes of a token: exact for byte-level BPE (a token may hold part of a character)."""

    def __init__(self, engine):
        self.engine = engine                    # the tokenizer is looked up on first use
        self.byte_level: Optional[bool] = None
        self.cache: dict[int, list[int]] = {}

    def __call__(self, lp: Logprob) -> list[int]:
        found = self.cache.get(lp.token_id)
        if found is None:
            tokenizer = self.engine.tokenizer
            if self.byte_level is None:
                backend = getattr(tokenizer, "backend_tokenizer", None)
                self.byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
            found = list(lp.decoded.encode("utf-8"))
            if self.byte_level:
                piece = tokenizer.convert_ids_to_tokens(lp.token_id)
                table = _byte_decoder()
                if isinstance(piece, str) and piece and all(c in table for c in piece):
                    found = [table[c] for c in piece]
            self.cache[lp.token_id] = found
        return found


def _tool_fields(msg: ChatMessage) -> dict:
    """An assistant's `tool_calls` (arguments as objects when they are JSON) and a tool message's id."""
    out: dict = {}
    if msg.tool_calls:
        calls = []
        for call in msg.tool_calls:
            try:
                args = json.loads(call.function.arguments)
            except ValueError:
                args = call.function.arguments
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": args}})
        out["tool_calls"] = calls
    if msg.tool_call_id is not None:
        out["tool_call_id"] = msg.tool_call_id
    return out


def _delta(text: str, tools: Optional[ToolStream], final: bool) -> dict:
    if tools is None:
        return {"content": text} if text else {}
    content, calls = tools.feed(text, final)
    delta: dict = {"content": content} if content else {}
    if calls:
        delta["tool_calls"] = calls
    return delta


def _finish_reason(reason: Optional[str], tools: Optional[ToolStream]) -> Optional[str]:
    """"tool_calls" instead of "stop" when the answer made calls."""
    if reason == "stop" and tools is not None and tools.finish_reason is not None:
        return tools.finish_reason
    return reason


class ServingChat(OpenAIServing):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.token_bytes = _TokenBytes(self.engine)

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_request(req.model)
        audio = ChatAudio.from_request(self.engine, req.modalities, req.audio,   # None: text only
                                       req.initial_codec_chunk_frames)
        if audio is not None and (req.n or 1) > 1:
            raise OpenAIError(400, "n must be 1 when modalities include \"audio\"", param="n")
        if not req.messages:
            raise OpenAIError(400, "messages must not be empty", param="messages")
        self.check_prompt_chars(sum(_text_chars(m) for m in req.messages), "messages")
        _check_template_kwargs(req.chat_template_kwargs, self.engine.tokenizer)
        media = tuple(getattr(self.engine, "media_types", ()))

        def convert() -> list[dict]:
            return [self._message(m, media, f"messages[{i}]") for i, m in enumerate(req.messages)]

        # media parts are decoded in a decoder thread: the event loop keeps serving meanwhile
        messages = await chat_media.off_loop(convert) if chat_media.has_media(
            m.content for m in req.messages) else convert()
        tokenizer = self.engine.tokenizer
        plan = ToolPlan.of(req, tool_parser_for(getattr(tokenizer, "chat_template", None),
                                                getattr(self.engine, "tool_parser", None)))
        try:
            params = req.to_sampling_params(getattr(self.engine, "sampling_defaults", None), plan.grammar())
        except ValueError as e:
            raise bad_request(e, req.field_names()) from e
        prompt = await self._render(messages, req.chat_template_kwargs, plan.tools)
        prompt = await asyncio.to_thread(self.with_token_ids, prompt)
        if audio is not None:
            prompt = audio.prompt(prompt)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        gens = [self.generate(prompt, params, rid, req.field_names(), default_param="messages")]
        if req.stream:
            firsts = await self.until_disconnected(raw, self.first_outputs(gens))
            return self.sse_response(self._chunks(rid, created, req, params.n, gens, firsts, audio, plan))
        (final,) = await self.until_disconnected(raw, self.collect(gens))
        response = self._response(rid, created, req, final, plan)
        if audio is not None:
            response.choices[0].message.audio = audio.message_audio(final)
        return JSONResponse(response.model_dump())

    async def _render(self, messages: list[dict], kwargs: Optional[dict], tools: list[dict]) -> dict:
        """The model's chat renderer in a worker thread (it may run media encoders); its refusals are 400s."""
        try:
            if tools:
                return await asyncio.to_thread(self.engine.render_chat, messages, kwargs, tools)
            return await asyncio.to_thread(self.engine.render_chat, messages, kwargs)
        except ParamError as e:
            raise bad_request(e) from e
        except (TemplateError, ValueError, LookupError) as e:   # the template's own refusals, transformers' checks
            raise OpenAIError(400, f"the chat template rejected the messages: {e}", param="messages") from e
        except Exception as e:                  # e.g. a TypeError from a kwarg of the wrong type: no internals
            logger.info("chat template failed: %r", e)
            param = "chat_template_kwargs" if kwargs else "messages"
            raise OpenAIError(400, f"the chat template could not render these messages"
                                   f"{' with these chat_template_kwargs' if kwargs else ''}", param=param) from e

    @staticmethod
    def _message(msg: ChatMessage, media: tuple[str, ...] = (), field: str = "messages") -> dict:
        """Text parts joined (text models), or a list of text and decoded media parts (media models)."""
        content = msg.content
        if isinstance(content, list):
            texts, parts = [], []
            for part in content:
                if part.type == "text":
                    texts.append(part.text or "")
                    parts.append({"type": "text", "text": part.text or ""})
                elif chat_media.kind(part.type) and chat_media.kind(part.type) in media:
                    parts.append(chat_media.decode_part(part, f"{field}.content"))
                elif part.type in _MEDIA_PARTS:
                    raise OpenAIError(400, f"this model does not read {_MEDIA_PARTS[part.type]}",
                                      param="messages")
                else:
                    raise OpenAIError(400, f"content part type {part.type!r} is not supported; use \"text\"",
                                      param="messages")
            if len(parts) > len(texts):         # media present: the renderer takes the parts
                return {"role": msg.role, "content": parts, **_tool_fields(msg)}
            content = "\n".join(texts)
        return {"role": msg.role, "content": content or "", **_tool_fields(msg)}

    def _logprobs(self, entries: list[TokenLogprobs], num_top: int) -> ChatChoiceLogprobs:
        def top(lp: Logprob) -> TopLogprob:
            return TopLogprob(token=lp.decoded, logprob=clamp_logprob(lp.logprob), bytes=self.token_bytes(lp))

        return ChatChoiceLogprobs(content=[
            ChatTokenLogprob(token=e.chosen.decoded, logprob=clamp_logprob(e.chosen.logprob),
                             bytes=self.token_bytes(e.chosen), top_logprobs=[top(alt) for alt in e.top[:num_top]])
            for e in entries])

    def _response(self, rid: str, created: int, req: ChatCompletionRequest, final: RequestOutput,
                  plan: ToolPlan) -> ChatCompletionResponse:
        choices = []
        for comp in final.outputs:
            message, finish = ChatMessageOut(content=comp.text), comp.finish_reason
            tools = plan.stream()
            if tools is not None:
                content, _ = tools.feed(comp.text, final=True)
                message = ChatMessageOut(content=content or (None if tools.called else ""),
                                         tool_calls=list(tools.calls) or None)
                finish = _finish_reason(finish, tools)
            choices.append(ChatChoice(
                index=comp.index, message=message,
                logprobs=self._logprobs(comp.logprobs or [], req.top_logprobs or 0) if req.logprobs else None,
                finish_reason=finish, stop_reason=comp.stop_reason))
        choices.sort(key=lambda c: c.index)
        return ChatCompletionResponse(id=rid, created=created, model=self.served_model_name, choices=choices,
                                      usage=usage_of([final]))

    async def _chunks(self, rid: str, created: int, req: ChatCompletionRequest, n: int, gens: list,
                      firsts: list[RequestOutput], audio: Optional[ChatAudio] = None,
                      plan: Optional[ToolPlan] = None) -> AsyncIterator[ChatCompletionChunk]:
        def chunk(choices: list[ChatStreamChoice]) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=rid, created=created, model=self.served_model_name, choices=choices,
                                       usage=usage_of([last]) if req.continuous_usage else None)

        last: Optional[RequestOutput] = firsts[0]
        yield chunk([ChatStreamChoice(index=i, delta={"role": "assistant", "content": ""}) for i in range(n)])
        tracker = DeltaTracker(n)
        tools = {i: plan.stream() for i in range(n)} if plan is not None else {}
        async with aclosing(self.merge(gens, firsts)) as merged:
            async for _, out in merged:
                last = out
                audio_delta = audio.stream_delta(out) if audio is not None else None
                if audio_delta is not None:     # before the text chunk that may carry finish_reason
                    yield chunk([ChatStreamChoice(index=0, delta={"audio": audio_delta})])
                choices = [ChatStreamChoice(
                    index=d.index, delta=_delta(d.text, tools.get(d.index), d.finish_reason is not None),
                    logprobs=self._logprobs(d.logprobs, req.top_logprobs or 0) if req.logprobs else None,
                    finish_reason=_finish_reason(d.finish_reason, tools.get(d.index)), stop_reason=d.stop_reason)
                    for d in tracker.update(0, out)]
                if choices:
                    yield chunk(choices)
        if req.include_usage:
            final = chunk([])
            final.usage = usage_of([last])
            yield final
