"""`pipeline/build.py`: `detect_pipeline` hands out each stage's EngineConfig resolved once, after the
deploy config, so that what runs later (planner, engines) has nothing left to derive."""

import json
import shutil

import pytest

from omnistage import config
from omnistage.config import EngineConfig
from omnistage.pipeline.build import detect_pipeline, resolve_stage


@pytest.fixture
def bf16_llm(tiny_models, tmp_path) -> str:
    """The tiny llama with a config.json that names bfloat16 weights (what `dtype="auto"` reads)."""
    folder = tmp_path / "tiny-llama-bf16"
    shutil.copytree(tiny_models["llama"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["dtype"] = "bfloat16"                   # read before the older `torch_dtype`
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


def test_each_stage_is_resolved_for_its_kind_and_device_after_the_deploy_config(bf16_llm, monkeypatch):
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: False)
    on_gpu = detect_pipeline(bf16_llm, EngineConfig(device="cuda", max_num_seqs=4))
    llm = on_gpu.stage("llm").engine
    assert (llm.device, llm.dtype, llm.max_num_seqs) == ("cuda:0", "bfloat16", 4)   # the checkpoint's dtype
    # moved to the CPU by the deploy config: the CPU's dtype, not the one resolved for the GPU
    moved = detect_pipeline(bf16_llm, EngineConfig(device="cuda"), {"stages": {"llm": {"device": "cpu"}}})
    assert (moved.stage("llm").engine.device, moved.stage("llm").engine.dtype) == ("cpu", "float32")
    for spec in (on_gpu, moved):
        for stage in spec.stages:               # a cascaded TTS stage too, when Piper is installed
            assert stage.engine.device in ("cpu", "cuda:0") and stage.engine.dtype != "auto"
            assert resolve_stage(stage) == stage    # build_engine and the planner find nothing to change
