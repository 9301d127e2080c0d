"""Qwen3-Omni-30B-A3B thinker decode on one GPU: omnistage vs transformers vs the active-weight floor.

The real thinker text shape (hidden 2048, 48 layers, 32 q / 4 kv heads of 128, 128 experts top-8 of
width 768, vocab 152064; ~30B parameters, ~3B active per token) in bf16 with random weights, which
time like real ones. No checkpoint is written (60 GB): a folder with config.json + tokenizer only,
and the weights drawn on the GPU (`load_format="dummy"`, models/dummy.py) -- omnistage's served thinker
component ("qwen3_omni.thinker": Triton fused MoE, CUDA graphs) run by its `AREngine`, then transformers'
`Qwen3OmniMoeThinkerForConditionalGeneration.generate` (its default experts implementation) on its own
random weights, one after the other (each takes ~60 GB).
First, the tiny Qwen3-Omni served on CUDA in fp32 (Triton MoE, CUDA graphs) must give transformers'
greedy ids (text and image + audio prompts). Per batch size (1 and 64; 128 prompt tokens, 128 new tokens, greedy, ignore eos) it prints output
tok/s and the floor: every decode step reads the attention, router, norm and lm_head weights and the
expected number of distinct experts the batch hits (128 * (1 - (1 - 8/128)^B) per layer), at the
copy bandwidth measured in the same run. Target: bs1 >= 50% of that floor.
Then the MoE decode tiles `layers.moe_tune` chose at start-up (per T bucket), and a per-kernel profile of bs1 decode steps (torch.profiler, top 15 by self CUDA time), replayed from
the CUDA graphs as served and once more eager (the graphs set aside), so what is left of a step shows.
Last the "bs1 gap" table (bs1_gap.py): the bs1 graph replayed back to back, the profiled kernel time and
device gaps per step, the engine's wall per decode step in the timed bs1 run, the host time of one
`replay()` call, and the profiled CPU time of the runtime's waits. `--gap-only`: only that (bs1 row, graph
profile; no tiny check, no transformers, no bs64 row, no eager profile), well under a minute once started.

    PYTHONPATH=$PWD python benchmarks/q3_thinker_bench.py [--work /tmp/q3bench] [--out q3_thinker.json] [--skip-hf]
        [--skip-tiny] [--profile-steps 32] [--gap-only]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # the sibling benchmark modules

from ar_bench import copy_bandwidth  # noqa: E402
from bs1_gap import print_gap_table, profile_gap, replay_host_ms  # noqa: E402

THINKER_30B = dict(vocab_size=152064, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                   num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, num_experts=128,
                   num_experts_per_tok=8, max_position_embeddings=65536, initializer_range=0.02,
                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [24, 20, 20],
                                    "interleaved": True})
IN_LEN, OUT_LEN = 128, 128
MAX_NUM_SEQS = 64            # the engine as served in every run (also with --gap-only: the same bs1 graph and tiles)


def config_folder(path: str):
    """A Qwen3-Omni folder without weights: the tiny checkpoint's config with the 30B-A3B thinker text shape."""
    from omnistage.testing.qwen3_omni import make_config, make_omni_tokenizer, token_ids

    config = make_config(token_ids(), text_overrides=THINKER_30B)
    config.thinker_config.audio_config.output_dim = THINKER_30B["hidden_size"]
    config.thinker_config.vision_config.out_hidden_size = THINKER_30B["hidden_size"]
    config.talker_config.thinker_hidden_size = THINKER_30B["hidden_size"]
    config.thinker_config.dtype = "bfloat16"
    config.dtype = "bfloat16"
    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)
    make_omni_tokenizer().save_pretrained(path)
    return config


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, THINKER_30B["vocab_size"] - 100, (n, IN_LEN), generator=g).tolist()


