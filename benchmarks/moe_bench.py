"""Tile sweep of the Triton MoE decode path (`triton_moe_small.routed_moe_small`) on one GPU, against the floor.

Run on the GPU machine:  PYTHONPATH=$PWD python benchmarks/moe_bench.py [--prefill] [--json out.json]   (< 60 s on an H200)

Shapes (bf16, random weights; Qwen3-Omni-30B-A3B, `qwen3_omni_bench.py`'s config): the thinker's MoE
(hidden 2048, 128 experts top-8, width 768) and the talker's (hidden 1024, 128 experts top-8, width 384,
plus a shared expert of 768), at T = 1, 2, 4, 8 rows (T * top-k <= `triton_moe_small.SMALL_PAIRS`).

Every time is per call, from a CUDA graph of CALLS calls, each call with its own rows and its own random
experts (so the L2 cache, 50 MB on an H200, does not hold the previous call's experts, as in a decode step
that goes through 48 layers). Per (shape, T):
  * the router launch (GEMV + softmax + top-k, `triton_moe_small.small_route`), the gate-up kernel and the down
    kernel alone, default tiles (`small_tiles`) and the best of a sweep (router: its candidates; gate-up,
    down: column tile x K step at 4 warps, then num_warps, then the K-loop unroll factor at the best so far;
    gate-up also the split-K candidates of `triton_moe_tiles.UP_CANDIDATES`);
    beside them the router as it ran before (cuBLAS GEMM + the one-launch `triton_moe_small.route`);
  * the whole MoE block (`moe.SparseMoeBlock`: router, both kernels, the shared expert where there is
    one) with the default tiles, with the sweep's best, and with what `moe_tune` chose at start-up (its
    first eager call: the tiles are printed);
  * the floor: the bytes the block must read (distinct experts hit, router, shared expert) at the copy
    bandwidth measured in the same run, and the block's share of it;
  * a dense GEMM pair of the same active FLOPs (x @ [H, 2*I*K], then [T, I*K] @ [I*K, H]; cuBLAS) and
    the sorted grouped-GEMM path (`triton_moe.fused_moe`) on the same inputs;
  * the max abs error of `triton_moe_small.routed_moe_small` (best tiles) against `moe.route` of the router's
    logits (`F.linear`) + `moe.fused_moe_ref`, beside the reference's peak; and of the
    whole block (the talker's shared expert term fused into the down launch) against its PyTorch path
    (`fused.ENABLED` off).
With --prefill only the thinker's prefill step (T=128): `triton_moe.fused_moe` at its default tiles and the
best of a `SortedTiles` sweep, the whole block from graphs and eager (host wall; "eager old": align's torch ops
instead of `triton_moe.align_one_launch`, as before), against the floor; then
`SORTED_TUNED = {...}` for `triton_moe_tiles.py`. Otherwise it prints `TUNED = {...}`: the best tiles per (T, top_k, hidden, width), to paste into
`omnistage/layers/triton_moe_tiles.py` (the start-up tuner's candidates are built around them).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

import torch

import torch.nn.functional as F

from omnistage.layers import fused, moe, moe_tune, triton_moe, triton_moe_small, triton_moe_tiles
from omnistage.layers.triton_moe_tiles import SmallTiles

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ar_bench import copy_bandwidth  # noqa: E402  (one way of measuring it for every benchmark)
from gemv_bench import graph_us  # noqa: E402  (one CUDA-graph timer for every benchmark)
from qwen3_omni_bench import TALKER_30B, THINKER_30B  # noqa: E402

SHAPES = {"thinker": (THINKER_30B["hidden_size"], THINKER_30B["num_experts"], THINKER_30B["num_experts_per_tok"],
                      THINKER_30B["moe_intermediate_size"], 0, True),
          "talker": (TALKER_30B["hidden_size"], TALKER_30B["num_experts"], TALKER_30B["num_experts_per_tok"],
                     TALKER_30B["moe_intermediate_size"], TALKER_30B["shared_expert_intermediate_size"], False)}
TS = (1, 2, 4, 8)
DEVICE = "cuda"
CALLS = 16                                   # calls per graph, each on other experts
MAX_TILE = 8192                              # elements of one weight tile (beyond: ~200+ registers or spills at 4 warps, sm_90)
UP_NK = [(n, k) for n in (2, 4, 8, 16, 32) for k in (256, 512, 1024) if 2 * n * k <= MAX_TILE]
DOWN_NK = [(n, k) for n in (2, 4, 8, 16) for k in (64, 128, 256, 512)]
WARPS = (2, 4, 8)                            # phase 2 (num_warps; num_stages changes nothing here)
UNROLLS = (2, 4)                             # phase 3: K-loop unroll factors (1 is phases 1-2)
# us per call of launch(i), i < CALLS, from one CUDA graph: the median of 7 timings of 4 replays
per_call_us = functools.partial(graph_us, calls=CALLS, trials=7, replays=4)


def sweep(time_with, base: SmallTiles, prefix: str, nk: list, k_bound: int, slots: int) -> tuple[float, SmallTiles]:
    """Three phases over one kernel's fields (`prefix` up / down): (n, k) at base's warps, then the warps
    at the best (n, k), then the K-loop unroll factor. Returns (us, tiles) of the fastest."""
    def timed_or_inf(tiles: SmallTiles) -> float:
        try:
            return time_with(tiles)
        except Exception as e:                  # e.g. a tile the compiler refuses: skipped, said
            print(f"skipped {tiles}: {type(e).__name__}: {str(e)[:200]}")
            return float("inf")

    best = (float("inf"), base)
    for n, k in nk:
        if k > 2 * k_bound or slots * n * k > MAX_TILE:
            continue
        tiles = dataclasses.replace(base, **{f"{prefix}_n": n, f"{prefix}_k": k})
        best = min(best, (timed_or_inf(tiles), tiles), key=lambda r: r[0])
    for w in WARPS:
        tiles = dataclasses.replace(best[1], **{f"{prefix}_warps": w})
        best = min(best, (timed_or_inf(tiles), tiles), key=lambda r: r[0])
    for u in UNROLLS:
        tiles = dataclasses.replace(best[1], **{f"{prefix}_unroll": u})
        best = min(best, (timed_or_inf(tiles), tiles), key=lambda r: r[0])
    return best


def block_of(h: int, e: int, k: int, inter: int, shared: int, norm: bool, w13, w2) -> moe.SparseMoeBlock:
    block = moe.SparseMoeBlock(h, e, k, inter, norm, shared).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, h ** -0.5)
        block.w13.copy_(w13)
        block.w2.copy_(w2)
    return block


def run_shape(name: str, bandwidth: float) -> tuple[list, dict]:
    h, e, k, inter, shared, norm = SHAPES[name]
    w13 = (torch.randn(e, 2 * inter, h, device=DEVICE) * h ** -0.5).bfloat16()
    w2 = (torch.randn(e, h, inter, device=DEVICE) * inter ** -0.5).bfloat16()
    block = block_of(h, e, k, inter, shared, norm, w13, w2)
    dense_a = torch.randn(h, 2 * inter * k, device=DEVICE, dtype=torch.bfloat16)
    dense_b = torch.randn(inter * k, h, device=DEVICE, dtype=torch.bfloat16)
    rows, tuned = [], {}
    for t in TS:
        xs = [torch.randn(t, h, device=DEVICE, dtype=torch.bfloat16) for _ in range(CALLS)]
        gate = block.gate.weight
        routed = [moe.route(F.linear(x, gate), k, norm) for x in xs]
        default = triton_moe_small.small_tiles(t, k, h, inter, torch.cuda.get_device_properties(DEVICE).multi_processor_count)
        mids = [triton_moe_small.small_gate_up(xs[i], w13, routed[i][1], default) for i in range(CALLS)]

        def route_us(tiles):
            return per_call_us(lambda i: triton_moe_small.small_route(xs[i], gate, k, norm, tiles))

        def up_us(tiles):
            return per_call_us(lambda i: triton_moe_small.small_gate_up(xs[i], w13, routed[i][1], tiles))

        def down_us(tiles):
            return per_call_us(lambda i: triton_moe_small.small_down(mids[i], w2, routed[i][0], routed[i][1], tiles))

        route_times = [(route_us(c), c) for c in triton_moe_tiles.candidates(default, "route")]
        route_best, route_tiles = min(route_times, key=lambda r: r[0])
        route_old = per_call_us(lambda i: triton_moe_small.route(F.linear(xs[i], gate), k, norm))
        up_best, up_tiles = sweep(up_us, default, "up", UP_NK, h, 2)
        for tiles in triton_moe_tiles.candidates(default, "up"):    # the split-K GEMVs the start-up tuner tries
            if tiles.up_split > 1:
                up_best, up_tiles = min((up_best, up_tiles), (up_us(tiles), tiles), key=lambda r: r[0])
        down_best, down_tiles = sweep(down_us, default, "down", DOWN_NK, inter, triton_moe.triton.next_power_of_2(k))
        best = dataclasses.replace(up_tiles, **{f: getattr(down_tiles, f) for f in
                                                ("down_n", "down_k", "down_warps", "down_unroll")},
                                   **{f: getattr(route_tiles, f) for f in ("route_r", "route_k", "route_warps")})
        key = (t, k, h, inter)
        saved = triton_moe_tiles.TUNED.get(key)
        with torch.no_grad():
            moe_tune.ENABLED = False             # the table / rule, untimed
            layer_default = per_call_us(lambda i: block(xs[i]))
            triton_moe_tiles.TUNED[key] = best
            layer_best = per_call_us(lambda i: block(xs[i]))
            if saved is None:
                del triton_moe_tiles.TUNED[key]
            else:
                triton_moe_tiles.TUNED[key] = saved
            moe_tune.ENABLED = True              # the start-up choice: timed on the first eager call
            moe_tune.CHOSEN.clear()
            layer_startup = per_call_us(lambda i: block(xs[i]))
            startup = next(iter(moe_tune.CHOSEN.values()))
        print(f"{name} T={t}: start-up choice {startup}; sweep best {best}")
        dense = per_call_us(lambda i: (xs[i] @ dense_a)[:, :inter * k] @ dense_b)
        sorted_path = per_call_us(lambda i: triton_moe.fused_moe(xs[i], w13, w2, *routed[i]))
        with torch.no_grad():                   # the whole block (shared expert included) vs its PyTorch path
            fast_block = block(xs[0])
            fused.ENABLED = False
            ref_block = block(xs[0])
            fused.ENABLED = True
        block_err = (fast_block.float() - ref_block.float()).abs().max().item()
        ref = moe.fused_moe_ref(xs[0], w13, w2, *routed[0])
        got = triton_moe_small.routed_moe_small(xs[0], gate, w13, w2, k, norm, tiles=best)
        hit = sum(r[1].unique().numel() for r in routed) / CALLS
        weight_bytes = 2 * (hit * 3 * inter * h + e * h + (3 * shared * h + h if shared else 0))
        floor_us = weight_bytes / bandwidth * 1e6
        rows.append(dict(shape=name, T=t, route_old_us=route_old, route_default_us=route_us(default),
                         route_best_us=route_best, up_default_us=up_us(default), up_best_us=up_best,
                         down_default_us=down_us(default), down_best_us=down_best,
                         layer_default_us=layer_default, layer_best_us=layer_best, layer_startup_us=layer_startup,
                         startup=dataclasses.asdict(startup), floor_us=floor_us,
                         floor_share=floor_us / layer_best, dense_same_flops_us=dense, sorted_path_us=sorted_path,
                         err=(got.float() - ref.float()).abs().max().item(), peak=ref.float().abs().max().item(),
                         block_err=block_err, block_peak=ref_block.float().abs().max().item(),
                         best=dataclasses.asdict(best)))
        tuned[(t, k, h, inter)] = best
    return rows, tuned


PREFILL_TS = (128,)                          # q3_thinker_bench's prompt: one prefill step of 128 rows
# us per call of a prefill-size launch: fewer calls per graph (each reads ~1 GB of experts)
prefill_us = functools.partial(graph_us, calls=4, trials=5, replays=2)


def eager_us(fn, iters: int = 20) -> float:
    """Host-inclusive microseconds per call of `fn()` run eagerly back to back (what an eager prefill step
    pays: the launches' host cost, where it exceeds the kernels', included)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def run_prefill(bandwidth: float) -> tuple[list, dict]:
    """The thinker's MoE at prefill sizes (T * top-k > SMALL_PAIRS: `triton_moe.fused_moe`, the sorted
    grouped GEMMs): the default `SortedTiles`, the best of `triton_moe_tiles.sorted_candidates` (gate-up's at
    the default down, then down's at the best gate-up), the whole block eager and graphed, and the floor."""
    h, e, k, inter, shared, norm = SHAPES["thinker"]
    w13 = (torch.randn(e, 2 * inter, h, device=DEVICE) * h ** -0.5).bfloat16()
    w2 = (torch.randn(e, h, inter, device=DEVICE) * inter ** -0.5).bfloat16()
    block = block_of(h, e, k, inter, shared, norm, w13, w2)
    rows, tuned = [], {}
    for t in PREFILL_TS:
        xs = [torch.randn(t, h, device=DEVICE, dtype=torch.bfloat16) for _ in range(4)]
        routed = [moe.route(F.linear(x, block.gate.weight), k, norm) for x in xs]
        bm = triton_moe._block_m(t * k, e)
        default = triton_moe_tiles.sorted_tiles(bm, h, inter)

        def moe_us(tiles):
            try:
                return prefill_us(lambda i: triton_moe.fused_moe(xs[i], w13, w2, *routed[i], tiles=tiles))
            except Exception as err:            # a tile the compiler refuses (shared memory): skipped, said
                print(f"skipped {tiles}: {type(err).__name__}: {str(err)[:200]}")
                return float("inf")

        base_us = moe_us(default)
        best_us, best = base_us, default
        for which in ("up", "down"):
            for tiles in triton_moe_tiles.sorted_candidates(best, which)[1:]:
                us = moe_us(tiles)
                print(f"  T={t} {which} {dataclasses.asdict(tiles)}: {us:.1f} us (default {base_us:.1f})")
                best_us, best = min((best_us, best), (us, tiles), key=lambda r: r[0])
        saved = triton_moe_tiles.SORTED_TUNED.get((bm, h, inter))
        with torch.no_grad():
            layer_default = prefill_us(lambda i: block(xs[i]))
            layer_eager_default = eager_us(lambda: block(xs[0]))
            align_pairs, triton_moe.ALIGN_PAIRS = triton_moe.ALIGN_PAIRS, 0     # as before: align's torch ops
            layer_eager_old = eager_us(lambda: block(xs[0]))
            triton_moe.ALIGN_PAIRS = align_pairs
            triton_moe_tiles.SORTED_TUNED[(bm, h, inter)] = best
            layer_best = prefill_us(lambda i: block(xs[i]))
            layer_eager_best = eager_us(lambda: block(xs[0]))
            got = block(xs[0])
            fused.ENABLED = False
            ref = block(xs[0])
            fused.ENABLED = True
        if saved is None:
            del triton_moe_tiles.SORTED_TUNED[(bm, h, inter)]
        else:
            triton_moe_tiles.SORTED_TUNED[(bm, h, inter)] = saved
        hit = sum(r[1].unique().numel() for r in routed) / len(routed)
        floor_us = 2 * (hit * 3 * inter * h + e * h) / bandwidth * 1e6
        print(f"thinker prefill T={t} (BLOCK_M {bm}): default {default}; best {best}")
        rows.append(dict(shape="thinker", T=t, block_m=bm, moe_default_us=base_us, moe_best_us=best_us,
                         layer_default_us=layer_default, layer_best_us=layer_best,
                         layer_eager_old_us=layer_eager_old, layer_eager_default_us=layer_eager_default, layer_eager_best_us=layer_eager_best,
                         floor_us=floor_us, floor_share=floor_us / layer_best, experts_hit=hit,
                         block_err=(got.float() - ref.float()).abs().max().item(),
                         block_peak=ref.float().abs().max().item(), best=dataclasses.asdict(best)))
        tuned[(bm, h, inter)] = best
    return rows, tuned


