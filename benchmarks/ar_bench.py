"""AR engine benchmark on one GPU: omnistage vs transformers vs the hardware floor, in one run.

Builds a random-weight bf16 checkpoint with Qwen2.5-1.5B's shape (random weights time exactly like
real ones), then measures, for omnistage with the fused kernels on and off (`layers.fused.ENABLED`:
off is the unfused path as it was, an A/B in the same run) and for transformers on the same weights:
  - single-stream decode tok/s (1 request, 128 prompt tokens, 128 new tokens)
  - throughput at 64 and 256 concurrent requests (128 in / 128 out each), output tok/s
  - prefill tok/s: 256 prompts x 128 tokens, one new token each
  - TTFT of one 2048-token prompt
  - the floor of each: max(weight bytes per decode step / measured copy bandwidth, FLOPs / measured
    bf16 matmul rate)
  - the GPU time of one decode step alone (CUDA-graph replay at batch 1 / 64 / 256, context 192: the
    decoder, lm_head and argmax), which the host work around each step (scheduling, inputs, outputs)
    does not enter, beside the engine's wall ms per step in each decode run
  - host time per launch: a Triton kernel vs a PyTorch elementwise op (eager steps are launch-bound)
With --fp8, the same workloads with `quantization="fp8"` (decoder linears FP8: W8A16 Triton GEMV
for steps of <= 16 rows, W8A8 `torch._scaled_mm` above) as one more column, and its floor (decoder
weights at 1 byte, embeddings / lm_head at 2). Its logit error is checked by benchmarks/ar_check_7b.py.
Also checks that greedy output on CUDA equals CPU output on a tiny fp32 model.
Prints a markdown table last; writes JSON to --out if given.

    python benchmarks/ar_bench.py [--work /tmp/arbench] [--out results.json] [--skip-hf-256] [--fp8] [--only-ours]
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


def matmul_flops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192 ** 3 * 10 / (time.perf_counter() - t)


def param_counts(shape: dict) -> tuple[int, int]:
    """(decoder-layer parameters incl. final norm, embedding / lm_head parameters) of a Qwen2 shape."""
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = shape["num_key_value_heads"] * h // shape["num_attention_heads"]
    per_layer = h * (h + 2 * kv) + (h + 2 * kv) + h * h + 3 * h * inter + 2 * h
    return layers * per_layer + h, shape["vocab_size"] * h


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n, length), generator=g).tolist()


def _timed_generate(omni, n: int, in_len: int, out_len: int, seed: int, temperature: float = 0.0
                    ) -> tuple[float, int]:
    from omnistage import SamplingParams

    sp = SamplingParams(max_tokens=out_len, temperature=temperature, top_p=0.95 if temperature else 1.0,
                        ignore_eos=True)
    ps = [{"prompt_token_ids": p} for p in prompts(n, in_len, 151936, seed)]
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = omni.generate(ps, sp, use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)


def bench_ours(path: str, fused_on: bool, cuda_graphs: bool = True, batches=(1, 64, 256),
               async_scheduling: bool = True, quantization=None) -> dict:
    """Every workload in one engine (fresh prompts each time: the prefix cache never hits)."""
    from omnistage import Omni
    from omnistage.layers import fused

    fused.ENABLED = fused_on                 # read at capture and at every call: set before the engine
    res: dict = {"fused": fused_on, "cuda_graphs": cuda_graphs, "async_scheduling": async_scheduling,
                 "quantization": quantization}
    with Omni(path, device="cuda", dtype="bfloat16", max_num_seqs=256, cuda_graphs=cuda_graphs,
              async_scheduling=async_scheduling, quantization=quantization) as omni:
        for n, new in ((4, 128), (64, 2), (1, 2)):                     # warm-up: compiles, autotuning
            _timed_generate(omni, n, 128, new, 1)
        res["decode"] = []
        engine = omni.orchestrator.main
        for i, b in enumerate(batches):
            before = engine.stats()
            dt, n_out = _timed_generate(omni, b, 128, 128, 10 + i)
            after = engine.stats()
            steps = after["steps_total"] - before["steps_total"]
            # the engine's wall time per model step (prefill steps included; schedule excluded): beside
            # the graph replay's GPU time it shows how much of a step is host work
            step_ms = 1e3 * (after["step_seconds_total"] - before["step_seconds_total"]) / max(steps, 1)
            res["decode"].append({"batch": b, "seconds": dt, "output_tokens": n_out, "tok_s": n_out / dt,
                                  "steps": steps, "engine_step_ms": step_ms})
        if len(batches) > 1:
            dt, n_out = _timed_generate(omni, 64, 128, 128, 40, temperature=0.8)
            res["sampled_64_tok_s"] = n_out / dt
            runs = [_timed_generate(omni, 256, 128, 1, 20 + i)[0] for i in range(2)]
            res["prefill"] = {"tokens": 256 * 128, "seconds": runs, "tok_s": 256 * 128 / min(runs)}
            runs = [_timed_generate(omni, 1, 2048, 1, 30 + i)[0] for i in range(3)]
            res["ttft_2048_s"] = min(runs)
        if cuda_graphs:
            res["graph_step_ms"] = graph_step_ms(omni.orchestrator.main.runner.graphs, batches)
    fused.ENABLED = True
    return res


def graph_step_ms(graphs, batches) -> dict:
    """GPU time of one captured decode step per batch size, every row at context 192 (its k, v
    written to the scratch slot, so the KV pool is left as it was)."""
    graphs.slots.fill_(graphs.scratch_slot)
    graphs.ctx.fill_(192)
    graphs.tables[:, :12] = torch.arange(12, device=graphs.tables.device)
    out = {}
    for b in batches:
        g = graphs.graphs[b]
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            g.replay()
        torch.cuda.synchronize()
        out[b] = (time.perf_counter() - t) / 20 * 1e3
    return out


def launch_us() -> dict:
    """Host microseconds per call of a tiny op (the GPU keeps up, so this is the issuing cost)."""
    from omnistage.layers import fused, triton_fused

    x = torch.randn(1, 1536, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(1536, device="cuda", dtype=torch.bfloat16)
    out = {}
    for name, fn in (("triton rms_norm", lambda: triton_fused.rms_norm(x, w, 1e-6)), ("torch add", lambda: x + x),
                     ("torch rms_norm, unfused (7 ops)", lambda: fused.rms_norm_ref(x, w, 1e-6))):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(2000):
            fn()
        out[name] = (time.perf_counter() - t) / 2000 * 1e6
        torch.cuda.synchronize()
    return out


def bench_hf(path: str, batches) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    kw = dict(do_sample=False, pad_token_id=0)

    def generate(ids, new):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t, out

    res: dict = {"decode": []}
    generate(torch.tensor(prompts(1, 128, 151936, 1), device="cuda"), 8)
    for b in batches:
        dt, out = generate(torch.tensor(prompts(b, 128, 151936, 2), device="cuda"), 128)
        n_out = (out.shape[1] - 128) * b
        res["decode"].append({"batch": b, "seconds": dt, "output_tokens": n_out, "tok_s": n_out / dt})
    with torch.no_grad():                                              # prefill: one forward, last logits only
        ids = torch.tensor(prompts(256, 128, 151936, 3), device="cuda")
        model(input_ids=ids[:16], logits_to_keep=1)
        runs = []
        for _ in range(2):
            torch.cuda.synchronize()
            t = time.perf_counter()
            model(input_ids=ids, logits_to_keep=1)
            torch.cuda.synchronize()
            runs.append(time.perf_counter() - t)
    res["prefill"] = {"tokens": 256 * 128, "seconds": runs, "tok_s": 256 * 128 / min(runs)}
    ids = torch.tensor(prompts(1, 2048, 151936, 4), device="cuda")
    res["ttft_2048_s"] = min(generate(ids, 1)[0] for _ in range(3))
    del model
    torch.cuda.empty_cache()
    return res


def floors(bw: float, flops: float, shape: dict, body_bytes: int = 2) -> dict:
    """Lower bounds on time: weights read once per decode step; every matmul FLOP at the measured rate
    (layer GEMMs for every token, lm_head for sampled rows, prefill attention; decode attention and
    KV reads are left out, small at 256 tokens of context). `body_bytes`: bytes per decoder-layer
    weight (2: bf16, 1: FP8; FLOPs counted at the bf16 rate either way)."""
    body, head = param_counts(shape)
    weight_bytes = body_bytes * body + 2 * head         # the embedding rows a step reads are few
    layers, hd = shape["num_hidden_layers"], shape["hidden_size"]
    out = {"weight_bytes": weight_bytes}
    for b in (1, 64, 256):
        t = max(128 * weight_bytes / bw, (2 * body * b * 256 + 2 * head * b * 128) / flops)
        out[f"decode_{b}_tok_s"] = b * 128 / t
    out["prefill_tok_s"] = 256 * 128 / ((2 * body * 256 * 128 + 2 * head * 256 + 2 * layers * hd * 128 * 128 * 256) / flops)
    out["ttft_2048_s"] = (2 * body * 2048 + 2 * head + 2 * layers * hd * 2048 * 2048) / flops
    return out


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
    ap.add_argument("--only-ours", action="store_true",
                    help="only the fused engine's rows (for an A/B of two trees in one device call)")
    ap.add_argument("--fp8", action="store_true", help="also every workload with quantization=fp8")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    res["cuda_equals_cpu"] = check_cuda_equals_cpu(args.work)
    path = build_checkpoint(os.path.join(args.work, "qwen2.5-1.5b-shape"))
    res["copy_bw_GBs"] = copy_bandwidth() / 1e9
    res["matmul_TFLOPs"] = matmul_flops() / 1e12
    res["floor"] = floors(res["copy_bw_GBs"] * 1e9, res["matmul_TFLOPs"] * 1e12, QWEN25_15B)
    res["launch_us"] = launch_us()
    res["ours"] = bench_ours(path, fused_on=True)
    res["ours_sync"] = bench_ours(path, fused_on=True, async_scheduling=False)
    if args.fp8:
        res["floor_fp8"] = floors(res["copy_bw_GBs"] * 1e9, res["matmul_TFLOPs"] * 1e12, QWEN25_15B, body_bytes=1)
        res["ours_fp8"] = bench_ours(path, fused_on=True, quantization="fp8")
    if args.only_ours:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
        print(json.dumps(res, indent=1))
        print_step_ms(res)
        if args.fp8:
            print_fp8_table(res)
        return
    res["ours_unfused"] = bench_ours(path, fused_on=False)
    res["ours_eager"] = bench_ours(path, fused_on=True, cuda_graphs=False, batches=(1,))
    res["hf"] = bench_hf(path, (1, 64) if args.skip_hf_256 else (1, 64, 256))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    print_table(res)
    print_step_ms(res)
    if args.fp8:
        print_fp8_table(res)


def print_step_ms(res: dict) -> None:
    """Engine wall ms per step of each decode run beside its graph replay's GPU ms (the rest is host)."""
    on = res["ours"]
    print("\n| decode run | engine steps | engine ms / step (wall) | graph GPU ms / step | host share |")
    print("|---|---|---|---|---|")
    for r in on["decode"]:
        gpu = on.get("graph_step_ms", {}).get(r["batch"])
        share = f"{1 - gpu / r['engine_step_ms']:.0%}" if gpu else "-"
        print(f"| {r['batch']} x (128 in, 128 out) | {r['steps']} | {r['engine_step_ms']:.2f} "
              f"| {'-' if gpu is None else f'{gpu:.2f}'} | {share} |")


