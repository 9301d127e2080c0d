"""Short prompts' time to first token with and without prefill CUDA graphs (ar/prefill_graphs.py), one GPU.

The model: the Qwen3-Omni-30B-A3B thinker text shape in bf16 with dummy weights (`q3_thinker_bench.config_folder`,
`load_format="dummy"`: the same weights at every start), or with `--model 1.5b` ar_bench's random Qwen2.5-1.5B-shape
checkpoint. One engine with the prefill graphs (`prefill_cuda_graphs=True`, the default), then one without (the
thinker's weights take ~60 GB: one engine at a time). Per engine:

  * bs1 TTFT per prompt length (16, 128, 512 tokens): wall from `add_request` to the `step()` that returns the
    answer's one token (max_tokens=1), median over `--repeats` fresh prompts (prefix caching off), after one untimed;
  * greedy ids (32 new tokens) of prompts of 16, 100, 128, 300 and 512 tokens one by one, then three of them added
    together (one step of three chunks);
  * the prefill graphs' capture seconds and memory (`PrefillGraphs.capture_seconds / capture_bytes`: the pool and
    outputs they keep) and the KV blocks the engine got.

Then the table (TTFT with / without, speed-up) and whether the greedy ids agree (first divergence per prompt when
not: padded GEMMs may round differently, so a near-tie can flip).

    PYTHONPATH=$PWD python benchmarks/prefill_graph_bench.py [--model thinker|1.5b] [--work /tmp/pgbench]
        [--repeats 10] [--max-prefill-graph-tokens 512] [--out prefill_graphs.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # the sibling benchmark modules

LENGTHS = (16, 128, 512)
GREEDY_LENGTHS = (16, 100, 128, 300, 512)
NEW = 32


def make_engine(model: str, work: str, graphs: bool, max_graph_tokens: int):
    from omnistage.ar.engine import AREngine
    from omnistage.config import EngineConfig

    common = dict(device="cuda", dtype="bfloat16", max_num_seqs=64, max_model_len=2048, enable_prefix_caching=False,
                  prefill_cuda_graphs=graphs, max_prefill_graph_tokens=max_graph_tokens)
    if model == "thinker":
        from q3_thinker_bench import config_folder

        from omnistage.models.dummy import use_dummy_weights
        from omnistage.models.qwen3_omni.thinker import load_thinker

        config_folder(work)
        use_dummy_weights(work)               # as pipeline/build.py does for load_format="dummy"
        return AREngine(work, EngineConfig(load_format="dummy", **common), loader=load_thinker)
    from ar_bench import build_checkpoint

    from omnistage.models.loader import load_causal_lm

    return AREngine(build_checkpoint(work), EngineConfig(**common), loader=load_causal_lm)


def prompt(length: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (length,), generator=g).tolist()


def generate(engine, prompts: list[list[int]], new: int) -> tuple[list[list[int]], float]:
    """(greedy ids of `prompts` added together, seconds to the last step)."""
    from omnistage.params import SamplingParams

    sp = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    base = len(engine.requests) + int(time.perf_counter() * 1e3)
    for i, p in enumerate(prompts):
        engine.add_request(f"{base}-{i}", {"prompt_token_ids": p}, sp)
    torch.cuda.synchronize()
    t = time.perf_counter()
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.output.outputs[0].token_ids for o in engine.step() if o.finished})
    dt = time.perf_counter() - t
    return [done[f"{base}-{i}"] for i in range(len(prompts))], dt


def measure(engine, repeats: int) -> dict:
    vocab = engine.hf_config.vocab_size
    ttft = {}
    for n in LENGTHS:
        generate(engine, [prompt(n, 999, vocab)], 1)           # untimed: first use of this length's shapes
        times = [generate(engine, [prompt(n, 1000 + r, vocab)], 1)[1] for r in range(repeats)]
        ttft[n] = {"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times)}
    prompts = [prompt(n, 7 + i, vocab) for i, n in enumerate(GREEDY_LENGTHS)]
    greedy = [generate(engine, [p], NEW)[0][0] for p in prompts]
    greedy += generate(engine, prompts[:3], NEW)[0]             # 16 + 100 + 128 rows: one step of three chunks
    graphs = engine.runner.prefill_graphs
    return {"ttft": ttft, "greedy": greedy, "kv_blocks": engine.block_manager.num_blocks,
            "prefill_graphs": None if graphs is None else {
                "buckets": graphs.buckets, "max_chunks": graphs.max_chunks,
                "capture_s": graphs.capture_seconds, "capture_MiB": graphs.capture_bytes / 2**20,
                "replays": graphs.replays}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("thinker", "1.5b"), default="thinker")
    ap.add_argument("--work", default=None, help="model folder (default /tmp/pgbench-MODEL)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--max-prefill-graph-tokens", type=int, default=512)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    work = args.work or f"/tmp/pgbench-{args.model}"
    res = {}
    for graphs in (True, False):
        t = time.perf_counter()
        engine = make_engine(args.model, work, graphs, args.max_prefill_graph_tokens)
        start_s = time.perf_counter() - t
        res["with" if graphs else "without"] = {"engine_start_s": start_s, **measure(engine, args.repeats)}
        del engine
        torch.cuda.empty_cache()
    on, off = res["with"], res["without"]
    diverge = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
               for x, y in zip(on["greedy"], off["greedy"])]
    res["greedy_equal"] = on["greedy"] == off["greedy"]
    res["first_divergence"] = diverge
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print(f"{args.model}: prefill graphs {on['prefill_graphs']}")
    print(f"engine start {on['engine_start_s']:.1f} s with, {off['engine_start_s']:.1f} s without; "
          f"KV blocks {on['kv_blocks']} with, {off['kv_blocks']} without")
    print("| prompt tokens | TTFT with prefill graphs (ms) | without (ms) | speed-up |")
    print("|---|---|---|---|")
    for n in LENGTHS:
        a, b = on["ttft"][n]["median_ms"], off["ttft"][n]["median_ms"]
        print(f"| {n} | {a:.1f} (min {on['ttft'][n]['min_ms']:.1f}) | {b:.1f} (min {off['ttft'][n]['min_ms']:.1f}) "
              f"| {b / a:.2f}x |")
    print(f"greedy ids ({NEW} new; prompts {GREEDY_LENGTHS}, then the first three together) with == without: "
          f"{res['greedy_equal']}; first divergence per prompt: {diverge}")


if __name__ == "__main__":
    main()
