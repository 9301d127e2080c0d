"""Stages placed as Ray actors on two nodes of a local Ray cluster (a head and one more node on
loopback, each with a custom resource; started and stopped here): the tiny Llama -> Piper cascade
with its LM stage on the head node and its TTS stage on the other (`distributed_executor_backend:
ray`, per-stage `ray: {resources: ...}`) gives the same text and audio as the in-process run. The TTS
stage's node is not the orchestrator's, so its messages carry arrays inline (`wire`'s remote mode);
the LM stage shares the orchestrator's node and keeps shared memory.

A TP=2 tiny Qwen2 stage under Ray runs its rank 1 as a Ray actor (`parallel/ray_ranks.py`), on the
other node than the stage (each node has one `rank_slot`, which the stage's actor and each rank's
actor ask for), joined to rank 0 over gloo at rank 0's node IP: greedy ids equal the TP=1 run."""

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'omnistage[ray]')")

PROMPTS = ["Tell me a story.", "Hello there, how are you today?"]
DEPLOY = {"stages": {"llm": {"ray": {"resources": {"head_node": 1}}},
                     "tts": {"ray": {"resources": {"node_b": 1}}}}}


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"head_node": 1, "rank_slot": 1},
                                                      "include_dashboard": False})
    node_b = c.add_node(num_cpus=2, resources={"node_b": 1, "rank_slot": 1})
    try:
        c.wait_for_nodes(timeout=180)
        yield c, c.head_node.node_id, node_b.node_id
    finally:
        ray.shutdown()
        c.shutdown()


def _run(folder: str, **kwargs):
    from omnistage import SamplingParams
    from omnistage.entrypoints.omni import Omni

    omni = Omni(folder, device="cpu", dtype="float32", num_kv_blocks=256, **kwargs)
    try:
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        outs = omni.generate([{"prompt": p, "modalities": ["text", "audio"]} for p in PROMPTS], params,
                             use_tqdm=False)
        return outs, {name: stage.placement for name, stage in omni.orchestrator.stages.items()
                      if hasattr(stage, "placement")}
    finally:
        omni.orchestrator.close()


def test_two_stage_pipeline_on_two_ray_nodes_equals_the_local_run(cluster, tiny_models):
    from omnistage.pipeline.build import default_tts_backend

    if default_tts_backend() is None:
        pytest.skip("no TTS back end installed for the cascade's second stage")
    c, head, other = cluster
    local, _ = _run(tiny_models["llama"])
    placed_outs, placed = _run(tiny_models["llama"], deploy_config=DEPLOY, distributed_executor_backend="ray",
                               ray_address=c.address)
    assert placed == {"llm": (head, False), "tts": (other, True)}
    for a, b in zip(local, placed_outs):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.audio is not None and a.audio is not None
        np.testing.assert_allclose(np.asarray(b.audio.samples), np.asarray(a.audio.samples), atol=1e-6)


def test_tp2_stage_with_its_rank_as_a_ray_actor_on_the_other_node_equals_tp1(cluster, tiny_models):
    import time

    from omnistage import SamplingParams
    from omnistage.entrypoints.omni import Omni

    c = cluster[0]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    runs = {}
    for tp, kwargs in ((1, {}), (2, {"deploy_config": {"stages": {"llm": {"ray": {"resources": {"rank_slot": 1}}}}},
                                     "distributed_executor_backend": "ray", "ray_address": c.address})):
        omni = Omni(tiny_models["qwen2"], device="cpu", dtype="float32", num_kv_blocks=64,
                    tensor_parallel_size=tp, **kwargs)
        try:
            runs[tp] = [o.outputs[0].token_ids for o in omni.generate(PROMPTS, params, use_tqdm=False)]
            if tp == 2:   # the stage's actor holds one node's slot, rank 1's actor the other's
                deadline = time.monotonic() + 60
                while ray.available_resources().get("rank_slot", 0) != 0 and time.monotonic() < deadline:
                    time.sleep(0.5)
                assert ray.available_resources().get("rank_slot", 0) == 0
        finally:
            omni.orchestrator.close()
    assert runs[2] == runs[1] and all(len(ids) == 12 for ids in runs[1])
