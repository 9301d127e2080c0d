"""FLUX.1 text-to-image (`FluxPipeline`): CLIP pooled + T5 sequence prompt encoding, packed 2x2
latents with positional ids, `FluxTransformer2DModel`; dev checkpoints embed `guidance_scale` per row
(no extra CFG rows), schnell ones take none; optional true CFG (negative prompt + true_cfg_scale > 1)
runs as extra rows. KL VAE (scaling / shift factors) -> PIL images.

In: `{"prompt", "negative_prompt"}` + `DiffusionParams`. Out: PIL images. The maths follows
diffusers' `pipeline_flux.py`.
"""

from __future__ import annotations

from typing import Hashable

import numpy as np
import torch

from omnistage.diffusion.pipelines.base import DiffusionFamily, check_multiple, seeded_noise, to_pil
from omnistage.diffusion.pipelines.qwen_image import pack, unpack
from omnistage.diffusion.task import Conditioning, DiffusionTask
from omnistage.params import DiffusionParams

T5_MAX = 512


def latent_ids(h: int, w: int, device, dtype) -> torch.Tensor:
    """Positional ids [h*w, 3] of packed latent tokens: (0, row, col)."""
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = ids[..., 1] + torch.arange(h)[:, None]
    ids[..., 2] = ids[..., 2] + torch.arange(w)[None, :]
    return ids.reshape(h * w, 3).to(device=device, dtype=dtype)


class FluxFamily(DiffusionFamily):
    class_names = ("FluxPipeline",)
    default_steps = 28
    default_guidance = 3.5

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.transformer = self.c["transformer"]
        self.vae = self.c["vae"]
        self.vae_scale = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.multiple = self.vae_scale * 2
        self.guidance_embeds = bool(self.transformer.config.guidance_embeds)

    def resolve(self, params: DiffusionParams, inputs: dict) -> DiffusionParams:
        p = params.clone(height=params.height or 128 * self.vae_scale, width=params.width or 128 * self.vae_scale,
                         num_inference_steps=params.num_inference_steps or self.default_steps,
                         guidance_scale=params.guidance_scale if params.guidance_scale is not None
                         else self.default_guidance)
        check_multiple("height", p.height, self.multiple, self.max_pixels)
        check_multiple("width", p.width, self.multiple, self.max_pixels)
        return p

    def new_task(self, request_id: str, inputs: dict, params: DiffusionParams) -> DiffusionTask:
        p = self.resolve(params, inputs)
        neg = self.negative(inputs, p)
        scale = p.true_cfg_scale if p.true_cfg_scale is not None else 1.0
        task = DiffusionTask(request_id=request_id, params=p, prompt=self.prompt(inputs), negative_prompt=neg,
                             generator=self.generator(p), num_images=p.num_outputs_per_prompt,
                             do_cfg=scale > 1 and neg is not None)
        h, w = 2 * (p.height // self.multiple), 2 * (p.width // self.multiple)
        task.tokens_per_row = (h // 2) * (w // 2)
        task.static.update(cfg_scale=scale, latent_hw=(h, w), shape=(h, w))
        n = p.num_inference_steps
        task.schedule = self.schedule(n, task.tokens_per_row, list(np.linspace(1.0, 1 / n, n)))
        return task

    def key(self, task: DiffusionTask) -> Hashable:
        return (task.static["shape"], task.do_cfg)

    def encode(self, tasks: list[DiffusionTask]) -> None:
        prompts = [t.prompt for t in tasks] + [t.negative_prompt for t in tasks if t.do_cfg]
        tok, clip = self.c["tokenizer"], self.c["text_encoder"]
        ids = tok(prompts, padding="max_length", max_length=tok.model_max_length, truncation=True,
                  return_tensors="pt").input_ids
        pooled = clip(ids.to(self.device), output_hidden_states=False).pooler_output.to(clip.dtype)
        tok2, t5 = self.c["tokenizer_2"], self.c["text_encoder_2"]
        ids2 = tok2(prompts, padding="max_length", max_length=T5_MAX, truncation=True, return_tensors="pt").input_ids
        seq = t5(ids2.to(self.device), output_hidden_states=False)[0].to(t5.dtype)
        conds = [Conditioning(embeds=seq[i], pooled=pooled[i]) for i in range(len(prompts))]
        negs = iter(conds[len(tasks):])
        for task, cond in zip(tasks, conds):
            task.cond = cond
            if task.do_cfg:
                task.uncond = next(negs)

    def prepare(self, task: DiffusionTask) -> None:
        h, w = task.static["latent_hw"]
        c = self.transformer.config.in_channels // 4
        noise = seeded_noise((task.num_images, c, h, w), task.generator, self.device, task.cond.embeds.dtype)
        task.latents = pack(noise)
        task.static["img_ids"] = latent_ids(h // 2, w // 2, self.device, task.cond.embeds.dtype)

    def denoise(self, key, x, t, conds, row_tasks) -> torch.Tensor:
        text = torch.stack([c.embeds for c, task in zip(conds, row_tasks) for _ in range(task.num_images)])
        pooled = torch.stack([c.pooled for c, task in zip(conds, row_tasks) for _ in range(task.num_images)])
        guidance = None
        if self.guidance_embeds:
            g = [task.params.guidance_scale for task in row_tasks for _ in range(task.num_images)]
            guidance = torch.tensor(g, dtype=torch.float32, device=self.device)
        txt_ids = torch.zeros(text.shape[1], 3, device=self.device, dtype=text.dtype)
        return self.transformer(hidden_states=x, timestep=t, guidance=guidance, pooled_projections=pooled,
                                encoder_hidden_states=text, txt_ids=txt_ids, img_ids=row_tasks[0].static["img_ids"],
                                return_dict=False)[0]

    def decode(self, task: DiffusionTask) -> list:
        h, w = task.static["latent_hw"]
        z = unpack(task.latents, h, w)
        z = (z / self.vae.config.scaling_factor) + self.vae.config.shift_factor
        self.set_tiling(self.vae, task.params.height * task.params.width)
        return to_pil(self.vae.decode(z.to(self.vae.dtype), return_dict=False)[0])
