"""Image and video generation end to end: the real `openai` client against uvicorn on loopback.

Three servers, one per tiny random checkpoint built through `make_tiny` (CPU, float32): Qwen-Image
for /v1/images, Wan 2.1 text-to-video and Wan image-to-video for /v1/videos. Tests talk HTTP only,
and read `engine.stats()` to check that a deleted job left the engine. Offline `Omni` on the same
folder is the reference for what the server returns.
"""

import asyncio
import base64
import io
import time
from contextlib import contextmanager
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
from live_server import live_server
from PIL import Image

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")    # the client marks videos deprecated

STEPS = {"num_inference_steps": 2}


@contextmanager
def _serve(model_dir: str, name: str, limits=None):
    from omnistage.entrypoints.async_omni import AsyncOmni
    from omnistage.entrypoints.openai.api_server import build_app

    engine = AsyncOmni(model_dir, device="cpu", dtype="float32")
    try:
        with live_server(build_app(engine, name, media_limits=limits)) as url, \
                openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60) as client:
            yield SimpleNamespace(url=url, engine=engine, client=client, name=name, model=model_dir)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from omnistage.testing import make_tiny

    out = str(tmp_path_factory.mktemp("diffusion-server"))
    return {kind: make_tiny(out, kind)[0] for kind in ("qwen-image", "wan", "wan-i2v")}


@pytest.fixture(scope="module")
def images(tiny):
    with _serve(tiny["qwen-image"], "tiny-qwen-image") as s:
        yield s


@pytest.fixture(scope="module")
def videos(tiny):
    with _serve(tiny["wan"], "tiny-wan") as s:
        yield s


@pytest.fixture(scope="module")
def i2v(tiny):
    from omnistage.entrypoints.openai.serving_images import MediaLimits

    with _serve(tiny["wan-i2v"], "tiny-wan-i2v", MediaLimits(max_upload_bytes=64 * 1024, max_video_jobs=2)) as s:
        yield s


def _pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def _png(w=40, h=24, seed=0) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def _status(fn) -> tuple[int, str]:
    with pytest.raises(openai.APIStatusError) as e:
        fn()
    return e.value.status_code, str(e.value.body.get("param") if isinstance(e.value.body, dict) else None)


def _wait(client, video_id: str, timeout=30.0):
    deadline = time.time() + timeout
    while True:
        job = client.videos.retrieve(video_id)
        assert 0 <= job.progress <= 100
        if job.status in ("completed", "failed"):
            return job
        assert time.time() < deadline, f"job {video_id} still {job.status}"
        time.sleep(0.05)


def _idle(engine, timeout=5.0):
    deadline = time.time() + timeout
    while engine.stats()["num_running"] or engine.stats()["num_waiting"]:
        assert time.time() < deadline, f"engine still busy: {engine.stats()}"
        time.sleep(0.01)


# ---- images ----------------------------------------------------------------------------------------
def test_images_generate_n_seed_and_offline_equality(images):
    from omnistage import DiffusionParams, Omni

    kw = dict(model=images.name, prompt="a red cube", size="64x48", response_format="b64_json")
    extra = dict(STEPS, seed=7, negative_prompt="blurry", true_cfg_scale=4.0)
    two = images.client.images.generate(n=2, extra_body=extra, **kw)
    assert len(two.data) == 2 and two.size == "64x48" and two.output_format == "png"
    a, b = (_pixels(d.b64_json) for d in two.data)
    assert a.shape == (48, 64, 3) and not np.array_equal(a, b)                  # n=2: two different images
    again = images.client.images.generate(n=2, extra_body=extra, **kw)
    assert np.array_equal(_pixels(again.data[0].b64_json), a)                   # same seed: same images
    assert np.array_equal(_pixels(again.data[1].b64_json), b)
    other = images.client.images.generate(n=1, extra_body=dict(extra, seed=8), **kw)
    assert not np.array_equal(_pixels(other.data[0].b64_json), a)

    with Omni(images.model, device="cpu", dtype="float32") as omni:
        ref = omni.generate([{"prompt": "a red cube", "negative_prompt": "blurry"}],
                            DiffusionParams(height=48, width=64, num_inference_steps=2, seed=7, true_cfg_scale=4.0,
                                            num_outputs_per_prompt=2), use_tqdm=False)[0]
    assert [np.asarray(im).tolist() for im in ref.images] == [a.tolist(), b.tolist()]

    for fmt in ("jpeg", "webp"):
        out = images.client.images.generate(extra_body=STEPS, output_format=fmt, **kw)
        assert Image.open(io.BytesIO(base64.b64decode(out.data[0].b64_json))).format == fmt.upper()


