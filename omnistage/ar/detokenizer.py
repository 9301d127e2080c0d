"""Incremental detokenization that is right for multi-byte UTF-8 under byte-level BPE.

A token may carry only part of a character's bytes. Each step decodes a small window that starts
at the end of the last complete decode; while the window ends in an incomplete character (U+FFFD)
the new text is held back. So the streamed text is always a prefix of the full decode.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        # A fast tokenizer's Rust decoder gives the same text as `tokenizer.decode(...,
        # clean_up_tokenization_spaces=False)` at a tenth of the cost of the Python wrapper.
        rust = getattr(tokenizer, "_tokenizer", None) if tokenizer is not None else None
        self._rust_decode = rust.decode if rust is not None and hasattr(rust, "decode") else None
        self.skip_special_tokens = skip_special_tokens
        self.prefix_offset = 0                  # window start (a character boundary)
        self.read_offset = 0                    # tokens already turned into text
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        if not ids or self.tokenizer is None:                # e.g. a talker emitting codec ids: no text
            return ""
        if self._rust_decode is not None:
            return self._rust_decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def update(self, output_ids: list[int]) -> str:
        """Feed all output ids so far; returns the newly completed text (maybe empty)."""
        prefix = self._decode(output_ids[self.prefix_offset:self.read_offset])
        full = self._decode(output_ids[self.prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(output_ids)
        self.text += delta
        return delta

    def finalize(self, output_ids: list[int]) -> str:
        """At the end, text owed to a trailing incomplete character is flushed as U+FFFD."""
        full = self._decode(output_ids[self.prefix_offset:])
        prefix = self._decode(output_ids[self.prefix_offset:self.read_offset])
        if len(full) > len(prefix):
            self.text += full[len(prefix):]
        self.prefix_offset = self.read_offset = len(output_ids)
        return self.text
