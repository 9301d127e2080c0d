"""Sequence parallel for DiT blocks: Ulysses all-to-all, Ring attention, and the 2D mesh of both
(every rank's process; knows no model names).

In: a denoiser module, its family's `DiTParallelPlan` and this rank's `DiTMesh`. `SequenceParallel.install`
wraps, once, the `forward` of every block of the plan's lists and of every self-attention module:
  * the first block of a list cuts the plan's sequence arguments ([B, L, C]) to this rank's piece
    (piece `mesh.sp_rank` of sp_size equal pieces of L); every block cuts the rotary tables to the
    positions of its pieces; the last block of a list all-gathers its outputs (every tensor it returns
    is a sequence), so what runs between lists, before and after them sees whole sequences;
  * inside a self-attention module, `F.scaled_dot_product_attention` (our families all reach it,
    `diffusion/attention.py`) runs `sp_attention`: Ulysses swaps the sequence split for a head split
    (all-to-all in the Ulysses group), Ring passes K/V blocks around the ring and merges the blocks'
    results by log-sum-exp in fp32, and the all-to-all back restores the sequence split. Cross-attention
    (queries split, keys / values whole) needs nothing.
Attention without a mask is invariant to the order of the positions once rotary tables are applied, so
a rank's piece may join pieces of several segments (FLUX: its text piece, then its image piece).
Out: the denoiser's output, equal on every rank of the group to the one-process output (up to the order
of floating-point sums). `attention_lse` is the block kernel with its log-sum-exp: flash on CUDA in half
precision, plain fp32 PyTorch (the reference, what CPU tests run) otherwise.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from omnistage.parallel.mesh import DiTMesh, DiTParallelPlan

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of [B, H, Lq, D] queries over [B, H, Lk, D] keys -> (out [B, H, Lq, D] fp32,
    log-sum-exp of the scores [B, H, Lq] fp32)."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[:2]
        return out.float(), lse.float()
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float()), lse


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mesh: DiTMesh) -> torch.Tensor:
    """Attention of this rank's queries over the keys / values of every rank of its ring: the K/V block
    goes to the next rank while this one computes on it; results merge by log-sum-exp in fp32."""
    kv = torch.stack([k, v]).contiguous()
    out = lse = None
    nxt, prev = mesh.ring_peers
    for step in range(mesh.config.ring_degree):
        pending, incoming = [], None
        if step + 1 < mesh.config.ring_degree:
            incoming = torch.empty_like(kv)
            pending = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, nxt, mesh.ring_group),
                                              dist.P2POp(dist.irecv, incoming, prev, mesh.ring_group)])
        block_out, block_lse = attention_lse(q, kv[0], kv[1], scale)
        if out is None:
            out, lse = block_out, block_lse
        else:
            merged = torch.logaddexp(lse, block_lse)
            out = out * torch.exp(lse - merged).unsqueeze(-1) + block_out * torch.exp(block_lse - merged).unsqueeze(-1)
            lse = merged
        for request in pending:
            request.wait()
        if incoming is not None:
            kv = incoming
    return out.to(q.dtype)


def _all_to_all(x: torch.Tensor, split_dim: int, cat_dim: int, group) -> torch.Tensor:
    """Cut `x` into group-size pieces along split_dim, send piece j to member j, concatenate what
    arrives along cat_dim (in member order)."""
    n = dist.get_world_size(group)
    send = torch.stack(x.chunk(n, dim=split_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=cat_dim)


def sp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale, mesh: DiTMesh,
                 attend: Callable) -> torch.Tensor:
    """Self-attention over the whole sequence when each rank holds [B, H, L/sp, D] of q, k, v:
    Ulysses all-to-all (sequence split -> head split), Ring across the rings, all-to-all back.
    `attend(q, k, v, scale)` is the local attention of the Ulysses-only case (the phase's backend)."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    group = mesh.ulysses_group
    if group is not None:
        q, k, v = (_all_to_all(t, 1, 2, group) for t in (q, k, v))
    out = ring_attention(q, k, v, scale, mesh) if mesh.ring_group is not None else attend(q, k, v, scale)
    if group is not None:
        out = _all_to_all(out, 2, 1, group)
    return out


class _SPAttention(TorchFunctionMode):
    """Inside one self-attention module: `F.scaled_dot_product_attention` -> `sp_attention`."""

    def __init__(self, mesh: DiTMesh):
        super().__init__()
        self.mesh = mesh

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        a = dict(zip(_SDPA_ARGS, args), **kwargs)
        if a.get("attn_mask") is not None or a.get("is_causal") or a.get("dropout_p") or a.get("enable_gqa"):
            raise ValueError("sequence parallel attention takes no mask, causality, dropout or grouped heads")
        local = lambda q, k, v, scale: F.scaled_dot_product_attention(q, k, v, scale=scale)  # noqa: E731
        return sp_attention(a["query"], a["key"], a["value"], a.get("scale"), self.mesh, local)


def _piece(x: torch.Tensor, dim: int, mesh: DiTMesh) -> torch.Tensor:
    return x.chunk(mesh.sp_size, dim=dim)[mesh.sp_rank]


def _rope_piece(table: Any, dim: int, local_lengths: list[int], mesh: DiTMesh) -> Any:
    """The rows of a rotary table (a tensor or a tuple of them) for this rank's pieces of each segment."""
    if isinstance(table, (tuple, list)):
        return type(table)(_rope_piece(t, dim, local_lengths, mesh) for t in table)
    parts, start = [], 0
    for n in local_lengths:
        parts.append(table.narrow(dim, start + mesh.sp_rank * n, n))
        start += n * mesh.sp_size
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _gather(x: Any, mesh: DiTMesh) -> Any:
    """All-gather sequence pieces [B, L/sp, ...] along dim 1, in sp_rank order."""
    if isinstance(x, (tuple, list)):
        return type(x)(_gather(t, mesh) for t in x)
    if not isinstance(x, torch.Tensor):
        return x
    x = x.contiguous()
    pieces = [torch.empty_like(x) for _ in range(mesh.sp_size)]
    dist.all_gather(pieces, x, group=mesh.sp_group)
    return torch.cat(pieces, dim=1)


class SequenceParallel:
    """Installs the plan's sequence split on a denoiser (once; wrappers live on the modules)."""

    def __init__(self, plan: DiTParallelPlan, mesh: DiTMesh):
        self.plan = plan
        self.mesh = mesh

    def install(self, denoiser: torch.nn.Module) -> None:
        for name in self.plan.lists:
            blocks = getattr(denoiser, name, None)
            if blocks is None:
                continue
            for i, block in enumerate(blocks):
                block.forward = self._wrap_block(block.forward, first=i == 0, last=i == len(blocks) - 1)
                for attn in self.plan.self_attention:
                    module = _find(block, attn)
                    if module is not None:
                        module.forward = self._wrap_attention(module.forward)

    def _wrap_block(self, forward: Callable, first: bool, last: bool) -> Callable:
        signature, plan, mesh = inspect.signature(forward), self.plan, self.mesh

        @functools.wraps(forward)
        def run(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            a = bound.arguments
            if first:
                for name in plan.seq_args:
                    if isinstance(a.get(name), torch.Tensor):
                        a[name] = _piece(a[name], 1, mesh)
            for name, (dim, segments) in plan.rope_args.items():
                if a.get(name) is not None:
                    lengths = [a[s].shape[1] for s in segments]
                    a[name] = _rope_piece(a[name], dim, lengths, mesh)
            out = forward(*bound.args, **bound.kwargs)
            return _gather(out, mesh) if last else out

        return run

    def _wrap_attention(self, forward: Callable) -> Callable:
        mesh = self.mesh

        @functools.wraps(forward)
        def run(*args, **kwargs):
            with _SPAttention(mesh):
                return forward(*args, **kwargs)

        return run


def _find(module: torch.nn.Module, path: str):
    """The sub-module at `path` (dotted), or None when the module has none there."""
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None
