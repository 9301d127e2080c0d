"""Tiny Qwen3-TTS (12 Hz) checkpoints in the real folder layout, random weights built in code.

`make_tiny_qwen3_tts(out_dir, variant)` writes what a Hugging Face Qwen3-TTS folder holds:
config.json (`model_type` "qwen3_tts", the talker + code predictor config), model.safetensors
(`talker.*`, and `speaker_encoder.*` for Base), generation_config.json, the text tokenizer
(tokenizer.json + tokenizer_config.json: the tiny BPE of `testing/llm.py` plus "assistant" /
"user" as single tokens, so the ChatML slicing of the reference holds), and speech_tokenizer/
(config.json `model_type` "qwen3_tts_tokenizer_12hz", preprocessor_config.json, model.safetensors
with the Mimi encoder and the code -> 24 kHz decoder). Variants: "custom_voice" (preset speakers),
"voice_design" (no speakers, an instruction describes the voice), "base" (cloning: + speaker
encoder). The same folder loads in `qwen-tts` 0.1.1 (scripts/qwen_tts_reference/) and in
`omnistage.models.qwen3_tts`. Runs in the caller's process, on the CPU, in about a second; the
folder is under 2 MB.

Shapes keep what the reference code hard-codes: the talker's vocabulary is the codebook size +
1024 (its special ids live in the top 1024 rows, which `generate` suppresses), and the decoder
upsamples by 8*5*4*3*2*2 = 1920 (24 kHz at 12.5 frames/s).
"""

from __future__ import annotations

import json
import os
from typing import Iterator

import torch

VARIANTS = ("custom_voice", "voice_design", "base")
SAMPLE_RATE = 24000
CODEBOOK = 128                                  # codes per codebook (decoder `codebook_size`)
NUM_GROUPS = 4                                  # codebooks per frame (talker group 0 + predictor 1..3)
TEXT_VOCAB = 800
CODEC_IDS = {"codec_pad_id": 1100, "codec_bos_id": 1101, "codec_eos_token_id": 1102, "codec_think_id": 1103,
             "codec_nothink_id": 1104, "codec_think_bos_id": 1105, "codec_think_eos_id": 1106}
SPEAKERS = {"vivian": 1110, "ryan": 1111}
LANGUAGES = {"english": 1120, "chinese": 1121}
TTS_TEXT_IDS = {"tts_pad_token_id": 790, "tts_bos_token_id": 791, "tts_eos_token_id": 792}
_RATES = dict(upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], layer_scale_initial_scale=0.01, rms_norm_eps=1e-5,
              rope_theta=10000, max_position_embeddings=8000, hidden_act="silu", attention_bias=False)
# Network shapes: the tiny one of the tests, and Qwen3-TTS-12Hz-1.7B's (benchmarks, random weights).
TINY = dict(
    codebook=CODEBOOK, groups=NUM_GROUPS, text_vocab=TEXT_VOCAB,
    talker=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, text_hidden_size=32),
    predictor=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=8),
    decoder=dict(codebook_dim=8, hidden_size=16, latent_dim=16, num_attention_heads=2, num_key_value_heads=2,
                 head_dim=8, intermediate_size=32, num_hidden_layers=2, sliding_window=8, decoder_dim=32, **_RATES))
SHAPE_1_7B = dict(
    codebook=2048, groups=16, text_vocab=151936,
    talker=dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                num_key_value_heads=8, head_dim=128, text_hidden_size=2048),
    predictor=dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=5, num_attention_heads=16,
                   num_key_value_heads=8, head_dim=128),
    decoder=dict(codebook_dim=512, hidden_size=512, latent_dim=1024, num_attention_heads=16, num_key_value_heads=16,
                 head_dim=64, intermediate_size=1024, num_hidden_layers=8, sliding_window=72, decoder_dim=1536,
                 **_RATES))
SPEAKER_ENCODER = dict(mel_dim=128, enc_dim=TINY["talker"]["hidden_size"], enc_channels=[16, 16, 16, 16, 48],
                       enc_kernel_sizes=[5, 3, 3, 3, 1], enc_dilations=[1, 2, 3, 4, 1], enc_attention_channels=8,
                       enc_res2net_scale=4, enc_se_channels=8, sample_rate=SAMPLE_RATE)


