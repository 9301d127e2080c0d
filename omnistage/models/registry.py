"""Architecture name (config.json `architectures[0]`) -> native model class and what it can do."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from omnistage.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM


@dataclass(frozen=True)
class ModelInfo:
    cls: type
    family: str                                 # "llm" for text decoders


_REGISTRY: dict[str, ModelInfo] = {
    "LlamaForCausalLM": ModelInfo(LlamaForCausalLM, "llm"),
    "MistralForCausalLM": ModelInfo(LlamaForCausalLM, "llm"),
    "Qwen2ForCausalLM": ModelInfo(Qwen2ForCausalLM, "llm"),
    "Qwen3ForCausalLM": ModelInfo(Qwen3ForCausalLM, "llm"),
}


def lookup(architecture: str) -> ModelInfo:
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(sorted(_REGISTRY))}") from None


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


# Components of multi-network checkpoints (e.g. the thinker or the talker of an omni model) that an AR
# stage serves. A loader maps (model_dir, device, dtype, max_positions) to
# (model, text_config, tokenizer or None, eos ids); it lives in the model's own file.
_COMPONENTS: dict[str, Callable] = {}


def register_component(name: str, loader: Callable) -> None:
    _COMPONENTS[name] = loader


def component_loader(name: str) -> Callable:
    """Loaders live in `omnistage.models.<family>.stages` for a name "<family>.<part>"; importing
    that module registers them (so a fresh stage process finds them too)."""
    if name not in _COMPONENTS:
        import importlib

        try:
            importlib.import_module(f"omnistage.models.{name.split('.')[0]}.stages")
        except ImportError:
            pass
    try:
        return _COMPONENTS[name]
    except KeyError:
        raise ValueError(f"model component {name!r} is not registered; known: {', '.join(sorted(_COMPONENTS))}") from None
