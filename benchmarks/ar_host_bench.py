"""Host cost of an AR decode step at 256 rows, on the CPU (no GPU needed).

A tiny random Llama (hidden 32, one layer: its forward costs little) runs 256 requests of 16 prompt
tokens and 96 new tokens through `AREngine.step()`. For every decode-only step the bench times the
engine step and the device-side work inside it (model forward, lm_head, sampling or argmax: on the CPU these
run synchronously, so the difference is the host's Python: scheduling, step inputs, stop checks,
detokenizing, outputs), in process CPU time (`time.process_time`, one torch thread), so that other
work on a shared machine counts less. Prints host microseconds per row-step for a few request mixes, and
the top cProfile entries of the plain mix.

    PYTHONPATH=$PWD python benchmarks/ar_host_bench.py [--rows 256] [--new 96] [--profile 15]

"Before": the same script with PYTHONPATH set to an older checkout (`git archive <commit> | tar -x -C DIR`).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import tempfile
import time

import torch

MIXES = {
    # every row greedy, no stop strings, only the finished output read (what `Omni.generate` asks for)
    "greedy": lambda i: dict(temperature=0.0, ignore_eos=True, output_kind="final_only"),
    "sampled (T 0.8, top-p 0.95)": lambda i: dict(temperature=0.8, top_p=0.95, ignore_eos=True,
                                                  output_kind="final_only"),
    # text needed every step: a stop string that never matches
    "greedy + stop string": lambda i: dict(temperature=0.0, ignore_eos=True, stop=["\u2603\u2603"],
                                           output_kind="final_only"),
    # an output (text, ids) every step, as a streaming server request reads it
    "greedy, streamed": lambda i: dict(temperature=0.0, ignore_eos=True),
}


class Timer:
    """Wraps callables and sums the process seconds spent in them while `on` (re-entry counted once)."""

    def __init__(self):
        self.seconds = 0.0
        self.on = False
        self.depth = 0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            if not self.on or self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            t = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.process_time() - t
                self.depth -= 1
        return timed


def print_table(header: list[str], rows: list[list[str]]) -> None:
    """A markdown table (after a blank line): `header`'s cells, then one line of cells per row."""
    print("\n| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for cells in rows:
        print("| " + " | ".join(cells) + " |")


def build(path: str, rows: int):
    from omnistage.ar import runner as runner_mod
    from omnistage.ar.engine import AREngine
    from omnistage.config import EngineConfig
    from omnistage.models.loader import load_causal_lm

    cfg = EngineConfig(device="cpu", dtype="float32", max_num_seqs=rows, max_num_batched_tokens=8192,
                       block_size=16)
    engine = AREngine(path, cfg, loader=load_causal_lm)
    device = Timer()
    engine.runner.forward = device.wrap(engine.runner.forward)
    engine.model.compute_logits = device.wrap(engine.model.compute_logits)
    for name in ("sample", "greedy_ids"):       # (an older tree has no greedy_ids)
        if hasattr(runner_mod, name):
            setattr(runner_mod, name, device.wrap(getattr(runner_mod, name)))
    return engine, device


def run_mix(engine, device: Timer, rows: int, new: int, mix, profile: int = 0) -> dict:
    from omnistage.params import SamplingParams

    known = {f.name for f in dataclasses.fields(SamplingParams)}   # an older tree (the "before" run) may lack some
    g = torch.Generator().manual_seed(0)
    vocab = engine.hf_config.vocab_size
    for i in range(rows):
        ids = torch.randint(10, vocab - 10, (16,), generator=g).tolist()
        kw = {k: v for k, v in mix(i).items() if k in known}
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, SamplingParams(max_tokens=new, **kw))
    host: list[float] = []                      # per full decode step: host seconds per row
    wall, dev, steps = 0.0, 0.0, 0
    prof = cProfile.Profile() if profile else None
    while engine.has_unfinished():
        n_running = len(engine.scheduler.running)
        prefilling = bool(engine.scheduler.waiting) or any(s.num_computed_tokens < s.prompt_len
                                                            for s in engine.scheduler.running)
        device.seconds, device.on = 0.0, True
        if prof is not None and not prefilling:
            prof.enable()
        t = time.process_time()
        engine.step()
        dt = time.process_time() - t
        if prof is not None:
            prof.disable()
        device.on = False
        if prefilling or n_running < rows:      # only full decode steps count
            continue
        wall += dt
        dev += device.seconds
        host.append((dt - device.seconds) / n_running)
        steps += 1
    out = {"steps": steps, "wall_ms_per_step": 1e3 * wall / max(steps, 1),
           "device_ms_per_step": 1e3 * dev / max(steps, 1),
           # the median: the machine may be shared, and a few steps hit a garbage collection
           "host_us_per_row_step": 1e6 * sorted(host)[len(host) // 2] if host else float("nan")}
    if prof is not None:
        out["profile"] = prof
        # deterministic, whatever else loads the machine: Python calls per row-step in the decode steps
        out["calls_per_row_step"] = pstats.Stats(prof).total_calls / max(steps * rows, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--profile", type=int, default=15, help="cProfile entries to print (0: none)")
    args = ap.parse_args()
    from omnistage.testing.llm import make_tiny_lm

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_lm(tmp, "llama", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
        torch.set_num_threads(1)
        engine, device = build(path, args.rows)
        run_mix(engine, device, 8, 4, MIXES["greedy"])                  # warm-up
        results = {name: run_mix(engine, device, args.rows, args.new, mix) for name, mix in MIXES.items()}
        if args.profile:                        # a run of its own: the profiler slows what it watches
            r = run_mix(engine, device, args.rows, args.new, MIXES["greedy"], profile=True)
            prof, prof_calls = r["profile"], r["calls_per_row_step"]
    print_table([f"{args.rows} rows x {args.new} new tokens, tiny Llama, CPU", "decode steps", "CPU ms / step",
                 "device ms / step", "host us / row-step (median)"],
                [[name, str(r["steps"]), f"{r['wall_ms_per_step']:.2f}", f"{r['device_ms_per_step']:.2f}",
                  f"{r['host_us_per_row_step']:.1f}"] for name, r in results.items()])
    if args.profile:
        print(f"\ncProfile of the greedy mix's decode steps, top {args.profile} by own time:")
        print(f"Python function calls per row-step: {prof_calls:.1f}")
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
