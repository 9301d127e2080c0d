"""Inputs beyond token ids of one AR sequence (stage process, CPU or CUDA).

Some stages are fed embeddings: an omni thinker's prompt carries encoder outputs merged into its
embedding rows and 3-D multimodal-rope positions; a talker adds one streamed vector from the
upstream stage to each generated row; a multi-codebook talker (Qwen3-TTS) adds to each generated row
the text row given up front for it (`extra_rows`) and the frame row its model's frame head made
when the row's token was sampled (`frame_feedback`). In: the request's `ARPrompt` (`Conditioning.of`, at
`add_request`) and its streamed `ExtraRows` (`add`, at `add_input`). Out, for the positions the
scheduler picked: their rope positions (`positions`), their input rows (`fill`, on the token
embeddings; `fill_layers`: rows added after the first decoder layers), and whether they can run yet (`max_computable`). A plain token-id prompt has none
(`Sequence.cond` is None).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from omnistage.ar.sampler import to_device
from omnistage.params import ParamError
from omnistage.stage import ARPrompt, ExtraRows


@dataclass
class Conditioning:
    """One sequence's embedding-level inputs and streamed-row state (engine-owned, read by the runner)."""

    prompt_len: int                             # P: tokens in the sequence's prompt
    prompt_embeds: Optional[torch.Tensor] = None  # [P, H] on the engine's device: replaces the prompt's embedding rows
    mrope_positions: Optional[torch.Tensor] = None  # [3, P] on the CPU: multimodal-rope positions of the prompt
    position_delta: int = 0                     # generated position p is rotated as p + delta (multimodal rope)
    layer_embeds: Optional[torch.Tensor] = None  # [L, P, H] on the engine's device: added after decoder layers 0..L-1 (deepstack)
    return_hidden: bool = False                 # report last hidden states + input rows of every computed row
    stream_extra: bool = False                  # generated position P + j adds streamed row j (fed by `add`)
    frame_feedback: bool = False                # generated position P + j adds frame row j (`add_frame`, the model's frame head)
    given_rows: Optional[torch.Tensor] = None   # [k, H] extra rows given up front (a finished stream from the start)
    given_pad: Optional[torch.Tensor] = None    # [H] with given_rows: the row past them
    # Streamed-row state, fresh for every sequence (not an __init__ argument).
    extra_chunks: list = field(default_factory=list, init=False)   # received rows, in order ([k, H] each)
    num_extra: int = field(default=0, init=False)                  # rows received so far
    extra_finished: bool = field(default=False, init=False)        # no more rows will come; pad_embed follows them
    pad_embed: Optional[torch.Tensor] = field(default=None, init=False)  # [H] row added past the stream's end
    frame_rows: list = field(default_factory=list, init=False)     # frame rows so far ([H] each), one per sampled token

    def __post_init__(self) -> None:
        if self.given_rows is not None:         # every copy (`dataclasses.replace`) starts with them
            self.extra_chunks = [self.given_rows]
            self.num_extra = len(self.given_rows)
            self.pad_embed = self.given_pad
            self.extra_finished = True

    @classmethod
    def of(cls, prompt: ARPrompt, prompt_len: int, hidden_size: int, has_mrope: bool,
           device: torch.device, dtype: torch.dtype) -> Optional["Conditioning"]:
        """The conditioning of a prompt of `prompt_len` tokens, checked against the model (width
        `hidden_size`, multimodal rope or not); None for a plain token prompt."""
        n = prompt_len
        given = prompt.extra_rows is not None
        if given and prompt.stream_extra:
            raise ValueError("extra_rows (given up front) and stream_extra (streamed) exclude each other")
        rows = pad = None
        if given:                               # the whole stream at once: rows, then the pad row
            rows, pad = prompt.extra_rows, prompt.extra_pad
            if rows.ndim != 2 or rows.shape[1] != hidden_size or pad is None or tuple(pad.shape) != (hidden_size,):
                raise ParamError("extra_rows", f"extra_rows must be [k, {hidden_size}] with an extra_pad of "
                                               f"[{hidden_size}], got {list(rows.shape)}")
            rows, pad = rows.to(device, dtype), pad.to(device, dtype)
        cond = cls(n, return_hidden=bool(prompt.return_hidden_states), stream_extra=bool(prompt.stream_extra) or given,
                   frame_feedback=bool(prompt.frame_feedback), given_rows=rows, given_pad=pad)
        embeds = prompt.prompt_embeds
        if embeds is not None:
            if tuple(embeds.shape) != (n, hidden_size):
                raise ParamError("prompt_embeds", f"prompt_embeds must be [{n}, hidden], got {list(embeds.shape)}")
            cond.prompt_embeds = embeds.to(device, dtype)
        positions = prompt.mrope_positions
        if positions is not None:
            if not has_mrope:
                raise ValueError("mrope_positions given, but the model's rope has no mrope_section")
            if tuple(positions.shape) != (3, n):
                raise ParamError("mrope_positions", f"mrope_positions must be [3, {n}], got {list(positions.shape)}")
            cond.mrope_positions = positions.cpu()
            cond.position_delta = int(prompt.mrope_delta)
        layers = prompt.layer_embeds
        if layers is not None:
            if layers.ndim != 3 or tuple(layers.shape[1:]) != (n, hidden_size):
                raise ParamError("layer_embeds", f"layer_embeds must be [layers, {n}, {hidden_size}], "
                                                 f"got {list(layers.shape)}")
            cond.layer_embeds = layers.to(device, dtype)
        plain = (embeds is None and positions is None and layers is None and not cond.return_hidden
                 and not cond.stream_extra and not cond.frame_feedback)
        return None if plain else cond

    @property
    def cacheable(self) -> bool:
        """Only plain token-id sequences may share KV blocks through the prefix cache (a sequence that
        reports hidden states must compute every position itself)."""
        return (self.prompt_embeds is None and self.mrope_positions is None and self.layer_embeds is None
                and not self.stream_extra
                and not self.return_hidden and not self.frame_feedback)

    @property
    def needs_embeds(self) -> bool:
        """True when the sequence's rows are not just the embedding of its token ids (or must be reported)."""
        return (self.prompt_embeds is not None or self.layer_embeds is not None or self.stream_extra
                or self.return_hidden or self.frame_feedback)

    def max_computable(self, start: int, n: int) -> int:
        """How many of the n positions from `start` on have all their inputs (streamed rows) available."""
        if not self.stream_extra or self.extra_finished:
            return n
        return max(0, min(n, self.prompt_len + self.num_extra - start))

    def add(self, piece: ExtraRows, device: torch.device, dtype: torch.dtype) -> None:
        """Take one streamed piece (`AREngine.add_input`)."""
        if piece.rows is not None and len(piece.rows):
            self.extra_chunks.append(piece.rows.to(device, dtype))
            self.num_extra += len(piece.rows)
        if piece.pad is not None:
            self.pad_embed = piece.pad.to(device, dtype)
        if piece.finished:
            if self.pad_embed is None:
                raise ValueError("a finished extra stream needs a pad row (ExtraRows.pad)")
            self.extra_finished = True

    def add_frame(self, row: torch.Tensor) -> None:
        """The frame row of the token just sampled (the runner, from the model's frame head): it is
        added to that token's own position, the next one computed. Kept, so a recomputed position
        (after preemption) gets it again."""
        self.frame_rows.append(row)

    def extra_rows(self, i: int, j: int) -> torch.Tensor:
        """Streamed rows i..j-1 (the pad row past the end of a finished stream)."""
        if len(self.extra_chunks) > 1:
            self.extra_chunks = [torch.cat(self.extra_chunks)]
        have = self.extra_chunks[0] if self.extra_chunks else None
        got = have[i:min(j, self.num_extra)] if have is not None and i < self.num_extra else None
        missing = j - max(i, self.num_extra)
        if missing <= 0:
            return got
        pad = self.pad_embed[None].expand(missing, -1)
        return pad if got is None else torch.cat([got, pad.to(got)])

    def positions(self, a: int, b: int) -> tuple[list[int], Optional[list[list[int]]]]:
        """1-D rope positions of positions a..b-1 and, when some are multimodal-rope prompt rows, their
        three rows [3][b - a] (later positions repeat the 1-D value in each)."""
        n = self.prompt_len
        flat = [p + (self.position_delta if p >= n else 0) for p in range(a, b)]
        if self.mrope_positions is None or a >= n:
            return flat, None
        e = min(b, n)
        return flat, [[int(v) for v in self.mrope_positions[r, a:e].tolist()] + flat[e - a:] for r in range(3)]

    def fill_layers(self, adds: torch.Tensor, a: int) -> None:
        """In place on adds [L', k, H] (zeros) for positions a..a+k-1: the prompt rows' `layer_embeds`."""
        n = self.prompt_len
        if self.layer_embeds is None or a >= n:
            return
        e = min(a + adds.shape[1], n)
        adds[:len(self.layer_embeds), :e - a] = self.layer_embeds[:, a:e].to(adds)

    def fill(self, x: torch.Tensor, a: int) -> None:
        """In place on the token embeddings x [k, H] of positions a..a+k-1: prompt rows given as
        embeddings replace theirs, generated rows add their streamed row."""
        b, n = a + x.shape[0], self.prompt_len
        if self.prompt_embeds is not None and a < n:
            e = min(b, n)
            x[:e - a] = self.prompt_embeds[a:e].to(x)
        if self.stream_extra and b > n:
            lo = max(a, n)
            x[lo - a:] += self.extra_rows(lo - n, b - n).to(x)
        if self.frame_feedback and b > n:
            lo = max(a, n)
            x[lo - a:] += torch.stack(self.frame_rows[lo - n:b - n]).to(x)


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
