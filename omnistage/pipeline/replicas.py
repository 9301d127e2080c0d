"""`ReplicaSet`: N copies of one stage, each a `StageClient` (its own process), behind the
`StageEngine` interface (the orchestrator's engine thread).

In: the stage's `StageSpec` with `engine.num_replicas` = N (and optionally `replica_devices`, one
device per replica). Out: the replicas' outputs, merged, as if one stage produced them.

* A new request (`add_request`, `add_requests`, `submit`) goes to the least-loaded replica that is
  ready: fewest requests in flight, then fewest prompt tokens in flight (a text prompt counts its
  characters / 4, an input without a length counts 1), then the replica that took a request longest
  ago, so that light traffic still spreads. Requests added together are placed one by one, the
  batch's earlier ones counted as in flight, and each replica's share goes to it in one message.
  The request then sticks to that replica: its later pieces (`add_input`, streamed edge pieces) and
  its abort go there only.
* A replica whose process dies fails only the requests it held (its `StageClient` reports them as
  fatal errors: 503) and restarts in the background while the others take every new request; the
  stage refuses work (`unavailable`) only when no replica is ready.
* `state` is "ready" while any replica serves (else "restarting" / "failed"); `replica_states`
  and `replica_stats` say how each one is (what `/health` and the `replica` label of `/metrics` show).
* What entry points read once (tokenizer, `max_model_len`, voices, a diffusion stage's attributes)
  comes from the first replica; they are copies of one stage, so all agree.
"""

from __future__ import annotations

import dataclasses
import itertools
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Optional

from omnistage.pipeline import stage_client
from omnistage.pipeline.stage_client import StageClient
from omnistage.stage import StageOutput

# stats that are fractions (averaged over the replicas); the others are counts (summed)
_AVERAGED = ("kv_cache_usage",)


def replica_specs(spec: Any) -> list[Any]:
    """One spec per replica: the stage's, with that replica's device when `replica_devices` names them."""
    n = spec.engine.num_replicas
    if not spec.replica_devices:
        return [spec] * n
    return [dataclasses.replace(spec, engine=dataclasses.replace(spec.engine, device=d)) for d in spec.replica_devices]


