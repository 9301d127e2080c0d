"""Chat messages with an image and audio -> thinker inputs and merged embeddings equal to HF's forward."""

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
        build_thinker_inputs(omni_processor, [{"role": "user", "content": [{"type": "video", "video": None}]}])
    with pytest.raises(ValueError, match="PIL image"):
        build_thinker_inputs(omni_processor, [{"role": "user", "content": [{"type": "image", "image": "x.png"}]}])
