"""The contract every model family implements, plus the pieces all families share.

A family (one file each under `pipelines/`) turns a diffusers folder into the five phases the
engine drives: `new_task` (resolve params, schedule, CFG layout), `encode` (text conditioning, batched
across requests), `prepare` (seeded latents exactly as diffusers draws them), `denoise` (ONE call of
the denoiser over rows stacked by the runner) with `guide` (combine CFG rows into the solver's input),
and `decode` (VAE -> PIL images or uint8 frames). Shared here: loading the components listed in
`model_index.json`, seeded noise, post-processing, and size validation. `resolve` checks a request
against the model's limits (sizes, and frames for video, from the checkpoint's config) and raises
`ParamError` naming the field before any work; what fails later is that request's run-time error.
`limits()` states those limits and the defaults as data (`DiffusionLimits`), for entry points to
show (`GET /v1/capabilities`). Runs in the stage's process.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from dataclasses import dataclass
from typing import Any, Hashable, Optional

import numpy as np
import torch

from omnistage.diffusion.solvers import Schedule, make_schedule, mu_for
from omnistage.diffusion.step_cache import BlockCacheSpec
from omnistage.diffusion.task import Conditioning, DiffusionTask
from omnistage.parallel.mesh import DiTParallelPlan
from omnistage.params import DiffusionParams, ParamError

_TOKENIZER_HINTS = ("Tokenizer", "TokenizersBackend")


def read_model_index(model_dir: str) -> dict:
    path = os.path.join(model_dir, "model_index.json")
    if not os.path.isfile(path):
        raise ValueError(f"{model_dir!r} is not a diffusers folder: model_index.json is missing")
    with open(path) as f:
        return json.load(f)


def load_components(model_dir: str, index: dict, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """Load each sub-folder named in model_index.json with its own library; the scheduler stays a config."""
    out: dict[str, Any] = {}
    for name, spec in index.items():
        if name.startswith("_") or not isinstance(spec, (list, tuple)) or spec[0] is None or spec[1] is None:
            continue
        lib, cls_name = spec
        sub = os.path.join(model_dir, name)
        if name == "scheduler":
            with open(os.path.join(sub, "scheduler_config.json")) as f:
                out[name] = json.load(f)
            continue
        if lib == "transformers" and any(h in cls_name for h in _TOKENIZER_HINTS):
            from transformers import AutoTokenizer
            out[name] = AutoTokenizer.from_pretrained(sub)
            continue
        cls = getattr(importlib.import_module(lib), cls_name)
        if not hasattr(cls, "parameters"):  # processors, image processors: no weights
            out[name] = cls.from_pretrained(sub)
            continue
        kw = {"dtype": dtype}
        out[name] = cls.from_pretrained(sub, **kw).to(device).eval()
    return out


def seeded_noise(shape: tuple, generator: torch.Generator, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """diffusers' randn_tensor for one generator: drawn on the generator's device, then moved."""
    return torch.randn(shape, generator=generator, device=generator.device, dtype=dtype).to(device)


def to_pil(images: torch.Tensor) -> list:
    """[B, 3, H, W] in [-1, 1] -> PIL images (VaeImageProcessor.postprocess arithmetic)."""
    from PIL import Image

    arr = to_uint8(images.permute(0, 2, 3, 1))
    return [Image.fromarray(a) for a in arr]


def to_uint8(x: torch.Tensor) -> np.ndarray:
    """Channels-last values in [-1, 1] -> uint8 numpy, rounding like diffusers' numpy_to_pil."""
    x = (x * 0.5 + 0.5).clamp(0, 1)
    return (x.cpu().float().numpy() * 255).round().astype("uint8")


def check_multiple(name: str, value: int, multiple: int, maximum: int) -> None:
    if value % multiple != 0 or not (multiple <= value <= maximum):
        raise ParamError(name, f"{name} must be a positive multiple of {multiple} and at most {maximum}, got {value}")


