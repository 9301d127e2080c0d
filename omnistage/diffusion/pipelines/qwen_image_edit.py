"""Qwen-Image-Edit (`QwenImageEditPipeline`): Qwen-Image with an input image that conditions twice.

1. Size: the input image is resized to `CONDITION_AREA` pixels at its own aspect ratio (multiples of 32,
   diffusers' `calculate_dimensions`); unless the request sets height / width, the output takes that
   size floored to the model's multiple.
2. Text: Qwen2.5-VL reads the edit prompt template with the resized image's vision tokens, through the
   folder's `Qwen2VLProcessor`; the first `PROMPT_DROP` tokens of the last hidden state are dropped.
   The negative prompt is encoded with the same image. Prompts of all admitted requests share one call.
3. Latents: the resized image is VAE-encoded (distribution mode, normalised by the config mean / std)
   and 2x2-packed; these condition tokens follow the noisy tokens along the sequence of every row, and
   `img_shapes` lists both grids. Only the first (noisy) part of the transformer output is the velocity.

In: `{"prompt", "negative_prompt", "image" | "images" | "multi_modal_data": {"image"}}` (one PIL image)
+ `DiffusionParams`. Out: PIL images. Runs in the diffusion stage's process. The maths follows
diffusers' `pipeline_qwenimage_edit.py`; everything else (true CFG, schedule, decode) is `QwenImageFamily`.
"""

from __future__ import annotations

from typing import Any

import torch

from omnistage.diffusion.pipelines.base import assign_conds, cfg_prompts
from omnistage.diffusion.pipelines.qwen_image import QwenImageFamily, pack
from omnistage.diffusion.task import Conditioning, DiffusionTask
from omnistage.params import DiffusionParams, ParamError

PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
                   "objects, background), then explain how the user's text instruction should alter or modify the "
                   "image. Generate a new image that meets the user's requirements while maintaining consistency "
                   "with the original input where appropriate.<|im_end|>\n<|im_start|>user\n"
                   "<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n")
PROMPT_DROP = 64                    # template tokens dropped from the front of the encoder output
CONDITION_AREA = 1024 * 1024        # pixels of the resized input image (VAE condition and vision tokens)


def input_image(inputs: dict) -> Any:
    """The one PIL input image of a request, from `image`, `images` or `multi_modal_data["image"]`."""
    image = inputs.get("image")
    if image is None:
        image = inputs.get("images")
    if image is None:
        image = (inputs.get("multi_modal_data") or {}).get("image")
    if isinstance(image, (list, tuple)):
        if len(image) > 1:
            raise ParamError("image", f"image must be exactly one input image for Qwen-Image-Edit, got {len(image)}")
        image = image[0] if image else None
    if image is None or not hasattr(image, "convert"):
        raise ParamError("image", "image must be given for Qwen-Image-Edit, as one PIL image")
    return image.convert("RGB")


def condition_size(image) -> tuple[int, int]:
    """(height, width) the input image is resized to: CONDITION_AREA at its aspect ratio, multiples of 32."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    width, height, _ = calculate_dimensions(CONDITION_AREA, image.size[0] / image.size[1])
    return int(height), int(width)


class QwenImageEditFamily(QwenImageFamily):
    class_names = ("QwenImageEditPipeline",)
    takes_image = True

    def __init__(self, *args, **kwargs):
        from diffusers.image_processor import VaeImageProcessor

        super().__init__(*args, **kwargs)
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.multiple)

    # -- request side --------------------------------------------------------------------------------
    def default_size(self, inputs: dict | None = None) -> tuple[int, int]:
        """The input image's condition size floored to the model's multiple (1024 x 1024 without an image)."""
        image = input_image(inputs) if inputs and any(k in inputs for k in ("image", "images",
                                                                             "multi_modal_data")) else None
        h, w = condition_size(image) if image is not None else (1024, 1024)
        m = self.multiple
        return max(m, h // m * m), max(m, w // m * m)

    def resolve(self, params: DiffusionParams, inputs: dict) -> DiffusionParams:
        return self.fill_defaults(params, self.default_size(inputs), self.default_guidance)

    def init_task(self, task: DiffusionTask, inputs: dict) -> None:
        image = input_image(inputs)
        ch, cw = condition_size(image)
        lh, lw = ch // self.vae_scale, cw // self.vae_scale
        if lh % 2 or lw % 2:
            raise ParamError("image", f"image must give a condition size that packs into 2x2 latent patches, got {cw}x{ch} "
                             f"with this VAE (downscale {self.vae_scale})")
        task.images = [self.image_processor.resize(image, ch, cw)]
        noisy = task.tokens_per_row
        task.static.update(cond_size=(ch, cw), cond_hw=(lh, lw), shape=(noisy, (lh // 2) * (lw // 2)))
        task.tokens_per_row = noisy + (lh // 2) * (lw // 2)

    # -- phases --------------------------------------------------------------------------------------
    def encode(self, tasks: list[DiffusionTask]) -> None:
        prompts = cfg_prompts(tasks)
        images = [t.images[0] for t in tasks] + [t.images[0] for t in tasks if t.do_cfg]
        inputs = self.c["processor"](text=[PROMPT_TEMPLATE.format(p) for p in prompts], images=images,
                                     padding=True, return_tensors="pt").to(self.device)
        hidden = self.c["text_encoder"](input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                        pixel_values=inputs.get("pixel_values"),
                                        image_grid_thw=inputs.get("image_grid_thw"),
                                        output_hidden_states=True).hidden_states[-1]
        keep = inputs["attention_mask"].bool()
        embeds = [hidden[i][keep[i]][PROMPT_DROP:].to(self.dtype) for i in range(len(prompts))]
        assign_conds(tasks, [Conditioning(embeds=e) for e in embeds])

    def prepare(self, task: DiffusionTask) -> None:
        super().prepare(task)
        ch, cw = task.static["cond_size"]
        pixels = self.image_processor.preprocess(task.images[0], ch, cw).unsqueeze(2)
        z = self.vae.encode(pixels.to(self.device, self.vae.dtype)).latent_dist.mode()
        cfg = self.vae.config
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
        std = torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
        z = ((z - mean) / std)[:, :, 0].to(self.dtype)
        task.static["condition"] = pack(z).repeat(task.num_images, 1, 1)

    def model_input(self, task: DiffusionTask) -> torch.Tensor:
        return torch.cat([task.latents, task.static["condition"]], dim=1)

    def img_shapes(self, task) -> list[tuple[int, int, int]]:
        lh, lw = task.static["cond_hw"]
        return super().img_shapes(task) + [(1, lh // 2, lw // 2)]

    def denoise(self, key, x, t, conds, row_tasks) -> torch.Tensor:
        out = super().denoise(key, x, t, conds, row_tasks)
        return out[:, : key[0][0]]                  # the noisy tokens; the condition's outputs are unused
