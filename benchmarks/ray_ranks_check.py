"""GPU check (issue #14): an AR stage's tensor-parallel ranks as Ray actors (`distributed_executor_backend:
ray`, NCCL) against the same TP run with spawned ranks and against TP=1, in one run.

Starts a one-node Ray cluster in this process (all visible GPUs), builds the tiny fp32 Qwen2 of
omnistage.testing (or uses --model), then through `Omni`: TP=1 (this host), TP=N with spawned ranks,
TP=N with the stage and its ranks as Ray actors (one GPU each). For each: greedy ids of 8 prompts
(equal to TP=1's in fp32), single-stream decode tok/s and 64-request throughput; the reference
library row is transformers `generate` on one GPU, same weights (its greedy ids too). Prints a
markdown table; exits 1 when an fp32 run's ids differ from TP=1's.

    python benchmarks/ray_ranks_check.py --tp 2        # 2 GPUs (the lead's H200 x2 run)
    python benchmarks/ray_ranks_check.py --tp 2 --device cpu   # gloo, no GPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n, length), generator=g).tolist()


def run_ours(path: str, a: argparse.Namespace, tp: int, **kwargs) -> dict:
    from omnistage import SamplingParams
    from omnistage.entrypoints.omni import Omni

    omni = Omni(path, device=a.device, dtype="float32", tensor_parallel_size=tp, **kwargs)
    try:
        greedy = SamplingParams(max_tokens=a.out_len, temperature=0, ignore_eos=True)
        ids = [o.outputs[0].token_ids for o in omni.generate(
            [{"prompt_token_ids": p} for p in prompts(8, 32, a.vocab, 0)], greedy, use_tqdm=False)]
        rates = []
        for n in (1, 64):
            t = time.perf_counter()
            outs = omni.generate([{"prompt_token_ids": p} for p in prompts(n, 128, a.vocab, 1)], greedy,
                                 use_tqdm=False)
            rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
        return {"ids": ids, "bs1": rates[0], "bs64": rates[1]}
    finally:
        omni.orchestrator.close()


def run_reference(path: str, a: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    dev = "cuda:0" if a.device == "cuda" else "cpu"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(dev).eval()
    ids = []
    with torch.no_grad():
        for p in prompts(8, 32, a.vocab, 0):
            x = torch.tensor([p], device=dev)
            out = model.generate(x, max_new_tokens=a.out_len, min_new_tokens=a.out_len, do_sample=False)
            ids.append(out[0, len(p):].tolist())
        x = torch.tensor(prompts(1, 128, a.vocab, 1), device=dev)
        t = time.perf_counter()
        model.generate(x, max_new_tokens=a.out_len, min_new_tokens=a.out_len, do_sample=False)
        bs1 = a.out_len / (time.perf_counter() - t)
    del model
    return {"ids": ids, "bs1": bs1, "bs64": float("nan")}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--model", default=None, help="an fp32-loadable Qwen2/Llama folder (default: the tiny Qwen2)")
    ap.add_argument("--out-len", type=int, default=64)
    a = ap.parse_args()
    import ray

    from omnistage.testing.llm import make_tiny_lm

    path = a.model or make_tiny_lm(os.path.join(tempfile.mkdtemp(), "tiny-qwen2"), "qwen2")
    a.vocab = json.load(open(os.path.join(path, "config.json")))["vocab_size"]
    gpus = torch.cuda.device_count() if a.device == "cuda" else 0
    if gpus < a.tp and a.device == "cuda":
        print(f"needs {a.tp} GPUs, {gpus} visible")
        return 2
    ray.init(num_cpus=max(os.cpu_count() or 2, a.tp + 2), num_gpus=gpus, include_dashboard=False)
    address = ray.get_runtime_context().gcs_address
    rows = {"TP=1": run_ours(path, a, 1),
            f"TP={a.tp} spawned ranks": run_ours(path, a, a.tp),
            f"TP={a.tp} Ray actors": run_ours(path, a, a.tp, distributed_executor_backend="ray", ray_address=address),
            "transformers generate (one device)": run_reference(path, a)}
    want = rows["TP=1"]["ids"]
    print("| run | greedy ids == TP=1 | bs1 decode tok/s | 64 x 128 out tok/s |\n|---|---|---|---|")
    bad = False
    for name, r in rows.items():
        same = r["ids"] == want
        bad |= not same and "transformers" not in name
        print(f"| {name} | {same} | {r['bs1']:.1f} | {r['bs64']:.1f} |")
    ray.shutdown()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