def print_table(res: dict) -> None:
    on, off, hf, fl = res["ours"], res["ours_unfused"], res["hf"], res["floor"]
    sync = res["ours_sync"]
    hf_dec = {r["batch"]: r["tok_s"] for r in hf["decode"]}
    print(f"\n| Qwen2.5-1.5B shape, bf16, {res['gpu']} | omnistage (fused, async) | async scheduling off "
          "| unfused (before) | transformers | floor |")
    print("|---|---|---|---|---|---|")
    for a, s, b in zip(on["decode"], sync["decode"], off["decode"]):
        n = a["batch"]
        ref = f"{hf_dec[n]:.0f}" if n in hf_dec else "not run"
        print(f"| decode {n} x (128 in, 128 out), output tok/s | {a['tok_s']:.0f} | {s['tok_s']:.0f} "
              f"| {b['tok_s']:.0f} | {ref} | {fl[f'decode_{n}_tok_s']:.0f} |")
    print(f"| decode 64 x (128, 128) sampled (T 0.8, top-p 0.95), tok/s | {on['sampled_64_tok_s']:.0f} "
          f"| {sync['sampled_64_tok_s']:.0f} | {off['sampled_64_tok_s']:.0f} | - | - |")
    print(f"| prefill 256 x 128 tokens, tok/s | {on['prefill']['tok_s']:.0f} | {sync['prefill']['tok_s']:.0f} "
          f"| {off['prefill']['tok_s']:.0f} | {hf['prefill']['tok_s']:.0f} | {fl['prefill_tok_s']:.0f} |")
    print(f"| TTFT, one 2048-token prompt, ms | {1e3 * on['ttft_2048_s']:.1f} | {1e3 * sync['ttft_2048_s']:.1f} "
          f"| {1e3 * off['ttft_2048_s']:.1f} | {1e3 * hf['ttft_2048_s']:.1f} | {1e3 * fl['ttft_2048_s']:.1f} |")
    print(f"| decode 1 x (128 in, 128 out), CUDA graphs off | {res['ours_eager']['decode'][0]['tok_s']:.0f} | - "
          f"| - | {hf_dec[1]:.0f} | - |")
    for b, ms in on["graph_step_ms"].items():
        floor = fl["weight_bytes"] / (res["copy_bw_GBs"] * 1e9) * 1e3
        print(f"| one decode step's GPU time (graph replay: decoder, lm_head, argmax), batch {b}, context 192, "
              f"ms | {ms:.2f} | - | {off['graph_step_ms'][b]:.2f} | - | {floor:.2f} (weights / bw) |")
    print_step_ms(res)
    print("\nhost us per call: " + ", ".join(f"{k} {v:.1f}" for k, v in res["launch_us"].items()))
    if "ours_fp8" in res:
        print_fp8_table(res)
    print(f"\ncopy bandwidth {res['copy_bw_GBs']:.0f} GB/s, bf16 matmul {res['matmul_TFLOPs']:.0f} TFLOP/s, "
          f"weights {fl['weight_bytes'] / 1e9:.2f} GB; greedy CUDA == CPU on tiny model: {res['cuda_equals_cpu']}")


