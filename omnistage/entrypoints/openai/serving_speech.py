"""Speech over HTTP: /v1/audio/speech, /v1/audio/voices, and audio in chat (API-server event loop).

`register_speech_routes(app, engine, served_model_name, metrics)` adds:
  * `POST /v1/audio/speech` (`SpeechRequest`): the text goes straight to the pipeline's speech stage
    (`AsyncOmni.speech_stage`, skipping any LM). Out: the whole file (wav | pcm | flac | mp3 | opus | aac), or with
    `stream_format: "audio"` the same bytes streamed as sentences are synthesized, or with
    `stream_format: "sse"` events `speech.audio.delta` (`audio`: base64 of the next bytes of that
    stream) and a last `speech.audio.done` with usage (input tokens = phoneme ids, output tokens =
    audio frames of 256 samples).
  * `GET /v1/audio/voices`: `{"object": "list", "data": [{id, name, sample_rate, language}]}`.
`ChatAudio` is what the chat endpoint uses for `"modalities": ["text", "audio"]`: it checks the
request's `audio` options, tags the prompt with `modalities` and `voice`, and turns the cumulative
`RequestOutput.audio` into `message.audio` (base64 WAV + transcript) or `delta.audio.data` chunks.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from sse_starlette import EventSourceResponse

from omnistage.codec.speech import TTSParams, clean_for_speech
from omnistage.entrypoints.openai.errors import OpenAIError, bad_request
from omnistage.entrypoints.openai.protocol import RequestBody
from omnistage.entrypoints.openai.serving_engine import OpenAIServing
from omnistage.io.audio import AUDIO_FORMATS, MEDIA_TYPES, AudioStreamEncoder, encode_audio
from omnistage.outputs import RequestOutput

MAX_INPUT_CHARS = 4096                          # OpenAI's limit for /v1/audio/speech `input`
AUDIO_TTL_S = 3600                              # `expires_at` of chat audio: nothing is stored, so it is nominal
FRAME = 256                                     # samples per "output token" in speech usage


class SpeechRequest(RequestBody):
    model: Optional[str] = None                 # None or the served model's name
    input: str                                  # text to speak, at most 4096 characters
    voice: Union[str, dict[str, Any], None] = None  # a voice name, or {"id": name}; None = the default voice
    response_format: str = "wav"                # wav | pcm (16-bit LE mono) | flac | mp3 | opus (Ogg) | aac (ADTS)
    speed: float = 1.0                          # [0.25, 4.0]
    instructions: Optional[str] = None          # accepted; voices without style control ignore it
    stream_format: Optional[str] = None         # None = one file; "audio" = byte stream; "sse" = events


def _voice_name(voice: Any, field: str = "voice") -> Optional[str]:
    if isinstance(voice, dict):
        voice = voice.get("id")
    if voice is not None and not isinstance(voice, str):
        raise OpenAIError(400, f"{field} must be a voice name or {{\"id\": name}}", param=field)
    return voice


def _check_voice(engine: Any, voice: Optional[str], field: str = "voice") -> None:
    names = [v["id"] for v in engine.voices()]
    if voice is not None and voice not in names:
        raise OpenAIError(400, f"{field} must be one of {names}, got {voice[:40]!r}", param=field)


class _AudioDelta:
    """Cumulative audio -> the samples not sent yet."""

    def __init__(self):
        self.sent = 0

    def __call__(self, out: RequestOutput):
        if out.audio is None or len(out.audio.samples) <= self.sent:
            return None
        chunk = out.audio.samples[self.sent:]
        self.sent = len(out.audio.samples)
        return chunk


async def _first(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        raise OpenAIError(500, "the engine ended the request without output") from None


async def _final(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    final = None
    async with aclosing(gen) as outs:
        async for final in outs:
            pass
    if final is None or final.audio is None:
        raise OpenAIError(500, "the engine ended the request without audio")
    return final


class ServingSpeech(OpenAIServing):
    def _check(self, req: SpeechRequest) -> TTSParams:
        self.check_request(req.model, "speech")
        if not req.input.strip() or len(req.input) > MAX_INPUT_CHARS:
            raise OpenAIError(400, f"input must be 1 to {MAX_INPUT_CHARS} characters, got {len(req.input)}",
                              param="input")
        if "\x00" in req.input:                 # never text (a C-string end): refused, not silently dropped
            raise OpenAIError(400, f"input must not contain NUL (U+0000) characters; found one at "
                                   f"{req.input.index(chr(0))}", param="input")
        if not clean_for_speech(req.input):     # only control characters, markdown marks, unencodable ones
            raise OpenAIError(400, "input must contain speakable text; it has only control, formatting or "
                                   "unencodable characters", param="input")
        if req.response_format not in AUDIO_FORMATS:
            raise OpenAIError(400, f"response_format must be one of {', '.join(AUDIO_FORMATS)}, got "
                                   f"{req.response_format!r}", param="response_format")
        if req.stream_format not in (None, "audio", "sse"):
            raise OpenAIError(400, f"stream_format must be \"audio\" or \"sse\", got {req.stream_format!r}",
                              param="stream_format")
        voice = _voice_name(req.voice)
        _check_voice(self.engine, voice)
        try:
            return TTSParams(voice=voice, speed=req.speed, instructions=req.instructions)
        except ValueError as e:
            raise bad_request(e) from e

    async def create(self, req: SpeechRequest, raw: Request) -> Response:
        params = self._check(req)
        rid = f"speech-{uuid.uuid4().hex}"
        gen = self.generate(req.input, params, rid, default_param="input", entry_stage=self.engine.speech_stage)
        # Until the response starts, a client that leaves cancels the synthesis (counted as an abort);
        # errors become 4xx / 5xx before any byte is sent.
        if req.stream_format is None:
            audio = (await self.until_disconnected(raw, _final(gen))).audio
            return Response(encode_audio(audio.samples, audio.sample_rate, req.response_format),
                            media_type=MEDIA_TYPES[req.response_format])
        first = await self.until_disconnected(raw, _first(gen))
        pieces = self._byte_pieces(first, gen, req.response_format)
        if req.stream_format == "audio":
            return StreamingResponse(self._raw(pieces), media_type=MEDIA_TYPES[req.response_format])
        return EventSourceResponse(self._sse(pieces), sep="\n")

    @staticmethod
    async def _byte_pieces(first: RequestOutput, gen: AsyncIterator[RequestOutput],
                           fmt: str) -> AsyncIterator[tuple[bytes, RequestOutput]]:
        encoder = AudioStreamEncoder(fmt, first.audio.sample_rate if first.audio else 22050)
        delta = _AudioDelta()
        async with aclosing(gen) as rest:
            out = first
            while True:
                chunk = delta(out)
                data = encoder.encode(chunk) if chunk is not None else b""
                if out.finished:
                    data += encoder.finish()
                yield data, out
                if out.finished:
                    return
                try:
                    out = await rest.__anext__()
                except StopAsyncIteration:
                    return

    @staticmethod
    async def _raw(pieces) -> AsyncIterator[bytes]:
        async with aclosing(pieces) as it:
            async for data, _ in it:
                if data:
                    yield data

    @staticmethod
    async def _sse(pieces) -> AsyncIterator[str]:
        async with aclosing(pieces) as it:
            try:
                async for data, out in it:
                    if data:
                        yield json.dumps({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
                    if out.finished:
                        frames = len(out.audio.samples) // FRAME if out.audio is not None else 0
                        tokens = len(out.prompt_token_ids)
                        yield json.dumps({"type": "speech.audio.done", "usage": {
                            "input_tokens": tokens, "output_tokens": frames, "total_tokens": tokens + frames}})
            except OpenAIError as e:
                yield json.dumps({"type": "error", **e.body()})


class ChatAudio:
    """Audio output of one chat completion (`"modalities": ["text", "audio"]`)."""

    def __init__(self, voice: Optional[str], fmt: str):
        self.voice = voice
        self.fmt = fmt
        self.id = f"audio_{uuid.uuid4().hex}"
        self.delta = _AudioDelta()
        self.encoder: Optional[AudioStreamEncoder] = None

    @classmethod
    def from_request(cls, engine: Any, modalities: Optional[list[str]],
                     audio: Optional[dict[str, Any]]) -> Optional["ChatAudio"]:
        """None for a text-only request; a 400 for what this engine cannot produce."""
        modalities = list(modalities or ["text"])
        allowed = list(getattr(engine, "output_modalities", ["text"]))
        bad = [m for m in modalities if m not in allowed]
        if bad:
            raise OpenAIError(400, f"modalities must be a subset of {allowed}; this model does not produce "
                                   f"{', '.join(bad)}", param="modalities")
        if "audio" not in modalities:
            return None
        audio = dict(audio or {})
        fmt = audio.get("format") or "wav"
        if fmt not in AUDIO_FORMATS:
            raise OpenAIError(400, f"audio.format must be one of {', '.join(AUDIO_FORMATS)}, got {str(fmt)[:40]!r}",
                              param="audio.format")
        voice = _voice_name(audio.get("voice"), "audio.voice")
        _check_voice(engine, voice, "audio.voice")
        return cls(voice, fmt)

    def prompt(self, prompt: dict) -> dict:
        return {**prompt, "modalities": ["text", "audio"], "voice": self.voice}

    def message_audio(self, final: RequestOutput) -> Optional[dict[str, Any]]:
        """`message.audio` of a non-streamed answer: the whole file, base64, with its transcript."""
        if final.audio is None:
            return None
        data = encode_audio(final.audio.samples, final.audio.sample_rate, self.fmt)
        return {"id": self.id, "data": base64.b64encode(data).decode(), "expires_at": int(time.time()) + AUDIO_TTL_S,
                "transcript": final.outputs[0].text if final.outputs else ""}

    def stream_delta(self, out: RequestOutput) -> Optional[dict[str, Any]]:
        """`delta.audio` for the audio added since the last call (the last one carries the transcript)."""
        chunk = self.delta(out)
        if out.audio is not None and self.encoder is None:
            self.encoder = AudioStreamEncoder(self.fmt, out.audio.sample_rate)
        if self.encoder is None or (chunk is None and not out.finished):
            return None
        data = self.encoder.encode(chunk) if chunk is not None else b""
        delta: dict[str, Any] = {"id": self.id, "data": base64.b64encode(data).decode()}
        if out.finished:
            delta["data"] = base64.b64encode(data + self.encoder.finish()).decode()
            delta["expires_at"] = int(time.time()) + AUDIO_TTL_S
            delta["transcript"] = out.outputs[0].text if out.outputs else ""
        return delta


def register_speech_routes(app: FastAPI, engine: Any, served_model_name: str, metrics: Any = None) -> None:
    speech = ServingSpeech(engine, served_model_name, metrics)

    @app.post("/v1/audio/speech")
    async def create_speech(body: SpeechRequest, raw: Request) -> Response:
        return await speech.create(body, raw)

    @app.get("/v1/audio/voices")
    async def list_voices() -> JSONResponse:
        return JSONResponse({"object": "list", "data": engine.voices() if hasattr(engine, "voices") else []})

