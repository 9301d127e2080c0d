"""A tiny random Qwen2.5-Omni checkpoint in the real Hugging Face layout (tests, demos; CPU, seconds).

Contract:
  * ``make_tiny_qwen2_5_omni(out_dir, seed=0) -> out_dir`` writes, with ``save_pretrained``:
    ``config.json`` + ``model.safetensors`` of a ``Qwen2_5OmniForConditionalGeneration`` (thinker =
    text LM + audio encoder + vision encoder, talker, token2wav = DiT + BigVGAN), a
    ``generation_config.json``, ``spk_dict.pt`` with the voices in ``VOICES``
    (``{voice: {"bos_token": int, "cond": [1, enc_emb_dim], "ref_mel": [1, frames, 80]}}``), and a
    ``Qwen2_5OmniProcessor`` (tokenizer + chat template, Whisper feature extractor, Qwen2-VL image
    and video processors). The folder loads back through ``Qwen2_5OmniForConditionalGeneration
    .from_pretrained`` and ``AutoProcessor.from_pretrained``; HF ``generate`` returns text ids and a
    24 kHz waveform in about a second.
  * ``TOKENS``: the special token ids of the tiny checkpoint (thinker placeholders, talker codec ids).

Token layout (mirrors the real checkpoint; only the numbers are smaller):
  * thinker vocab = the tiny BPE (``omnistage.testing.llm``) + Qwen-Omni's named special tokens
    (``<|AUDIO|>``, ``<|audio_bos|>``, ... added as tokenizer tokens) + embedding rows without a
    tokenizer token for the talker's text-side ids (tts pad / bos / eos and one bos per voice), as in
    the real model, whose tts ids 151859-151861 lie outside the tokenizer too.
  * talker vocab keeps the real size (8448) and the real codec ids (pad 8292, bos 8293, eos 8294,
    mask 8296), so HF ``generate``'s hard-coded talker defaults apply unchanged; the DiT's codec
    table covers all 8448 ids so a random talker can never index past it.

Runs in whichever process calls it; needs only CPU. The global torch RNG is left untouched.
"""

from __future__ import annotations

import os

import torch

VOICES = ("Chelsie", "Ethan")
SAMPLE_RATE = 24000                              # BigVGAN output rate: 100 mel frames/s x 240 samples
THINKER_VOCAB = 800                              # tokenizer (~775 ids) + talker-side rows
TALKER_VOCAB = 8448
# Named special tokens of Qwen2.5-Omni's tokenizer that the processor and chat template use.
OMNI_SPECIAL = {
    "audio_token": "<|AUDIO|>", "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>",
    "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
    "image_token": "<|IMAGE|>", "video_token": "<|VIDEO|>",
}
# Thinker-vocab rows used only by the talker (no tokenizer token, like the real tts ids).
TTS_TEXT_PAD, TTS_TEXT_BOS, TTS_TEXT_EOS = 790, 791, 792
VOICE_BOS = {"Chelsie": 793, "Ethan": 794}
CODEC_PAD, CODEC_BOS, CODEC_EOS, CODEC_MASK = 8292, 8293, 8294, 8296

# Qwen2.5-Omni's chat template, restated: media parts become <bos><placeholder><eos> runs that the
# processor expands to one placeholder per feature row.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}{{- '<|vision_bos|><|IMAGE|><|vision_eos|>' -}}"
    "{%- elif part['type'] in ('audio', 'input_audio', 'audio_url') -%}"
    "{{- '<|audio_bos|><|AUDIO|><|audio_eos|>' -}}"
    "{%- elif part['type'] in ('video', 'video_url') -%}{{- '<|vision_bos|><|VIDEO|><|vision_eos|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def make_omni_tokenizer():
    """The tiny BPE of ``omnistage.testing.llm`` plus Qwen2.5-Omni's named special tokens."""
    from transformers import PreTrainedTokenizerFast

    from omnistage.testing.llm import make_tokenizer

    base = make_tokenizer()
    base.add_special_tokens({"extra_special_tokens": list(OMNI_SPECIAL.values())},
                            replace_extra_special_tokens=False)
    # Rebuilt so the named tokens become attributes (``tokenizer.image_token_id``) and are saved in
    # tokenizer_config.json, which is what Qwen2_5OmniProcessor reads.
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer, eos_token=base.eos_token, pad_token=base.pad_token,
        chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False, model_max_length=base.model_max_length,
        extra_special_tokens=dict(OMNI_SPECIAL))
    if len(tokenizer) > TTS_TEXT_PAD:
        raise RuntimeError(f"tokenizer grew to {len(tokenizer)} ids; move the talker-side rows above it")
    return tokenizer


