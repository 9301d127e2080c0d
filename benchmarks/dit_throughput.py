"""The throughput rows of `dit_bench.py` (imported by it; one GPU run, or --smoke on CPU).

In: a FLUX family built by dit_bench (random weights, random prompt embeddings), the request count,
size and steps. Out: seconds and requests/s of the n requests through diffusers' `FluxPipeline` one at a
time and through our `DiffusionEngine` one at a time (max_num_seqs=1) and with step batching
(max_num_seqs=n), each warmed first; on CUDA the GPU-busy share of a few steps; the FLOPs floor.
"""

from __future__ import annotations

import time

import torch

import dit_speed
from omnistage.config import EngineConfig
from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.speed import DiffusionSpeed
from omnistage.params import DiffusionParams


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def throughput(family, n: int, size: int, steps: int, batched: bool, speed=None) -> dict:
    """n requests through one engine (`speed`: None = no speed feature), warmed by one 2-step request
    and, batched, by one round of n 2-step requests (compiles each batch size's graphs once)."""
    engine = DiffusionEngine.from_family(family, max_num_seqs=n if batched else 1, speed=speed)

    def requests(count: int, num_steps: int) -> dict:
        return {f"r{i}": ({"prompt": "x"}, DiffusionParams(height=size, width=size, num_inference_steps=num_steps,
                                                           seed=i)) for i in range(count)}
    engine.generate(requests(n if batched else 1, 2))
    sync(family.device)
    start = time.perf_counter()
    outs = engine.generate(requests(n, steps))
    sync(family.device)
    seconds = time.perf_counter() - start
    assert len(outs) == n and all(len(o.images) == 1 for o in outs.values())
    out = {"seconds": seconds, "requests_per_s": n / seconds, "max_batch_tasks": engine.stats()["max_batch_tasks"]}
    if family.device.type == "cuda":            # where a step's time goes: GPU kernels vs gaps between them
        out["gpu_busy"] = gpu_busy(lambda: engine.generate(requests(n if batched else 1, 3)))
    return out


def gpu_busy(fn) -> float:
    """Share of the wall time of `fn()` during which a CUDA kernel ran (kernel intervals merged, from the
    profiler): near 1 = GPU-bound; well under 1 = the GPU waits on the host (launches, syncs, Python)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        # "## ... ##" CUDA events are annotations spanning a compiled graph's kernels: not kernels
        spans = [(e.time_range.start, e.time_range.end) for e in prof.events()
                 if e.device_type.name == "CUDA" and not e.name.startswith("## ")]
    except Exception as e:                      # the measured row matters more than this extra column
        print(f"gpu_busy failed: {type(e).__name__}: {e}", flush=True)
        return float("nan")
    return busy_us(spans) / 1e6 / wall


def busy_us(spans) -> float:
    """Microseconds covered by the (start, end) kernel intervals `spans` (overlapping ones merged)."""
    busy, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


def diffusers_throughput(family, n: int, size: int, steps: int) -> dict:
    """diffusers' `FluxPipeline.__call__` per request on the family's transformer, VAE and scheduler
    config, with random prompt embeddings of the real shape (what our bench family's encode makes)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(family.scheduler_config),
                        vae=family.vae, text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
                        transformer=family.transformer)
    pipe.set_progress_bar_config(disable=True)

    def call(seed: int, num_steps: int):
        cond = family.random_cond()
        return pipe(prompt_embeds=cond.embeds[None], pooled_prompt_embeds=cond.pooled[None], height=size, width=size,
                    num_inference_steps=num_steps, guidance_scale=3.5,
                    generator=torch.Generator("cpu").manual_seed(seed)).images
    call(0, 2)
    sync(family.device)
    start = time.perf_counter()
    images = [img for i in range(n) for img in call(i, steps)]
    sync(family.device)
    seconds = time.perf_counter() - start
    assert len(images) == n
    out = {"seconds": seconds, "requests_per_s": n / seconds, "max_batch_tasks": 1}
    if family.device.type == "cuda":
        out["gpu_busy"] = gpu_busy(lambda: call(0, 3))
    return out


def throughput_rows(family, label: str, t: dict, flops_row: float, rate: float, extended: bool = False) -> dict:
    """The throughput section on a FLUX family of its own (the speed rows change theirs): diffusers
    first (plain modules), ours eager (`extended` only), then ours with the default speed features
    (merges + compile + probed attention). `floor_s`: the denoiser FLOPs of every request's steps
    (`flops_row` per row-step) at `rate` (decode not counted): what batching can approach at best."""
    rows = {"shape": f"{label}, {t['size']}x{t['size']}, {t['steps']} steps, {t['n']} requests"}
    args = (family, t["n"], t["size"], t["steps"])
    device = family.device
    rows["requests"] = t["n"]
    rows["floor_s"] = t["n"] * t["steps"] * flops_row / rate if rate else None
    measure = [("diffusers_one_at_a_time", lambda: diffusers_throughput(*args))]
    if extended:
        measure += [("batched", lambda: throughput(*args, batched=True)),
                    ("one_at_a_time", lambda: throughput(*args, batched=False))]
    default = DiffusionSpeed.from_config(EngineConfig(device=str(device)))
    rows["default"] = {"merge_projections": default.merge_projections, "compile": default.compile}
    measure += [("default_one_at_a_time", lambda: throughput(*args, batched=False, speed=default)),
                ("default_batched", lambda: throughput(*args, batched=True, speed=default))]
    for name, fn in measure:
        dit_speed.guarded(rows, name, fn)
    return rows


def throughput_table(t) -> list[str]:
    if not t:
        return []
    d = t["default"]
    default = "ours default (" + " + ".join(k for k in ("merge_projections", "compile") if d[k]) + ")"
    rows = ["", "| throughput: " + t["shape"] + " | seconds | requests/s | largest batch | vs ours one at a time "
            "| vs diffusers one at a time | GPU busy |", "|---|---|---|---|---|---|---|"]
    ok = {k: r for k, r in t.items() if isinstance(r, dict) and "requests_per_s" in r}
    base = ok.get("diffusers_one_at_a_time", {}).get("requests_per_s")
    for key, label, alone in (("diffusers_one_at_a_time", "diffusers pipe() one at a time", None),
                              ("one_at_a_time", "one at a time", "one_at_a_time"),          # ours, eager
                              ("batched", "step batching (max_num_seqs=8)", "one_at_a_time"),
                              ("default_one_at_a_time", f"{default}, one at a time", "default_one_at_a_time"),
                              ("default_batched", f"{default}, step batching", "default_one_at_a_time")):
        r = ok.get(key)
        if r is None:
            if isinstance(t.get(key), dict):
                rows.append(f"| {label} | error: {t[key].get('error', '')[:120]} | | | | | |")
            continue
        vs_ours = f"{r['requests_per_s'] / ok[alone]['requests_per_s']:.2f}x" if alone in ok else "-"
        vs_base = f"{r['requests_per_s'] / base:.2f}x" if base else "-"
        busy = f"{r['gpu_busy']:.0%}" if "gpu_busy" in r else "-"
        rows.append(f"| {label} | {r['seconds']:.2f} | {r['requests_per_s']:.3f} | {int(r['max_batch_tasks'])} | "
                    f"{vs_ours} | {vs_base} | {busy} |")
    if t.get("floor_s"):
        rows.append(f"| floor (denoiser FLOPs of all steps / matmul rate; decode not counted) | {t['floor_s']:.2f} "
                    f"| {t['requests'] / t['floor_s']:.3f} | | | | |")
    return rows
