"""CUDA-graph capture and replay of decode steps (stage process, CUDA only).

Decode-only steps have static shapes once the batch is padded to a captured size, so the model
forward from the input rows on (every layer, the paged attention included), the lm_head and the
greedy argmax replay as one graph: the per-kernel launch cost that dominates small-batch decoding
disappears. Out: a `GraphOutput` (hidden states, logits, argmax ids of every padded row); a step
whose rows sample greedily with nothing else (`sampler.plain_greedy`) takes the ids as they are,
any other step samples from the graph's logits (`sampler.sample`, as eager steps do). The embedding
lookup (and any conditioning added to its rows) runs before the graph; inputs are copied into
static buffers; padded rows write their KV to the scratch slot past the pool and attend to one token.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omnistage.ar.sampler import greedy_ids
from omnistage.ar.staging import staged
from omnistage.layers.attention import AttentionMetadata


@dataclass
class GraphOutput:
    """A captured step's outputs for its padded rows (static buffers of the graph)."""

    model: Any                                  # the model's forward output: hidden [b, H], or (it, reported rows)
    logits: torch.Tensor                        # [b, V] float32: the lm_head over every row
    greedy: torch.Tensor                        # [b] long: each row's argmax (rows that need nothing else use it)
    # True: `logits` and `greedy` hold only the step's logit rows, in order (a prefill graph,
    # ar/prefill_graphs.py); False: every row's, indexed by row
    picked: bool = False


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class CudaGraphs:
    def __init__(self, model, device: torch.device, block_size: int, scratch_slot: int, max_batch: int,
                 max_blocks: int, pool=None):
        """`pool`: a graph memory pool to capture into (the prefill graphs', ar/prefill_graphs.py)."""
        self.model = model
        self.block_size = block_size
        self.scratch_slot = scratch_slot
        self.sizes = capture_sizes(max_batch)
        self.max_blocks = max_blocks
        n = self.sizes[-1]
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.pos = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), scratch_slot, dtype=torch.long, device=device)
        self.tables = torch.zeros(n, max_blocks, dtype=torch.long, device=device)
        self.ctx = torch.ones(n, dtype=torch.long, device=device)
        embed = model.embed_tokens.weight
        self.x = torch.zeros(n, embed.shape[1], dtype=embed.dtype, device=device)   # the graphs' input rows
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, GraphOutput] = {}
        for b in reversed(self.sizes):                         # largest first so smaller ones share its pool
            meta = self._meta(b)
            with torch.inference_mode():
                for _ in range(2):
                    self._step(b, meta)
                torch.cuda.synchronize(device)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self.outputs[b] = self._step(b, meta)
            pool = g.pool()
            self.graphs[b] = g

    def _step(self, b: int, meta: AttentionMetadata) -> "GraphOutput":
        """What a graph holds: the decoder over the input rows, the lm_head over every row, the argmax."""
        out = self.model(self.ids[:b], self.pos[:b], meta, inputs_embeds=self.x[:b])
        logits = self.model.compute_logits(out[0] if isinstance(out, tuple) else out)
        return GraphOutput(out, logits, greedy_ids(logits))

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slots[:b], num_decodes=b, decode_block_tables=self.tables[:b],
                                 decode_ctx_lens=self.ctx[:b], graph_batch=b)

    def fits(self, n: int) -> bool:
        return 0 < n <= self.sizes[-1]

    def load(self, ids: list[int], pos: list[int], slots: list[int], tables: list[list[int]], ctx: list[int]):
        """Fill the static buffers for n real rows; returns (ids, pos, meta) of the padded batch. `ctx`:
        each row's context length, its new token included -- not `pos + 1`: a multimodal rope position
        (M-RoPE) runs behind the token count after an image or audio."""
        b = next(s for s in self.sizes if s >= len(ids))
        # pinned: the copies below do not wait for queued steps (the thread's staging ring, ar/staging.py:
        # no pinned allocation per step)
        w = max(map(len, tables))
        buf, host = staged(self.ids.device, b * (4 + w), np.int64)
        graph_inputs(buf, b, self.scratch_slot, ids, pos, slots, tables, ctx)
        # torch views (not numpy's): the copies must hold the pinned block itself
        rows, table = host[:4 * b].view(4, b), host[4 * b:].view(b, w)
        self.ids[:b].copy_(rows[0], non_blocking=True)
        self.pos[:b].copy_(rows[1], non_blocking=True)
        self.slots[:b].copy_(rows[2], non_blocking=True)
        self.ctx[:b].copy_(rows[3], non_blocking=True)
        self.tables[:b, :table.shape[1]].copy_(table, non_blocking=True)
        return self.ids[:b], self.pos[:b], self._meta(b)

    def replay(self, meta: AttentionMetadata, x: torch.Tensor) -> "GraphOutput":
        """x: the batch's input rows (embeddings plus any conditioning), [graph batch, H]. The outputs
        are the graph's own buffers: valid until the next replay of any size (they share one pool)."""
        self.x[:meta.graph_batch].copy_(x)
        self.graphs[meta.graph_batch].replay()
        return self.outputs[meta.graph_batch]


def graph_inputs(buf: np.ndarray, b: int, scratch_slot: int, ids: list[int], pos: list[int], slots: list[int],
                 tables: list[list[int]], ctx: list[int]) -> None:
    """Fills `buf` (int64, b * (4 + w) long, w = the widest of `tables`) with a decode batch padded
    to b rows: first [4, b] rows (ids, positions, slots, context lengths `ctx`), then the [b, w] block
    tables. Padded rows: id 0, the scratch slot, context 1; table entries past a row's blocks are 0
    (never read). Numpy fills, no per-token Python."""
    n = len(ids)
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=n)
    w = int(lens.max())
    rows = buf[:4 * b].reshape(4, b)
    rows[0, :n], rows[1, :n], rows[2, :n] = ids, pos, slots
    rows[3, :n] = ctx
    rows[:, n:] = np.array([[0], [0], [scratch_slot], [1]])
    table = buf[4 * b:4 * b + b * w].reshape(b, w)
    table[:] = 0
    table[:n][np.arange(w) < lens[:, None]] = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64,
                                                          count=int(lens.sum()))
