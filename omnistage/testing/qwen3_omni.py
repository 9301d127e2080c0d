"""A tiny random Qwen3-Omni-30B-A3B checkpoint in the real Hugging Face layout (tests, demos; CPU, seconds).

Contract:
  * ``make_tiny_qwen3_omni(out_dir, seed=0, text_overrides=None) -> out_dir`` writes, with
    ``save_pretrained``: ``config.json`` + ``model.safetensors`` of a
    ``Qwen3OmniMoeForConditionalGeneration`` (thinker = MoE text decoder + AuT audio encoder + vision
    encoder with deepstack; talker = MoE decoder with a sigmoid-gated shared expert + MTP code predictor;
    code2wav = causal ConvNet decoder), routed experts stored one by one
    (``...mlp.experts.{e}.gate_proj.weight``) as the real checkpoint stores them, a
    ``generation_config.json``, and a ``Qwen3OmniMoeProcessor`` (tokenizer + chat template, Whisper
    feature extractor, Qwen2-VL image and video processors). ``text_overrides`` updates the thinker's
    text config (e.g. ``{"mlp_only_layers": [1]}``). Loads back through ``from_pretrained`` /
    ``AutoProcessor.from_pretrained``; HF ``generate`` returns text ids and a 24 kHz waveform.
  * ``load_reference(path, dtype) -> model``: transformers' model from such a folder, ready to compare
    against (eval, the talker's ``audio_config`` restored after reloading).
  * ``TOKENS``: the talker's codec ids; ``token_ids()`` adds the thinker's (placeholders, roles, tts ids);
    ``SPEAKERS``: speaker name -> codec id, lowercased as transformers looks them up.

What transformers 5.24 needs that its config classes do not declare, and what a fresh model leaves
unset, is applied here (see issue #13): the talker's ``shared_expert_intermediate_size`` and
``spatial_merge_size``, the thinker's ``vision_start/end`` and ``audio_end`` ids, the talker's
``audio_config`` (read when an image/video + audio prompt asks for audio), the talker's routed experts
(``torch.empty``) and every router (zeros) drawn at random, and a codec vocab = codebook + 1024 (the
talker suppresses ids from vocab-1024 upwards except codec EOS). The thinker's ``head_dim`` (32) is
not hidden/heads (16), as in the real model (128 vs 64), so code that derives it is caught.

Runs in whichever process calls it; needs only CPU. The global torch RNG is left untouched.
"""

from __future__ import annotations

import os

import torch

SAMPLE_RATE = 24000                      # code2wav output rate (not in the config)
THINKER_VOCAB = 800                      # tokenizer (~780 ids) + spare rows
CODEBOOK = 64                            # code2wav codebook size = code predictor vocab
TALKER_VOCAB = CODEBOOK + 1024           # the talker suppresses [vocab-1024, vocab) except codec EOS
NUM_CODE_GROUPS = 4                      # codebooks per frame (real: 16)
# Named special tokens of Qwen3-Omni's tokenizer (attribute -> token), as its tokenizer_config has them.
OMNI_SPECIAL = {
    "audio_token": "<|audio_pad|>", "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>",
    "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
    "image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
}
TTS_SPECIAL = ("<tts_pad>", "<tts_text_bos>", "<tts_text_eod>")
# Codec ids above the codebook, at the real offsets from it (real codebook 2048: pad 2148, eos 2150, ...).
CODEC = {"pad": CODEBOOK + 100, "bos": CODEBOOK + 101, "eos": CODEBOOK + 102, "nothink": CODEBOOK + 107,
         "think_bos": CODEBOOK + 108, "think_eos": CODEBOOK + 109}
SPEAKERS = {"chelsie": CODEBOOK + 253, "ethan": CODEBOOK + 254, "aiden": CODEBOOK + 255}

