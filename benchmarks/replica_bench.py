"""Stage replicas on 2 GPUs: output throughput of one replica vs two (one per GPU), in one run.

Builds (or reuses) ar_bench's random-weight bf16 checkpoint of Qwen2.5-1.5B's shape, then runs the
same workload -- N concurrent greedy requests, 128 prompt tokens and 128 new tokens each (fresh
prompts per run: the prefix cache never hits) -- through:
  - one replica in its own process on cuda:0 (`runner: process`), the baseline
  - two replicas, on cuda:0 and cuda:1 (`num_replicas: 2, replica_devices: [cuda:0, cuda:1]`)
  - with --ray, the same two replicas as Ray actors of a local Ray cluster started for the run
and checks that every configuration's greedy ids equal the baseline's. The floor is perfect scaling:
two replicas at twice the baseline's throughput. Prints a markdown table; writes JSON to --out.

    python benchmarks/replica_bench.py [--work /tmp/arbench] [--requests 256] [--ray] [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ar_bench import build_checkpoint, prompts  # noqa: E402

IN_LEN, OUT_LEN = 128, 128


def run(folder: str, deploy: dict, n: int, **engine) -> tuple[float, list]:
    """(seconds, token ids per request) of one timed run after a warm-up, in a fresh engine."""
    from omnistage import SamplingParams
    from omnistage.entrypoints.omni import Omni

    omni = Omni(folder, device="cuda:0", dtype="bfloat16", deploy_config=deploy, **engine)
    try:
        sp = SamplingParams(max_tokens=OUT_LEN, temperature=0, ignore_eos=True)
        omni.generate([{"prompt_token_ids": p} for p in prompts(8, IN_LEN, 151936, 1)], sp, use_tqdm=False)
        ps = [{"prompt_token_ids": p} for p in prompts(n, IN_LEN, 151936, 2)]
        t = time.perf_counter()
        outs = omni.generate(ps, sp, use_tqdm=False)
        return time.perf_counter() - t, [o.outputs[0].token_ids for o in outs]
    finally:
        omni.orchestrator.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/arbench")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--ray", action="store_true", help="also run the two replicas as Ray actors (local cluster)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    if torch.cuda.device_count() < 2:
        raise SystemExit("replica_bench needs 2 GPUs")
    folder = build_checkpoint(os.path.join(args.work, "qwen2.5-1.5b-shape"))
    n = args.requests
    configs = {"1 replica (cuda:0)": ({"stages": {"llm": {"runner": "process"}}}, {}),
               "2 replicas (cuda:0, cuda:1)": ({"stages": {"llm": {"num_replicas": 2,
                                                                   "replica_devices": ["cuda:0", "cuda:1"]}}}, {})}
    if args.ray:
        configs["2 replicas, Ray actors"] = (configs["2 replicas (cuda:0, cuda:1)"][0],
                                             {"distributed_executor_backend": "ray", "ray_address": "local"})
    results, base_ids = {}, None
    for name, (deploy, engine) in configs.items():
        seconds, ids = run(folder, deploy, n, **engine)
        base_ids = ids if base_ids is None else base_ids
        results[name] = {"seconds": seconds, "output_tok_s": n * OUT_LEN / seconds, "ids_equal": ids == base_ids}
    base = next(iter(results.values()))["output_tok_s"]
    results["floor: perfect scaling (2 x 1 replica)"] = {"output_tok_s": 2 * base}
    print(f"\n{n} requests x {IN_LEN} in / {OUT_LEN} out, greedy, Qwen2.5-1.5B shape, bf16\n")
    print("| configuration | output tok/s | x 1 replica | greedy ids equal |")
    print("|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['output_tok_s']:.0f} | {r['output_tok_s'] / base:.2f} | {r.get('ids_equal', '-')} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
