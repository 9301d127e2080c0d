"""CUDA-graph capture and replay of short prefill steps (stage process; CUDA, and eagerly on CPU in tests).

A short prefill is host-bound: its kernels take less GPU time than the host needs to launch them (a
128-token Qwen3-Omni thinker step: ~10 ms of GPU work under ~30 ms of launches). A step with prefill
chunks only (no decode rows, no deepstack `layer_adds`, one rank) of at most `max_tokens` rows in at
most `max_chunks` chunks is padded to a token bucket (16, 32, 64, ... then `max_tokens`) and replays
that bucket's graph: the decoder over the padded rows, the lm_head over the rows that sample (a
static index, padded with row 0) and their argmax, as a `GraphOutput` with `picked` set (its logits
and ids are those rows', in order), so the runner's greedy and sampling paths take it as they take a
decode graph's.

Static buffers per bucket: one int64 block (ids | positions: [T], or [3, T] for a model with
multimodal rope, whose 1-D steps fill all three rows | KV slots | logit rows) and one int32 block,
the prefill attention's static plan (`triton_prefill.static_plan`: `max_chunks` + 1 chunk slots,
the bucket's most tiles, then the chunks' block tables one after another, each at most `max_blocks`
long: `max_model_len / block_size`, what a sequence can have). Each step fills both in pinned memory
and copies them up in two transfers (the input rows x, embeddings plus conditioning made before the
graph as for decode graphs, are copied at replay). Padded rows: id 0, position 0, the scratch KV slot,
and a chunk of their own (causal among themselves, no cached context), so every row of the forward
is a finite prefill row; no real row attends to them. Every op in the captured forward depends on
the bucket only (grids, the MoE's tile height and sort buffers, which kernels run) and none syncs
with the host (the MoE align runs on the device; moe_tune times only outside capture).

Captured only where the Triton prefill path serves the model (`serves`: CUDA, fused kernels on, a head
size the prefill kernel takes); the PyTorch path is not graph-safe. `PrefillGraphs(capture=False)` keeps
the same buffers and replays by running the same `_step` eagerly over them: the CPU tests check it against the unpadded eager step. Outputs are the graph's
buffers, valid until the next replay of any graph (decode graphs share the pool).
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import numpy as np
import torch

from omnistage.ar.cuda_graphs import GraphOutput
from omnistage.ar.sampler import greedy_ids
from omnistage.ar.staging import staged
from omnistage.ar.step_inputs import StepInputs
from omnistage.layers import fused, triton_prefill
from omnistage.layers.attention import AttentionMetadata, PrefillChunk

log = logging.getLogger(__name__)

MAX_CHUNKS = 8                                  # prefill chunks per graphed step at most (capped by max_num_seqs)
MIN_BUCKET = 16                                 # the smallest token bucket


def token_buckets(max_tokens: int) -> list[int]:
    """Captured token counts: powers of two from MIN_BUCKET below `max_tokens`, then `max_tokens`."""
    sizes, b = [], MIN_BUCKET
    while b < max_tokens:
        sizes.append(b)
        b *= 2
    return sizes + [max_tokens]


def serves(model, device: torch.device) -> bool:
    """Whether `model`'s prefill forward can be captured on `device`: CUDA with the fused kernels on and a
    head size the Triton prefill attention takes. (The PyTorch path is not graph-safe: its attention loops
    over the chunks' host lengths, its MoE reads expert counts on the host.)"""
    attn = model.attention_layers[0]
    q = torch.empty(1, attn.num_heads, attn.head_dim, dtype=model.embed_tokens.weight.dtype, device=device)
    return fused.use_triton(q) and triton_prefill.available(q)


def estimate_bytes(max_tokens: int, max_chunks: int, hidden: int, vocab: int, elem: int,
                   activation_per_token: float) -> int:
    """Device memory the graphs keep (the KV-cache sizing subtracts it): per bucket its outputs (the last
    and reported hidden rows, the sampled rows' logits in the model dtype and float32), and the pool's
    activations of the largest bucket (the profiled step's, scaled by its tokens)."""
    outputs = sum(2 * t * hidden * elem + max_chunks * vocab * (4 + elem) for t in token_buckets(max_tokens))
    return int(outputs + activation_per_token * max_tokens)


class PrefillGraphs:
    """One graph per token bucket over this model and KV cache (`scratch_slot`: where padded rows write);
    `max_blocks`: a sequence's most KV blocks (a chunk's block-table length at most). `capture` None:
    capture on CUDA; False: replay by running the forward eagerly (the CPU tests). `pool`: a graph pool to
    capture into."""

    def __init__(self, model, device: torch.device, block_size: int, scratch_slot: int, max_tokens: int,
                 max_chunks: int, max_blocks: int, capture: Optional[bool] = None, pool=None):
        self.model = model
        self.device = device
        self.block_size = block_size
        self.scratch_slot = scratch_slot
        self.buckets = token_buckets(max_tokens)
        self.max_chunks = max_chunks
        self.max_blocks = max_blocks
        self.chunk_slots = max_chunks + 1       # the real chunks, then the padded rows' own
        embed = model.embed_tokens.weight
        self.block_m = triton_prefill.block_m(embed.dtype)
        self.rope_rows = 3 if getattr(getattr(model, "rotary", None), "section_rows", None) is not None else 1
        self.x = torch.zeros(self.buckets[-1], embed.shape[1], dtype=embed.dtype, device=device)
        self.rows: dict[int, torch.Tensor] = {}        # bucket -> int64 [ids | positions | slots | logit rows]
        self.plans: dict[int, triton_prefill.PrefillPlan] = {}
        self.plan_bufs: dict[int, torch.Tensor] = {}   # bucket -> the plan's int32 buffer
        for t in self.buckets:
            tiles = triton_prefill.max_tiles(t, self.chunk_slots, self.block_m)
            self.rows[t] = torch.zeros((2 + self.rope_rows) * t + max_chunks, dtype=torch.long, device=device)
            buf = torch.zeros(triton_prefill.static_size(self.chunk_slots, tiles, max_chunks * max_blocks),
                              dtype=torch.int32, device=device)
            self.plan_bufs[t] = buf
            self.plans[t] = triton_prefill.static_plan(buf, self.chunk_slots, tiles, self.block_m)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, GraphOutput] = {}
        self.pool = pool
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        self.replays = 0                        # steps served (the benchmarks and checks read it)
        if (device.type == "cuda") if capture is None else capture:
            self._capture()

    # ---- which steps ---------------------------------------------------------------------------
    def fits(self, inputs: StepInputs) -> bool:
        """A prefill-only step of at most the largest bucket's rows and `max_chunks` chunks, with
        positions the static buffer takes (3 rows only for a multimodal-rope model)."""
        n = len(inputs.ids)
        return (inputs.num_decodes == 0 and 0 < n <= self.buckets[-1] and len(inputs.prefills) <= self.max_chunks
                and (self.rope_rows == 3 or not (inputs.positions and isinstance(inputs.positions[0], list))))

    # ---- per step ------------------------------------------------------------------------------
    def load(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Fill a bucket's static buffers with the step's rows; returns (ids, positions, meta) of the
        padded step (`meta.graph_tokens` = the bucket, `meta.prefill_plan` its static plan)."""
        t = next(b for b in self.buckets if b >= len(inputs.ids))
        return self._load(t, inputs.ids, inputs.positions, inputs.slots, inputs.prefills,
                          inputs.block_tables[inputs.num_decodes:], inputs.logit_rows)

    def replay(self, meta: AttentionMetadata, x: torch.Tensor) -> GraphOutput:
        """x: the step's input rows [bucket, H] (embeddings of the padded ids plus conditioning)."""
        t = meta.graph_tokens
        self.replays += 1
        self.x[:t].copy_(x)
        graph = self.graphs.get(t)
        if graph is None:                       # not captured (CPU tests): the same forward, run now
            self.outputs[t] = self._step(t, meta)
        else:
            graph.replay()
        return self.outputs[t]

    def _views(self, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids [t], positions [t] or [3, t], slots [t], logit rows [max_chunks]) of bucket t's block."""
        r, p = self.rows[t], self.rope_rows
        pos = r[t:(1 + p) * t]
        return r[:t], pos.view(3, t) if p == 3 else pos, r[(1 + p) * t:(2 + p) * t], r[(2 + p) * t:]

    def _load(self, t: int, ids, positions, slots, prefills, tables, logit_rows):
        """`load` of bucket t from `StepInputs`' lists (none at capture: every row padded)."""
        n, p = len(ids), self.rope_rows
        rows = staged(self.device, self.rows[t].numel(), np.int64)
        rows[0][:] = 0
        rows[0][:n] = ids
        pos = rows[0][t:(1 + p) * t].reshape(p, t)
        if n:
            pos[:, :n] = positions          # 1-D positions fill every row of a multimodal-rope buffer
        slot = rows[0][(1 + p) * t:(2 + p) * t]
        slot[:n], slot[n:] = slots, self.scratch_slot
        rows[0][(2 + p) * t:(2 + p) * t + len(logit_rows)] = logit_rows
        bs = self.block_size
        spans = [(row, q, ctx - q) for row, q, ctx in prefills]
        tabs = [table[:-(-ctx // bs)] for (_, _, ctx), table in zip(prefills, tables)]
        if n < t:                               # the padded rows: a chunk of their own, no cached context
            spans.append((n, t - n, 0))
            tabs.append([])
        plan = self.plans[t]
        # host room for what this step writes: the info and its own tables (not the buffer's full width)
        size = triton_prefill.static_size(plan.num_chunks, plan.num_tiles, sum(map(len, tabs)))
        buf = staged(self.device, size, np.int32)
        used = triton_prefill.fill_static(buf[0], plan.num_chunks, plan.num_tiles, self.block_m, spans, tabs)
        dev_rows, dev_plan = self.rows[t], self.plan_bufs[t]
        dev_rows.copy_(rows[1], non_blocking=True)
        dev_plan[:used].copy_(buf[1][:used], non_blocking=True)
        # the chunks as the PyTorch attention reads them (the CPU path; the kernel reads the plan)
        chunks, at = [], 0
        for (row, q, cached), table in zip(spans, tabs):
            chunks.append(PrefillChunk(row, q, cached + q, plan.block_tables[at:at + len(table)]))
            at += len(table)
        ids_dev, pos_dev, slots_dev, _ = self._views(t)
        meta = AttentionMetadata(slot_mapping=slots_dev, prefills=chunks, graph_tokens=t, prefill_plan=plan)
        return ids_dev, pos_dev, meta

    # ---- what a graph holds --------------------------------------------------------------------
    def _step(self, t: int, meta: AttentionMetadata) -> GraphOutput:
        """The decoder over bucket t's rows, the lm_head over its logit rows, their argmax."""
        ids, pos, _, logit_rows = self._views(t)
        out = self.model(ids, pos, meta, inputs_embeds=self.x[:t])
        logits = self.model.compute_logits((out[0] if isinstance(out, tuple) else out)[logit_rows])
        return GraphOutput(out, logits, greedy_ids(logits), picked=True)

    def _capture(self) -> None:
        """Each bucket, largest first (the smaller ones share its pool, as the decode graphs then do):
        two eager runs over padded rows only (compiles, the allocator's blocks), then the capture."""
        torch.cuda.empty_cache()
        start, before = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        pool = self.pool
        for t in reversed(self.buckets):
            _, _, meta = self._load(t, [], [], [], [], [], [])
            with torch.inference_mode():
                for _ in range(2):
                    self._step(t, meta)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[t] = self._step(t, meta)
            pool = graph.pool()
            self.graphs[t] = graph
        torch.cuda.synchronize(self.device)
        self.pool = pool
        self.capture_seconds = time.perf_counter() - start
        torch.cuda.empty_cache()                # the warm runs' cached blocks: what stays is the graphs' pool
        self.capture_bytes = torch.cuda.memory_reserved(self.device) - before
        log.info("prefill CUDA graphs: %d token buckets (%s), up to %d chunks, captured in %.2f s, %.1f MiB",
                 len(self.buckets), ", ".join(map(str, self.buckets)), self.max_chunks, self.capture_seconds,
                 self.capture_bytes / 2**20)
