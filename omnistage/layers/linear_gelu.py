"""A linear layer and the tanh GELU after it as one GEMM (any process; CUDA fast path, PyTorch reference).

In: the `nn.Linear` of a diffusers `GELU(approximate="tanh")` activation module (the first half of a
`FeedForward` with `activation_fn="gelu-approximate"`: FLUX, SD3, Qwen-Image, Wan). Out: `LinearGELU`
in the module's place, which returns gelu_tanh(x @ W^T + b).

On CUDA (16-bit activations with a bias) the op is `torch._addmm_activation(..., use_gelu=True)`:
cuBLASLt applies the GELU in the GEMM's epilogue, on the float32 accumulator, so the [tokens, hidden]
output is written once and never read back by a separate GELU kernel (Wan2.1's FFN: 1.2 GB per block
at 832x480x81; benchmarks/dit_variants.py on an H200: Wan's up-projection + GELU 542 -> 624 TFLOP/s,
FLUX's double-block one 665 -> 709). Elsewhere the op is `reference` (the linear, then the GELU): the same ops as
diffusers' modules, so CPU outputs are unchanged. The fast path rounds once instead of twice (the
GEMM's output before the GELU), so it differs from the reference by bf16 rounding
(benchmarks/dit_variants.py prints the difference). The op is a torch custom op, so compiled blocks
call it as one opaque kernel (inductor would otherwise decompose it back into a GEMM and a GELU).
A `LinearGELU` whose `proj` was swapped for another layer type (FP8, `Fp8Linear`) runs that layer and
then the GELU.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


def reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")


def epilogue_supports(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    return (x2.is_cuda and bias is not None and x2.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x2.dtype and bias.dtype == x2.dtype and x2.shape[0] > 1)


@torch.library.custom_op("omnistage::linear_gelu_tanh", mutates_args=())
def linear_gelu_tanh(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if epilogue_supports(x2, weight, bias):
        out = torch._addmm_activation(bias, x2, weight.t(), use_gelu=True)
    else:
        out = reference(x2, weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


@linear_gelu_tanh.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


class LinearGELU(nn.Module):
    """gelu_tanh(proj(x)) in one op; `proj` keeps its name and parameters (state dicts, FP8's
    `ignored_layers` and offload see the same layer)."""

    def __init__(self, proj: nn.Linear):
        super().__init__()
        self.proj = proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        proj = self.proj
        if type(proj) is nn.Linear and not (torch.is_grad_enabled() and (x.requires_grad or proj.weight.requires_grad)):
            return linear_gelu_tanh(x, proj.weight, proj.bias)     # the op has no backward: inference only
        return F.gelu(self.proj(x), approximate="tanh")


def fuse_gelu(block: nn.Module) -> int:
    """In one DiT block, every diffusers `GELU(approximate="tanh")` module with a plain linear `proj`
    becomes a `LinearGELU`; returns the count."""
    from diffusers.models.activations import GELU

    fused = 0
    for name, module in list(block.named_modules()):
        if isinstance(module, GELU) and module.approximate == "tanh" and type(module.proj) is nn.Linear:
            parent_name, _, child = name.rpartition(".")
            setattr(block.get_submodule(parent_name) if parent_name else block, child, LinearGELU(module.proj))
            fused += 1
    return fused
