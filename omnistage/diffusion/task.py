"""`DiffusionTask`: everything one request owns while it is denoised (engine-internal, stage process).

In: built by a family pipeline (`pipelines/<family>.py`) from the request's inputs and resolved
`DiffusionParams`. The pipeline fills the conditioning at encode time and the latents at prepare time;
the runner advances `latents`, `step_index` and `solver_state` once per forward; the engine turns the
finished task into a `RequestOutput`. Nothing per-request lives anywhere else, so tasks at different
timesteps can share one forward without mixing state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from omnistage.diffusion.solvers import Schedule
from omnistage.params import DiffusionParams


@dataclass
class Conditioning:
    embeds: Any                                 # text embeddings, [num_images, seq, dim] (or list per image)
    mask: Optional[torch.Tensor] = None         # [num_images, seq] 1 = real token, None = all real
    pooled: Optional[torch.Tensor] = None       # pooled text embedding [num_images, dim] (FLUX, SD3)
    extra: dict[str, Any] = field(default_factory=dict)  # family-specific tensors (e.g. CLIP image embeds)


@dataclass
class DiffusionTask:
    request_id: str
    params: DiffusionParams                     # resolved: every size / step / guidance field is set
    prompt: str
    negative_prompt: Optional[str]              # None = no negative branch asked for
    generator: torch.Generator                  # seeded CPU generator: the latents' noise comes from here
    num_images: int                             # images (or videos) this request makes = rows per CFG branch
    do_cfg: bool                                # run an unconditional / negative branch as extra rows
    images: list[Any] = field(default_factory=list)  # input PIL images (edit, image-to-video)
    arrival_time: float = field(default_factory=time.time)  # seconds since the epoch
    cond: Optional[Conditioning] = None         # positive prompt conditioning, set by encode
    uncond: Optional[Conditioning] = None       # negative prompt conditioning when do_cfg
    latents: Optional[torch.Tensor] = None      # current sample, [num_images, ...] in the model's layout
    schedule: Optional[Schedule] = None         # sigmas / timesteps of this request
    step_index: int = 0                         # next denoising step to run, 0..num_steps
    solver_state: Any = None                    # multistep solver history (UniPC), owned by this task only
    static: dict[str, Any] = field(default_factory=dict)  # per-request constants for the denoiser (ids, shapes)
    tokens_per_row: int = 1                     # image tokens per batch row (token budget of the scheduler)
    timings: dict[str, float] = field(default_factory=dict)  # phase -> seconds (encode, denoise, decode)

    @property
    def num_steps(self) -> int:
        return self.schedule.num_steps if self.schedule is not None else int(self.params.num_inference_steps)

    @property
    def num_rows(self) -> int:
        """Batch rows this task adds to a forward: one per image, doubled when CFG runs as extra rows."""
        return self.num_images * (2 if self.do_cfg else 1)

    @property
    def finished(self) -> bool:
        return self.schedule is not None and self.step_index >= self.schedule.num_steps

    @property
    def progress(self) -> float:
        return self.step_index / max(1, self.num_steps)

    def timestep(self) -> torch.Tensor:
        return self.schedule.timesteps[self.step_index]

    def sigma(self) -> float:
        return float(self.schedule.sigmas[self.step_index])

    def add_time(self, phase: str, seconds: float) -> None:
        self.timings[phase] = self.timings.get(phase, 0.0) + seconds

