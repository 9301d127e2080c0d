"""`GraphCache`: replay a tensor function as CUDA graphs, one per input shape (stage process, CUDA).

For launch-bound work whose shapes repeat -- code2wav's ODE runs 36 DiT evaluations of ~20 layers on
a few hundred frames, with the same window sizes chunk after chunk -- the per-kernel launch cost is
most of the time. `run(key, inputs, fn)` captures `fn(*inputs)` the first time a key is seen (after
one eager warm-up run on a side stream, as CUDA graphs require) into static input buffers, and
afterwards copies the inputs in and replays. `fn` must be free of host syncs and its output shape a
function of the key. All graphs share one memory pool (they never run at once); the cache holds
at most `max_graphs` shapes and runs anything beyond eagerly.
"""

from __future__ import annotations

from typing import Callable, Hashable, Sequence

import torch


class GraphCache:
    def __init__(self, max_graphs: int = 32):
        self.max_graphs = max_graphs
        self._graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], torch.Tensor]] = {}
        self._pool = None
        self.captures = 0                       # graphs captured so far
        self.replays = 0                        # runs served by a replay

    def run(self, key: Hashable, inputs: Sequence[torch.Tensor], fn: Callable[..., torch.Tensor]) -> torch.Tensor:
        """`fn(*inputs)`, replayed from a graph for `key` (captured now if new). The result is a view of
        the graph's output buffer: use it before the next `run`."""
        entry = self._graphs.get(key)
        if entry is None:
            if len(self._graphs) >= self.max_graphs:
                return fn(*inputs)
            entry = self._capture(inputs, fn)
            self._graphs[key] = entry
            self.captures += 1
        graph, buffers, out = entry
        for buf, x in zip(buffers, inputs):
            buf.copy_(x)
        graph.replay()
        self.replays += 1
        return out

    def _capture(self, inputs: Sequence[torch.Tensor], fn: Callable[..., torch.Tensor]):
        buffers = [x.clone() for x in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):           # warm-up: lazy inits, autotuning, allocator growth
            fn(*buffers)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = fn(*buffers)
        return graph, buffers, out