def test_async_omni_streams_progress(images):
    from omnistage import DiffusionParams

    async def run():
        return [o async for o in images.engine.generate("a cat", DiffusionParams(height=32, width=32,
                                                                                 num_inference_steps=3, seed=0))]

    outs = asyncio.run(run())
    assert [round(o.progress, 2) for o in outs] == [0.33, 0.67, 1.0]
    assert [o.finished for o in outs] == [False, False, True] and len(outs[-1].images) == 1
    assert set(outs[-1].metrics.phase_times) == {"encode", "denoise", "decode"}


def _sse_events(response) -> list[dict]:
    """The JSON data of each SSE event of an httpx streaming response (with its `event:` name checked)."""
    import json

    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            events.append(json.loads(line[5:]))
            assert events[-1]["type"] == name
    return events


def test_streamed_generation_sends_each_step_then_the_same_images(images):
    """`stream: true`: a progress event per denoising step, then OpenAI's `image_generation.completed`
    per image, read by the real openai client; the images are the non-streamed ones of that seed."""
    kw = dict(model=images.name, prompt="a red cube", size="64x48", n=2, extra_body=dict(seed=5, num_inference_steps=3))
    events = list(images.client.images.generate(stream=True, **kw))
    assert [e.type for e in events] == ["image_generation.progress"] * 3 + ["image_generation.completed"] * 2
    assert [(e.step, e.num_inference_steps) for e in events[:3]] == [(1, 3), (2, 3), (3, 3)]
    assert [(e.index, e.size, e.output_format) for e in events[3:]] == [(0, "64x48", "png"), (1, "64x48", "png")]
    plain = images.client.images.generate(**kw)
    assert [_pixels(e.b64_json).tolist() for e in events[3:]] == [_pixels(d.b64_json).tolist() for d in plain.data]


