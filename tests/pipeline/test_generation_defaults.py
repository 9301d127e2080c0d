"""Request defaults from a model's generation_config.json (vLLM's `--generation-config auto`), the
answer cap, and the CPU KV pool sized from what the model needs."""

import json
import shutil

import pytest

from omnistage.config import EngineConfig
from omnistage.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from omnistage.pipeline.build import read_generation_config


@pytest.fixture(scope="module")
def sampled_model(tiny_models, tmp_path_factory):
    """The tiny Qwen2 with sampling defaults and an answer cap in its generation_config.json."""
    folder = tmp_path_factory.mktemp("gen") / "tiny-qwen2"
    shutil.copytree(tiny_models["qwen2"], folder)
    path = folder / "generation_config.json"
    config = json.loads(path.read_text())
    config.update(temperature=0.6, top_p=0.8, top_k=20, repetition_penalty=1.05, max_new_tokens=5, do_sample=True)
    path.write_text(json.dumps(config))
    return str(folder)


def test_the_files_keys_become_defaults_and_overrides_win(sampled_model, tmp_path):
    assert read_generation_config(sampled_model) == dict(temperature=0.6, top_p=0.8, top_k=20,
                                                         repetition_penalty=1.05, max_tokens=5)
    assert read_generation_config(sampled_model, "vllm") == {}
    assert read_generation_config(str(tmp_path), "auto", {"temperature": 0.1}) == {"temperature": 0.1}
    assert read_generation_config(str(tmp_path), sampled_model)["top_k"] == 20      # another folder's file
    with pytest.raises(ValueError, match=r"override_generation_config keys must be among .*got \['temp'\]"):
        read_generation_config(sampled_model, "auto", {"temp": 0.1})
    with pytest.raises(ValueError, match="override_generation_config: top_p must be in"):
        read_generation_config(sampled_model, "auto", {"top_p": 3})
    with pytest.raises(ValueError, match="generation_config must be auto, vllm or a folder"):
        read_generation_config(sampled_model, "nope")


def test_requests_take_the_defaults_and_their_own_fields_win():
    defaults = {"temperature": 0.6, "top_k": 20}
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_k=5)
    p = chat.to_sampling_params(defaults)
    assert (p.temperature, p.top_k, p.max_tokens) == (0.6, 5, None)      # None: the engine's answer cap
    assert CompletionRequest(prompt="x", temperature=0).to_sampling_params(defaults).temperature == 0


def test_the_engine_applies_them(sampled_model):
    from omnistage import Omni, SamplingParams

    with Omni(model=sampled_model, device="cpu", dtype="float32") as omni:
        main = omni.orchestrator.spec.main_stage
        assert main.params["temperature"] == 0.6 and main.engine.default_max_tokens == 5
        out = omni.generate("The harbour", use_tqdm=False)[0]               # no params: the model's defaults
        assert len(out.outputs[0].token_ids) <= 16
        uncapped = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
        assert len(omni.generate("The harbour", uncapped, use_tqdm=False)[0].outputs[0].token_ids) == 5
    with Omni(model=sampled_model, device="cpu", dtype="float32", generation_config="vllm",
              override_generation_config={"max_new_tokens": 3}) as omni:
        assert omni.orchestrator.spec.main_stage.params == {}
        uncapped = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
        assert len(omni.generate("The harbour", uncapped, use_tqdm=False)[0].outputs[0].token_ids) == 3


def test_the_cpu_kv_pool_is_sized_from_what_the_model_needs():
    per_token = 30 * 2 * 3 * 64 * 4                 # SmolLM2-135M in float32: 46 KB of KV per token
    block = 16 * per_token
    cfg = EngineConfig()                            # 256 sequences x 8192 tokens would want 48 GB
    assert cfg.cpu_kv_blocks(8192, block) == 2 * 8192 // 16 + 1          # two full-length sequences (0.75 GB)
    assert EngineConfig(cpu_kv_cache_gb=0.25).cpu_kv_blocks(8192, block) == 2**28 // block   # the cap
    tiny = EngineConfig(max_num_seqs=4)              # a small model: what 4 sequences need, under the 256 MiB floor
    assert tiny.cpu_kv_blocks(512, 16 * 512) == tiny.kv_blocks_wanted(512) == 4 * 32 + 1