def make_text_tokenizer():
    """The tiny BPE with "assistant" and "user" as whole tokens (the reference slices ChatML by count)."""
    from omnistage.testing.llm import make_tokenizer

    tokenizer = make_tokenizer()
    tokenizer.add_tokens(["assistant", "user"])
    if len(tokenizer) > min(TTS_TEXT_IDS.values()):
        raise RuntimeError(f"tokenizer grew to {len(tokenizer)} ids; move the tts text ids above it")
    return tokenizer


def make_config(variant: str, tokenizer, shape: dict = TINY, dtype: str = "float32") -> dict:
    """config.json of a tiny Qwen3-TTS folder (the reference's `Qwen3TTSConfig` fields)."""
    head = shape["talker"]["head_dim"]
    talker = dict(shape["talker"], vocab_size=shape["codebook"] + 1024, text_vocab_size=shape["text_vocab"],
                  num_code_groups=shape["groups"],
                  hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000,
                  rope_scaling={"rope_type": "default", "mrope_section": [head // 4, head // 8, head // 8],
                                "interleaved": True},
                  code_predictor_config=dict(shape["predictor"], vocab_size=shape["codebook"],
                                             num_code_groups=shape["groups"],
                                             hidden_act="silu", max_position_embeddings=64, rms_norm_eps=1e-6,
                                             rope_theta=10000),
                  spk_id=dict(SPEAKERS) if variant == "custom_voice" else {},
                  spk_is_dialect={name: False for name in SPEAKERS} if variant == "custom_voice" else {},
                  codec_language_id=dict(LANGUAGES), **CODEC_IDS)
    return dict(architectures=["Qwen3TTSForConditionalGeneration"], model_type="qwen3_tts",
                tokenizer_type="qwen3_tts_tokenizer_12hz", tts_model_size="1b7", tts_model_type=variant,
                im_start_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
                im_end_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), **TTS_TEXT_IDS,
                talker_config=talker, speaker_encoder_config=dict(SPEAKER_ENCODER), torch_dtype=dtype)


def _mimi_config():
    """The speech tokenizer's encoder: a tiny Mimi at 12.5 frames/s (24 kHz / (8*6*5*4) / 2)."""
    from transformers import MimiConfig

    return MimiConfig(hidden_size=16, num_filters=4, num_residual_layers=1, upsampling_ratios=[8, 6, 5, 4],
                      kernel_size=7, last_kernel_size=3, residual_kernel_size=3, dilation_growth_rate=2,
                      codebook_size=CODEBOOK, codebook_dim=8, num_quantizers=NUM_GROUPS, num_semantic_quantizers=1,
                      vector_quantization_hidden_dimension=8, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=8, intermediate_size=32, sliding_window=16,
                      max_position_embeddings=512, frame_rate=12.5, sampling_rate=SAMPLE_RATE,
                      use_cache=False, layer_scale_initial_scale=0.01, upsample_groups=16)


def speech_tokenizer_config(shape: dict = TINY) -> dict:
    mimi = _mimi_config().to_dict()
    for key in ("architectures", "transformers_version", "_name_or_path", "dtype", "torch_dtype"):
        mimi.pop(key, None)
    return dict(architectures=["Qwen3TTSTokenizerV2Model"], model_type="qwen3_tts_tokenizer_12hz",
                encoder_config=mimi, decoder_config=_decoder_config(shape),
                encoder_valid_num_quantizers=NUM_GROUPS,
                input_sample_rate=SAMPLE_RATE, output_sample_rate=SAMPLE_RATE, decode_upsample_rate=1920,
                encode_downsample_rate=1920)


def _decoder_config(shape: dict) -> dict:
    return dict(shape["decoder"], codebook_size=shape["codebook"], num_quantizers=shape["groups"])


# ---- weights ------------------------------------------------------------------------------------
def _qwen3_layer(prefix: str, hidden: int, inter: int, heads: int, kv: int, head_dim: int,
                 qk_norm: bool = True) -> Iterator[tuple[str, tuple, str]]:
    """(name, shape, init) of one Qwen3-style decoder layer."""
    a = f"{prefix}self_attn."
    yield a + "q_proj.weight", (heads * head_dim, hidden), "w"
    yield a + "k_proj.weight", (kv * head_dim, hidden), "w"
    yield a + "v_proj.weight", (kv * head_dim, hidden), "w"
    yield a + "o_proj.weight", (hidden, heads * head_dim), "w"
    if qk_norm:
        yield a + "q_norm.weight", (head_dim,), "one"
        yield a + "k_norm.weight", (head_dim,), "one"
    yield prefix + "mlp.gate_proj.weight", (inter, hidden), "w"
    yield prefix + "mlp.up_proj.weight", (inter, hidden), "w"
    yield prefix + "mlp.down_proj.weight", (hidden, inter), "w"
    yield prefix + "input_layernorm.weight", (hidden,), "one"
    yield prefix + "post_attention_layernorm.weight", (hidden,), "one"


