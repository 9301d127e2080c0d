"""Chat messages with an image and audio, or a video -> thinker inputs and merged embeddings equal to
HF's forward."""

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.models.qwen2_5_omni.processor import build_thinker_inputs, thinker_input_embeds, thinker_positions


def messages(image_part="image", audio_rate=22050):
    image = Image.fromarray((np.random.RandomState(0).rand(70, 100, 3) * 255).astype("uint8"))
    audio = (np.random.RandomState(1).randn(audio_rate // 2) * 0.1).astype("float32")  # 0.5 s
    return [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Look: "},
                                         {"type": image_part, image_part: image},
                                         {"type": "input_audio", "input_audio": (audio, audio_rate)},
                                         {"type": "text", "text": "What is it?"}]}]


def test_embeddings_and_positions_match_hf_thinker_forward(hf_omni, omni_processor):
    thinker, cfg = hf_omni.thinker, hf_omni.config.thinker_config
    inputs = build_thinker_inputs(omni_processor, messages())
    ids = inputs.input_ids[0]
    assert inputs.text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nLook: <|vision_bos|>")
    assert int((ids == cfg.image_token_index).sum()) == int(inputs["image_grid_thw"].prod()) // 4
    assert int((ids == cfg.audio_token_index).sum()) == 12   # 0.5 s -> 50 mel frames -> 12 rows
    with torch.no_grad():
        hf = thinker(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask, output_hidden_states=True,
                     **inputs.features)
    embeds = thinker_input_embeds(thinker, inputs)
    torch.testing.assert_close(embeds, hf.hidden_states[0], rtol=0, atol=1e-6)
    positions, delta = thinker_positions(thinker, inputs)
    assert positions.shape == (3, 1, ids.numel())
    assert not torch.equal(positions[0], positions[1])      # the image rows differ in h / w
    assert int(positions.max()) + 1 - ids.numel() == int(delta)
    with torch.no_grad():
        logits = thinker.lm_head(thinker.model.language_model(inputs_embeds=embeds, position_ids=positions)[0])
    torch.testing.assert_close(logits, hf.logits, rtol=1e-5, atol=1e-5)


def test_text_only_positions_are_plain_1d(hf_omni, omni_processor):
    inputs = build_thinker_inputs(omni_processor, [{"role": "user", "content": "Hi there"}])
    positions, delta = thinker_positions(hf_omni.thinker, inputs)
    n = inputs.input_ids.shape[1]
    assert torch.equal(positions, torch.arange(n).expand(3, 1, n)) and int(delta) == 0


def test_image_url_parts_and_bad_parts(omni_processor):
    inputs = build_thinker_inputs(omni_processor, messages(image_part="image_url", audio_rate=16000))
    assert inputs["pixel_values"] is not None and inputs["input_features"] is not None
    with pytest.raises(ValueError, match="part type must be one of"):
        build_thinker_inputs(omni_processor, [{"role": "user", "content": [{"type": "input_video", "video": None}]}])
    with pytest.raises(ValueError, match=r"video part must carry decoded frames.*got NoneType"):
        build_thinker_inputs(omni_processor, [{"role": "user", "content": [{"type": "video", "video": None}]}])
    with pytest.raises(ValueError, match=r"uint8 array \[T, H, W, 3\].*got float64"):
        build_thinker_inputs(omni_processor, video_message(np.zeros((2, 28, 28, 3))))
    with pytest.raises(ValueError, match="fps of a video part must be a positive number"):
        build_thinker_inputs(omni_processor, video_message(fps=0))
    with pytest.raises(ValueError, match="PIL image"):
        build_thinker_inputs(omni_processor, [{"role": "user", "content": [{"type": "image", "image": "x.png"}]}])


def video_frames(n=4, height=56, width=84):
    return (np.random.RandomState(2).rand(n, height, width, 3) * 255).astype("uint8")


def video_message(frames=None, **extra):
    frames = video_frames() if frames is None else frames
    return [{"role": "user", "content": [{"type": "video", "video": frames, **extra},
                                         {"type": "text", "text": "What happens?"}]}]


def test_video_embeddings_and_positions_match_hf_thinker_forward(hf_omni, omni_processor):
    """Frames as an array or as PIL images give the same inputs; the merged embeddings, 3-D positions
    and logits equal the thinker's forward; `fps` sets the seconds per temporal patch."""
    thinker, cfg = hf_omni.thinker, hf_omni.config.thinker_config
    inputs = build_thinker_inputs(omni_processor, video_message())
    as_images = build_thinker_inputs(omni_processor, [{"role": "user", "content": [
        {"type": "video_url", "video_url": [Image.fromarray(f) for f in video_frames()]},
        {"type": "text", "text": "What happens?"}]}])
    assert torch.equal(inputs.input_ids, as_images.input_ids)
    torch.testing.assert_close(inputs["pixel_values_videos"], as_images["pixel_values_videos"])
    grid = inputs["video_grid_thw"]
    assert grid[0, 0] == 2 and inputs["pixel_values"] is None   # 4 frames -> 2 temporal patches
    assert int((inputs.input_ids == cfg.video_token_index).sum()) == int(grid.prod()) // 4
    assert inputs["video_second_per_grid"].tolist() == [1.0]   # 2 frames per patch at the default 2 fps
    with torch.no_grad():
        hf = thinker(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask, output_hidden_states=True,
                     **inputs.features)
    embeds = thinker_input_embeds(thinker, inputs)
    torch.testing.assert_close(embeds, hf.hidden_states[0], rtol=0, atol=1e-6)
    positions, delta = thinker_positions(thinker, inputs)
    n = inputs.input_ids.shape[1]
    assert positions.shape == (3, 1, n) and int(positions.max()) + 1 - n == int(delta)
    with torch.no_grad():
        logits = thinker.lm_head(thinker.model.language_model(inputs_embeds=embeds, position_ids=positions)[0])
    torch.testing.assert_close(logits, hf.logits, rtol=1e-5, atol=1e-5)
    # at 4 fps a temporal patch (2 frames) is 0.5 s: the second patch's t row is 12.5 after the first
    fast = build_thinker_inputs(omni_processor, video_message(fps=4.0))
    assert fast["video_second_per_grid"].tolist() == [0.5]
    t_rows = [thinker_positions(thinker, x)[0][0, 0][x.input_ids[0] == cfg.video_token_index] for x in (inputs, fast)]
    assert [int(t.max() - t.min()) for t in t_rows] == [25, 12]