def bench_ours(path: str, batches, profile_steps: int, modes=("cuda graphs", "eager")
               ) -> tuple[list[dict], dict[str, str], dict]:
    from omnistage.ar.engine import AREngine
    from omnistage.config import EngineConfig
    from omnistage.models.dummy import use_dummy_weights
    from omnistage.models.qwen3_omni.thinker import load_thinker
    from omnistage.params import SamplingParams

    use_dummy_weights(path)                   # as pipeline/build.py does for load_format="dummy"
    engine = AREngine(path, EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=MAX_NUM_SEQS,
                                         max_model_len=1024, enable_prefix_caching=False, load_format="dummy"),
                      loader=load_thinker)
    params = SamplingParams(max_tokens=OUT_LEN, temperature=0, ignore_eos=True)

    def run(n: int, seed: int, new: int = OUT_LEN) -> tuple[float, int, float, float]:
        """(seconds, output tokens, wall ms per `step()` call from the one that returned the first tokens to
        the last: the decode steps only, prefill excluded; at bs1 one call is one token, seconds to the first
        tokens: the prefill and first step)."""
        for i, p in enumerate(prompts(n, seed)):
            engine.add_request(f"{seed}-{i}", {"prompt_token_ids": p}, params.clone(max_tokens=new))
        torch.cuda.synchronize()
        t = time.perf_counter()
        tokens, first, calls = 0, None, 0
        while engine.has_unfinished():
            outs = engine.step()
            if first is not None:
                calls += 1
            elif any(out.output.outputs[0].token_ids for out in outs):
                first = time.perf_counter()
            for out in outs:
                if out.finished:
                    tokens += len(out.output.outputs[0].token_ids)
        torch.cuda.synchronize()
        end = time.perf_counter()
        return end - t, tokens, 1e3 * (end - first) / max(calls, 1), first - t

    run(4, 1, 16)                                             # warm-up: Triton compiles, graphs
    rows = []
    for i, b in enumerate(batches):
        dt, n, step_ms, first_s = run(b, 10 + i)
        rows.append({"batch": b, "seconds": dt, "output_tokens": n, "tok_s": n / dt, "decode_step_ms": step_ms,
                     "first_token_s": first_s})
    dt, n, step_ms, first_s = run(1, 30)                      # bs1 again: one-time costs of the first bs1 run show
    rows.append({"batch": "1 (again)", "seconds": dt, "output_tokens": n, "tok_s": n / dt, "decode_step_ms": step_ms,
                 "first_token_s": first_s})
    prefill_table = profile_prefill(engine, params)
    gap = replay_host_ms(engine.runner.graphs, 1)
    gap["engine_decode_step_ms"] = rows[batches.index(1)]["decode_step_ms"]
    tables = {"bs1 prefill (128 tokens), one step": prefill_table}
    if profile_steps:
        decode_tables, profiled = profile_bs1(engine, params, profile_steps, modes)
        tables.update(decode_tables)
        gap.update(profiled)
    del engine
    torch.cuda.empty_cache()
    return rows, tables, gap


def profile_prefill(engine, params) -> str:
    """torch.profiler table of one bs1 prefill step (128 prompt tokens; top 20 by self CUDA time), with the
    step's wall time: what the ~55 ms from a request's arrival to its first token is made of."""
    from torch.profiler import ProfilerActivity, profile

    engine.add_request("profile-prefill", {"prompt_token_ids": prompts(1, 98)[0]}, params.clone(max_tokens=2))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    while engine.has_unfinished():
        engine.step()
    events = prof.key_averages()
    out = f"wall {wall * 1e3:.1f} ms (profiled)\n"
    for key in ("self_device_time_total", "self_cuda_time_total"):
        try:
            out += events.table(sort_by=key, row_limit=20)
            break
        except (KeyError, AttributeError, ValueError):
            continue
    return out + "\nby self CPU time:\n" + events.table(sort_by="self_cpu_time_total", row_limit=15)