def _size(inputs: Any) -> int:
    """A rough token count of a request's input, for balancing (not for any limit)."""
    if isinstance(inputs, str):
        return max(1, len(inputs) // 4)
    if isinstance(inputs, list):
        return max(1, len(inputs))
    if isinstance(inputs, dict):               # a prompt dict: token ids or text
        return _size(inputs.get("prompt_token_ids") or inputs.get("prompt") or 1)
    if hasattr(inputs, "prompt_token_ids"):     # an ARPrompt
        return _size(inputs.prompt_token_ids or inputs.prompt or 1)
    return 1


class ReplicaSet:
    def __init__(self, spec: Any, **client_kwargs):
        self.spec = spec
        self.replicas: list[StageClient] = []
        specs = replica_specs(spec)
        with ThreadPoolExecutor(len(specs)) as pool:   # the replicas load at the same time
            starting = [pool.submit(StageClient, s, replica=i, **client_kwargs) for i, s in enumerate(specs)]
            wait(starting)
        failed = [f.exception() for f in starting if f.exception() is not None]
        self.replicas = [f.result() for f in starting if f.exception() is None]
        if failed:                              # one failed to start: stop those started
            self.close()
            raise failed[0]
        first = self.replicas[0]
        self.params_type, self.max_model_len, self.tokenizer = first.params_type, first.max_model_len, first.tokenizer
        for name in stage_client._ATTRIBUTES:   # what a stage client reads once, read from the first
            if hasattr(first, name):
                setattr(self, name, getattr(first, name))
        for name in stage_client._OPTIONAL:     # the optional verbs, offered as the replicas offer them
            if hasattr(first, name):
                setattr(self, name, getattr(self, "_" + name))
        self.owner: dict[str, int] = {}         # request id -> index of the replica that holds it
        self._sizes: dict[str, int] = {}        # request id -> its prompt tokens (roughly), while in flight
        self.tokens = [0] * len(self.replicas)  # prompt tokens (roughly) in flight on each replica
        self.requests = [0] * len(self.replicas)   # requests handed to each replica so far
        self._last = [0] * len(self.replicas)   # `_tick` of each replica's latest request
        self._tick = itertools.count(1)

    # ---- balancing ------------------------------------------------------------------------------
    def _pick(self, batch: Optional[list[int]] = None) -> int:
        """The least-loaded ready replica (see the module docstring; `batch`: requests of the batch
        being placed that each replica was given already, counted as in flight); when none is ready,
        the first, whose client refuses the request saying why."""
        load = [r.in_flight + (batch[i] if batch else 0) for i, r in enumerate(self.replicas)]
        ready = [i for i, r in enumerate(self.replicas) if r.unavailable is None] or [0]
        return min(ready, key=lambda i: (load[i], self.tokens[i], self._last[i]))

    def _assign(self, request_id: str, inputs: Any, batch: Optional[list[int]] = None) -> int:
        i = self._pick(batch)
        self.owner[request_id] = i
        self._sizes[request_id] = _size(inputs)
        self.tokens[i] += self._sizes[request_id]
        self.requests[i] += 1
        self._last[i] = next(self._tick)
        return i

    def add_request(self, request_id: str, inputs: Any, params: Any, arrival_time: Optional[float] = None) -> None:
        [error] = self.add_requests([(request_id, inputs, params, arrival_time)])
        if error is not None:
            raise error

    def add_requests(self, requests: list[tuple]) -> list[Optional[Exception]]:
        """`add_request` for each (request_id, inputs, params, arrival_time): each request placed as
        one alone would be (the batch's earlier ones counted), then each replica's share sent in one
        message (`StageClient.add_requests`). Per request: None, or why it was refused."""
        batch = [0] * len(self.replicas)        # replica -> requests of this batch placed on it
        shares: dict[int, list[int]] = {}       # replica -> places in `requests`
        for k, (request_id, inputs, *_) in enumerate(requests):
            i = self._assign(request_id, inputs, batch)
            batch[i] += 1
            shares.setdefault(i, []).append(k)
        errors: list[Optional[Exception]] = [None] * len(requests)
        for i, places in shares.items():
            for k, error in zip(places, self.replicas[i].add_requests([requests[k] for k in places])):
                errors[k] = error
                if error is not None:
                    self._release(requests[k][0])
        return errors

    def submit(self, request_id: str, inputs: Any, params: Any, arrival_time: Optional[float] = None) -> None:
        self.replicas[self._assign(request_id, inputs)].submit(request_id, inputs, params, arrival_time)

    def _add_input(self, request_id: str, piece: Any) -> None:
        i = self.owner.get(request_id)
        if i is not None:
            self.replicas[i].add_input(request_id, piece)

    def abort(self, request_id: str) -> None:
        i = self._release(request_id)
        if i is not None:
            self.replicas[i].abort(request_id)

    def _release(self, request_id: str) -> Optional[int]:
        """Forgets a request that left its replica; the replica's index (None: not held)."""
        i = self.owner.pop(request_id, None)
        if i is not None:
            self.tokens[i] -= self._sizes.pop(request_id, 0)
        return i

    # ---- what any replica answers ---------------------------------------------------------------
    def _serving(self) -> StageClient:
        return next((r for r in self.replicas if r.unavailable is None), self.replicas[0])

    def _check_params(self, params: Any) -> Any:
        return self._serving().check_params(params)

    def _voices(self) -> list:
        return self.replicas[0].voices()

    def _reset_prefix_cache(self) -> int:
        return sum(r.reset_prefix_cache() for r in self.replicas if r.unavailable is None)

    # ---- the loop -------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return any(r.has_unfinished() for r in self.replicas)

    def step(self) -> list[StageOutput]:
        outs: list[StageOutput] = []
        for r in self.replicas:
            if r.has_unfinished():
                outs.extend(r.step())
        for o in outs:
            if o.finished:
                self._release(o.request_id)
        return outs

    def close(self) -> None:
        for r in self.replicas:
            r.close()

    # ---- state ----------------------------------------------------------------------------------
    @property
    def state(self) -> str:
        """"ready" while any replica serves; else "restarting" while any restarts; else "failed"."""
        states = self.replica_states()
        return next(s for s in ("ready", "restarting", "failed") if s in states)

    @property
    def unavailable(self) -> Optional[str]:
        """None while any replica takes requests; else why not (every replica's reason)."""
        reasons = [r.unavailable for r in self.replicas]
        return None if None in reasons else "; ".join(reasons)

    def replica_states(self) -> list[str]:
        return [r.state for r in self.replicas]

    def stats(self) -> dict[str, float]:
        """The replicas' engine stats merged: counts summed, fractions (`_AVERAGED`) averaged."""
        merged: dict[str, float] = {}
        for r in self.replicas:
            for k, v in r.stats().items():
                merged[k] = merged.get(k, 0) + v
        for k in _AVERAGED:
            if k in merged:
                merged[k] /= len(self.replicas)
        return merged

    def replica_stats(self) -> list[dict[str, float]]:
        """Per replica: requests in flight and handed to it, up (1) or not, restarts, and its engine stats."""
        return [{**r.stats(), "in_flight": r.in_flight, "requests": self.requests[i], "up": float(r.state == "ready"),
                 "restarts": r.restarts} for i, r in enumerate(self.replicas)]
