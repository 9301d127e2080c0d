"""Per-step device inputs of the AR runner, built by diffs and numpy (stage process, CPU or CUDA).

Two pieces the runner keeps across steps:
  - `SeqRows`: one row per live sequence. Its block table lives in a preallocated [rows, width] table
    (a numpy host mirror, always current, and on CUDA a device copy that is updated only by the entries
    that changed: a sequence that gained a block, or a new / preempted one rewritten), plus the
    sequence's sampling parameters as numbers (host only, gathered per batch with one numpy index).
  - `Staging`: the step's one host -> device copy. Every array a step needs on the device (token ids,
    positions, slot mapping, context lengths, table rows and table diffs, sampling rows) is packed into
    one pinned int64 buffer and copied with one non-blocking copy; the device tensors are views of it.

On CPU the host arrays are the tensors (no copy). Row 0 of the block table is never given to a
sequence and stays 0: padded CUDA-graph rows read it.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from omnistage.ar.sequence import Sequence

ALIGN = 8                                       # int64 elements (64 bytes): every packed part starts aligned

# Columns of the float parameter table (float32) and of the int one (int64).
F_TEMP, F_TOP_P, F_MIN_P, F_REP, F_FREQ, F_PRES, F_GREEDY, NUM_F = range(8)
I_TOP_K, I_SEEDED, I_BANS, I_PENALTY, I_LOGPROBS, NUM_I = range(6)


def _aligned(n: int) -> int:
    """Rows of the table start 64-byte aligned (a row is handed to kernels as a prefill chunk's table)."""
    return -(-n // ALIGN) * ALIGN


class _Row:
    __slots__ = ("row", "seq", "table", "n")

    def __init__(self, row: int, seq: Sequence):
        self.row = row
        self.seq = seq
        self.table: Optional[list[int]] = None  # the block_table list object last written (reset = a new list)
        self.n = 0                              # entries of it written


class SeqRows:
    """Rows of live sequences: block tables (host mirror + device copy by diffs) and sampling parameters.

    A sequence's `block_table` only grows by `append`; a reset (preemption) replaces the list object
    (`kv_cache.BlockManager`), which `sync` notices and answers with a full rewrite of the row."""

    def __init__(self, device: torch.device, width: int = 32, rows: int = 64, max_width: Optional[int] = None,
                 on_full: Optional[Callable[[list[str]], None]] = None):
        self.device = device
        self.cuda = device.type == "cuda"
        self.max_width = max_width
        self.on_full = on_full                  # called with finished sequences' ids when rows run out
        self.host = np.zeros((rows, width), np.int64)
        self.dev = self._to_dev(self.host)
        self.used = np.zeros(rows, np.int64)    # per row: entries that may be non-zero
        self.fparams = np.zeros((rows, NUM_F), np.float32)
        self.iparams = np.zeros((rows, NUM_I), np.int64)
        self.of: dict[str, _Row] = {}           # seq_id -> its row
        self.free = list(range(rows - 1, 0, -1))
        self.diffs: list[np.ndarray] = []       # flat indices into the table whose device copy is stale

    @property
    def width(self) -> int:
        return self.host.shape[1]

    def _to_dev(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        return t.to(self.device, copy=True) if self.cuda else t

    def set_width(self, width: int) -> None:
        """Fix the table width at (at least) `width` entries: no sequence will need more (CUDA graphs)."""
        self.max_width = width = _aligned(width)
        if width != self.width:
            self._regrow(self.host.shape[0], width)

    def _regrow(self, rows: int, width: int) -> None:
        old = self.host
        self.host = np.zeros((rows, width), np.int64)
        w = min(width, old.shape[1])
        self.host[:old.shape[0], :w] = old[:, :w]
        if rows > old.shape[0]:
            n = rows - old.shape[0]
            self.used = np.concatenate([self.used, np.zeros(n, np.int64)])
            self.fparams = np.concatenate([self.fparams, np.zeros((n, NUM_F), np.float32)])
            self.iparams = np.concatenate([self.iparams, np.zeros((n, NUM_I), np.int64)])
            self.free += list(range(rows - 1, old.shape[0] - 1, -1))
        if self.cuda and width == old.shape[1]:         # flat indices of pending diffs stay valid
            dev = torch.zeros(rows, width, dtype=torch.long, device=self.device)
            dev[:old.shape[0]] = self.dev
            self.dev = dev
        else:                                           # rare: a new layout, uploaded whole
            self.dev = self._to_dev(self.host)
            self.diffs = []

    # ---- rows ----------------------------------------------------------------------------------
    def _assign(self, seq: Sequence) -> _Row:
        if not self.free and self.on_full is not None:
            self.on_full([sid for sid, r in self.of.items() if r.seq.is_finished])
        if not self.free:
            self._regrow(2 * self.host.shape[0], self.width)
        r = _Row(self.free.pop(), seq)
        self.of[seq.seq_id] = r
        p = seq.params
        self.fparams[r.row] = (1.0 if p.greedy else p.temperature, p.top_p, p.min_p, p.repetition_penalty,
                               p.frequency_penalty, p.presence_penalty, float(p.greedy))
        self.iparams[r.row] = (p.top_k, seq.seed is not None, bool(p.bad_token_ids or p.min_tokens),
                               p.needs_penalties, -1 if p.logprobs is None else p.logprobs)
        return r

    def release(self, seq_id: str) -> None:
        r = self.of.pop(seq_id, None)
        if r is not None:
            self.free.append(r.row)

    def sync(self, seq: Sequence) -> int:
        """The sequence's row, its table brought up to date (host now, device at the next upload)."""
        r = self.of.get(seq.seq_id)
        if r is None:
            r = self._assign(seq)
        bt = seq.block_table
        if r.table is bt and r.n == len(bt):
            return r.row
        start = r.n if r.table is bt else 0
        end = len(bt)
        if end > self.width:
            want = max(end, 2 * self.width)
            want = want if self.max_width is None else max(end, min(want, self.max_width))
            self._regrow(self.host.shape[0], _aligned(want))
        row = r.row
        hi = max(end, int(self.used[row])) if start == 0 else end
        self.host[row, start:end] = bt[start:end]
        self.host[row, end:hi] = 0                          # what an earlier owner left past this table
        self.used[row] = end
        if self.cuda and hi > start:
            self.diffs.append(np.arange(row * self.width + start, row * self.width + hi, dtype=np.int64))
        r.table, r.n = bt, end
        return row

    def take_diffs(self) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """(flat indices, values) of the table entries to write on the device, or None."""
        if not self.diffs:
            return None
        idx = self.diffs[0] if len(self.diffs) == 1 else np.concatenate(self.diffs)
        self.diffs = []
        return idx, self.host.reshape(-1)[idx]

    def apply_diffs(self, idx: torch.Tensor, vals: torch.Tensor) -> None:
        self.dev.view(-1)[idx] = vals


class Staging:
    """The step's host -> device upload: named numpy parts packed into one int64 buffer (pinned on CUDA),
    one non-blocking copy, device views back. Two host buffers alternate; a buffer is rewritten only
    after its last copy has run (an event), so a step that does not wait on the device stays safe."""

    def __init__(self, device: torch.device, capacity: int = 1 << 14):
        self.device = device
        self.cuda = device.type == "cuda"
        self._alloc(capacity)
        self.parts: list[tuple[str, np.ndarray]] = []

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        if self.cuda:
            self.hosts = [torch.empty(capacity, dtype=torch.long, pin_memory=True) for _ in range(2)]
            self.events = [None, None]
            self.dev = torch.empty(capacity, dtype=torch.long, device=self.device)
        else:
            self.hosts = [torch.empty(capacity, dtype=torch.long)]
        self.turn = 0

    def add(self, name: str, a: np.ndarray) -> None:
        """a: int64, or float32 (read back as float32)."""
        self.parts.append((name, a))

    def send(self) -> dict[str, torch.Tensor]:
        sizes, offsets, total = [], [], 0
        for _, a in self.parts:
            n = -(-a.size * a.itemsize // 8)
            offsets.append(total)
            sizes.append(n)
            total += -(-n // ALIGN) * ALIGN
        if total > self.capacity:
            self._alloc(max(total, 2 * self.capacity))
        i = self.turn = (self.turn + 1) % len(self.hosts)
        if self.cuda and self.events[i] is not None:
            self.events[i].synchronize()
        host = self.hosts[i].numpy()
        for (_, a), o, n in zip(self.parts, offsets, sizes):
            dst = host[o:o + n]
            if a.dtype == np.float32:
                dst = dst.view(np.float32)[:a.size]
            dst[:a.size] = a.reshape(-1)
        if self.cuda:
            self.dev[:total].copy_(self.hosts[i][:total], non_blocking=True)
            self.events[i] = torch.cuda.Event()
            self.events[i].record()
            base = self.dev
        else:
            base = self.hosts[i]
        out = {}
        for (name, a), o, n in zip(self.parts, offsets, sizes):
            t = base[o:o + n]
            if a.dtype == np.float32:
                t = t.view(torch.float32)[:a.size]
            out[name] = t.view(a.shape) if a.ndim > 1 else t[:a.size]
        self.parts = []
        return out
