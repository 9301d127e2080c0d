"""How the stages that share a GPU split its memory (entry point's process, at start-up; no GPU work).

In: a `PipelineSpec` (`detect_pipeline`'s: deploy config applied, each stage's EngineConfig
resolved; a spec built by hand is resolved here the same way, for reading only) and the stages
whose `gpu_memory_utilization` the user set (`pinned`). Out: a new spec in which each stage on a
shared CUDA device carries its OWN planned share of that device in `engine.gpu_memory_utilization`.
The AR engine reads its share as "KV budget = share x total - its measured peak (weights + a
largest step) - CUDA_CONTEXT_BYTES" (`ar/engine.py`); codec and diffusion stages get a share too,
for the log (they size no cache).

Per CUDA device, with U the pipeline-level `gpu_memory_utilization` (that of the device's first
unpinned stage in pipeline order: the main stage's, unless it is elsewhere or pinned):

    total x U  -  reserves: pinned stages' shares; the entry point's process when it uses the device
                  (its CUDA context, and the chat renderer's weights + WORKSPACE_BYTES when the main
                  stage is there)
               -  each planned stage's fixed cost: its process's CUDA context (runner "process"), its
                  weights, and an activation estimate (AR) or a workspace (codec, diffusion)
               =  what the AR stages' KV caches share, in proportion to how much KV each can use.

Weights are counted from the safetensors headers (no tensor is read) at the dtype the stage runs
in: its resolved `engine.dtype` (a codec's `memory.weights_dtype`, else as stored). Activations
and contexts are estimates; the AR engine measures its real peak and caps its KV at what the
device really has free, so an estimate that is off costs KV blocks, not a crash.
A device holding one stage and no renderer keeps that stage's setting as it is. A stage with
`num_replicas` > 1 counts once per replica on each device its replicas use (`replica_devices`, else
all on its device); its share is one replica's (the smallest, when its devices differ).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from omnistage.config import CUDA_CONTEXT_BYTES, concrete_device, dtype_by_name
from omnistage.pipeline.build import resolve_stage
from omnistage.spec import PipelineSpec, StageSpec

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

GiB = 2**30
WORKSPACE_BYTES = GiB                           # activations of a codec / diffusion step, or of the chat renderer


def safetensors_header(path: str) -> dict[str, dict]:
    """tensor name -> {"dtype", "shape", "data_offsets"} of a .safetensors file, from its header only."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def _weight_files(model_dir: str) -> list[str]:
    """The safetensors a stage loads: the checkpoint's shards, or every sub-folder's of a diffusers folder."""
    from omnistage.models.loader import safetensors_files

    if not os.path.exists(os.path.join(model_dir, "model_index.json")):
        return safetensors_files(model_dir)
    files = []
    for root, _, names in os.walk(model_dir):
        for name in names:
            # `x.fp16.safetensors` is a variant of `x.safetensors`; from_pretrained loads the plain one
            plain = name.split(".")[0] + ".safetensors"
            if name.endswith(".safetensors") and (name == plain or plain not in names):
                files.append(os.path.join(root, name))
    return sorted(files)


def weight_bytes(model_dir: str, prefixes: Optional[tuple[str, ...]] = None,
                 dtype: Optional["torch.dtype"] = None) -> int:
    """Bytes the tensors whose names start with one of `prefixes` (None: all) take once loaded:
    floating tensors at `dtype` (None: as stored), others as stored. A `load_format="dummy"` folder's
    are counted from the checkpoint's shapes (`models/dummy.py`)."""
    from omnistage.models import dummy

    total = 0
    if dummy.is_dummy(model_dir):
        for name, (shape, stored) in dummy.checkpoint_shapes(model_dir).items():
            if prefixes is None or name.startswith(prefixes):
                total += math.prod(shape) * (dtype if dtype and stored.is_floating_point else stored).itemsize
        return total
    for path in _weight_files(model_dir):
        for name, info in safetensors_header(path).items():
            if prefixes is None or name.startswith(prefixes):
                begin, end = info["data_offsets"]
                floating = info["dtype"].startswith(("F", "BF"))
                total += (math.prod(info["shape"]) * dtype.itemsize) if floating and dtype else end - begin
    return total