def test_streamed_generation_refuses_bad_requests_before_the_stream(images):
    base = {"model": images.name, "prompt": "a cube", "size": "64x48", "stream": True, "num_inference_steps": 2}
    for body, param in (({**base, "size": "65x48"}, "size"), ({**base, "partial_images": 2}, "partial_images"),
                        ({**base, "prompt": " "}, "prompt")):
        r = httpx.post(images.url + "/v1/images/generations", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def _aborts(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    key = 'omnistage:request_success_total{finished_reason="abort"'
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(key))


def test_leaving_a_streamed_generation_aborts_it(images):
    before = _aborts(images)
    body = {"prompt": "a cube", "size": "16x16", "stream": True, "num_inference_steps": 1000}
    with httpx.stream("POST", images.url + "/v1/images/generations", json=body, timeout=60) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        assert first.startswith('data: {"type": "image_generation.progress"')
    _idle(images.engine, timeout=30)
    assert _aborts(images) == before + 1         # cut at a step boundary, not run to its 1000th step


def test_image_requests_with_bad_fields_get_4xx(images):
    gen = images.client.images.generate
    kw = dict(model=images.name, prompt="x", extra_body=STEPS)
    assert _status(lambda: gen(size="70x64", **kw)) == (400, "size")            # not a multiple of 4 (tiny VAE)
    assert _status(lambda: gen(size="big", **kw)) == (400, "size")
    assert _status(lambda: gen(size="4096x4096", **kw)) == (400, "size")        # over --max-image-pixels
    assert _status(lambda: gen(size="32x32", n=0, **kw)) == (400, "n")
    assert _status(lambda: gen(size="32x32", n=11, **kw)) == (400, "n")
    assert _status(lambda: gen(size="32x32", response_format="url", **kw)) == (400, "response_format")
    assert _status(lambda: gen(size="32x32", output_format="gif", **kw)) == (400, "output_format")
    assert _status(lambda: gen(size="32x32", model="dall-e-3", prompt="x")) == (404, "model")
    bad_steps = dict(model=images.name, prompt="x", size="32x32", extra_body={"num_inference_steps": 0})
    assert _status(lambda: gen(**bad_steps)) == (400, "num_inference_steps")
    edit = lambda: images.client.images.edit(model=images.name, image=("in.png", _png(), "image/png"), prompt="x")
    assert _status(edit) == (400, "image")                                      # Qwen-Image takes no input image
    chat = lambda: images.client.chat.completions.create(model=images.name, messages=[{"role": "user",
                                                                                        "content": "hi"}])
    assert _status(chat)[0] == 400
    assert _status(lambda: images.client.videos.create(model=images.name, prompt="x"))[0] == 400
    ok = gen(size="32x32", **kw)                                                # still serving
    assert _pixels(ok.data[0].b64_json).shape == (32, 32, 3)
    assert httpx.get(images.url + "/health").status_code == 200


def test_text_and_speech_routes_on_an_image_model_say_what_it_serves(images):
    chat = httpx.post(images.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "/v1/images/generations" in chat.json()["error"]["message"]
    speech = httpx.post(images.url + "/v1/audio/speech", json={"input": "hi", "voice": "joe"})
    message = speech.json()["error"]["message"]
    assert speech.status_code == 400 and "image / video generation model" in message and "install" not in message


def test_image_routes_refuse_text_models():
    from fastapi.testclient import TestClient

    from omnistage.entrypoints.openai.api_server import build_app

    llm = SimpleNamespace(main_stage_kind="ar", is_running=True, orchestrator=None, output_hooks=[],
                          stats=lambda: {}, max_model_len=128)
    with TestClient(build_app(llm, "tiny-llm")) as c:
        r = c.post("/v1/images/generations", json={"prompt": "x"})
        assert r.status_code == 400 and "does not generate images" in r.json()["error"]["message"]
        assert c.post("/v1/videos", json={"prompt": "x"}).status_code == 400


# ---- videos ----------------------------------------------------------------------------------------
def test_video_job_lifecycle(videos):
    from omnistage.io.media import decode_mp4

    c = videos.client
    job = c.videos.create(model=videos.name, prompt="a boat", size="48x32",
                          extra_body=dict(STEPS, num_frames=5, fps=8, seed=3))
    assert (job.object, job.status, job.progress, job.size, job.model) == ("video", "queued", 0, "48x32", videos.name)
    assert job.seconds == "0.625" and job.created_at > 0
    done = _wait(c, job.id)
    assert (done.status, done.progress) == ("completed", 100) and done.completed_at >= done.created_at
    frames = decode_mp4(c.videos.download_content(job.id).read())
    assert frames.shape == (5, 32, 48, 3)
    thumb = httpx.get(f"{videos.url}/v1/videos/{job.id}/content", params={"variant": "thumbnail"})
    assert thumb.headers["content-type"] == "image/webp"
    by_seconds = c.videos.create(model=videos.name, prompt="a boat", size="48x32", seconds="4",
                                 extra_body=dict(STEPS, fps=2))
    assert by_seconds.seconds == "4.5"                                          # 4 s * 2 fps + 1 -> 9 frames
    _wait(c, by_seconds.id)
    listed = [v.id for v in c.videos.list()]
    assert listed[:2] == [by_seconds.id, job.id]                                # newest first
    page = c.videos.list(limit=1, order="asc")
    assert [v.id for v in page.data] == [job.id] and page.has_more
    assert c.videos.delete(job.id).deleted
    assert _status(lambda: c.videos.retrieve(job.id))[0] == 404
    metrics = httpx.get(videos.url + "/metrics").text
    for family in ("omnistage:diffusion_step_seconds_count", 'omnistage:diffusion_request_phase_seconds_count',
                   'omnistage:video_jobs{model_name="tiny-wan",status="completed"} 1.0'):
        assert family in metrics


def test_deleting_a_running_job_frees_the_engine(videos):
    c = videos.client
    long = c.videos.create(model=videos.name, prompt="a long one", size="48x32",
                           extra_body={"num_frames": 5, "num_inference_steps": 1000})
    deadline = time.time() + 20
    while c.videos.retrieve(long.id).status != "in_progress":
        assert time.time() < deadline
        time.sleep(0.01)
    assert c.videos.delete(long.id).deleted
    forwards = videos.engine.stats()["num_forwards"]
    _idle(videos.engine)
    assert videos.engine.stats()["num_forwards"] - forwards <= 2               # stopped within a step or two
    nxt = c.videos.create(model=videos.name, prompt="next", size="48x32", extra_body=dict(STEPS, num_frames=3))
    assert _wait(c, nxt.id).status == "completed"


def test_video_requests_with_bad_fields_get_4xx(videos):
    c = videos.client
    kw = dict(model=videos.name, prompt="x")
    assert _status(lambda: c.videos.create(size="50x32", **kw)) == (400, "size")
    assert _status(lambda: c.videos.create(seconds="soon", **kw)) == (400, "seconds")
    assert _status(lambda: c.videos.create(size="48x32", extra_body={"num_frames": 999}, **kw)) == (400, "num_frames")
    ref = ("ref.png", _png(), "image/png")
    assert _status(lambda: c.videos.create(size="48x32", input_reference=ref, **kw)) == (400, "input_reference")
    for call in (c.videos.retrieve, c.videos.download_content, c.videos.delete):
        assert _status(lambda: call("video_nope"))[0] == 404
    r = httpx.post(videos.url + "/v1/videos", json={"prompt": "json body", "size": "48x32", "seconds": 1, "fps": 2,
                                                    "num_inference_steps": 1})
    assert r.status_code == 200 and r.json()["status"] == "queued"             # JSON works as well as multipart
    assert r.json()["num_frames"] == 3
    assert _wait(c, r.json()["id"]).status == "completed"


def test_image_to_video_uploads(i2v):
    from omnistage.io.media import decode_mp4

    c, kw = i2v.client, dict(model=i2v.name, prompt="it moves", size="32x32")
    job = c.videos.create(input_reference=("ref.png", _png(), "image/png"), extra_body=dict(STEPS, num_frames=5), **kw)
    done = _wait(c, job.id)
    assert done.status == "completed", done.error
    assert decode_mp4(c.videos.download_content(job.id).read()).shape == (5, 32, 32, 3)
    data_url = "data:image/png;base64," + base64.b64encode(_png(seed=1)).decode()
    by_url = httpx.post(i2v.url + "/v1/videos", json=dict(kw, input_reference={"image_url": data_url}, num_frames=5,
                                                          **STEPS))               # the client uploads files only
    assert _wait(c, by_url.json()["id"]).status == "completed"

    assert _status(lambda: c.videos.create(**kw)) == (400, "input_reference")  # I2V needs an image
    corrupt = ("ref.png", b"\x89PNG\r\n\x1a\n not really a png", "image/png")
    assert _status(lambda: c.videos.create(input_reference=corrupt, **kw)) == (400, "input_reference")
    huge = ("ref.png", b"\x89PNG" + bytes(100 * 1024), "image/png")
    assert _status(lambda: c.videos.create(input_reference=huge, **kw)) == (413, "input_reference")
    edit = lambda: c.images.edit(model=i2v.name, image=("in.png", _png(), "image/png"), prompt="x")
    assert _status(edit) == (400, "model")                                      # makes videos: use /v1/videos

    ref = ("ref.png", _png(), "image/png")
    slow = dict(num_frames=5, num_inference_steps=1000)
    jobs = [c.videos.create(input_reference=ref, extra_body=slow, **kw) for _ in range(2)]
    assert _status(lambda: c.videos.create(input_reference=ref, extra_body=slow, **kw))[0] == 429
    for j in jobs:
        c.videos.delete(j.id)
    _idle(i2v.engine)
    assert _wait(c, c.videos.create(input_reference=ref, extra_body=dict(STEPS, num_frames=5), **kw).id).status \
        == "completed"


# ---- image edits ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def image_edit(tmp_path_factory):
    from omnistage.testing.diffusion import DIFFUSION_TINY_BUILDERS

    path = DIFFUSION_TINY_BUILDERS["qwen-image-edit"](str(tmp_path_factory.mktemp("qwen-image-edit")))
    with _serve(path, "tiny-qwen-image-edit") as s:
        yield s


def test_images_edit_returns_an_edited_png(image_edit, tmp_path):
    from omnistage import DiffusionParams, Omni

    png = tmp_path / "in.png"
    png.write_bytes(_png())                                                     # 40x24
    c, extra = image_edit.client, dict(STEPS, seed=3, negative_prompt="blurry", true_cfg_scale=3.0)
    with open(png, "rb") as f:
        out = c.images.edit(model=image_edit.name, image=f, prompt="make it red", extra_body=extra)
    assert out.size == "1312x800"                   # 1024^2 pixels at the input's aspect ratio, multiples of 32
    got = Image.open(io.BytesIO(base64.b64decode(out.data[0].b64_json)))
    assert got.format == "PNG" and got.size == (1312, 800)
    small = c.images.edit(model=image_edit.name, image=("in.png", _png(), "image/png"), prompt="make it red",
                          size="64x32", extra_body=extra)
    with Omni(image_edit.model, device="cpu", dtype="float32") as omni:
        ref = omni.generate([{"prompt": "make it red", "image": Image.open(io.BytesIO(_png()))}],
                            DiffusionParams(height=32, width=64, **extra), use_tqdm=False)[0]
    diff = np.abs(_pixels(small.data[0].b64_json).astype(int) - np.asarray(ref.images[0]).astype(int))
    assert diff.max() <= 2                                                      # the server's edit is Omni's
    two = lambda: c.images.edit(model=image_edit.name, image=[("a.png", _png(), "image/png")] * 2, prompt="x")
    assert _status(two) == (400, "image")                                       # Qwen-Image-Edit takes one image
    assert _status(lambda: c.images.generate(model=image_edit.name, prompt="x"))[0] == 400


def test_streamed_edit_sends_progress_then_the_edited_image(image_edit):
    form = {"prompt": "make it red", "size": "64x32", "stream": "true", "seed": "3", "num_inference_steps": "2"}
    with httpx.stream("POST", image_edit.url + "/v1/images/edits", data=form, timeout=120,
                      files={"image": ("in.png", _png(), "image/png")}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(r)
    assert [e["type"] for e in events] == ["image_edit.progress"] * 2 + ["image_edit.completed"]
    plain = image_edit.client.images.edit(model=image_edit.name, image=("in.png", _png(), "image/png"),
                                          prompt="make it red", size="64x32", extra_body=dict(STEPS, seed=3))
    assert np.array_equal(_pixels(events[-1]["b64_json"]), _pixels(plain.data[0].b64_json))