def talker_shapes(shape: dict = TINY) -> Iterator[tuple[str, tuple, str]]:
    t, p, book, vocab = shape["talker"], shape["predictor"], shape["codebook"], shape["codebook"] + 1024
    h, th = t["hidden_size"], t["text_hidden_size"]
    yield "talker.model.codec_embedding.weight", (vocab, h), "e"
    yield "talker.model.text_embedding.weight", (shape["text_vocab"], th), "e"
    for i in range(t["num_hidden_layers"]):
        yield from _qwen3_layer(f"talker.model.layers.{i}.", h, t["intermediate_size"], t["num_attention_heads"],
                                t["num_key_value_heads"], t["head_dim"])
    yield "talker.model.norm.weight", (h,), "one"
    yield "talker.text_projection.linear_fc1.weight", (th, th), "w"
    yield "talker.text_projection.linear_fc1.bias", (th,), "b"
    yield "talker.text_projection.linear_fc2.weight", (h, th), "w"
    yield "talker.text_projection.linear_fc2.bias", (h,), "b"
    yield "talker.codec_head.weight", (vocab, h), "e"
    cp = "talker.code_predictor."
    for i in range(p["num_hidden_layers"]):
        yield from _qwen3_layer(f"{cp}model.layers.{i}.", p["hidden_size"], p["intermediate_size"],
                                p["num_attention_heads"], p["num_key_value_heads"], p["head_dim"])
    yield cp + "model.norm.weight", (p["hidden_size"],), "one"
    for g in range(shape["groups"] - 1):
        yield f"{cp}model.codec_embedding.{g}.weight", (book, h), "e"
        yield f"{cp}lm_head.{g}.weight", (book, p["hidden_size"]), "e"
    yield cp + "small_to_mtp_projection.weight", (p["hidden_size"], h), "w"
    yield cp + "small_to_mtp_projection.bias", (p["hidden_size"],), "b"


def speaker_encoder_shapes() -> Iterator[tuple[str, tuple, str]]:
    """The x-vector encoder (ECAPA-TDNN: TDNN, SE-Res2Net blocks, attentive pooling, 1x1 conv out)."""
    s = SPEAKER_ENCODER
    ch, ks, scale = s["enc_channels"], s["enc_kernel_sizes"], s["enc_res2net_scale"]
    pre = "speaker_encoder."
    yield f"{pre}blocks.0.conv.weight", (ch[0], s["mel_dim"], ks[0]), "w"
    yield f"{pre}blocks.0.conv.bias", (ch[0],), "b"
    for i in range(1, len(ch) - 1):
        b = f"{pre}blocks.{i}."
        for name, cin in (("tdnn1", ch[i - 1]), ("tdnn2", ch[i])):
            yield f"{b}{name}.conv.weight", (ch[i], cin, 1), "w"
            yield f"{b}{name}.conv.bias", (ch[i],), "b"
        width = ch[i] // scale
        for j in range(scale - 1):
            yield f"{b}res2net_block.blocks.{j}.conv.weight", (width, width, ks[i]), "w"
            yield f"{b}res2net_block.blocks.{j}.conv.bias", (width,), "b"
        yield f"{b}se_block.conv1.weight", (s["enc_se_channels"], ch[i], 1), "w"
        yield f"{b}se_block.conv1.bias", (s["enc_se_channels"],), "b"
        yield f"{b}se_block.conv2.weight", (ch[i], s["enc_se_channels"], 1), "w"
        yield f"{b}se_block.conv2.bias", (ch[i],), "b"
    yield f"{pre}mfa.conv.weight", (ch[-1], ch[-1], ks[-1]), "w"
    yield f"{pre}mfa.conv.bias", (ch[-1],), "b"
    att = s["enc_attention_channels"]
    yield f"{pre}asp.tdnn.conv.weight", (att, ch[-1] * 3, 1), "w"
    yield f"{pre}asp.tdnn.conv.bias", (att,), "b"
    yield f"{pre}asp.conv.weight", (ch[-1], att, 1), "w"
    yield f"{pre}asp.conv.bias", (ch[-1],), "b"
    yield f"{pre}fc.weight", (s["enc_dim"], ch[-1] * 2, 1), "w"
    yield f"{pre}fc.bias", (s["enc_dim"],), "b"


