"""Whole denoiser calls replayed from CUDA graphs, one per call shape (stage process; CUDA only).

Why: at small step shapes the host cannot keep up with the GPU. A FLUX.1 step at 512^2 takes 57 ms
for 37 ms of kernels (benchmarks/RESULTS.md, session 12: each of the 57 compiled blocks costs ~1 ms
of guards and launches), and an FP8 step at 1024^2 105.6 ms for 95 ms. A graph replays the step's
kernels with one launch.

In: a family that declares its denoiser call as a pure function of tensors: `graph_inputs(x, t, conds,
row_tasks)` (every tensor the call reads, stacked per row: latents, timesteps, text embeddings, ...)
and `denoise_inputs(key, inputs)` (the call itself, reading nothing else from the tasks). Its plain
`denoise` is `denoise_inputs(key, graph_inputs(...))`, so CPU runs the same code. Out:
`StepGraphs.run(key, inputs, call)`: the first call of a (key, input shapes and dtypes) pair warms
`call` on a side stream and captures it; later calls copy `inputs` into the graph's input buffers,
replay, and return a copy of the output (the graphs share one memory pool, so an output does not
outlive the next replay). At most `size` graphs are kept (least recently used dropped). A capture
that fails (an op that cannot be captured) is logged once and that shape runs `call` as before.

When it is used (`DiffusionSpeed.step_graphs`, on by default on CUDA unless `enforce_eager`; the
Accelerator builds it on CUDA): no step cache (it decides per step which blocks run), no offload
(weights move between calls), one process (not a parallel DiT). The runner leaves the step-constant
cache out of a captured call: the rotary tables are recomputed inside the graph, since a kept table
could be evicted while a graph still reads it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable

import torch

log = logging.getLogger(__name__)


class _Graph:
    def __init__(self, inputs: dict[str, torch.Tensor]):
        self.graph = torch.cuda.CUDAGraph()
        self.inputs = {name: t.clone() for name, t in inputs.items()}   # outside the pool: kept between replays
        self.output: torch.Tensor = None


class StepGraphs:
    def __init__(self, device: torch.device, size: int = 8):
        self.device = device
        self.size = size
        self.graphs: OrderedDict = OrderedDict()       # shape key -> _Graph
        self.failed: set = set()                       # shape keys whose capture failed
        self.pool = torch.cuda.graph_pool_handle()
        self.captures = 0                              # graphs captured
        self.replays = 0                               # calls answered by a replay

    @staticmethod
    def shape_key(key, inputs: dict[str, torch.Tensor]) -> tuple:
        return (key,) + tuple((name, tuple(t.shape), t.dtype) for name, t in inputs.items())

    def run(self, key, inputs: dict[str, torch.Tensor], call: Callable[[dict], torch.Tensor]) -> torch.Tensor:
        skey = self.shape_key(key, inputs)
        if skey in self.failed:
            return call(inputs)
        g = self.graphs.get(skey)
        if g is None:
            g = self._capture(skey, inputs, call)
            if g is None:
                return call(inputs)
        else:
            self.graphs.move_to_end(skey)
            for name, t in inputs.items():
                g.inputs[name].copy_(t, non_blocking=True)
        g.graph.replay()
        self.replays += 1
        return g.output.clone()

    def _capture(self, skey, inputs, call):
        g = _Graph(inputs)
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):              # compiles / autotunes / allocates before the capture
                    call(g.inputs)
            torch.cuda.current_stream(self.device).wait_stream(side)
            # thread_local: other threads' CUDA calls (another stage's, the server's) do not break the capture
            with torch.cuda.graph(g.graph, pool=self.pool, capture_error_mode="thread_local"):
                g.output = call(g.inputs)
        except Exception as e:                  # e.g. an op that syncs with the host
            self.failed.add(skey)
            log.warning("step graphs: the denoiser call at %s could not be captured (%s: %s); it runs without a "
                        "graph", skey[1:], type(e).__name__, e)
            return None
        self.captures += 1
        self.graphs[skey] = g
        while len(self.graphs) > self.size:
            self.graphs.popitem(last=False)
        return g
