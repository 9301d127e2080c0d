"""Speech over HTTP: /v1/audio/speech and audio in chat (API-server event loop).

`register_speech_routes(app, engine, served_model_name, metrics, options)` adds:
  * `POST /v1/audio/speech` (`SpeechRequest`): the text goes straight to the pipeline's speech stage
    (`AsyncOmni.speech_stage`, skipping any LM), or, on an omni model (Qwen2.5-Omni, Qwen3-Omni), to its thinker
    as the answer to speak (`AsyncOmni.speech`: the talker speaks exactly that text). Fields: OpenAI's plus vLLM-Omni's `task_type`,
    `language`, `ref_audio` (data URL / base64 / an allowed URL, `ref_audio.py`), `ref_text`,
    `x_vector_only_mode`, `max_new_tokens`, `initial_codec_chunk_frames`, `stream`; `voice` is a
    preset of the model (`preset_voice`: in any case for an `any_case` entry, passed on as its id) or
    an uploaded voice (`voice_store.py`, whose reference becomes `ref_audio` / `ref_text`). A field
    the model cannot honour is a 400 from its `check_params`.
    Out: the whole file (wav | pcm | flac | mp3 | opus | aac) with usage headers `x-vllm-omni-*-tokens`, or with
    `stream_format: "audio"` the same bytes streamed as sentences are synthesized, or with
    `stream: true` / `stream_format: "sse"` events `speech.audio.delta` (`audio`: base64 of the next
    bytes of that stream), a last `speech.audio.done` with usage, or `speech.audio.error`.
    Usage: input text tokens = the model's ids (Piper: phoneme ids), input audio tokens and output
    tokens = audio frames of 256 samples (of the reference, of the answer).
  * the voice routes of `serving_voices`, `WS /v1/audio/speech/stream` of `serving_speech_ws`,
    `POST /v1/audio/speech/batch` of `serving_speech_batch`, all on this module's `ServingSpeech`.
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
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import StrictBool
from sse_starlette import EventSourceResponse

from omnistage.codec.speech import MAX_CHUNK_FRAMES, TTSParams, clean_for_speech
from omnistage.entrypoints.openai.chat_media import off_loop
from omnistage.entrypoints.openai.errors import OpenAIError, bad_request
from omnistage.entrypoints.openai.protocol import RequestBody
from omnistage.entrypoints.openai.ref_audio import load_reference
from omnistage.entrypoints.openai.serving_engine import OpenAIServing
from omnistage.entrypoints.openai.voice_store import DEFAULT_MAX_VOICES, VoiceStore, default_voice_dir
from omnistage.io.audio import AUDIO_FORMATS, MEDIA_TYPES, AudioStreamEncoder, encode_audio
from omnistage.outputs import RequestOutput

MAX_INPUT_CHARS = 4096                          # OpenAI's limit for /v1/audio/speech `input`
AUDIO_TTL_S = 3600                              # `expires_at` of chat audio: nothing is stored, so it is nominal
FRAME = 256                                     # samples per "output token" in speech usage


USAGE_HEADER = "x-vllm-omni-{}-tokens"         # usage of a non-streamed answer: input, output, total, input-text, ...


@dataclass
class SpeechOptions:
    """Server options of the speech routes (`omnistage serve` flags)."""

    speaker_samples_dir: Optional[str] = None   # uploaded voices' folder; None = default_voice_dir()
    speaker_max_uploaded: int = DEFAULT_MAX_VOICES  # uploaded voices kept at most
    allowed_media_domains: tuple[str, ...] = ()  # hosts whose http(s) `ref_audio` URLs are fetched; () = none


class SpeechRequest(RequestBody):
    model: Optional[str] = None                 # None or the served model's name
    input: str                                  # text to speak, at most 4096 characters
    voice: Union[str, dict[str, Any], None] = None  # a preset or uploaded voice name, or {"id": name}; None = default
    response_format: str = "wav"                # wav | pcm (16-bit LE mono) | flac | mp3 | opus (Ogg) | aac (ADTS)
    speed: float = 1.0                          # [0.25, 4.0]
    instructions: Optional[str] = None          # style prompt; VoiceDesign: the voice's description
    stream: StrictBool = False                  # true: stream (SSE events unless stream_format says "audio")
    stream_format: Optional[str] = None         # None = one file (or SSE with stream); "audio" = byte stream; "sse"
    task_type: Optional[str] = None             # CustomVoice | VoiceDesign | Base; None = the model's default
    language: Optional[str] = None              # "Auto" or a language the model lists
    ref_audio: Optional[str] = None             # voice to clone: data URL, base64, or an allowed http(s) URL
    ref_text: Optional[str] = None              # transcript of ref_audio
    x_vector_only_mode: Optional[StrictBool] = None  # clone from the speaker embedding alone
    max_new_tokens: Optional[int] = None        # codec frames at most
    initial_codec_chunk_frames: Optional[int] = None  # codec frames of the first streamed chunk


def speech_usage(out: Optional[RequestOutput], params: Optional[TTSParams]) -> dict[str, Any]:
    """Usage of one answer: text and reference-audio input tokens, audio frames out."""
    text = len(out.prompt_token_ids) if out is not None else 0
    audio_in = len(params.ref_audio[0]) // FRAME if params is not None and params.ref_audio is not None else 0
    frames = len(out.audio.samples) // FRAME if out is not None and out.audio is not None else 0
    return {"input_tokens": text + audio_in, "output_tokens": frames, "total_tokens": text + audio_in + frames,
            "input_token_details": {"text_tokens": text, "audio_tokens": audio_in}}


def usage_headers(usage: dict[str, Any]) -> dict[str, str]:
    details = usage["input_token_details"]
    return {USAGE_HEADER.format("input"): str(usage["input_tokens"]),
            USAGE_HEADER.format("output"): str(usage["output_tokens"]),
            USAGE_HEADER.format("total"): str(usage["total_tokens"]),
            USAGE_HEADER.format("input-text"): str(details["text_tokens"]),
            USAGE_HEADER.format("input-audio"): str(details["audio_tokens"])}


def _voice_name(voice: Any, field: str = "voice") -> Optional[str]:
    if isinstance(voice, dict):
        voice = voice.get("id")
    if voice is not None and not isinstance(voice, str):
        raise OpenAIError(400, f"{field} must be a voice name or {{\"id\": name}}", param=field)
    return voice


def preset_voice(engine: Any, voice: Optional[str]) -> Optional[str]:
    """The id of the model's preset voice that `voice` names, or None: the same id, or the same
    name in any case for an entry marked `any_case` (a model that looks its speakers up so)."""
    if voice is None:
        return None
    for v in engine.voices():
        if v["id"] == voice or (v.get("any_case") and v["id"].lower() == voice.lower()):
            return v["id"]
    return None


def _check_voice(engine: Any, voice: Optional[str], field: str = "voice") -> Optional[str]:
    """The preset id of `voice` (None = the model's default); a 400 naming `field` for an unknown one."""
    preset = preset_voice(engine, voice)
    if voice is not None and preset is None:
        names = [v["id"] for v in engine.voices()]
        raise OpenAIError(400, f"{field} must be one of {names}, got {voice[:40]!r}", param=field)
    return preset


class AudioDelta:
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
    """The first output with audio (or the last one): what a stream's header (its sample rate) needs;
    an omni pipeline's first outputs are the thinker's, without audio."""
    try:
        out = await gen.__anext__()
        while out.audio is None and not out.finished:
            out = await gen.__anext__()
        return out
    except StopAsyncIteration:
        raise OpenAIError(500, "the engine ended the request without output") from None


async def final_audio(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    final = None
    async with aclosing(gen) as outs:
        async for final in outs:
            pass
    if final is None or final.audio is None:
        raise OpenAIError(500, "the engine ended the request without audio")
    return final


class ServingSpeech(OpenAIServing):
    def __init__(self, engine: Any, served_model_name: str, metrics: Any = None,
                 options: Optional[SpeechOptions] = None):
        super().__init__(engine, served_model_name, metrics)
        self.options = options or SpeechOptions()
        self.voices = VoiceStore(self.options.speaker_samples_dir or default_voice_dir(),
                                 self.options.speaker_max_uploaded)

    def check_text(self, text: Any, param: str = "input") -> None:
        if not isinstance(text, str) or not text.strip() or len(text) > MAX_INPUT_CHARS:
            size = len(text) if isinstance(text, str) else 0
            raise OpenAIError(400, f"{param} must be 1 to {MAX_INPUT_CHARS} characters, got {size}", param=param)
        if "\x00" in text:                     # never text (a C-string end): refused, not silently dropped
            raise OpenAIError(400, f"{param} must not contain NUL (U+0000) characters; found one at "
                                   f"{text.index(chr(0))}", param=param)
        if not clean_for_speech(text):          # only control characters, markdown marks, unencodable ones
            raise OpenAIError(400, f"{param} must contain speakable text; it has only control, formatting or "
                                   "unencodable characters", param=param)

    def check_format(self, fmt: str) -> None:
        if fmt not in AUDIO_FORMATS:
            raise OpenAIError(400, f"response_format must be one of {', '.join(AUDIO_FORMATS)}, got "
                                   f"{fmt!r}", param="response_format")

    def stream_kind(self, req: SpeechRequest) -> Optional[str]:
        """None (one file), "audio" (byte stream) or "sse" (events)."""
        if req.stream_format not in (None, "audio", "sse"):
            raise OpenAIError(400, f"stream_format must be \"audio\" or \"sse\", got {req.stream_format!r}",
                              param="stream_format")
        return req.stream_format or ("sse" if req.stream else None)

    async def params(self, req: SpeechRequest) -> TTSParams:
        """The request's `TTSParams`: its voice resolved (a preset, or an uploaded voice's reference),
        `ref_audio` decoded off the event loop; 400 naming the field for what is malformed."""
        voice = _voice_name(req.voice)
        ref_audio, ref_text, task = None, req.ref_text, req.task_type
        preset = preset_voice(self.engine, voice)
        if voice is not None and preset is None:
            presets = [v["id"] for v in self.engine.voices()]
            if self.voices.get(voice) is None:
                raise OpenAIError(400, f"voice must be one of {presets + self.voices.names()}, got {voice[:40]!r}",
                                  param="voice")
            if req.ref_audio is None:
                found = await off_loop(lambda: self.voices.reference(voice))
                if found is None:
                    raise OpenAIError(400, f"voice {voice!r} was just deleted", param="voice")
                ref_audio, ref_text, task = (found[0], found[1]), ref_text or found[2], task or "Base"
        elif preset is not None:
            voice = preset
        if req.ref_audio is not None:
            ref_audio = await off_loop(lambda: load_reference(req.ref_audio, self.options.allowed_media_domains))
        try:
            params = TTSParams(voice=voice, speed=req.speed, instructions=req.instructions, task_type=task,
                               language=req.language, ref_audio=ref_audio, ref_text=ref_text,
                               x_vector_only_mode=bool(req.x_vector_only_mode), max_new_tokens=req.max_new_tokens,
                               initial_codec_chunk_frames=req.initial_codec_chunk_frames)
            self.check_params(params)
        except ValueError as e:
            raise bad_request(e) from e
        return params

    def check_params(self, params: TTSParams) -> None:
        """The speech stage's own check (its capabilities: voices, task types, languages, fields), or
        the read-aloud model's, at once, so a WebSocket session's config is refused when it is sent;
        raises ParamError."""
        self.engine.speech.check(params)

    def speak(self, text: str, params: TTSParams, request_id: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        """The pipeline's cumulative outputs for speaking `text`: through the speech stage, or read
        aloud by an omni model (its thinker fed the text as its answer, `AsyncOmni.speech`)."""
        try:
            prompt, stage_params, entry = self.engine.speech.request(text, params)
        except ValueError as e:
            raise bad_request(e) from e
        return self.generate(prompt, stage_params, request_id or f"speech-{uuid.uuid4().hex}", default_param="input",
                             entry_stage=entry)

    async def create(self, req: SpeechRequest, raw: Request) -> Response:
        self.check_request(req.model, "speech")
        self.check_text(req.input)
        self.check_format(req.response_format)
        kind = self.stream_kind(req)
        params = await self.params(req)
        gen = self.speak(req.input, params)
        # Until the response starts, a client that leaves cancels the synthesis (counted as an abort);
        # errors become 4xx / 5xx before any byte is sent.
        if kind is None:
            final = await self.until_disconnected(raw, final_audio(gen))
            audio = final.audio
            return Response(encode_audio(audio.samples, audio.sample_rate, req.response_format),
                            media_type=MEDIA_TYPES[req.response_format],
                            headers=usage_headers(speech_usage(final, params)))
        first = await self.until_disconnected(raw, _first(gen))
        pieces = self._byte_pieces(first, gen, req.response_format)
        if kind == "audio":
            return StreamingResponse(self._raw(pieces), media_type=MEDIA_TYPES[req.response_format])
        return EventSourceResponse(self._sse(pieces, params), sep="\n")

    @staticmethod
    async def _byte_pieces(first: RequestOutput, gen: AsyncIterator[RequestOutput],
                           fmt: str) -> AsyncIterator[tuple[bytes, RequestOutput]]:
        encoder = AudioStreamEncoder(fmt, first.audio.sample_rate if first.audio else 22050)
        delta = AudioDelta()
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
    async def _sse(pieces, params: TTSParams) -> AsyncIterator[str]:
        async with aclosing(pieces) as it:
            try:
                async for data, out in it:
                    if data:
                        yield json.dumps({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
                    if out.finished:
                        yield json.dumps({"type": "speech.audio.done", "usage": speech_usage(out, params)})
            except OpenAIError as e:
                yield json.dumps({"type": "speech.audio.error", **e.body()})


class ChatAudio:
    """Audio output of one chat completion (`"modalities": ["text", "audio"]`)."""

    def __init__(self, voice: Optional[str], fmt: str, initial_codec_chunk_frames: Optional[int] = None):
        self.voice = voice
        self.fmt = fmt
        self.initial_codec_chunk_frames = initial_codec_chunk_frames   # None: the codec stage chooses by load
        self.id = f"audio_{uuid.uuid4().hex}"
        self.delta = AudioDelta()
        self.encoder: Optional[AudioStreamEncoder] = None

    @classmethod
    def from_request(cls, engine: Any, modalities: Optional[list[str]], audio: Optional[dict[str, Any]],
                     initial_codec_chunk_frames: Optional[int] = None) -> Optional["ChatAudio"]:
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
        voice = _check_voice(engine, _voice_name(audio.get("voice"), "audio.voice"), "audio.voice")
        first = initial_codec_chunk_frames
        if first is not None and (isinstance(first, bool) or not 1 <= first <= MAX_CHUNK_FRAMES):
            raise OpenAIError(400, f"initial_codec_chunk_frames must be an integer in [1, {MAX_CHUNK_FRAMES}], "
                                   f"got {first!r}", param="initial_codec_chunk_frames")
        return cls(voice, fmt, first)

    def prompt(self, prompt: dict) -> dict:
        out = {**prompt, "modalities": ["text", "audio"], "voice": self.voice}
        if self.initial_codec_chunk_frames is not None:
            out["initial_codec_chunk_frames"] = self.initial_codec_chunk_frames
        return out

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


def register_speech_routes(app: FastAPI, engine: Any, served_model_name: str, metrics: Any = None,
                           options: Optional[SpeechOptions] = None) -> ServingSpeech:
    """Adds `POST /v1/audio/speech`; returns the `ServingSpeech` that the voice, stream and batch
    routes (`api_server.build_app`) share."""
    speech = ServingSpeech(engine, served_model_name, metrics, options)

    @app.post("/v1/audio/speech")
    async def create_speech(body: SpeechRequest, raw: Request) -> Response:
        return await speech.create(body, raw)
    return speech
