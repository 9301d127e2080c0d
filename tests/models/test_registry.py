"""The model registry: one entry per architecture, every declared part importable, folders matched."""

import json
import os

import pytest

from omnistage.models import registry


def test_entries_are_unique_and_every_declared_part_imports():
    names = [e.name for e in registry.MODELS]
    matches = [m for e in registry.MODELS for m in e.match]
    assert len(set(names)) == len(names) and len(set(matches)) == len(matches)
    for e in registry.MODELS:
        targets = [e.decoder, e.family, e.pipeline, e.chat_renderer,
                   *e.components.values(), *e.adapters.values(), *e.codecs.values()]
        for target in filter(None, targets):
            assert registry.load_attr(target) is not None, target


def test_tiny_folders_find_their_entries(tiny_models):
    for arch, path in tiny_models.items():
        assert registry.entry_for_folder(path).name == {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[arch]


def test_unknown_architectures_and_names_are_clear_errors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt9", "architectures": ["Gpt9ForCausalLM"]}))
    with pytest.raises(ValueError, match="architecture 'Gpt9ForCausalLM' is not supported; supported: .*Qwen2ForCausalLM"):
        registry.entry_for_folder(str(tmp_path))
    os.remove(tmp_path / "config.json")
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "NopePipeline"}))
    with pytest.raises(ValueError, match="diffusers pipeline 'NopePipeline' is not supported; supported: .*FluxPipeline"):
        registry.entry_for_folder(str(tmp_path))
    with pytest.raises(ValueError, match="adapter must be one of"):
        registry.adapter_target("nope")
    with pytest.raises(ValueError, match="backend must be one of .*piper"):
        registry.codec_class("nope")
    with pytest.raises(ValueError, match="component must be one of .*qwen2_5_omni.talker"):
        registry.component_loader("nope")
