"""Structured outputs of the AR engine: grammars compiled off the step loop, a matcher per sequence
(stage process of an AR stage).

In: a request's `StructuredOutputsParams` (a JSON schema, any JSON object, a regex, a list of
choices or an EBNF grammar) and, each step, the sampled token of every constrained sequence. Out:
per step, a packed token bitmask (int32 [S, ceil(V / 32)] on the host, bit j of word i = token
32 i + j may come next; rows of unconstrained sequences all ones) that the sampler applies to the
logits in one batched op (`ar/sampler.apply_token_bitmask`); and whether a sequence's grammar has
terminated (the answer is complete).

`Grammars` is built by the engine on the first constrained request (xgrammar is imported then, so
plain requests never pay for it). `prepare` turns the params into an xgrammar `Grammar` at once
(a bad schema / regex / grammar is a `ParamError`, a 400 before any work) and hands the costly
token-level compile to a worker thread, cached by the params' `key`; the engine keeps the request
out of the scheduler until its future is done, while the other sequences keep stepping. Each
sequence then gets its own `SeqGrammar` (xgrammar `GrammarMatcher`) whose stop tokens are the
model's eos ids, so the grammar ends an answer the way the model does.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

import torch

from omnistage.params import ParamError, StructuredOutputsParams

MAX_CACHED_GRAMMARS = 64                        # compiled grammars kept per engine (least recently used dropped)
_FIELD = "structured_outputs"
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")   # "[12:00:00] /project/cpp/x.cc:42: " of xgrammar errors


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:                    # a runtime dependency; only a broken install lacks it
        raise ParamError(_FIELD, "structured outputs need the xgrammar package (pip install xgrammar)") from e
    return xgrammar


def _why(error: Exception) -> str:
    return _CPP_PREFIX.sub("", str(error).strip().splitlines()[0] if str(error).strip() else repr(error))


def build_grammar(spec: StructuredOutputsParams) -> Any:
    """The xgrammar `Grammar` of `spec`; `ParamError` naming the field when it is not a valid one."""
    xgr = _xgrammar()
    kind = spec.kind
    ws = {"any_whitespace": not spec.disable_any_whitespace,
          "max_whitespace_cnt": None if spec.disable_any_whitespace else spec.WHITESPACE_RUN}
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(spec.json, **ws)
        if kind == "json_object":              # an object, not any JSON value
            return xgr.Grammar.from_json_schema({"type": "object"}, **ws)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                  for c in spec.choice))
        return xgr.Grammar.from_ebnf(spec.grammar)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ParamError(f"{_FIELD}.{kind}", f"{_FIELD}.{kind} is not a valid {_KIND_NAMES[kind]}: {_why(e)}") from e


_KIND_NAMES = {"json": "JSON schema", "json_object": "JSON object request", "regex": "regular expression",
               "choice": "list of choices", "grammar": "EBNF grammar (its start rule is `root`)"}


class SeqGrammar:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: Any):
        self.matcher = matcher                  # xgrammar GrammarMatcher
        self.dead = False                       # no token continues the grammar: the answer cannot go on

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> None:
        """Advances past the sampled token; a dead grammar is a `ParamError` (the request's grammar
        admits no answer), a token it refuses a `RuntimeError` (it cannot happen once masked)."""
        if self.dead:
            raise ParamError(_FIELD, f"{_FIELD} admits no answer: no token continues its grammar")
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"token {token} does not continue the structured-output grammar")

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


class Grammars:
    """The engine's grammar compiler (one per tokenizer) and its cache of compiled grammars."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: frozenset[int], max_threads: int = 2):
        if tokenizer is None:
            raise ParamError(_FIELD, "structured outputs need a stage with a tokenizer; this one has none")
        _xgrammar()
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size            # logits width: the bitmask covers it
        self.stop_ids = sorted(eos_ids)
        self.max_threads = max_threads
        self.compiler: Any = None               # xgrammar GrammarCompiler, built by the first compile job
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self.cache: OrderedDict[str, Future] = OrderedDict()   # params key -> future of a CompiledGrammar
        self.lock = threading.Lock()

    def prepare(self, spec: StructuredOutputsParams) -> Future:
        """The compiled grammar of `spec`, as a future (done at once when cached). `ParamError` now
        when `spec` is not a valid grammar."""
        key = spec.key
        with self.lock:
            found = self.cache.get(key)
            if found is not None:
                self.cache.move_to_end(key)
                return found
        grammar = build_grammar(spec)
        future = self.pool.submit(self._compile, grammar)
        with self.lock:
            self.cache[key] = future
            while len(self.cache) > MAX_CACHED_GRAMMARS:
                self.cache.popitem(last=False)
        return future

    def _compile(self, grammar: Any) -> Any:
        """Worker thread: the token-level compile (the tokenizer's tables first, once: a second for a
        large vocabulary, so that too stays off the step loop)."""
        if self.compiler is None:
            xgr = _xgrammar()
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_ids)
            self.compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads)
        return self.compiler.compile_grammar(grammar)

    def matcher(self, compiled: Any) -> SeqGrammar:
        xgr = _xgrammar()
        return SeqGrammar(xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_ids))

    def bitmask(self, seqs: list) -> Optional[torch.Tensor]:
        """The packed mask of the sampling rows `seqs` (`Sequence`s; host int32), or None when none is
        constrained."""
        if all(s.grammar is None for s in seqs):
            return None
        mask = torch.full((len(seqs), -(-self.vocab_size // 32)), -1, dtype=torch.int32)
        for i, s in enumerate(seqs):
            if s.grammar is not None:
                s.grammar.fill(mask, i)
        # a grammar no token continues (an unsatisfiable schema such as {"anyOf": []}): its row is left
        # unmasked, so the step stays well defined, and the engine fails that request (`dead`)
        for i in (~mask.any(dim=1)).nonzero().flatten().tolist():
            seqs[i].grammar.dead = True
            mask[i] = -1
        return mask

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
