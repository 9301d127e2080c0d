"""AR engine benchmark on one GPU: omnistage vs transformers `generate` vs the bandwidth roofline.

Builds a random-weight bf16 checkpoint with Qwen2.5-1.5B's shape (random weights time exactly like
real ones), then measures in one run:
  - single-stream decode tok/s (1 request, 128 prompt tokens, 128 new tokens)
  - throughput at 64 and 256 concurrent requests (128 in / 128 out each), output tok/s
  - transformers `generate` on the same weights (bs 1 and bs 64, left-padded batch)
  - the roofline: weight bytes / measured device copy bandwidth (bs 1 decode upper bound)
Also checks that greedy output on CUDA equals CPU output on a tiny fp32 model.
Prints a markdown table last; writes JSON to --out if given.

    python benchmarks/ar_bench.py [--work /tmp/arbench] [--out results.json] [--skip-hf-256]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

QWEN25_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True,
                  rms_norm_eps=1e-6)


def build_checkpoint(path: str) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from omnistage.testing.llm import make_tokenizer

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    cfg = Qwen2Config(**QWEN25_15B, dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    make_tokenizer(path)
    del model
    torch.cuda.empty_cache()
    return path


def copy_bandwidth() -> float:
    x = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (time.perf_counter() - t)       # bytes read + written per second


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n, length), generator=g).tolist()


def bench_ours(path: str, batch: int, in_len=128, out_len=128, cuda_graphs=True) -> dict:
    from omnistage import Omni, SamplingParams

    with Omni(path, device="cuda", dtype="bfloat16", max_num_seqs=256, cuda_graphs=cuda_graphs) as omni:
        sp = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
        omni.generate([{"prompt_token_ids": p} for p in prompts(4, in_len, 151936, 1)], sp, use_tqdm=False)
        torch.cuda.synchronize()
        ps = [{"prompt_token_ids": p} for p in prompts(batch, in_len, 151936, 2)]
        t = time.perf_counter()
        outs = omni.generate(ps, sp, use_tqdm=False)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"batch": batch, "seconds": dt, "output_tokens": n_out, "tok_s": n_out / dt, "cuda_graphs": cuda_graphs}


def bench_hf(path: str, batch: int, in_len=128, out_len=128) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor(prompts(batch, in_len, 151936, 2), device="cuda")
    mask = torch.ones_like(ids)
    kw = dict(max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False, pad_token_id=0)
    model.generate(ids[:1], attention_mask=mask[:1], **{**kw, "max_new_tokens": 8, "min_new_tokens": 8})
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, **kw)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    n_out = (out.shape[1] - in_len) * batch
    del model
    torch.cuda.empty_cache()
    return {"batch": batch, "seconds": dt, "output_tokens": n_out, "tok_s": n_out / dt}


def check_cuda_equals_cpu(work: str) -> bool:
    from omnistage import Omni, SamplingParams
    from omnistage.testing.llm import make_tiny_lm

    path = make_tiny_lm(os.path.join(work, "tiny-qwen2"), "qwen2")
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    texts = ["Hello world", "The quick brown fox jumps over", "café 日本語"]
    res = []
    for device in ("cpu", "cuda"):
        with Omni(path, device=device, dtype="float32") as omni:
            res.append([o.outputs[0].token_ids for o in omni.generate(texts, sp, use_tqdm=False)])
    return res[0] == res[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/arbench")
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-hf-256", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    res["cuda_equals_cpu"] = check_cuda_equals_cpu(args.work)
    path = build_checkpoint(os.path.join(args.work, "qwen2.5-1.5b-shape"))
    n_params = sum(v for v in [
        QWEN25_15B["vocab_size"] * QWEN25_15B["hidden_size"],
        QWEN25_15B["num_hidden_layers"] * (
            QWEN25_15B["hidden_size"] * (QWEN25_15B["hidden_size"] + 2 * 256) + 1536 + 2 * 256
            + QWEN25_15B["hidden_size"] ** 2 + 3 * QWEN25_15B["hidden_size"] * QWEN25_15B["intermediate_size"])])
    bw = copy_bandwidth()
    res["weight_bytes"] = n_params * 2
    res["copy_bw_GBs"] = bw / 1e9
    res["roofline_bs1_tok_s"] = bw / (n_params * 2)
    res["ours"] = [bench_ours(path, b) for b in (1, 64, 256)]
    res["ours_eager"] = bench_ours(path, 1, cuda_graphs=False)
    res["hf"] = [bench_hf(path, b) for b in ((1, 64) if args.skip_hf_256 else (1, 64, 256))]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    hf = {r["batch"]: r["tok_s"] for r in res["hf"]}
    print(f"\n| workload (Qwen2.5-1.5B shape, bf16, {res['gpu']}) | omnistage tok/s | transformers tok/s | floor |")
    print("|---|---|---|---|")
    for r in res["ours"]:
        floor = f"{res['roofline_bs1_tok_s']:.0f} (weights/bw)" if r["batch"] == 1 else "-"
        ref = f"{hf[r['batch']]:.0f}" if r["batch"] in hf else "not run"
        print(f"| {r['batch']} x (128 in, 128 out) | {r['tok_s']:.0f} | {ref} | {floor} |")
    print(f"| 1 x (128 in, 128 out), CUDA graphs off | {res['ours_eager']['tok_s']:.0f} | {hf[1]:.0f} | - |")
    print(f"\ncopy bandwidth {res['copy_bw_GBs']:.0f} GB/s, weights {res['weight_bytes'] / 1e9:.2f} GB; "
          f"greedy CUDA == CPU on tiny model: {res['cuda_equals_cpu']}")


if __name__ == "__main__":
    main()
