"""Tiny random diffusers pipelines, written in the real on-disk layout, for tests and `make-tiny`.

In: an output folder. Out: the folder, holding `model_index.json` plus one sub-folder per component
(transformer, vae, text encoder(s), tokenizer(s), scheduler), saved with `save_pretrained` so that
loading them runs the same code path as a real checkpoint. Weights are random (seeded) and every
network has one or two layers, so a whole 2-step generation takes a fraction of a second on a CPU.
Runs in whatever process calls it; imports diffusers and transformers.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

_TINY_TEXT_DIM = 32


def _tokenizer(max_len: int = 512):
    """The project's tiny byte-level BPE tokenizer (Qwen-style special tokens and chat template)."""
    from omnistage.testing.llm import make_tokenizer

    tok = make_tokenizer()
    tok.model_max_length = max_len
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _vocab(tok) -> int:
    return max(len(tok), 256)


def _save(pipe, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    pipe.save_pretrained(out_dir)
    return out_dir


def _qwen25vl_text_encoder(vocab: int, vision_ids: dict | None = None):
    """`vision_ids` (image / video / vision start / vision end token ids) default to the vocabulary's top ids."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = vision_ids or dict(image_token_id=vocab - 1, video_token_id=vocab - 2, vision_start_token_id=vocab - 3,
                             vision_end_token_id=vocab - 4)

    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=_TINY_TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=_TINY_TEXT_DIM,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0]),
        **ids,
    )
    return Qwen2_5_VLForConditionalGeneration(cfg).eval()


def _qwen_image_parts(seed: int):
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    torch.manual_seed(seed)
    tok = _tokenizer(1024)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=_TINY_TEXT_DIM, guidance_embeds=False, axes_dims_rope=(4, 6, 6))
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1,
                                 temperal_downsample=[False], latents_mean=[0.1, -0.2, 0.0, 0.3],
                                 latents_std=[1.5, 0.8, 1.0, 1.2])
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, shift=1.0,
        use_dynamic_shifting=True, time_shift_type="exponential")
    return dict(transformer=transformer, vae=vae, text_encoder=_qwen25vl_text_encoder(_vocab(tok)),
                tokenizer=tok, scheduler=scheduler)


def build_qwen_image(out_dir: str, seed: int = 0) -> str:
    from diffusers import QwenImagePipeline

    return _save(QwenImagePipeline(**_qwen_image_parts(seed)), out_dir)


_VISION_TOKENS = {"vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>",
                  "image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>"}


def build_qwen_image_edit(out_dir: str, seed: int = 0) -> str:
    """Qwen-Image-Edit: the Qwen-Image parts with a VAE of 16x downscale (the condition image is encoded
    at ~1024x1024 whatever the output size), a Qwen2VLProcessor whose image processor keeps ~1 vision
    token per request, and the tiny tokenizer extended with the vision tokens of the prompt template."""
    from diffusers import AutoencoderKLQwenImage, QwenImageEditPipeline
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    parts = _qwen_image_parts(seed)
    tok = parts["tokenizer"]
    tok.add_special_tokens({"additional_special_tokens": list(_VISION_TOKENS.values())})
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in _VISION_TOKENS.items()}
    torch.manual_seed(seed + 1)
    parts["text_encoder"] = _qwen25vl_text_encoder(max(_vocab(tok), max(ids.values()) + 1), ids)
    parts["vae"] = AutoencoderKLQwenImage(base_dim=4, z_dim=4, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=0,
                                          temperal_downsample=[False] * 4, latents_mean=[0.1, -0.2, 0.0, 0.3],
                                          latents_std=[1.5, 0.8, 1.0, 1.2])
    with torch.no_grad():  # a random decoder this small maps any latents to one flat image: sharpen it
        for name, p in parts["vae"].decoder.named_parameters():
            if name.endswith("weight") and p.dim() == 5:
                p.mul_(3.0)
    small = dict(min_pixels=28 * 28, max_pixels=2 * 28 * 28, patch_size=14, merge_size=2, temporal_patch_size=2)
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(**small), tokenizer=tok,
                                 video_processor=Qwen2VLVideoProcessor(**small))
    return _save(QwenImageEditPipeline(processor=processor, **parts), out_dir)


def _clip_text(vocab: int, projection: bool, dim: int = _TINY_TEXT_DIM):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=77, projection_dim=dim,
                         bos_token_id=0, eos_token_id=2, pad_token_id=1)
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(cfg).eval()


def _t5(vocab: int, umt5: bool = False, dim: int = _TINY_TEXT_DIM):
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    kw = dict(vocab_size=vocab, d_model=dim, d_kv=8, d_ff=64, num_layers=2, num_heads=2,
              relative_attention_num_buckets=8, relative_attention_max_distance=32)
    if umt5:
        return UMT5EncoderModel(UMT5Config(**kw)).eval()
    return T5EncoderModel(T5Config(**kw)).eval()


def _kl_vae(latent_channels: int, shift: float, scale: float):
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
                         up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[8, 16], layers_per_block=1,
                         latent_channels=latent_channels, norm_num_groups=4, sample_size=32,
                         shift_factor=shift, scaling_factor=scale, use_quant_conv=False, use_post_quant_conv=False)


def build_flux(out_dir: str, seed: int = 0, guidance_embeds: bool = True) -> str:
    """FLUX.1-dev layout (guidance embedding); `guidance_embeds=False` gives the schnell layout."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(seed)
    tok, tok2 = _tokenizer(77), _tokenizer(512)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=_TINY_TEXT_DIM, pooled_projection_dim=_TINY_TEXT_DIM,
        guidance_embeds=guidance_embeds, axes_dims_rope=(4, 6, 6))
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15, shift=3.0,
        use_dynamic_shifting=guidance_embeds)
    pipe = FluxPipeline(transformer=transformer, vae=_kl_vae(4, 0.1159, 0.3611), scheduler=scheduler,
                        text_encoder=_clip_text(_vocab(tok), False), tokenizer=tok,
                        text_encoder_2=_t5(_vocab(tok2)), tokenizer_2=tok2)
    return _save(pipe, out_dir)


