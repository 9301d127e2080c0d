"""The voice library over HTTP: `GET / POST /v1/audio/voices`, `DELETE /v1/audio/voices/{name}`
(API-server event loop; decoding and file I/O in chat_media's decoder threads).

  * `GET /v1/audio/voices` -> `{"object": "list", "data": [...]}`: the model's preset voices
    (`engine.voices()`: Piper voices, omni speakers; `"uploaded": false`) and then the uploaded ones
    (`"uploaded": true`, with sample rate, length, ref_text, speaker_description, created_at), plus
    `"capabilities"` of the speech stage when it declares them (task types, languages, cloning;
    `CodecEngine.speech_capabilities`, read once from a stage process at its start).
  * `POST /v1/audio/voices` (multipart): `audio_sample` (an audio file, at most 10 MB and
    `MAX_REF_AUDIO_SECONDS` long), `name` (`[A-Za-z0-9][A-Za-z0-9_.-]{0,63}`, not a preset's),
    `consent` (required: the speaker's consent statement or record id, stored with the voice),
    optional `ref_text`, `speaker_description` -> 201 with the voice's entry. Stored by `VoiceStore`
    (one file per voice in `--speaker-samples-dir`, restored at restart, `--speaker-max-uploaded`).
    Any model with a speech stage takes and lists an upload; only one that clones voices can speak
    with it (others: 400 naming `voice`).
  * `DELETE /v1/audio/voices/{name}` -> `{"id", "object": "voice", "deleted": true}`; 404 unknown.
"""

from __future__ import annotations

from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from omnistage.codec.speech import MAX_REF_TEXT_CHARS
from omnistage.entrypoints.openai.chat_media import off_loop
from omnistage.entrypoints.openai.errors import OpenAIError
from omnistage.entrypoints.openai.ref_audio import MAX_REF_AUDIO_BYTES, decode_reference
from omnistage.entrypoints.openai.serving_images import MediaLimits, body_schema, read_form
from omnistage.entrypoints.openai.serving_speech import preset_voice
from omnistage.entrypoints.openai.voice_store import NAME_RE, StoredVoice

_FORM_LIMITS = MediaLimits(max_upload_bytes=MAX_REF_AUDIO_BYTES, max_upload_files=1)


class VoiceUpload(BaseModel):
    """The text fields of `POST /v1/audio/voices` (its OpenAPI schema; `audio_sample` is the file)."""

    name: str                                   # what speech requests will put in `voice`
    consent: str                                # the speaker's consent statement or record id
    ref_text: Optional[str] = None              # transcript of the sample
    speaker_description: Optional[str] = None   # free text about the speaker


_TEXT_FIELDS = {"consent": 1000, "ref_text": MAX_REF_TEXT_CHARS, "speaker_description": 1000}


def _capabilities(engine: Any) -> Any:
    """The speech stage's declared capabilities (inline or in its own process); None without any."""
    orch = getattr(engine, "orchestrator", None)
    found = orch.stage_for("audio") if orch is not None else None
    return getattr(found[1], "speech_capabilities", None) if found is not None else None


async def _upload(speech: Any, raw: Request) -> StoredVoice:
    speech.check_request(None, "speech")        # a model that speaks; whether it clones is checked at use
    fields, files = await read_form(raw, _FORM_LIMITS)
    name = fields.get("name", "")
    if not NAME_RE.match(name):
        raise OpenAIError(400, "name must be 1 to 64 letters, digits, '_', '-' or '.', starting with a letter or "
                               f"digit, got {name[:40]!r}", param="name")
    if preset_voice(speech.engine, name) is not None:
        raise OpenAIError(400, f"name {name!r} is a preset voice of this model; choose another", param="name")
    for key, most in _TEXT_FIELDS.items():
        value = fields.get(key)
        if value is not None and len(value) > most:
            raise OpenAIError(400, f"{key} must be at most {most} characters, got {len(value)}", param=key)
    if not (fields.get("consent") or "").strip():
        raise OpenAIError(400, "consent is required: the speaker's consent to clone their voice (a statement "
                               "or a consent record id)", param="consent")
    uploads = files.get("audio_sample") or []
    if len(uploads) != 1:
        raise OpenAIError(400, "audio_sample must be one uploaded audio file", param="audio_sample")
    data = await uploads[0].read(MAX_REF_AUDIO_BYTES + 1)
    if len(data) > MAX_REF_AUDIO_BYTES:
        raise OpenAIError(413, f"audio_sample is larger than the {MAX_REF_AUDIO_BYTES}-byte limit",
                          param="audio_sample")
    samples, rate = await off_loop(lambda: decode_reference(data, "audio_sample"))
    return StoredVoice(name=name, sample_rate=rate, seconds=len(samples) / rate, consent=fields["consent"],
                       ref_text=fields.get("ref_text") or None,
                       speaker_description=fields.get("speaker_description") or None, samples=samples)


def register_voice_routes(app: FastAPI, speech: Any) -> None:
    """`speech` is the app's `ServingSpeech` (its engine and `VoiceStore`)."""
    engine, store = speech.engine, speech.voices

    @app.get("/v1/audio/voices")
    async def list_voices() -> JSONResponse:
        presets = [{**v, "uploaded": False} for v in (engine.voices() if hasattr(engine, "voices") else [])]
        body: dict[str, Any] = {"object": "list", "data": presets + store.describe()}
        caps = _capabilities(engine)
        if caps is not None:
            body["capabilities"] = caps
        return JSONResponse(body)

    @app.post("/v1/audio/voices", status_code=201, openapi_extra=body_schema(VoiceUpload, ("audio_sample",)))
    async def upload_voice(raw: Request) -> JSONResponse:
        voice = await _upload(speech, raw)
        try:
            voice = await off_loop(lambda: store.add(voice))
        except ValueError as e:
            raise OpenAIError(400, str(e), param="name") from None
        return JSONResponse({**voice.describe(), "object": "voice"}, status_code=201)

    @app.delete("/v1/audio/voices/{name}")
    async def delete_voice(name: str) -> JSONResponse:
        if not await off_loop(lambda: store.delete(name)):
            raise OpenAIError(404, f"no uploaded voice is named {name[:64]!r}; uploaded: {store.names()[:20]}",
                              param="name")
        return JSONResponse({"id": name, "object": "voice", "deleted": True})
