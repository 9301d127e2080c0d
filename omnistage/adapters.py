"""Stage-to-stage glue: what an edge adapter is and how one is built (orchestrator's process).

An adapter takes the upstream stage's latest cumulative `StageOutput` and returns the downstream
stage's typed input for everything produced so far (or None while nothing is ready). For a
streaming edge the input is `Streamable`: the orchestrator forwards only the units it has not sent
yet, in pieces of the edge's chunk sizes. Adapters are declared by name in the model registry
(`models/registry.py`), and an edge names its adapter in the `PipelineSpec`.

Two shapes of adapter:
  * a plain function `fn(out) -> input`: keeps no state, so it is tested with hand-made outputs;
  * an adapter class, built once per edge with `EdgeSpec.options` (e.g. the checkpoint whose
    constants it adds), whose instances are called as `adapter(out, ctx)` with an `EdgeContext`
    that the orchestrator keeps per request and edge (upstream outputs that carry per-step payloads,
    such as hidden states of the rows computed in one step, are gathered there). It may declare
    `upstream_inputs`: fields merged into the entry stage's request inputs when the request runs
    that edge (e.g. `{"return_hidden_states": True}`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from omnistage.stage import StageOutput


@dataclass
class EdgeContext:
    """What an edge adapter sees besides the upstream output, for one request (orchestrator-owned)."""

    fields: dict[str, Any] = field(default_factory=dict)  # request-level prompt fields: modalities, voice
    entry_inputs: Any = None                    # the inputs the request entered the pipeline with
    memory: dict[str, Any] = field(default_factory=dict)  # the adapter's own state; dropped with the request


EdgeAdapter = Callable[[StageOutput, EdgeContext], Optional[Any]]


class _Plain:
    """A plain adapter function seen through the edge-adapter interface."""

    upstream_inputs: dict[str, Any] = {}

    def __init__(self, fn: Callable[[StageOutput], Optional[Any]]):
        self.fn = fn

    def __call__(self, out: StageOutput, ctx: EdgeContext) -> Optional[Any]:
        return self.fn(out)


def build_adapter(name: str, target: Any, options: Optional[dict] = None) -> EdgeAdapter:
    """The adapter of one edge from its registered `target`: an adapter class built with `options`,
    or a plain function (which takes no options)."""
    if isinstance(target, type):
        return target(dict(options or {}))
    if options:
        raise ValueError(f"adapter {name!r} takes no options, got {sorted(options)}")
    return _Plain(target)
