"""`OMNISTAGE_TORCH_PROFILER_DIR` (pipeline/step_profiler.py): a tiny AR stage's steps, after the
warm-up, are recorded with torch.profiler and cProfile, and the three tables land in the folder."""

import os

import pytest

from omnistage.ar.engine import AREngine
from omnistage.config import EngineConfig
from omnistage.models.loader import load_causal_lm
from omnistage.params import SamplingParams
from omnistage.pipeline.step_profiler import StepProfiler


def test_a_tiny_stage_writes_its_profile_tables(tiny_models, tmp_path, monkeypatch):
    folder = tmp_path / "prof"
    monkeypatch.setenv("OMNISTAGE_TORCH_PROFILER_DIR", str(folder))
    monkeypatch.setenv("OMNISTAGE_PROFILER_STEPS", "4")
    monkeypatch.setenv("OMNISTAGE_PROFILER_WARMUP", "2")
    profiler = StepProfiler.from_env("llm")
    engine = AREngine(tiny_models["llama"], EngineConfig(device="cpu", dtype="float32"), loader=load_causal_lm)
    engine.add_request("r", "Hello there", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        profiler.run(engine.step)
    assert profiler.done and profiler.recorded == 4 and profiler.seen == 6   # 2 warm-up + 4 recorded
    prefix = folder / f"llm-{os.getpid()}"
    cpu = (folder / f"{prefix.name}.torch-cpu.txt").read_text()
    cuda = (folder / f"{prefix.name}.torch-cuda.txt").read_text()
    calls = (folder / f"{prefix.name}.cprofile.txt").read_text()
    assert cpu.startswith("4 steps") and "aten::" in cpu and "Self CPU" in cpu
    assert cuda.startswith("4 steps") and "aten::" in cuda
    assert "cumulative" in calls and "engine.py" in calls and "_step" in calls
    profiler.close()                            # a second close writes nothing more


def test_bad_profiler_steps_name_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("OMNISTAGE_TORCH_PROFILER_DIR", str(tmp_path))
    monkeypatch.setenv("OMNISTAGE_PROFILER_STEPS", "zero")
    with pytest.raises(ValueError, match="OMNISTAGE_PROFILER_STEPS must be an integer >= 1"):
        StepProfiler.from_env("llm")
    monkeypatch.delenv("OMNISTAGE_TORCH_PROFILER_DIR")
    assert StepProfiler.from_env("llm") is None
