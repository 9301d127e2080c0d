"""The rank mesh of a parallel DiT and what a model family declares for it (every rank's process).

In: a `DiffusionParallelConfig` (cfg x ring x ulysses x tensor sizes) once the default process
group exists (`group.init_rank`). Out: `DiTMesh`, this rank's coordinates and the sub-groups of each
axis (None where the axis has size 1), made in the same order on every rank as torch.distributed
requires. The layout is rank = ((cfg * ring + r) * ulysses + u) * tensor + t: tensor-parallel ranks are
neighbours (the chattiest axis on the closest devices), then Ulysses, Ring, CFG.

`DiTParallelPlan` is the data a family declares on its class (`parallel_plan`, in
`diffusion/pipelines/*.py`): which block lists repeat, which block arguments are sequences to split,
its rotary tables, its self-attention modules (K/V split like Q) and the column / row split of each
block's linear layers. `check_plan` refuses, at start-up, a config the family or its sizes cannot run,
naming the option and the sizes that would work.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist

from omnistage.config import DiffusionParallelConfig
from omnistage.parallel.group import divisors_up_to

MODES = {"ulysses": "ulysses_degree", "ring": "ring_degree", "cfg": "cfg_parallel_size",
         "tensor": "tensor_parallel_size"}


@dataclass(frozen=True)
class DiTParallelPlan:
    """What generic parallel code needs to know about one family's denoiser blocks (names are
    attribute paths inside one block; names a block lacks are skipped, e.g. I2V-only projections)."""

    modes: tuple[str, ...]                      # supported among MODES' keys ("ulysses", "ring", "cfg", "tensor")
    lists: tuple[str, ...]                      # the denoiser's repeated block ModuleLists, in forward order
    seq_args: tuple[str, ...]                   # block arguments [B, L, C] split along L before a list's first block
    # block argument -> (sequence dim of each of its tensors, the seq_args its positions run over, in order):
    # the rotary tables, computed once for the whole sequence, cut to each rank's positions at every block
    rope_args: dict[str, tuple[int, tuple[str, ...]]] = field(default_factory=dict)
    self_attention: tuple[str, ...] = ()        # attention modules whose K/V are split like Q (cross: none)
    column: tuple[str, ...] = ()                # linears split by output features (heads, MLP hidden units)
    row: tuple[str, ...] = ()                   # linears split by input features; outputs all-reduced
    # row linear -> the column linears whose outputs its input concatenates, in order (FLUX single blocks)
    packed_row: dict[str, tuple[str, ...]] = field(default_factory=dict)
    heads: tuple[str, ...] = ()                 # attention modules whose `heads` count becomes heads / tensor size
    head_norms: tuple[str, ...] = ()            # RMSNorms over all heads' features (Wan): sum of squares all-reduced
    fixed_seq: dict[str, int] = field(default_factory=dict)   # seq_args of fixed length (padded text) -> tokens


@dataclass
class DiTMesh:
    """This rank's place in the mesh and the process groups of its axes."""

    config: DiffusionParallelConfig             # the sizes
    rank: int                                   # global rank
    cfg_rank: int                               # which CFG branch this rank computes (0: positive)
    ring_rank: int                              # index along the ring
    ulysses_rank: int                           # index inside the Ulysses group
    tp_rank: int                                # index inside the tensor-parallel group
    cfg_group: Optional[object] = None          # ranks differing only in cfg_rank (None: size 1)
    sp_group: Optional[object] = None           # ranks sharing one sequence (ring x ulysses), by sp_rank
    ulysses_group: Optional[object] = None      # ranks of one all-to-all
    ring_group: Optional[object] = None         # ranks of one ring
    tp_group: Optional[object] = None           # ranks sharing one block's weights
    ring_peers: tuple[int, int] = (0, 0)        # global ranks (next, previous) along the ring

    @property
    def sp_rank(self) -> int:
        """Which piece of the sequence this rank holds (ring-major, so a Ulysses group's pieces are adjacent)."""
        return self.ring_rank * self.config.ulysses_degree + self.ulysses_rank

    @property
    def sp_size(self) -> int:
        return self.config.sequence_parallel_size

    @classmethod
    def single(cls, config: Optional[DiffusionParallelConfig] = None) -> "DiTMesh":
        """The mesh of one process (every axis of size 1)."""
        return cls(config or DiffusionParallelConfig(), 0, 0, 0, 0, 0)

    @classmethod
    def build(cls, config: DiffusionParallelConfig) -> "DiTMesh":
        """Coordinates and sub-groups of this rank; every rank must call it, in the same order."""
        sizes = (config.cfg_parallel_size, config.ring_degree, config.ulysses_degree, config.tensor_parallel_size)
        if dist.get_world_size() != config.world_size:
            raise ValueError(f"parallel_config needs {config.world_size} ranks, the group has {dist.get_world_size()}")
        me = dist.get_rank()
        coords = {}
        for c in itertools.product(*(range(s) for s in sizes)):
            coords[c] = ((c[0] * sizes[1] + c[1]) * sizes[2] + c[2]) * sizes[3] + c[3]
        mine = next(c for c, r in coords.items() if r == me)
        groups = {}
        for name, axes in (("cfg", (0,)), ("sp", (1, 2)), ("ulysses", (2,)), ("ring", (1,)), ("tp", (3,))):
            if all(sizes[a] == 1 for a in axes):
                continue
            # one group per setting of the other axes; all ranks create all of them, in one order
            others = [a for a in range(4) if a not in axes]
            for fixed in itertools.product(*(range(sizes[a]) for a in others)):
                members = sorted((c for c in coords if all(c[a] == v for a, v in zip(others, fixed))),
                                 key=lambda c: tuple(c[a] for a in axes))
                group = dist.new_group([coords[c] for c in members])
                if all(mine[a] == v for a, v in zip(others, fixed)):
                    groups[name] = group
        ring = sizes[1]
        peer = lambda step: coords[(mine[0], (mine[1] + step) % ring, mine[2], mine[3])]  # noqa: E731
        return cls(config, me, mine[0], mine[1], mine[2], mine[3],
                   cfg_group=groups.get("cfg"), sp_group=groups.get("sp"), ulysses_group=groups.get("ulysses"),
                   ring_group=groups.get("ring"), tp_group=groups.get("tp"), ring_peers=(peer(1), peer(-1)))


