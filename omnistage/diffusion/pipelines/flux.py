"""FLUX.1 text-to-image (`FluxPipeline`): CLIP pooled + T5 sequence prompt encoding, packed 2x2
latents with positional ids, `FluxTransformer2DModel`; dev checkpoints embed `guidance_scale` per row
(no extra CFG rows), schnell ones take none; optional true CFG (negative prompt + true_cfg_scale > 1)
runs as extra rows. KL VAE (scaling / shift factors) -> PIL images.

In: `{"prompt", "negative_prompt"}` + `DiffusionParams`. Out: PIL images. The maths follows
diffusers' `pipeline_flux.py`.
"""

from __future__ import annotations

import torch

from omnistage.diffusion.pipelines.base import JOINT_QKV, ImageFamily, assign_conds, cfg_prompts, seeded_noise
from omnistage.diffusion.pipelines.qwen_image import pack, unpack
from omnistage.diffusion.step_cache import BlockCacheSpec
from omnistage.diffusion.task import Conditioning, DiffusionTask
from omnistage.parallel.mesh import DiTParallelPlan
from omnistage.params import DiffusionParams

T5_MAX = 512


def latent_ids(h: int, w: int, device, dtype) -> torch.Tensor:
    """Positional ids [h*w, 3] of packed latent tokens: (0, row, col)."""
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = ids[..., 1] + torch.arange(h)[:, None]
    ids[..., 2] = ids[..., 2] + torch.arange(w)[None, :]
    return ids.reshape(h * w, 3).to(device=device, dtype=dtype)


class FluxFamily(ImageFamily):
    class_names = ("FluxPipeline",)
    default_steps = 28
    default_guidance = 3.5
    block_cache = BlockCacheSpec(lists=("transformer_blocks", "single_transformer_blocks"),
                                 batched=("hidden_states", "encoder_hidden_states", "temb"),
                                 outputs=("encoder_hidden_states", "hidden_states"), modulated_norm="norm1",
                                 # TeaCache's published FLUX.1 fit (the paper's; vLLM-Omni uses the same)
                                 coefficients=(4.98651651e02, -2.83781631e02, 5.58554382e01, -3.82021401e00,
                                               2.64230861e-01))
    repeated_blocks = ("transformer_blocks", "single_transformer_blocks")
    # a single block feeds its normed input to q, k, v and the MLP: one 3072 -> 21504 GEMM at FLUX.1 size
    joint_text_tokens = T5_MAX                 # T5 tokens join the image tokens in every block's attention
    step_constant_modules = ("pos_embed",)     # rotary of (text ids, image ids): the key's latent size, T5_MAX
    merged_projections = {"transformer_blocks": JOINT_QKV,
                          "single_transformer_blocks": (("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),)}
    # text and image tokens are both split (joint attention: the rope table runs over text, then image);
    # CFG-parallel applies to true CFG (negative prompt + true_cfg_scale > 1)
    parallel_plan = DiTParallelPlan(
        modes=("ulysses", "ring", "cfg", "tensor"), lists=("transformer_blocks", "single_transformer_blocks"),
        seq_args=("hidden_states", "encoder_hidden_states"),
        rope_args={"image_rotary_emb": (0, ("encoder_hidden_states", "hidden_states"))}, self_attention=("attn",),
        column=("attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
                "ff.net.0.proj", "ff_context.net.0.proj", "proj_mlp"),
        row=("attn.to_out.0", "attn.to_add_out", "ff.net.2", "ff_context.net.2", "proj_out"),
        packed_row={"proj_out": ("attn.to_q", "proj_mlp")}, heads=("attn",),
        fixed_seq={"encoder_hidden_states (T5 text)": T5_MAX})

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.guidance_embeds = bool(self.transformer.config.guidance_embeds)

    def new_task(self, request_id: str, inputs: dict, params: DiffusionParams) -> DiffusionTask:
        p = self.resolve(params, inputs)
        neg = self.negative(inputs, p)
        scale = p.true_cfg_scale if p.true_cfg_scale is not None else 1.0
        return self.packed_task(request_id, inputs, p, neg, scale > 1 and neg is not None, scale)

    def encode(self, tasks: list[DiffusionTask]) -> None:
        prompts = cfg_prompts(tasks)
        tok, clip = self.c["tokenizer"], self.c["text_encoder"]
        ids = tok(prompts, padding="max_length", max_length=tok.model_max_length, truncation=True,
                  return_tensors="pt").input_ids
        pooled = clip(ids.to(self.device), output_hidden_states=False).pooler_output.to(clip.dtype)
        tok2, t5 = self.c["tokenizer_2"], self.c["text_encoder_2"]
        ids2 = tok2(prompts, padding="max_length", max_length=T5_MAX, truncation=True, return_tensors="pt").input_ids
        seq = t5(ids2.to(self.device), output_hidden_states=False)[0].to(t5.dtype)
        assign_conds(tasks, [Conditioning(embeds=seq[i], pooled=pooled[i]) for i in range(len(prompts))])

    def prepare(self, task: DiffusionTask) -> None:
        h, w = task.static["latent_hw"]
        c = self.transformer.config.in_channels // 4
        noise = seeded_noise((task.num_images, c, h, w), task.generator, self.device, task.cond.embeds.dtype)
        task.latents = pack(noise)
        task.static["img_ids"] = latent_ids(h // 2, w // 2, self.device, task.cond.embeds.dtype)

    def denoise(self, key, x, t, conds, row_tasks) -> torch.Tensor:
        return self.denoise_inputs(key, self.graph_inputs(x, t, conds, row_tasks))

    def graph_inputs(self, x, t, conds, row_tasks) -> dict:
        """Every tensor the denoiser call reads (diffusion/step_graphs.py): per row, the latents, timestep,
        T5 and CLIP embeddings and (guidance-distilled) guidance scale; the image position ids."""
        text = torch.stack([c.embeds for c, task in zip(conds, row_tasks) for _ in range(task.num_images)])
        pooled = torch.stack([c.pooled for c, task in zip(conds, row_tasks) for _ in range(task.num_images)])
        inputs = {"x": x, "t": t, "text": text, "pooled": pooled, "img_ids": row_tasks[0].static["img_ids"]}
        if self.guidance_embeds:
            g = [task.params.guidance_scale for task in row_tasks for _ in range(task.num_images)]
            inputs["guidance"] = torch.tensor(g, dtype=torch.float32).to(self.device, non_blocking=True)   # no sync
        return inputs

    def denoise_inputs(self, key, inputs: dict) -> torch.Tensor:
        text = inputs["text"]
        txt_ids = torch.zeros(text.shape[1], 3, device=text.device, dtype=text.dtype)
        return self.transformer(hidden_states=inputs["x"], timestep=inputs["t"], guidance=inputs.get("guidance"),
                                pooled_projections=inputs["pooled"], encoder_hidden_states=text, txt_ids=txt_ids,
                                img_ids=inputs["img_ids"], return_dict=False)[0]

    def decode(self, task: DiffusionTask) -> list:
        h, w = task.static["latent_hw"]
        return self.decode_scaled(task, unpack(task.latents, h, w))
