"""A diffusion request is checked against the model's own limits up front, and one that still fails
at run time fails alone (`DiffusionEngine`, tiny random checkpoints built in code, CPU float32).

* Limits come from the checkpoint's config: Wan's rope table (`rope_max_seq_len` positions per axis
  of the latent grid: frames, rows, columns), SD3's learnt position table (`pos_embed_max_size`
  patches per side), Z-Image's rope axes (`axes_lens`). Over them, `check_params` / `add_request`
  raise `ParamError` naming the field (before: accepted, then "denoising failed: shape ... is
  invalid" mid-run); exactly at them, the request runs.
* A request that breaks a shared forward or a batched prompt encode fails alone: the engine runs the
  group again request by request. Z-Image's tiny rope has 256 caption positions, so a long prompt
  fails in denoising (a real run-time failure); for the encode, a family whose encode refuses one
  prompt stands in for a prompt the text encoder cannot take. Either way the other request's image
  equals the one it gets alone.
"""

import re

import numpy as np
import pytest

from omnistage.config import EngineConfig
from omnistage.diffusion.engine import DiffusionEngine
from omnistage.params import DiffusionParams, ParamError

CPU = EngineConfig(device="cpu", dtype="float32")
LONG_PROMPT = "a very long and winding description of a quiet harbour town at dawn " * 30


def _engine(tiny_dir, kind: str, family_cls=None) -> DiffusionEngine:
    from omnistage.models import registry

    path = tiny_dir(kind)
    return DiffusionEngine(path, family_cls or registry.diffusion_family(path), CPU)


@pytest.fixture(scope="module")
def engine(tiny_dir):
    """engine(kind) -> one engine per tiny checkpoint for this module (idle between tests)."""
    built: dict[str, DiffusionEngine] = {}

    def get(kind: str) -> DiffusionEngine:
        if kind not in built:
            built[kind] = _engine(tiny_dir, kind)
        return built[kind]

    return get


@pytest.mark.parametrize("kind, params, field, message", [
    ("wan", dict(height=32, width=32, num_frames=99), "num_frames", "num_frames must be at most 63 for this model, got 99"),
    ("wan", dict(height=256, width=32, num_frames=5), "height", "height must be a positive multiple of 4 and at "
                                                                "most 128, got 256"),
    ("wan-i2v", dict(height=32, width=132, num_frames=5), "width", "at most 128, got 132"),
    ("sd3", dict(height=32, width=256), "width", "width must be a positive multiple of 4 and at most 128, got 256"),
    ("z-image", dict(height=1024, width=32), "height", "height must be a positive multiple of 4 and at most 256, "
                                                       "got 1024"),
])
def test_params_over_the_models_limits_are_refused_up_front(engine, kind, params, field, message):
    eng = engine(kind)
    p = DiffusionParams(num_inference_steps=1, seed=0, **params)
    with pytest.raises(ParamError, match=re.escape(message)) as refused:
        eng.check_params(p)
    assert refused.value.field == field
    inputs = {"prompt": "x"}
    if eng.takes_image:
        from PIL import Image

        inputs["image"] = Image.new("RGB", (32, 32))
    with pytest.raises(ParamError, match=re.escape(message)):
        eng.add_request("r", inputs, p)
    assert not eng.has_unfinished()


@pytest.mark.parametrize("kind, params", [
    ("wan", dict(height=32, width=128, num_frames=5)),
    ("sd3", dict(height=128, width=32)),
    ("z-image", dict(height=32, width=256)),
])
def test_params_at_the_models_limits_run(engine, kind, params):
    eng = engine(kind)
    out = eng.generate({"r": ("a cat", DiffusionParams(num_inference_steps=1, seed=0, **params))})["r"]
    assert out.finished and out.error is None
    shape = out.video.frames.shape[1:3] if out.video is not None else np.asarray(out.images[0]).shape[:2]
    assert shape == (params["height"], params["width"])
    if kind == "wan":                           # the most frames it takes (running them: 16 s on CPU)
        assert eng.check_params(DiffusionParams(height=32, width=32, num_frames=63)).num_frames == 63


def test_the_models_defaults_fit_the_folder(engine):
    """Unset size and frames take the model's defaults (Wan: 480x832, 81 frames), scaled down to
    what the folder's position tables hold (tiny Wan: 128 px per side, 63 frames), aspect kept."""
    p = engine("wan").check_params(DiffusionParams())
    assert (p.height, p.width, p.num_frames) == (72, 128, 63)
    sd3 = engine("sd3")                         # a default that fits stays as it is
    p = sd3.check_params(DiffusionParams(width=32))
    assert (p.height, p.width) == (sd3.family.default_size()[0], 32)


