"""Profiles of a stage's engine steps, on request (the stage's process: `stage_client._serve`).

`OMNISTAGE_TORCH_PROFILER_DIR` (vLLM's `VLLM_TORCH_PROFILER_DIR`) set to a folder turns it on: after
`OMNISTAGE_PROFILER_WARMUP` steps with work (default 3: graph captures, first allocations), the next
`OMNISTAGE_PROFILER_STEPS` (default 20) run under torch.profiler (CPU activities, and CUDA when the
process has a GPU) and cProfile together; then, per stage, three text files go into the folder:

  <stage>-<pid>.torch-cpu.txt    the profiler's key averages, top 40 by self CPU time
  <stage>-<pid>.torch-cuda.txt   the same, top 40 by self CUDA time (all zeros without a GPU)
  <stage>-<pid>.cprofile.txt     cProfile's top 40 functions by cumulative time, and the step count

Fewer steps than asked (the process stopped first) are written when it stops (`close`). Unset, the
stage pays one attribute check per step.
"""

from __future__ import annotations

import cProfile
import io
import logging
import os
import pstats
import time
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

DIR_ENV = "OMNISTAGE_TORCH_PROFILER_DIR"
STEPS_ENV = "OMNISTAGE_PROFILER_STEPS"
WARMUP_ENV = "OMNISTAGE_PROFILER_WARMUP"
ROWS = 40                                       # rows of each table


def _count(name: str, default: int, least: int) -> int:
    raw = os.environ.get(name, "")
    try:
        value = int(raw) if raw else default
    except ValueError:
        value = least - 1
    if value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {raw!r}")
    return value


class StepProfiler:
    """Wraps a stage's steps (`run`); records steps warmup..warmup+steps-1 and writes their tables."""

    def __init__(self, folder: str, stage: str, steps: int = 20, warmup: int = 3):
        os.makedirs(folder, exist_ok=True)
        self.prefix = os.path.join(folder, f"{stage}-{os.getpid()}")
        self.steps, self.warmup = steps, warmup
        self.seen = 0                           # steps run so far (recorded or not)
        self.recorded = 0                       # steps recorded
        self.done = False                       # tables written
        self._torch: Any = None                 # the torch.profiler.profile while recording
        self._cprofile: Optional[cProfile.Profile] = None
        self._seconds = 0.0                     # wall seconds of the recorded steps

    @classmethod
    def from_env(cls, stage: str) -> Optional["StepProfiler"]:
        folder = os.environ.get(DIR_ENV)
        if not folder:
            return None
        return cls(folder, stage, _count(STEPS_ENV, 20, 1), _count(WARMUP_ENV, 3, 0))

    def run(self, step: Callable[[], Any]) -> Any:
        """One step, recorded when its turn has come."""
        if self.done:
            return step()
        self.seen += 1
        if self.seen <= self.warmup:
            return step()
        if self._torch is None:
            self._start()
        t = time.perf_counter()
        self._cprofile.enable()
        try:
            return step()
        finally:
            self._cprofile.disable()
            self._seconds += time.perf_counter() - t
            self.recorded += 1
            if self.recorded >= self.steps:
                self.close()

    def _start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            activities.append(ProfilerActivity.CUDA)
        self._torch = profile(activities=activities)
        self._torch.__enter__()
        self._cprofile = cProfile.Profile()

    def close(self) -> None:
        """Stops recording and writes the tables (once; nothing when no step was recorded)."""
        if self.done or self._torch is None:
            return
        self.done = True
        self._torch.__exit__(None, None, None)
        averages = self._torch.key_averages()
        head = f"{self.recorded} steps, {self._seconds * 1e3 / max(self.recorded, 1):.2f} ms per step (wall)\n"
        self._write("torch-cpu", head + averages.table(sort_by="self_cpu_time_total", row_limit=ROWS))
        self._write("torch-cuda", head + averages.table(sort_by=_device_key(averages), row_limit=ROWS))
        text = io.StringIO()
        pstats.Stats(self._cprofile, stream=text).sort_stats("cumulative").print_stats(ROWS)
        self._write("cprofile", head + text.getvalue())
        logger.info("profile of %d steps written to %s.*.txt", self.recorded, self.prefix)

    def _write(self, kind: str, text: str) -> None:
        with open(f"{self.prefix}.{kind}.txt", "w", encoding="utf-8") as f:
            f.write(text)


def _device_key(averages) -> str:
    """The key-averages sort key for device time in this torch ("self_device_time_total" since 2.4)."""
    first = next(iter(averages), None)
    if first is None or hasattr(first, "self_device_time_total"):
        return "self_device_time_total"
    return "self_cuda_time_total"
