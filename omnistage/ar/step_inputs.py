"""One AR step's model inputs as host lists, and their device tensors (stage process; TP worker ranks).

In: a `SchedulerOutput` (built on the scheduler's process) -> `step_inputs` -> `StepInputs`: plain ints
and lists, rows ordered decodes first, then prefill chunks. Out: `StepInputs.tensors(device)` -> the
flattened ids, positions and `AttentionMetadata` one forward takes. The runner builds both on rank 0;
under tensor parallelism the same `StepInputs` is the message rank 0 sends every other rank each step
(`ar/tensor_parallel.py`), which rebuild the tensors on their own device: no live objects cross.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from omnistage.ar.sampler import to_device
from omnistage.ar.scheduler import ScheduledSeq, SchedulerOutput
from omnistage.ar.sequence import PLACEHOLDER
from omnistage.layers.attention import AttentionMetadata, PrefillChunk


@dataclass
class StepInputs:
    """A step's rows, picklable and small (the tensor-parallel step message)."""

    ids: list[int]                              # token id per row (0 at placeholder rows: see `fill`)
    positions: list                             # rope position per row, or 3 lists (multimodal rope prefill)
    slots: list[int]                            # KV-cache slot per row (block * block_size + offset)
    num_decodes: int                            # the first rows are this many single-token decodes
    seq_ids: list[str]                          # the step's sequences: decodes, then one per prefill chunk
    block_tables: list[list[int]]               # per sequence of `seq_ids`, its KV blocks (crossing ranks: [],
    # sent as diffs against each rank's copy, ar/tensor_parallel.BlockTables)
    decode_ctx_lens: list[int]                  # context length per decode row, the new token included
    prefills: list[tuple[int, int, int]]        # per prefill chunk: (first row, rows, context after it)
    block_size: int                             # tokens per KV block
    fill: list[tuple[int, int]]                 # (row, row in the previous step's sampled ids) of placeholders
    embeds: bool = False                        # rows enter as embeddings (rank 0 adds conditioning; broadcast)
    logit_rows: tuple[int, ...] = ()            # rows whose logits are computed (the sampling sequences' last)

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(ids [T], positions [T] or [3, T], metadata) on `device`; placeholder rows still hold 0."""
        d = self.num_decodes
        meta = AttentionMetadata(slot_mapping=to_device(self.slots, device, torch.long), num_decodes=d)
        if d:
            width = max(len(t) for t in self.block_tables[:d])
            tables = [t + [0] * (width - len(t)) for t in self.block_tables[:d]]
            meta.decode_block_tables = to_device(tables, device, torch.long)
            meta.decode_ctx_lens = to_device(self.decode_ctx_lens, device, torch.long)
        for (row, n, ctx), table in zip(self.prefills, self.block_tables[d:]):
            table = table[: -(-ctx // self.block_size)]
            meta.prefills.append(PrefillChunk(row, n, ctx, to_device(table, device, torch.long)))
        return to_device(self.ids, device, torch.long), to_device(self.positions, device, torch.long), meta


def step_order(sched: SchedulerOutput) -> tuple[list[ScheduledSeq], list[ScheduledSeq]]:
    """(decodes, prefills) of a step: single-token continuations first, then prefill chunks."""
    decodes = [s for s in sched.scheduled if s.num_new_tokens == 1 and s.start > 0]
    prefills = [s for s in sched.scheduled if not (s.num_new_tokens == 1 and s.start > 0)]
    return decodes, prefills


def step_inputs(decodes: list[ScheduledSeq], prefills: list[ScheduledSeq], block_size: int,
                prev_rows: Optional[dict[str, int]] = None) -> StepInputs:
    """The rows of a step. `prev_rows`: seq_id -> row of the queued step's sampled ids (placeholders)."""
    order = decodes + prefills
    bs = block_size
    ids, slots, fill, rows = [], [], [], []
    conditioned = False
    for i, s in enumerate(decodes):             # one row each: one pass, no per-token loop
        seq, p = s.seq, s.start
        t = seq.token_ids[p]
        if t == PLACEHOLDER:
            fill.append((i, prev_rows[seq.seq_id]))
            t = 0
        ids.append(t)
        slots.append(seq.block_table[p // bs] * bs + p % bs)
        if p + 1 == len(seq.token_ids):         # `ScheduledSeq.samples`
            rows.append(i)
        conditioned = conditioned or seq.cond is not None
    chunks = []
    for s in prefills:
        seq = s.seq
        chunks.append((len(ids), s.num_new_tokens, s.start + s.num_new_tokens))
        for p in range(s.start, s.start + s.num_new_tokens):
            t = seq.token_ids[p]
            if t == PLACEHOLDER:
                fill.append((len(ids), prev_rows[seq.seq_id]))
                t = 0
            ids.append(t)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
        if s.samples:
            rows.append(len(ids) - 1)
        conditioned = conditioned or seq.cond is not None
    if conditioned:
        pos, mrope_rows = _positions(order)
    else:
        pos = [s.start for s in decodes] + [p for s in prefills for p in range(s.start, s.start + s.num_new_tokens)]
        mrope_rows = None
    embeds = conditioned and any(s.seq.cond is not None and s.seq.cond.needs_embeds for s in order)
    return StepInputs(ids, mrope_rows if mrope_rows else pos, slots, len(decodes), [s.seq.seq_id for s in order],
                      [s.seq.block_table for s in order], [s.start + 1 for s in decodes], chunks, bs, fill,
                      embeds, tuple(rows))


def _positions(order: list[ScheduledSeq]) -> tuple[list[int], Optional[list[list[int]]]]:
    """1-D positions of every row and, when a multimodal-rope prompt is being prefilled, 3-D rows."""
    flat: list[int] = []
    parts = []                                  # per sequence: (1-D positions, 3 rows or None)
    for s in order:
        a, b = s.start, s.start + s.num_new_tokens
        one, three = (list(range(a, b)), None) if s.seq.cond is None else s.seq.cond.positions(a, b)
        flat += one
        parts.append((one, three))
    if all(three is None for _, three in parts):
        return flat, None
    rows: list[list[int]] = [[], [], []]
    for one, three in parts:
        for r in range(3):
            rows[r] += three[r] if three is not None else one
    return flat, rows