# Qwen3-Omni's chat template, restated for the tiny tokenizer: media parts become <bos><pad><eos> runs
# that the processor expands to one placeholder per feature row.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] in ('audio', 'input_audio', 'audio_url') -%}"
    "{{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}"
    "{%- elif part['type'] in ('video', 'video_url') -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def make_omni_tokenizer():
    """The tiny BPE of ``omnistage.testing.llm`` plus Qwen3-Omni's named special and tts tokens."""
    from transformers import PreTrainedTokenizerFast

    from omnistage.testing.llm import make_tokenizer

    base = make_tokenizer()
    base.add_special_tokens({"extra_special_tokens": [*OMNI_SPECIAL.values(), *TTS_SPECIAL]},
                            replace_extra_special_tokens=False)
    # Rebuilt so the named tokens become attributes (``tokenizer.image_token_id``) saved in
    # tokenizer_config.json, which is what Qwen3OmniMoeProcessor reads.
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer, eos_token=base.eos_token, pad_token=base.pad_token,
        chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False, model_max_length=base.model_max_length,
        extra_special_tokens=dict(OMNI_SPECIAL))
    if len(tokenizer) > THINKER_VOCAB:
        raise RuntimeError(f"tokenizer grew to {len(tokenizer)} ids; raise THINKER_VOCAB")
    return tokenizer


def _token_ids(tokenizer) -> dict[str, int]:
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in OMNI_SPECIAL.items()}
    ids.update(zip(("tts_pad", "tts_bos", "tts_eos"), tokenizer.convert_tokens_to_ids(list(TTS_SPECIAL))))
    ids.update(endoftext=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
               im_start=tokenizer.convert_tokens_to_ids("<|im_start|>"),
               im_end=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    # transformers finds turns by the token after <|im_start|>; the tiny BPE splits role names, so the
    # role's first piece stands for it (the real tokenizer has "user" etc. as single tokens).
    for role in ("system", "user", "assistant"):
        ids[role] = tokenizer(f"<|im_start|>{role}\n").input_ids[1]
    return ids


def make_config(ids: dict[str, int], text_overrides: dict | None = None):
    """The tiny ``Qwen3OmniMoeConfig``; ``ids`` as ``_token_ids`` returns them."""
    from transformers import Qwen3OmniMoeConfig

    # Interleaved MRoPE over head_dim 32 (16 frequencies: t 6, h 5, w 5 -- the real [24, 20, 20] / 4).
    mrope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [6, 5, 5], "interleaved": True}
    placeholders = dict(audio_token_id=ids["audio_token"], image_token_id=ids["image_token"],
                        video_token_id=ids["video_token"], audio_start_token_id=ids["audio_bos_token"],
                        vision_start_token_id=ids["vision_bos_token"])
    text = dict(vocab_size=THINKER_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                rope_parameters=mrope, initializer_range=0.5, decoder_sparse_step=1, moe_intermediate_size=32,
                num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[],
                tie_word_embeddings=False, eos_token_id=ids["im_end"], pad_token_id=ids["endoftext"])
    text.update(text_overrides or {})
    audio = dict(num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                 output_dim=64, max_source_positions=1500, n_window=50, n_window_infer=800, conv_chunksize=500,
                 downsample_hidden_size=16, initializer_range=0.5)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=64,
                  deepstack_visual_indexes=[0], initializer_range=0.5)
    thinker = dict(text_config=text, audio_config=audio, vision_config=vision, user_token_id=ids["user"],
                   initializer_range=0.5, position_id_per_seconds=25, audio_end_token_id=ids["audio_eos_token"],
                   vision_end_token_id=ids["vision_eos_token"], **placeholders)
    talker_text = dict(vocab_size=TALKER_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=8192,
                       rope_parameters={**mrope, "mrope_section": [4, 2, 2]}, moe_intermediate_size=32,
                       num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1,
                       shared_expert_intermediate_size=48, initializer_range=0.5)
    predictor = dict(vocab_size=CODEBOOK, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                     num_code_groups=NUM_CODE_GROUPS, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                     initializer_range=0.5)
    talker = dict(text_config=talker_text, code_predictor_config=predictor, num_code_groups=NUM_CODE_GROUPS,
                  thinker_hidden_size=64, accept_hidden_layer=2, codec_eos_token_id=CODEC["eos"],
                  codec_nothink_id=CODEC["nothink"], codec_think_bos_id=CODEC["think_bos"],
                  codec_think_eos_id=CODEC["think_eos"], codec_pad_id=CODEC["pad"], codec_bos_id=CODEC["bos"],
                  speaker_id=dict(SPEAKERS), spatial_merge_size=2, position_id_per_seconds=25,
                  initializer_range=0.5, **placeholders)
    # The real rates (8*5*4*3 upsampling x 2*2 ratios = 1920 samples per frame: 12.5 frames/s at 24 kHz).
    code2wav = dict(codebook_size=CODEBOOK, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                    num_hidden_layers=1, intermediate_size=64, sliding_window=8, num_quantizers=NUM_CODE_GROUPS,
                    decoder_dim=32, max_position_embeddings=8000, initializer_range=0.1)
    config = Qwen3OmniMoeConfig(
        thinker_config=thinker, talker_config=talker, code2wav_config=code2wav, im_start_token_id=ids["im_start"],
        im_end_token_id=ids["im_end"], tts_pad_token_id=ids["tts_pad"], tts_bos_token_id=ids["tts_bos"],
        tts_eos_token_id=ids["tts_eos"], system_token_id=ids["system"], user_token_id=ids["user"],
        assistant_token_id=ids["assistant"])
    # Read with getattr / attribute access by transformers but not declared by its config classes.
    config.talker_config.text_config.shared_expert_intermediate_size = talker_text["shared_expert_intermediate_size"]
    config.talker_config.spatial_merge_size = 2
    config.talker_config.audio_config = config.thinker_config.audio_config
    return config


