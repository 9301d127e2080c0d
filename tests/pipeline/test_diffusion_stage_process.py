"""A diffusion stage in its own process (`runner: process` in the deploy config) gives what the same
stage gives inline: PIL images (input and output) and video frames cross the process boundary
(`pipeline.wire`), and the HTTP routes check requests against the stage's limits over the client's
check channel, which the stage process answers even mid-step.

A tiny random Qwen-Image built in code (CPU, float32), its stage in a process and served over HTTP
with the real `openai` client, against the same stage inline (`Omni`); what an image-to-video
stage takes and sends (an input image, video frames) is checked at the wire.
"""

import base64
import io
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from live_server import live_server
from PIL import Image

from omnistage.params import DiffusionParams
from omnistage.pipeline import wire

IN_PROCESS = {"stages": {"dit": {"runner": "process"}}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from omnistage.testing import make_tiny

    out = str(tmp_path_factory.mktemp("diffusion-process"))
    return {kind: make_tiny(out, kind)[0] for kind in ("qwen-image",)}


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "LA", "1", "I;16", "F", "CMYK", "P"])
def test_pil_images_cross_the_wire_with_their_mode_and_pixels(mode):
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (300, 200, 3), dtype=np.uint8)).convert(mode)  # 180 KB: shm
    if mode == "P":
        image.info["transparency"] = 3
    back = wire.decode(wire.encode({"images": [image]}))["images"][0]
    assert (back.mode, back.size, back.tobytes()) == (image.mode, image.size, image.tobytes())
    assert back.getpalette() == image.getpalette() and back.info.get("transparency") == image.info.get("transparency")


def test_a_diffusion_stages_inputs_and_outputs_cross_the_wire():
    """What a diffusion stage process takes (an edit / image-to-video request) and sends back (images,
    a video with every video of the request)."""
    from omnistage.outputs import RequestOutput, VideoOutput
    from omnistage.pipeline.stage_messages import CallStage, StageOutputs
    from omnistage.stage import StageOutput

    rng = np.random.default_rng(2)
    image = Image.fromarray(rng.integers(0, 255, (24, 40, 3), dtype=np.uint8))
    frames = rng.integers(0, 255, (5, 32, 48, 3), dtype=np.uint8)
    call = CallStage(0, "add_request", ["r", {"prompt": "it moves", "image": image},
                                        DiffusionParams(height=32, width=48, num_frames=5, seed=3), None])
    got = wire.decode(wire.encode(call))
    assert got.args[2] == call.args[2] and got.args[1]["image"].tobytes() == image.tobytes()
    video = VideoOutput(frames=frames, fps=16)
    out = StageOutputs([StageOutput("r", RequestOutput("r", finished=True, images=[image], video=video), True,
                                    videos=[video], timings={"decode": 0.1}, finish_reason="stop")], {})
    back = wire.decode(wire.encode(out)).outputs[0]
    assert back.output.images[0].tobytes() == image.tobytes() and back.output.video.fps == 16
    np.testing.assert_array_equal(back.output.video.frames, frames)
    np.testing.assert_array_equal(back.videos[0].frames, frames)


def test_images_served_from_a_diffusion_stage_process_equal_the_inline_stage(tiny):
    from omnistage import Omni
    from omnistage.entrypoints.async_omni import AsyncOmni
    from omnistage.entrypoints.openai.api_server import build_app
    from omnistage.pipeline.stage_client import StageClient

    path = tiny["qwen-image"]
    with Omni(path, device="cpu", dtype="float32") as inline:
        want = inline.generate([{"prompt": "a red cube", "negative_prompt": "blurry"}],
                               DiffusionParams(height=32, width=48, num_inference_steps=2, seed=7, true_cfg_scale=4.0,
                                               num_outputs_per_prompt=2), use_tqdm=False)[0].images
    engine = AsyncOmni(path, device="cpu", dtype="float32", deploy_config=IN_PROCESS)
    try:
        assert isinstance(engine.orchestrator.main, StageClient)
        with live_server(build_app(engine, "tiny")) as url, \
                openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120) as client:
            got = client.images.generate(model="tiny", prompt="a red cube", size="48x32", n=2, extra_body=dict(
                num_inference_steps=2, seed=7, true_cfg_scale=4.0, negative_prompt="blurry"))
            assert [np.asarray(Image.open(io.BytesIO(base64.b64decode(d.b64_json)))).tolist() for d in got.data] \
                == [np.asarray(im).tolist() for im in want]
            caps = httpx.get(url + "/v1/capabilities", timeout=30).json()   # DiffusionLimits crossed the wire
            assert caps["tasks"] == ["image_generation"]
            assert caps["images"]["size_multiple"] == {"width": 4, "height": 4}

            slow: dict = {}                     # the stage is busy with 50 steps: checks are answered meanwhile
            thread = threading.Thread(target=lambda: slow.update(r=client.images.generate(
                model="tiny", prompt="slow", size="32x32", extra_body={"num_inference_steps": 50})))
            thread.start()
            while thread.is_alive() and not engine.stats().get("num_running"):
                time.sleep(0.005)
            with pytest.raises(openai.BadRequestError) as refused:
                client.images.generate(model="tiny", prompt="x", size="30x32")   # not a multiple of 4
            assert refused.value.body["param"] == "size" and "multiple of 4" in refused.value.body["message"]
            thread.join()
            assert len(slow["r"].data) == 1
    finally:
        engine.close()
