"""Profile single-stream and batched decode steps on CUDA (where does a step's time go?).

    python benchmarks/profile_decode.py MODEL_DIR [--batch 1] [--steps 30]
Prints wall time per engine step, then the top ops by CUDA time and by CPU time.
"""

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from omnistage import Omni, SamplingParams


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    omni = Omni(args.model, device="cuda", dtype="bfloat16", max_num_seqs=256)
    orch = omni.orchestrator
    eng = orch.main
    sp = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
    for i in range(args.batch):
        eng.add_request(f"r{i}", {"prompt_token_ids": [100 + i] * 128}, sp)
    for _ in range(5):                                   # prefill + warm-up decodes
        eng.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    torch.cuda.synchronize()
    print(f"batch {args.batch}: {(time.perf_counter() - t) / args.steps * 1000:.2f} ms per decode step")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            eng.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
