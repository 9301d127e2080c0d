"""Chat messages with images, audio and video -> Qwen3-Omni thinker prompts (the entry point's process; CPU or CUDA).

In: OpenAI-style messages as `models.qwen2_5_omni.processor` reads them (text, decoded images,
(samples, rate) audio, decoded video frames + fps; frames only, no audio track), rendered and
expanded to placeholder runs by that module's `build_thinker_inputs` with the checkpoint's own
`Qwen3OmniMoeProcessor` (image / video placeholders: grid_t*grid_h*grid_w/4 each; audio: the AuT
encoder's output length).
Out: `thinker_prompt(encoders, inputs) -> dict` of `ARPrompt` fields:
  * `prompt_embeds` [T, H]: token embeddings with the audio encoder's rows over `<|audio_pad|>` and the
    vision encoder's merged rows over `<|image_pad|>` / `<|video_pad|>`, in order;
  * `layer_embeds` [L, T, H]: the vision encoder's deepstack features (one per
    `deepstack_visual_indexes` entry) at the image / video positions, zero elsewhere -- added after
    decoder layers 0..L-1, as transformers' thinker does;
  * `mrope_positions` [3, T] and `mrope_delta` from transformers' `get_rope_index` when the prompt
    has an image or a video (audio and text alone keep 1-D positions there too).
`encoders` is `load_thinker_encoders(model_dir, device, dtype)`: transformers'
`Qwen3OmniMoeThinkerModel` with the token embeddings, audio tower and vision tower and no decoder layers.
"""

from __future__ import annotations

from typing import Any

import torch

from omnistage.models import loader
from omnistage.models.qwen2_5_omni.processor import ThinkerInputs, scatter_rows


# Tensor-name prefixes the renderer loads beside the thinker stage.
ENCODER_WEIGHTS = ("thinker.audio_tower.", "thinker.visual.", "thinker.model.embed_tokens.")


def load_thinker_encoders(model_dir: str, device: torch.device, dtype: torch.dtype):
    """transformers' thinker model without decoder layers: embeddings, audio and vision towers, rope index."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerModel

    return loader.load_thinker_encoders(Qwen3OmniMoeThinkerModel, model_dir, ENCODER_WEIGHTS, device, dtype)


@torch.no_grad()
def thinker_prompt(encoders, inputs: ThinkerInputs) -> dict[str, Any]:
    """The embedding-level `ARPrompt` fields of one rendered prompt (see the module docstring)."""
    config, device = encoders.config, encoders.device
    ids = inputs.input_ids.to(device)
    embeds = encoders.get_input_embeddings()(ids)[0]
    out: dict[str, Any] = {}
    if inputs["input_features"] is not None:
        audio = encoders.get_audio_features(inputs["input_features"].to(device, embeds.dtype),
                                            inputs["feature_attention_mask"].to(device)).last_hidden_state
        embeds = scatter_rows(embeds, ids[0] == config.audio_token_id, audio, "audio")
    deep = None
    for kind, pixels, grid, token in (("image", "pixel_values", "image_grid_thw", config.image_token_id),
                                      ("video", "pixel_values_videos", "video_grid_thw", config.video_token_id)):
        if inputs[pixels] is None:
            continue
        get = encoders.get_image_features if kind == "image" else encoders.get_video_features
        feats = get(inputs[pixels].to(device, embeds.dtype), inputs[grid].to(device))
        mask = ids[0] == token
        embeds = scatter_rows(embeds, mask, torch.cat(feats.pooler_output), kind)
        if deep is None:
            deep = embeds.new_zeros(len(feats.deepstack_features), *embeds.shape)
        for layer, rows in enumerate(feats.deepstack_features):
            deep[layer] = scatter_rows(deep[layer], mask, torch.cat(rows), kind)
    if inputs["input_features"] is None and deep is None:
        return out                              # text only: the thinker's own embedding lookup
    out["prompt_embeds"] = embeds
    if deep is not None:
        out["layer_embeds"] = deep
        positions, delta = thinker_positions(encoders, inputs)
        out["mrope_positions"] = positions[:, 0].long().cpu()
        out["mrope_delta"] = int(delta.reshape(-1)[0])
    return out


@torch.no_grad()
def thinker_positions(encoders, inputs: ThinkerInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids [3, 1, T], rope delta [1, 1]) from transformers' `get_rope_index`."""
    mask = inputs["feature_attention_mask"]
    return encoders.get_rope_index(
        inputs.input_ids, inputs["image_grid_thw"], inputs["video_grid_thw"], inputs.attention_mask,
        False, None if mask is None else mask.sum(-1), inputs["video_second_per_grid"])
