"""Merged projections: linear layers that read the same input become one GEMM (any process; inference).

In: a module and groups of its linear layers (dotted names inside it, e.g. ("attn.to_q", "attn.to_k",
"attn.to_v", "proj_mlp")) whose callers always pass them the same input tensor within one forward.
`merge_linears(module, group)` concatenates their weights (and biases) into one `MergedLinear`
([K] -> [sum of N]) and puts a `LinearPart` in place of each member, so the original callers stay as
they are. Out: each part returns its columns of the merged output, a strided view, like
`chunk` of a fused projection.

How a part knows the GEMM already ran: the first part called with an input computes the merged
output and keeps it with that input; the other parts called with the same tensor object slice it;
once every part took its columns the kept tensors are dropped (nothing outlives the block's
forward). A part called with another tensor (a caller that breaks the "same input" promise)
recomputes, so the result is always right, only slower. The state is plain attributes with no
host sync, which torch.compile traces without graph breaks (tests/diffusion/test_speed.py).
The merged GEMM is the same math as the separate ones (lossless); an FP8 swap of `nn.Linear`s
(diffusion/speed.py) quantizes `MergedLinear.proj` like any other, so the activations of the group
are quantized once.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class MergedLinear(nn.Module):
    """One `proj` ([K] -> [sum N_i]) standing in for several linear layers of the same input."""

    def __init__(self, linears: list[nn.Linear]):
        super().__init__()
        first = linears[0]
        weight = torch.cat([lin.weight.detach() for lin in linears])
        self.proj = nn.Linear(first.in_features, weight.shape[0], bias=first.bias is not None,
                              device=weight.device, dtype=weight.dtype)
        self.proj.weight.data = weight
        if first.bias is not None:
            self.proj.bias.data = torch.cat([lin.bias.detach() for lin in linears])
        self.proj.requires_grad_(False)
        ends = torch.tensor([lin.out_features for lin in linears]).cumsum(0).tolist()
        self.bounds = list(zip([0] + ends[:-1], ends))  # part i -> its (start, end) columns
        self._input: Optional[torch.Tensor] = None      # the input the kept output was computed from
        self._output: Optional[torch.Tensor] = None     # proj(_input), until every part took its columns
        self._left = 0                                  # parts that have not yet taken their columns
        self.gemms = 0                                  # merged GEMMs run eagerly (not counted under compile)

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if self._left == 0 or self._input is not x:
            self._output, self._input, self._left = self.proj(x), x, len(self.bounds)
            if not torch.compiler.is_compiling():   # a counter inside compiled code would be a guard
                self.gemms += 1
        start, end = self.bounds[index]
        out = self._output[..., start:end]
        self._left -= 1
        if self._left == 0:
            self._input = self._output = None
        return out

    def extra_repr(self) -> str:
        return f"parts={[end - start for start, end in self.bounds]}"


class LinearPart(nn.Module):
    """A member of a merged group, where the original `nn.Linear` was: its columns of the merged GEMM.
    The first part of a group holds the `MergedLinear` as its child `merged` (so the weights appear
    once in `parameters()`); the others refer to it without registering it."""

    def __init__(self, merged: MergedLinear, index: int):
        super().__init__()
        if index == 0:
            self.merged = merged
        else:
            object.__setattr__(self, "_shared", merged)
        self.index = index
        start, end = merged.bounds[index]
        self.in_features, self.out_features = merged.proj.in_features, end - start

    @property
    def group(self) -> MergedLinear:
        return self.merged if self.index == 0 else self._shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.part(self.index, x)

    def extra_repr(self) -> str:
        return f"part {self.index} of a merged projection, in_features={self.in_features}, " \
               f"out_features={self.out_features}"


def mergeable(module: nn.Module, group: tuple[str, ...]) -> Optional[list[nn.Linear]]:
    """The group's linear layers, or None when one is missing or not a plain `nn.Linear`, or they
    differ in input width, dtype, device or having a bias (then the group stays as it is)."""
    linears = []
    for name in group:
        try:
            m = module.get_submodule(name)
        except AttributeError:
            return None
        if type(m) is not nn.Linear:
            return None
        linears.append(m)
    first = linears[0]
    if any(lin.in_features != first.in_features or lin.weight.dtype != first.weight.dtype
           or lin.weight.device != first.weight.device or (lin.bias is None) != (first.bias is None)
           for lin in linears):
        return None
    return linears


def merge_linears(module: nn.Module, group: tuple[str, ...]) -> bool:
    """Merge the group's linear layers inside `module` (see the module docstring); False (nothing
    changed) when `mergeable` says no."""
    linears = mergeable(module, group)
    if linears is None or len(linears) < 2:
        return False
    merged = MergedLinear(linears)
    for index, name in enumerate(group):
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, LinearPart(merged, index))
    return True
