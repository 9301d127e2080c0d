"""Tensor-parallel layers and the plan a model declares to get them (every rank's process).

In: a model built inside `sharding(size, rank)` that declares a `TPPlan` (which attention modules
split their heads, which linears are stacked q|k|v, column- or row-parallel, which embeddings and
heads split the vocabulary) and calls `apply_plan(self, plan)` at the end of its constructor. Out: the
same model with those modules replaced by this rank's shard; each replacement loads its slice from a
full checkpoint tensor by name (`load_shard(param, tensor, shard)`), so weight loading needs no
per-model code. With size 1 (no `sharding` context) `apply_plan` changes nothing.

  ColumnParallelLinear   output rows split; stacked parts (q|k|v, gate|up) each give this rank its slice
  RowParallelLinear      input columns split; partial products all-reduced, bias added once
  VocabParallelEmbedding rows of the vocabulary split (padded to a multiple of the size); ids outside a
                         rank's rows give zeros; all-reduced
  VocabParallelHead      an lm head's rows split the same way; `vocab_logits` gathers the full logits

KV heads: with kv_heads >= size each rank keeps kv_heads / size of them; with fewer, each keeps one,
replicated (rank r holds kv head r * kv_heads // size, the one its query heads read).
Collectives go over the default process group (`parallel/group.py`).
"""

from __future__ import annotations

import contextlib
import fnmatch
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from omnistage.parallel.group import check_divides, divisors_up_to

OPTION = "tensor_parallel_size"
_SHARDING = {"size": 1, "rank": 0}


@contextlib.contextmanager
def sharding(size: int, rank: int) -> Iterator[None]:
    """Models built inside this block are this rank's shard of a `size`-way tensor-parallel model."""
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in [0, {size}), got {rank}")
    old = dict(_SHARDING)
    _SHARDING.update(size=size, rank=rank)
    try:
        yield
    finally:
        _SHARDING.update(old)


def shard_size() -> int:
    """The tensor-parallel size models are being built for (1 outside `sharding`)."""
    return _SHARDING["size"]


@dataclass(frozen=True)
class TPPlan:
    """Which modules of a model are split, by module-name glob (`fnmatch`, e.g. "layers.*.mlp.down_proj")."""

    attention: str = ""                         # attention modules (num_heads, num_kv_heads, head_dim): heads split
    qkv: str = ""                               # stacked [q | k | v] linears, children of `attention` modules
    column: dict = field(default_factory=dict)  # glob -> number of equal stacked parts (gate|up: 2; plain: 1)
    row: tuple = ()                             # row-parallel linears (input split, output all-reduced)
    vocab: tuple = ()                           # embeddings (nn.Embedding) and lm heads (nn.Linear) split by vocab


def kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    return max(num_kv_heads // size, 1)


def check_heads(num_heads: int, num_kv_heads: int, size: int) -> None:
    """ValueError naming tensor_parallel_size unless `size` splits the query heads and the KV heads
    (KV heads either split evenly or are replicated: size a multiple of them)."""
    def fits(d: int) -> bool:
        return num_heads % d == 0 and (num_kv_heads % d == 0 or d % num_kv_heads == 0)
    if not fits(size):
        ok = [d for d in divisors_up_to(num_heads, max(num_heads, 8)) if fits(d)]
        raise ValueError(f"{OPTION}={size} must divide num_attention_heads={num_heads} and divide or be a "
                         f"multiple of num_key_value_heads={num_kv_heads}; sizes that would work: {ok}")


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split: this rank holds `slices` (start, length) of each stacked part."""

    def __init__(self, in_features: int, slices: list[tuple[int, int]], bias: bool):
        super().__init__()
        self.slices = slices                    # per stacked part: (first row in the full part, rows kept)
        out = sum(n for _, n in slices)
        self.in_features, self.out_features = in_features, out
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def load_shard(self, param: torch.Tensor, full: torch.Tensor, shard: Optional[int]) -> None:
        """`full`: part `shard` of the checkpoint's stacked tensor (None: the only part)."""
        i = shard or 0
        offset = sum(n for _, n in self.slices[:i])
        start, n = self.slices[i]
        with torch.no_grad():
            param.narrow(0, offset, n).copy_(full.narrow(0, start, n))


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r W_r^T) + b: this rank holds W's input columns [rank*in/size, (rank+1)*in/size)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, size: int, rank: int):
        check_divides(OPTION, size, in_features=in_features)
        super().__init__()
        self.size, self.part = size, in_features // size
        self.start = rank * self.part
        self.weight = nn.Parameter(torch.empty(out_features, self.part), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.size > 1:
            dist.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def load_shard(self, param: torch.Tensor, full: torch.Tensor, shard: Optional[int]) -> None:
        with torch.no_grad():
            param.copy_(full if param is self.bias else full.narrow(1, self.start, self.part))


def vocab_rows(vocab: int, size: int, rank: int) -> tuple[int, int]:
    """(first id, rows) of this rank's part of a vocabulary padded up to a multiple of `size`."""
    per = -(-vocab // size)
    return rank * per, per


class VocabParallelEmbedding(nn.Module):
    """An embedding table whose rows (token ids) are split across ranks; the lookup is all-reduced."""

    def __init__(self, num_embeddings: int, dim: int, size: int, rank: int):
        super().__init__()
        self.num_embeddings, self.size = num_embeddings, size
        self.start, self.rows = vocab_rows(num_embeddings, size, rank)
        self.weight = nn.Parameter(torch.empty(self.rows, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside[:, None], 0)
        dist.all_reduce(x)
        return x

    def load_shard(self, param: torch.Tensor, full: torch.Tensor, shard: Optional[int]) -> None:
        n = max(min(self.rows, full.shape[0] - self.start), 0)
        with torch.no_grad():
            param.zero_()                       # the padding rows past the vocabulary stay zero
            param.narrow(0, 0, n).copy_(full.narrow(0, self.start, n))


class VocabParallelHead(VocabParallelEmbedding):
    """An lm head's weight [vocab, hidden] split by rows like the embedding; used through `vocab_logits`."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return vocab_logits(hidden, self.weight, self.num_embeddings)


def vocab_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab: int) -> torch.Tensor:
    """Float logits [T, vocab] from an lm head / tied embedding `weight` that may be this rank's rows
    (then every rank's part is gathered and the padding cut)."""
    logits = F.linear(hidden, weight).float()
    if weight.shape[0] == vocab or not dist.is_initialized() or dist.get_world_size() == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, logits.contiguous())
    return torch.cat(parts, dim=-1)[:, :vocab]


def _matches(name: str, globs) -> bool:
    return any(fnmatch.fnmatchcase(name, g) for g in ([globs] if isinstance(globs, str) else globs) if g)


def apply_plan(model: nn.Module, plan: TPPlan) -> None:
    """Replace the modules `plan` names with this rank's shards (see the module docstring); a no-op
    outside `sharding`. ValueError naming tensor_parallel_size when a size does not split a module."""
    size, rank = _SHARDING["size"], _SHARDING["rank"]
    if size == 1:
        return
    heads: dict[str, tuple[int, int, int]] = {}         # attention module -> (heads, kv heads, head_dim), full
    for name, mod in model.named_modules():
        if _matches(name, plan.attention):
            check_heads(mod.num_heads, mod.num_kv_heads, size)
            heads[name] = (mod.num_heads, mod.num_kv_heads, mod.head_dim)
            mod.num_heads //= size
            mod.num_kv_heads = kv_heads_per_rank(mod.num_kv_heads, size)
    for name, mod in list(model.named_modules()):
        new = None
        if _matches(name, plan.qkv):
            h, kvh, d = heads[name.rpartition(".")[0]]
            new = ColumnParallelLinear(mod.in_features, _qkv_slices(h, kvh, d, size, rank), mod.bias is not None)
        elif any(fnmatch.fnmatchcase(name, g) for g in plan.column):
            parts = next(n for g, n in plan.column.items() if fnmatch.fnmatchcase(name, g))
            part = mod.out_features // parts
            check_divides(OPTION, size, **{f"{name}.out_features/{parts}": part})
            new = ColumnParallelLinear(mod.in_features, [(rank * part // size, part // size)] * parts,
                                       mod.bias is not None)
        elif _matches(name, plan.row):
            new = RowParallelLinear(mod.in_features, mod.out_features, mod.bias is not None, size, rank)
        elif _matches(name, plan.vocab):
            if isinstance(mod, nn.Embedding):
                new = VocabParallelEmbedding(mod.num_embeddings, mod.embedding_dim, size, rank)
            else:
                new = VocabParallelHead(mod.out_features, mod.in_features, size, rank)
        if new is not None:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, new)


def _qkv_slices(h: int, kvh: int, d: int, size: int, rank: int) -> list[tuple[int, int]]:
    q = (rank * (h // size) * d, (h // size) * d)
    if kvh >= size:
        kv = (rank * (kvh // size) * d, (kvh // size) * d)
    else:
        kv = ((rank * kvh // size) * d, d)
    return [q, kv, kv]
