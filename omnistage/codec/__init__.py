"""Non-autoregressive generation stages (TTS back ends, code2wav vocoders) and their registry.

`build_codec_stage(spec)` builds the engine named by `StageSpec.backend`; back ends import their
heavy dependencies only when built, so listing what is installed stays cheap.
"""

from __future__ import annotations

import dataclasses
import importlib

from omnistage.pipeline.memory import engine_options

# backend name -> "module:class" of an engine class with `from_stage_spec(spec)`
CODEC_BACKENDS = {
    "piper": "omnistage.codec.piper_tts:PiperTTSEngine",
    "qwen2_5_omni_code2wav": "omnistage.codec.code2wav:Code2WavEngine",
}


def default_tts_backend():
    """The TTS back end a chat LM is cascaded with, or None when none is installed."""
    from omnistage.codec.piper_tts import piper_available

    return "piper" if piper_available() else None


def build_codec_stage(spec):
    target = CODEC_BACKENDS.get(spec.backend or "")
    if target is None:
        raise ValueError(f"stage {spec.name!r}: backend must be one of {sorted(CODEC_BACKENDS)}, got {spec.backend!r}")
    module, cls = target.split(":")
    spec = dataclasses.replace(spec, options=engine_options(spec.options))   # less the memory planner's keys
    return getattr(importlib.import_module(module), cls).from_stage_spec(spec)
