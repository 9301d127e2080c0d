"""Structured outputs on one GPU: correctness on CUDA, the cost of the grammar mask, engine throughput.

  1. the same constrained greedy requests on a tiny fp32 model give the same ids on CUDA and CPU,
     and every JSON answer validates against its schema;
  2. applying a packed token bitmask to logits [S, 151936] (S = 1, 64, 256): ours
     (`ar/sampler.apply_token_bitmask`, plain PyTorch) vs xgrammar's `apply_token_bitmask_inplace`
     (its CUDA kernel) vs the floor (logits read + written and the mask read at copy bandwidth);
  3. a Qwen2.5-1.5B-shaped random bf16 model (the tiny tokenizer, so the host's grammar work is that
     of a 768-token vocabulary), 64 requests x 128 new tokens: plain vs every request under a JSON
     schema vs half of them, output tok/s.
Prints a markdown table last; writes JSON to --out if given.

    python benchmarks/structured_bench.py [--work /tmp/sobench] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ar_bench import build_checkpoint, copy_bandwidth  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,12}$"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 40}},
          "required": ["name", "n", "tags"]}
VOCAB = 151936


def check_cuda_equals_cpu(work: str) -> dict:
    import jsonschema

    from omnistage import Omni, SamplingParams, StructuredOutputsParams
    from omnistage.testing.llm import make_tiny_lm

    path = make_tiny_lm(os.path.join(work, "tiny"), "qwen2")
    kinds = [dict(json=SCHEMA), dict(json_object=True), dict(regex=r"[0-9]{4}-[a-z]{3}"), dict(choice=["yes", "no"])]
    params = [SamplingParams(max_tokens=96, temperature=0, structured_outputs=StructuredOutputsParams(**k))
              for k in kinds] + [SamplingParams(max_tokens=24, temperature=0, logit_bias={40: 5.0})]
    prompts = ["The harbour town woke"] * len(params)
    ids = {}
    for device in ("cpu", "cuda"):
        with Omni(path, device=device, dtype="float32") as omni:
            outs = omni.generate(prompts, params, use_tqdm=False)
        ids[device] = [o.outputs[0].token_ids for o in outs]
        if outs[0].outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(outs[0].outputs[0].text), SCHEMA)
    return {"cuda_equals_cpu": ids["cpu"] == ids["cuda"]}


def _time(fn, reps: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def bench_mask(bw: float) -> list[dict]:
    import xgrammar as xgr

    from omnistage.ar.sampler import apply_token_bitmask

    rows = []
    for s in (1, 64, 256):
        logits = torch.randn(s, VOCAB, device="cuda")
        mask = torch.randint(-2**31, 2**31 - 1, (s, -(-VOCAB // 32)), dtype=torch.int32, device="cuda")
        ref = logits.clone()
        xgr.apply_token_bitmask_inplace(ref, mask, vocab_size=VOCAB)
        same = bool(torch.equal(apply_token_bitmask(logits, mask), ref))
        ours = _time(lambda: apply_token_bitmask(logits, mask))
        theirs = _time(lambda: xgr.apply_token_bitmask_inplace(logits.clone(), mask, vocab_size=VOCAB)) - _time(
            lambda: logits.clone())
        floor = (2 * logits.numel() * 4 + mask.numel() * 4) / bw
        rows.append({"rows": s, "same": same, "ours_us": ours * 1e6, "xgrammar_us": theirs * 1e6,
                     "floor_us": floor * 1e6})
    return rows


def bench_engine(path: str) -> list[dict]:
    from omnistage import Omni, SamplingParams, StructuredOutputsParams

    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    plain = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=128, temperature=0, structured_outputs=spec)
    g = torch.Generator().manual_seed(0)
    out = []
    with Omni(path, device="cuda", dtype="bfloat16", max_num_seqs=256) as omni:
        for label, mix in (("warm-up", [constrained] * 8), ("plain x64", [plain] * 64),
                           ("json schema x64", [constrained] * 64), ("half json x64", [plain, constrained] * 32)):
            ps = [{"prompt_token_ids": torch.randint(100, VOCAB - 100, (128,), generator=g).tolist()} for _ in mix]
            torch.cuda.synchronize()
            t = time.perf_counter()
            outs = omni.generate(ps, mix, use_tqdm=False)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            if label != "warm-up":
                out.append({"run": label, "output_tokens": n, "seconds": dt, "tok_s": n / dt})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/sobench")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    res = {"device": torch.cuda.get_device_name()}
    res.update(check_cuda_equals_cpu(args.work))
    bw = copy_bandwidth()
    res["copy_bandwidth_gb_s"] = bw / 1e9
    res["mask"] = bench_mask(bw)
    res["engine"] = bench_engine(build_checkpoint(os.path.join(args.work, "qwen25-1.5b")))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print(f"\n{res['device']}; CUDA greedy ids == CPU: {res['cuda_equals_cpu']}; copy {res['copy_bandwidth_gb_s']:.0f} GB/s")
    print("\n| mask rows | same as xgrammar | ours (us) | xgrammar kernel (us) | floor (us) |\n|---|---|---|---|---|")
    for r in res["mask"]:
        print(f"| {r['rows']} | {r['same']} | {r['ours_us']:.1f} | {r['xgrammar_us']:.1f} | {r['floor_us']:.1f} |")
    print("\n| engine run | output tokens | tok/s |\n|---|---|---|")
    for r in res["engine"]:
        print(f"| {r['run']} | {r['output_tokens']} | {r['tok_s']:.0f} |")


if __name__ == "__main__":
    main()
