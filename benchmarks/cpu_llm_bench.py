"""CPU benchmark on the embedded default (real SmolLM2-135M-Instruct weights): omnistage vs transformers.

Workload (as ENVIRONMENT.md measured transformers on this machine): 64 prompts, 64 new greedy tokens each,
bfloat16. Prints output tokens/s for both and a markdown table last.

    python benchmarks/cpu_llm_bench.py [--batch 64] [--new 64] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM

from omnistage import Omni, SamplingParams
from omnistage.models.default_model import default_model_path

TOPICS = ["the ocean", "a small robot", "the history of bread", "mountains", "a rainy day", "chess",
          "the moon", "music", "a busy city", "gardening", "volcanoes", "friendship", "trains", "winter"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    path = default_model_path()
    prompts = [f"Write a short paragraph about {TOPICS[i % len(TOPICS)]} (variant {i}):" for i in range(args.batch)]
    sp = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)

    with Omni(path, device="cpu", dtype=args.dtype) as omni:
        omni.generate(prompts[:2], sp, use_tqdm=False)
        t = time.perf_counter()
        outs = omni.generate(prompts, sp, use_tqdm=False)
        ours = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
        tok = omni.tokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=tok.pad_token_id)
    model.generate(**tok(prompts[:2], return_tensors="pt", padding=True), **{**kw, "max_new_tokens": 4,
                                                                             "min_new_tokens": 4})
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**enc, **kw)
    ref = (out.shape[1] - enc.input_ids.shape[1]) * args.batch / (time.perf_counter() - t)

    print(f"\n| SmolLM2-135M, CPU {torch.get_num_threads()} threads, {args.dtype}, {args.batch} x {args.new} new tokens "
          f"| omnistage tok/s | transformers generate tok/s |")
    print("|---|---|---|")
    print(f"| greedy, EOS ignored | {ours:.0f} | {ref:.0f} |")


if __name__ == "__main__":
    main()
