"""Stable Diffusion 3 / 3.5 text-to-image (`StableDiffusion3Pipeline`): two CLIP encoders (penultimate
hidden states + pooled) and T5, joined into one [77 + 256, D] sequence; `SD3Transformer2DModel` on
unpacked latents with raw timesteps; classic CFG (guidance_scale > 1, empty negative by default) as
extra rows; KL VAE (scaling / shift factors) -> PIL images.

In: `{"prompt", "negative_prompt"}` + `DiffusionParams`. Out: PIL images. The maths follows
diffusers' `pipeline_stable_diffusion_3.py`.
"""

from __future__ import annotations

import torch

from omnistage.diffusion.pipelines.base import JOINT_QKV, ImageFamily, assign_conds, cfg_prompts, seeded_noise
from omnistage.diffusion.solvers import calculate_shift, make_schedule
from omnistage.diffusion.step_cache import BlockCacheSpec
from omnistage.diffusion.task import Conditioning, DiffusionTask
from omnistage.params import DiffusionParams

T5_MAX = 256


class SD3Family(ImageFamily):
    class_names = ("StableDiffusion3Pipeline",)
    joint_text_tokens = 77 + T5_MAX            # CLIP + T5 tokens join the image tokens (joint attention)
    default_steps = 28
    default_guidance = 7.0
    block_cache = BlockCacheSpec(lists=("transformer_blocks",), batched=("hidden_states", "encoder_hidden_states", "temb"),
                                 outputs=("encoder_hidden_states", "hidden_states"), modulated_norm="norm1")
    # joint attention; SD3.5's second (image-only) attention of the dual-attention blocks
    merged_projections = {"transformer_blocks": JOINT_QKV + (("attn2.to_q", "attn2.to_k", "attn2.to_v"),)}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.patch = self.latent_patch()

    def latent_patch(self) -> int:
        return self.transformer.config.patch_size

    def default_size(self) -> tuple[int, int]:
        size = self.transformer.config.sample_size * self.vae_scale
        return size, size

    def max_size(self) -> tuple[int, int]:
        """The learnt position table covers `pos_embed_max_size` patches per side (None: any)."""
        cells = self.transformer.config.get("pos_embed_max_size")
        if cells is None:
            return super().max_size()
        side = cells * self.patch * self.vae_scale
        return side, side

    def new_task(self, request_id: str, inputs: dict, params: DiffusionParams) -> DiffusionTask:
        p = self.resolve(params, inputs)
        do_cfg = p.guidance_scale > 1
        neg = self.negative(inputs, p) or ""
        task = DiffusionTask(request_id=request_id, params=p, prompt=self.prompt(inputs), negative_prompt=neg,
                             generator=self.generator(p), num_images=p.num_outputs_per_prompt, do_cfg=do_cfg)
        h, w = p.height // self.vae_scale, p.width // self.vae_scale
        task.tokens_per_row = self.image_tokens(p.height, p.width)
        task.static.update(cfg_scale=p.guidance_scale, latent_hw=(h, w), shape=(h, w))
        cfg = self.scheduler_config
        mu = None
        if cfg.get("use_dynamic_shifting"):
            mu = calculate_shift(task.tokens_per_row, cfg.get("base_image_seq_len", 256),
                                 cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5),
                                 cfg.get("max_shift", 1.16))
        task.schedule = make_schedule(cfg, p.num_inference_steps, mu=mu)
        return task

    def _clip(self, idx: str, prompts: list[str]):
        tok, enc = self.c["tokenizer" + idx], self.c["text_encoder" + idx]
        ids = tok(prompts, padding="max_length", max_length=self.c["tokenizer"].model_max_length, truncation=True,
                  return_tensors="pt").input_ids
        out = enc(ids.to(self.device), output_hidden_states=True)
        return out.hidden_states[-2].to(self.c["text_encoder"].dtype), out[0]

    def encode(self, tasks: list[DiffusionTask]) -> None:
        prompts = cfg_prompts(tasks)
        seq1, pool1 = self._clip("", prompts)
        seq2, pool2 = self._clip("_2", prompts)
        tok3, t5 = self.c.get("tokenizer_3"), self.c.get("text_encoder_3")
        dim = self.transformer.config.joint_attention_dim
        if t5 is None:
            seq3 = torch.zeros(len(prompts), T5_MAX, dim, device=self.device, dtype=self.dtype)
        else:
            ids = tok3(prompts, padding="max_length", max_length=T5_MAX, truncation=True, add_special_tokens=True,
                       return_tensors="pt").input_ids
            seq3 = t5(ids.to(self.device))[0].to(t5.dtype)
        clip = torch.cat([seq1, seq2], dim=-1)
        clip = torch.nn.functional.pad(clip, (0, seq3.shape[-1] - clip.shape[-1]))
        seq = torch.cat([clip, seq3], dim=-2)
        pooled = torch.cat([pool1, pool2], dim=-1)
        assign_conds(tasks, [Conditioning(embeds=seq[i], pooled=pooled[i]) for i in range(len(prompts))])

    def prepare(self, task: DiffusionTask) -> None:
        h, w = task.static["latent_hw"]
        c = self.transformer.config.in_channels
        task.latents = seeded_noise((task.num_images, c, h, w), task.generator, self.device, task.cond.embeds.dtype)

    def model_timestep(self, task: DiffusionTask) -> torch.Tensor:
        return task.timestep()

    def denoise(self, key, x, t, conds, row_tasks) -> torch.Tensor:
        text = torch.stack([c.embeds for c, task in zip(conds, row_tasks) for _ in range(task.num_images)])
        pooled = torch.stack([c.pooled for c, task in zip(conds, row_tasks) for _ in range(task.num_images)])
        return self.transformer(hidden_states=x, timestep=t, encoder_hidden_states=text, pooled_projections=pooled,
                                return_dict=False)[0]

    def decode(self, task: DiffusionTask) -> list:
        return self.decode_scaled(task, task.latents)
