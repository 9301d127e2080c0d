"""Z-Image text-to-image (`ZImagePipeline`): Qwen3 prompt encoding through the chat template
(penultimate hidden states, padding dropped, so each prompt keeps its own length),
`ZImageTransformer2DModel` over lists of per-row latents and captions with timestep (1000 - t) / 1000,
CFG as extra rows with pred = pos + s * (pos - neg), solver input = -pred; KL VAE -> PIL images.

In: `{"prompt", "negative_prompt"}` + `DiffusionParams`. Out: PIL images. The maths follows
diffusers' `pipeline_z_image.py` (cfg_normalization off, cfg_truncation 1.0: its defaults).
"""

from __future__ import annotations

import torch

from omnistage.diffusion.pipelines.base import ImageFamily, assign_conds, cfg_prompts, seeded_noise
from omnistage.diffusion.step_cache import BlockCacheSpec
from omnistage.diffusion.task import Conditioning, DiffusionTask
from omnistage.params import DiffusionParams

MAX_TEXT = 512


class ZImageFamily(ImageFamily):
    class_names = ("ZImagePipeline",)
    default_steps = 50
    default_guidance = 5.0
    # the main layers over the joined image + caption sequence (the refiners before them always run)
    block_cache = BlockCacheSpec(lists=("layers",), batched=("x", "attn_mask", "freqs_cis", "adaln_input", "noise_mask",
                                                             "adaln_noisy", "adaln_clean"),
                                 outputs=("x",), modulated="adaln_input")
    repeated_blocks = ("noise_refiner", "context_refiner", "layers")
    # attention q|k|v and the SwiGLU's gate|up (w1|w3) of every block
    merged_projections = dict.fromkeys(repeated_blocks, (("attention.to_q", "attention.to_k", "attention.to_v"),
                                                         ("feed_forward.w1", "feed_forward.w3")))

    def default_size(self) -> tuple[int, int]:
        return 1024, 1024

    def max_size(self) -> tuple[int, int]:
        """The rope tables hold `axes_lens` positions per axis (frame, height, width); image tokens
        count from 0 on the height and width axes."""
        _, rows, cols = self.transformer.config.axes_lens
        cell = self.latent_patch() * self.vae_scale
        return rows * cell, cols * cell

    def new_task(self, request_id: str, inputs: dict, params: DiffusionParams) -> DiffusionTask:
        p = self.resolve(params, inputs)
        n = p.num_inference_steps                # diffusers builds these base sigmas with torch, not numpy
        return self.packed_task(request_id, inputs, p, self.negative(inputs, p) or "", p.guidance_scale > 0,
                                p.guidance_scale, torch.linspace(1.0, 1 / n, n).tolist())

    def encode(self, tasks: list[DiffusionTask]) -> None:
        tok, enc = self.c["tokenizer"], self.c["text_encoder"]
        prompts = cfg_prompts(tasks)
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=True) for p in prompts]
        ids = tok(texts, padding="max_length", max_length=MAX_TEXT, truncation=True, return_tensors="pt")
        mask = ids.attention_mask.to(self.device).bool()
        hidden = enc(input_ids=ids.input_ids.to(self.device), attention_mask=mask,
                     output_hidden_states=True).hidden_states[-2]
        assign_conds(tasks, [Conditioning(embeds=hidden[i][mask[i]]) for i in range(len(prompts))])

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
        return self.decode_scaled(task, task.latents.to(self.vae.dtype))
