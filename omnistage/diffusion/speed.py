"""Speed features of a diffusion stage, applied generically to a family (stage process; no model names).

In: a `DiffusionSpeed` (from the stage's `EngineConfig`: attention_backend, quantization,
ignored_layers, enforce_eager, enable_cpu_offload, enable_layerwise_offload) and a family, which
declares what the code reads: its component roles (`component_roles()`: "dit" / "text_encoder" /
"vae"), each DiT's repeated block lists (`repeated_blocks`) and, per block list, the groups of
linear layers that read the same input (`merged_projections`). `Accelerator(family, speed)` changes
the family's modules in place, in this order:
  0a. linear + GELU (`fuse_gelu`, on unless the DiT runs parallel or in FP8): the linear layer of each
     diffusers `GELU(approximate="tanh")` module (the feed-forwards' up-projections) runs as one GEMM
     with the GELU in its epilogue on CUDA (layers/linear_gelu.py; the same ops as before elsewhere).
     FLUX's single-block MLP projection stays in its merged q|k|v|mlp GEMM: on an H200 the merged
     GEMM (767 TFLOP/s) beats q|k|v and mlp apart (674) by more than the GELU epilogue gains.
  0. merged projections (`merge_projections`, on unless the DiT runs parallel): each declared group
     becomes one GEMM with a part in place of each member (layers/merged_linear.py; lossless). With
     FP8, a group with a member named in `ignored_layers` stays unmerged, so the ignored layer stays
     bf16 alone.
  1. FP8 (`quantization="fp8"`): every `nn.Linear` inside the DiTs' repeated blocks (merged ones
     included: one activation quantization for the whole group) becomes an `Fp8Linear`
     (layers/fp8_linear.py) unless its name contains one of `ignored_layers`; text encoders, VAE
     and the DiT's embedders / head stay in the model dtype.
  2. offload (diffusion/offload.py): model-level or layerwise.
  2b. step constants (`step_constants`): the DiT modules the family names in `step_constant_modules`
     (rotary tables: functions of the resolution alone) run once per compatibility key of a step's
     group (`StepConstants`, up to 8 keys kept) instead of once per step; the runner names the key.
  3. regional compile: each repeated block's `forward` goes through `torch.compile` (`dynamic`
     on by default: one compiled code object per block class, reused by every block of it and by every
     resolution and batch size; `compile_mode` = `diffusion_compile_mode`); module hooks (layerwise
     offload) stay outside the compiled code. On by default on CUDA, off with `enforce_eager=True`; the time of the first DiT forward (which compiles) is
     logged and kept in `first_denoise_s`.
  4. attention: each role's backend (diffusion/attention.py); "auto" for the DiT with
     `probe_attention` (CUDA) is the fastest lossless backend timed at load on the family's
     `attention_probe_shape()` (kept in `attention_probe`).
  5. step graphs (`step_graphs`, on by default on CUDA, off with `enforce_eager=True`): a `StepGraphs`
     for a family that declares `graph_inputs` / `denoise_inputs`, unless offload is on (weights move);
     the engine uses it only without a step cache and without parallel ranks. Lossless (the replayed
     step's latents equal the compiled call's exactly on an H200, session 13) and faster where the host
     limits: FLUX 512^2 49.9 -> 41.7 ms, FP8 1024^2 109.9 -> 106.7 ms (benchmarks/RESULTS.md).
Out: `accelerator.phase(name)` for name in PHASE_ROLES: the context the engine runs each phase in
(that role's weights on the device, its attention backend; diffusion/attention.py). Fused
elementwise work (AdaLN modulation + norm, gated residuals, rotary) comes from the compile of the
blocks (inductor fuses those pointwise chains into the neighbouring kernels; dit_bench shows it).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from omnistage.config import EngineConfig, attention_backends
from omnistage.diffusion.attention import AttentionRouter, ProbeResult, probe
from omnistage.diffusion.offload import LayerwiseOffload, ModelOffload
from omnistage.diffusion.step_graphs import StepGraphs
from omnistage.layers.fp8_linear import quantize_fp8
from omnistage.layers.linear_gelu import fuse_gelu
from omnistage.layers.merged_linear import merge_linears

log = logging.getLogger(__name__)

# engine phase -> the component role it runs
PHASE_ROLES = {"encode": "text_encoder", "prepare": "vae", "denoise": "dit", "decode": "vae"}


@dataclass
class DiffusionSpeed:
    attention: dict = field(default_factory=lambda: attention_backends("auto"))   # role -> backend name
    compile: bool = False                       # regional torch.compile of the DiTs' repeated blocks
    compile_backend: str = "inductor"           # torch.compile backend ("eager" / "aot_eager": CPU tests)
    compile_mode: str = "default"               # torch.compile mode (config.COMPILE_MODES)
    compile_dynamic: bool = True                # symbolic shapes: one compiled block for every resolution / batch
    probe_attention: bool = False               # "auto" DiT attention = the fastest lossless backend measured at load
    # (on CUDA unless the DiT runs parallel)
    quantization: Optional[str] = None          # None | "fp8"
    ignored_layers: tuple = ()                  # module-name parts FP8 leaves alone
    offload: Optional[str] = None               # None | "model" | "layerwise"
    merge_projections: bool = False             # one GEMM per group of the family's `merged_projections`
    fuse_gelu: bool = False                     # linear -> tanh GELU as one GEMM (layers/linear_gelu.py)
    step_graphs: bool = False                   # CUDA: denoiser calls replayed from graphs (step_graphs.py)
    step_constants: bool = False                # the family's `step_constant_modules` once per group key

    @classmethod
    def from_config(cls, config: EngineConfig) -> "DiffusionSpeed":
        """What a stage's (resolved) config asks for; compile and step graphs are on for CUDA unless
        enforce_eager, and off for a parallel DiT (its collectives and attention hooks run eagerly, diffusion/ranks.py);
        merged projections and step constants are on unless the DiT is parallel (its plans name the
        separate layers and split the rotary tables); the attention probe runs on CUDA for a DiT in one
        process (a parallel DiT's ranks would time, and might pick, differently: they keep DEFAULT_ATTENTION)."""
        parallel = config.parallel_config is not None and config.parallel_config.world_size > 1
        offload = "model" if config.enable_cpu_offload else "layerwise" if config.enable_layerwise_offload else None
        cuda = config.torch_device().type == "cuda"
        return cls(attention=attention_backends(config.attention_backend),
                   compile=cuda and not config.enforce_eager and not parallel,
                   compile_mode=config.diffusion_compile_mode, compile_dynamic=config.diffusion_compile_dynamic,
                   probe_attention=cuda and not parallel,
                   quantization=config.quantization, ignored_layers=tuple(config.ignored_layers), offload=offload,
                   merge_projections=not parallel, step_constants=not parallel,
                   fuse_gelu=not parallel and config.quantization is None,
                   step_graphs=cuda and not config.enforce_eager and not parallel)


def dit_blocks(family, name: str) -> dict[str, list[nn.Module]]:
    """ModuleList attribute -> its blocks, for the repeated block lists the family declares that
    DiT component `name` has."""
    module = family.c[name]
    return {attr: list(getattr(module, attr)) for attr in family.repeated_blocks
            if getattr(module, attr, None) is not None}


def merge_projections(family, groups: dict[str, list[nn.Module]], ignored: tuple = ()) -> int:
    """Merge the family's `merged_projections` groups in every block of `groups` (a DiT's
    `dit_blocks`), except groups with a member whose full name ("single_transformer_blocks.3.proj_mlp")
    contains one of `ignored`; returns the number of groups merged."""
    merged = 0
    for attr, blocks in groups.items():
        for i, block in enumerate(blocks):
            for group in family.merged_projections.get(attr, ()):
                if not any(part in f"{attr}.{i}.{name}" for name in group for part in ignored):
                    merged += merge_linears(block, group)
    return merged


class StepConstants:
    """Outputs of DiT modules that depend only on a step group's compatibility key (the family's
    `step_constant_modules`, e.g. FLUX's `pos_embed`, Wan's `rope`: rotary tables per resolution),
    computed once per key. `use(key)` is the context of one denoiser call (the runner opens it); outside
    it (another rank, a benchmark's direct call) the modules run as usual. The kept outputs are read,
    never written, by the blocks; the `size` most recent keys are kept."""

    def __init__(self, modules: list[nn.Module], size: int = 8):
        self.key = None                         # the compatibility key of the denoiser call running now
        self.outputs: OrderedDict = OrderedDict()   # (module index, key) -> its output
        self.size = size
        self.hits = 0                           # module calls answered from `outputs`
        self.num_modules = len(modules)
        for index, module in enumerate(modules):
            module.forward = self._cached(index, module.forward)

    def _cached(self, index: int, forward):
        def call(*args, **kwargs):
            if self.key is None:
                return forward(*args, **kwargs)
            k = (index, self.key)
            if k in self.outputs:
                self.hits += 1
                self.outputs.move_to_end(k)
                return self.outputs[k]
            out = self.outputs[k] = forward(*args, **kwargs)
            while len(self.outputs) > self.size * self.num_modules:
                self.outputs.popitem(last=False)
            return out
        return call

    @contextlib.contextmanager
    def use(self, key):
        self.key = key
        try:
            yield
        finally:
            self.key = None


def compile_blocks(blocks: list[nn.Module], backend: str = "inductor", mode: str = "default",
                   dynamic: bool = True) -> None:
    """Each block's forward through torch.compile; a block compiled before (a second engine on the
    same family: benchmarks) compiles its eager forward again rather than wrapping the compiled one."""
    for block in blocks:
        eager = block.__dict__.get("_eager_forward", block.forward)
        block._eager_forward = eager
        # mode "default" is passed as None: torch rejects `mode` together with a non-inductor backend
        block.forward = torch.compile(eager, dynamic=dynamic, backend=backend,
                                      mode=None if mode == "default" else mode)


class Accelerator:
    def __init__(self, family, speed: DiffusionSpeed):
        self.speed, self.device = speed, family.device
        roles = family.component_roles()
        dits = [name for name, role in roles.items() if role == "dit"]
        groups = {name: dit_blocks(family, name) for name in dits}
        self.fused_gelus = 0                    # linear layers whose tanh GELU runs in their GEMM
        if speed.fuse_gelu:
            self.fused_gelus = sum(fuse_gelu(b) for name in dits for blocks in groups[name].values() for b in blocks)
            log.info("linear + GELU: %d linear layers with the GELU in the GEMM", self.fused_gelus)
        self.merged_groups = 0                  # groups of linear layers merged into one GEMM
        if speed.merge_projections:
            ignored = speed.ignored_layers if speed.quantization == "fp8" else ()
            self.merged_groups = sum(merge_projections(family, groups[name], ignored) for name in dits)
            log.info("merged projections: %d groups of linear layers run as one GEMM each", self.merged_groups)
        self.constants: Optional[StepConstants] = None  # step constants (None: off, or nothing declared)
        if speed.step_constants:
            modules = [family.c[name].get_submodule(m) for name in dits for m in family.step_constant_modules]
            self.constants = StepConstants(modules) if modules else None
        self.fp8_layers = 0                     # linear layers swapped for Fp8Linear
        if speed.quantization == "fp8":
            for name in dits:
                for attr, blocks in groups[name].items():
                    self.fp8_layers += sum(quantize_fp8(b, speed.ignored_layers, f"{attr}.{i}.")
                                           for i, b in enumerate(blocks))
            log.info("fp8: %d linear layers of the DiT blocks quantized (ignored_layers=%s)", self.fp8_layers,
                     list(speed.ignored_layers))
        self.model_offload: Optional[ModelOffload] = None
        self.layerwise: Optional[LayerwiseOffload] = None
        if speed.offload == "model":
            self.model_offload = ModelOffload({role: [family.c[n] for n, r in roles.items() if r == role]
                                               for role in ("text_encoder", "dit")}, self.device)
            copies = [c for cs in self.model_offload.copies.values() for c in cs]
        elif speed.offload == "layerwise":
            self.layerwise = LayerwiseOffload([[b for blocks in groups[n].values() for b in blocks] for n in dits],
                                              self.device)
            copies = self.layerwise.copies
        if speed.offload is not None:           # what is not offloaded lives on the device
            offloaded = {id(t) for c in copies for t, _ in c.tensors}
            for name in roles:
                module = family.c[name]
                for t in list(module.parameters()) + list(module.buffers()):
                    if id(t) not in offloaded:
                        t.data = t.data.to(self.device)
        self.compiled_blocks = 0                # blocks whose forward is compiled
        if speed.compile:
            for name in dits:
                for blocks in groups[name].values():
                    compile_blocks(blocks, speed.compile_backend, speed.compile_mode, speed.compile_dynamic)
                    self.compiled_blocks += len(blocks)
            log.info("regional torch.compile (dynamic=%s, mode %s, backend %s) of %d repeated blocks",
                     speed.compile_dynamic, speed.compile_mode, speed.compile_backend, self.compiled_blocks)
        self.attention_probe: Optional[ProbeResult] = None   # what "auto" DiT attention measured (None: no probe)
        attention = dict(speed.attention)
        if speed.probe_attention and attention.get("dit") == "auto":
            shape = family.attention_probe_shape()
            if shape is not None:
                self.attention_probe = probe(shape, family.dtype, self.device)
                attention["dit"] = self.attention_probe.choice
        self.routers = {role: AttentionRouter(name, self.device) for role, name in attention.items()}
        log.info("diffusion attention: %s%s", {role: r.name for role, r in self.routers.items()},
                 " (dit: measured at load)" if self.attention_probe is not None else "")
        self.first_denoise_s: Optional[float] = None    # seconds of the first DiT forward (compiles, if on)
        self.graphs: Optional[StepGraphs] = None        # whole denoiser calls as CUDA graphs (None: off)
        if (speed.step_graphs and self.device.type == "cuda" and speed.offload is None
                and hasattr(family, "graph_inputs")):
            self.graphs = StepGraphs(self.device)

    def info(self) -> dict:
        """What the speed features did, for the stage's info (`DiffusionEngine.speed_info`)."""
        return {"attention": {role: r.name for role, r in self.routers.items()},
                "attention_probe": self.attention_probe.as_dict() if self.attention_probe is not None else None,
                "compiled_blocks": self.compiled_blocks,
                "compile": {"mode": self.speed.compile_mode, "dynamic": self.speed.compile_dynamic,
                            "backend": self.speed.compile_backend} if self.compiled_blocks else None,
                "merged_groups": self.merged_groups, "fused_gelus": self.fused_gelus, "fp8_layers": self.fp8_layers,
                "step_graphs": self.graphs is not None,
                "offload": self.speed.offload, "first_denoise_s": self.first_denoise_s}

    @contextlib.contextmanager
    def phase(self, name: str):
        role = PHASE_ROLES[name]
        if self.model_offload is not None:
            self.model_offload.use([role])
        router = self.routers.get(role)
        start = time.perf_counter()
        with router if router is not None else contextlib.nullcontext():
            yield
        if name == "denoise" and self.first_denoise_s is None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.first_denoise_s = time.perf_counter() - start
            log.info("first DiT forward took %.2f s%s", self.first_denoise_s,
                     " (includes the regional compile)" if self.speed.compile else "")
