"""One denoising step for a group of compatible tasks (stage process; knows no model names).

In: the tasks the scheduler grouped (equal compatibility keys, possibly at different timesteps).
The runner stacks each task's sample rows once per CFG branch (conditional, then unconditional) into
one batch with one timestep per row, makes ONE denoiser call through the family, splits the output
back per task, lets the family combine the CFG rows, and advances each task with its own solver
state. Out: a `DiffusionRunnerOutput` (who stepped, each one's next compatibility key).
"""

from __future__ import annotations

import time

import torch

from omnistage.diffusion.pipelines.base import DiffusionFamily
from omnistage.diffusion.scheduler import DiffusionRunnerOutput
from omnistage.diffusion.solvers import solver_step
from omnistage.diffusion.task import DiffusionTask


class DiffusionRunner:
    def __init__(self, family: DiffusionFamily):
        self.family = family
        self.last_batch_rows = 0                # rows of the most recent forward
        self.last_batch_tasks = 0               # tasks in the most recent forward
        self.max_batch_rows = 0                 # largest forward seen (rows)
        self.max_batch_tasks = 0                # largest forward seen (tasks)
        self.num_forwards = 0                   # denoiser calls so far
        self.last_step_time = 0.0               # seconds of the most recent step

    @torch.no_grad()
    def step(self, tasks: list[DiffusionTask]) -> DiffusionRunnerOutput:
        fam = self.family
        start = time.perf_counter()
        xs, ts, conds, row_tasks = [], [], [], []
        for task in tasks:
            x = fam.model_input(task)
            t = fam.model_timestep(task).reshape(1).expand(x.shape[0])
            for cond in [task.cond] + ([task.uncond] if task.do_cfg else []):
                xs.append(x)
                ts.append(t)
                conds.append(cond)
                row_tasks.append(task)
        key = fam.key(tasks[0])
        x = torch.cat(xs)
        out = fam.denoise(key, x, torch.cat(ts).to(x.device), conds, row_tasks)

        result = DiffusionRunnerOutput()
        row = 0
        for task in tasks:
            n = task.num_images
            cond_out = out[row: row + n]
            uncond_out = out[row + n: row + 2 * n] if task.do_cfg else None
            row += task.num_rows
            v = fam.guide(task, cond_out, uncond_out)
            task.latents, task.solver_state = solver_step(task.latents, v, task.schedule, task.step_index,
                                                          task.solver_state)
            task.step_index += 1
            result.stepped.append(task.request_id)
            if not task.finished:
                result.next_keys[task.request_id] = fam.key(task)
        elapsed = time.perf_counter() - start
        for task in tasks:
            task.add_time("denoise", elapsed)
        self.last_step_time = elapsed
        self.last_batch_rows, self.last_batch_tasks = row, len(tasks)
        self.max_batch_rows = max(self.max_batch_rows, row)
        self.max_batch_tasks = max(self.max_batch_tasks, len(tasks))
        self.num_forwards += 1
        return result
