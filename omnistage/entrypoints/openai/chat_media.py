"""Media content parts of chat messages -> decoded parts for models that read them (API-server process).

In: a message's content parts as the OpenAI API (and vLLM, for video) sends them:
  {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}
  {"type": "input_audio", "input_audio": {"data": "<base64>", "format": "wav"}}
  {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,..."}}
  {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,..."}}
Out: `{"type": "image", "image": PIL image}` / `{"type": "audio", "audio": (float32 samples, rate)}` /
`{"type": "video", "video": uint8 frames [T, H, W, 3], "fps": float}` (frames sampled at 2 per second
with PyAV, `omnistage.io.media.decode_video`: at most 64 frames, i.e. 32 s, of at most 1920x1080, from
at most 32 MiB), what a pipeline's chat renderer reads (`AsyncOmni.media_types` says which kinds it
takes). Only base64 payloads are accepted: remote URLs are never fetched. Bad payloads are 400s
naming the part; audio longer than 10 minutes and videos over their limits are refused from the
file's header, before anything is decoded (`omnistage.io`).

`decode_part` is CPU-bound and runs where it is called; `off_loop(fn)` runs such work (a message's
parts) in this module's small pool of decoder threads, so the event loop keeps answering (`/health`)
and at most `DECODE_THREADS` payloads are decoded at once, which bounds their memory too.
"""

from __future__ import annotations

import asyncio
import base64
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, TypeVar

from omnistage.entrypoints.openai.errors import OpenAIError
from omnistage.entrypoints.openai.serving_images import MediaLimits, decode_data_url
from omnistage.io.audio import DEFAULT_MAX_AUDIO_BYTES, decode_audio
from omnistage.io.media import DEFAULT_MAX_VIDEO_BYTES, decode_video

IMAGE_PARTS = ("image_url", "input_image")
AUDIO_PARTS = ("input_audio", "audio_url")
VIDEO_PARTS = ("video_url",)
DECODE_THREADS = 2                              # media payloads decoded at once (API-server process)

_T = TypeVar("_T")
_decoders = ThreadPoolExecutor(max_workers=DECODE_THREADS, thread_name_prefix="omnistage-media")


async def off_loop(fn: Callable[[], _T]) -> _T:
    """`fn()` in a decoder thread (its exceptions raised here)."""
    return await asyncio.get_running_loop().run_in_executor(_decoders, fn)


def has_media(parts_lists: Iterable[Any]) -> bool:
    """Whether any content (a string or a list of parts) holds a part `decode_part` decodes."""
    return any(isinstance(parts, list) and any(kind(getattr(p, "type", "")) for p in parts)
               for parts in parts_lists)


def _b64(encoded: Any, field: str, what: str, max_bytes: int) -> bytes:
    if not isinstance(encoded, str) or len(encoded) > max_bytes * 4 // 3 + 4:
        raise OpenAIError(400, f"{field} must be base64 {what} of at most {max_bytes} bytes", param=field)
    try:
        return base64.b64decode(encoded, validate=True)
    except ValueError:
        raise OpenAIError(400, f"{field} is not valid base64", param=field) from None


def _data_url(part: Any, field: str, example: str) -> str:
    """The base64 payload of a `{"url": "data:...;base64,..."}` part (what `example` shows)."""
    value = getattr(part, part.type, None)
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url:
        name = f"{field}.{part.type}.url"
        raise OpenAIError(400, f"{name} must be a base64 data URL ({example}); remote URLs are not fetched",
                          param=name)
    return url.split(";base64,", 1)[1]


def _audio(part: Any, field: str) -> tuple:
    if part.type == "input_audio":
        value = getattr(part, part.type, None)
        encoded, name = value.get("data") if isinstance(value, dict) else None, f"{field}.input_audio.data"
    else:
        encoded, name = _data_url(part, field, "data:audio/wav;base64,..."), f"{field}.audio_url.url"
    data = _b64(encoded, name, "audio", DEFAULT_MAX_AUDIO_BYTES)
    try:
        return decode_audio(data, field=name)
    except ValueError as e:
        raise OpenAIError(400, str(e), param=name) from None


def _video(part: Any, field: str) -> dict:
    name = f"{field}.{part.type}.url"
    data = _b64(_data_url(part, field, "data:video/mp4;base64,..."), name, "video", DEFAULT_MAX_VIDEO_BYTES)
    try:
        frames, fps = decode_video(data, field=name)
    except ValueError as e:
        raise OpenAIError(400, str(e), param=name) from None
    return {"type": "video", "video": frames, "fps": fps}


def decode_part(part: Any, field: str) -> dict:
    """One media part -> its decoded form (see the module docstring)."""
    if part.type in IMAGE_PARTS:
        value = getattr(part, part.type, None)
        url = value.get("url") if isinstance(value, dict) else value
        return {"type": "image", "image": decode_data_url(url, MediaLimits(), f"{field}.{part.type}.url")}
    if part.type in AUDIO_PARTS:
        return {"type": "audio", "audio": _audio(part, field)}
    if part.type in VIDEO_PARTS:
        return _video(part, field)
    raise OpenAIError(400, f"content part type {part.type!r} is not supported", param=field)


def kind(part_type: str) -> str:
    """"image" / "audio" / "video" / "" for a content part type."""
    for name, types in (("image", IMAGE_PARTS), ("audio", AUDIO_PARTS), ("video", VIDEO_PARTS)):
        if part_type in types:
            return name
    return ""
