"""Architecture name (config.json `architectures[0]`) -> native model class and what it can do."""

from __future__ import annotations

from dataclasses import dataclass

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
