"""`POST /v1/audio/speech/batch`: many speech requests in one call (API-server event loop).

In: `{"items": [{...}, ...], ...defaults}`: 1 to `MAX_BATCH_ITEMS` items, each a `SpeechRequest`'s
fields (at least `input`), overriding the batch-level defaults (any `SpeechRequest` field but the
stream fields: a batch answers whole files). Out: `{"id", "object": "speech.batch", "results":
[{"index", "status": "succeeded", "audio_data": base64 file, "media_type", "usage"} | {"index",
"status": "failed", "error": {message, type, param, code}}], "total", "succeeded", "failed"}` in item
order. The items run concurrently (the engine batches them); a bad item fails only itself, with the
error it would get alone. A malformed batch (no items, too many, a bad default `model`) is one 4xx.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import Field, ValidationError

from omnistage.entrypoints.openai.chat_media import off_loop
from omnistage.entrypoints.openai.errors import OpenAIError, validation_error
from omnistage.entrypoints.openai.serving_images import MediaLimits, body_schema, read_body
from omnistage.entrypoints.openai.serving_speech import (
    SpeechRequest, ServingSpeech, final_audio, speech_usage,
)
from omnistage.io.audio import MEDIA_TYPES, encode_audio

MAX_BATCH_ITEMS = 32
_STREAM_FIELDS = ("stream", "stream_format")
_BODY_LIMITS = MediaLimits()


class SpeechBatchRequest(SpeechRequest):
    """The batch body's OpenAPI schema: items plus defaults (any speech field; `input` per item)."""

    input: str = ""                             # a default `input` is allowed, items usually give their own
    items: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_BATCH_ITEMS)  # one speech request each


async def _one(speech: ServingSpeech, index: int, fields: dict[str, Any]) -> dict[str, Any]:
    """One item's result entry; its error (as it would be answered alone) when it fails."""
    try:
        streamed = [k for k in _STREAM_FIELDS if fields.get(k) not in (None, False)]
        if streamed:
            raise OpenAIError(400, f"items[{index}].{streamed[0]}: a batch answers whole files; remove it",
                              param=streamed[0])
        try:
            req = SpeechRequest.model_validate(fields)
        except ValidationError as e:
            raise validation_error(e.errors()) from None
        speech.check_request(req.model, "speech")
        speech.check_text(req.input)
        speech.check_format(req.response_format)
        params = await speech.params(req)
        final = await final_audio(speech.speak(req.input, params))
        data = await off_loop(lambda: encode_audio(final.audio.samples, final.audio.sample_rate, req.response_format))
        return {"index": index, "status": "succeeded", "audio_data": base64.b64encode(data).decode(),
                "media_type": MEDIA_TYPES[req.response_format], "usage": speech_usage(final, params)}
    except OpenAIError as e:
        return {"index": index, "status": "failed", "error": e.body()["error"]}
    except Exception as e:                      # unexpected: this item fails (500's shape), the others stand
        return {"index": index, "status": "failed", "error": OpenAIError(500, f"internal error: {e!r}").body()["error"]}


async def create_batch(speech: ServingSpeech, raw: Request) -> JSONResponse:
    body, _ = await read_body(raw, _BODY_LIMITS)
    items = body.get("items")
    if not isinstance(items, list) or not 1 <= len(items) <= MAX_BATCH_ITEMS:
        got = f"{len(items)} items" if isinstance(items, list) else type(items).__name__
        raise OpenAIError(400, f"items must be a list of 1 to {MAX_BATCH_ITEMS} speech requests, got {got}",
                          param="items")
    defaults = {k: v for k, v in body.items() if k != "items"}
    speech.check_request(defaults.get("model") if isinstance(defaults.get("model"), str) else None, "speech")
    merged = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise OpenAIError(400, f"items[{i}] must be an object of speech request fields", param="items")
        merged.append({**defaults, **item})
    results = await speech.until_disconnected(
        raw, asyncio.gather(*(_one(speech, i, fields) for i, fields in enumerate(merged))))
    ok = sum(r["status"] == "succeeded" for r in results)
    return JSONResponse({"id": f"speechbatch-{uuid.uuid4().hex}", "object": "speech.batch", "results": results,
                         "total": len(results), "succeeded": ok, "failed": len(results) - ok})


def register_batch_route(app: FastAPI, speech: ServingSpeech) -> None:
    @app.post("/v1/audio/speech/batch", openapi_extra=body_schema(SpeechBatchRequest))
    async def speech_batch(raw: Request) -> JSONResponse:
        return await create_batch(speech, raw)
