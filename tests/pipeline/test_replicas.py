"""Two replicas of the tiny Llama's LM stage (`num_replicas: 2`, each its own process on CPU), served
over HTTP on loopback: 32 concurrent greedy completions use both replicas and equal one in-process
engine's answers; killing one replica's process (os.kill) fails only the requests it held, the
other replica keeps serving, `/health` and `/metrics` show the replicas, and the killed one comes
back and takes requests again."""

import asyncio
import dataclasses
import json
import os
import re
import signal
import sys
import time

import httpx
import openai
import pytest
from live_server import live_server

DEPLOY = {"stages": {"llm": {"num_replicas": 2}}}
PROMPTS = [f"the story of number {i} begins" for i in range(32)]


@pytest.fixture(scope="module")
def served(tiny_models):
    from omnistage.entrypoints.async_omni import AsyncOmni
    from omnistage.entrypoints.openai.api_server import build_app

    engine = AsyncOmni(tiny_models["llama"], device="cpu", dtype="float32", deploy_config=DEPLOY, num_kv_blocks=512)
    try:
        with live_server(build_app(engine, "tiny"), timeout=120) as url:
            yield engine, url
    finally:
        engine.close()


@pytest.fixture(scope="module")
def reference(tiny_models):
    """prompt -> the greedy 8-token answer of one in-process engine on the same weights."""
    from omnistage import SamplingParams
    from omnistage.entrypoints.omni import Omni

    omni = Omni(tiny_models["llama"], device="cpu", dtype="float32", num_kv_blocks=512)
    try:
        outs = omni.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
        return {p: o.outputs[0].text for p, o in zip(PROMPTS, outs)}
    finally:
        omni.orchestrator.close()


def _metric(text: str, name: str, replica: str) -> float:
    m = re.search(rf'^omnistage:{name}\{{[^}}]*replica="{replica}"[^}}]*\}} (\S+)$', text, re.M)
    assert m, f"no {name} for replica {replica} in /metrics"
    return float(m.group(1))


def test_two_replicas_serve_32_concurrent_requests(served, reference):
    engine, url = served

    async def main():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300) as client:
            return await asyncio.gather(*[
                client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True}) for p in PROMPTS])

    answers = asyncio.run(main())
    assert [a.choices[0].text for a in answers] == [reference[p] for p in PROMPTS]
    text = httpx.get(url + "/metrics").text
    served_by = [_metric(text, "replica_requests_total", r) for r in ("0", "1")]
    assert min(served_by) >= 1 and sum(served_by) >= 32, served_by
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and health["replicas"] == {"llm": ["ready", "ready"]}


