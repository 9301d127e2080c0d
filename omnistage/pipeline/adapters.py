"""Stage-to-stage glue: pure, typed functions of one upstream output (orchestrator's process).

An adapter takes the upstream stage's latest cumulative `StageOutput` and returns the downstream
stage's typed input for everything produced so far (or None while nothing is ready). For a
streaming edge the input is `Streamable`: the orchestrator forwards only the units it has not sent
yet, in pieces of the edge's chunk sizes. Adapters keep no state, so they are tested with
hand-made outputs, and an edge is named in a `PipelineSpec` by the adapter's registered name.
"""

from __future__ import annotations

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
