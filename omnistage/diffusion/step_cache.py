"""Step caches (TeaCache, DBCache) over a family's repeated denoiser blocks (stage process).

In: the family's declaration (`BlockCacheSpec`: which block lists its denoiser runs, which block
arguments are batch rows, what the blocks return, TeaCache's modulated input) and the stage's
`cache_backend` / `cache_config` (config.CACHE_BACKENDS defines both backends' settings). Each
request may override settings (`DiffusionParams.cache_config`), checked by `check` (ParamError).

How it runs: `StepCache.install` wraps the `forward` of every declared block once. The runner
opens `forward(tasks)` around each shared denoiser call, telling which batch rows belong to which
request and at which step index it is. Inside, every block decides per request whether its rows
compute: a request that skips this step keeps its rows out of the cached span of blocks (only the
rows that compute are sliced out and run), and at the span's end gets its cached residual added
back. So requests at different steps, with different settings, share one forward and each gets
what it would get alone. Decisions:
  * tea_cache: before block 0, the relative L1 change of the modulated input since the request's
    previous step, rescaled by a polynomial, accumulates; under `rel_l1_thresh` the whole block
    stack is skipped (residual over all blocks). The first and last steps always run.
  * cache_dit (DBCache): the first Fn blocks always run; when the relative L1 change of their
    residual against the last computed step is under `residual_diff_threshold`, blocks Fn .. N-Bn-1
    are skipped; the last Bn blocks always run. Warm-up and cached-step limits apply.
A threshold of 0 never skips, and then every block runs exactly as without a cache.
Out: the blocks' outputs; `cached_steps(request_id)` counts the steps a request skipped.
State lives here, in a dict keyed by request id (never on the modules); what one forward changes
is committed only when the forward succeeds, so a forward retried request by request decides anew.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch

from omnistage.config import CACHE_BACKENDS, cache_config_problem, cache_settings
from omnistage.params import ParamError


@dataclass(frozen=True)
class BlockCacheSpec:
    """What a family declares so that a step cache can run over its denoiser (one per family class)."""

    lists: tuple[str, ...]                      # attribute names of the denoiser's repeated block lists, in run order
    batched: tuple[str, ...]                    # block arguments whose dim 0 is the batch rows (or k times them)
    outputs: tuple[str, ...]                    # the argument each element of a block's return value replaces
    modulated: str = "temb"                     # TeaCache indicator: this argument of block 0 ...
    modulated_norm: Optional[str] = None        # ... or the first output of block 0's submodule of this name,
    # called as norm(hidden_states, emb=temb) (AdaLN-zero: the timestep-modulated input itself)
    coefficients: Optional[tuple[float, ...]] = None  # TeaCache rescaling polynomial, highest power first


@dataclass
class _RequestState:
    settings: dict[str, Any]                    # the backend's settings for this request (defaults + server + request)
    owner: int = -1                             # id() of the denoiser the cached tensors came from (Wan 2.2 experts)
    prev_indicator: Optional[torch.Tensor] = None  # TeaCache: last modulated input; DBCache: last computed Fn residual
    accumulated: float = 0.0                    # TeaCache: rescaled change summed since the last computed step
    residual: dict[str, Optional[torch.Tensor]] = field(default_factory=dict)  # stream -> cached span residual
    cached_steps: int = 0                       # steps this request skipped so far
    continuous: int = 0                         # DBCache: skipped steps in a row


@dataclass
class _Row:
    """One request's rows in the current forward."""

    request_id: str
    rows: slice                                 # its rows of the batch
    step: int                                   # its step index this forward
    num_steps: int                              # its number of steps
    state: _RequestState                        # a working copy, committed when the forward succeeds
    skip: bool = False                          # decided: this step reuses the cached residual
    base: dict[str, Optional[torch.Tensor]] = field(default_factory=dict)  # stream values the residual is added to
    decided: bool = False                       # the decision of this forward is made
    first_input: Optional[torch.Tensor] = None  # DBCache: the last output stream's rows entering block 0


@dataclass
class _Forward:
    rows: list[_Row]                            # requests of this forward, in batch order
    total: int                                  # batch rows
    off: bool = False                           # the batch did not look as announced: no caching this forward


