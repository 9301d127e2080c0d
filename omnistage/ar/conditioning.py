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

import bisect
from dataclasses import dataclass, field
from typing import Optional

import torch

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
    extra_starts: list = field(default_factory=list, init=False)   # per chunk: the index of its first row
    num_extra: int = field(default=0, init=False)                  # rows received so far
    extra_finished: bool = field(default=False, init=False)        # no more rows will come; pad_embed follows them
    pad_embed: Optional[torch.Tensor] = field(default=None, init=False)  # [H] row added past the stream's end
    frame_rows: list = field(default_factory=list, init=False)     # frame rows so far ([H] each), one per sampled token

    def __post_init__(self) -> None:
        if self.given_rows is not None:         # every copy (`dataclasses.replace`) starts with them
            self.extra_chunks = [self.given_rows]
            self.extra_starts = [0]
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
            self.extra_starts.append(self.num_extra)
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
        if j == i + 1 and i < self.num_extra:   # one row (a decode step): a view of its chunk, no copy
            c = bisect.bisect_right(self.extra_starts, i) - 1
            return self.extra_chunks[c][i - self.extra_starts[c]:j - self.extra_starts[c]]
        if len(self.extra_chunks) > 1:
            self.extra_chunks = [torch.cat(self.extra_chunks)]
            self.extra_starts = [0]
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

    def generated_rows(self, a: int) -> list[Optional[torch.Tensor]]:
        """The [H] rows added to the token embedding of generated position a (>= prompt_len), as
        `fill` adds them, in its order: [streamed row or None, frame row or None] (the runner adds a
        step's one-row decodes in one batched add per slot)."""
        j = a - self.prompt_len
        return [self.extra_rows(j, j + 1)[0] if self.stream_extra else None,
                self.frame_rows[j] if self.frame_feedback else None]

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

