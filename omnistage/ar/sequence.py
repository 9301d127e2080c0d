"""One generated sequence of the AR engine (engine-internal state, no torch).

A request with `n > 1` becomes n sequences sharing a prompt; the prefix cache lets them share its
KV blocks. `num_computed_tokens` is how many of `token_ids` have KV in the cache; the scheduler
advances it, preemption resets it to 0 (the blocks are then recomputed, usually from the cache).
A model fed more than token ids keeps that in `cond` (`ar/conditioning.py`).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Optional

from omnistage.params import SamplingParams

if TYPE_CHECKING:
    from omnistage.ar.conditioning import Conditioning
    from omnistage.ar.structured import SeqGrammar


PLACEHOLDER = -1        # in `token_ids`: a token a queued step sampled that the host has not read yet


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
        self.codes: list[list[int]] = []        # per generated token: its frame's other codebooks (models with a frame head)
        self.detok: Any = None                  # incremental detokenizer state (engine-owned)
        self.num_preemptions = 0
        # inputs beyond token ids (prompt embeddings, multimodal rope, streamed rows), or None
        self.cond: Optional[Conditioning] = None
        # where the answer stands in its structured-output grammar (`ar/structured.py`), or None
        self.grammar: Optional[SeqGrammar] = None

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
