"""Tensor parallel for DiT blocks: each rank keeps a slice of every block's weights (every rank's process).

In: a denoiser, its family's `DiTParallelPlan` and this rank's `DiTMesh` (`tp_rank` of
`tensor_parallel_size`). `shard_blocks` changes the modules of the plan's block lists in place, once,
before the first forward:
  * column linears (attention q / k / v, MLP up-projections) keep rows tp_rank of tp of their weight
    and bias, so each rank computes its heads / hidden units; attention `heads` counts are divided;
  * row linears (attention out, MLP down-projections) keep the matching input columns and become
    `RowParallelLinear`: a partial product, all-reduced over the tensor group, plus the bias once;
    a row linear whose input concatenates several column linears' outputs (FLUX single blocks) keeps
    the matching columns of each part;
  * RMSNorms over all heads' features (Wan's q / k norms) become `ShardedRMSNorm`, whose mean square
    is all-reduced, so each rank normalises its slice by the whole row's statistics.
Everything outside the block lists (embeddings, final norm and projection) stays whole on every rank.
Out: blocks whose outputs equal the whole model's on every rank of the group (up to sum order).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from omnistage.parallel.mesh import DiTMesh, DiTParallelPlan


class RowParallelLinear(torch.nn.Module):
    """y = all_reduce(x_slice @ W_slice^T) + b over the tensor group."""

    def __init__(self, weight: torch.Tensor, bias, group):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)   # [out, in / tp]
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.group = group                                                          # the tensor group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


class ShardedRMSNorm(torch.nn.Module):
    """torch.nn.RMSNorm over features split across the tensor group: sum of squares all-reduced."""

    def __init__(self, norm: torch.nn.RMSNorm, rank: int, size: int, group):
        super().__init__()
        self.full_dim = norm.normalized_shape[-1]                   # features of the whole row
        self.eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
        w = norm.weight
        self.weight = None if w is None else torch.nn.Parameter(w.detach().chunk(size)[rank].clone(),
                                                                requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        squares = x.float().pow(2).sum(-1, keepdim=True)
        dist.all_reduce(squares, group=self.group)
        y = (x.float() * torch.rsqrt(squares / self.full_dim + self.eps)).to(x.dtype)
        return y if self.weight is None else y * self.weight


def _get(block: torch.nn.Module, path: str):
    try:
        return block.get_submodule(path)
    except AttributeError:
        return None


def _set(block: torch.nn.Module, path: str, module: torch.nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(block.get_submodule(parent) if parent else block, name, module)


def column_sizes(denoiser: torch.nn.Module, plan: DiTParallelPlan) -> dict[str, int]:
    """Output features of each column linear of the first block of each list (for `check_plan`)."""
    sizes = {}
    for name in plan.lists:
        blocks = getattr(denoiser, name, None)
        if not blocks:
            continue
        for path in plan.column:
            linear = _get(blocks[0], path)
            if linear is not None:
                sizes[f"{name}.{path}"] = linear.out_features
    return sizes


@torch.no_grad()
def shard_blocks(denoiser: torch.nn.Module, plan: DiTParallelPlan, mesh: DiTMesh) -> None:
    """Keep this rank's slice of every block of the plan's lists (see the module docstring)."""
    rank, size, group = mesh.tp_rank, mesh.config.tensor_parallel_size, mesh.tp_group
    for name in plan.lists:
        for block in getattr(denoiser, name, None) or ():
            widths = {path: _get(block, path).out_features for path in plan.column if _get(block, path) is not None}
            for path in widths:
                linear = _get(block, path)
                linear.weight = torch.nn.Parameter(linear.weight.chunk(size, 0)[rank].clone(), requires_grad=False)
                if linear.bias is not None:
                    linear.bias = torch.nn.Parameter(linear.bias.chunk(size, 0)[rank].clone(), requires_grad=False)
                linear.out_features = linear.weight.shape[0]
            for path in plan.row:
                linear = _get(block, path)
                if linear is None:
                    continue
                parts = [widths[p] for p in plan.packed_row.get(path, ()) if p in widths] or [linear.in_features]
                cols = torch.split(linear.weight, parts, dim=1)
                weight = torch.cat([c.chunk(size, 1)[rank] for c in cols], dim=1)
                _set(block, path, RowParallelLinear(weight, linear.bias, group))
            for path in plan.heads:
                attn = _get(block, path)
                if attn is not None and hasattr(attn, "heads"):
                    attn.heads //= size
                    for attr in ("inner_dim", "kv_inner_dim"):
                        if hasattr(attn, attr):
                            setattr(attn, attr, getattr(attn, attr) // size)
            for path in plan.head_norms:
                norm = _get(block, path)
                if isinstance(norm, torch.nn.RMSNorm):
                    _set(block, path, ShardedRMSNorm(norm, rank, size, group))
