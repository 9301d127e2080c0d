"""Launch shapes of `triton_moe_small`'s decode kernels (data and the default rule; any process).

`SmallTiles`: the tiles of the router, gate-up and down launches of `triton_moe_small.routed_moe_small`.
`TUNED`: measured defaults per (T, top_k, hidden, moe_intermediate) (benchmarks/moe_bench.py on an H200);
`small_tiles` picks them or the rule. `CANDIDATES`: what `moe_tune` times on the device at start-up.
`SortedTiles`: the tiles of `triton_moe.fused_moe`'s grouped GEMMs (prefill sizes), `SORTED_TUNED` / `sorted_tiles`
their measured table per tile height (`benchmarks/moe_bench.py --prefill` sweeps `SORTED_CANDIDATES`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

_PROGRAMS_PER_SM = 4                            # the default tiles' target: loads of ~4 programs in flight per SM


@dataclass(frozen=True)
class SmallTiles:
    """Launch shapes of `routed_moe_small`'s three kernels (`benchmarks/moe_bench.py` sweeps them). No
    num_stages: Triton does not pipeline these loops' plain loads (the same PTX at 1..3 stages, sm_90),
    so the loads in flight come from the programs resident per SM (tile size against registers) and
    from unrolling the K loop (`*_unroll`: the next steps' loads issued before this one's sums)."""
    up_n: int = 4              # gate-up: output columns of I per program (each also reads the matching up rows)
    up_k: int = 512            # gate-up: elements of H per loop step
    up_warps: int = 4          # gate-up: num_warps
    up_unroll: int = 1         # gate-up: K-loop unroll factor (more weight loads in flight per program)
    up_split: int = 1          # gate-up: slices of H (split-K; > 1: float32 partials, the last slice sums them)
    down_n: int = 2            # down: output columns of H per program (all K slots of the token in one tile)
    down_k: int = 256          # down: elements of I per loop step
    down_warps: int = 4        # down: num_warps
    down_unroll: int = 1       # down: K-loop unroll factor
    down_split: int = 1        # down: slices of I (split-K, as up_split)
    route_r: int = 2           # router: experts (rows of the gate weight) per program
    route_k: int = 1024        # router: elements of H per loop step
    route_warps: int = 4       # router: num_warps (the last program's top-k compares [E, E] pairs: more warps,
                               # fewer pairs each; fewer warps, fewer cross-warp steps in its reductions)


# (T, top_k, hidden, moe_intermediate) -> the fastest tiles of `benchmarks/moe_bench.py` on an H200
# (session 7 run 2, Qwen3-Omni-30B-A3B thinker / talker shapes; benchmarks/RESULTS.md); shapes not
# listed get `small_tiles`' default (enough programs for every SM)
TUNED: dict[tuple[int, int, int, int], SmallTiles] = {
    (1, 8, 2048, 768): SmallTiles(up_n=4, up_k=1024, down_n=8, down_k=256),
    (2, 8, 2048, 768): SmallTiles(up_n=4, up_k=1024, down_n=2, down_k=128),
    (4, 8, 2048, 768): SmallTiles(up_n=4, up_k=1024, down_n=8, down_k=64),
    (8, 8, 2048, 768): SmallTiles(up_n=4, up_k=1024, down_n=8, down_k=64),
    (1, 8, 1024, 384): SmallTiles(up_n=4, up_k=1024, down_n=2, down_k=512, down_warps=8),
    (2, 8, 1024, 384): SmallTiles(up_n=4, up_k=256, down_n=2, down_k=128, down_warps=8),
    (4, 8, 1024, 384): SmallTiles(up_n=4, up_k=1024, down_n=2, down_k=128),
    (8, 8, 1024, 384): SmallTiles(up_n=4, up_k=1024, down_n=8, down_k=64),
}


def small_tiles(t: int, k: int, hidden: int, inter: int, sms: int) -> SmallTiles:
    """The tuned tiles of this shape, else the defaults, gate-up's column tile halved when 8 leaves fewer
    than ~`_PROGRAMS_PER_SM` programs per SM. (sm_90 compiles of the defaults, cuobjdump: gate-up ~96
    registers, down ~109 at [8, 2, 256]: 4-5 programs per SM resident, no spills; down at [8, 4, 256]
    takes 212, [8, 8, 128] spills.)"""
    if (t, k, hidden, inter) in TUNED:
        return TUNED[(t, k, hidden, inter)]
    up_n = 8 if t * k * -(-inter // 8) >= _PROGRAMS_PER_SM * sms else 4
    return SmallTiles(up_n=up_n)




# what `moe_tune` times per kernel at start-up, each a change to the shape's `small_tiles`: today's tiles,
# narrower / wider column tiles, longer K steps (fewer, bigger loads), unrolled K loops, 8 warps
# and split-K GEMVs (many programs, each a slice of H for a block of an expert's rows)
UP_CANDIDATES = [dict(), dict(up_n=2, up_k=1024), dict(up_n=4, up_k=1024), dict(up_n=4, up_k=2048),
                 dict(up_n=8, up_k=512), dict(up_n=8, up_k=1024, up_warps=8), dict(up_n=4, up_k=512, up_unroll=2),
                 dict(up_n=16, up_k=256, up_warps=8), dict(up_n=8, up_k=512, up_split=4),
                 dict(up_n=16, up_k=256, up_split=4), dict(up_n=16, up_k=256, up_split=8),
                 dict(up_n=32, up_k=128, up_split=8, up_warps=8),
                 # all of H in one or two steps at 8 warps (the most weight bytes in flight per program)
                 dict(up_n=4, up_k=2048, up_warps=8), dict(up_n=2, up_k=2048),
                 dict(up_n=8, up_k=1024, up_unroll=2, up_warps=8), dict(up_n=2, up_k=1024, up_unroll=2)]
DOWN_CANDIDATES = [dict(), dict(down_n=2, down_k=128), dict(down_n=8, down_k=64), dict(down_n=8, down_k=256),
                   dict(down_n=2, down_k=512, down_warps=8), dict(down_n=4, down_k=128),
                   dict(down_n=4, down_k=64, down_unroll=2), dict(down_n=1, down_k=512),
                   dict(down_n=8, down_k=128, down_split=3), dict(down_n=4, down_k=128, down_split=3),
                   dict(down_n=8, down_k=64, down_split=4),
                   # split-K over the expert rows with more columns per program: every program one or two
                   # K steps, all their loads issued before the first sum
                   dict(down_n=8, down_k=256, down_split=3), dict(down_n=16, down_k=64, down_split=4),
                   dict(down_n=16, down_k=128, down_split=6, down_warps=8), dict(down_n=8, down_k=256, down_warps=8),
                   dict(down_n=4, down_k=256, down_split=3),
                   # the next K step's loads issued before this one's sums (unrolled), at tiles small
                   # enough for two steps' registers
                   dict(down_n=4, down_k=256, down_unroll=2), dict(down_n=8, down_k=128, down_unroll=2)]
ROUTE_CANDIDATES = [dict(), dict(route_warps=1), dict(route_r=1, route_k=2048),
                    dict(route_r=1, route_k=2048, route_warps=1), dict(route_r=1, route_k=2048, route_warps=2),
                    dict(route_r=4, route_k=512), dict(route_r=8, route_k=256),
                    # a few gate rows per program over all of H (the norm from the same loads, once per
                    # program): half / a quarter of the programs behind the ticket
                    dict(route_r=2, route_k=2048, route_warps=2), dict(route_r=4, route_k=2048, route_warps=4),
                    # the top-k's rank comparison ([128, 128] pairs for the thinker) split over more threads
                    dict(route_r=1, route_k=2048, route_warps=4), dict(route_r=1, route_k=2048, route_warps=8),
                    dict(route_r=2, route_k=1024, route_warps=8)]


def candidates(base: SmallTiles, which: str) -> list[SmallTiles]:
    """`base` changed by each entry of UP_ / DOWN_ / ROUTE_CANDIDATES (`which`: "up", "down" or "route"),
    duplicates dropped, `base` first."""
    table = {"up": UP_CANDIDATES, "down": DOWN_CANDIDATES, "route": ROUTE_CANDIDATES}[which]
    out: list[SmallTiles] = []
    for change in table:
        tiles = replace(base, **change)
        if tiles not in out:
            out.append(tiles)
    return out


@dataclass(frozen=True)
class SortedTiles:
    """Launch shapes of `triton_moe.fused_moe`'s two grouped GEMMs (rows sorted by expert, BLOCK_M rows
    per tile from `triton_moe._block_m`); the defaults are what it launched before the table existed."""
    up_n: int = 64             # gate-up: columns of I per program (each also reads the matching up columns)
    up_k: int = 64             # gate-up: elements of H per loop step
    up_warps: int = 4          # gate-up: num_warps
    up_stages: int = 3         # gate-up: num_stages (software-pipelined weight loads: tl.dot loops pipeline)
    down_n: int = 64           # down: columns of H per program
    down_k: int = 64           # down: elements of I per loop step
    down_warps: int = 4        # down: num_warps
    down_stages: int = 3       # down: num_stages


# (BLOCK_M, hidden, moe_intermediate) -> the fastest `SortedTiles` of `benchmarks/moe_bench.py --prefill` on
# an H200 (session 9 run 4, the thinker at T=128: 362.3 -> 349.3 us, 81% of the floor; every candidate within
# 4%); shapes not listed keep the defaults
SORTED_TUNED: dict[tuple[int, int, int], SortedTiles] = {
    (16, 2048, 768): SortedTiles(up_n=128, up_k=128, up_warps=8, up_stages=3, down_n=64, down_k=128, down_warps=4,
                                 down_stages=4),
}

# what `moe_bench.py --prefill` times per grouped GEMM (changes to the defaults; gate-up and down separately):
# wider column tiles and longer K steps (fewer, bigger loads per stage), deeper pipelines, 8 warps
SORTED_CANDIDATES = [dict(), dict(n=64, k=128), dict(n=128, k=64), dict(n=128, k=128, warps=8), dict(n=64, k=256),
                     dict(n=64, k=128, stages=4), dict(n=128, k=64, stages=4), dict(n=32, k=256, stages=4),
                     dict(n=128, k=128, stages=4, warps=8)]


def sorted_tiles(block_m: int, hidden: int, inter: int) -> SortedTiles:
    """The measured grouped-GEMM tiles of this shape, else the defaults."""
    return SORTED_TUNED.get((block_m, hidden, inter), SortedTiles())


def sorted_candidates(base: SortedTiles, which: str) -> list[SortedTiles]:
    """`base` with each SORTED_CANDIDATES change applied to the `which` ("up" or "down") kernel, `base` first."""
    out: list[SortedTiles] = []
    for change in SORTED_CANDIDATES:
        tiles = replace(base, **{f"{which}_{name}": value for name, value in change.items()})
        if tiles not in out:
            out.append(tiles)
    return out
