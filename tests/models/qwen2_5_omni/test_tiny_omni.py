"""The tiny Qwen2.5-Omni folder loads back through transformers and speaks through HF `generate`."""

import os

import numpy as np
import pytest
import torch

from omnistage.testing.qwen2_5_omni import VOICE_BOS, VOICES

SAMPLES_PER_CODE = 2 * 240                      # DiT repeats x BigVGAN hop


def test_folder_has_the_real_layout(omni_dir, hf_omni):
    for name in ("config.json", "model.safetensors", "generation_config.json", "spk_dict.pt",
                 "tokenizer.json", "tokenizer_config.json", "processor_config.json", "chat_template.jinja"):
        assert os.path.isfile(os.path.join(omni_dir, name)), name
    assert hf_omni.has_talker and sorted(hf_omni.speaker_map) == sorted(VOICES)
    dit = hf_omni.config.token2wav_config.dit_config
    for voice in VOICES:
        spk = hf_omni.speaker_map[voice]
        assert spk["bos_token"] == VOICE_BOS[voice]
        assert spk["cond"].shape == (1, dit.enc_emb_dim)
        assert spk["ref_mel"].ndim == 3 and spk["ref_mel"].shape[-1] == dit.mel_dim
    names = {n.split(".")[0] for n, _ in hf_omni.named_parameters()}
    assert names == {"thinker", "talker", "token2wav"}


def test_processor_reloads_with_omni_special_tokens(omni_processor, hf_omni):
    from transformers import Qwen2_5OmniProcessor

    assert isinstance(omni_processor, Qwen2_5OmniProcessor)
    cfg = hf_omni.config.thinker_config
    assert omni_processor.audio_token_id == cfg.audio_token_index
    assert omni_processor.image_token_id == cfg.image_token_index
    assert omni_processor.video_token_id == cfg.video_token_index
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "audio"}, {"type": "text", "text": "Hi"}]}]
    text = omni_processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>user\n<|vision_bos|><|IMAGE|><|vision_eos|><|audio_bos|><|AUDIO|><|audio_eos|>Hi"
                    "<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("speaker", VOICES)
def test_hf_generate_returns_text_and_24khz_audio(hf_omni, omni_processor, speaker):
    text = omni_processor.apply_chat_template([{"role": "user", "content": "Tell me a story."}],
                                              add_generation_prompt=True, tokenize=False)
    inputs = omni_processor(text=text, return_tensors="pt")
    torch.manual_seed(0)
    ids, wav = hf_omni.generate(**inputs, speaker=speaker, thinker_max_new_tokens=8, talker_max_new_tokens=24)
    assert ids.shape == (1, inputs["input_ids"].shape[1] + 8)
    assert wav.dtype == torch.float32 and wav.ndim == 1 and torch.isfinite(wav).all()
    # A random talker never says eos within 24 codes, so the audio is 24 codes long at 24 kHz.
    assert wav.numel() == 24 * SAMPLES_PER_CODE and 0.01 < wav.std() < 1


def test_hf_generate_with_image_and_audio_input(hf_omni, omni_processor):
    from PIL import Image

    image = Image.fromarray((np.random.RandomState(0).rand(60, 90, 3) * 255).astype("uint8"))
    audio = (np.random.RandomState(1).randn(8000) * 0.1).astype("float32")  # 0.5 s at 16 kHz
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "audio"}, {"type": "text", "text": "What?"}]}]
    text = omni_processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = omni_processor(text=text, images=[image], audio=[audio], return_tensors="pt")
    n_image = int((inputs["input_ids"] == hf_omni.config.thinker_config.image_token_index).sum())
    assert n_image == int(inputs["image_grid_thw"].prod()) // 4
    # transformers 5.24 forwards `pixel_values` to the talker's generate, which rejects it; the
    # `thinker_` prefix keeps it on the thinker (the talker only needs image_grid_thw for its rope).
    inputs["thinker_pixel_values"] = inputs.pop("pixel_values")
    torch.manual_seed(0)
    ids, wav = hf_omni.generate(**inputs, thinker_max_new_tokens=4, talker_max_new_tokens=8)
    assert ids.shape[1] == inputs["input_ids"].shape[1] + 4 and wav.numel() == 8 * SAMPLES_PER_CODE