def decoder_shapes(shape: dict = TINY) -> Iterator[tuple[str, tuple, str]]:
    """The speech tokenizer's decoder (`decoder.*`): RVQ tables, pre-conv, sliding-window transformer,
    ConvNeXt upsampling, snake-activated transposed-conv blocks."""
    d = _decoder_config(shape)
    dim, cdim, latent, hid = d["codebook_dim"] // 2, d["codebook_dim"], d["latent_dim"], d["hidden_size"]
    for part, n in (("rvq_first", 1), ("rvq_rest", d["num_quantizers"] - 1)):
        q = f"decoder.quantizer.{part}."
        yield q + "input_proj.weight", (dim, cdim, 1), "w"
        yield q + "output_proj.weight", (cdim, dim, 1), "w"
        for i in range(n):
            yield f"{q}vq.layers.{i}._codebook.cluster_usage", (d["codebook_size"],), "usage"
            yield f"{q}vq.layers.{i}._codebook.embedding_sum", (d["codebook_size"], dim), "e1"
    yield "decoder.pre_conv.conv.weight", (latent, cdim, 3), "c"
    yield "decoder.pre_conv.conv.bias", (latent,), "b"
    t = "decoder.pre_transformer."
    for i in range(d["num_hidden_layers"]):
        yield from _qwen3_layer(f"{t}layers.{i}.", hid, d["intermediate_size"], d["num_attention_heads"],
                                d["num_key_value_heads"], d["head_dim"], qk_norm=False)
        yield f"{t}layers.{i}.self_attn_layer_scale.scale", (hid,), "scale"
        yield f"{t}layers.{i}.mlp_layer_scale.scale", (hid,), "scale"
    yield t + "norm.weight", (hid,), "one"
    yield t + "input_proj.weight", (hid, latent), "w"
    yield t + "input_proj.bias", (hid,), "b"
    yield t + "output_proj.weight", (latent, hid), "w"
    yield t + "output_proj.bias", (latent,), "b"
    for k, factor in enumerate(d["upsampling_ratios"]):
        u = f"decoder.upsample.{k}."
        yield u + "0.conv.weight", (latent, latent, factor), "c"
        yield u + "0.conv.bias", (latent,), "b"
        yield u + "1.dwconv.conv.weight", (latent, 1, 7), "c"
        yield u + "1.dwconv.conv.bias", (latent,), "b"
        yield u + "1.norm.weight", (latent,), "one"
        yield u + "1.norm.bias", (latent,), "b"
        yield u + "1.pwconv1.weight", (4 * latent, latent), "w"
        yield u + "1.pwconv1.bias", (4 * latent,), "b"
        yield u + "1.pwconv2.weight", (latent, 4 * latent), "w"
        yield u + "1.pwconv2.bias", (latent,), "b"
        yield u + "1.gamma", (latent,), "scale"
    yield "decoder.decoder.0.conv.weight", (d["decoder_dim"], latent, 7), "c"
    yield "decoder.decoder.0.conv.bias", (d["decoder_dim"],), "b"
    rates = d["upsample_rates"]
    for i, rate in enumerate(rates):
        cin, cout = d["decoder_dim"] // 2 ** i, d["decoder_dim"] // 2 ** (i + 1)
        b = f"decoder.decoder.{i + 1}.block."
        yield b + "0.alpha", (cin,), "snake"
        yield b + "0.beta", (cin,), "snake"
        yield b + "1.conv.weight", (cin, cout, 2 * rate), "c"
        yield b + "1.conv.bias", (cout,), "b"
        for j in range(3):
            r = f"{b}{j + 2}."
            for act in ("act1", "act2"):
                yield f"{r}{act}.alpha", (cout,), "snake"
                yield f"{r}{act}.beta", (cout,), "snake"
            yield r + "conv1.conv.weight", (cout, cout, 7), "c"
            yield r + "conv1.conv.bias", (cout,), "b"
            yield r + "conv2.conv.weight", (cout, cout, 1), "c"
            yield r + "conv2.conv.bias", (cout,), "b"
    out = d["decoder_dim"] // 2 ** len(rates)
    n = len(rates) + 1
    yield f"decoder.decoder.{n}.alpha", (out,), "snake"
    yield f"decoder.decoder.{n}.beta", (out,), "snake"
    yield f"decoder.decoder.{n + 1}.conv.weight", (1, out, 7), "out"
    yield f"decoder.decoder.{n + 1}.conv.bias", (1,), "b"