def profile_bs1(engine, params, steps: int, modes) -> tuple[dict[str, str], dict]:
    """torch.profiler tables (top 15 kernels by self CUDA time) of `steps` bs1 decode steps per mode ("cuda
    graphs", "eager"), and the graphs' device activity and runtime waits per step (bs1_gap.profile_gap)."""
    from torch.profiler import ProfilerActivity, profile

    tables, gap = {}, {}
    for mode in modes:
        graphs = engine.runner.graphs
        if mode == "eager":
            engine.runner.graphs = None          # the runner then launches every kernel itself
        engine.add_request(f"profile-{mode}", {"prompt_token_ids": prompts(1, 99)[0]},
                           params.clone(max_tokens=steps + 8))
        for _ in range(3):                       # prefill, and the decode pipeline filled
            engine.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
        while engine.has_unfinished():
            engine.step()
        engine.runner.graphs = graphs
        if mode == "cuda graphs":
            gap = profile_gap(prof, steps)
        events = prof.key_averages()
        for key in ("self_device_time_total", "self_cuda_time_total"):   # the name changed across torch versions
            try:
                tables[mode] = events.table(sort_by=key, row_limit=15)
                break
            except (KeyError, AttributeError, ValueError):
                continue
    return tables, gap


def bench_hf(path: str, batches) -> list[dict]:
    from transformers import AutoConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerForConditionalGeneration

    config = AutoConfig.from_pretrained(path).thinker_config
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3OmniMoeThinkerForConditionalGeneration._from_config(config, dtype=torch.bfloat16).eval()
    rows = []

    def generate(ids, new):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    generate(torch.tensor(prompts(1, 1), device="cuda"), 8)
    for b in batches:
        dt = generate(torch.tensor(prompts(b, 2), device="cuda"), OUT_LEN)
        rows.append({"batch": b, "seconds": dt, "output_tokens": b * OUT_LEN, "tok_s": b * OUT_LEN / dt})
    del model
    torch.cuda.empty_cache()
    return rows


def floor_tok_s(batch: int, bandwidth: float) -> dict:
    """Output tok/s if each decode step only read the weights it must (bf16) at `bandwidth`."""
    s = THINKER_30B
    h, layers, d = s["hidden_size"], s["num_hidden_layers"], s["head_dim"]
    q, kv = s["num_attention_heads"] * d, s["num_key_value_heads"] * d
    dense = layers * (h * (q + 2 * kv) + q * h + s["num_experts"] * h + 2 * h + 2 * d) + s["vocab_size"] * h
    e, k = s["num_experts"], s["num_experts_per_tok"]
    hit = e * (1 - (1 - k / e) ** batch)
    experts = layers * hit * 3 * h * s["moe_intermediate_size"]
    step_bytes = 2 * (dense + experts)
    return {"batch": batch, "step_bytes": step_bytes, "active_params_per_token": dense + layers * k * 3 * h * s["moe_intermediate_size"],
            "tok_s": batch / (step_bytes / bandwidth)}


