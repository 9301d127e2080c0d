"""The GPU memory plan (pipeline/memory.py) on CPU: a tiny Qwen2.5-Omni and tiny LLMs planned for a
pretend "cuda:0" (`device_total` injected), and weight sizes read from safetensors headers checked
against the tensors themselves."""

import dataclasses

import pytest
import torch
from safetensors import safe_open

from omnistage.config import EngineConfig
from omnistage.models.loader import safetensors_files
from omnistage.pipeline.deploy_config import apply_deploy_config, pinned_stages
from omnistage.config import CUDA_CONTEXT_BYTES
from omnistage.pipeline.memory import (WORKSPACE_BYTES, plan_gpu_memory, split_kv, stage_cost,
                                       weight_bytes)
from omnistage.spec import PipelineSpec, StageSpec

GiB = 2**30
TOTAL = 80 * GiB


def total_80(device: str) -> int:
    assert device == "cuda:0"
    return TOTAL


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory) -> str:
    from omnistage.testing.qwen2_5_omni import make_tiny_qwen2_5_omni

    return make_tiny_qwen2_5_omni(str(tmp_path_factory.mktemp("omni") / "tiny-qwen2_5_omni"))


def on_cuda0(spec: PipelineSpec, **engine) -> PipelineSpec:
    """`spec` as on a GPU: every stage on "cuda:0" in its own process, with `engine` changes."""
    return dataclasses.replace(spec, stages=[dataclasses.replace(
        s, runner="process", engine=dataclasses.replace(s.engine, device="cuda:0", **engine)) for s in spec.stages])


@pytest.fixture(scope="module")
def omni_spec(omni_dir) -> PipelineSpec:
    from omnistage.models.qwen2_5_omni.pipeline import omni_pipeline

    return on_cuda0(omni_pipeline(omni_dir, EngineConfig(device="cpu")))


def big_kv(spec: PipelineSpec, thinker_blocks: int, talker_blocks: int) -> PipelineSpec:
    """KV demands larger than the GPU, so that the AR stages' KV shares are not capped."""
    blocks = {"thinker": thinker_blocks, "talker": talker_blocks}
    return dataclasses.replace(spec, stages=[dataclasses.replace(s, engine=dataclasses.replace(
        s.engine, num_kv_blocks=blocks[s.name])) if s.name in blocks else s for s in spec.stages])


def shares(spec: PipelineSpec) -> dict[str, float]:
    return {s.name: s.engine.gpu_memory_utilization for s in spec.stages}


def renderer_reserve(spec: PipelineSpec) -> int:
    """The entry point's process on the device: its context, the renderer's weights and workspace."""
    return CUDA_CONTEXT_BYTES + WORKSPACE_BYTES + weight_bytes(
        spec.main_stage.model_dir, spec.renderer_weights, torch.float32)


def kv_share(spec: PipelineSpec, name: str) -> float:
    stage = spec.stage(name)
    return stage.engine.gpu_memory_utilization * TOTAL - stage_cost(stage, "cuda:0").fixed


def test_omni_shares_cover_each_stage_and_fit_in_the_pipeline_utilization(omni_spec):
    planned = plan_gpu_memory(omni_spec, device_total=total_80)
    got = shares(planned)
    assert set(got) == {"thinker", "talker", "code2wav"}
    # the tiny checkpoint is fp32; each stage's weights are those it loads, at the dtype it runs in
    weights = {"thinker": ("thinker.model.", "thinker.lm_head."), "talker": ("talker.",), "code2wav": ("token2wav.",)}
    for name, prefixes in weights.items():
        assert 0 < got[name] <= 1
        assert got[name] * TOTAL >= CUDA_CONTEXT_BYTES + weight_bytes(planned.main_stage.model_dir, prefixes,
                                                                      torch.float32)
    assert sum(got.values()) * TOTAL + renderer_reserve(planned) <= 0.90 * TOTAL
    # tiny demands fit: each AR stage gets all the KV it can use, and no more
    for name in ("thinker", "talker"):
        assert kv_share(planned, name) == pytest.approx(stage_cost(planned.stage(name), "cuda:0").kv_demand, abs=2)
    # what the stages did not ask for stays unplanned
    assert planned.edges == omni_spec.edges and planned.renderer_weights == omni_spec.renderer_weights


def test_kv_is_split_in_proportion_to_demand_when_it_does_not_all_fit(omni_spec):
    spec = big_kv(omni_spec, thinker_blocks=30_000_000, talker_blocks=10_000_000)
    planned = plan_gpu_memory(spec, device_total=total_80)
    demand = {n: stage_cost(spec.stage(n), "cuda:0").kv_demand for n in ("thinker", "talker")}
    kv = {n: kv_share(planned, n) for n in demand}
    assert all(kv[n] < demand[n] for n in demand)
    assert kv["thinker"] / kv["talker"] == pytest.approx(demand["thinker"] / demand["talker"], rel=1e-6)
    # the whole pool is handed out: the shares and the entry point's reserve add up to U
    assert sum(shares(planned).values()) * TOTAL + renderer_reserve(planned) == pytest.approx(0.90 * TOTAL, rel=1e-6)


