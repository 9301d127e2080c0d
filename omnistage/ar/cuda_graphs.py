"""CUDA-graph capture and replay of decode steps (stage process, CUDA only; `pack_inputs` is plain numpy).

Decode-only steps have static shapes once the batch is padded to a captured size, so the model
forward from the input rows on (every layer, the paged attention included) replays as one graph: the
per-kernel launch cost that dominates small-batch decoding disappears. The embedding lookup (and any
conditioning added to its rows) runs before the graph. Static inputs: `inputs` [4, n] (token ids,
positions, slots, context lengths), filled by one device copy from the step's upload (packed on the
host by `pack_inputs`), and `tables` [n, max_blocks], gathered on the device from the runner's
persistent block tables. Padded rows write their KV to the scratch slot past the pool, attend to one
token and read table row 0 (all zeros).
"""

from __future__ import annotations

import numpy as np
import torch

from omnistage.layers.attention import AttentionMetadata


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def pack_inputs(n: int, ids: np.ndarray, pos: np.ndarray, slots: np.ndarray, ctx: np.ndarray,
                scratch_slot: int) -> np.ndarray:
    """The static inputs [4, n] for len(ids) real rows; the rest padded (id 0, position 0, scratch slot,
    context 1)."""
    d = len(ids)
    out = np.empty((4, n), np.int64)
    out[:, d:] = np.array([[0], [0], [scratch_slot], [1]], np.int64)
    out[0, :d], out[1, :d], out[2, :d], out[3, :d] = ids, pos, slots, ctx
    return out


class CudaGraphs:
    def __init__(self, model, device: torch.device, block_size: int, scratch_slot: int, max_batch: int,
                 max_blocks: int):
        self.model = model
        self.block_size = block_size
        self.scratch_slot = scratch_slot
        self.sizes = capture_sizes(max_batch)
        self.max_blocks = max_blocks
        n = self.n = self.sizes[-1]
        self.inputs = torch.zeros(4, n, dtype=torch.long, device=device)
        self.ids, self.pos, self.slots, self.ctx = self.inputs             # views: one row each
        self.slots.fill_(scratch_slot)
        self.ctx.fill_(1)
        self.tables = torch.zeros(n, max_blocks, dtype=torch.long, device=device)
        embed = model.embed_tokens.weight
        self.x = torch.zeros(n, embed.shape[1], dtype=embed.dtype, device=device)   # the graphs' input rows
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = None
        for b in reversed(self.sizes):                         # largest first so smaller ones share its pool
            meta = self._meta(b)
            with torch.inference_mode():
                for _ in range(2):
                    self.model(self.ids[:b], self.pos[:b], meta, inputs_embeds=self.x[:b])
                torch.cuda.synchronize(device)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self.outputs[b] = self.model(self.ids[:b], self.pos[:b], meta, inputs_embeds=self.x[:b])
            pool = g.pool()
            self.graphs[b] = g

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slots[:b], num_decodes=b, decode_block_tables=self.tables[:b],
                                 decode_ctx_lens=self.ctx[:b], graph_batch=b)

    def fits(self, n: int) -> bool:
        return 0 < n <= self.n

    def size_for(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def load(self, packed: torch.Tensor, table_rows: torch.Tensor, tables: torch.Tensor):
        """packed: `pack_inputs`' [4, n] on the device; table_rows [b]: the rows of `tables` [R, >= max_blocks]
        for the padded batch (0 for padding). Returns (ids, pos, meta) of the batch."""
        b = table_rows.shape[0]
        self.inputs.copy_(packed)
        torch.index_select(tables[:, :self.max_blocks], 0, table_rows, out=self.tables[:b])
        return self.ids[:b], self.pos[:b], self._meta(b)

    def replay(self, meta: AttentionMetadata, x: torch.Tensor) -> torch.Tensor:
        """x: the batch's input rows (embeddings plus any conditioning), [graph batch, H]."""
        self.x[:meta.graph_batch].copy_(x)
        self.graphs[meta.graph_batch].replay()
        return self.outputs[meta.graph_batch]
