"""One denoising step for a group of compatible tasks (stage process; knows no model names).

In: the tasks the scheduler grouped (equal compatibility keys, possibly at different timesteps).
The runner stacks each task's sample rows once per CFG branch (conditional, then unconditional) into
one batch with one timestep per row, makes ONE denoiser call through the family, splits the output
back per task, lets the family combine the CFG rows, and advances each task with its own solver
state. Out: a `DiffusionRunnerOutput` (who stepped, each one's next compatibility key, and who
failed: a forward that raises is retried task by task, so only the request that breaks it fails).
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Optional

import torch

from omnistage.diffusion.pipelines.base import DiffusionFamily
from omnistage.diffusion.scheduler import DiffusionRunnerOutput
from omnistage.diffusion.solvers import solver_step
from omnistage.diffusion.step_cache import StepCache
from omnistage.diffusion.step_graphs import StepGraphs
from omnistage.diffusion.task import DiffusionTask


class DiffusionRunner:
    def __init__(self, family: DiffusionFamily, cache: Optional[StepCache] = None, phase: Optional[Callable] = None,
                 denoise: Optional[Callable] = None, constants: Optional[Callable] = None,
                 graphs: Optional[StepGraphs] = None):
        """`cache`: the step cache consulted inside the denoiser's blocks, or None. `phase(name)`: the
        context the denoiser call runs in (diffusion/speed.py `Accelerator.phase`: its attention
        backend, offload moves); None runs it as is. `denoise(key, x, t, conds, row_tasks, branches)`:
        the denoiser call over the stacked rows (`branches[i]`: block i's CFG branch, 0 = prompt,
        1 = negative); None: the family's own `denoise` in this process (a parallel DiT passes
        `DiTRanks.denoise`, diffusion/ranks.py). `constants(key)`: the context that lets the DiT's
        step-constant modules answer from their cache for the group's compatibility key
        (`StepConstants.use`, diffusion/speed.py); None: none. `graphs`: a `StepGraphs` that replays the
        family's `denoise_inputs` from CUDA graphs (diffusion/step_graphs.py; the engine passes it only
        with no step cache and no parallel ranks); None: the call runs as is."""
        self.family = family
        self.denoise = denoise or (lambda key, x, t, conds, row_tasks, branches:
                                   family.denoise(key, x, t, conds, row_tasks))
        self.cache = cache
        self.phase = phase or (lambda name: contextlib.nullcontext())
        self.constants = constants or (lambda key: contextlib.nullcontext())
        self.graphs = graphs
        self.last_batch_rows = 0                # rows of the most recent forward
        self.last_batch_tasks = 0               # tasks in the most recent forward
        self.max_batch_rows = 0                 # largest forward seen (rows)
        self.max_batch_tasks = 0                # largest forward seen (tasks)
        self.num_forwards = 0                   # denoiser calls so far
        self.last_step_time = 0.0               # seconds of the most recent step

    @torch.no_grad()
    def step(self, tasks: list[DiffusionTask]) -> DiffusionRunnerOutput:
        """One step of every task; a task whose forward raises is in `failed` and the others step.

        A shared forward that raises is run again one task at a time, so that one request's bad
        inputs fail only that request; nothing has advanced before the forward's velocities are
        all computed, so a retried task steps exactly once."""
        start = time.perf_counter()
        try:
            velocities = self._velocities(tasks)
        except Exception as e:
            if len(tasks) == 1:
                return DiffusionRunnerOutput(failed={tasks[0].request_id: f"denoising failed: {e}"})
            result = DiffusionRunnerOutput()
            for task in tasks:
                alone = self.step([task])
                result.stepped += alone.stepped
                result.next_keys.update(alone.next_keys)
                result.failed.update(alone.failed)
            return result
        fam = self.family
        result = DiffusionRunnerOutput()
        for task, v in zip(tasks, velocities):
            task.latents, task.solver_state = solver_step(task.latents, v, task.schedule, task.step_index,
                                                          task.solver_state)
            task.step_index += 1
            result.stepped.append(task.request_id)
            if not task.finished:
                result.next_keys[task.request_id] = fam.key(task)
        elapsed = time.perf_counter() - start
        rows = sum(task.num_rows for task in tasks)
        for task in tasks:
            task.add_time("denoise", elapsed)
        self.last_step_time = elapsed
        self.last_batch_rows, self.last_batch_tasks = rows, len(tasks)
        self.max_batch_rows = max(self.max_batch_rows, rows)
        self.max_batch_tasks = max(self.max_batch_tasks, len(tasks))
        self.num_forwards += 1
        return result

    def _velocities(self, tasks: list[DiffusionTask]) -> list[torch.Tensor]:
        """ONE denoiser call over every task's rows -> each task's guided velocity (changes no task)."""
        fam = self.family
        xs, ts, conds, row_tasks, branches = [], [], [], [], []
        for task in tasks:
            x = fam.model_input(task)
            t = fam.model_timestep(task).reshape(1).expand(x.shape[0])
            for branch, cond in enumerate([task.cond] + ([task.uncond] if task.do_cfg else [])):
                xs.append(x)
                ts.append(t)
                conds.append(cond)
                row_tasks.append(task)
                branches.append(branch)
        key = fam.key(tasks[0])
        x = torch.cat(xs)
        # non_blocking: a host -> device copy that does not wait for the queued GPU work (no host sync)
        t = torch.cat(ts).to(x.device, non_blocking=True)
        if self.graphs is not None:             # no step constants inside a graph (step_graphs.py)
            with self.phase("denoise"):
                out = self.graphs.run(key, fam.graph_inputs(x, t, conds, row_tasks),
                                      lambda inputs: fam.denoise_inputs(key, inputs))
        else:
            cached = self.cache.forward(tasks) if self.cache is not None else contextlib.nullcontext()
            with self.phase("denoise"), cached, self.constants(key):
                out = self.denoise(key, x, t, conds, row_tasks, branches)
        velocities, row = [], 0
        for task in tasks:
            n = task.num_images
            cond_out = out[row: row + n]
            uncond_out = out[row + n: row + 2 * n] if task.do_cfg else None
            row += task.num_rows
            velocities.append(fam.guide(task, cond_out, uncond_out))
        return velocities
