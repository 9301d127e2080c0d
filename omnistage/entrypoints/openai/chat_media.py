"""Media content parts of chat messages -> decoded parts for models that read them (API-server process).

In: a message's content parts as the OpenAI API sends them:
  {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}
  {"type": "input_audio", "input_audio": {"data": "<base64>", "format": "wav"}}
  {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,..."}}
Out: `{"type": "image", "image": PIL image}` / `{"type": "audio", "audio": (float32 samples, rate)}`,
what a pipeline's chat renderer reads (`AsyncOmni.media_types` says which kinds it takes). Only
base64 payloads are accepted: remote URLs are never fetched. Bad payloads are 400s naming the part.
"""

from __future__ import annotations

import base64
from typing import Any

from omnistage.entrypoints.openai.errors import OpenAIError
from omnistage.entrypoints.openai.serving_images import MediaLimits, decode_data_url
from omnistage.io.audio import DEFAULT_MAX_AUDIO_BYTES, decode_audio

IMAGE_PARTS = ("image_url", "input_image")
AUDIO_PARTS = ("input_audio", "audio_url")


def _b64(encoded: Any, field: str) -> bytes:
    if not isinstance(encoded, str) or len(encoded) > DEFAULT_MAX_AUDIO_BYTES * 4 // 3 + 4:
        raise OpenAIError(400, f"{field} must be base64 audio of at most {DEFAULT_MAX_AUDIO_BYTES} bytes", param=field)
    try:
        return base64.b64decode(encoded, validate=True)
    except ValueError:
        raise OpenAIError(400, f"{field} is not valid base64", param=field) from None


def _audio(part: Any, field: str) -> tuple:
    value = getattr(part, part.type, None)
    if part.type == "input_audio":
        data = _b64(value.get("data") if isinstance(value, dict) else None, f"{field}.input_audio.data")
    else:
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url:
            raise OpenAIError(400, f"{field}.audio_url.url must be a base64 data URL (data:audio/wav;base64,...); "
                                   "remote URLs are not fetched", param=field)
        data = _b64(url.split(";base64,", 1)[1], f"{field}.audio_url.url")
    try:
        return decode_audio(data, field=field)
    except ValueError as e:
        raise OpenAIError(400, str(e), param=field) from None


def decode_part(part: Any, field: str) -> dict:
    """One media part -> its decoded form (see the module docstring)."""
    if part.type in IMAGE_PARTS:
        value = getattr(part, part.type, None)
        url = value.get("url") if isinstance(value, dict) else value
        return {"type": "image", "image": decode_data_url(url, MediaLimits(), f"{field}.{part.type}.url")}
    if part.type in AUDIO_PARTS:
        return {"type": "audio", "audio": _audio(part, field)}
    raise OpenAIError(400, f"content part type {part.type!r} is not supported", param=field)


def kind(part_type: str) -> str:
    """"image" / "audio" / "" for a content part type."""
    return "image" if part_type in IMAGE_PARTS else "audio" if part_type in AUDIO_PARTS else ""
