"""Attention backends of a diffusion stage, one per role (stage process; knows no model names).

In: a backend name per role (`config.attention_backends`: roles "dit", "text_encoder"; names
`ATTENTION_BACKENDS`) and the device. Out: `AttentionRouter(name, device)`, a context manager the
engine enters around each phase of that role (diffusion/speed.py). Every attention call of our
families reaches `F.scaled_dot_product_attention` (diffusers' "native" dispatch, SD3's processor,
transformers' "sdpa" encoders), so the router works on that one function, for every family:

  TORCH_SDPA     torch's own choice of SDPA kernel
  FLASH_ATTN / EFFICIENT_ATTN / CUDNN_ATTN / MATH_ATTN
                 that SDPA kernel first (`sdpa_kernel(..., set_priority=True)`), the others after it,
                 so a shape the kernel cannot run still runs (lossless)
  FLEX_ATTN      FlexAttention (compiled once on CUDA) for mask-free calls
  SAGE_ATTN      8-bit attention (layers/quant_attention.py; lossy, opt-in) for mask-free calls
The last two take over `F.scaled_dot_product_attention` inside the phase through a
`TorchFunctionMode` (torch's own interception mechanism, traced by torch.compile); a call with a mask,
dropout, causal or grouped heads runs plain SDPA.

"auto" (the default) on CUDA is the fastest lossless backend measured on this device for the model's
shape: `probe(shape, dtype, device)` times each of `PROBE_BACKENDS` (FlexAttention on CUDA only) that
runs the shape (each pinned alone, no fallback; one warm-up call, then the median of a few), once per
(shape, dtype, device) in the process (`_PROBED`); the stage's Accelerator calls it at load on the DiT's
attention shape at the family's default request size. Where no probe ran (CPU, a text encoder, a shape the family cannot
name), "auto" is `DEFAULT_ATTENTION[device type]` (SDPA's own choice on CPU: the math / CPU flash kernel).
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from omnistage.config import DEFAULT_ATTENTION
from omnistage.layers import quant_attention

log = logging.getLogger(__name__)

_KERNELS = {"FLASH_ATTN": SDPBackend.FLASH_ATTENTION, "EFFICIENT_ATTN": SDPBackend.EFFICIENT_ATTENTION,
            "CUDNN_ATTN": SDPBackend.CUDNN_ATTENTION, "MATH_ATTN": SDPBackend.MATH}
_ORDER = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_flex_compiled: Optional[Callable] = None
# the lossless backends "auto" chooses among, in the order they win ties (cuDNN first: the fastest on
# the H200 so far, benchmarks/RESULTS.md session 4)
PROBE_BACKENDS = ("CUDNN_ATTN", "FLASH_ATTN", "EFFICIENT_ATTN", "FLEX_ATTN")
PROBE_REPEATS = 5                               # timed calls per backend (after one warm-up call)


@dataclass
class ProbeResult:
    """What the attention probe measured for one (shape, dtype, device)."""
    shape: tuple                                # (batch rows, heads, tokens, head dim) of q, k and v
    dtype: str                                  # their dtype, e.g. "torch.bfloat16"
    choice: str                                 # the fastest backend that ran (TORCH_SDPA if none ran)
    seconds: dict = field(default_factory=dict)  # backend -> median seconds of one attention call
    skipped: dict = field(default_factory=dict)  # backend -> why it did not run this shape ("RuntimeError: ...")

    def as_dict(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype, "choice": self.choice,
                "seconds": dict(self.seconds), "skipped": dict(self.skipped)}


def probe_backends(device: torch.device) -> tuple:
    """The probe's candidates on `device`: FlexAttention only on CUDA, where it is compiled (elsewhere it
    runs its unfused reference, never the fastest)."""
    return PROBE_BACKENDS if device.type == "cuda" else tuple(b for b in PROBE_BACKENDS if b != "FLEX_ATTN")


_PROBED: dict[tuple, ProbeResult] = {}          # (shape, dtype, device) -> result: one probe per process


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, repeats: int = PROBE_REPEATS) -> float:
    """Median seconds of one attention call on backend `name` alone (an SDPA kernel pinned without
    fallback, or FlexAttention); raises when that backend cannot run these inputs."""
    if name == "FLEX_ATTN":
        def call():
            return _flex(q, k, v, None)
    else:
        def call():
            with sdpa_kernel([_KERNELS[name]]):
                return F.scaled_dot_product_attention(q, k, v)
    call()                                      # warm-up (FlexAttention compiles here on CUDA)
    times = []
    for _ in range(repeats):
        _sync(q.device)
        start = time.perf_counter()
        call()
        _sync(q.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def probe(shape: tuple, dtype: torch.dtype, device: torch.device, backends: Optional[tuple] = None,
          timer: Callable = measure) -> ProbeResult:
    """The fastest of `backends` (default `probe_backends(device)`) on random q, k, v of `shape`
    ([B, H, S, D]), measured once per (shape, dtype, device, backends) in the process;
    `timer(name, q, k, v) -> seconds` (raises: skipped)."""
    backends = probe_backends(device) if backends is None else tuple(backends)
    key = (tuple(shape), str(dtype), str(device), tuple(backends))
    if key in _PROBED:
        return _PROBED[key]
    result = ProbeResult(shape=tuple(shape), dtype=str(dtype), choice="TORCH_SDPA")
    gen = torch.Generator(device="cpu").manual_seed(0)
    try:
        q, k, v = (torch.randn(*shape, generator=gen).to(device, dtype) for _ in range(3))
    except torch.OutOfMemoryError as e:         # a GPU too small for the probe's inputs: SDPA chooses
        result.skipped = {name: f"inputs: {type(e).__name__}"[:200] for name in backends}
        q = k = v = None
    for name in backends if q is not None else ():
        try:
            with torch.no_grad():
                result.seconds[name] = float(timer(name, q, k, v))
        except Exception as e:                  # this backend cannot run the shape here: not a candidate
            result.skipped[name] = f"{type(e).__name__}: {e}"[:200]
    if result.seconds:
        result.choice = min(result.seconds, key=lambda n: (result.seconds[n], backends.index(n)))
    del q, k, v
    if device.type == "cuda":
        torch.cuda.empty_cache()                # the probe's inputs and workspaces go back to the device
    log.info("attention probe %s %s on %s: %s (%s)", list(shape), dtype, device, result.choice,
             ", ".join(f"{n} {s * 1e3:.3f} ms" for n, s in result.seconds.items()) or "no backend ran")
    _PROBED[key] = result
    return result


def resolve_backend(name: str, device: torch.device) -> str:
    """"auto" -> the device's default (DEFAULT_ATTENTION); other names as they are."""
    return DEFAULT_ATTENTION.get(device.type, "TORCH_SDPA") if name == "auto" else name


