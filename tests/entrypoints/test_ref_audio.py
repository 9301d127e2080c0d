"""`ref_audio` as requests send it -> decoded samples: data URLs and bare base64, and http(s) URLs
fetched only from the server's allowed domains (a real file server on loopback), with the
reference caps (length, bytes) and no redirects."""

import base64

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.responses import RedirectResponse, Response
from live_server import live_server

from omnistage.entrypoints.openai.errors import OpenAIError
from omnistage.entrypoints.openai.ref_audio import domain_allowed, load_reference
from omnistage.io.audio import encode_audio

WAV = encode_audio(np.linspace(-0.5, 0.5, 8000, dtype=np.float32), 16000, "wav")


@pytest.fixture(scope="module")
def files():
    app = FastAPI()

    @app.get("/voice.wav")
    def voice():
        return Response(WAV, media_type="audio/wav")

    @app.get("/elsewhere.wav")
    def elsewhere():
        return RedirectResponse("http://example.com/voice.wav")

    with live_server(app, timeout=120) as url:
        yield url


def _param(value, domains=()):
    with pytest.raises(OpenAIError) as e:
        load_reference(value, domains)
    assert e.value.status == 400 and e.value.param == "ref_audio"
    return e.value.message


def test_inline_references_decode_and_bad_ones_name_ref_audio():
    for value in ("data:audio/wav;base64," + base64.b64encode(WAV).decode(), base64.b64encode(WAV).decode()):
        samples, rate = load_reference(value)
        assert rate == 16000 and len(samples) == 8000 and abs(samples[-1] - 0.5) < 1e-3
    assert "base64" in _param("data:audio/wav,notbase64")
    assert "base64" in _param("%%%")
    assert "decoded" in _param(base64.b64encode(b"\x00" * 100).decode())
    assert "not supported" in _param("file:///etc/passwd")
    long = encode_audio(np.zeros(31 * 8000, np.float32), 8000, "wav")
    assert "30 seconds" in _param(base64.b64encode(long).decode())


def test_urls_are_fetched_only_from_allowed_domains_without_redirects(files):
    assert "--allowed-media-domains" in _param(files + "/voice.wav")
    assert "allowed domains: example.com" in _param(files + "/voice.wav", ("example.com",))
    samples, rate = load_reference(files + "/voice.wav", ("127.0.0.1",))
    assert rate == 16000 and len(samples) == 8000
    assert "could not fetch" in _param(files + "/elsewhere.wav", ("127.0.0.1",))
    assert "could not fetch" in _param(files + "/missing.wav", ("127.0.0.1",))
    assert domain_allowed("cdn.Example.com", ["example.com"]) and not domain_allowed("badexample.com", ["example.com"])