async def _stream(client: httpx.AsyncClient, url: str, prompt: str, started: asyncio.Event) -> str:
    """How a long streamed completion ended: "done" or "error: <message>"."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return f"status {r.status_code}"
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return "done"
            chunk = json.loads(data)
            if "error" in chunk:
                return f"error: {chunk['error']['message']}"
            started.set()
    return "no [DONE]"


def _snapshot(d: dict) -> dict:
    """A copy of a dict the engine thread may be changing."""
    for _ in range(100):
        try:
            return dict(d)
        except RuntimeError:                    # changed size during the copy: again
            time.sleep(0.001)
    raise AssertionError("could not copy the replica owners")


def test_killed_replica_fails_only_its_requests_and_comes_back(served, reference):
    engine, url = served
    replicas = engine.orchestrator.stages["llm"]
    victim = replicas.replicas[0]

    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            events = [asyncio.Event() for _ in range(6)]
            tasks = [asyncio.create_task(_stream(client, url, f"long story {i}", e)) for i, e in enumerate(events)]
            await asyncio.wait_for(asyncio.gather(*[e.wait() for e in events]), 120)
            owners = _snapshot(replicas.owner)  # request id -> replica, as the kill lands
            os.kill(victim.proc.pid, signal.SIGKILL)
            ends = await asyncio.gather(*tasks)
            return owners, ends

    owners, ends = asyncio.run(main())
    held = list(owners.values())
    failed = [e for e in ends if e != "done"]
    assert held.count(0) >= 1 and held.count(1) >= 1, owners     # both replicas held some at the kill
    assert len(failed) <= held.count(0) and len(ends) - len(failed) >= held.count(1), (owners, ends)
    assert failed and all("replica 0" in e and "died" in e for e in failed), ends

    deadline = time.monotonic() + 240           # the replica's new process loads in the background
    while time.monotonic() < deadline:
        health = httpx.get(url + "/health").json()
        assert health["stages"]["llm"] == "ready"    # the other replica served all along
        if health["replicas"]["llm"] == ["ready", "ready"]:
            break
        time.sleep(0.5)
    assert health["replicas"]["llm"] == ["ready", "ready"], health
    assert victim.restarts == 1
    before = replicas.requests[0]
    out = [httpx.post(url + "/v1/completions", timeout=300, json={
        "model": "tiny", "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True}).json()
        for p in PROMPTS[:4]]
    assert [o["choices"][0]["text"] for o in out] == [reference[p] for p in PROMPTS[:4]]
    assert replicas.requests[0] > before        # the restarted replica takes requests again
    assert _metric(httpx.get(url + "/metrics").text, "replica_restarts_total", "0") == 1


# ---- start-up options (no processes) ----------------------------------------------------------------
def test_bad_scale_out_options_name_the_option_and_allowed_values():
    from omnistage.config import EngineConfig
    from omnistage.spec import StageSpec

    with pytest.raises(ValueError, match="num_replicas must be an integer >= 1"):
        EngineConfig(num_replicas=0)
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of mp, ray"):
        EngineConfig(distributed_executor_backend="slurm")
    with pytest.raises(ValueError, match="replica_devices must name one device per replica"):
        StageSpec("llm", "ar", "", EngineConfig(num_replicas=2), replica_devices=["cuda:0"])
    with pytest.raises(ValueError, match=r"ray keys must be among \['node_id', 'num_cpus', 'num_gpus', 'resources'\]"):
        StageSpec("llm", "ar", "", ray={"gpus": 1})
    assert StageSpec("llm", "ar", "", EngineConfig(num_replicas=2)).runner == "process"   # replicas are processes


def test_deploy_config_sets_replicas_per_stage(tiny_models):
    from omnistage.config import EngineConfig
    from omnistage.pipeline.build import detect_pipeline

    deploy = {"stages": {"llm": {"num_replicas": 2, "replica_devices": ["cpu", "cpu"],
                                 "ray": {"resources": {"node_b": 1}}}}}
    spec = detect_pipeline(tiny_models["llama"], EngineConfig(device="cpu"), deploy)
    llm = spec.stage("llm")
    assert (llm.engine.num_replicas, llm.replica_devices, llm.runner) == (2, ["cpu", "cpu"], "process")
    assert llm.ray == {"resources": {"node_b": 1}}
    with pytest.raises(ValueError, match="unknown keys"):
        detect_pipeline(tiny_models["llama"], EngineConfig(device="cpu"), {"stages": {"llm": {"replicas": 2}}})


def test_memory_plan_counts_every_replica_on_a_device(tiny_models):
    """Two replicas on one GPU each get a share that fits both; on two GPUs each keeps the whole."""
    from omnistage.config import EngineConfig
    from omnistage.pipeline.memory import plan_gpu_memory
    from omnistage.spec import PipelineSpec, StageSpec

    def llm(**kw):
        engine = EngineConfig(device="cuda:0", dtype="float32", num_kv_blocks=10**8, **kw)
        return PipelineSpec([StageSpec("llm", "ar", tiny_models["llama"], engine)])

    total = lambda device: 80 * 2**30
    two = plan_gpu_memory(llm(num_replicas=2), device_total=total).stage("llm").engine.gpu_memory_utilization
    assert 0.40 < two <= 0.45                   # half of 0.90 each, less nothing they do not share
    spread = dataclasses.replace(llm(num_replicas=2).stages[0], replica_devices=["cuda:0", "cuda:1"])
    planned = plan_gpu_memory(PipelineSpec([spread]), device_total=total).stage("llm")
    assert planned.engine.gpu_memory_utilization == 0.90


def test_serve_flags_reach_the_engine_options():
    from omnistage.entrypoints.cli import build_parser
    from omnistage.entrypoints.common import engine_kwargs_from_args

    args = build_parser().parse_args(["serve", "--num-replicas", "2", "--distributed-executor-backend", "ray",
                                      "--ray-address", "10.0.0.1:6379"])
    kwargs = engine_kwargs_from_args(args)
    assert (kwargs["num_replicas"], kwargs["distributed_executor_backend"], kwargs["ray_address"]) == \
        (2, "ray", "10.0.0.1:6379")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--distributed-executor-backend", "slurm"])


def test_ray_backend_without_ray_names_the_extra(monkeypatch):
    from omnistage.config import EngineConfig
    from omnistage.pipeline.launch import launcher_for
    from omnistage.spec import StageSpec

    monkeypatch.setitem(sys.modules, "ray", None)   # `import ray` fails as when it is not installed
    spec = StageSpec("llm", "ar", "", EngineConfig(device="cpu", distributed_executor_backend="ray"))
    with pytest.raises(RuntimeError, match=r"pip install 'omnistage\[ray\]'"):
        launcher_for(spec)