def test_a_pinned_stage_keeps_its_share_and_the_others_shrink(omni_spec):
    spec = big_kv(omni_spec, thinker_blocks=30_000_000, talker_blocks=10_000_000)
    free = shares(plan_gpu_memory(spec, device_total=total_80))
    pinned_spec = dataclasses.replace(spec, stages=[dataclasses.replace(s, engine=dataclasses.replace(
        s.engine, gpu_memory_utilization=0.5)) if s.name == "talker" else s for s in spec.stages])
    got = shares(plan_gpu_memory(pinned_spec, pinned=frozenset({"talker"}), device_total=total_80))
    assert got["talker"] == 0.5 > free["talker"]
    assert got["thinker"] < free["thinker"]
    assert got["code2wav"] == pytest.approx(free["code2wav"])      # fixed cost only: it has no KV to give
    assert sum(got.values()) * TOTAL + renderer_reserve(spec) == pytest.approx(0.90 * TOTAL, rel=1e-6)


def test_an_impossible_plan_names_the_estimates_and_the_override(omni_spec):
    with pytest.raises(ValueError) as err:
        plan_gpu_memory(omni_spec, device_total=lambda d: 2 * GiB)
    msg = str(err.value)
    assert "cuda:0" in msg and "GiB" in msg
    for part in ("thinker", "talker", "code2wav", "chat renderer", "gpu_memory_utilization: F"):
        assert part in msg


def test_cpu_stages_and_a_lone_llm_are_left_unchanged(omni_dir, tiny_models):
    from omnistage.models.qwen2_5_omni.pipeline import omni_pipeline

    on_cpu = omni_pipeline(omni_dir, EngineConfig(device="cpu"))
    assert plan_gpu_memory(on_cpu, device_total=lambda d: pytest.fail("no CUDA device to plan")) == on_cpu
    lone = PipelineSpec([StageSpec("llm", "ar", tiny_models["llama"], EngineConfig(device="cuda"))])
    assert plan_gpu_memory(lone, device_total=lambda d: pytest.fail("nothing to plan")) == lone


def test_two_llms_on_one_gpu_are_planned_from_their_config(tiny_models):
    llama, qwen = tiny_models["llama"], tiny_models["qwen2"]
    spec = PipelineSpec([StageSpec("a", "ar", llama, EngineConfig(device="cuda:0", max_num_seqs=8)),
                         StageSpec("b", "ar", qwen, EngineConfig(device="cuda", max_num_seqs=8), runner="process")])
    got = shares(plan_gpu_memory(spec, device_total=total_80))
    for name, folder in (("a", llama), ("b", qwen)):
        assert got[name] * TOTAL >= weight_bytes(folder, None, torch.float32)
    # the inline stage shares the entry point's context; only "b" brings its own
    assert stage_cost(spec.stage("a"), "cuda:0").context == 0
    assert stage_cost(spec.stage("b"), "cuda:0").context == CUDA_CONTEXT_BYTES


def test_split_kv_is_proportional_and_capped_at_demand():
    assert split_kv(100, {"a": 30, "b": 10}) == {"a": 30, "b": 10}
    assert split_kv(20, {"a": 30, "b": 10}) == {"a": 15, "b": 5}
    assert split_kv(0, {"a": 30}) == {"a": 0}


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float32])
def test_header_only_weight_bytes_equal_the_tensors(omni_dir, dtype):
    prefixes = ("thinker.model.", "thinker.lm_head.", "token2wav.")
    expected = 0
    for path in safetensors_files(omni_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name.startswith(prefixes):
                    t = f.get_tensor(name)
                    if dtype is not None and t.is_floating_point():
                        t = t.to(dtype)
                    expected += t.numel() * t.element_size()
    assert weight_bytes(omni_dir, prefixes, dtype) == expected > 0


def test_the_thinker_prefixes_are_what_its_loader_loads(omni_dir):
    from omnistage.models.qwen2_5_omni.pipeline import THINKER_WEIGHTS
    from omnistage.models.qwen2_5_omni.stages import load_thinker

    model = load_thinker(omni_dir, torch.device("cpu"), torch.float32, None)[0]
    loaded = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes(omni_dir, tuple(THINKER_WEIGHTS), torch.float32) == loaded


def test_deploy_config_gpu_memory_utilization_pins_a_stage(omni_spec, tmp_path):
    config = {"stages": {"talker": {"gpu_memory_utilization": 0.3}, "thinker": {"max_num_seqs": 4}}}
    assert pinned_stages(config) == {"talker"}
    path = tmp_path / "deploy.yaml"
    path.write_text("stages:\n  code2wav: {gpu_memory_utilization: 0.1}\n")
    assert pinned_stages(str(path)) == {"code2wav"}
    assert pinned_stages(None) == frozenset()
    spec = apply_deploy_config(omni_spec, config)
    assert spec.renderer_weights == omni_spec.renderer_weights and spec.model == omni_spec.model
    planned = plan_gpu_memory(spec, pinned=pinned_stages(config), device_total=total_80)
    assert planned.stage("talker").engine.gpu_memory_utilization == 0.3


def test_tensor_parallel_stage_is_planned_for_rank_0s_shard(tiny_models):
    """TP=2 on the tiny Llama (2 KV heads): half the weights and half the KV per token on cuda:0."""
    def cost(tp: int):
        return stage_cost(StageSpec("a", "ar", tiny_models["llama"], EngineConfig(
            device="cuda:0", dtype="float32", max_num_seqs=8, num_kv_blocks=64, tensor_parallel_size=tp)), "cuda:0")
    one, two = cost(1), cost(2)
    assert two.weights == one.weights // 2 and two.kv_demand * 2 == one.kv_demand