def offloaded_weight_bytes(stage: StageSpec, dtype) -> int:
    """Weights a diffusion stage with CPU offload keeps on the device at once (diffusion/speed.py):
    model-level: the larger of its text encoders and its DiTs, + the rest (VAE); layerwise: all but
    the DiTs' repeated blocks, + two blocks of each DiT (one running, one prefetched)."""
    from omnistage.models.registry import diffusion_family

    family = diffusion_family(stage.model_dir)
    with open(os.path.join(stage.model_dir, "model_index.json"), encoding="utf-8") as f:
        subs = [k for k, v in json.load(f).items() if isinstance(v, list) and os.path.isdir(
            os.path.join(stage.model_dir, k))]
    sizes = {k: weight_bytes(os.path.join(stage.model_dir, k), None, dtype) for k in subs
             if any(n.endswith(".safetensors") for n in os.listdir(os.path.join(stage.model_dir, k)))}
    subs = list(sizes)
    dits = {k for k in subs if k in family.dit_components}
    encoders = {k for k in subs if k.startswith(("text_encoder", "image_encoder"))}
    rest = sum(v for k, v in sizes.items() if k not in dits | encoders)
    if stage.engine.enable_cpu_offload:
        return rest + max(sum(sizes[k] for k in encoders), sum(sizes[k] for k in dits))
    resident = rest + sum(sizes[k] for k in encoders)
    for k in dits:
        path = os.path.join(stage.model_dir, k)
        names = {n for f in _weight_files(path) for n in safetensors_header(f)}
        block_ids = {".".join(n.split(".")[:2]) + "." for n in names
                     if n.split(".")[0] in family.repeated_blocks and n.split(".")[1].isdigit()}
        per_block = [weight_bytes(path, (b,), dtype) for b in block_ids]
        resident += sizes[k] - sum(per_block) + 2 * max(per_block, default=0)
    return resident


@dataclass
class StageCost:
    context: int                                # CUDA context of the stage's own process (runner "process")
    weights: int                                # weights at the dtype the stage runs in
    work: int                                   # activation estimate (AR) or workspace (codec, diffusion)
    kv_demand: int = 0                          # KV bytes the AR stage can use at most (0: no KV cache)

    @property
    def fixed(self) -> int:
        return self.context + self.weights + self.work


def _prefixes(stage: StageSpec) -> Optional[tuple[str, ...]]:
    p = stage.memory.get("weights_prefix")
    return None if p is None else (p,) if isinstance(p, str) else tuple(p)


def _weights_dtype(stage: StageSpec) -> Optional["torch.dtype"]:
    """The dtype a resolved stage's floating weights take once loaded (None: as stored)."""
    if stage.kind != "codec":
        return stage.engine.torch_dtype()
    # a codec back end may compute in its own dtype, whatever its config says (`memory.weights_dtype`)
    name = stage.memory.get("weights_dtype")
    return None if name is None else dtype_by_name(name, f"stage {stage.name!r}: memory.weights_dtype")


