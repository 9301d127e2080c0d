"""The Qwen3-Omni MoE block at decode sizes before and after q3talk's changes, on one GPU (issue #13).

Run on the GPU machine:  PYTHONPATH=$PWD python benchmarks/moe_block_bench.py [--json out.json]   (< 60 s)

Shapes as `moe_bench.py` (30B-A3B thinker and talker MoE, bf16, random weights), T = 1, 2, 4, 8 rows; every
time is us per call from a CUDA graph of `moe_bench.CALLS` calls, each on other rows and other experts:
  * gate-up: the gate-up kernel with the routing inside each program (`ROUTE_INSIDE_PER_SM` large: what
    the block ran before) and `route` + the gate-up kernel reading the ids (one launch more);
  * block: the whole `SparseMoeBlock` as before (separate router / shared-expert GEMMs, routing inside)
    and as now (`merge_inputs`: one GEMM for the talker's shared gate | up, router and shared gate;
    the route launch where the gate-up grid has more than `ROUTE_INSIDE_PER_SM` programs per SM);
  * err: max abs difference of the block now against before (same weights), beside the output's peak.
The `now` column picks the split per shape by the rule; the `inside` / `split` columns show both, so the
rule's threshold (`triton_moe.ROUTE_INSIDE_PER_SM`) can be set from this table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from omnistage.layers import moe, triton_moe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_bench import CALLS, DEVICE, SHAPES, TS, block_of, per_call_us  # noqa: E402
from qwen3_omni_bench import TALKER_30B  # noqa: E402

ALWAYS_INSIDE = 1 << 30


def run_shape(name: str) -> list[dict]:
    h, e, k, inter, shared, norm = SHAPES[name]
    w13 = (torch.randn(e, 2 * inter, h, device=DEVICE) * h ** -0.5).bfloat16()
    w2 = (torch.randn(e, h, inter, device=DEVICE) * inter ** -0.5).bfloat16()
    before = block_of(h, e, k, inter, shared, norm, w13, w2)
    after = block_of(h, e, k, inter, shared, norm, w13, w2)
    after.load_state_dict(before.state_dict())
    after.merge_inputs()
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    rule = triton_moe.ROUTE_INSIDE_PER_SM
    rows = []
    for t in TS:
        xs = [torch.randn(t, h, device=DEVICE, dtype=torch.bfloat16) for _ in range(CALLS)]
        logits = [torch.randn(t, e, device=DEVICE) for _ in range(CALLS)]
        tiles = triton_moe.small_tiles(t, k, h, inter, sms)
        ids = torch.empty(t, k, dtype=torch.int64, device=DEVICE)
        weights = torch.empty(t, k, dtype=torch.float32, device=DEVICE)
        up_inside = per_call_us(lambda i: triton_moe.small_gate_up(xs[i], w13, ids, tiles,
                                                                   routing=(logits[i], weights, norm)))
        up_split = per_call_us(lambda i: triton_moe.small_gate_up(xs[i], w13, triton_moe.route(logits[i], k, norm)[1],
                                                                  tiles))
        with torch.no_grad():
            triton_moe.ROUTE_INSIDE_PER_SM = ALWAYS_INSIDE
            block_before = per_call_us(lambda i: before(xs[i]))
            ref = before(xs[0])
            merged_inside = per_call_us(lambda i: after(xs[i]))
            triton_moe.ROUTE_INSIDE_PER_SM = 0
            merged_split = per_call_us(lambda i: after(xs[i]))
            triton_moe.ROUTE_INSIDE_PER_SM = rule
            block_now = per_call_us(lambda i: after(xs[i]))
            got = after(xs[0])
        programs = t * k * triton_moe.triton.cdiv(inter, tiles.up_n)
        rows.append(dict(shape=name, T=t, programs_per_sm=programs / sms, up_inside_us=up_inside, up_split_us=up_split,
                         block_before_us=block_before, merged_inside_us=merged_inside, merged_split_us=merged_split,
                         block_now_us=block_now, err=(got.float() - ref.float()).abs().max().item(),
                         peak=ref.float().abs().max().item()))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = [r for name in SHAPES for r in run_shape(name)]
    print(f"us per call from CUDA graphs; ROUTE_INSIDE_PER_SM = {triton_moe.ROUTE_INSIDE_PER_SM}")
    print("| shape | T | gate-up programs / SM | gate-up, routing inside | route + gate-up | block before | "
          "merged, inside | merged, split | **block now** | err | peak |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['T']} | {r['programs_per_sm']:.1f} | {r['up_inside_us']:.1f} | {r['up_split_us']:.1f} | "
              f"{r['block_before_us']:.1f} | {r['merged_inside_us']:.1f} | {r['merged_split_us']:.1f} | "
              f"**{r['block_now_us']:.1f}** | {r['err']:.1e} | {r['peak']:.2f} |")
    talker8 = next(r for r in rows if r["shape"] == "talker" and r["T"] == 8)
    layers = TALKER_30B["num_hidden_layers"]   # the 30B-A3B talker's decoder layers, every one MoE
    print(f"\ntalker T=8: {layers} layers x (before - now) = "
          f"{layers * (talker8['block_before_us'] - talker8['block_now_us']) / 1e3:.2f} ms per talker step saved")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