def print_prefill(rows: list, tuned: dict) -> None:
    print(f"{'shape':<8} {'T':>4} {'moe def':>8} {'moe best':>8} {'layer def':>9} {'layer best':>10} "
          f"{'eager old':>9} {'eager def':>9} {'eager best':>10} {'floor':>6} {'% floor':>7} {'block err':>9} {'peak':>6}")
    for r in rows:
        print(f"{r['shape']:<8} {r['T']:>4} {r['moe_default_us']:>8.1f} {r['moe_best_us']:>8.1f} "
              f"{r['layer_default_us']:>9.1f} {r['layer_best_us']:>10.1f} {r['layer_eager_old_us']:>9.1f} "
              f"{r['layer_eager_default_us']:>9.1f} "
              f"{r['layer_eager_best_us']:>10.1f} {r['floor_us']:>6.1f} {100 * r['floor_share']:>6.0f}% "
              f"{r['block_err']:>9.1e} {r['block_peak']:>6.2f}")
    print("\nSORTED_TUNED = {")
    for key, tiles in tuned.items():
        print(f"    {key}: {tiles!r},")
    print("}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--prefill", action="store_true",
                        help="only the prefill rows (T=128, the sorted grouped GEMMs' tile sweep)")
    args = parser.parse_args()
    torch.manual_seed(0)
    start = time.perf_counter()
    bandwidth = copy_bandwidth()
    if args.prefill:
        with torch.no_grad():
            rows, tuned = run_prefill(bandwidth)
        print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; us per call (graphs; eager: host wall)")
        print_prefill(rows, tuned)
        print(f"\n({time.perf_counter() - start:.0f} s)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    rows, tuned = [], {}
    for name in SHAPES:
        with torch.no_grad():
            r, t = run_shape(name, bandwidth)
        rows += r
        tuned.update(t)
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; us per call from CUDA graphs")
    print(f"{'shape':<8} {'T':>2} {'rt old':>6} {'rt def':>6} {'rt best':>7} {'up def':>7} {'up best':>7} {'dn def':>7} {'dn best':>7} {'layer def':>9} "
          f"{'layer best':>10} {'startup':>7} {'floor':>6} {'% floor':>7} {'dense':>6} {'sorted':>7} {'err':>8} {'peak':>6} "
          f"{'block err':>9} {'peak':>6}")
    for r in rows:
        print(f"{r['shape']:<8} {r['T']:>2} {r['route_old_us']:>6.1f} {r['route_default_us']:>6.1f} "
              f"{r['route_best_us']:>7.1f} {r['up_default_us']:>7.1f} {r['up_best_us']:>7.1f} "
              f"{r['down_default_us']:>7.1f} {r['down_best_us']:>7.1f} {r['layer_default_us']:>9.1f} "
              f"{r['layer_best_us']:>10.1f} {r['layer_startup_us']:>7.1f} {r['floor_us']:>6.1f} {100 * r['floor_share']:>6.0f}% "
              f"{r['dense_same_flops_us']:>6.1f} {r['sorted_path_us']:>7.1f} {r['err']:>8.1e} {r['peak']:>6.2f} "
              f"{r['block_err']:>9.1e} {r['block_peak']:>6.2f}")
    print("\nTUNED = {")
    for key, tiles in tuned.items():
        print(f"    {key}: {tiles!r},")
    print("}")
    print(f"\n({time.perf_counter() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
