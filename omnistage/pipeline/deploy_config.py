"""`--deploy-config FILE.yaml`: overrides of a detected pipeline (entry point's process, at start-up).

In: a YAML file (or an already parsed dict) and the `PipelineSpec` the registry picked. Out: a new
`PipelineSpec` with the overrides applied; `detect_pipeline` applies them before it resolves each
stage's EngineConfig, so an overridden `device: auto` / `dtype: auto` is resolved like any other.
Only what the file names changes:

```yaml
stage_layout: shared        # every stage's runner at once (inline | shared | process); a stage's runner wins
stages:
  llm:                      # a stage of the detected pipeline, by name
    device: cuda:0          # any EngineConfig field: device, dtype, max_num_seqs, num_kv_blocks, ...
    max_num_seqs: 64
    tensor_parallel_size: 2             # AR stage split over cuda:0 and cuda:1 (ranks: ar/tensor_parallel.py)
    gpu_memory_utilization: 0.5         # this stage's own share of its GPU, kept as given ("pinned");
                                        # unset, stages sharing a GPU get planned shares (pipeline/memory.py)
    params: {temperature: 0.7}          # default request params of the stage (merged)
  tts:
    device: cpu
    runner: process                     # its own process (default: inline, in the orchestrator's;
                                        # shared: there too, on a CUDA stream of its own)
    priority: 1                         # runner shared: its GPU work first (a high-priority CUDA stream)
    num_replicas: 2                     # two copies, each its own process; requests go to the least loaded
    # replica_devices: [cuda:0, cuda:1] # one device per replica (default: all on `device`)
    # distributed_executor_backend: ray # the stage's processes as Ray actors (`ray_address`: the cluster)
    # ray: {resources: {node_b: 1}, num_gpus: 1}   # what each actor holds: places it on a node (spec.RAY_KEYS)
    options:                            # back-end settings (merged)
      max_batch_sentences: 4
      voices: {joe-slow: {voice: joe, length_scale: 1.3}}
  # talker: {enabled: false}            # drop a stage and its edges
edges:
  - {src: llm, dst: tts, chunk_size: 2, first_chunk_size: 1}   # null chunk_size = whole output
  # - {src: thinker, dst: talker, options: {default_voice: Ethan}}  # edge-adapter settings (merged)
```
Unknown stages, edges and keys are errors that name the allowed values.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

from omnistage.config import EngineConfig
from omnistage.spec import RUNNERS, PipelineSpec, StageSpec

_ENGINE_KEYS = {f.name for f in dataclasses.fields(EngineConfig)}
_STAGE_KEYS = {"options", "params", "memory", "enabled", "final_output", "model_dir", "runner", "priority",
               "replica_devices", "ray"}
_EDGE_KEYS = {"src", "dst", "chunk_size", "first_chunk_size", "adapter", "options"}


def load_deploy_config(path: str) -> dict[str, Any]:
    import yaml

    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a deploy config is a mapping with `stages` and/or `edges`")
    return data


def _load(config: Union[str, dict[str, Any]]) -> dict[str, Any]:
    return load_deploy_config(config) if isinstance(config, str) else dict(config)


def _stage_overrides(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    stages = data.get("stages") or {}
    if isinstance(stages, list):                # also accept a list of {name: ..., ...}
        stages = {s["name"]: {k: v for k, v in s.items() if k != "name"} for s in stages}
    if not isinstance(stages, dict):
        raise ValueError("deploy config `stages` must map stage names to settings")
    return stages


def apply_deploy_config(spec: PipelineSpec, config: Union[str, dict[str, Any], None]) -> PipelineSpec:
    if config is None:
        return spec
    data = _load(config)
    unknown = set(data) - {"stages", "edges", "stage_layout"}
    if unknown:
        raise ValueError(f"deploy config: unknown top-level keys {sorted(unknown)}; "
                         "allowed: ['edges', 'stage_layout', 'stages']")
    layout = data.get("stage_layout")
    if layout is not None and layout not in RUNNERS:
        raise ValueError(f"deploy config: stage_layout must be one of {', '.join(RUNNERS)}; got {layout!r}")
    names = [s.name for s in spec.stages]
    overrides = _stage_overrides(data)
    stages: list[StageSpec] = []
    for name, over in overrides.items():
        if name not in names:
            raise ValueError(f"deploy config: stage must be one of {names}, got {name!r}")
        bad = set(over or {}) - _ENGINE_KEYS - _STAGE_KEYS
        if bad:
            raise ValueError(f"deploy config: stages.{name} has unknown keys {sorted(bad)}; allowed: "
                             f"{sorted(_ENGINE_KEYS | _STAGE_KEYS)}")
    for s in spec.stages:
        over = dict(overrides.get(s.name) or {})
        if over.pop("enabled", True) is False:
            continue
        engine = dataclasses.replace(s.engine, **{k: over.pop(k) for k in list(over) if k in _ENGINE_KEYS})
        options = {**s.options, **(over.pop("options", None) or {})}
        params = {**s.params, **(over.pop("params", None) or {})}
        memory = {**s.memory, **(over.pop("memory", None) or {})}
        if layout is not None:
            over.setdefault("runner", layout)
        stages.append(dataclasses.replace(s, engine=engine, options=options, params=params, memory=memory, **over))
    kept = {s.name for s in stages}
    if spec.main_stage.name not in kept:
        raise ValueError(f"deploy config: the main stage {spec.main_stage.name!r} cannot be disabled")
    edges = [e for e in spec.edges if e.src in kept and e.dst in kept]
    for item in data.get("edges") or []:
        bad = set(item) - _EDGE_KEYS
        if bad or "src" not in item or "dst" not in item:
            raise ValueError(f"deploy config: an edge needs src and dst and may set {sorted(_EDGE_KEYS - {'src', 'dst'})}; "
                             f"got {item}")
        match = [i for i, e in enumerate(edges) if (e.src, e.dst) == (item["src"], item["dst"])]
        if not match:
            raise ValueError(f"deploy config: edge must be one of {[f'{e.src}->{e.dst}' for e in edges]}, "
                             f"got {item['src']}->{item['dst']}")
        changes = {k: v for k, v in item.items() if k not in ("src", "dst")}
        if "options" in changes:                # merged, like stage options
            changes["options"] = {**edges[match[0]].options, **(changes["options"] or {})}
        if changes.get("chunk_size", edges[match[0]].chunk_size) is None:
            changes["first_chunk_size"] = None
        edges[match[0]] = dataclasses.replace(edges[match[0]], **changes)
    return dataclasses.replace(spec, stages=stages, edges=edges)   # keeps model, renderer_weights


def pinned_stages(config: Union[str, dict[str, Any], None]) -> frozenset[str]:
    """Stages whose `gpu_memory_utilization` the deploy config sets: the memory plan keeps their share."""
    if config is None:
        return frozenset()
    return frozenset(name for name, over in _stage_overrides(_load(config)).items()
                     if "gpu_memory_utilization" in (over or {}))
