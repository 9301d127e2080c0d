"""Qwen3-Omni parts of `omni_bench.py --model qwen3-omni`: the checkpoint and the request settings.

`--tiny`: the tiny checkpoint (omnistage.testing.qwen3_omni) on the CPU. Otherwise a folder with the
config, tokenizer and processor of Qwen3-Omni-30B-A3B's shape and no weight file is written under --work
(a few MB), served with `load_format="dummy"`: every stage draws random bf16 weights of the
checkpoint's shapes on the GPU (models/dummy.py; 34B parameters; random weights time like real ones):
  thinker  hidden 2048, 48 layers, 32 q / 4 kv heads of 128, 128 experts top-8 of width 768, vocab 152064
  talker   hidden 1024, 20 layers, 16 q / 2 kv heads of 128, 128 experts top-8 of width 384 + a shared
           expert of 768, codec vocab 3072; code predictor 5 layers x 1024, 16 codebooks of 2048
  code2wav transformers' defaults (8 transformer layers x 1024, window 72, decoder 1536 channels)
  encoders tiny (the prompts are text), the tiny tokenizer / processor, three speakers.
Each request bans codec eos, so every answer has the same number of frames (12.5 per second of audio).
"""

from __future__ import annotations

import os

import torch

FRAMES_PER_SECOND = 12.5                        # 24 kHz / 1920 samples per frame
THINKER_30B = dict(vocab_size=152064, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                   num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, num_experts=128,
                   num_experts_per_tok=8, max_position_embeddings=65536, initializer_range=0.02)
TALKER_30B = dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=20, num_attention_heads=16,
                  num_key_value_heads=2, head_dim=128, moe_intermediate_size=384, num_experts=128,
                  num_experts_per_tok=8, shared_expert_intermediate_size=768, initializer_range=0.02)
PREDICTOR_30B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=5, num_attention_heads=16,
                     num_key_value_heads=8, head_dim=128, vocab_size=2048, num_code_groups=16)
CODE2WAV_30B = dict(codebook_size=2048, hidden_size=1024, num_attention_heads=16, num_key_value_heads=16,
                    num_hidden_layers=8, intermediate_size=3072, sliding_window=72, num_quantizers=16,
                    decoder_dim=1536)


def config_30b():
    """The tiny checkpoint's config with the 30B-A3B shapes above (codec ids at the real offsets)."""
    from omnistage.testing.qwen3_omni import make_config, token_ids

    config = make_config(token_ids(), text_overrides=THINKER_30B)
    thinker, talker = config.thinker_config, config.talker_config
    thinker.audio_config.output_dim = thinker.vision_config.out_hidden_size = THINKER_30B["hidden_size"]
    talker.thinker_hidden_size = THINKER_30B["hidden_size"]
    talker.num_code_groups = PREDICTOR_30B["num_code_groups"]
    for key, value in TALKER_30B.items():
        setattr(talker.text_config, key, value)
    talker.text_config.rope_parameters = {**talker.text_config.rope_parameters, "mrope_section": [24, 20, 20]}
    talker.text_config.vocab_size = 3072
    for key, value in PREDICTOR_30B.items():
        setattr(talker.code_predictor_config, key, value)
    talker.code_predictor_config.layer_types = ["full_attention"] * PREDICTOR_30B["num_hidden_layers"]
    for key, value in CODE2WAV_30B.items():
        setattr(config.code2wav_config, key, value)
    offset = 2048 - 64                          # the tiny ids sit at the real offsets above codebook 64
    for name in ("codec_eos_token_id", "codec_nothink_id", "codec_think_bos_id", "codec_think_eos_id",
                 "codec_pad_id", "codec_bos_id"):
        setattr(talker, name, getattr(talker, name) + offset)
    talker.speaker_id = {k: v + offset for k, v in talker.speaker_id.items()}
    config.dtype = thinker.dtype = "bfloat16"
    return config


def config_folder(path: str) -> str:
    """The 30B-A3B-shape folder without weights (config, tokenizer, processor), for `load_format="dummy"`."""
    from omnistage.testing.qwen3_omni import make_omni_tokenizer, make_processor

    config = config_30b()
    config.architectures = ["Qwen3OmniMoeForConditionalGeneration"]   # models/dummy.py builds its shapes
    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)
    tokenizer = make_omni_tokenizer()
    tokenizer.save_pretrained(path)
    make_processor(tokenizer).save_pretrained(path)
    return path


def tiny_checkpoint(path: str) -> str:
    from omnistage.testing.qwen3_omni import make_tiny_qwen3_omni

    if not os.path.exists(os.path.join(path, "config.json")):
        make_tiny_qwen3_omni(path)
    return path


def stage_params(path: str, thinker_tokens: int, talker_frames: int) -> list:
    """Thinker: sampled, eos ignored; talker: transformers' sampling with codec eos banned too."""
    from omnistage import SamplingParams
    from omnistage.models.qwen3_omni.pipeline import talker_params
    from omnistage.models.qwen3_omni.thinker import omni_config

    talker = talker_params(omni_config(path))
    banned = talker["stop_token_ids"]           # the talker masks the other suppressed ids itself
    return [SamplingParams(max_tokens=thinker_tokens, temperature=0.7, ignore_eos=True, seed=0),
            SamplingParams(max_tokens=talker_frames, temperature=0.9, top_k=50, repetition_penalty=1.05,
                           bad_token_ids=banned, seed=0),
            None]
