"""Wan2.1 / Wan2.2 text-to-video (`WanPipeline`) and Wan image-to-video (`WanImageToVideoPipeline`).

UMT5 prompt encoding (trimmed to the real tokens, zero-padded to 512), seeded latents
[n, C, 1 + (frames - 1) / t, H / s, W / s], `WanTransformer3DModel` with raw (UniPC: integer)
timesteps per row, classic CFG as extra rows; Wan2.2 checkpoints carry `transformer_2` and a
`boundary_ratio`: steps with t >= boundary * 1000 run the first expert, later ones the second, and the
expert is part of the batching key. Image-to-video adds the VAE-encoded first frame plus a frame mask
as extra input channels and CLIP image features as a second cross-attention input.

In: `{"prompt", "negative_prompt", "image" (i2v)}` + `DiffusionParams` (num_frames, fps). Out: uint8
frames [n][T, H, W, 3]. The maths follows diffusers' `pipeline_wan.py` / `pipeline_wan_i2v.py`.
"""

from __future__ import annotations

import dataclasses
import html
import re
from typing import Hashable

import torch

from omnistage.diffusion.pipelines.base import (DiffusionFamily, DiffusionLimits, assign_conds, cfg_prompts,
                                                 seeded_noise, to_uint8, vae_stats)
from omnistage.diffusion.solvers import make_schedule
from omnistage.diffusion.step_cache import BlockCacheSpec
from omnistage.diffusion.task import Conditioning, DiffusionTask
from omnistage.parallel.mesh import DiTParallelPlan
from omnistage.params import DiffusionParams, ParamError

MAX_TEXT = 512


def clean_prompt(text: str) -> str:
    """Wan's prompt cleaning: ftfy when installed, HTML unescape twice, collapse whitespace."""
    try:
        import ftfy
        text = ftfy.fix_text(text)
    except ImportError:
        pass
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