class StepCache:
    """Per-request step-cache state and the block wrappers that consult it."""

    def __init__(self, backend: str, config: Optional[dict], spec: BlockCacheSpec):
        if backend not in CACHE_BACKENDS:
            raise ValueError(f"cache_backend must be one of {', '.join(CACHE_BACKENDS)}; got {backend!r}")
        self.backend, self.server_config, self.spec = backend, dict(config or {}), spec
        self.states: dict[str, _RequestState] = {}
        self.total_cached_steps = 0             # skipped steps over all requests (metrics)
        self._forward: Optional[_Forward] = None
        self.num_blocks: Optional[int] = None   # blocks of the smallest wrapped denoiser (set by install)
        self.check(None)

    # -- set-up ----------------------------------------------------------------------------------------
    def install(self, denoisers: list[torch.nn.Module]) -> None:
        """Wrap the forward of every declared block of each denoiser (once)."""
        for model in denoisers:
            blocks = [b for name in self.spec.lists for b in getattr(model, name)]
            if not blocks:
                raise ValueError(f"{type(model).__name__} has no blocks in {self.spec.lists}")
            for index, block in enumerate(blocks):
                block.forward = self._wrap(block, block.forward, id(model), index, len(blocks))
            self.num_blocks = min(self.num_blocks or len(blocks), len(blocks))

    def check(self, overrides: Optional[dict]) -> dict[str, Any]:
        """The settings a request with these overrides runs with; ParamError naming the key if out of range."""
        problem = cache_config_problem(self.backend, overrides or {})
        if problem is None:
            settings = cache_settings(self.backend, self.server_config, overrides)
            if self.backend == "cache_dit" and self.num_blocks is not None:
                fn, bn = settings["Fn_compute_blocks"], settings["Bn_compute_blocks"]
                if fn + bn >= self.num_blocks:
                    problem = ("Fn_compute_blocks", f"cache_config.Fn_compute_blocks + Bn_compute_blocks must be "
                               f"below the denoiser's {self.num_blocks} blocks, got {fn} + {bn}")
        if problem is not None:
            key, message = problem
            raise ParamError(f"cache_config.{key}" if key else "cache_config", message)
        return settings

    # -- per request -----------------------------------------------------------------------------------
    def add(self, request_id: str, overrides: Optional[dict]) -> None:
        self.states[request_id] = _RequestState(settings=self.check(overrides))

    def drop(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def cached_steps(self, request_id: str) -> int:
        state = self.states.get(request_id)
        return state.cached_steps if state is not None else 0

    @contextlib.contextmanager
    def forward(self, tasks: list) -> Iterator[None]:
        """Around ONE denoiser call over `tasks`' rows (each task's rows contiguous, in order)."""
        rows, start = [], 0
        for task in tasks:
            state = self.states.get(task.request_id)
            if state is not None:
                copy = dataclasses.replace(state, residual=dict(state.residual))
                rows.append(_Row(task.request_id, slice(start, start + task.num_rows), task.step_index,
                                 task.num_steps, copy))
            start += task.num_rows
        self._forward = _Forward(rows, start)
        try:
            yield
        finally:
            done, self._forward = self._forward, None
        for row in done.rows:                   # reached only when the denoiser call returned
            if row.skip:
                row.state.cached_steps += 1
                self.total_cached_steps += 1
            if row.request_id in self.states:
                self.states[row.request_id] = row.state

    # -- the block wrapper -----------------------------------------------------------------------------
    def _wrap(self, block, original, owner: int, index: int, num_blocks: int):
        signature = inspect.signature(original)

        def forward(*args, **kwargs):
            fwd = self._forward
            if fwd is None or fwd.off or not fwd.rows:
                return original(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            if index == 0 and not self._batch_ok(bound.arguments, fwd):
                fwd.off = True
                return original(*args, **kwargs)
            return self._run_block(block, original, bound, fwd, owner, index, num_blocks)

        return forward

    def _batch_ok(self, bound: dict, fwd: _Forward) -> bool:
        first = bound.get(self.spec.outputs[-1])
        return isinstance(first, torch.Tensor) and first.shape[0] == fwd.total

    def _span(self, row: _Row, num_blocks: int) -> tuple[int, int]:
        """(decision block, last block of the cached span): the decision is made after the first
        (before block 0 when -1); a skipping request's rows sit out the blocks after it up to the second."""
        if self.backend == "tea_cache":
            return -1, num_blocks - 1
        s = row.state.settings
        return s["Fn_compute_blocks"] - 1, num_blocks - 1 - s["Bn_compute_blocks"]

    def _run_block(self, block, original, call: inspect.BoundArguments, fwd: _Forward, owner: int, index: int,
                   num_blocks: int):
        bound = call.arguments
        for row in fwd.rows:
            if row.state.owner != owner:        # another expert's cache is no use to this one
                row.state = _RequestState(settings=row.state.settings, cached_steps=row.state.cached_steps)
                row.state.owner = owner
            if index == 0 and not row.decided:
                if self.backend == "tea_cache":
                    self._decide_tea(row, block, bound, fwd.total)
                    row.base = {n: _rows(bound.get(n), row.rows) for n in self.spec.outputs}
                else:
                    row.first_input = _rows(bound[self.spec.outputs[-1]], row.rows)
        sitting_out = [row for row in fwd.rows if row.skip and self._span(row, num_blocks)[0] < index
                       <= self._span(row, num_blocks)[1]]
        outputs, fresh = self._call(original, call, fwd, sitting_out)
        for row in fwd.rows:
            decision, last = self._span(row, num_blocks)
            if index == decision and not row.decided:          # DBCache: after the first Fn blocks
                self._decide_db(row, bound, outputs)
                row.base = {n: _rows(outputs[n], row.rows) for n in self.spec.outputs}
            if index == last and row.decided:
                if row.skip and not fresh:      # passed-through inputs: write into copies, not the model's tensors
                    outputs = {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in outputs.items()}
                    fresh = True
                self._apply(row, outputs)
        values = tuple(outputs[n] for n in self.spec.outputs)
        return values if len(values) > 1 else values[0]

    def _call(self, original, call: inspect.BoundArguments, fwd: _Forward,
              sitting_out: list[_Row]) -> tuple[dict[str, Any], bool]:
        """Run the block on the rows that compute; rows sitting out pass their inputs through.
        Returns (stream -> value, whether the values are new tensors rather than the inputs)."""
        bound = call.arguments
        if not sitting_out:
            return self._named(original(*call.args, **call.kwargs)), True
        out_rows = torch.zeros(fwd.total, dtype=torch.bool)
        for row in sitting_out:
            out_rows[row.rows] = True
        if bool(out_rows.all()):
            return {n: bound.get(n) for n in self.spec.outputs}, False
        keep = (~out_rows).nonzero().flatten()
        sliced = inspect.BoundArguments(call.signature, dict(call.arguments))
        for name in self.spec.batched:
            if name in sliced.arguments:
                sliced.arguments[name] = _take(sliced.arguments[name], keep, fwd.total)
        computed = self._named(original(*sliced.args, **sliced.kwargs))
        outputs = {}
        for name in self.spec.outputs:
            full, part = bound.get(name), computed[name]
            if part is None or full is None:
                outputs[name] = part
                continue
            merged = full.clone()
            merged[keep.to(full.device)] = part.to(full.dtype)
            outputs[name] = merged
        return outputs, True

    def _named(self, result) -> dict[str, Any]:
        values = result if isinstance(result, tuple) else (result,)
        return dict(zip(self.spec.outputs, values))

    # -- decisions ---------------------------------------------------------------------------------------
    def _decide_tea(self, row: _Row, block, bound: dict, total: int) -> None:
        state, s = row.state, row.state.settings
        if self.spec.modulated_norm is not None:
            norm = getattr(block, self.spec.modulated_norm)
            hidden = _rows(bound["hidden_states"], row.rows)
            indicator = norm(hidden, emb=_rows(bound["temb"], row.rows))[0]
        else:
            own = torch.arange(row.rows.start, row.rows.stop)
            indicator = _take(bound[self.spec.modulated], own, total)
        indicator = indicator.detach().float()
        compute = (s["rel_l1_thresh"] <= 0 or row.step == 0 or row.step >= row.num_steps - 1
                   or state.prev_indicator is None or not state.residual)
        if not compute:
            coeffs = s["coefficients"] or self.spec.coefficients or (1.0, 0.0)
            state.accumulated += _poly(coeffs, _rel_l1(indicator, state.prev_indicator))
            compute = state.accumulated >= s["rel_l1_thresh"]
        if compute:
            state.accumulated = 0.0
        state.prev_indicator = indicator
        row.skip, row.decided = not compute, True

    def _decide_db(self, row: _Row, bound: dict, outputs: dict) -> None:
        state, s = row.state, row.state.settings
        stream = self.spec.outputs[-1]
        first = (_rows(outputs[stream], row.rows) - row.first_input).detach().float()
        skip = (s["residual_diff_threshold"] > 0 and row.step >= s["max_warmup_steps"]
                and state.prev_indicator is not None and bool(state.residual)
                and (s["max_cached_steps"] < 0 or state.cached_steps < s["max_cached_steps"])
                and (s["max_continuous_cached_steps"] < 0 or state.continuous < s["max_continuous_cached_steps"])
                and _rel_l1(first, state.prev_indicator) < s["residual_diff_threshold"])
        if skip:
            state.continuous += 1
        else:
            state.continuous = 0
            state.prev_indicator = first
        row.skip, row.decided = skip, True

    def _apply(self, row: _Row, outputs: dict) -> None:
        """End of the cached span: skipping rows get base + cached residual; computing rows refresh it."""
        for name in self.spec.outputs:
            out, base = outputs[name], row.base.get(name)
            if out is None or base is None:
                row.state.residual[name] = None
                continue
            if row.skip:
                residual = row.state.residual.get(name)
                if residual is not None:
                    out[row.rows] = base + residual
            else:
                row.state.residual[name] = _rows(out, row.rows) - base


def _rows(x, rows: slice):
    return x[rows] if isinstance(x, torch.Tensor) else x


def _take(x, keep: torch.Tensor, total: int):
    """The rows `keep` of a batched argument (dim 0 = total rows, or k * total: k stacked copies)."""
    if not isinstance(x, torch.Tensor) or x.shape[0] % total != 0:
        return x
    k = x.shape[0] // total
    keep = keep.to(x.device)
    if k == 1:
        return x.index_select(0, keep)
    return x.view(k, total, *x.shape[1:]).index_select(1, keep).reshape(k * keep.numel(), *x.shape[1:])


def _rel_l1(cur: torch.Tensor, prev: torch.Tensor) -> float:
    return float((cur - prev).abs().mean() / prev.abs().mean().clamp_min(1e-12))


def _poly(coeffs, x: float) -> float:
    value = 0.0
    for c in coeffs:
        value = value * x + c
    return value