def print_fp8_table(res: dict) -> None:
    """bf16 (the fused engine above) beside quantization=fp8, same run, same workloads."""
    bf, f8, fl, fl8 = res["ours"], res["ours_fp8"], res["floor"], res["floor_fp8"]
    print("\n| Qwen2.5-1.5B shape | bf16 | fp8 | fp8 / bf16 | bf16 floor | fp8 floor |")
    print("|---|---|---|---|---|---|")
    for a, b in zip(bf["decode"], f8["decode"]):
        n = a["batch"]
        print(f"| decode {n} x (128 in, 128 out), output tok/s | {a['tok_s']:.0f} | {b['tok_s']:.0f} "
              f"| {b['tok_s'] / a['tok_s']:.2f}x | {fl[f'decode_{n}_tok_s']:.0f} | {fl8[f'decode_{n}_tok_s']:.0f} |")
    print(f"| prefill 256 x 128 tokens, tok/s | {bf['prefill']['tok_s']:.0f} | {f8['prefill']['tok_s']:.0f} "
          f"| {f8['prefill']['tok_s'] / bf['prefill']['tok_s']:.2f}x | {fl['prefill_tok_s']:.0f} | - |")
    print(f"| TTFT, one 2048-token prompt, ms | {1e3 * bf['ttft_2048_s']:.1f} | {1e3 * f8['ttft_2048_s']:.1f} "
          f"| {f8['ttft_2048_s'] / bf['ttft_2048_s']:.2f}x | {1e3 * fl['ttft_2048_s']:.1f} | - |")
    bw = res["copy_bw_GBs"] * 1e9
    for b, ms in bf["graph_step_ms"].items():
        print(f"| one decode step's GPU time (graph replay), batch {b}, ms | {ms:.2f} | {f8['graph_step_ms'][b]:.2f} "
              f"| {f8['graph_step_ms'][b] / ms:.2f}x | {fl['weight_bytes'] / bw * 1e3:.2f} "
              f"| {fl8['weight_bytes'] / bw * 1e3:.2f} |")


if __name__ == "__main__":
    main()