def _plain(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> bool:
    """Whether a call is one the replacement kernels take: no mask, dropout, causality or GQA."""
    return attn_mask is None and not dropout_p and not is_causal and not enable_gqa and q.shape[1] == k.shape[1]


def _flex(q, k, v, scale):
    global _flex_compiled
    from torch.nn.attention.flex_attention import flex_attention

    if not q.is_cuda:
        return flex_attention(q, k, v, scale=scale)       # eager: the reference path (CPU tests)
    if _flex_compiled is None:
        _flex_compiled = torch.compile(flex_attention, dynamic=True)
    return _flex_compiled(q, k, v, scale=scale)


class _Replace(TorchFunctionMode):
    """Runs `attend(q, k, v, scale)` in place of mask-free `F.scaled_dot_product_attention` calls."""

    def __init__(self, attend: Callable):
        super().__init__()
        self.attend = attend

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            a = dict(zip(_SDPA_ARGS, args), **kwargs)
            q, k, v = a["query"], a["key"], a["value"]
            if _plain(q, k, v, a.get("attn_mask"), a.get("dropout_p", 0.0), a.get("is_causal", False),
                      a.get("scale"), a.get("enable_gqa", False)):
                return self.attend(q, k, v, a.get("scale"))
        return func(*args, **kwargs)


class AttentionRouter:
    """`with router:` runs the phase's attention on the chosen backend."""

    def __init__(self, name: str, device: torch.device):
        self.name = resolve_backend(name, device)
        self.device = device

    def __enter__(self):
        self._stack = contextlib.ExitStack()
        if self.name in _KERNELS:
            first = _KERNELS[self.name]
            self._stack.enter_context(sdpa_kernel([first] + [b for b in _ORDER if b != first], set_priority=True))
        elif self.name == "FLEX_ATTN":
            self._stack.enter_context(_Replace(_flex))
        elif self.name == "SAGE_ATTN":
            self._stack.enter_context(_Replace(quant_attention.sage_attention))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
