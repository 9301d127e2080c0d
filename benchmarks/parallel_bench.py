"""Parallelism benchmark (issue #14/#15). AR part: tensor parallelism, TP=1 vs TP=N in one run.

Builds a random-weight bf16 checkpoint with Qwen2.5-7B's shape (random weights time like real ones;
`--tiny`: the tiny fp32 Qwen2 of omnistage.testing, for CPU over gloo or a quick GPU check), then for
TP=1 (CUDA graphs on, and eager, since TP steps run eager) and TP=N, each through `Omni`:
  - single-stream decode tok/s (1 request, 128 prompt tokens, 128 new tokens)
  - throughput: 256 requests x (128 in, 128 out), output tok/s
  - greedy ids of 8 prompts against TP=1's (equal in fp32; in bf16 the all-reduce's summation order
    may flip a near tie, so the first differing position is reported)
  - the floor of bs1 decode: one rank's weight bytes per step / measured copy bandwidth (CUDA)
  - the reference library: transformers `generate` bs1 decode on one GPU (TP=1), same weights
Prints a markdown table last; writes JSON to --out if given. Exits 1 when fp32 ids differ.

    python benchmarks/parallel_bench.py --tp 2                 # 2 GPUs (the lead's H200 run)
    python benchmarks/parallel_bench.py --tp 1                 # one GPU: TP=1 only
    python benchmarks/parallel_bench.py --tp 2 --tiny          # CPU (gloo) or GPU, tiny shape
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, max_position_embeddings=4096, tie_word_embeddings=False,
                 rms_norm_eps=1e-6)


def build_checkpoint(path: str, tiny: bool) -> tuple[str, str]:
    """(folder, dtype name) of the benchmark's checkpoint, built once."""
    if tiny:
        from omnistage.testing.llm import make_tiny_lm

        if not os.path.exists(os.path.join(path, "config.json")):
            make_tiny_lm(path, "qwen2")
        return path, "float32"
    if not os.path.exists(os.path.join(path, "config.json")):
        from transformers import Qwen2Config, Qwen2ForCausalLM

        from omnistage.testing.llm import make_tokenizer

        torch.manual_seed(0)
        with torch.device("cuda"):
            model = Qwen2ForCausalLM(Qwen2Config(**QWEN25_7B, dtype="bfloat16")).to(torch.bfloat16)
        model.save_pretrained(path)
        make_tokenizer(path)
        del model
        torch.cuda.empty_cache()
    return path, "bfloat16"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def prompts(n: int, length: int, vocab: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": p} for p in torch.randint(10, vocab - 10, (n, length), generator=g).tolist()]


def timed(omni, device: str, n: int, in_len: int, out_len: int, vocab: int, seed: int) -> float:
    """Output tok/s of n requests (in_len in, out_len out, greedy, no early stop)."""
    from omnistage import SamplingParams

    sp = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    sync(device)
    t = time.perf_counter()
    outs = omni.generate(prompts(n, in_len, vocab, seed), sp, use_tqdm=False)
    sync(device)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)


def bench_ours(path: str, device: str, dtype: str, tp: int, cuda_graphs: bool, a: argparse.Namespace) -> dict:
    from omnistage import Omni, SamplingParams

    vocab = a.vocab
    res: dict = {"tp": tp, "cuda_graphs": cuda_graphs and tp == 1 and device.startswith("cuda")}
    t = time.perf_counter()
    with Omni(path, device=device, dtype=dtype, tensor_parallel_size=tp, max_num_seqs=256,
              cuda_graphs=cuda_graphs) as omni:
        res["start_s"] = time.perf_counter() - t
        timed(omni, device, 4, a.in_len, 8, vocab, 1)                     # warm-up
        res["bs1_tok_s"] = timed(omni, device, 1, a.in_len, a.out_len, vocab, 2)
        res["batch_tok_s"] = timed(omni, device, a.batch, a.in_len, a.out_len, vocab, 3)
        outs = omni.generate(prompts(8, 32, vocab, 4), SamplingParams(max_tokens=32, temperature=0, ignore_eos=True),
                             use_tqdm=False)
        res["ids"] = [o.outputs[0].token_ids for o in outs]
    del omni
    gc.collect()                               # the next run sizes its KV from what is free
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return res


