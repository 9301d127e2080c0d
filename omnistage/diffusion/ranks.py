"""The ranks of a parallel DiT: rank 0 in the stage's process, ranks 1..N-1 in child processes.

In: a diffusion stage whose `EngineConfig.parallel_config` has a world size > 1, and the family it
serves (which declares a `parallel_plan`, `parallel/mesh.py`). `DiTRanks` (rank 0, built by the
engine) checks the config against the family (`check_parallel`: modes, heads, widths -> ValueError
naming the option), starts ranks 1..N-1 (`parallel/group.py`: processes, or Ray actors under Ray; each builds the same family -- the same
model folder, or a benchmark's seeded weights -- on its own device and applies the same plan), joins the group and then, every step, sends one
`DenoiseCommand` over the gloo step channel: the batching key, each row block's (request, CFG
branch, step), the tasks the ranks have not seen yet (their conditioning, on the host, once per
request) and the requests to forget; the stacked sample and timesteps follow by broadcast on the
device group. Every rank then runs `DiTParallel.denoise`: its CFG branch's blocks (`parallel/cfg.py`)
through the family's own `denoise`, whose blocks are sequence-split (`parallel/sequence.py`) and / or
tensor-split (`parallel/dit_tensor.py`); the ranks' outputs are merged, so rank 0 gets the whole
batch's output and alone runs guidance, the solver, encode and decode: latents live on rank 0 only.
Out: `DiTRanks.denoise` has the signature of the runner's denoiser call. A step that raises on one
rank raises on all (same inputs, same code), so the group stays in step; a rank that dies makes the
next collective raise on rank 0 and the engine fails that step's requests (restarting the ranks is
not done here).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional

import torch
import torch.distributed as dist

from omnistage.config import DiffusionParallelConfig, EngineConfig
from omnistage.diffusion.pipelines.base import load_components, read_model_index
from omnistage.diffusion.speed import Accelerator, DiffusionSpeed
from omnistage.diffusion.task import Conditioning, DiffusionTask
from omnistage.parallel import group
from omnistage.parallel.cfg import cfg_blocks, cfg_merge
from omnistage.parallel.dit_tensor import column_sizes, shard_blocks
from omnistage.parallel.mesh import DiTMesh, check_plan
from omnistage.parallel.sequence import SequenceParallel

log = logging.getLogger(__name__)


@dataclass
class DenoiseCommand:
    """Rank 0 -> every rank, once per denoiser call (pickled over the gloo step channel)."""

    key: Hashable                               # the batch's compatibility key (family.key), e.g. Wan's expert
    blocks: list[tuple[str, int, int]]          # per row block, in row order: (request_id, CFG branch 0 | 1, step)
    new: dict[str, DiffusionTask] = field(default_factory=dict)   # tasks first seen now (host tensors only)
    drop: list[str] = field(default_factory=list)                 # request ids the ranks may forget
    x_shape: tuple[int, ...] = ()               # the stacked sample's shape (broadcast after this command)
    x_dtype: str = "float32"                    # its dtype name
    t_shape: tuple[int, ...] = ()               # the per-row timesteps' shape (broadcast after the sample)
    t_dtype: str = "float32"                    # their dtype name


def _moved(obj: Any, device: torch.device) -> Any:
    """`obj` with every tensor inside (dicts, lists, tuples, Conditioning) on `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _moved(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_moved(v, device) for v in obj)
    if isinstance(obj, Conditioning):
        return dataclasses.replace(obj, **{f.name: _moved(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj)})
    return obj


def _for_ranks(task: DiffusionTask) -> DiffusionTask:
    """What the other ranks' denoiser call reads of a task: params, conditioning, static tensors (host)."""
    cpu = torch.device("cpu")
    return dataclasses.replace(task, generator=None, latents=None, solver_state=None, schedule=None, images=[],
                               cond=_moved(task.cond, cpu), uncond=_moved(task.uncond, cpu),
                               static=_moved(task.static, cpu), timings={})


def check_parallel(family, config: DiffusionParallelConfig) -> None:
    """ValueError naming the option when `family` cannot run `config` (see `parallel.mesh.check_plan`)."""
    plan = family.parallel_plan
    denoiser = family.denoisers()[0]
    heads = int(denoiser.config.get("num_attention_heads", 1))
    widths = column_sizes(denoiser, plan) if plan is not None and config.tensor_parallel_size > 1 else {}
    check_plan(type(family).__name__, plan, config, heads, widths)


class DiTParallel:
    """One rank's share of the denoiser: the family's plan applied to its denoisers, CFG split."""

    def __init__(self, family, config: DiffusionParallelConfig):
        self.family = family
        self.mesh = DiTMesh.build(config)
        plan = family.parallel_plan
        for denoiser in family.denoisers():
            if config.tensor_parallel_size > 1:
                shard_blocks(denoiser, plan, self.mesh)
            if config.sequence_parallel_size > 1:
                SequenceParallel(plan, self.mesh).install(denoiser)

    @torch.no_grad()
    def denoise(self, key, x: torch.Tensor, t: torch.Tensor, conds: list, row_tasks: list,
                branches: list[int]) -> Optional[torch.Tensor]:
        """This rank's blocks through `family.denoise`, merged: the whole output (None on a cfg rank 1
        when no block was its)."""
        rows = [task.num_images for task in row_tasks]
        mine = cfg_blocks(branches, self.mesh)
        out = None
        if len(mine) == len(branches):
            out = self.family.denoise(key, x, t, conds, row_tasks)
        elif mine:
            starts = [sum(rows[:i]) for i in range(len(rows))]
            pick = torch.cat([torch.arange(starts[i], starts[i] + rows[i]) for i in mine]).to(x.device)
            out = self.family.denoise(key, x.index_select(0, pick), t.index_select(0, pick),
                                      [conds[i] for i in mine], [row_tasks[i] for i in mine])
        return cfg_merge(out, branches, rows, self.mesh)

    def sequence_multiple(self) -> int:
        """Latent tokens of a row must be a multiple of this (the sequence is cut in equal pieces)."""
        return self.mesh.sp_size


class DiTRanks:
    """Rank 0's side: starts the other ranks, joins the group, sends each step's command."""

    def __init__(self, family, loader: Callable, config: EngineConfig):
        """`loader(device, dtype) -> family`: picklable (a module-level function or a partial of one);
        each other rank calls it to build the same family (weights) on its own device."""
        pc = config.parallel_config
        check_parallel(family, pc)
        init = group.ParallelInit.for_engine(config, pc.world_size, option="parallel_config world size")
        self.workers = group.spawn_ranks(init, rank_main, (loader, config))
        group.init_rank(init, 0)
        self.device = family.device
        self.parallel = DiTParallel(family, pc)
        self.channel = group.StepChannel()
        self.known: set[str] = set()            # requests whose task the other ranks hold
        self.dropped: list[str] = []            # requests to forget with the next command

    def denoise(self, key, x, t, conds, row_tasks, branches) -> torch.Tensor:
        new = {task.request_id: _for_ranks(task) for task in row_tasks if task.request_id not in self.known}
        self.known.update(new)
        cmd = DenoiseCommand(key=key, blocks=[(task.request_id, b, task.step_index)
                                              for task, b in zip(row_tasks, branches)],
                             new=new, drop=self.dropped, x_shape=tuple(x.shape), x_dtype=str(x.dtype)[6:],
                             t_shape=tuple(t.shape), t_dtype=str(t.dtype)[6:])
        self.dropped = []
        self.channel.send(cmd)
        x, t = x.contiguous(), t.contiguous()
        dist.broadcast(x, 0)
        dist.broadcast(t, 0)
        return self.parallel.denoise(key, x, t, conds, row_tasks, branches)

    def forget(self, request_id: str) -> None:
        if request_id in self.known:
            self.known.discard(request_id)
            self.dropped.append(request_id)

    def close(self) -> None:
        """Stop the other ranks and leave the group."""
        try:
            self.channel.send(None)
        finally:
            self.workers.close()
            group.destroy()


def load_family(model_dir: str, family_cls: type, device: torch.device, dtype: torch.dtype):
    """A family loaded from its diffusers folder onto `device` (the loader of engines built from a folder)."""
    index = read_model_index(model_dir)
    return family_cls(model_dir, index, load_components(model_dir, index, dtype, device), device, dtype)


def rank_main(init: group.ParallelInit, rank: int, loader: Callable, config: EngineConfig) -> None:
    """A child rank: build the family on this rank's device, apply the plan, run commands until None."""
    group.init_rank(init, rank)
    device = init.device(rank)
    config = dataclasses.replace(config, device=str(device))
    if device.type == "cpu":
        config.apply_cpu_threads()
    family = loader(device, config.torch_dtype())
    accel = Accelerator(family, DiffusionSpeed.from_config(config))
    parallel = DiTParallel(family, config.parallel_config)
    channel = group.StepChannel()
    tasks: dict[str, DiffusionTask] = {}
    while True:
        cmd: Optional[DenoiseCommand] = channel.recv()
        if cmd is None:
            break
        for rid in cmd.drop:
            tasks.pop(rid, None)
        for rid, task in cmd.new.items():
            tasks[rid] = dataclasses.replace(task, cond=_moved(task.cond, device), uncond=_moved(task.uncond, device),
                                             static=_moved(task.static, device))
        x = torch.empty(cmd.x_shape, dtype=getattr(torch, cmd.x_dtype), device=device)
        t = torch.empty(cmd.t_shape, dtype=getattr(torch, cmd.t_dtype), device=device)
        dist.broadcast(x, 0)
        dist.broadcast(t, 0)
        row_tasks, conds, branches = [], [], []
        for rid, branch, step in cmd.blocks:
            task = tasks[rid]
            task.step_index = step
            row_tasks.append(task)
            conds.append(task.cond if branch == 0 else task.uncond)
            branches.append(branch)
        try:
            with accel.phase("denoise"):
                parallel.denoise(cmd.key, x, t, conds, row_tasks, branches)
        except Exception:     # rank 0 raises the same error and fails the step's requests
            log.exception("rank %d: denoiser call failed", rank)
    group.destroy()
