"""`WS /v1/audio/speech/stream`: text arrives in pieces, speech goes back sentence by sentence
(API-server event loop).

Client messages (JSON text frames):
  * `{"type": "session.config", ...}`: any `SpeechRequest` field but `input` / stream fields --
    `voice`, `response_format` (or `format`): "pcm" (default) | "wav", `speed`, `task_type`,
    `language`, `instructions`, `ref_audio`, `ref_text`, ... Sticky: it applies to the sentences
    that complete after it; a bad config is an `error` and the previous one stays.
  * `{"type": "input.text", "text": "..."}`: more text; every sentence it completes
    (`codec.speech.split_sentences`) is spoken at once.
  * `{"type": "input.done"}`: the text so far is complete (its last, unterminated sentence is
    spoken too); the session stays open for more.
  * `{"type": "session.close"}`: as `input.done`, then `session.done` once everything is spoken,
    and the server closes the socket.
Server messages, per sentence in order: `{"type": "audio.start", "sentence_index", "text",
"format", "sample_rate"}`, binary frames of audio (PCM16 LE mono; "wav": a streaming WAV header
first, then PCM), `{"type": "audio.done", "sentence_index", "usage"}`; then `{"type":
"session.done", "sentences"}`; `{"type": "error", "error": {message, type, param, code}}` (with
`sentence_index` when one sentence failed: the session goes on).

Sentences start in the engine as soon as they complete (at most `MAX_SENTENCES_AHEAD` in flight;
further input waits), so the engine batches them, and their audio is sent strictly in order.
Authentication: with `--api-key`, the handshake needs `Authorization: Bearer KEY` (the API-key
middleware refuses it otherwise); no query-string key is accepted.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import aclosing
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from omnistage.codec.speech import TTSParams, split_sentences
from omnistage.entrypoints.openai.errors import OpenAIError, validation_error
from omnistage.entrypoints.openai.serving_speech import (
    MAX_INPUT_CHARS, SpeechRequest, ServingSpeech, AudioDelta, speech_usage,
)
from omnistage.io.audio import AudioStreamEncoder
from omnistage.outputs import RequestOutput

MAX_SENTENCES_AHEAD = 8                         # sentences synthesized ahead of the one being sent
WS_FORMATS = ("pcm", "wav")
_NOT_CONFIG = ("type", "input", "stream", "stream_format")


class _Sentence:
    """One sentence in flight: its engine outputs, pumped into a queue as they come."""

    def __init__(self, index: int, text: str, params: TTSParams, fmt: str):
        self.index, self.text, self.params, self.fmt = index, text, params, fmt
        self.outputs: asyncio.Queue = asyncio.Queue()   # RequestOutput ..., then None or an OpenAIError
        self.pump: Optional[asyncio.Task] = None   # the task running `run`

    async def run(self, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async with aclosing(gen) as outs:
                async for out in outs:
                    self.outputs.put_nowait(out)
            self.outputs.put_nowait(None)
        except OpenAIError as e:
            self.outputs.put_nowait(e)


class SpeechSession:
    """One WebSocket session: sticky config, the text not yet spoken, sentences in flight."""

    def __init__(self, speech: ServingSpeech, ws: WebSocket):
        self.speech, self.ws = speech, ws
        self.config: dict[str, Any] = {}        # SpeechRequest fields of the last good session.config
        self.params = TTSParams()
        self.fmt = "pcm"
        self.text = ""                          # text received that ends no sentence yet
        self.count = 0                          # sentences queued so far
        self.queue: asyncio.Queue = asyncio.Queue()     # _Sentence ..., then None after session.close
        self.slots = asyncio.Semaphore(MAX_SENTENCES_AHEAD)
        self.pumps: set[asyncio.Task] = set()   # engine streams of sentences not finished yet

    async def send_error(self, e: OpenAIError, sentence: Optional[int] = None) -> None:
        event = {"type": "error", **e.body()}
        if sentence is not None:
            event["sentence_index"] = sentence
        await self.ws.send_text(json.dumps(event))

    async def configure(self, message: dict[str, Any]) -> None:
        fields = {**self.config, **{k: v for k, v in message.items() if k not in _NOT_CONFIG}}
        if "format" in fields:
            fields["response_format"] = fields.pop("format")
        fields.setdefault("response_format", "pcm")
        try:
            req = SpeechRequest.model_validate({**fields, "input": "."})
        except ValidationError as e:
            raise validation_error(e.errors()) from None
        if req.response_format not in WS_FORMATS:
            raise OpenAIError(400, f"response_format must be one of {list(WS_FORMATS)} on this route, got "
                                   f"{req.response_format!r}", param="response_format")
        self.speech.check_request(req.model, "speech")
        self.params = await self.speech.params(req)
        self.config, self.fmt = fields, req.response_format

    async def add_text(self, text: Any, final: bool) -> None:
        if not isinstance(text, str):
            raise OpenAIError(400, "input.text needs `text`, a string", param="text")
        if len(self.text) + len(text) > MAX_INPUT_CHARS:
            raise OpenAIError(400, f"text: at most {MAX_INPUT_CHARS} characters may wait for a sentence end",
                              param="text")
        sentences, self.text = split_sentences(self.text + text, final=final)
        for sentence in sentences:
            await self.slots.acquire()          # at most MAX_SENTENCES_AHEAD in flight: input waits
            item = _Sentence(self.count, sentence, self.params, self.fmt)
            item.pump = asyncio.ensure_future(item.run(self.speech.speak(sentence, self.params)))
            self.pumps.add(item.pump)
            item.pump.add_done_callback(self.pumps.discard)
            self.count += 1
            self.queue.put_nowait(item)

    async def speak(self) -> None:
        """Sends each queued sentence's audio, in order, until the None after session.close."""
        while (item := await self.queue.get()) is not None:
            try:
                await self._send(item)
            finally:
                self.slots.release()
        await self.ws.send_text(json.dumps({"type": "session.done", "sentences": self.count}))

    async def _send(self, item: _Sentence) -> None:
        delta, encoder, final = AudioDelta(), None, None
        while (out := await item.outputs.get()) is not None:
            if isinstance(out, OpenAIError):
                await self.send_error(out, item.index)
                return
            if encoder is None and out.audio is not None:
                encoder = AudioStreamEncoder(item.fmt, out.audio.sample_rate)
                await self.ws.send_text(json.dumps({"type": "audio.start", "sentence_index": item.index,
                                                    "text": item.text, "format": item.fmt,
                                                    "sample_rate": out.audio.sample_rate}))
            chunk = delta(out)
            data = encoder.encode(chunk) if encoder is not None and chunk is not None else b""
            if out.finished and encoder is not None:
                data += encoder.finish()
            if data:
                await self.ws.send_bytes(data)
            final = out
        if encoder is None:
            await self.send_error(OpenAIError(500, "the engine ended the sentence without audio"), item.index)
            return
        await self.ws.send_text(json.dumps({"type": "audio.done", "sentence_index": item.index,
                                            "usage": speech_usage(final, item.params)}))

    async def read(self) -> None:
        """Client messages until session.close (then the None that ends `speak`)."""
        while True:
            frame = await self.ws.receive()
            if frame["type"] == "websocket.disconnect":
                raise WebSocketDisconnect(frame.get("code", 1000))
            try:
                if frame.get("text") is None:
                    raise ValueError("a binary frame")
                message = json.loads(frame["text"])
                if not isinstance(message, dict):
                    raise ValueError("not an object")
            except ValueError:
                await self.send_error(OpenAIError(400, "each message must be a JSON object with a `type`, sent as a "
                                                       "text frame"))
                continue
            kind = message.get("type")
            try:
                if kind == "session.config":
                    await self.configure(message)
                elif kind == "input.text":
                    await self.add_text(message.get("text"), final=False)
                elif kind in ("input.done", "session.close"):
                    await self.add_text("", final=True)
                    if kind == "session.close":
                        self.queue.put_nowait(None)
                        return
                else:
                    raise OpenAIError(400, f"type must be session.config, input.text, input.done or session.close, "
                                           f"got {str(kind)[:40]!r}", param="type")
            except OpenAIError as e:
                await self.send_error(e)

    def cancel(self) -> list[asyncio.Task]:
        """Aborts every sentence still in flight (the client left); returns their tasks."""
        pumps = list(self.pumps)
        for pump in pumps:
            pump.cancel()
        return pumps


async def serve_session(speech: ServingSpeech, ws: WebSocket) -> None:
    await ws.accept()
    session = SpeechSession(speech, ws)
    try:
        speech.check_request(None, "speech")
    except OpenAIError as e:
        await session.send_error(e)
        await ws.close(code=1011)
        return
    speaker = asyncio.ensure_future(session.speak())
    reader = asyncio.ensure_future(session.read())
    try:
        done, _ = await asyncio.wait({speaker, reader}, return_when=asyncio.FIRST_EXCEPTION)
        if reader in done and reader.exception() is None:
            await speaker                       # session.close: finish speaking
        for task in done:
            task.result()                       # a disconnect or error surfaces here
        await ws.close()
    except (WebSocketDisconnect, RuntimeError):  # the client left (RuntimeError: sending on a closed socket)
        pass
    finally:
        for task in (reader, speaker):
            task.cancel()
        await asyncio.gather(reader, speaker, *session.cancel(), return_exceptions=True)


def register_stream_route(app: FastAPI, speech: ServingSpeech) -> None:
    @app.websocket("/v1/audio/speech/stream")
    async def speech_stream(ws: WebSocket) -> None:
        await serve_session(speech, ws)
