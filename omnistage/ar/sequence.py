"""One generated sequence of the AR engine (engine-internal state, no torch).

A request with `n > 1` becomes n sequences sharing a prompt; the prefix cache lets them share its
KV blocks. `num_computed_tokens` is how many of `token_ids` have KV in the cache; the scheduler
advances it, preemption resets it to 0 (the blocks are then recomputed, usually from the cache).
"""

from __future__ import annotations

import enum
from typing import Any, Optional

from omnistage.params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, seq_id: str, request_id: str, index: int, prompt_token_ids: list[int],
                 params: SamplingParams, arrival_time: float, seed: Optional[int] = None):
        self.seq_id = seq_id                    # unique per sequence: "<request_id>" or "<request_id>#i"
        self.request_id = request_id
        self.index = index                      # which of the request's n completions
        self.prompt_len = len(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt + generated
        self.params = params
        self.seed = seed                        # per-sequence seed (request seed + index) or None
        self.arrival_time = arrival_time
        self.status = SeqStatus.WAITING
        self.num_computed_tokens = 0            # tokens with KV in the cache
        self.num_cached_tokens = 0              # prompt tokens served by the prefix cache at admission
        self.block_table: list[int] = []        # physical block ids, in order
        self.block_hashes: list[int] = []       # content hash of each full block, in order
        self.finish_reason: Optional[str] = None
        self.stop_reason: Any = None
        self.logprobs: list = []                # TokenLogprobs per generated token, when asked for
        self.detok: Any = None                  # incremental detokenizer state (engine-owned)
        self.num_preemptions = 0
        # Conditioning for models fed embeddings rather than (only) token ids; opaque device tensors
        # here, read by the runner.
        self.prompt_embeds: Any = None          # [prompt_len, hidden]: replaces the prompt's embedding rows
        self.mrope_positions: Any = None        # [3, prompt_len] positions of multimodal rope prefill
        self.position_delta = 0                 # decode position p uses p + delta (multimodal rope)
        self.return_hidden = False              # report last hidden states + input rows per step
        self.stream_extra = False               # generated rows add extra[p - prompt_len] (fed by add_input)
        self.extra_chunks: list = []            # received extra rows, in order
        self.num_extra = 0                      # rows received so far
        self.extra_finished = False             # no more rows will come; pad_embed is used after them
        self.pad_embed: Any = None

    @property
    def cacheable(self) -> bool:
        """Only plain token-id sequences may share KV blocks through the prefix cache (a sequence that
        reports hidden states must compute every position itself)."""
        return (self.prompt_embeds is None and self.mrope_positions is None and not self.stream_extra
                and not self.return_hidden)

    def max_computable(self, n: int) -> int:
        """How many of the next n positions have all their inputs (extra rows) available."""
        if not self.stream_extra or self.extra_finished:
            return n
        start = self.num_computed_tokens
        return max(0, min(n, self.prompt_len + self.num_extra - start))

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id}, len={len(self)}, computed={self.num_computed_tokens}, "
                f"{self.status.value})")
