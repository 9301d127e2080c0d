"""Qwen-Image text-to-image (`QwenImagePipeline`): Qwen2.5-VL prompt encoding, packed 2x2 latents,
`QwenImageTransformer2DModel` with per-row timesteps and padded + masked text, true CFG with the
norm rescale, Qwen-Image VAE (latents de-normalised by the config mean / std) -> PIL images.

In: `{"prompt", "negative_prompt"}` + `DiffusionParams`. Out: PIL images. The maths follows
diffusers' `pipeline_qwenimage.py`; the edit variant extends this file's class (`qwen_image_edit.py`).
"""

from __future__ import annotations

import torch

from omnistage.diffusion.pipelines.base import (JOINT_QKV, ImageFamily, assign_conds, cfg_prompts, pad_stack, seeded_noise,
                                                 to_pil, vae_stats)
from omnistage.diffusion.step_cache import BlockCacheSpec
from omnistage.diffusion.task import Conditioning, DiffusionTask
from omnistage.params import DiffusionParams

PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                   "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                   "<|im_end|>\n<|im_start|>assistant\n")
PROMPT_DROP = 34            # template tokens dropped from the front of the encoder output
MAX_TEXT = 1024             # tokenizer limit after the template
MAX_SEQ = 512               # text tokens kept for the transformer (diffusers' max_sequence_length)


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, H/2 * W/2, C*4] (2x2 patches as tokens)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """[B, h/2 * w/2, C*4] -> [B, C, h, w] for latent height h and width w."""
    b, _, ch = tokens.shape
    x = tokens.view(b, h // 2, w // 2, ch // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, ch // 4, h, w)


class QwenImageFamily(ImageFamily):
    class_names = ("QwenImagePipeline",)
    default_steps = 50
    default_true_cfg = 4.0
    # temb is 2x the rows with zero_cond_t (Qwen-Image-Edit-2511): the cache slices both halves
    block_cache = BlockCacheSpec(lists=("transformer_blocks",),
                                 batched=("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask",
                                          "temb", "modulate_index"),
                                 outputs=("encoder_hidden_states", "hidden_states"), modulated="temb")
    merged_projections = {"transformer_blocks": JOINT_QKV}

    def vae_scale_factor(self) -> int:
        return 2 ** len(self.vae.temperal_downsample)

    # -- request side --------------------------------------------------------------------------------

    def cfg_scale(self, p: DiffusionParams) -> float:
        if p.true_cfg_scale is not None:
            return p.true_cfg_scale
        return p.guidance_scale if p.guidance_scale is not None else self.default_true_cfg

    def new_task(self, request_id: str, inputs: dict, params: DiffusionParams) -> DiffusionTask:
        p = self.resolve(params, inputs)
        neg = self.negative(inputs, p)
        scale = self.cfg_scale(p)
        task = self.packed_task(request_id, inputs, p, neg, scale > 1 and neg is not None, scale)
        task.static["shape"] = (task.tokens_per_row,)   # rows carry their own img_shapes: only the count must match
        self.init_task(task, inputs)
        return task

    def init_task(self, task: DiffusionTask, inputs: dict) -> None:
        """Hook for the edit variant (reads input images)."""

    # -- phases --------------------------------------------------------------------------------------
    def text_embeddings(self, prompts: list[str]) -> list[torch.Tensor]:
        tok, enc = self.c["tokenizer"], self.c["text_encoder"]
        txt = [PROMPT_TEMPLATE.format(p) for p in prompts]
        ids = tok(txt, max_length=MAX_TEXT + PROMPT_DROP, padding=True, truncation=True, return_tensors="pt")
        ids = ids.to(self.device)
        hidden = enc(input_ids=ids.input_ids, attention_mask=ids.attention_mask,
                     output_hidden_states=True).hidden_states[-1]
        keep = ids.attention_mask.bool()
        return [hidden[i][keep[i]][PROMPT_DROP:][:MAX_SEQ].to(self.dtype) for i in range(len(prompts))]

    def encode(self, tasks: list[DiffusionTask]) -> None:
        assign_conds(tasks, [Conditioning(embeds=e) for e in self.text_embeddings(cfg_prompts(tasks))])

    def prepare(self, task: DiffusionTask) -> None:
        h, w = task.static["latent_hw"]
        c = self.transformer.config.in_channels // 4
        noise = seeded_noise((task.num_images, 1, c, h, w), task.generator, self.device, self.dtype)
        task.latents = pack(noise[:, 0])

    def img_shapes(self, task) -> list[tuple[int, int, int]]:
        """The (frames, rows, cols) grids of the packed image tokens of one row, in sequence order."""
        h, w = task.static["latent_hw"]
        return [(1, h // 2, w // 2)]

    def denoise(self, key, x, t, conds, row_tasks) -> torch.Tensor:
        embeds, img_shapes = [], []
        for cond, task in zip(conds, row_tasks):
            for _ in range(task.num_images):
                embeds.append(cond.embeds)
                img_shapes.append(self.img_shapes(task))
        text, mask = pad_stack(embeds)
        guidance = None
        if self.transformer.config.guidance_embeds:
            g = [task.params.guidance_scale or 1.0 for task in row_tasks for _ in range(task.num_images)]
            guidance = torch.tensor(g, dtype=torch.float32).to(self.device, non_blocking=True)   # no host sync
        return self.transformer(hidden_states=x, timestep=t, guidance=guidance, encoder_hidden_states=text,
                                encoder_hidden_states_mask=mask, img_shapes=img_shapes, return_dict=False)[0]

    def guide(self, task, cond_out, uncond_out):
        if uncond_out is None:
            return cond_out
        comb = uncond_out + task.static["cfg_scale"] * (cond_out - uncond_out)
        cond_norm = torch.norm(cond_out, dim=-1, keepdim=True)
        noise_norm = torch.norm(comb, dim=-1, keepdim=True)
        return comb * (cond_norm / noise_norm)

    def decode(self, task: DiffusionTask) -> list:
        h, w = task.static["latent_hw"]
        z = unpack(task.latents, h, w)[:, :, None].to(self.vae.dtype)
        mean, inv_std = vae_stats(self.vae, z.device, z.dtype)
        z = z / inv_std + mean
        self.set_tiling(self.vae, task.params.height * task.params.width)
        image = self.vae.decode(z, return_dict=False)[0][:, :, 0]
        return to_pil(image)