def _init(shape: tuple, how: str, g: torch.Generator) -> torch.Tensor:
    if how == "one":
        return torch.ones(shape)
    if how == "usage":
        return 0.5 + torch.rand(shape, generator=g)
    if how == "scale":
        return torch.full(shape, 0.1)
    if how == "snake":
        return 0.1 * torch.randn(shape, generator=g)
    fan_in = max(1, int(torch.tensor(shape[1:]).prod().item())) if len(shape) > 1 else 1
    # "out": the decoder's last conv, small, so the tiny waveform stays mostly inside the [-1, 1] clamp
    std = {"w": fan_in ** -0.5, "c": fan_in ** -0.5, "out": 0.02 * fan_in ** -0.5, "e": 0.5, "e1": 1.0, "b": 0.02}[how]
    return std * torch.randn(shape, generator=g)


def random_weights(shapes: Iterator[tuple[str, tuple, str]], g: torch.Generator,
                   dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {name: _init(shape, how, g).to(dtype).contiguous() for name, shape, how in shapes}


# transformers 5 groups Mimi's encoder half under `encoder.`; checkpoints (and qwen-tts' pin) name them flat.
MIMI_RENAMES = (("encoder.encoder_seanet.", "encoder."), ("encoder.encoder_transformer.", "encoder_transformer."),
                ("encoder.downsample.", "downsample."))


def _mimi_encoder_weights(seed: int) -> dict[str, torch.Tensor]:
    """`encoder.*`: a random tiny transformers `MimiModel` without its decoder half (as the reference drops it)."""
    from transformers import MimiModel

    torch.manual_seed(seed)
    model = MimiModel(_mimi_config())
    dropped = ("upsample.", "decoder_transformer.", "decoder.")
    g = torch.Generator().manual_seed(seed + 1)
    out = {}
    for name, tensor in model.state_dict().items():
        if name.startswith(dropped):
            continue
        # a fresh model's codebooks are all zero (every frame would get code 0): random ones, as trained ones are
        if name.endswith("codebook.embed_sum"):
            tensor = 0.3 * torch.randn(tensor.shape, generator=g)
        elif name.endswith("codebook.cluster_usage"):
            tensor = 0.5 + torch.rand(tensor.shape, generator=g)
        for new, old in MIMI_RENAMES:           # our transformers' names -> the checkpoints' (transformers 4.5x)
            if name.startswith(new):
                name = old + name[len(new):]
                break
        out[f"encoder.{name}"] = tensor.detach().clone().contiguous()
    return out


def make_tiny_qwen3_tts(out_dir: str, variant: str = "custom_voice", seed: int = 0, shape: dict = TINY,
                        dtype: torch.dtype = torch.float32) -> str:
    """Writes a Qwen3-TTS folder of `variant` (one of `VARIANTS`) to `out_dir`, random weights of
    `shape` (TINY, or SHAPE_1_7B for benchmarks) in `dtype`; returns the folder."""
    from safetensors.torch import save_file

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    os.makedirs(os.path.join(out_dir, "speech_tokenizer"), exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tokenizer = make_text_tokenizer()
    tokenizer.save_pretrained(out_dir)
    _write_json(os.path.join(out_dir, "config.json"), make_config(variant, tokenizer, shape, str(dtype).removeprefix("torch.")))
    _write_json(os.path.join(out_dir, "generation_config.json"), {
        "do_sample": True, "repetition_penalty": 1.05, "temperature": 0.9, "top_p": 1.0, "top_k": 50,
        "subtalker_dosample": True, "subtalker_temperature": 0.9, "subtalker_top_k": 50, "subtalker_top_p": 1.0,
        "max_new_tokens": 2048})
    shapes = list(talker_shapes(shape)) + (list(speaker_encoder_shapes()) if variant == "base" else [])
    save_file(random_weights(iter(shapes), g, dtype), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    st = os.path.join(out_dir, "speech_tokenizer")
    _write_json(os.path.join(st, "config.json"), speech_tokenizer_config(shape))
    _write_json(os.path.join(st, "preprocessor_config.json"), {
        "feature_extractor_type": "EncodecFeatureExtractor", "feature_size": 1, "padding_side": "right",
        "padding_value": 0.0, "return_attention_mask": True, "sampling_rate": SAMPLE_RATE,
        "chunk_length_s": None, "overlap": None})
    weights = {**_mimi_encoder_weights(seed), **random_weights(decoder_shapes(shape), g)}
    save_file(weights, os.path.join(st, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