def build_flux_schnell(out_dir: str, seed: int = 0) -> str:
    return build_flux(out_dir, seed, guidance_embeds=False)


def build_sd3(out_dir: str, seed: int = 0) -> str:
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    torch.manual_seed(seed)
    tok, tok2, tok3 = _tokenizer(77), _tokenizer(77), _tokenizer(256)
    transformer = SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=2 * _TINY_TEXT_DIM, caption_projection_dim=16, pooled_projection_dim=2 * _TINY_TEXT_DIM,
        out_channels=4, pos_embed_max_size=32, dual_attention_layers=(0,), qk_norm="rms_norm")
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, vae=_kl_vae(4, 0.0609, 1.5305), scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        text_encoder=_clip_text(_vocab(tok), True), tokenizer=tok,
        text_encoder_2=_clip_text(_vocab(tok2), True), tokenizer_2=tok2,
        text_encoder_3=_t5(_vocab(tok3), dim=2 * _TINY_TEXT_DIM), tokenizer_3=tok3)
    return _save(pipe, out_dir)


def build_z_image(out_dir: str, seed: int = 0) -> str:
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(seed)
    tok = _tokenizer(512)
    text_encoder = Qwen3Model(Qwen3Config(
        vocab_size=_vocab(tok), hidden_size=_TINY_TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024)).eval()
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=2, n_refiner_layers=1,
        n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True, cap_feat_dim=_TINY_TEXT_DIM, rope_theta=256.0,
        t_scale=1000.0, axes_dims=[4, 6, 6], axes_lens=[256, 64, 64])
    with torch.no_grad():  # the pad tokens are torch.empty in diffusers: give them defined values
        for name, p in transformer.named_parameters():
            if "pad_token" in name:
                p.fill_(1.0)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    pipe = ZImagePipeline(transformer=transformer, vae=_kl_vae(4, 0.1159, 0.3611), scheduler=scheduler,
                          text_encoder=text_encoder, tokenizer=tok)
    return _save(pipe, out_dir)


def _wan_transformer(in_channels: int, image_dim=None):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=in_channels,
        out_channels=4, text_dim=_TINY_TEXT_DIM, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=image_dim,
        added_kv_proj_dim=16 if image_dim else None, rope_max_seq_len=32)


def _wan_common(seed: int):
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler

    torch.manual_seed(seed)
    tok = _tokenizer(512)
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
                           latents_mean=[0.1, -0.2, 0.0, 0.3], latents_std=[1.5, 0.8, 1.0, 1.2],
                           scale_factor_temporal=2, scale_factor_spatial=2)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                        num_train_timesteps=1000)
    return dict(vae=vae, scheduler=scheduler, text_encoder=_t5(_vocab(tok), umt5=True), tokenizer=tok)


def build_wan(out_dir: str, seed: int = 0, two_experts: bool = False) -> str:
    """Wan2.1 text-to-video; `two_experts=True` gives the Wan2.2 A14B layout (transformer_2 + boundary)."""
    from diffusers import WanPipeline

    parts = _wan_common(seed)
    extra = {}
    if two_experts:
        extra = dict(transformer_2=_wan_transformer(4), boundary_ratio=0.875)
    pipe = WanPipeline(transformer=_wan_transformer(4), **parts, **extra)
    return _save(pipe, out_dir)


def build_wan22(out_dir: str, seed: int = 0) -> str:
    return build_wan(out_dir, seed, two_experts=True)


def build_wan_i2v(out_dir: str, seed: int = 0) -> str:
    """Wan2.1 image-to-video: CLIP vision image encoder + 4 + 4 + 4 input channels (noise, mask, image)."""
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    parts = _wan_common(seed)
    image_encoder = CLIPVisionModel(CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=32,
        patch_size=8, projection_dim=16)).eval()
    image_processor = CLIPImageProcessor(crop_size=32, size={"shortest_edge": 32})
    pipe = WanImageToVideoPipeline(transformer=_wan_transformer(4 + 2 + 4, image_dim=16), image_encoder=image_encoder,
                                   image_processor=image_processor, **parts)
    return _save(pipe, out_dir)


DIFFUSION_TINY_BUILDERS: dict[str, Callable[[str], str]] = {
    "qwen-image": build_qwen_image,
    "qwen-image-edit": build_qwen_image_edit,
    "flux": build_flux,
    "flux-schnell": build_flux_schnell,
    "sd3": build_sd3,
    "z-image": build_z_image,
    "wan": build_wan,
    "wan2.2": build_wan22,
    "wan-i2v": build_wan_i2v,
}
