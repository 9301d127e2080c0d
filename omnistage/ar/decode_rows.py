"""Conditioned decode rows of an AR step in one device op (stage process, CPU or CUDA; runner-owned).

In: the step's decode rows whose sequence's `Conditioning` adds rows given up front and / or its frame
head's latest row (`DecodeRows.takes`), and each step's frame rows. Out: those rows added to the step's
input rows in place (`fill`), gathered from a device table, where `Conditioning.fill` would cost a few
tensor ops per row per step.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from omnistage.ar.conditioning import Conditioning
from omnistage.ar.sampler import to_device


class DecodeRows:
    """The rows decode positions add, for all of a step's decode rows in one device op (runner-owned).

    A sequence whose generated positions add rows given up front (`given_rows`, then the pad row) and /
    or its frame head's row (`frame_feedback`) gets a region of a device table [rows, H] the first time
    it decodes: its k given rows, the pad row, and one slot for its latest frame row (rewritten by
    `put_frames` each step, for all sampled rows in one copy). A decode row at generated index j then
    adds table[region + min(j, k)] and table[region + k + 1], gathered with the step's other decode
    rows and added in one `index_add_` (`fill`), where `Conditioning.fill` would cost a few tensor ops
    per row per step. Other rows (prompt chunks, streamed rows, a recomputed position whose frame row
    is not the latest) go through `Conditioning.fill`. A region is kept through preemption and freed
    by `release`; the table is compacted or grown when a new region does not fit.
    """

    def __init__(self, hidden: int, device: torch.device, dtype: torch.dtype):
        self.table = torch.zeros(0, hidden, dtype=dtype, device=device)   # [rows, H]
        self.regions: dict[str, tuple[int, int]] = {}   # seq_id -> (first row, k given rows)
        self.end = 0                            # rows in use at the table's front (regions and holes)

    @staticmethod
    def takes(cond: Optional[Conditioning], start: int, n: int) -> bool:
        """Whether a step's rows start.. (n of them) of a sequence with `cond` go through the table."""
        if cond is None or n != 1 or start < cond.prompt_len:
            return False
        if cond.stream_extra and cond.given_rows is None:        # rows streamed in: Conditioning.fill
            return False
        if not cond.frame_feedback:
            return cond.stream_extra
        return len(cond.frame_rows) == start - cond.prompt_len + 1  # its latest frame row is the one it adds

    def _region(self, seq_id: str, cond: Conditioning) -> tuple[int, int]:
        region = self.regions.get(seq_id)
        if region is not None:
            return region
        k = 0 if cond.given_rows is None else len(cond.given_rows)
        size = k + 2
        if self.end + size > self.table.shape[0]:
            self._compact(size)
        base = self.end
        if cond.given_rows is not None:
            self.table[base:base + k] = cond.given_rows.to(self.table)
            self.table[base + k] = cond.given_pad.to(self.table)
        if cond.frame_rows:                     # the frame of the token its prefill sampled
            self.table[base + k + 1] = cond.frame_rows[-1].to(self.table)
        self.end += size
        self.regions[seq_id] = (base, k)
        return base, k

    def _compact(self, need: int) -> None:
        """Live regions packed at the front of a table with room for `need` more rows."""
        live = sum(k + 2 for _, k in self.regions.values())
        table = self.table.new_zeros(max(2 * (live + need), 64), self.table.shape[1])
        end = 0
        for seq_id, (base, k) in self.regions.items():
            table[end:end + k + 2] = self.table[base:base + k + 2]
            self.regions[seq_id] = (end, k)
            end += k + 2
        self.table, self.end = table, end

    def fill(self, x: torch.Tensor, rows: list[tuple[int, Any]]) -> None:
        """In place on the step's input rows x [T, H]: rows (row of x, its ScheduledSeq), each `takes`."""
        dst, src = [], []
        for row, s in rows:
            cond = s.seq.cond
            base, k = self._region(s.seq.seq_id, cond)
            if cond.stream_extra:
                dst.append(row)
                src.append(base + min(s.start - cond.prompt_len, k))
            if cond.frame_feedback:
                dst.append(row)
                src.append(base + k + 1)
        at = to_device([dst, src], x.device)
        x.index_add_(0, at[0], self.table[at[1]].to(x))

    def put_frames(self, seqs: list, rows: torch.Tensor) -> None:
        """The frame rows [S, H] the frame head made for `seqs` (every one `frame_feedback`), each into
        its region's frame slot (a sequence without a region yet gets it when it first decodes)."""
        slots = [self.regions[q.seq_id][0] + self.regions[q.seq_id][1] + 1 if q.seq_id in self.regions else -1
                 for q in seqs]
        keep = [i for i, s in enumerate(slots) if s >= 0]
        if not keep:
            return
        if len(keep) < len(slots):
            rows = rows[to_device(keep, rows.device)]
            slots = [slots[i] for i in keep]
        self.table.index_copy_(0, to_device(slots, rows.device), rows.to(self.table))

    def release(self, seq_id: str) -> None:
        self.regions.pop(seq_id, None)
        if not self.regions:
            self.end = 0
