"""Z-Image text-to-image (`ZImagePipeline`): Qwen3 prompt encoding through the chat template
(penultimate hidden states, padding dropped, so each prompt keeps its own length),
`ZImageTransformer2DModel` over lists of per-row latents and captions with timestep (1000 - t) / 1000,
CFG as extra rows with pred = pos + s * (pos - neg), solver input = -pred; KL VAE -> PIL images.

In: `{"prompt", "negative_prompt"}` + `DiffusionParams`. Out: PIL images. The maths follows
diffusers' `pipeline_z_image.py` (cfg_normalization off, cfg_truncation 1.0: its defaults).
"""

from __future__ import annotations

from typing import Hashable

import torch

from omnistage.diffusion.pipelines.base import DiffusionFamily, check_multiple, seeded_noise, to_pil
from omnistage.diffusion.task import Conditioning, DiffusionTask
from omnistage.params import DiffusionParams

MAX_TEXT = 512


class ZImageFamily(DiffusionFamily):
    class_names = ("ZImagePipeline",)
    default_steps = 50
    default_guidance = 5.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.transformer = self.c["transformer"]
        self.vae = self.c["vae"]
        self.vae_scale = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.multiple = self.vae_scale * 2

    def resolve(self, params: DiffusionParams, inputs: dict) -> DiffusionParams:
        p = params.clone(height=params.height or 1024, width=params.width or 1024,
                         num_inference_steps=params.num_inference_steps or self.default_steps,
                         guidance_scale=params.guidance_scale if params.guidance_scale is not None
                         else self.default_guidance)
        check_multiple("height", p.height, self.multiple, self.max_pixels)
        check_multiple("width", p.width, self.multiple, self.max_pixels)
        return p

    def new_task(self, request_id: str, inputs: dict, params: DiffusionParams) -> DiffusionTask:
        p = self.resolve(params, inputs)
        task = DiffusionTask(request_id=request_id, params=p, prompt=self.prompt(inputs),
                             negative_prompt=self.negative(inputs, p) or "", generator=self.generator(p),
                             num_images=p.num_outputs_per_prompt, do_cfg=p.guidance_scale > 0)
        h, w = 2 * (p.height // self.multiple), 2 * (p.width // self.multiple)
        task.tokens_per_row = (h // 2) * (w // 2)
        task.static.update(cfg_scale=p.guidance_scale, latent_hw=(h, w), shape=(h, w))
        n = p.num_inference_steps
        task.schedule = self.schedule(n, task.tokens_per_row, torch.linspace(1.0, 1 / n, n).tolist())
        return task

    def key(self, task: DiffusionTask) -> Hashable:
        return (task.static["shape"], task.do_cfg)

    def encode(self, tasks: list[DiffusionTask]) -> None:
        tok, enc = self.c["tokenizer"], self.c["text_encoder"]
        prompts = [t.prompt for t in tasks] + [t.negative_prompt for t in tasks if t.do_cfg]
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=True) for p in prompts]
        ids = tok(texts, padding="max_length", max_length=MAX_TEXT, truncation=True, return_tensors="pt")
        mask = ids.attention_mask.to(self.device).bool()
        hidden = enc(input_ids=ids.input_ids.to(self.device), attention_mask=mask,
                     output_hidden_states=True).hidden_states[-2]
        conds = [Conditioning(embeds=hidden[i][mask[i]]) for i in range(len(prompts))]
        negs = iter(conds[len(tasks):])
        for task, cond in zip(tasks, conds):
            task.cond = cond
            if task.do_cfg:
                task.uncond = next(negs)

    def prepare(self, task: DiffusionTask) -> None:
        h, w = task.static["latent_hw"]
        c = self.transformer.in_channels
        task.latents = seeded_noise((task.num_images, c, h, w), task.generator, self.device, torch.float32)

    def model_input(self, task: DiffusionTask) -> torch.Tensor:
        return task.latents.to(self.transformer.dtype)

    def model_timestep(self, task: DiffusionTask) -> torch.Tensor:
        return (1000 - task.timestep()) / 1000

    def denoise(self, key, x, t, conds, row_tasks) -> torch.Tensor:
        caps = [c.embeds for c, task in zip(conds, row_tasks) for _ in range(task.num_images)]
        out = self.transformer(list(x.unsqueeze(2).unbind(dim=0)), t, caps, return_dict=False)[0]
        return torch.stack([o.float() for o in out], dim=0).squeeze(2)

    def guide(self, task, cond_out, uncond_out):
        pred = cond_out if uncond_out is None else cond_out + task.static["cfg_scale"] * (cond_out - uncond_out)
        return -pred.to(torch.float32)

    def decode(self, task: DiffusionTask) -> list:
        z = task.latents.to(self.vae.dtype)
        z = (z / self.vae.config.scaling_factor) + self.vae.config.shift_factor
        self.set_tiling(self.vae, task.params.height * task.params.width)
        return to_pil(self.vae.decode(z, return_dict=False)[0])
