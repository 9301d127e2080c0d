"""CFG-parallel: the positive and negative branches of one denoiser batch on two ranks (every rank's process).

In: the runner's row blocks (one per task and CFG branch, `num_images` rows each, branch 0 = the
prompt, 1 = the negative prompt) and this rank's `DiTMesh` (`cfg_rank`). `cfg_blocks` picks the blocks
this rank computes (its branch; tasks without CFG have only branch 0, so they run on cfg rank 0);
`cfg_merge` all-gathers the two ranks' outputs (padded to equal rows: both know every block's size; nothing when no task runs CFG)
and puts the rows back in the runner's order, so that on every rank the guidance and the solver step
that follow see the same full batch as one process would.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from omnistage.parallel.mesh import DiTMesh


def cfg_blocks(branches: list[int], mesh: DiTMesh) -> list[int]:
    """Indices of the row blocks this rank computes."""
    if mesh.cfg_group is None:
        return list(range(len(branches)))
    return [i for i, b in enumerate(branches) if b == mesh.cfg_rank]


def cfg_merge(mine: Optional[torch.Tensor], branches: list[int], rows: list[int], mesh: DiTMesh
              ) -> Optional[torch.Tensor]:
    """The full output (all blocks, the runner's row order) from each rank's `mine` (its blocks' rows,
    in block order; None when it had no block). `rows[i]`: rows of block i. When no block is of
    branch 1, cfg rank 0 computed everything and nothing is exchanged (cfg rank 1 returns None)."""
    counts = [sum(r for r, b in zip(rows, branches) if b == c) for c in range(2)]
    if mesh.cfg_group is None or counts[1] == 0:
        return mine
    local = mine.new_zeros((max(counts),) + tuple(mine.shape[1:]))
    local[: mine.shape[0]] = mine
    pieces = [torch.empty_like(local) for _ in range(2)]
    dist.all_gather(pieces, local, group=mesh.cfg_group)
    taken, out = [0, 0], []
    for r, b in zip(rows, branches):
        out.append(pieces[b][taken[b]: taken[b] + r])
        taken[b] += r
    return torch.cat(out)