def _run_together(eng: DiffusionEngine, prompts: dict[str, str], params: DiffusionParams) -> dict:
    for rid, prompt in prompts.items():             # added before the first step: admitted and run as one group
        eng.add_request(rid, prompt, params)
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_a_request_that_breaks_a_shared_forward_fails_alone(tiny_dir):
    params = DiffusionParams(height=32, width=32, num_inference_steps=2, seed=3)
    eng = _engine(tiny_dir, "z-image")          # its own: the batch statistics are read below
    alone = eng.generate({"ref": ("a red cube", params)})["ref"].images[0]
    done = _run_together(eng, {"long": LONG_PROMPT, "short": "a red cube"}, params)
    assert done["long"].finish_reason == "error" and done["long"].error.message.startswith("denoising failed: ")
    assert not done["long"].error.fatal and done["long"].output.images == []
    assert done["short"].finish_reason == "stop" and done["short"].error is None
    np.testing.assert_array_equal(np.asarray(done["short"].output.images[0]), np.asarray(alone))
    assert eng.stats()["max_batch_tasks"] == 1                 # the shared forward failed; each then ran alone
    assert eng.generate({"again": ("a red cube", params)})["again"].error is None   # the engine serves on


def test_a_request_that_breaks_a_batched_encode_fails_alone(tiny_dir):
    from omnistage.diffusion.pipelines.z_image import ZImageFamily

    class RefusesOnePrompt(ZImageFamily):
        def encode(self, tasks):
            if any(t.prompt == "poison" for t in tasks):
                raise ValueError("the text encoder cannot take this prompt")
            super().encode(tasks)

    params = DiffusionParams(height=32, width=32, num_inference_steps=2, seed=4)
    eng = _engine(tiny_dir, "z-image", RefusesOnePrompt)
    alone = eng.generate({"ref": ("a blue sky", params)})["ref"].images[0]
    done = _run_together(eng, {"poison": "poison", "fine": "a blue sky"}, params)
    assert done["poison"].error.message == "prompt encoding failed: the text encoder cannot take this prompt"
    assert done["fine"].error is None
    np.testing.assert_array_equal(np.asarray(done["fine"].output.images[0]), np.asarray(alone))


def test_image_to_video_takes_an_input_image_of_any_mode(engine):
    from PIL import Image

    eng = engine("wan-i2v")
    params = DiffusionParams(height=32, width=32, num_frames=5, num_inference_steps=1, seed=0)
    grey = Image.new("L", (32, 32), 128)
    out = eng.generate({"la": ({"prompt": "x", "image": grey.convert("LA")}, params),
                        "rgb": ({"prompt": "x", "image": grey.convert("RGB")}, params)})
    assert out["la"].error is None and out["la"].video.frames.shape == (5, 32, 32, 3)
    diff = np.abs(out["la"].video.frames.astype(int) - out["rgb"].video.frames.astype(int))
    assert diff.max() <= 1                                      # one batch: rows may round apart by one level


@pytest.mark.parametrize("kind", ["wan", "sd3", "z-image", "qwen-image"])
def test_stated_limits_are_the_ones_check_params_enforces(engine, kind):
    """`DiffusionEngine.limits` (what GET /v1/capabilities shows) is what `check_params` does: the
    largest size and frame count run, one multiple more is refused, unset fields get its defaults."""
    eng = engine(kind)
    lim = eng.limits
    (mh, mw), video = lim.size_multiple, lim.output_kind == "video"
    frames = dict(num_frames=lim.max_num_frames) if video else {}
    top = eng.check_params(DiffusionParams(height=lim.max_height, width=lim.max_width, **frames))
    assert (top.height, top.width) == (lim.max_height, lim.max_width)
    assert top.num_inference_steps == lim.default_steps and top.guidance_scale == lim.default_guidance_scale
    with pytest.raises(ParamError) as e:
        eng.check_params(DiffusionParams(height=lim.max_height + mh, width=lim.max_width, **frames))
    assert e.value.field == "height"
    with pytest.raises(ParamError) as e:
        eng.check_params(DiffusionParams(height=lim.max_height, width=lim.max_width - mw // 2 or 1, **frames))
    assert e.value.field == "width"
    if video:
        assert top.fps == lim.default_fps and (lim.max_num_frames - 1) % lim.frame_step == 0
        with pytest.raises(ParamError) as e:
            eng.check_params(DiffusionParams(height=mh, width=mw, num_frames=lim.max_num_frames + lim.frame_step))
        assert e.value.field == "num_frames"
        small = dict(height=mh, width=mw, num_frames=lim.frame_step + 1)
        assert eng.check_params(DiffusionParams(**small)).num_frames == lim.frame_step + 1
    elif lim.default_height <= lim.max_height and lim.default_width <= lim.max_width:
        default = eng.check_params(DiffusionParams())
        assert (default.height, default.width) == (lim.default_height, lim.default_width)
