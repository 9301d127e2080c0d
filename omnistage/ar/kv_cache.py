"""Paged KV-cache bookkeeping: a pool of fixed-size blocks with content-hash prefix caching.

No torch here: this decides which physical block holds which tokens; the runner owns the tensors.
A full block is identified by the hash of (previous block's hash, its token ids). Blocks whose
reference count drops to zero go to the tail of a free queue but keep their hash, so a later
request with the same prefix takes them back; allocation takes from the head, so the least
recently freed cached block is evicted first (LRU).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from omnistage.ar.sequence import Sequence


def block_hash(parent: Optional[int], tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


def _cacheable(seq: Sequence) -> bool:
    """A sequence fed only token ids, or whose conditioning allows sharing (`Conditioning.cacheable`)."""
    return seq.cond is None or seq.cond.cacheable


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.hash_of: list[Optional[int]] = [None] * num_blocks
        self.cached: dict[int, int] = {}                      # content hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.prefix_queries = 0                               # prompt tokens looked up
        self.prefix_hits = 0                                  # of which found in the cache

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    # ---- allocation ----------------------------------------------------------------------
    def _take_free(self) -> int:
        block, _ = self.free.popitem(last=False)
        h = self.hash_of[block]
        if h is not None:                                     # evict its cached content
            if self.cached.get(h) == block:
                del self.cached[h]
            self.hash_of[block] = None
        self.ref_count[block] = 1
        return block

    def _acquire(self, block: int) -> None:
        if self.ref_count[block] == 0:
            del self.free[block]
        self.ref_count[block] += 1

    def match_prefix(self, seq: Sequence) -> int:
        """At admission: reuse cached blocks for the sequence's leading full blocks.

        At least one token is always left to compute, so the last prompt position gets logits.
        Returns the number of tokens served from the cache."""
        assert not seq.block_table
        if not self.enable_prefix_caching or not _cacheable(seq):
            return 0
        bs = self.block_size
        parent = None
        hits = 0
        for i in range((len(seq.token_ids) - 1) // bs):
            h = block_hash(parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            block = self.cached.get(h)
            if block is None:
                break
            self._acquire(block)
            seq.block_table.append(block)
            seq.block_hashes.append(h)
            parent = h
            hits += 1
        seq.num_computed_tokens = hits * bs
        self.prefix_queries += seq.prompt_len
        self.prefix_hits += hits * bs
        return hits * bs

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give the sequence enough blocks to hold `num_new_tokens` more computed tokens."""
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            seq.block_table.append(self._take_free())

    def commit_full_blocks(self, seq: Sequence) -> None:
        """After a step: hash every block that is now full of computed tokens, so others can share it."""
        if not self.enable_prefix_caching or not _cacheable(seq):
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens, len(seq.token_ids)) // bs
        while len(seq.block_hashes) < num_full:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = block_hash(parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            seq.block_hashes.append(h)
            block = seq.block_table[i]
            if h not in self.cached:
                self.cached[h] = block
                self.hash_of[block] = h

    def reset_prefix_cache(self) -> int:
        """Forget the content of every block, so no later request matches a prefix computed before
        (vLLM's `reset_prefix_cache`). Blocks held by running sequences stay theirs, KV untouched:
        requests in flight go on; blocks they fill from now on are shared again. Returns how many
        cached blocks were forgotten."""
        dropped = len(self.cached)
        self.cached.clear()
        self.hash_of = [None] * self.num_blocks
        return dropped

    def free_seq(self, seq: Sequence) -> None:
        # Release in reverse so a sequence's tail blocks are evicted before its (more shareable) head.
        for block in reversed(seq.block_table):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free[block] = None
        seq.block_table = []
        seq.block_hashes = []
