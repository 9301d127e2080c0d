"""The contract every model family implements, plus the pieces all families share.

A family (one file each under `pipelines/`) turns a diffusers folder into the five phases the
engine drives: `new_task` (resolve params, schedule, CFG layout), `encode` (text conditioning, batched
across requests), `prepare` (seeded latents exactly as diffusers draws them), `denoise` (ONE call of
the denoiser over rows stacked by the runner) with `guide` (combine CFG rows into the solver's input),
and `decode` (VAE -> PIL images or uint8 frames). Shared here: loading the components listed in
`model_index.json`, seeded noise, post-processing, and size validation. Runs in the stage's process.
"""

from __future__ import annotations

import importlib
import json
import os
from typing import Any, Hashable, Optional

import numpy as np
import torch

from omnistage.diffusion.solvers import Schedule, make_schedule, mu_for
from omnistage.diffusion.task import Conditioning, DiffusionTask
from omnistage.params import DiffusionParams

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
        raise ValueError(f"{name} must be a positive multiple of {multiple} and at most {maximum}, got {value}")


class DiffusionFamily:
    """Base class: per-family subclasses override the phase methods; this holds shared state."""

    class_names: tuple[str, ...] = ()           # model_index `_class_name`s this family serves
    output_kind = "image"                       # "image" or "video"
    default_steps = 50
    max_pixels = 4096                           # largest accepted height / width

    def __init__(self, model_dir: str, index: dict, components: dict[str, Any], device: torch.device,
                 dtype: torch.dtype):
        self.model_dir = model_dir
        self.index = index
        self.c = components
        self.device = device
        self.dtype = dtype
        self.scheduler_config: dict = components["scheduler"]
        self.tile_threshold = 1024 * 1024       # decode with VAE tiling above this many output pixels

    # -- request side --------------------------------------------------------------------------------
    def resolve(self, params: DiffusionParams, inputs: dict) -> DiffusionParams:
        """Fill the model's defaults and validate; raises ValueError naming the field."""
        raise NotImplementedError

    def new_task(self, request_id: str, inputs: dict, params: DiffusionParams) -> DiffusionTask:
        raise NotImplementedError

    def key(self, task: DiffusionTask) -> Hashable:
        """Compatibility key of the task's next forward: tasks with equal keys share one forward."""
        return (tuple(task.latents.shape[1:]) if task.latents is not None else task.static.get("shape"),
                task.do_cfg)

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
        """ONE denoiser call: row block i (num_images rows) uses conds[i] and belongs to row_tasks[i]."""
        raise NotImplementedError

    def guide(self, task: DiffusionTask, cond_out: torch.Tensor, uncond_out: Optional[torch.Tensor]) -> torch.Tensor:
        """Combine CFG rows into the velocity the solver integrates (default: classic CFG)."""
        if uncond_out is None:
            return cond_out
        return uncond_out + task.static["cfg_scale"] * (cond_out - uncond_out)

    def decode(self, task: DiffusionTask) -> Any:
        raise NotImplementedError

    # -- shared helpers ------------------------------------------------------------------------------
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
            raise ValueError(f"prompt must be a string, got {type(p).__name__}")
        return p

    def set_tiling(self, vae, pixels: int) -> None:
        if hasattr(vae, "enable_tiling"):
            vae.enable_tiling() if pixels > self.tile_threshold else vae.disable_tiling()


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
