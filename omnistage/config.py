"""Engine configuration: one small dataclass tree built once and passed explicitly.

`EngineConfig` is what the user tunes (batch limits, KV pool size, device, dtype); the AR engine
derives everything else (block count, model dtype) from it and the checkpoint's config.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch

# torch is imported only where a device or dtype is resolved, so that control-plane processes
# (stage clients, the API server's argument parsing) start without paying for it.
_DTYPES = ("float32", "bfloat16", "float16")
CUDA_CONTEXT_BYTES = 2**29                      # CUDA context + torch kernels of one process on one GPU (estimate)


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
    cpu_kv_cache_gb: float = 2.0                # KV pool budget on CPU when num_kv_blocks is None
    enable_prefix_caching: bool = True          # share full KV blocks across requests by content
    seed: int = 0                               # seed of the generator used by unseeded requests
    cpu_threads: Optional[int] = None           # torch intra-op threads on CPU; None = cores - 1 (>= 1)
    cuda_graphs: bool = True                    # capture decode steps on CUDA

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", *_DTYPES):
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {self.device!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    def max_len(self, model_max_len: int) -> int:
        """Prompt + output tokens a sequence may have: `max_model_len`, at most the model's limit."""
        return min(self.max_model_len or model_max_len, model_max_len)

    def kv_blocks_wanted(self, model_max_len: int) -> int:
        """KV blocks an AR engine could ever use: `max_num_seqs` sequences of the longest length, + 1."""
        return self.max_num_seqs * -(-self.max_len(model_max_len) // self.block_size) + 1

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

    def resolve_device(self) -> "torch.device":
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, checkpoint_dtype: Optional["torch.dtype"], device: "torch.device") -> "torch.dtype":
        """`auto` keeps the checkpoint's dtype, except on a CPU, where half precision becomes bfloat16
        if the CPU computes in it natively (AVX512-BF16 / AMX) and float32 otherwise: on this
        project's AVX2 machines a bfloat16 matmul is emulated, and SmolLM2-135M decoded 64 prompts
        4.6x faster in float32 (transformers, one thread: 94 vs 20 tok/s)."""
        import torch

        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        dtype = checkpoint_dtype or torch.float32
        if device.type == "cpu" and dtype in (torch.float16, torch.bfloat16):
            return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        return dtype


def checkpoint_dtype(model_dir: str) -> Optional["torch.dtype"]:
    """The dtype a transformers folder's config.json gives its weights (`dtype`, or the older
    `torch_dtype`), or None when it names none."""
    import json
    import os

    import torch

    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    name = config.get("dtype") or config.get("torch_dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) else None


@functools.lru_cache(maxsize=None)
def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bfloat16 arithmetic (AVX512-BF16 or AMX-BF16 in /proc/cpuinfo's flags)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})