def _token_ids(tokenizer) -> dict[str, int]:
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in OMNI_SPECIAL.items()}
    ids.update(endoftext=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
               im_end=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    return ids


def make_config(ids: dict[str, int]):
    """The tiny ``Qwen2_5OmniConfig``; ``ids`` maps the names of ``OMNI_SPECIAL`` to token ids."""
    from transformers import Qwen2_5OmniConfig

    mrope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]}  # head_dim 16
    placeholders = dict(audio_token_index=ids["audio_token"], image_token_index=ids["image_token"],
                        video_token_index=ids["video_token"], audio_start_token_id=ids["audio_bos_token"],
                        audio_end_token_id=ids["audio_eos_token"], vision_start_token_id=ids["vision_bos_token"],
                        vision_end_token_id=ids["vision_eos_token"])
    text = dict(vocab_size=THINKER_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                rope_parameters=mrope, initializer_range=0.5, tie_word_embeddings=False,
                eos_token_id=ids["im_end"], pad_token_id=ids["endoftext"])
    audio = dict(num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                 output_dim=64, max_source_positions=1500, n_window=100)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=56, out_hidden_size=64, fullatt_block_indexes=[1])
    thinker = dict(text_config=text, audio_config=audio, vision_config=vision, user_token_id=0,
                   initializer_range=0.5, **placeholders)
    talker = dict(vocab_size=TALKER_VOCAB, embedding_size=64, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                  max_position_embeddings=4096, rope_parameters=mrope, initializer_range=0.5,
                  tts_text_start_token_id=TTS_TEXT_BOS, tts_text_end_token_id=TTS_TEXT_EOS,
                  tts_text_pad_token_id=TTS_TEXT_PAD, tts_codec_start_token_id=CODEC_BOS,
                  tts_codec_end_token_id=CODEC_EOS, tts_codec_pad_token_id=CODEC_PAD,
                  tts_codec_mask_token_id=CODEC_MASK, spatial_merge_size=2, **placeholders)
    # initializer_range 0.2 (DiT): attention across DiT blocks matters (a chunk decoded without
    # context is visibly off), so chunked-decoding errors are measurable; 0.1 (BigVGAN): the waveform
    # has a real amplitude (std ~0.3, not 1e-4 as with the default 0.02).
    # The real DiT has 22 layers (look-ahead layer 10, look-back layers 0 and 20); four layers keep one
    # of each kind, so the block-local attention pattern that chunked decoding relies on is exercised.
    dit = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, head_dim=16, ff_mult=2, emb_dim=16,
               block_size=24, look_ahead_layers=[2], look_backward_layers=[0, 3], repeats=2,
               num_embeds=TALKER_VOCAB, mel_dim=80, dropout=0.0, enc_emb_dim=16, enc_dim=16,
               enc_channels=[32, 32, 32, 32, 96], enc_kernel_sizes=[5, 3, 3, 3, 1], enc_dilations=[1, 2, 3, 4, 1],
               enc_attention_channels=16, enc_res2net_scale=2, enc_se_channels=16,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, initializer_range=0.2)
    # 8 * 5 * 6 = 240 samples per mel frame, as the real [5, 3, 2, 2, 2, 2]: 24 kHz from 100 frames/s.
    bigvgan = dict(mel_dim=80, upsample_initial_channel=32, resblock_kernel_sizes=[3],
                   resblock_dilation_sizes=[[1, 3, 5]], upsample_rates=[8, 5, 6],
                   upsample_kernel_sizes=[16, 11, 12], initializer_range=0.1)
    return Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker,
                             token2wav_config={"dit_config": dit, "bigvgan_config": bigvgan})


def make_processor(tokenizer):
    """A ``Qwen2_5OmniProcessor`` from tiny components (small image budget: 56x56 px -> 4 tokens)."""
    from transformers import Qwen2_5OmniProcessor, WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    size = {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}
    image = Qwen2VLImageProcessor(size=size, patch_size=14, temporal_patch_size=2, merge_size=2)
    video = Qwen2VLVideoProcessor(size=size, patch_size=14, temporal_patch_size=2, merge_size=2)
    audio = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160, chunk_length=30,
                                    n_fft=400)
    return Qwen2_5OmniProcessor(image_processor=image, video_processor=video, feature_extractor=audio,
                                tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)


def make_speakers(config, generator: torch.Generator) -> dict[str, dict]:
    """Random voices shaped like the real ``spk_dict.pt`` entries (see module docstring)."""
    dit = config.token2wav_config.dit_config
    speakers = {}
    for i, voice in enumerate(VOICES):
        frames = 60 + 20 * i                    # voices differ in reference length, as real ones do
        speakers[voice] = {
            "bos_token": VOICE_BOS[voice],
            "cond": torch.randn(1, dit.enc_emb_dim, generator=generator),
            "ref_mel": torch.randn(1, frames, dit.mel_dim, generator=generator) - 5.0,  # log-mel scale
        }
    return speakers


def make_tiny_qwen2_5_omni(out_dir: str, seed: int = 0) -> str:
    """Writes the tiny Qwen2.5-Omni folder (see module docstring) and returns ``out_dir``."""
    from transformers import GenerationConfig, Qwen2_5OmniForConditionalGeneration

    tokenizer = make_omni_tokenizer()
    ids = _token_ids(tokenizer)
    config = make_config(ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5OmniForConditionalGeneration(config).to(torch.float32).eval()
        speakers = make_speakers(config, torch.Generator().manual_seed(seed + 1))
    eos = [ids["im_end"], ids["endoftext"]]
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=ids["endoftext"], do_sample=False)
    model.thinker.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=ids["endoftext"],
                                                       do_sample=False)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    torch.save(speakers, os.path.join(out_dir, "spk_dict.pt"))
    make_processor(tokenizer).save_pretrained(out_dir)
    return out_dir


TOKENS = {"tts_text_pad": TTS_TEXT_PAD, "tts_text_bos": TTS_TEXT_BOS, "tts_text_eos": TTS_TEXT_EOS,
          "codec_pad": CODEC_PAD, "codec_bos": CODEC_BOS, "codec_eos": CODEC_EOS, "codec_mask": CODEC_MASK,
          **{f"voice_bos_{v}": i for v, i in VOICE_BOS.items()}}
