"""Servers shared by the hardening tests of this folder, built once per session: the real `build_app`
on loopback around a tiny LM with the Piper TTS stage behind it (completions, chat, speech), a tiny
Qwen-Image (images) and a tiny Wan 2.1 (videos), all on CPU in float32."""

import shutil
import tempfile
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
from live_server import live_server


@contextmanager
def serve(model_dir: str, name: str, **app_kwargs):
    """A live server for `model_dir` served as `name`; yields its url, engine and app."""
    from omnistage.entrypoints.async_omni import AsyncOmni
    from omnistage.entrypoints.openai.api_server import build_app

    from omnistage.entrypoints.openai.serving_speech import SpeechOptions

    engine = AsyncOmni(model_dir, device="cpu", dtype="float32")
    voices = tempfile.mkdtemp(prefix="omnistage-voices-")     # uploaded voices never land in ~/.cache
    app_kwargs.setdefault("speech_options", SpeechOptions(speaker_samples_dir=voices))
    try:
        app = build_app(engine, name, **app_kwargs)
        with live_server(app) as url:
            yield SimpleNamespace(url=url, engine=engine, app=app, name=name, model=model_dir)
    finally:
        engine.close()
        shutil.rmtree(voices, ignore_errors=True)


@pytest.fixture(scope="session")
def text_server(tiny_models):
    with serve(tiny_models["llama"], "tiny-llama") as s:
        yield s


@pytest.fixture(scope="session")
def diffusion_models(tmp_path_factory) -> dict[str, str]:
    from omnistage.testing import make_tiny

    out = str(tmp_path_factory.mktemp("hardening-diffusion"))
    return {kind: make_tiny(out, kind)[0] for kind in ("qwen-image", "wan")}


@pytest.fixture(scope="session")
def image_server(diffusion_models):
    with serve(diffusion_models["qwen-image"], "tiny-qwen-image") as s:
        yield s


@pytest.fixture(scope="session")
def video_server(diffusion_models):
    with serve(diffusion_models["wan"], "tiny-wan") as s:
        yield s