def make_processor(tokenizer):
    """A ``Qwen3OmniMoeProcessor`` from tiny components (images: 32 px per token, 2-16 tokens)."""
    from transformers import Qwen3OmniMoeProcessor, WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    size = {"shortest_edge": 2 * 32 * 32, "longest_edge": 16 * 32 * 32}
    norm = dict(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    image = Qwen2VLImageProcessor(size=size, patch_size=16, temporal_patch_size=2, merge_size=2, **norm)
    video = Qwen2VLVideoProcessor(size=size, patch_size=16, temporal_patch_size=2, merge_size=2, **norm)
    audio = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160, chunk_length=30,
                                    n_fft=400)
    return Qwen3OmniMoeProcessor(image_processor=image, video_processor=video, feature_extractor=audio,
                                 tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)


def _draw_unset(model, generator: torch.Generator, std: float) -> None:
    """Draws what a fresh model leaves empty or zero: talker experts (``torch.empty``) and all routers."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            routed = name.endswith(("experts.gate_up_proj", "experts.down_proj")) and name.startswith("talker.")
            router = name.endswith("mlp.gate.weight")
            if routed or router:
                param.copy_(torch.randn(param.shape, generator=generator) * std)


def make_tiny_qwen3_omni(out_dir: str, seed: int = 0, text_overrides: dict | None = None,
                         weights: bool = True) -> str:
    """Writes the tiny Qwen3-Omni folder (see module docstring) and returns ``out_dir``; ``weights=False``:
    config, generation config and processor only (a folder for ``load_format="dummy"``)."""
    from transformers import GenerationConfig, Qwen3OmniMoeForConditionalGeneration

    tokenizer = make_omni_tokenizer()
    ids = _token_ids(tokenizer)
    config = make_config(ids, text_overrides)
    eos = [ids["im_end"], ids["endoftext"]]
    if not weights:
        os.makedirs(out_dir, exist_ok=True)
        config.architectures = [Qwen3OmniMoeForConditionalGeneration.__name__]
        config.save_pretrained(out_dir)
        GenerationConfig(eos_token_id=eos, pad_token_id=ids["endoftext"], do_sample=False).save_pretrained(out_dir)
        make_processor(tokenizer).save_pretrained(out_dir)
        return out_dir
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3OmniMoeForConditionalGeneration(config).to(torch.float32).eval()
        _draw_unset(model, torch.Generator().manual_seed(seed + 1), std=0.5)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=ids["endoftext"], do_sample=False)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    make_processor(tokenizer).save_pretrained(out_dir)
    return out_dir


def load_reference(path: str, dtype: torch.dtype = torch.float32):
    """transformers' ``Qwen3OmniMoeForConditionalGeneration`` from ``path``, in eval mode, with the talker's
    ``audio_config`` made a config object again (reloading leaves it a dict, and the talker reads
    ``audio_config.n_window`` for audio prompts)."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(path, dtype=dtype).eval()
    model.config.talker_config.audio_config = model.config.thinker_config.audio_config
    if hasattr(model, "talker"):
        model.talker.config.audio_config = model.config.thinker_config.audio_config
    return model


TOKENS = {f"codec_{k}": v for k, v in CODEC.items()}


def token_ids() -> dict[str, int]:
    """Every special id of the tiny checkpoint: thinker placeholders, roles, tts ids and ``TOKENS``."""
    return {**_token_ids(make_omni_tokenizer()), **TOKENS}