def stage_cost(stage: StageSpec, device: str) -> StageCost:
    """A stage's memory on `device` (a "cuda:N" string) apart from its KV share (see the module
    docstring), with its config resolved there as the stage's engine resolves it."""
    stage = resolve_stage(dataclasses.replace(stage, engine=dataclasses.replace(stage.engine, device=device)))
    dtype = _weights_dtype(stage)
    context = CUDA_CONTEXT_BYTES if stage.runner == "process" else 0
    weights = weight_bytes(stage.model_dir, _prefixes(stage), dtype) if stage.model_dir else 0
    if stage.kind == "diffusion" and stage.model_dir and (stage.engine.enable_cpu_offload
                                                          or stage.engine.enable_layerwise_offload):
        weights = offloaded_weight_bytes(stage, dtype)
    if stage.kind != "ar":
        return StageCost(context, weights, int(stage.memory.get("workspace_bytes", WORKSPACE_BYTES)))
    shape = stage.memory.get("lm_shape")
    if shape is None:
        from omnistage.models.loader import lm_shape, load_config

        shape = lm_shape(load_config(stage.model_dir))
    e, size = stage.engine, dtype.itemsize
    # Under tensor parallelism this device holds rank 0's shard: 1/N of the weights and of the MLP's
    # activations, and its KV heads (at least one, parallel/tensor.py); ranks 1..N-1 hold the next devices.
    tp = e.tensor_parallel_size
    weights //= tp
    kv_heads = max(shape["kv_heads"] // tp, 1)
    # A largest step's activations, twice for the allocator's slack, plus fp32 logits of every
    # sequence; an estimate: the engine measures its real peak before it sizes its KV.
    tokens = min(e.max_num_batched_tokens, 8192)
    work = tokens * (4 * shape["hidden"] + 2 * shape["intermediate"] // tp) * size * 2 + e.max_num_seqs * shape["vocab"] * 4
    # as many blocks as the engine would ever use (`AREngine._num_kv_blocks`)
    blocks = e.num_kv_blocks if e.num_kv_blocks is not None else e.kv_blocks_wanted(shape["max_positions"])
    per_token = 2 * shape["layers"] * kv_heads * shape["head_dim"] * size
    return StageCost(context, weights, work, blocks * e.block_size * per_token)


def _replica_devices(stage: StageSpec) -> list[str]:
    """The device of each of the stage's replicas ("cpu" | "cuda:N")."""
    return [concrete_device(d) for d in (stage.replica_devices or [stage.engine.device] * stage.engine.num_replicas)]


def replicas_on(stage: StageSpec, device: str) -> int:
    """How many of the stage's replicas run on `device`."""
    return _replica_devices(stage).count(device)


def _times(cost: StageCost, n: int) -> StageCost:
    return StageCost(cost.context * n, cost.weights * n, cost.work * n, cost.kv_demand * n)


def split_kv(pool: int, demands: dict[str, int]) -> dict[str, int]:
    """`pool` split in proportion to `demands`, none above its demand. (With proportional shares
    every stage reaches its cap at the same pool size, so there is nothing left to re-distribute.)"""
    want = sum(demands.values())
    scale = 1.0 if want <= pool else pool / want
    return {name: int(d * scale) for name, d in demands.items()}


def _cuda_total(device: str) -> int:
    import torch

    return torch.cuda.get_device_properties(torch.device(device)).total_memory


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _renderer_on(spec: PipelineSpec, stages: list[StageSpec]) -> bool:
    """Whether the chat renderer loads weights on the device of `stages` (the main stage's)."""
    return bool(spec.renderer_weights) and spec.main_stage.name in {s.name for s in stages}


def _plan_device(device: str, stages: list[StageSpec], spec: PipelineSpec, pinned: frozenset[str],
                 total: int) -> dict[str, float]:
    """stage name -> its share of `device` for the unpinned `stages` on it."""
    free = [s for s in stages if s.name not in pinned]
    if not free:
        return {}
    util = free[0].engine.gpu_memory_utilization
    reserves = {f"{s.name} (pinned)": int(s.engine.gpu_memory_utilization * total)
                for s in stages if s.name in pinned}
    renderer = _renderer_on(spec, stages)
    if renderer or any(s.runner != "process" for s in stages):
        reserves["entry point's CUDA context"] = CUDA_CONTEXT_BYTES
    if renderer:                                # in the main stage's dtype (`OmniChatRenderer`)
        main = next(s for s in stages if s.name == spec.main_stage.name)
        reserves["chat renderer"] = WORKSPACE_BYTES + weight_bytes(
            main.model_dir, tuple(spec.renderer_weights), main.engine.torch_dtype())
    copies = {s.name: replicas_on(s, device) for s in free}
    costs = {s.name: _times(stage_cost(s, device), copies[s.name]) for s in free}
    left = int(total * util) - sum(reserves.values()) - sum(c.fixed for c in costs.values())
    described = [f"{n} {_gib(c.fixed)} (weights {_gib(c.weights)}, activations {_gib(c.work)}, "
                 f"context {_gib(c.context)})" for n, c in costs.items()]
    described += [f"{label} {_gib(b)}" for label, b in reserves.items()]
    if left < 0:
        raise ValueError(
            f"{device}: the stages do not fit in gpu_memory_utilization {util} x {_gib(total)}; estimates: "
            f"{'; '.join(described)}. Set a stage's own share in the deploy config (`stages: {{NAME: "
            f"{{gpu_memory_utilization: F}}}}`), raise gpu_memory_utilization, or put fewer or smaller stages "
            f"on {device}")
    kv = split_kv(left, {n: c.kv_demand for n, c in costs.items() if c.kv_demand})
    # The AR engine takes a CUDA context off its share wherever it runs; a stage in the entry point's process
    # (inline, shared) uses that process's context, already reserved above, so its share carries it back.
    back = {s.name: CUDA_CONTEXT_BYTES if s.runner != "process" else 0 for s in free}
    shares = {n: min(1.0, (c.fixed + kv.get(n, 0) + back[n]) / copies[n] / total) for n, c in costs.items()}
    logger.info("GPU memory plan of %s (%s x %s): %s; KV: %s; fixed: %s", device, _gib(total), util,
                ", ".join(f"{n} {v:.3f}" for n, v in shares.items()),
                ", ".join(f"{n} {_gib(b)} of {_gib(costs[n].kv_demand)} wanted" for n, b in kv.items()) or "none",
                "; ".join(described))
    return shares


def plan_gpu_memory(spec: PipelineSpec, pinned: frozenset[str] = frozenset(),
                    device_total: Optional[Callable[[str], int]] = None) -> PipelineSpec:
    """`spec` with each stage on a shared CUDA device given its own share of it (module docstring).

    `pinned`: stages whose `gpu_memory_utilization` the user set (kept, and reserved for them).
    `device_total(device) -> bytes` of a "cuda:N" device (default: torch's device properties)."""
    device_total = device_total or _cuda_total
    by_device: dict[str, list[StageSpec]] = {}
    for s in map(resolve_stage, spec.stages):   # unchanged when they come from detect_pipeline
        for dev in dict.fromkeys(_replica_devices(s)):
            if dev != "cpu":
                by_device.setdefault(dev, []).append(s)
    shares: dict[str, float] = {}
    for dev, stages in by_device.items():
        if len(stages) > 1 or _renderer_on(spec, stages) or replicas_on(stages[0], dev) > 1:
            for name, share in _plan_device(dev, stages, spec, pinned, device_total(dev)).items():
                shares[name] = min(share, shares.get(name, 1.0))
    stages = [dataclasses.replace(s, engine=dataclasses.replace(s.engine, gpu_memory_utilization=shares[s.name]))
              if s.name in shares else s for s in spec.stages]
    return dataclasses.replace(spec, stages=stages)
