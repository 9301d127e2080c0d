"""Stage-to-stage glue: pure, typed functions of one upstream output (orchestrator's process).

An adapter takes the upstream stage's latest cumulative `StageOutput` and returns the downstream
stage's typed input for everything produced so far (or None while nothing is ready). For a
streaming edge the input is `Streamable`: the orchestrator forwards only the units it has not sent
yet, in pieces of the edge's chunk sizes. Adapters keep no state, so they are tested with
hand-made outputs, and an edge is named in a `PipelineSpec` by the adapter's registered name.

Edge adapters (`register_adapter_factory`) are for glue that needs settings or memory: the factory
is called once per edge with `EdgeSpec.options` (e.g. the checkpoint whose constants it adds), and
the adapter it returns is called as `adapter(out, ctx)` with an `EdgeContext` that the orchestrator
keeps per request and edge (upstream outputs that carry per-step payloads, such as hidden states
of the rows computed in one step, are gathered there). An edge adapter may declare
`upstream_inputs`: fields merged into the entry stage's request inputs when the request runs that
edge (e.g. `{"return_hidden_states": True}`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from omnistage.codec.speech import TTSInput, split_sentences
from omnistage.pipeline.stage import StageOutput

Adapter = Callable[[StageOutput], Optional[Any]]
ADAPTERS: dict[str, Adapter] = {}


def register_adapter(name: str) -> Callable[[Adapter], Adapter]:
    def wrap(fn: Adapter) -> Adapter:
        if name in ADAPTERS:
            raise ValueError(f"adapter {name!r} is already registered")
        ADAPTERS[name] = fn
        return fn
    return wrap


def get_adapter(name: str) -> Adapter:
    if name not in ADAPTERS:
        raise ValueError(f"adapter must be one of {sorted(ADAPTERS)}, got {name!r}")
    return ADAPTERS[name]


@dataclass
class EdgeContext:
    """What an edge adapter sees besides the upstream output, for one request (orchestrator-owned)."""

    fields: dict[str, Any] = field(default_factory=dict)  # request-level prompt fields: modalities, voice
    entry_inputs: Any = None                    # the inputs the request entered the pipeline with
    memory: dict[str, Any] = field(default_factory=dict)  # the adapter's own state; dropped with the request


EdgeAdapter = Callable[[StageOutput, EdgeContext], Optional[Any]]
ADAPTER_FACTORIES: dict[str, Callable[[dict], EdgeAdapter]] = {}


def register_adapter_factory(name: str) -> Callable:
    """Registers `factory(options: dict) -> adapter(out, ctx)` (see the module docstring)."""
    def wrap(factory):
        if name in ADAPTERS or name in ADAPTER_FACTORIES:
            raise ValueError(f"adapter {name!r} is already registered")
        ADAPTER_FACTORIES[name] = factory
        return factory
    return wrap


class _Plain:
    """A plain adapter seen through the edge-adapter interface."""

    upstream_inputs: dict[str, Any] = {}

    def __init__(self, fn: Adapter):
        self.fn = fn

    def __call__(self, out: StageOutput, ctx: EdgeContext) -> Optional[Any]:
        return self.fn(out)


def build_adapter(name: str, options: Optional[dict] = None) -> EdgeAdapter:
    """The adapter of one edge: an edge adapter built with `options`, or a plain one (no options)."""
    if name in ADAPTER_FACTORIES:
        return ADAPTER_FACTORIES[name](dict(options or {}))
    if name not in ADAPTERS:
        raise ValueError(f"adapter must be one of {sorted(ADAPTERS) + sorted(ADAPTER_FACTORIES)}, got {name!r}")
    if options:
        raise ValueError(f"adapter {name!r} takes no options, got {sorted(options)}")
    return _Plain(ADAPTERS[name])


@register_adapter("text_to_tts")
def text_to_tts(out: StageOutput) -> TTSInput:
    """LM text so far -> the complete sentences in it (all of it once the LM has finished).

    Speaks the first completion (choice 0). A sentence counts as complete once the whitespace after
    its final punctuation has arrived, so a sentence once returned never changes as the text grows.
    """
    comps = out.output.outputs
    text = comps[0].text if comps else ""
    sentences, _ = split_sentences(text, final=out.finished)
    return TTSInput(sentences, finished=out.finished)


@register_adapter("text_to_text")
def text_to_text(out: StageOutput) -> Optional[dict]:
    """LM text -> a prompt for another text stage (e.g. a rewriter); whole output only."""
    if not out.finished:
        return None
    comps = out.output.outputs
    return {"prompt": comps[0].text if comps else ""}