def bench_hf(path: str, a: argparse.Namespace) -> float:
    """transformers generate, bs1 decode tok/s on one GPU (the reference library, TP=1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    ids = torch.tensor([p["prompt_token_ids"] for p in prompts(1, a.in_len, a.vocab, 2)], device="cuda")
    model.generate(ids, max_new_tokens=8, do_sample=False)
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = model.generate(ids, max_new_tokens=a.out_len, min_new_tokens=a.out_len, do_sample=False)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    del model
    torch.cuda.empty_cache()
    return (out.shape[1] - ids.shape[1]) / dt


def bs1_floor(path: str, tp: int) -> float:
    """Decode tok/s if one step only read one rank's weights at the measured copy bandwidth."""
    from omnistage.models.loader import safetensors_files

    weight_bytes = sum(os.path.getsize(f) for f in safetensors_files(path)) / tp
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ar_bench import copy_bandwidth                 # one way of measuring it for every benchmark

    bandwidth = copy_bandwidth()                         # read + write bytes/s
    return bandwidth / weight_bytes


def first_difference(a: list[list[int]], b: list[list[int]]) -> int:
    """The first token position where any prompt's ids differ (-1: all equal)."""
    pos = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), -1) for p, q in zip(a, b)]
    diffs = [p for p in pos if p >= 0]
    return min(diffs) if diffs else -1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2, help="the tensor-parallel size compared with TP=1")
    p.add_argument("--tiny", action="store_true", help="the tiny fp32 Qwen2 instead of the Qwen2.5-7B shape")
    p.add_argument("--device", default="auto", help="auto (cuda when there is one) | cpu | cuda")
    p.add_argument("--work", default="/tmp/parallel_bench")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--skip-hf", action="store_true", help="leave out transformers' bs1 decode")
    a = p.parse_args()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    if a.tiny:
        a.in_len, a.out_len, a.batch = (16, 16, 8) if device == "cpu" else (128, 128, 256)
    else:
        a.in_len, a.out_len, a.batch = 128, 128, 256
    path, dtype = build_checkpoint(os.path.join(a.work, "tiny-qwen2" if a.tiny else "qwen2_5-7b-shape"), a.tiny)
    a.vocab = json.load(open(os.path.join(path, "config.json")))["vocab_size"]
    rows = [bench_ours(path, device, dtype, 1, True, a)]
    if device.startswith("cuda"):
        rows.append(bench_ours(path, device, dtype, 1, False, a))
    if a.tp > 1:
        rows.append(bench_ours(path, device, dtype, a.tp, False, a))
    hf = None if a.skip_hf or not device.startswith("cuda") else bench_hf(path, a)
    for r in rows:
        r["first_difference"] = first_difference(rows[0]["ids"], r["ids"])
        r["floor_bs1_tok_s"] = bs1_floor(path, r["tp"]) if device.startswith("cuda") else None
    results = {"device": device, "dtype": dtype, "tiny": a.tiny, "in": a.in_len, "out": a.out_len,
               "batch": a.batch, "hf_bs1_tok_s": hf, "runs": [{k: v for k, v in r.items() if k != "ids"} for r in rows]}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=2)
    print(f"\n{'tiny fp32 Qwen2' if a.tiny else 'Qwen2.5-7B shape, random bf16'} on {device}; "
          f"batch = {a.batch} x ({a.in_len} in, {a.out_len} out)")
    print("| run | start s | bs1 decode tok/s | bs1 floor tok/s | batch tok/s | greedy ids vs TP=1 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        name = f"omnistage TP={r['tp']}" + (" (CUDA graphs)" if r["cuda_graphs"] else " (eager)" * device.startswith("cuda"))
        same = "equal" if r["first_difference"] < 0 else f"differ from token {r['first_difference']}"
        floor = f"{r['floor_bs1_tok_s']:.0f}" if r["floor_bs1_tok_s"] else "-"
        print(f"| {name} | {r['start_s']:.1f} | {r['bs1_tok_s']:.1f} | {floor} | {r['batch_tok_s']:.1f} | {same} |")
    if hf is not None:
        print(f"| transformers generate, 1 GPU | - | {hf:.1f} | - | - | - |")
    mismatch = dtype == "float32" and any(r["first_difference"] >= 0 for r in rows)
    return 1 if mismatch else 0


if __name__ == "__main__":
    sys.exit(main())
