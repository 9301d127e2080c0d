"""Engine configuration: one small dataclass tree built once and passed explicitly (any process).

In: what the user tunes (batch limits, KV pool size, device, dtype; "auto" allowed for the last
two). Out: per stage, `EngineConfig.resolved(kind, checkpoint_dtype)`, a copy with a concrete
device ("cpu" | "cuda:N") and dtype name, the one rule for both (`_auto_dtype`). The entry point
resolves each stage's config once (`pipeline/build.py`); the memory planner, the engines and the
chat renderer read the resolved values (`torch_device()`, `torch_dtype()`). Engines built directly
(tests, benchmarks) resolve the config they are given the same way; resolving again changes nothing.
The AR engine derives the rest (block count) from it and the checkpoint's config.
`DiffusionParallelConfig` (vLLM-Omni's names: Ulysses / Ring sequence parallel, CFG-parallel, DiT
tensor parallel) is the diffusion stage's `parallel_config`; its sizes are checked here, the model-
dependent rules (heads, families) where the engine starts (`parallel/plan.py`).
Also defined here, once: the diffusion step-cache backends and their settings (`CACHE_BACKENDS`,
checked by `cache_config_problem`), read at start-up (EngineConfig), per request (the diffusion
engine) and by `diffusion/step_cache.py`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch

# torch is imported only where a device or dtype is resolved, so that control-plane processes
# (stage clients, the API server's argument parsing) start without paying for it.
_DTYPES = ("float32", "bfloat16", "float16")
STAGE_KINDS = ("ar", "diffusion", "codec")      # what a stage is (spec.StageSpec.kind; its rules resolve here)
CUDA_CONTEXT_BYTES = 2**29                      # CUDA context + torch kernels of one process on one GPU (estimate)
CPU_KV_FULL_SEQUENCES = 2                       # CPU KV pool: room for this many sequences of max_model_len ...
CPU_KV_FLOOR_BYTES = 2**28                      # ... or 256 MiB, whichever is larger (EngineConfig.cpu_kv_blocks)

# Diffusion attention backends (vLLM-Omni's names; lower-case short names accepted) and the roles
# they are chosen for: "dit" = the denoiser's self / joint (and cross) attention, "text_encoder" =
# the prompt (and image) encoders. Lossless: the SDPA kernels and FlexAttention; SAGE_ATTN is the
# opt-in lossy 8-bit one (INT8 QK^T, layers/quant_attention.py).
ATTENTION_BACKENDS = ("auto", "TORCH_SDPA", "FLASH_ATTN", "EFFICIENT_ATTN", "CUDNN_ATTN", "MATH_ATTN", "FLEX_ATTN",
                      "SAGE_ATTN")
ATTENTION_ALIASES = {"sdpa": "TORCH_SDPA", "flash": "FLASH_ATTN", "efficient": "EFFICIENT_ATTN",
                     "cudnn": "CUDNN_ATTN", "math": "MATH_ATTN", "flex": "FLEX_ATTN", "sage": "SAGE_ATTN"}
ATTENTION_ROLES = ("dit", "text_encoder")
# What "auto" means per device type: THE place to change the default. On the H200 cuDNN's SDPA was
# the fastest lossless kernel (619 vs 355 TFLOP/s for flash at 32k tokens, shared/reference/ENVIRONMENT.md;
# benchmarks/dit_bench.py re-measures it); where cuDNN cannot run a shape, SDPA falls back to flash.
DEFAULT_ATTENTION = {"cuda": "CUDNN_ATTN", "cpu": "TORCH_SDPA"}
QUANTIZATIONS = (None, "fp8")
# `diffusion_compile_mode` (torch.compile's `mode` for the DiT's repeated blocks; vLLM-Omni's name). Modes
# with CUDA graphs are left out: a block's graph would pin its shapes and the step-level batch changes them
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
EXECUTOR_BACKENDS = ("mp", "ray")
LOAD_FORMATS = ("auto", "dummy")                # `load_format` (vLLM's): read the safetensors | draw random weights               # `distributed_executor_backend`: local processes | Ray actors


@dataclass
class EngineConfig:
    device: str = "auto"                        # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"                         # "auto" | "float32" | "bfloat16" | "float16"
    max_num_seqs: int = 256                     # sequences per step at most
    max_num_batched_tokens: int = 8192          # tokens per step at most (prefill chunks + decodes)
    max_model_len: Optional[int] = None         # prompt + output tokens; None = the model's limit
    block_size: int = 16                        # tokens per KV block
    num_kv_blocks: Optional[int] = None         # KV pool size; None = derived from free memory
    gpu_memory_utilization: float = 0.90        # fraction of the GPU this stage may take (weights, activations,
    # KV, its CUDA context); stages sharing a GPU get planned shares of this (pipeline/memory.py)
    cpu_kv_cache_gb: float = 2.0                # CPU: most GiB the KV pool takes when num_kv_blocks is None (it is
    # sized from what the model needs first: `cpu_kv_blocks`)
    enable_prefix_caching: bool = True          # share full KV blocks across requests by content
    seed: int = 0                               # seed of the generator used by unseeded requests
    cpu_threads: Optional[int] = None           # torch intra-op threads on CPU; None = cores - 1 (>= 1)
    cuda_graphs: bool = True                    # capture decode steps on CUDA
    prefill_cuda_graphs: bool = True            # AR, with cuda_graphs: also capture short prefill-only steps (token
    # buckets 16, 32, ... up to max_prefill_graph_tokens, at most 8 chunks; ar/prefill_graphs.py); False: they run eager
    max_prefill_graph_tokens: int = 512         # rows of the largest prefill graph (at most max_num_batched_tokens)
    load_format: str = "auto"                   # LOAD_FORMATS: "auto" reads the folder's safetensors; "dummy" draws
    # random weights of the checkpoint's shapes on the device (no weight file read; models/dummy.py): benchmarks
    default_max_tokens: Optional[int] = None    # AR: answer cap of a request that gives no max_tokens (the model's
    # generation_config.json max_new_tokens, or --override-generation-config), at most the room left; None = up to
    # max_model_len
    async_scheduling: bool = True               # AR: queue step N+1 before reading step N's ids (ar/engine.py)
    tensor_parallel_size: int = 1               # AR: ranks (processes, one device each) the model is split over
    # (ar/tensor_parallel.py); must divide the attention heads; on CPU the ranks talk over gloo
    # -- diffusion: step cache and VAE (vLLM-Omni's names; the tables below define them) --
    cache_backend: Optional[str] = None         # None | "tea_cache" | "cache_dit" (CACHE_BACKENDS)
    cache_config: Optional[dict] = None         # server-wide cache settings (CACHE_BACKENDS keys);
    # a request's DiffusionParams.cache_config overrides them key by key
    vae_use_tiling: bool = False                # decode every image / video with diffusers' VAE tiling
    # -- end of the step cache and VAE options --

    # -- diffusion speed: attention, compile, FP8, offload (vLLM-Omni's names; diffusion/speed.py applies them) --
    attention_backend: Any = "auto"             # one name for every role, "role=NAME,role=NAME" or a
    # {role: name} dict; roles ATTENTION_ROLES, names ATTENTION_BACKENDS (case-insensitive; "auto": the
    # device's fastest lossless backend: on CUDA measured at load for the DiT's shape, diffusion/attention.py
    # `probe`; elsewhere, and for the text encoders, DEFAULT_ATTENTION)
    quantization: Optional[str] = None          # None | "fp8": online FP8 weights (one scale per output row) of the
    # DiT blocks' linear layers, or of an AR decoder's layers' qkv / o / gate_up / down (embeddings, lm_head stay)
    ignored_layers: tuple = ()                  # module-name parts FP8 leaves in the model dtype (e.g. "img_mlp",
    # or for an AR stage "o_proj", "layers.0.")
    enforce_eager: bool = False                 # True: no regional torch.compile of the DiT's blocks, no step graphs
    diffusion_compile_mode: str = "default"     # torch.compile mode of those blocks (COMPILE_MODES)
    diffusion_compile_dynamic: bool = True      # compile them over symbolic shapes (mixed resolutions and batch
    # sizes reuse one compiled block); False specializes per shape (recompiles per new resolution / batch)
    enable_cpu_offload: bool = False            # model-level: text encoder / DiT / VAE take turns on the GPU
    enable_layerwise_offload: bool = False      # DiT blocks live in pinned CPU memory; one runs, the next prefetches
    # -- diffusion parallelism (vLLM-Omni's DiffusionParallelConfig; a dict is accepted and converted) --
    parallel_config: Optional["DiffusionParallelConfig"] = None   # None: one process, one device

    # -- scale-out: stage replicas and placement (pipeline/replicas.py, pipeline/launch.py) --
    num_replicas: int = 1                       # copies of the stage, each in its own process; a new request goes
    # to the least-loaded one, its later pieces and aborts to the same one
    distributed_executor_backend: str = "mp"    # where stage processes run (EXECUTOR_BACKENDS): "mp" = this host,
    # "ray" = Ray actors of a cluster, with the resources the deploy config's `ray:` asks for
    ray_address: str = "auto"                   # the Ray cluster joined (`ray.init(address=...)`); "auto" = the one
    # this host's `ray start` runs
    ray_placement: Optional[dict] = None        # the stage's `ray:` settings (StageSpec.ray), set by the Ray
    # launcher: what each parallel rank 1..N-1's actor asks for too (None: 1 CPU, and 1 GPU on CUDA)

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", *_DTYPES):
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {self.device!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1 or None, got {self.default_max_tokens}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}; got {self.load_format!r}")
        if not isinstance(self.prefill_cuda_graphs, bool):
            raise ValueError(f"prefill_cuda_graphs must be true or false, got {self.prefill_cuda_graphs!r}")
        if (isinstance(self.max_prefill_graph_tokens, bool) or not isinstance(self.max_prefill_graph_tokens, int)
                or self.max_prefill_graph_tokens < 1):
            raise ValueError(f"max_prefill_graph_tokens must be an integer >= 1 (the rows of the largest prefill "
                             f"CUDA graph; prefill_cuda_graphs=False turns them off), got "
                             f"{self.max_prefill_graph_tokens!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        self._check_cache_options()
        self._check_diffusion_speed()
        self._check_scale_out()
        self._check_parallel()

    def _check_scale_out(self) -> None:
        """`num_replicas` a positive integer, `distributed_executor_backend` among EXECUTOR_BACKENDS."""
        if isinstance(self.num_replicas, bool) or not isinstance(self.num_replicas, int) or self.num_replicas < 1:
            raise ValueError(f"num_replicas must be an integer >= 1, got {self.num_replicas!r}")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}; "
                             f"got {self.distributed_executor_backend!r}")
        if not isinstance(self.ray_address, str) or not self.ray_address:
            raise ValueError(f"ray_address must be a Ray cluster address (host:port, ray://host:port or auto); "
                             f"got {self.ray_address!r}")
        if self.ray_placement is not None and not isinstance(self.ray_placement, dict):
            raise ValueError(f"ray_placement must be a dict of a stage's ray: settings or None; got {self.ray_placement!r}")

    def _check_parallel(self) -> None:
        """`parallel_config` as a DiffusionParallelConfig (dict keys checked), and what it cannot run with."""
        pc = self.parallel_config
        if pc is None:
            return
        if isinstance(pc, dict):
            known = {f.name for f in dataclasses.fields(DiffusionParallelConfig)}
            unknown = sorted(set(pc) - known)
            if unknown:
                raise ValueError(f"parallel_config: unknown keys {unknown}; allowed: {sorted(known)}")
            pc = self.parallel_config = DiffusionParallelConfig(**pc)
        if not isinstance(pc, DiffusionParallelConfig):
            raise ValueError(f"parallel_config must be a dict or DiffusionParallelConfig, got {type(pc).__name__}")
        if pc.world_size == 1:
            return
        clashes = [name for name, on in (("cache_backend", self.cache_backend is not None),
                                         ("enable_cpu_offload", self.enable_cpu_offload),
                                         ("enable_layerwise_offload", self.enable_layerwise_offload)) if on]
        if pc.tensor_parallel_size > 1 and self.quantization is not None:
            clashes.append("quantization")
        if clashes:
            raise ValueError(f"parallel_config (world size {pc.world_size}) cannot run with {', '.join(clashes)}: "
                             "unset those options or use one process (all sizes 1)")

    def _check_cache_options(self) -> None:
        """`cache_backend` among CACHE_BACKENDS (or None), `cache_config` valid for it."""
        if self.cache_backend is not None and self.cache_backend not in CACHE_BACKENDS:
            raise ValueError(f"cache_backend must be one of {', '.join(CACHE_BACKENDS)} (or unset); "
                             f"got {self.cache_backend!r}")
        if self.cache_config is not None:
            if self.cache_backend is None:
                raise ValueError("cache_config needs a cache_backend (one of "
                                 f"{', '.join(CACHE_BACKENDS)})")
            problem = cache_config_problem(self.cache_backend, self.cache_config)
            if problem is not None:
                raise ValueError(f"cache_config: {problem[1]}")
        if not isinstance(self.vae_use_tiling, bool):
            raise ValueError(f"vae_use_tiling must be true or false, got {self.vae_use_tiling!r}")

    def _check_diffusion_speed(self) -> None:
        """Start-up errors of the diffusion speed block, each naming the option and the allowed values."""
        attention_backends(self.attention_backend)
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(map(str, QUANTIZATIONS))}; "
                             f"got {self.quantization!r}")
        if isinstance(self.ignored_layers, str):
            self.ignored_layers = tuple(p for p in self.ignored_layers.split(",") if p)
        self.ignored_layers = tuple(self.ignored_layers)
        if self.ignored_layers and self.quantization is None:
            raise ValueError("ignored_layers needs quantization (one of: fp8)")
        if self.diffusion_compile_mode not in COMPILE_MODES:
            raise ValueError(f"diffusion_compile_mode must be one of {', '.join(COMPILE_MODES)}; "
                             f"got {self.diffusion_compile_mode!r}")
        if not isinstance(self.diffusion_compile_dynamic, bool):
            raise ValueError(f"diffusion_compile_dynamic must be true or false, got {self.diffusion_compile_dynamic!r}")
        if self.quantization is not None and self.tensor_parallel_size > 1:
            raise ValueError(f"quantization={self.quantization!r} cannot run with tensor_parallel_size="
                             f"{self.tensor_parallel_size}: FP8 layers have no tensor-parallel shards; use "
                             "tensor_parallel_size=1 or unset quantization")
        if self.enable_cpu_offload and self.enable_layerwise_offload:
            raise ValueError("enable_cpu_offload and enable_layerwise_offload cannot both be set: "
                             "choose model-level (enable_cpu_offload) or layerwise (enable_layerwise_offload) offload")

    def max_len(self, model_max_len: int) -> int:
        """Prompt + output tokens a sequence may have: `max_model_len`, at most the model's limit."""
        return min(self.max_model_len or model_max_len, model_max_len)

    def prefill_graph_tokens(self) -> int:
        """Rows of the largest prefill CUDA graph an AR stage captures (0: none; CUDA, one rank only)."""
        if not (self.cuda_graphs and self.prefill_cuda_graphs) or self.tensor_parallel_size > 1:
            return 0
        return min(self.max_prefill_graph_tokens, self.max_num_batched_tokens)

    def kv_blocks_wanted(self, model_max_len: int) -> int:
        """KV blocks an AR engine could ever use: `max_num_seqs` sequences of the longest length, + 1."""
        return self.max_num_seqs * -(-self.max_len(model_max_len) // self.block_size) + 1

    def cpu_kv_blocks(self, model_max_len: int, block_bytes: int) -> int:
        """KV blocks of a CPU pool (num_kv_blocks unset): what `max_num_seqs` sequences of the
        longest length need, but no more than room for CPU_KV_FULL_SEQUENCES of them or
        CPU_KV_FLOOR_BYTES (whichever is larger): a CPU serves few long sequences at once, and the
        pool is zeroed, so resident, at start; at most `cpu_kv_cache_gb`."""
        per_seq = -(-self.max_len(model_max_len) // self.block_size)
        room = max(CPU_KV_FULL_SEQUENCES * per_seq, CPU_KV_FLOOR_BYTES // block_bytes)
        return min(self.kv_blocks_wanted(model_max_len), room + 1, int(self.cpu_kv_cache_gb * 2**30) // block_bytes)

    def apply_cpu_threads(self) -> None:
        """On CPU, leave one core to the serving threads (event loop, engine loop, tokenizer).

        Intra-op threads that find every core busy spin at each op's barrier: measured here on two
        cores with the server's other threads running, a SmolLM2 decode step took 0.97 s with two
        threads and 0.13 s with one. OMP_NUM_THREADS, when set, wins."""
        import os

        import torch

        if self.cpu_threads is not None:
            torch.set_num_threads(self.cpu_threads)
        elif "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) - 1))

    def resolved(self, kind: Optional[str] = None, checkpoint_dtype: Optional[str] = None) -> "EngineConfig":
        """A copy with a concrete `device` ("cpu" | "cuda:N") and, for a stage of `kind` ("ar" |
        "diffusion" | "codec"), a concrete `dtype` name: the one given, or `_auto_dtype`'s. Without
        `kind` (the pipeline-wide config, before its stages are known) only the device is resolved.
        `checkpoint_dtype`: the dtype name an AR checkpoint stores its weights in (`checkpoint_dtype`
        below); the other kinds ignore it. Resolving a resolved config gives an equal one."""
        if kind is not None and kind not in STAGE_KINDS:
            raise ValueError(f"kind must be one of {', '.join(STAGE_KINDS)}; got {kind!r}")
        device, dtype = concrete_device(self.device), self.dtype
        if kind is not None and dtype == "auto":
            dtype = _auto_dtype(kind, device, checkpoint_dtype)
        out = dataclasses.replace(self, device=device, dtype=dtype)
        return out._dit_tensor_parallel() if kind == "diffusion" else out

    def _dit_tensor_parallel(self) -> "EngineConfig":
        """A diffusion stage reads the AR option `tensor_parallel_size` (`--tensor-parallel-size`) as DiT
        tensor parallel: moved into `parallel_config` (which must not set another size)."""
        tp = self.tensor_parallel_size
        if tp == 1:
            return self
        pc = self.parallel_config or DiffusionParallelConfig()
        if pc.tensor_parallel_size not in (1, tp):
            raise ValueError(f"tensor_parallel_size={tp} and parallel_config.tensor_parallel_size="
                             f"{pc.tensor_parallel_size} disagree; set one of them")
        out = dataclasses.replace(self, parallel_config=dataclasses.replace(pc, tensor_parallel_size=tp))
        out.tensor_parallel_size = 1
        return out

    def torch_device(self) -> "torch.device":
        """`device` as a torch.device ("auto" resolved as in `resolved`)."""
        import torch

        return torch.device(concrete_device(self.device))

    def torch_dtype(self) -> "torch.dtype":
        """`dtype` as a torch.dtype; the config must be resolved for its stage (`resolved(kind, ...)`)."""
        if self.dtype == "auto":
            raise ValueError("dtype is 'auto': resolve the config for its stage first "
                             "(EngineConfig.resolved(kind, checkpoint_dtype))")
        return dtype_by_name(self.dtype)


@dataclass
class DiffusionParallelConfig:
    """How one diffusion stage spreads its denoiser over ranks (one process and one device per rank).

    The ranks form a mesh cfg x ring x ulysses x tensor (tensor innermost); world size = the product.
    Sizes that depend on the model (heads, the families that support a mode) are checked when the
    engine starts (`omnistage.parallel.plan.check_plan`), the image size per request."""

    ulysses_degree: int = 1                     # Ulysses sequence parallel: all-to-all heads <-> sequence
    ring_degree: int = 1                        # Ring attention: K/V blocks passed around, sequence stays split
    cfg_parallel_size: int = 1                  # 1 | 2: the CFG branches (positive, negative) on two ranks
    tensor_parallel_size: int = 1               # DiT tensor parallel: attention heads and MLP split, all-reduce

    def __post_init__(self) -> None:
        for name in ("ulysses_degree", "ring_degree", "cfg_parallel_size", "tensor_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel_config.{name} must be an integer >= 1, got {value!r}")
        if self.cfg_parallel_size not in (1, 2):
            raise ValueError(f"parallel_config.cfg_parallel_size must be 1 or 2 (the two CFG branches), "
                             f"got {self.cfg_parallel_size}")

    @property
    def sequence_parallel_size(self) -> int:
        """Ranks one sequence is split over (ulysses x ring)."""
        return self.ulysses_degree * self.ring_degree

    @property
    def world_size(self) -> int:
        """Ranks (processes, devices) the stage runs on."""
        return self.cfg_parallel_size * self.sequence_parallel_size * self.tensor_parallel_size


# -- diffusion step caches: the options of each backend, defined once ----------------------------------
# Read by EngineConfig (server-wide `cache_config`, a ValueError at start-up), the diffusion engine
# (a request's `cache_config`, a ParamError -> 400) and diffusion/step_cache.py (the values it runs with).


@dataclass(frozen=True)
class CacheOption:
    default: Any                                # value when neither the server nor the request sets it
    low: float                                  # smallest allowed value
    high: float                                 # largest allowed value
    kind: type = float                          # float | int | list (a list of floats: polynomial coefficients)
    meaning: str = ""                           # one line for docs and error messages


CACHE_BACKENDS: dict[str, dict[str, CacheOption]] = {
    # TeaCache: skip a step while the accumulated, polynomial-rescaled relative L1 change of the first
    # block's modulated input stays under `rel_l1_thresh`; the first and last steps always run.
    "tea_cache": {
        "rel_l1_thresh": CacheOption(0.2, 0.0, 10.0, float, "accumulated change under which a step is skipped"),
        "coefficients": CacheOption(None, -1e9, 1e9, list, "rescaling polynomial, highest power first "
                                    "(default: the model family's, else the identity)"),
    },
    # DBCache (cache-dit's names): the first Fn blocks always run; when the relative L1 change of their
    # residual is under `residual_diff_threshold`, the middle blocks are skipped and their cached
    # residual is added; the last Bn blocks always run.
    "cache_dit": {
        "Fn_compute_blocks": CacheOption(1, 1, 1000, int, "leading blocks that always run"),
        "Bn_compute_blocks": CacheOption(0, 0, 1000, int, "trailing blocks that always run"),
        "residual_diff_threshold": CacheOption(0.24, 0.0, 10.0, float, "relative change under which a step is cached"),
        "max_warmup_steps": CacheOption(4, 0, 100000, int, "first steps that always run"),
        "max_cached_steps": CacheOption(-1, -1, 100000, int, "cached steps per request at most (-1: no limit)"),
        "max_continuous_cached_steps": CacheOption(3, -1, 100000, int,
                                                   "cached steps in a row at most (-1: no limit)"),
    },
}


def cache_config_problem(backend: str, config: Any) -> Optional[tuple[str, str]]:
    """None when `config` is a valid `cache_config` for `backend`, else (key, message naming the key
    and its allowed range). Callers raise it as their error (ValueError at start-up, ParamError)."""
    options = CACHE_BACKENDS[backend]
    if not isinstance(config, dict):
        return "", f"cache_config must be a JSON object of {backend} settings, got {type(config).__name__}"
    for key, value in config.items():
        if key not in options:
            return key, f"cache_config.{key} is not a {backend} setting; allowed: {', '.join(options)}"
        opt = options[key]
        if opt.kind is list:
            ok = value is None or (isinstance(value, list) and 1 <= len(value) <= 16 and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and opt.low <= v <= opt.high for v in value))
            allowed = "null or a list of 1 to 16 numbers"
        else:
            number = (int,) if opt.kind is int else (int, float)
            ok = isinstance(value, number) and not isinstance(value, bool) and opt.low <= value <= opt.high
            allowed = f"{'an integer' if opt.kind is int else 'a number'} in [{opt.low:g}, {opt.high:g}]"
        if not ok:
            return key, f"cache_config.{key} must be {allowed} ({opt.meaning}), got {value!r}"
    return None


def cache_settings(backend: str, *layers: Optional[dict]) -> dict[str, Any]:
    """The backend's defaults overridden by each of `layers` in turn (server-wide, then the request's)."""
    out = {key: opt.default for key, opt in CACHE_BACKENDS[backend].items()}
    for layer in layers:
        out.update(layer or {})
    return out


def attention_backends(value: Any) -> dict[str, str]:
    """`EngineConfig.attention_backend` as {role: backend name} for every role in ATTENTION_ROLES
    ("auto" where unset); a ValueError naming the option and the allowed roles and names else."""
    if value is None:
        value = "auto"
    if isinstance(value, str) and "=" in value:
        pairs = [item.split("=", 1) for item in value.split(",") if item.strip()]
        value = {k.strip(): v.strip() for k, v in pairs}
    if isinstance(value, str):
        value = {role: value for role in ATTENTION_ROLES}
    if not isinstance(value, dict):
        raise ValueError(f"attention_backend must be a backend name, 'role=NAME,...' or a dict; got {value!r}")
    out = {role: "auto" for role in ATTENTION_ROLES}
    for role, name in value.items():
        if role not in ATTENTION_ROLES:
            raise ValueError(f"attention_backend: role must be one of {', '.join(ATTENTION_ROLES)}; got {role!r}")
        canon = ATTENTION_ALIASES.get(str(name).lower(), str(name).upper() if str(name).lower() != "auto" else "auto")
        if canon not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)} (or "
                             f"{', '.join(ATTENTION_ALIASES)}); got {name!r}")
        out[role] = canon
    return out


def concrete_device(device: str) -> str:
    """An `EngineConfig.device` as "cpu" or "cuda:N": "auto" is the first GPU when there is one.

    Bare "cuda" is GPU 0, as torch's current device is in every process here (nothing calls
    `torch.cuda.set_device`); asking torch for its current device would create a CUDA context in the
    entry point's process."""
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda:0" if device == "cuda" else device


def _auto_dtype(kind: str, device: str, checkpoint_dtype: Optional[str]) -> str:
    """What `dtype="auto"` runs a stage of `kind` in on `device` (a concrete device string):

    ar: the checkpoint's dtype (float32 when it names none), except on a CPU, where half precision
        becomes bfloat16 if the CPU computes in it natively (AVX512-BF16 / AMX) and float32 otherwise:
        on this project's AVX2 machines a bfloat16 matmul is emulated, and SmolLM2-135M decoded 64
        prompts 4.6x faster in float32 (transformers, one thread: 94 vs 20 tok/s).
    diffusion: bfloat16 on a GPU, float32 on a CPU (whatever the checkpoint stores).
    codec: float32 (what the codec back ends compute in)."""
    if checkpoint_dtype is not None and checkpoint_dtype not in _DTYPES:
        raise ValueError(f"checkpoint_dtype must be one of {', '.join(_DTYPES)} or None; got {checkpoint_dtype!r}")
    on_cpu = device == "cpu"
    if kind == "diffusion":
        return "float32" if on_cpu else "bfloat16"
    if kind == "codec":
        return "float32"
    dtype = checkpoint_dtype or "float32"
    if on_cpu and dtype in ("float16", "bfloat16"):
        return "bfloat16" if cpu_has_native_bf16() else "float32"
    return dtype


def dtype_by_name(name: str, field: str = "dtype") -> "torch.dtype":
    """The torch dtype of a dtype name ("float32" | "bfloat16" | "float16"); a ValueError naming `field` else."""
    if name not in _DTYPES:
        raise ValueError(f"{field} must be one of {', '.join(_DTYPES)}; got {name!r}")
    import torch

    return getattr(torch, name)


def checkpoint_dtype(model_dir: str) -> Optional[str]:
    """The dtype name a transformers folder's config.json gives its weights (`dtype`, or the older
    `torch_dtype`) when it is one an engine runs in (float32, bfloat16, float16), else None."""
    import json
    import os

    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    name = config.get("dtype") or config.get("torch_dtype")
    return name if name in _DTYPES else None


@functools.lru_cache(maxsize=None)
def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bfloat16 arithmetic (AVX512-BF16 or AMX-BF16 in /proc/cpuinfo's flags)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})