class WanFamily(DiffusionFamily):
    class_names = ("WanPipeline",)
    output_kind = "video"
    default_steps = 50
    default_guidance = 5.0
    default_fps = 16
    default_frames = 81
    block_cache = BlockCacheSpec(lists=("blocks",), batched=("hidden_states", "encoder_hidden_states", "temb"),
                                 outputs=("hidden_states",), modulated="temb")
    repeated_blocks = ("blocks",)
    step_constant_modules = ("rope",)          # rotary from the latent shape alone
    # self-attention q|k|v; cross-attention k|v of the text (and of the image features, I2V)
    merged_projections = {"blocks": (("attn1.to_q", "attn1.to_k", "attn1.to_v"), ("attn2.to_k", "attn2.to_v"),
                                     ("attn2.add_k_proj", "attn2.add_v_proj"))}
    # video tokens are split; the text (cross-attention keys) stays whole on every rank
    parallel_plan = DiTParallelPlan(
        modes=("ulysses", "ring", "cfg", "tensor"), lists=("blocks",), seq_args=("hidden_states",),
        rope_args={"rotary_emb": (1, ("hidden_states",))}, self_attention=("attn1",),
        column=("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn2.to_q", "attn2.to_k", "attn2.to_v",
                "attn2.add_k_proj", "attn2.add_v_proj", "ffn.net.0.proj"),
        row=("attn1.to_out.0", "attn2.to_out.0", "ffn.net.2"), heads=("attn1", "attn2"),
        head_norms=("attn1.norm_q", "attn1.norm_k", "attn2.norm_q", "attn2.norm_k", "attn2.norm_added_k"))

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.experts = [m for m in (self.c.get("transformer"), self.c.get("transformer_2")) if m is not None]
        self.vae = self.c["vae"]
        self.t_scale = self.vae.config.scale_factor_temporal
        self.s_scale = self.vae.config.scale_factor_spatial
        self.patch = self.experts[0].config.patch_size
        self.boundary = self.index.get("boundary_ratio")
        if self.index.get("expand_timesteps"):
            raise ValueError("Wan2.2 TI2V (expand_timesteps=True) is not supported yet")
        if self.boundary is not None and len(self.experts) < 2:
            raise ValueError("boundary_ratio is set but the folder has no transformer_2")

    def denoisers(self) -> list:
        return list(self.experts)

    def resolve(self, params: DiffusionParams, inputs: dict) -> DiffusionParams:
        top = self.max_frames()                                          # frames the rope table holds
        frames = params.num_frames or min(self.default_frames, top)      # the default fits the model
        if frames % self.t_scale != 1:  # diffusers rounds to the nearest valid count the same way
            frames = max(frames // self.t_scale * self.t_scale + 1, 1)
        p = self.fill_defaults(params, self.default_size(), self.default_guidance, num_frames=frames,
                               fps=params.fps or self.default_fps)
        if frames > top:
            raise ParamError("num_frames", f"num_frames must be at most {top} for this model, got {frames}")
        return p

    @property
    def rope_len(self) -> int:
        """Positions per axis (latent frames, rows, columns in patches) of the denoiser's rope table."""
        return self.experts[0].config.get("rope_max_seq_len", 1024)

    def max_size(self) -> tuple[int, int]:
        return self.rope_len * self.patch[1] * self.s_scale, self.rope_len * self.patch[2] * self.s_scale

    def size_multiples(self) -> tuple[int, int]:
        return self.s_scale * self.patch[1], self.s_scale * self.patch[2]

    def latent_shape(self, height: int, width: int, frames: int) -> tuple[int, int, int]:
        """(latent frames, rows, columns) of a clip of that size."""
        return (frames - 1) // self.t_scale + 1, height // self.s_scale, width // self.s_scale

    def image_tokens(self, height: int, width: int, frames=None) -> int:
        f, h, w = self.latent_shape(height, width, frames or self.default_frames)
        return f * (h // self.patch[1]) * (w // self.patch[2])

    def max_frames(self) -> int:
        """Most frames of one clip: the latent frames the rope table holds."""
        return (self.rope_len * self.patch[0] - 1) * self.t_scale + 1

    def default_size(self) -> tuple[int, int]:
        return 480, 832

    def limits(self) -> DiffusionLimits:
        return dataclasses.replace(super().limits(), default_num_frames=min(self.default_frames, self.max_frames()),
                                   max_num_frames=self.max_frames(), frame_step=self.t_scale,
                                   default_fps=self.default_fps)

    def new_task(self, request_id: str, inputs: dict, params: DiffusionParams) -> DiffusionTask:
        p = self.resolve(params, inputs)
        task = DiffusionTask(request_id=request_id, params=p, prompt=clean_prompt(self.prompt(inputs)),
                             negative_prompt=clean_prompt(self.negative(inputs, p) or ""),
                             generator=self.generator(p), num_images=p.num_outputs_per_prompt,
                             do_cfg=p.guidance_scale > 1)
        shape = self.latent_shape(p.height, p.width, p.num_frames)
        task.tokens_per_row = self.image_tokens(p.height, p.width, p.num_frames)
        task.static.update(cfg_scale=p.guidance_scale, shape=shape)
        task.schedule = make_schedule(self.scheduler_config, p.num_inference_steps)
        self.init_task(task, inputs)
        return task

    def init_task(self, task: DiffusionTask, inputs: dict) -> None:
        """Hook for image-to-video (validates and keeps the input image)."""

    def expert(self, task: DiffusionTask) -> int:
        if self.boundary is None:
            return 0
        n_train = self.scheduler_config.get("num_train_timesteps", 1000)
        return 0 if task.timestep() >= self.boundary * n_train else 1

    def key(self, task: DiffusionTask) -> Hashable:
        return (task.static["shape"], task.do_cfg, self.expert(task))

    def encode(self, tasks: list[DiffusionTask]) -> None:
        tok, enc = self.c["tokenizer"], self.c["text_encoder"]
        prompts = cfg_prompts(tasks)
        ids = tok(prompts, padding="max_length", max_length=MAX_TEXT, truncation=True, add_special_tokens=True,
                  return_attention_mask=True, return_tensors="pt")
        lens = ids.attention_mask.gt(0).sum(dim=1).long()
        hidden = enc(ids.input_ids.to(self.device), ids.attention_mask.to(self.device)).last_hidden_state
        hidden = hidden.to(enc.dtype).to(self.experts[0].dtype)
        conds = []
        for i in range(len(prompts)):
            e = hidden[i].clone()
            e[lens[i]:] = 0
            conds.append(Conditioning(embeds=e))
        assign_conds(tasks, conds)
        self.encode_images(tasks)

    def encode_images(self, tasks: list[DiffusionTask]) -> None:
        """Hook for image-to-video (CLIP image features)."""

    def prepare(self, task: DiffusionTask) -> None:
        shape = (task.num_images, self.latent_channels()) + task.static["shape"]
        task.latents = seeded_noise(shape, task.generator, self.device, torch.float32)

    def latent_channels(self) -> int:
        return self.experts[0].config.in_channels

    def model_input(self, task: DiffusionTask) -> torch.Tensor:
        return task.latents.to(self.experts[0].dtype)

    def model_timestep(self, task: DiffusionTask) -> torch.Tensor:
        return task.timestep()

    def denoise(self, key, x, t, conds, row_tasks) -> torch.Tensor:
        model = self.experts[key[-1]]
        text = torch.stack([c.embeds for c, task in zip(conds, row_tasks) for _ in range(task.num_images)])
        extra = self.image_inputs(conds, row_tasks)
        return model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False, **extra)[0]

    def image_inputs(self, conds, row_tasks) -> dict:
        return {}

    def decode(self, task: DiffusionTask) -> list:
        z = task.latents.to(self.vae.dtype)
        mean, inv_std = vae_stats(self.vae, z.device, z.dtype)
        z = z / inv_std + mean
        self.set_tiling(self.vae, task.params.height * task.params.width)
        video = self.vae.decode(z, return_dict=False)[0]          # [n, 3, T, H, W] in [-1, 1]
        return list(to_uint8(video.permute(0, 2, 3, 4, 1)))


class WanI2VFamily(WanFamily):
    class_names = ("WanImageToVideoPipeline",)
    takes_image = True

    def init_task(self, task: DiffusionTask, inputs: dict) -> None:
        image = inputs.get("image") or (inputs.get("multi_modal_data") or {}).get("image")
        if isinstance(image, (list, tuple)):
            image = image[0] if image else None
        if image is None and inputs.get("images"):
            image = inputs["images"][0]
        if image is None or not hasattr(image, "convert"):
            raise ParamError("image", "image is required for image-to-video and must be a PIL image")
        task.images = [image.convert("RGB")]   # the VAE and CLIP take 3 channels, whatever the image's mode

    def latent_channels(self) -> int:
        return self.vae.config.z_dim

    def encode_images(self, tasks: list[DiffusionTask]) -> None:
        enc, proc = self.c.get("image_encoder"), self.c.get("image_processor")
        if enc is None or self.experts[0].config.image_dim is None:
            return
        pixels = proc(images=[t.images[0] for t in tasks], return_tensors="pt").to(self.device)
        feats = enc(**pixels, output_hidden_states=True).hidden_states[-2].to(self.experts[0].dtype)
        for i, task in enumerate(tasks):
            task.cond.extra["image_embeds"] = feats[i]

    def prepare(self, task: DiffusionTask) -> None:
        from diffusers.video_processor import VideoProcessor

        super().prepare(task)
        p = task.params
        n, (_, h, w) = task.num_images, task.static["shape"]
        image = VideoProcessor(vae_scale_factor=self.s_scale).preprocess(task.images[0], height=p.height,
                                                                         width=p.width)
        image = image.to(self.device, torch.float32).unsqueeze(2)
        video = torch.cat([image, image.new_zeros(1, image.shape[1], p.num_frames - 1, p.height, p.width)], dim=2)
        cond = self.vae.encode(video.to(self.vae.dtype)).latent_dist.mode().repeat(n, 1, 1, 1, 1)
        mean, inv_std = vae_stats(self.vae, self.device, torch.float32)
        cond = (cond.to(self.device, torch.float32) - mean) * inv_std
        mask = torch.ones(n, 1, p.num_frames, h, w)
        mask[:, :, 1:] = 0
        first = torch.repeat_interleave(mask[:, :, 0:1], dim=2, repeats=self.t_scale)
        mask = torch.concat([first, mask[:, :, 1:]], dim=2).view(n, -1, self.t_scale, h, w).transpose(1, 2)
        task.static["condition"] = torch.concat([mask.to(cond.device), cond], dim=1)

    def model_input(self, task: DiffusionTask) -> torch.Tensor:
        return torch.cat([task.latents, task.static["condition"]], dim=1).to(self.experts[0].dtype)

    def image_inputs(self, conds, row_tasks) -> dict:
        if "image_embeds" not in conds[0].extra:
            return {}
        feats = [task.cond.extra["image_embeds"] for task in row_tasks for _ in range(task.num_images)]
        return {"encoder_hidden_states_image": torch.stack(feats)}
