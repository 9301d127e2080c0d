"""Device-side token counts for repetition / presence / frequency penalties (stage process, CPU or CUDA).

One row per live sequence that has a penalty: `counts[r, t]` is how often token t was generated (float32
holding integers), `prompt[r, t]` whether t is in the prompt. The rows are kept with the runner and
updated incrementally: the runner adds each step's sampled ids on the device (`add_sampled`), so a step
uploads nothing for them. A row is built from the sequence's token list only when the sequence is new
to it or its count disagrees with the sequence (a sampled token the engine did not keep). Row 0 stays
zero (read by batch rows without penalties), row 1 is a sink (written by them); rows are freed with
their sequence (`release`).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from omnistage.ar.sequence import Sequence

ZERO_ROW, SINK_ROW = 0, 1


class _Entry:
    __slots__ = ("row", "counted", "seq")

    def __init__(self, row: int, seq: Sequence):
        self.row = row
        self.counted = -1                       # output tokens in the row; -1: not built yet
        self.seq = seq


class TokenCounts:
    def __init__(self, device: torch.device):
        self.device = device
        self.counts: Optional[torch.Tensor] = None  # [rows, V] float32, allocated at the first use
        self.prompt: Optional[torch.Tensor] = None  # [rows, V] bool
        self.num_rows = 2
        self.of: dict[str, _Entry] = {}
        self.free: list[int] = []
        self.one = torch.ones((), device=device)
        self.true = torch.ones((), dtype=torch.bool, device=device)

    def release(self, seq_id: str) -> None:
        e = self.of.pop(seq_id, None)
        if e is not None:
            self.free.append(e.row)

    def _entry(self, seq: Sequence) -> _Entry:
        e = self.of.get(seq.seq_id)
        if e is None:
            if not self.free:
                for sid in [sid for sid, x in self.of.items() if x.seq.is_finished]:
                    self.release(sid)
            if not self.free:
                self.free.append(self.num_rows)
                self.num_rows += 1
            e = self.of[seq.seq_id] = _Entry(self.free.pop(), seq)
        return e

    def plan(self, seqs: list[Sequence], penalized: np.ndarray) -> dict[str, np.ndarray]:
        """For one step's sampling rows (`penalized`: which have a penalty): the rows each batch row reads
        ("read", 0 for none) and writes its sampled id to ("write", the sink for none), and the rebuilds
        this step needs ("reset" rows, "inc" / "prompt" [2, n] row-token pairs), to upload."""
        read = np.zeros(len(seqs), np.int64)
        write = np.full(len(seqs), SINK_ROW, np.int64)
        reset, inc_r, inc_t, pr_r, pr_t = [], [], [], [], []
        for i in np.flatnonzero(penalized).tolist():
            seq = seqs[i]
            e = self._entry(seq)
            read[i] = write[i] = e.row
            if e.counted != seq.num_output_tokens:
                reset.append(e.row)
                out = seq.output_token_ids
                inc_r += [e.row] * len(out)
                inc_t += out
                pr_r += [e.row] * seq.prompt_len
                pr_t += seq.token_ids[:seq.prompt_len]
                e.counted = seq.num_output_tokens
        plan = {"read": read, "write": write}
        if reset:
            plan["reset"] = np.array(reset, np.int64)
            plan["prompt"] = np.array([pr_r, pr_t], np.int64).reshape(2, -1)
            if inc_r:
                plan["inc"] = np.array([inc_r, inc_t], np.int64)
        return plan

    def apply(self, v: dict[str, torch.Tensor], vocab: int) -> None:
        """Allocate / grow the rows, then run the planned rebuilds (`v`: the uploaded plan)."""
        have = 0 if self.counts is None else self.counts.shape[0]
        if have < self.num_rows:                        # one model, one vocabulary: only rows are added
            rows = max(self.num_rows, 2 * have, 8)
            counts = torch.zeros(rows, vocab, device=self.device)
            prompt = torch.zeros(rows, vocab, dtype=torch.bool, device=self.device)
            if have:
                counts[:have] = self.counts
                prompt[:have] = self.prompt
            self.counts, self.prompt = counts, prompt
        if "reset" in v:
            self.counts.index_fill_(0, v["reset"], 0.0)
            self.prompt.index_fill_(0, v["reset"], False)
            self.prompt.index_put_((v["prompt"][0], v["prompt"][1]), self.true)
        if "inc" in v:
            self.counts.index_put_((v["inc"][0], v["inc"][1]), self.one, accumulate=True)

    def gather(self, v: dict[str, torch.Tensor], with_prompt: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The batch's counts [S, V] and, for repetition penalties, prompt presence [S, V]."""
        counts = self.counts.index_select(0, v["read"])
        return counts, self.prompt.index_select(0, v["read"]) if with_prompt else None

    def add_sampled(self, v: dict[str, torch.Tensor], token_ids: torch.Tensor, seqs: list[Sequence],
                    penalized: np.ndarray) -> None:
        """Count this step's sampled ids (on the device); the engine appends them to the sequences."""
        self.counts.index_put_((v["write"], token_ids), self.one, accumulate=True)
        for i in np.flatnonzero(penalized).tolist():
            self.of[seqs[i].seq_id].counted += 1
