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
dropout, causal or grouped heads runs plain SDPA. "auto" is `DEFAULT_ATTENTION[device type]`.
"""

from __future__ import annotations

import contextlib
import logging
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
