"""GPU check and timing of the Triton fused MoE (`layers/triton_moe.py`) at Qwen3-Omni-30B-A3B thinker shapes.

Run on the GPU machine:  PYTHONPATH=$PWD python benchmarks/moe_check_cuda.py [--decode] [--json out.json]

Shapes: hidden 2048, 128 experts, top-8, moe_intermediate 768, bf16, random weights and router logits;
T = 1, 8, 64, 256, 2048 rows. Per T it prints:
  * max abs error of the Triton path against the PyTorch reference (`moe.fused_moe_ref`, same weights)
    beside the reference's largest value, in bf16 and in fp32 (fp32 only up to T=256);
  * time of the Triton path (eager, and replayed from a CUDA graph, which also proves it has no host
    sync), of the reference path, of transformers' Qwen3OmniMoeThinkerTextExperts forward (its default
    experts implementation) on the same weights, and of a dense GEMM pair with the same active FLOPs
    (x [T, 2048] @ [2048, 2*768*8] then [T, 768*8] @ [768*8, 2048]) -- the floor to compare against;
  * the weight bytes the step must read (the distinct experts hit) over 4 TB/s: the bandwidth floor.
Then, at T = 1, 8, 64, the decode path without the sort (`triton_moe_small.fused_moe_small`, what
`moe.fused_moe` runs when T*K <= SMALL_PAIRS) beside the sorted one, both from CUDA graphs: its error
against the reference, its ms with the default tiles (`benchmarks/moe_bench.py` sweeps them), and the
whole routed layer (router GEMM + routing + experts) with torch's routing and the sorted
kernels vs `moe.routed_moe` (the small path: router GEMV with its top-k, gate-up, down, in the tiles
`moe_tune` times on the first call, printed) and its error against the reference on the same
router logits -- each beside the bandwidth floor.
The sorted path's rows also time it as it ran before (old: `triton_moe.align`'s torch ops, the default
`SortedTiles`) beside today's (the one-launch align up to ALIGN_PAIRS pairs, the `SORTED_TUNED` tiles). With
--decode instead, at T = 1, 2, 4, 8, the decode kernels in the tiles the start-up tuner picks from session 9's candidate lists
(old) and from today's (new), per kernel and for the thinker's whole block, beside their floors at 4.2 TB/s;
then, in the new tiles, the block and the block followed by the next layer's input RMSNorm (the kernel after
down in the thinker's step) with programmatic dependent launch on and off (`layers/pdl.py`; whatever
OMNISTAGE_PDL says, both are timed), and the router's top-k (`triton_moe_small.route`) against torch's
softmax + topk + renormalisation on random logits (the same experts; weights to float32 rounding).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import torch

from omnistage.layers import fused, moe, moe_tune, pdl, triton_fused, triton_moe, triton_moe_small, triton_moe_tiles

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemv_bench import graph_us  # noqa: E402  (one CUDA-graph timer for every benchmark)

H, E, K, I = 2048, 128, 8, 768
TS = (1, 8, 64, 256, 2048)
SMALL_TS = (1, 8, 64)
DECODE_TS = (1, 2, 4, 8)
# the start-up tuner's candidate lists as session 9 ran them (the first entries of today's): "old" tiles
OLD_LISTS = {"UP_CANDIDATES": 12, "DOWN_CANDIDATES": 11, "ROUTE_CANDIDATES": 7}


def timed(fn, iters: int = 50) -> float:
    """Median ms of `fn()` over `iters` runs after warm-up (CUDA events)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def graphed(fn):
    """`fn` captured in a CUDA graph; returns the replay callable (raises if `fn` syncs with the host)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def hf_experts(w13: torch.Tensor, w2: torch.Tensor):
    """transformers' experts module holding the same weights, or None if it cannot be built here."""
    try:
        from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTextConfig
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextExperts
    except ImportError:
        return None
    cfg = Qwen3OmniMoeTextConfig(hidden_size=H, num_experts=E, moe_intermediate_size=I, num_experts_per_tok=K)
    mod = Qwen3OmniMoeThinkerTextExperts(cfg).to("cuda", w13.dtype)
    with torch.no_grad():
        mod.gate_up_proj.copy_(w13)
        mod.down_proj.copy_(w2)
    return mod


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--decode", action="store_true", help="instead: the decode kernels' old / new table")
    args = parser.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    rows = []
    w13_f = torch.randn(E, 2 * I, H, device=dev) * H ** -0.5
    w2_f = torch.randn(E, H, I, device=dev) * I ** -0.5
    w13, w2 = w13_f.bfloat16(), w2_f.bfloat16()
    if args.decode:
        logging.basicConfig(format="%(message)s")
        pdl_on_off(w13, w2, decode_old_new(w13, w2))
        route_check()
        return
    hf = hf_experts(w13, w2)
    for t in TS:
        x = torch.randn(t, H, device=dev, dtype=torch.bfloat16)
        weights, ids = moe.route(torch.randn(t, E, device=dev), K, True)
        fast = triton_moe.fused_moe(x, w13, w2, weights, ids)
        ref = moe.fused_moe_ref(x, w13, w2, weights, ids)
        err_bf16 = (fast.float() - ref.float()).abs().max().item()
        peak = ref.float().abs().max().item()
        err_fp32 = None
        if t <= 256:
            xf = x.float()
            err_fp32 = (triton_moe.fused_moe(xf, w13_f, w2_f, weights, ids)
                        - moe.fused_moe_ref(xf, w13_f, w2_f, weights, ids)).abs().max().item()
        ms_fast = timed(lambda: triton_moe.fused_moe(x, w13, w2, weights, ids))
        saved, triton_moe.ALIGN_PAIRS = triton_moe.ALIGN_PAIRS, 0     # the torch align, default tiles: before
        ms_old = timed(lambda: triton_moe.fused_moe(x, w13, w2, weights, ids, tiles=triton_moe_tiles.SortedTiles()))
        ms_graph_old = timed(graphed(lambda: triton_moe.fused_moe(x, w13, w2, weights, ids,
                                                                  tiles=triton_moe_tiles.SortedTiles())))
        triton_moe.ALIGN_PAIRS = saved
        ms_graph = timed(graphed(lambda: triton_moe.fused_moe(x, w13, w2, weights, ids)))
        ms_ref = timed(lambda: moe.fused_moe_ref(x, w13, w2, weights, ids), iters=10)
        ms_hf = None
        if hf is not None:
            with torch.no_grad():
                ms_hf = timed(lambda: hf(x, ids, weights.bfloat16()), iters=10)
        a = torch.randn(H, 2 * I * K, device=dev, dtype=torch.bfloat16)
        b = torch.randn(I * K, H, device=dev, dtype=torch.bfloat16)
        ms_dense = timed(lambda: (x @ a)[:, :I * K] @ b)
        hit = ids.unique().numel()
        floor_ms = hit * 3 * I * H * 2 / 4e12 * 1e3
        rows.append(dict(T=t, err_bf16=err_bf16, err_fp32=err_fp32, ref_peak=peak, triton_ms=ms_fast,
                         triton_graph_ms=ms_graph, triton_old_ms=ms_old, triton_graph_old_ms=ms_graph_old, reference_ms=ms_ref, transformers_ms=ms_hf,
                         dense_same_flops_ms=ms_dense, experts_hit=hit, bandwidth_floor_ms=floor_ms))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"{'T':>5} {'err bf16':>9} {'err fp32':>9} {'peak':>6} {'old':>8} {'triton':>8} {'old grph':>8} "
          f"{'graph':>8} {'ref':>8} {'hf':>8} {'dense':>8} {'bw floor':>8}  (ms; old: torch align, default tiles)")
    for r in rows:
        f32 = f"{r['err_fp32']:.1e}" if r["err_fp32"] is not None else "-"
        hf_ms = f"{r['transformers_ms']:.3f}" if r["transformers_ms"] is not None else "-"
        print(f"{r['T']:>5} {r['err_bf16']:>9.1e} {f32:>9} {r['ref_peak']:>6.2f} {r['triton_old_ms']:>8.3f} "
              f"{r['triton_ms']:>8.3f} {r['triton_graph_old_ms']:>8.3f} {r['triton_graph_ms']:>8.3f} {r['reference_ms']:>8.3f} {hf_ms:>8} {r['dense_same_flops_ms']:>8.3f} "
              f"{r['bandwidth_floor_ms']:>8.3f}")
    small_path(w13, w2)