def check_tiny_on_cuda(work: str, device: str = "cuda") -> dict:
    """The tiny Qwen3-Omni (fp32) served on CUDA -- Triton fused MoE, fused kernels, CUDA graphs --
    against transformers' thinker on the CPU: greedy ids of a text and an image + audio prompt."""
    import numpy as np
    from PIL import Image

    from omnistage import Omni, SamplingParams
    from omnistage.models.qwen2_5_omni.processor import build_thinker_inputs
    from omnistage.testing.qwen3_omni import load_reference, make_tiny_qwen3_omni

    path = make_tiny_qwen3_omni(os.path.join(work, "tiny-qwen3_omni"))
    image = Image.fromarray((np.random.RandomState(0).rand(60, 90, 3) * 255).astype("uint8"))
    audio = (np.random.RandomState(1).randn(11025) * 0.1).astype("float32")
    convs = {"text": [{"role": "user", "content": "What is the capital of France?"}],
             "image+audio": [{"role": "user", "content": [{"type": "image", "image": image},
                                                          {"type": "audio", "audio": (audio, 22050)},
                                                          {"type": "text", "text": "What is this?"}]}]}
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with Omni(path, device=device, dtype="float32") as omni:
        ours = {k: list(o.outputs[0].token_ids) for k, o in zip(convs, omni.chat(list(convs.values()), params,
                                                                                  use_tqdm=False))}
    from transformers import AutoProcessor

    hf, proc = load_reference(path), AutoProcessor.from_pretrained(path)
    equal = {}
    for k, messages in convs.items():
        inputs = build_thinker_inputs(proc, messages)
        with torch.no_grad():
            seq = hf.thinker.generate(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                                      **inputs.features, max_new_tokens=24, min_new_tokens=24, do_sample=False)
        equal[k] = ours[k] == seq[0, inputs.input_ids.shape[1]:].tolist()
    return equal


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", default="/tmp/q3bench")
    parser.add_argument("--out", default=None)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-tiny", action="store_true", help="skip the tiny model's CUDA-vs-transformers check")
    parser.add_argument("--profile-steps", type=int, default=32, help="bs1 decode steps profiled (0: none)")
    parser.add_argument("--gap-only", action="store_true",
                        help="only the bs1 row and the bs1 gap table (implies --skip-hf --skip-tiny; graph profile only)")
    args = parser.parse_args()
    if args.gap_only:
        args.skip_hf = args.skip_tiny = True
    batches = (1,) if args.gap_only else (1, 64)
    config_folder(args.work)
    tiny = None if args.skip_tiny else check_tiny_on_cuda(args.work)
    bw = copy_bandwidth()
    ours, tables, gap = bench_ours(args.work, batches, args.profile_steps,
                                   ("cuda graphs",) if args.gap_only else ("cuda graphs", "eager"))
    from omnistage.layers import moe_tune, pdl
    chosen = {f"T bucket {key[1]}, top_k {key[2]}, hidden {key[3]}, width {key[4]}": repr(tiles)
              for key, tiles in moe_tune.CHOSEN.items()}
    res = {"tiny_cuda_equals_transformers": tiny, "copy_bandwidth_GBs": bw / 1e9, "floor": [floor_tok_s(b, bw) for b in batches],
           "ours": ours, "profile_bs1": tables, "moe_tiles_chosen": chosen, "bs1_gap": gap, "pdl": pdl.ENABLED}
    if not args.skip_hf:
        res["transformers"] = bench_hf(args.work, batches)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print(f"tiny Qwen3-Omni on CUDA (fp32), greedy ids equal transformers': {tiny}")
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; active params per token "
          f"{res['floor'][0]['active_params_per_token'] / 1e9:.2f} B; programmatic dependent launch "
          f"(OMNISTAGE_PDL) {'on' if pdl.ENABLED else 'off'}")
    print("| batch | omnistage tok/s end to end (of floor) | decode rate tok/s (of floor) | prefill + first step ms "
          "| transformers tok/s | floor tok/s |")
    print("|---|---|---|---|---|---|")
    for i, b in enumerate(batches):
        row, floor = res["ours"][i], res["floor"][i]["tok_s"]
        rate = b * 1e3 / row["decode_step_ms"]      # output tokens per second of decode steps alone
        hf = f"{res['transformers'][i]['tok_s']:.1f}" if "transformers" in res else "-"
        print(f"| {b} | {row['tok_s']:.1f} ({row['tok_s'] / floor:.1%}) | {rate:.1f} ({rate / floor:.1%}) "
              f"| {row['first_token_s'] * 1e3:.1f} | {hf} | {floor:.0f} |")
    again = res["ours"][-1]
    print(f"  bs1 again: {again['tok_s']:.1f} tok/s end to end, prefill + first step {again['first_token_s'] * 1e3:.1f} ms, "
          f"decode step {again['decode_step_ms']:.3f} ms")
    print_gap_table(gap, args.profile_steps)
    print("MoE decode tiles chosen at start-up (moe_tune):")
    for key, tiles in chosen.items():
        print(f"  {key}: {tiles}")
    for mode, table in tables.items():
        what = mode if "prefill" in mode else f"bs1 decode, {args.profile_steps} steps, {mode}: top 15 kernels by self CUDA time"
        print(f"\n{what}\n{table}")


if __name__ == "__main__":
    main()