@dataclass
class DiffusionLimits:
    """What a request may ask of one diffusion model, and what it gets when it leaves a field unset."""

    output_kind: str                            # "image" or "video"
    takes_image: bool                           # every request brings an input image (edit, image-to-video)
    default_height: int                         # pixels, of a request that sets no size (edit models: without
    default_width: int                          #   an image; with one the size follows the image)
    size_multiple: tuple[int, int]              # (height, width): a requested size is a multiple of these, pixels
    max_height: int                             # largest accepted height, pixels (a multiple of size_multiple[0])
    max_width: int                              # largest accepted width, pixels (a multiple of size_multiple[1])
    default_steps: int                          # num_inference_steps of a request that sets none
    default_guidance_scale: Optional[float]     # guidance_scale of a request that sets none (None: unused)
    default_num_frames: Optional[int] = None    # video: frames of a request that sets none
    max_num_frames: Optional[int] = None        # video: most frames one clip may have
    frame_step: Optional[int] = None            # video: frame counts are k * frame_step + 1 (others are rounded)
    default_fps: Optional[int] = None           # video: fps of a request that sets none


class DiffusionFamily:
    """Base class: per-family subclasses override the phase methods; this holds shared state."""

    class_names: tuple[str, ...] = ()           # model_index `_class_name`s this family serves
    output_kind = "image"                       # "image" or "video"
    takes_image = False                         # True: every request brings an input image (edit, I2V)
    default_steps = 50
    default_guidance: Optional[float] = None    # None: guidance_scale stays unset unless a request sets it
    max_pixels = 4096                           # largest accepted height / width (see also `max_size`)
    block_cache: Optional[BlockCacheSpec] = None  # the denoiser's repeated blocks, for step caches (None: no cache)
    # what the speed features read (diffusion/speed.py): the components that are denoisers, and the
    # ModuleList attributes of a denoiser that repeat one block class per layer (compiled, offloaded
    # layer by layer, FP8-quantized)
    dit_components: tuple[str, ...] = ("transformer", "transformer_2")
    repeated_blocks: tuple[str, ...] = ("transformer_blocks",)
    # repeated block list -> groups of linear layers (names inside one block) that its forward always
    # calls with the same input tensor: each group runs as one GEMM (layers/merged_linear.py)
    merged_projections: dict[str, tuple[tuple[str, ...], ...]] = {}
    # submodules of a denoiser whose output depends only on `key(task)` of the step's group (rotary
    # tables per resolution): computed once per key (diffusion/speed.py StepConstants)
    step_constant_modules: tuple[str, ...] = ()
    # text tokens that join the image tokens in the DiT's self-attention (joint attention), at the
    # encoders' padded length; 0 where text enters through cross-attention (the attention probe's shape)
    joint_text_tokens: int = 0
    # what a parallel DiT reads (parallel/mesh.py, diffusion/ranks.py); None: one process only
    parallel_plan: Optional[DiTParallelPlan] = None

    def __init__(self, model_dir: str, index: dict, components: dict[str, Any], device: torch.device,
                 dtype: torch.dtype):
        self.model_dir = model_dir
        self.index = index
        self.c = components
        self.device = device
        self.dtype = dtype
        self.scheduler_config: dict = components["scheduler"]
        self.tile_threshold = 1024 * 1024       # decode with VAE tiling above this many output pixels

    def denoisers(self) -> list:
        """The denoiser modules whose `block_cache` blocks a step cache wraps."""
        return [self.c["transformer"]]

    def component_roles(self) -> dict[str, str]:
        """Component name -> role ("dit" | "text_encoder" | "vae") of every module with weights."""
        roles = {}
        for name, comp in self.c.items():
            if not isinstance(comp, torch.nn.Module):
                continue
            if name in self.dit_components:
                roles[name] = "dit"
            elif name.startswith(("text_encoder", "image_encoder")):
                roles[name] = "text_encoder"
            else:
                roles[name] = "vae"
        return roles

    # -- request side --------------------------------------------------------------------------------
    def resolve(self, params: DiffusionParams, inputs: dict) -> DiffusionParams:
        """Fill the model's defaults and validate; raises ValueError naming the field."""
        raise NotImplementedError

    def size_multiples(self) -> tuple[int, int]:
        """(height, width): every output size must be a multiple of these, in pixels."""
        raise NotImplementedError

    def largest_size(self) -> tuple[int, int]:
        """Largest accepted (height, width): `max_pixels` and `max_size`, floored to the multiples."""
        (mh, mw), (top_h, top_w) = self.size_multiples(), self.max_size()
        return min(self.max_pixels, top_h) // mh * mh, min(self.max_pixels, top_w) // mw * mw

    def default_size(self) -> tuple[int, int]:
        """(height, width) in pixels of a request that sets no size."""
        raise NotImplementedError

    def image_tokens(self, height: int, width: int, frames: Optional[int] = None) -> int:
        """DiT tokens of one batch row at that output size (pixels; `frames`: video)."""
        raise NotImplementedError

    def attention_probe_shape(self) -> Optional[tuple[int, int, int, int]]:
        """(rows, heads, tokens, head dim) of the DiT's self-attention at the default request size (one
        row): the shape the "auto" attention backend is measured on (diffusion/attention.py `probe`);
        None when the denoiser's config names no heads."""
        cfg = self.c[next(n for n, r in self.component_roles().items() if r == "dit")].config
        heads, head_dim = cfg.get("num_attention_heads"), cfg.get("attention_head_dim")
        if heads is None and cfg.get("n_heads") and cfg.get("dim"):           # Z-Image's names
            heads, head_dim = cfg["n_heads"], cfg["dim"] // cfg["n_heads"]
        if not heads or not head_dim:
            return None
        lim = self.limits()
        tokens = self.image_tokens(lim.default_height, lim.default_width, lim.default_num_frames)
        return 1, int(heads), tokens + self.joint_text_tokens, int(head_dim)

    def limits(self) -> DiffusionLimits:
        """The model's limits and defaults as data: what `resolve` enforces and fills in (a tiny
        checkpoint's default size may lie over its largest one: then every request must set a size)."""
        (h, w), (top_h, top_w) = self.fitted_size(self.default_size(), self.size_multiples()), self.largest_size()
        return DiffusionLimits(output_kind=self.output_kind, takes_image=self.takes_image, default_height=h,
                               default_width=w, size_multiple=self.size_multiples(), max_height=top_h,
                               max_width=top_w, default_steps=self.default_steps,
                               default_guidance_scale=self.default_guidance)

    def new_task(self, request_id: str, inputs: dict, params: DiffusionParams) -> DiffusionTask:
        raise NotImplementedError

    def key(self, task: DiffusionTask) -> Hashable:
        """Compatibility key of the task's next forward: tasks with equal keys share one forward."""
        return (task.static["shape"], task.do_cfg)

    # -- phases --------------------------------------------------------------------------------------
    def encode(self, tasks: list[DiffusionTask]) -> None:
        raise NotImplementedError

    def prepare(self, task: DiffusionTask) -> None:
        raise NotImplementedError

    def model_input(self, task: DiffusionTask) -> torch.Tensor:
        """The task's rows of the denoiser's sample input, [num_images, ...]."""
        return task.latents

    def model_timestep(self, task: DiffusionTask) -> torch.Tensor:
        """The scalar timestep value the denoiser takes at the task's current step."""
        return task.timestep().to(task.latents.dtype) / 1000

    def denoise(self, key: Hashable, x: torch.Tensor, t: torch.Tensor, conds: list[Conditioning],
                row_tasks: list[DiffusionTask]) -> torch.Tensor:
        """ONE denoiser call: row block i (num_images rows) uses conds[i] and belongs to row_tasks[i].
        A family whose call can be replayed from a CUDA graph (diffusion/step_graphs.py) also has
        `graph_inputs(x, t, conds, row_tasks) -> dict of tensors` and `denoise_inputs(key, inputs)`,
        and its `denoise` is the second applied to the first."""
        raise NotImplementedError

    def guide(self, task: DiffusionTask, cond_out: torch.Tensor, uncond_out: Optional[torch.Tensor]) -> torch.Tensor:
        """Combine CFG rows into the velocity the solver integrates (default: classic CFG)."""
        if uncond_out is None:
            return cond_out
        return uncond_out + task.static["cfg_scale"] * (cond_out - uncond_out)

    def decode(self, task: DiffusionTask) -> Any:
        """The task's latents -> its images (PIL) or videos (uint8 frames), one per latent row."""
        raise NotImplementedError

    def decode_key(self, task: DiffusionTask) -> Hashable:
        """Tasks with equal keys decode in one VAE call (same latent shape and output size)."""
        p = task.params
        return (task.static.get("shape"), task.static.get("latent_hw"), p.height, p.width, p.num_frames)

    def decode_batch(self, tasks: list[DiffusionTask]) -> list[list]:
        """ONE VAE decode over the latent rows of tasks with equal `decode_key`s -> each task's results.

        `decode` reads only the latents and the shape-level fields the key holds, so the tasks'
        rows stacked into one task decode as each would alone (VAE rows are independent)."""
        if len(tasks) == 1:
            return [list(self.decode(tasks[0]))]
        joined = dataclasses.replace(tasks[0], latents=torch.cat([t.latents for t in tasks]),
                                     num_images=sum(t.num_images for t in tasks))
        results, start = list(self.decode(joined)), 0
        out = []
        for t in tasks:
            out.append(results[start: start + t.num_images])
            start += t.num_images
        return out

    # -- shared helpers ------------------------------------------------------------------------------
    def fill_defaults(self, params: DiffusionParams, size: tuple[int, int], default_guidance: Optional[float],
                      **more) -> DiffusionParams:
        """Unset height / width / steps / guidance take the model's defaults (`size` is (height, width),
        scaled down, aspect kept, when the model's position tables are shorter: `fitted_size`);
        height and width must be multiples of `size_multiples()`, at most `largest_size()`; `more`
        sets further fields."""
        if not (params.height and params.width):
            size = self.fitted_size(size, self.size_multiples())
        p = params.clone(height=params.height or size[0], width=params.width or size[1],
                         num_inference_steps=params.num_inference_steps or self.default_steps,
                         guidance_scale=params.guidance_scale if params.guidance_scale is not None
                         else default_guidance, **more)
        (mh, mw), (top_h, top_w) = self.size_multiples(), self.largest_size()
        check_multiple("height", p.height, mh, top_h)
        check_multiple("width", p.width, mw, top_w)
        return p

    def fitted_size(self, size: tuple[int, int], multiples: tuple[int, int]) -> tuple[int, int]:
        """`size` (height, width) scaled down by one factor until it fits `max_size` and
        `max_pixels`, each side rounded down to its multiple (at least one multiple)."""
        top_h, top_w = (min(self.max_pixels, m) for m in self.max_size())
        scale = min(1.0, top_h / size[0], top_w / size[1])
        return tuple(max(m, int(v * scale) // m * m) for v, m in zip(size, multiples))

    def max_size(self) -> tuple[int, int]:
        """Largest (height, width) in pixels the model's denoiser takes: families whose position
        tables have a fixed length (rope or learnt embeddings) derive it from the checkpoint's
        config, so that a request over it is refused up front rather than failing mid-denoising."""
        return self.max_pixels, self.max_pixels

    def schedule(self, num_steps: int, image_seq_len: int, base_sigmas: Optional[list] = None) -> Schedule:
        mu = mu_for(self.scheduler_config, image_seq_len) if self.scheduler_config.get("use_dynamic_shifting") else None
        return make_schedule(self.scheduler_config, num_steps, mu=mu, sigmas=base_sigmas)

    @staticmethod
    def generator(params: DiffusionParams) -> torch.Generator:
        g = torch.Generator("cpu")
        if params.seed is not None:
            g.manual_seed(params.seed)
        else:
            g.seed()
        return g

    @staticmethod
    def negative(inputs: dict, params: DiffusionParams) -> Optional[str]:
        neg = inputs.get("negative_prompt")
        return neg if neg is not None else params.negative_prompt

    @staticmethod
    def prompt(inputs: dict) -> str:
        p = inputs.get("prompt")
        if not isinstance(p, str):
            raise ParamError("prompt", f"prompt must be a string, got {type(p).__name__}")
        return p

    def set_tiling(self, vae, pixels: int) -> None:
        if hasattr(vae, "enable_tiling"):
            vae.enable_tiling() if pixels > self.tile_threshold else vae.disable_tiling()


class ImageFamily(DiffusionFamily):
    """Text-to-image families with one transformer and a VAE (FLUX, SD3, Z-Image, Qwen-Image)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.transformer = self.c["transformer"]
        self.vae = self.c["vae"]
        self.vae_scale = self.vae_scale_factor()
        self.multiple = self.vae_scale * self.latent_patch()    # height / width must be multiples of this

    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    def latent_patch(self) -> int:
        """Latent pixels per transformer token side (2 for 2x2-packed latents)."""
        return 2

    def default_size(self) -> tuple[int, int]:
        return 128 * self.vae_scale, 128 * self.vae_scale

    def size_multiples(self) -> tuple[int, int]:
        return self.multiple, self.multiple

    def image_tokens(self, height: int, width: int, frames: Optional[int] = None) -> int:
        return (height // self.multiple) * (width // self.multiple)

    def resolve(self, params: DiffusionParams, inputs: dict) -> DiffusionParams:
        return self.fill_defaults(params, self.default_size(), self.default_guidance)

    def packed_task(self, request_id: str, inputs: dict, p: DiffusionParams, negative: Optional[str], do_cfg: bool,
                    cfg_scale: float, sigmas: Optional[list] = None) -> DiffusionTask:
        """A task over 2x2-packed latents, scheduled with base sigmas linspace(1, 1/n, n) unless given."""
        task = DiffusionTask(request_id=request_id, params=p, prompt=self.prompt(inputs), negative_prompt=negative,
                             generator=self.generator(p), num_images=p.num_outputs_per_prompt, do_cfg=do_cfg)
        h, w = 2 * (p.height // self.multiple), 2 * (p.width // self.multiple)
        task.tokens_per_row = self.image_tokens(p.height, p.width)
        task.static.update(cfg_scale=cfg_scale, latent_hw=(h, w), shape=(h, w))
        n = p.num_inference_steps
        task.schedule = self.schedule(n, task.tokens_per_row,
                                      sigmas if sigmas is not None else list(np.linspace(1.0, 1 / n, n)))
        return task

    def decode_scaled(self, task: DiffusionTask, z: torch.Tensor) -> list:
        """KL-VAE latents (scaling / shift factors) -> PIL images."""
        z = (z / self.vae.config.scaling_factor) + self.vae.config.shift_factor
        self.set_tiling(self.vae, task.params.height * task.params.width)
        return to_pil(self.vae.decode(z.to(self.vae.dtype), return_dict=False)[0])


JOINT_QKV = (("attn.to_q", "attn.to_k", "attn.to_v"), ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"))
"""The merge groups of a joint-attention block (image q|k|v, text q|k|v): FLUX, SD3, Qwen-Image."""


def cfg_prompts(tasks: list[DiffusionTask]) -> list[str]:
    """The prompts one batched encode runs: every task's prompt, then the negatives of CFG tasks."""
    return [t.prompt for t in tasks] + [t.negative_prompt for t in tasks if t.do_cfg]


def assign_conds(tasks: list[DiffusionTask], conds: list[Conditioning]) -> None:
    """Hand the conditionings of `cfg_prompts(tasks)` back to their tasks (cond, then uncond)."""
    negs = iter(conds[len(tasks):])
    for task, cond in zip(tasks, conds):
        task.cond = cond
        if task.do_cfg:
            task.uncond = next(negs)


def vae_stats(vae, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, 1 / std) of a latent-normalising VAE config (Qwen-Image, Wan), shaped [1, z, 1, 1, 1]."""
    cfg = vae.config
    mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(device, dtype)
    inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(device, dtype)
    return mean, inv_std


def pad_stack(embeds: list[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Right-pad [L_i, D] sequences to one [B, L, D] tensor; mask is None when nothing was padded."""
    lengths = [e.shape[0] for e in embeds]
    top = max(lengths)
    if all(n == top for n in lengths):
        return torch.stack(embeds), None
    out = embeds[0].new_zeros(len(embeds), top, embeds[0].shape[-1])
    mask = torch.zeros(len(embeds), top, dtype=torch.long, device=embeds[0].device)
    for i, e in enumerate(embeds):
        out[i, : e.shape[0]] = e
        mask[i, : e.shape[0]] = 1
    return out, mask