def check_plan(family_name: str, plan: Optional[DiTParallelPlan], config: DiffusionParallelConfig,
               num_heads: int, column_sizes: dict[str, int]) -> None:
    """ValueError naming the option when `family_name` cannot run `config`: a mode it does not
    declare, or sizes that do not divide its heads (`num_heads`), MLP widths (`column_sizes`: column
    linear name -> output features) or fixed-length sequences."""
    asked = [mode for mode, option in MODES.items() if getattr(config, option) > 1]
    supported = plan.modes if plan is not None else ()
    for mode in asked:
        if mode not in supported:
            option = MODES[mode]
            what = ", ".join(MODES[m] for m in supported) or "none"
            raise ValueError(f"{option}={getattr(config, option)}: {family_name} does not support it "
                             f"(its parallel modes: {what}); set {option}=1")
    heads_split = config.ulysses_degree * config.tensor_parallel_size
    if num_heads % heads_split:
        ok = divisors_up_to(num_heads, max(heads_split, 8))
        raise ValueError(f"ulysses_degree x tensor_parallel_size = {heads_split} must divide the denoiser's "
                         f"{num_heads} attention heads; products that would work: {ok}")
    tp = config.tensor_parallel_size
    for name, size in column_sizes.items():
        if size % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide {name}'s {size} output features; "
                             f"sizes that would work: {divisors_up_to(size, max(tp, 8))}")
    for name, tokens in (plan.fixed_seq.items() if plan is not None else ()):
        if tokens % config.sequence_parallel_size:
            raise ValueError(f"ulysses_degree x ring_degree = {config.sequence_parallel_size} must divide the "
                             f"{tokens} tokens of {name}; sizes that would work: "
                             f"{divisors_up_to(tokens, max(config.sequence_parallel_size, 8))}")