def tuned(x, gate, w13, w2, lists: dict | None):
    """(tiles, seconds) of `moe_tune` for rows like `x`, with the candidate lists cut to `lists` (None: all)."""
    saved = {name: getattr(triton_moe_tiles, name) for name in OLD_LISTS}
    if lists is not None:
        for name, keep in lists.items():
            setattr(triton_moe_tiles, name, saved[name][:keep])
    moe_tune.CHOSEN.clear()
    try:
        tiles = moe_tune.tiles_for(x, gate, w13, w2, K, True)
    finally:
        for name, table in saved.items():
            setattr(triton_moe_tiles, name, table)
    return tiles, next(iter(moe_tune.SECONDS.values()))


def decode_old_new(w13: torch.Tensor, w2: torch.Tensor) -> dict:
    """The decode kernels (the thinker layer's block: residual add + RMSNorm in the router launch) in the
    tiles the start-up tuner picks from session 9's candidate lists (old) and from today's (new): us per
    call, 16 calls per CUDA graph each on its own rows (other experts; L2 does not hold them), and the
    tuner's seconds (each includes compiles only of candidates no earlier call compiled), and the new
    tiles' block against the PyTorch reference (RMSNorm, router, `moe.route`, `fused_moe_ref`). Returns the new
    tiles per T."""
    chosen = {}
    gate = torch.randn(E, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5
    nw = 1 + 0.1 * torch.randn(H, device="cuda", dtype=torch.bfloat16)
    print(f"\n{'T':>3} {'kernel':>7} {'old us':>7} {'new us':>7} {'floor':>6}   (tuner s old / new; tiles)")
    for t in DECODE_TS:
        xs = [torch.randn(t, H, device="cuda", dtype=torch.bfloat16) for _ in range(16)]
        res = [torch.randn(t, H, device="cuda", dtype=torch.bfloat16) for _ in range(16)]
        moe_tune.SECONDS.clear()
        old, old_s = tuned(xs[0], gate, w13, w2, OLD_LISTS)
        moe_tune.SECONDS.clear()
        moe_tune.log.setLevel(logging.DEBUG)    # each candidate's time (changed fields only), today's lists
        new, new_s = tuned(xs[0], gate, w13, w2, None)
        moe_tune.log.setLevel(logging.WARNING)
        chosen[t] = new
        routed = [triton_moe_small.small_route(x, gate, K, True, new) for x in xs]
        mids = [triton_moe_small.small_gate_up(xs[i], w13, routed[i][1], new) for i in range(16)]
        hit = sum(r[1].unique().numel() for r in routed) / 16
        floors = {"route": 2 * (E * H + 3 * t * H) / 4.2e12 * 1e6, "up": 2 * hit * 2 * I * H / 4.2e12 * 1e6,
                  "down": 2 * hit * I * H / 4.2e12 * 1e6}
        runs = {"route": lambda c: lambda i: triton_moe_small.small_route(xs[i], gate, K, True, c,
                                                                          (res[i], nw, 1e-6)),
                "up": lambda c: lambda i: triton_moe_small.small_gate_up(xs[i], w13, routed[i][1], c),
                "down": lambda c: lambda i: triton_moe_small.small_down(mids[i], w2, *routed[i], c),
                "block": lambda c: lambda i: triton_moe_small.routed_moe_small(xs[i], gate, w13, w2, K, True, c,
                                                                               prenorm=(res[i], nw, 1e-6))}
        floors["block"] = sum(floors.values())
        for name, run in runs.items():
            print(f"{t:>3} {name:>7} {graph_us(run(old), calls=16):>7.1f} {graph_us(run(new), calls=16):>7.1f} "
                  f"{floors[name]:>6.1f}")
        normed = fused.rms_norm_ref(xs[0] + res[0], nw, 1e-6)
        ref = moe.fused_moe_ref(normed, w13, w2, *moe.route(normed @ gate.T, K, True))
        got = triton_moe_small.routed_moe_small(xs[0], gate, w13, w2, K, True, new, prenorm=(res[0], nw, 1e-6))[0]
        print(f"    new tiles' block err {(got.float() - ref.float()).abs().max().item():.1e} "
              f"(peak {ref.float().abs().max().item():.2f}); tuner {old_s:.1f} s / {new_s:.1f} s; old {old}; new {new}")
    return chosen


def pdl_on_off(w13: torch.Tensor, w2: torch.Tensor, chosen: dict) -> None:
    """us per call of the thinker's block, and of the block + the next layer's input RMSNorm, PDL on / off
    (16 calls per CUDA graph, each on its own rows), in the tiles `decode_old_new` chose."""
    gate = torch.randn(E, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5
    nw = 1 + 0.1 * torch.randn(H, device="cuda", dtype=torch.bfloat16)
    saved = pdl.ENABLED
    print(f"\n{'T':>3} {'launches':>11} {'PDL on':>7} {'off':>7}   (us per call; OMNISTAGE_PDL here: {saved})")
    for t, tiles in chosen.items():
        xs = [torch.randn(t, H, device="cuda", dtype=torch.bfloat16) for _ in range(16)]
        res = [torch.randn(t, H, device="cuda", dtype=torch.bfloat16) for _ in range(16)]

        def block(i):
            return triton_moe_small.routed_moe_small(xs[i], gate, w13, w2, K, True, tiles, prenorm=(res[i], nw, 1e-6))

        def block_norm(i):
            out, h = block(i)
            return triton_fused.rms_norm(out, nw, 1e-6, h)

        for name, run in (("block", block), ("block+norm", block_norm)):
            us = {}
            for on in (True, False):
                pdl.ENABLED = on and pdl.gdc_wait is not None
                us[on] = graph_us(run, calls=16)
            pdl.ENABLED = saved
            print(f"{t:>3} {name:>11} {us[True]:>7.1f} {us[False]:>7.1f}")


def route_check() -> None:
    """`triton_moe_small.route` (softmax, top-k by ranks, renormalisation) vs torch on random logits."""
    logits = torch.randn(64, E, device="cuda") * 3
    for norm in (True, False):
        w, ids = triton_moe_small.route(logits, K, norm)
        want_w, want_ids = torch.topk(torch.softmax(logits, -1), K, dim=-1)
        want_w = want_w / want_w.sum(-1, keepdim=True) if norm else want_w
        print(f"route (norm {norm}): ids equal torch.topk's {torch.equal(ids, want_ids)}, "
              f"weights max abs err {(w - want_w).abs().max().item():.1e}")


def small_path(w13: torch.Tensor, w2: torch.Tensor) -> None:
    """The decode path's table (see the module docstring)."""
    gate = torch.randn(E, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5
    print(f"\n{'T':>3} {'err':>8} {'peak':>6} {'sorted':>8} {'small':>8} "
          f"{'layer old':>9} {'layer new':>9} {'new err':>8} {'bw floor':>8}  (ms, CUDA graphs)")
    for t in SMALL_TS:
        x = torch.randn(t, H, device="cuda", dtype=torch.bfloat16)
        weights, ids = moe.route(x @ gate.T, K, True)
        ref = moe.fused_moe_ref(x, w13, w2, weights, ids)
        err = (triton_moe_small.fused_moe_small(x, w13, w2, weights, ids).float() - ref.float()).abs().max().item()
        ms_sorted = timed(graphed(lambda: triton_moe.fused_moe(x, w13, w2, weights, ids)))
        ms_small = timed(graphed(lambda: triton_moe_small.fused_moe_small(x, w13, w2, weights, ids)))

        def layer_old():
            probs = torch.softmax(x @ gate.T, dim=-1, dtype=torch.float32)
            w, i = torch.topk(probs, K, dim=-1)
            return triton_moe.fused_moe(x, w13, w2, w / w.sum(dim=-1, keepdim=True), i)

        def layer_new():
            return moe.routed_moe(x, gate, w13, w2, K, True)

        with torch.no_grad():
            new_err = (layer_new().float() - ref.float()).abs().max().item()
        floor_ms = ids.unique().numel() * 3 * I * H * 2 / 4e12 * 1e3 + E * H * 2 / 4e12 * 1e3
        print(f"{t:>3} {err:>8.1e} {ref.float().abs().max().item():>6.2f} {ms_sorted:>8.3f} {ms_small:>8.3f} "
              f"{timed(graphed(layer_old)):>9.3f} "
              f"{timed(graphed(layer_new)):>9.3f} {new_err:>8.1e} {floor_ms:>8.3f}")
    chosen = (f"T bucket {key[1]}: {tiles}" for key, tiles in moe_tune.CHOSEN.items())
    print("start-up tiles (moe_tune): " + "; ".join(chosen))


if __name__ == "__main__":
    main()
