"""GET /v1/capabilities per pipeline kind, over HTTP on loopback (the shared tiny servers of
conftest.py: a tiny LM cascaded into Piper, Qwen-Image, Wan 2.1; plus a tiny Qwen-Image-Edit).

What the route states is checked against what the other routes do: the voices are /v1/audio/voices,
every format and stream format it lists is accepted by /v1/audio/speech, the largest size it lists
generates and one multiple more is a 400 naming `size`, the frame and step limits are the engine's.
"""

from types import SimpleNamespace

import httpx
import pytest
from live_server import live_server

from omnistage.entrypoints.openai.capabilities import TASKS

SECTIONS = ("chat", "audio", "speech", "images", "video")


def _caps(server) -> dict:
    caps = httpx.get(server.url + "/v1/capabilities", timeout=30).json()
    assert caps["object"] == "capabilities" and caps["model"] == server.name
    assert set(caps["tasks"]) <= set(TASKS) and set(SECTIONS) <= set(caps)
    return caps


def test_cascade_llm_with_piper_offers_chat_chat_audio_and_speech(text_server):
    caps = _caps(text_server)
    assert caps["tasks"] == ["chat", "chat_audio", "speech"]
    assert caps["images"] is None and caps["video"] is None
    models = httpx.get(text_server.url + "/v1/models").json()["data"][0]
    assert caps["chat"] == {"max_model_len": models["max_model_len"], "input_media": [],
                            "output_modalities": ["text", "audio"]}
    assert caps["audio"]["voices"] == httpx.get(text_server.url + "/v1/audio/voices").json()["data"]
    speech = caps["speech"]
    assert speech["speed"] == {"min": 0.25, "max": 4.0} and speech["max_input_chars"] == 4096
    voice = caps["audio"]["voices"][0]["id"]
    for fmt in speech["formats"]:
        r = httpx.post(text_server.url + "/v1/audio/speech", timeout=120,
                       json={"input": "Hi.", "voice": voice, "response_format": fmt})
        assert r.status_code == 200 and r.content, (fmt, r.text[:200])
    for stream in speech["stream_formats"]:
        r = httpx.post(text_server.url + "/v1/audio/speech", timeout=120,
                       json={"input": "Hi.", "voice": voice, "stream_format": stream})
        assert r.status_code == 200 and r.content, (stream, r.text[:200])


def test_text_to_image_limits_are_what_the_route_enforces(image_server):
    caps = _caps(image_server)
    assert caps["tasks"] == ["image_generation"] and caps["chat"] is None and caps["speech"] is None
    img = caps["images"]
    lim = image_server.engine.orchestrator.main.limits
    assert img["generation"] and not img["edit"] and img["stream"] and img["max_n"] == 10
    assert img["steps"] == {"default": lim.default_steps, "max": 1000}
    assert (img["default_width"], img["default_height"]) == (lim.default_width, lim.default_height)
    assert img["output_formats"] == ["png", "jpeg", "webp"]
    m = img["size_multiple"]
    ok = httpx.post(image_server.url + "/v1/images/generations", timeout=120, json={
        "prompt": "a cube", "size": f"{2 * m['width']}x{m['height']}", "num_inference_steps": 1})
    assert ok.status_code == 200, ok.text
    bad = httpx.post(image_server.url + "/v1/images/generations", timeout=30, json={
        "prompt": "a cube", "size": f"{m['width'] + 1}x{m['height']}", "num_inference_steps": 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "size"
    over = httpx.post(image_server.url + "/v1/images/generations", timeout=30, json={
        "prompt": "a cube", "size": "16x16", "num_inference_steps": img["steps"]["max"] + 1})
    assert over.status_code in (400, 422) and "num_inference_steps" in over.text


def test_text_to_video_limits(video_server):
    caps = _caps(video_server)
    assert caps["tasks"] == ["video"] and caps["images"] is None
    video = caps["video"]
    lim = video_server.engine.orchestrator.main.limits
    assert video["input_reference"] == "none" and video["max_jobs"] == 16
    assert (video["max_num_frames"], video["frame_step"], video["default_fps"]) == (lim.max_num_frames, 2, 16)
    assert (video["max_width"], video["max_height"]) == (lim.max_width, lim.max_height)
    m = video["size_multiple"]
    too_long = httpx.post(video_server.url + "/v1/videos", timeout=30, json={
        "prompt": "waves", "size": f"{m['width']}x{m['height']}", "num_frames": video["max_num_frames"] + 2})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "num_frames"


@pytest.fixture(scope="module")
def edit_server(tmp_path_factory):
    from omnistage.entrypoints.async_omni import AsyncOmni
    from omnistage.entrypoints.openai.api_server import build_app
    from omnistage.testing import make_tiny

    folder = make_tiny(str(tmp_path_factory.mktemp("caps-edit")), "qwen-image-edit")[0]
    engine = AsyncOmni(folder, device="cpu", dtype="float32")
    try:
        with live_server(build_app(engine, "tiny-edit")) as url:
            yield SimpleNamespace(url=url, engine=engine, name="tiny-edit")
    finally:
        engine.close()


def test_edit_model_offers_edits_only(edit_server):
    caps = _caps(edit_server)
    assert caps["tasks"] == ["image_edit"]
    assert caps["images"]["edit"] and not caps["images"]["generation"]
    assert caps["images"]["size_multiple"] == {"width": 32, "height": 32}


def test_capabilities_need_the_api_key(text_server):
    from omnistage.entrypoints.openai.api_server import build_app

    with live_server(build_app(text_server.engine, text_server.name, api_key="k")) as url:
        assert httpx.get(url + "/v1/capabilities").status_code == 401
        r = httpx.get(url + "/v1/capabilities", headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and r.json()["tasks"] == ["chat", "chat_audio", "speech"]
        page = httpx.get(url + "/")
        assert page.status_code == 200 and "/static/app.js" in page.text
        assert "default-src 'self'" in page.headers["content-security-policy"]
        assert httpx.get(url + "/static/app.js").headers["content-type"].startswith("text/javascript")


def test_a_closed_engine_offers_nothing(tiny_models):
    from omnistage.entrypoints.async_omni import AsyncOmni
    from omnistage.entrypoints.openai.capabilities import capabilities
    from omnistage.entrypoints.openai.errors import OpenAIError
    from omnistage.entrypoints.openai.serving_images import MediaLimits

    engine = AsyncOmni(tiny_models["qwen3"], device="cpu", dtype="float32")
    assert capabilities(engine, "q", MediaLimits())["tasks"][0] == "chat"
    engine.close()
    with pytest.raises(OpenAIError) as e:
        capabilities(engine, "q", MediaLimits())
    assert e.value.status == 503 and e.value.code == "engine_dead"
