"""Chat messages with images, audio and video -> the thinker's input ids, media features, merged
input embeddings and 3D rope positions (the entry point's process; CPU or CUDA).

In: OpenAI-style messages whose `content` is a string or a list of parts:
  {"type": "text", "text": str}
  {"type": "image" | "image_url", "image" | "image_url": PIL.Image}   (decoded already; URLs are
      fetched and decoded by omnistage.io before this point)
  {"type": "audio" | "input_audio", "audio" | "input_audio": (samples, sample_rate)}  (mono float
      samples at any rate; resampled to the feature extractor's 16 kHz with soxr)
  {"type": "video" | "video_url", "video" | "video_url": frames, "fps": float (optional)}  (frames
      already sampled and decoded -- omnistage.io decodes video_url data URLs at 2 fps -- as a list
      of PIL images or a uint8 array [T, H, W, 3]; all of them are used, none is resampled here.
      `fps` is the rate they were sampled at, default 2.0 as transformers' processor assumes; it
      sets `video_second_per_grid` = temporal_patch_size / fps, hence the temporal rope positions.
      Frames only: the video's audio track is not read, i.e. use_audio_in_video=False)
Out:
  * `build_thinker_inputs(processor, messages) -> ThinkerInputs`: the rendered prompt, `input_ids`
    [1, T] with one placeholder id per encoder output row (`<|IMAGE|>` / `<|VIDEO|>` x
    grid_t*grid_h*grid_w/4, `<|AUDIO|>` x ((frames-1)//2+1-2)//2+1), and the encoder inputs of the
    checkpoint's own `Qwen2_5OmniProcessor` (`input_features`, `feature_attention_mask`,
    `pixel_values`, `image_grid_thw`, `pixel_values_videos`, `video_grid_thw`,
    `video_second_per_grid`).
  * `thinker_input_embeds(thinker, inputs) -> [1, T, hidden]`: token embeddings with the audio
    encoder's rows written over the `<|AUDIO|>` positions and the vision encoder's (after its
    2x2 patch merger) over the `<|IMAGE|>` and `<|VIDEO|>` positions, in order -- what
    transformers' thinker feeds its first decoder layer.
  * `thinker_positions(thinker, inputs) -> (position_ids [3, 1, T], delta [1, 1])`: transformers'
    `get_rope_index`; decode step k of the answer then uses position T + k + delta on all 3 rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

_IMAGE_TYPES = ("image", "image_url")
_AUDIO_TYPES = ("audio", "input_audio")
_VIDEO_TYPES = ("video", "video_url")
DEFAULT_VIDEO_FPS = 2.0                         # transformers' processor assumes it when given none


@dataclass
class ThinkerInputs:
    text: str                                   # the prompt the chat template rendered
    input_ids: torch.Tensor                     # [1, T] long, media expanded to placeholder runs
    attention_mask: torch.Tensor                # [1, T] long, all ones
    features: dict[str, torch.Tensor] = field(default_factory=dict)  # encoder inputs by processor name

    def __getitem__(self, name: str) -> Any:
        return self.features.get(name)


def _image(part: dict):
    from PIL import Image

    value = part.get(part["type"])
    if isinstance(value, dict):                 # {"url": image} as the OpenAI image_url part nests it
        value = value.get("url")
    if not isinstance(value, Image.Image):
        raise ValueError(f"an {part['type']} part must carry a decoded PIL image, got {type(value).__name__}")
    return value.convert("RGB")


def _audio(part: dict, rate: int) -> np.ndarray:
    value = part.get(part["type"])
    if isinstance(value, dict):
        value = (value.get("samples"), value.get("sample_rate"))
    if not (isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[1], int) and value[1] > 0):
        raise ValueError(f"an {part['type']} part must carry (samples, sample_rate), got {type(value).__name__}")
    samples = np.asarray(value[0], dtype=np.float32)
    if samples.ndim == 2:                       # [samples, channels] -> mono
        samples = samples.mean(axis=1)
    if value[1] != rate:
        import soxr

        samples = soxr.resample(samples, value[1], rate).astype(np.float32)
    return samples


def _video(part: dict) -> tuple[np.ndarray, float]:
    """A video part -> (uint8 frames [T, H, W, 3], frames per second)."""
    from PIL import Image

    kind, value = part["type"], part.get(part["type"])
    if isinstance(value, dict):                 # {"url": frames} as a decoded video_url part may nest it
        value = value.get("url")
    if isinstance(value, (list, tuple)) and value and all(isinstance(f, Image.Image) for f in value):
        if len({f.size for f in value}) != 1:
            raise ValueError(f"the frames of a {kind} part must all be one size, got {sorted({f.size for f in value})}")
        value = np.stack([np.asarray(f.convert("RGB")) for f in value])
    frames = value if isinstance(value, np.ndarray) else None
    if frames is None or frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or len(frames) < 1:
        got = f"{frames.dtype} {frames.shape}" if frames is not None else type(value).__name__
        raise ValueError(f"a {kind} part must carry decoded frames: a list of PIL images or a uint8 array "
                         f"[T, H, W, 3] with T >= 1; got {got}")
    fps = part.get("fps", DEFAULT_VIDEO_FPS)
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps < float("inf"):
        raise ValueError(f"the fps of a {kind} part must be a positive number of frames per second, got {fps!r}")
    return frames, float(fps)


def build_thinker_inputs(processor, messages: list[dict], add_generation_prompt: bool = True,
                         **template_kwargs) -> ThinkerInputs:
    """Renders `messages` with the checkpoint's chat template (extra keywords go to the template)
    and runs its processor (see module doc)."""
    rate = processor.feature_extractor.sampling_rate
    images, audios, videos, rates, rendered = [], [], [], [], []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) or content is None:
            rendered.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type")
            if kind in _IMAGE_TYPES:
                images.append(_image(part))
                parts.append({"type": "image"})
            elif kind in _AUDIO_TYPES:
                audios.append(_audio(part, rate))
                parts.append({"type": "audio"})
            elif kind in _VIDEO_TYPES:
                frames, fps = _video(part)
                videos.append(frames)
                rates.append(fps)
                parts.append({"type": "video"})
            elif kind == "text":
                parts.append({"type": "text", "text": part.get("text", "")})
            else:
                raise ValueError(f"message part type must be one of text, "
                                 f"{', '.join(_IMAGE_TYPES + _AUDIO_TYPES + _VIDEO_TYPES)}; got {kind!r}")
        rendered.append({**message, "content": parts})
    text = processor.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt, tokenize=False,
                                         **template_kwargs)
    # The frames are used as given (no sampling by the video processor); the processor takes one fps
    # for all videos, so each video's seconds per temporal patch is written from its own rate below.
    video_kwargs = {"videos": videos, "videos_kwargs": {"do_sample_frames": False}} if videos else {}
    batch = processor(text=text, images=images or None, audio=audios or None, return_tensors="pt", **video_kwargs)
    features = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask") and torch.is_tensor(v)}
    if videos:
        patch = processor.video_processor.temporal_patch_size
        features["video_second_per_grid"] = torch.tensor([patch / fps for fps in rates],
                                                         dtype=features["video_second_per_grid"].dtype)
    return ThinkerInputs(text, batch["input_ids"], batch["attention_mask"], features)


@torch.no_grad()
def thinker_input_embeds(thinker, inputs: ThinkerInputs) -> torch.Tensor:
    """Merged input embeddings [1, T, hidden] (`thinker`: a Qwen2_5OmniThinkerForConditionalGeneration)."""
    model, config = thinker.model, thinker.config
    ids = inputs.input_ids.to(thinker.device)
    embeds = model.get_input_embeddings()(ids)
    if inputs["input_features"] is not None:
        audio = model.get_audio_features(inputs["input_features"].to(thinker.device, embeds.dtype),
                                         inputs["feature_attention_mask"].to(thinker.device)).last_hidden_state
        embeds = scatter_rows(embeds, ids == config.audio_token_index, audio, "audio")
    if inputs["pixel_values"] is not None:
        grid = inputs["image_grid_thw"].to(thinker.device)
        image = torch.cat(model.get_image_features(inputs["pixel_values"].to(thinker.device), grid).pooler_output)
        embeds = scatter_rows(embeds, ids == config.image_token_index, image, "image")
    if inputs["pixel_values_videos"] is not None:
        pixels, grid = inputs["pixel_values_videos"].to(thinker.device), inputs["video_grid_thw"].to(thinker.device)
        video = torch.cat(model.get_video_features(pixels, grid).pooler_output)
        embeds = scatter_rows(embeds, ids == config.video_token_index, video, "video")
    return embeds


def scatter_rows(embeds: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor, what: str) -> torch.Tensor:
    """A copy of `embeds` with `rows` written over the positions of `mask` (counts must agree)."""
    if int(mask.sum()) != rows.shape[0]:
        raise ValueError(f"{int(mask.sum())} {what} placeholders in the prompt but {rows.shape[0]} {what} feature rows")
    out = embeds.clone()
    out[mask] = rows.to(embeds.dtype)
    return out


@torch.no_grad()
def thinker_positions(thinker, inputs: ThinkerInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids [3, 1, T], rope delta [1, 1]) from transformers' `get_rope_index`."""
    mask = inputs["feature_attention_mask"]
    return thinker.get_rope_index(
        inputs.input_ids, inputs["image_grid_thw"], inputs["video_grid_thw"], inputs.attention_mask,
        False, None if mask is None else mask.sum(-1), inputs["video_second_per_grid"])
