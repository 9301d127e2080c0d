"""Reference audio of a speech request (`ref_audio`, an uploaded `audio_sample`) -> decoded samples
(API-server process; blocking: the routes call it in chat_media's decoder threads).

In: what a request sends as `ref_audio`: a base64 data URL (`data:audio/wav;base64,...`), bare
base64, or an `http(s)://` URL whose host is one of the server's `--allowed-media-domains` (or a
subdomain of one); without that flag no URL is fetched. A fetched file is read with a 10 s timeout,
no redirects and at most `MAX_REF_AUDIO_BYTES`. Out: (float32 mono samples, rate) decoded by
`omnistage.io.audio.decode_audio` (WAV, FLAC, OGG, MP3) and at most `MAX_REF_AUDIO_SECONDS` long;
anything else is a 400 naming the field.
"""

from __future__ import annotations

import base64
import binascii
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Sequence

import numpy as np

from omnistage.codec.speech import MAX_REF_AUDIO_SECONDS, MAX_REF_SAMPLE_RATE
from omnistage.entrypoints.openai.errors import OpenAIError
from omnistage.io.audio import decode_audio

MAX_REF_AUDIO_BYTES = 10 * 1024 * 1024          # a reference file (upload or fetched URL) at most
FETCH_TIMEOUT_S = 10.0


def decode_reference(data: bytes, field: str) -> tuple[np.ndarray, int]:
    """Audio file bytes -> (samples, rate), within the reference caps; 400 naming `field`."""
    try:
        return decode_audio(data, max_bytes=MAX_REF_AUDIO_BYTES, max_seconds=MAX_REF_AUDIO_SECONDS,
                            max_sample_rate=MAX_REF_SAMPLE_RATE, field=field)
    except ValueError as e:
        raise OpenAIError(400, str(e), param=field) from None


def domain_allowed(host: str, allowed: Sequence[str]) -> bool:
    host = host.lower().rstrip(".")
    return any(host == d or host.endswith("." + d) for d in (a.lower().strip(".") for a in allowed) if d)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):    # a redirect could leave the allowed domains
        return None


def _fetch(url: str, field: str) -> bytes:
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(urllib.request.Request(url, headers={"User-Agent": "omnistage"}),
                         timeout=FETCH_TIMEOUT_S) as r:
            data = r.read(MAX_REF_AUDIO_BYTES + 1)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise OpenAIError(400, f"{field}: could not fetch {url[:200]!r} ({e})", param=field) from None
    if len(data) > MAX_REF_AUDIO_BYTES:
        raise OpenAIError(400, f"{field} at {url[:200]!r} is larger than {MAX_REF_AUDIO_BYTES} bytes", param=field)
    return data


def load_reference(value: Any, allowed_domains: Sequence[str] = (), field: str = "ref_audio") -> tuple[np.ndarray, int]:
    """A request's `ref_audio` string -> (samples, rate); see the module docstring."""
    if not isinstance(value, str) or not value:
        raise OpenAIError(400, f"{field} must be a base64 data URL, base64 audio or an allowed http(s) URL",
                          param=field)
    scheme = value.split(":", 1)[0].lower() if ":" in value[:8] else ""
    if scheme in ("http", "https"):
        host = urllib.parse.urlsplit(value).hostname or ""
        if not domain_allowed(host, allowed_domains):
            allowed = ", ".join(allowed_domains) if allowed_domains else "none (start the server with " \
                                                                         "--allowed-media-domains)"
            raise OpenAIError(400, f"{field}: URLs of {host[:100]!r} are not fetched; allowed domains: {allowed}",
                              param=field)
        return decode_reference(_fetch(value, field), field)
    if scheme == "data":
        if ";base64," not in value:
            raise OpenAIError(400, f"{field} must be a base64 data URL (data:audio/wav;base64,...)", param=field)
        value = value.split(";base64,", 1)[1]
    elif scheme:
        raise OpenAIError(400, f"{field}: {scheme}: URLs are not supported; send a data URL, base64 or an "
                               "http(s) URL", param=field)
    if len(value) > MAX_REF_AUDIO_BYTES * 4 // 3 + 4:
        raise OpenAIError(400, f"{field} is larger than {MAX_REF_AUDIO_BYTES} bytes", param=field)
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise OpenAIError(400, f"{field} is not valid base64", param=field) from None
    return decode_reference(data, field)
