"""Where a DiT step's GPU time goes (random bf16 weights at real shapes, our default speed features).

    PYTHONPATH=<diffusers wheels>:. python benchmarks/profile_dit.py [--only flux,batch,wan] [--smoke]

Sections:
  flux   FLUX.1-dev, 1024^2, one row: the engine's step (merged projections + regional compile + probed
         attention), then the same step profiled.
  batch  FLUX.1-dev, 512^2: one task per step and 8 tasks at different timesteps in one step.
  fp8    FLUX.1-dev, 1024^2, one row, with quantization="fp8" (the DiT blocks' linear layers).
  wan    Wan2.1-1.3B, 832x480x81 with CFG (2 rows).
Per profiled step: wall ms, the share of it some CUDA kernel ran (GPU busy), kernel ms by kind (GEMM,
attention, Triton / inductor, other), the top kernels, and each GEMM shape's ms and TFLOP/s (from the
profiler's aten ops with their input shapes), beside the analytic FLOP floor at the measured matmul rate.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dit_bench  # noqa: E402  (the bench families and shapes)
import dit_throughput  # noqa: E402
from omnistage.config import EngineConfig  # noqa: E402
from omnistage.diffusion.engine import DiffusionEngine  # noqa: E402
from omnistage.diffusion.speed import DiffusionSpeed  # noqa: E402
from omnistage.params import DiffusionParams  # noqa: E402

KINDS = (("attention", ("flash", "fmha", "cudnn", "attention", "attn")),
         ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "sm80_", "wgmma")),
         ("triton / inductor", ("triton",)))
GEMM_OPS = {"aten::mm": 2, "aten::addmm": 2, "aten::bmm": 2, "aten::_scaled_mm": 2, "aten::linear": 2}


def kind(name: str) -> str:
    low = name.lower()
    for label, keys in KINDS:
        if any(k in low for k in keys):
            return label
    return "other"


def gemm_flops(op: str, shapes: list) -> float:
    """2*M*N*K from the profiler's input shapes of a GEMM op (0 when they are not the expected ones)."""
    try:
        if op == "aten::addmm":
            (m, k), (_, n) = shapes[1], shapes[2]
        elif op == "aten::linear":
            a, (n, k) = shapes[0], shapes[1]
            m = 1
            for d in a[:-1]:
                m *= d
        elif op == "aten::bmm":
            (b, m, k), (_, _, n) = shapes[0], shapes[1]
            m *= b
        else:                                   # mm, _scaled_mm
            (m, k), (_, n) = shapes[0], shapes[1]
        return 2.0 * m * n * k
    except (ValueError, TypeError, IndexError):
        return 0.0


def profile_step(fn, device, steps: int = 2) -> dict:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    dit_bench.sync(device)
    with profile(activities=acts, record_shapes=True) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        dit_bench.sync(device)
        wall = (time.perf_counter() - start) / steps
    # CUDA events named "## ... ##" are annotations spanning a compiled graph's kernels, not kernels
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA" and not e.name.startswith("## ")]
    busy = dit_throughput.busy_us((e.time_range.start, e.time_range.end) for e in kernels)
    by_kind: dict = collections.Counter()
    by_name: dict = collections.Counter()
    count: dict = collections.Counter()
    for e in kernels:
        us = e.time_range.end - e.time_range.start
        by_kind[kind(e.name)] += us
        by_name[e.name[:90]] += us
        count[e.name[:90]] += 1
    gemms = []
    for avg in prof.key_averages(group_by_input_shape=True):
        if avg.key in GEMM_OPS:
            us = getattr(avg, "device_time_total", 0) or getattr(avg, "cuda_time_total", 0)
            if us <= 0:
                continue
            flops = gemm_flops(avg.key, avg.input_shapes) * avg.count
            gemms.append({"op": avg.key, "shapes": str(avg.input_shapes)[:80], "calls": avg.count // steps,
                          "ms": us / 1e3 / steps, "tflops": flops / (us / 1e6) / 1e12 if flops else 0.0})
    gemms.sort(key=lambda g: -g["ms"])
    return {"wall_ms": wall * 1e3, "gpu_busy": busy / 1e6 / steps / wall if wall else 0.0,
            "kind_ms": {k: v / 1e3 / steps for k, v in by_kind.most_common()},
            "top": [(n, us / 1e3 / steps, count[n] // steps) for n, us in by_name.most_common(18)],
            "gemms": gemms[:14]}


def show(label: str, p: dict, floor_ms: float) -> None:
    print(f"\n### {label}: {p['wall_ms']:.2f} ms per step (floor {floor_ms:.2f} ms), GPU busy {p['gpu_busy']:.3f}",
          flush=True)
    print("| kind | ms per step |\n|---|---|")
    for k, ms in p["kind_ms"].items():
        print(f"| {k} | {ms:.2f} |")
    print("\n| kernel | ms per step | launches |\n|---|---|---|")
    for name, ms, n in p["top"]:
        print(f"| `{name}` | {ms:.3f} | {n} |")
    print("\n| GEMM op | input shapes | calls per step | ms per step | TFLOP/s |\n|---|---|---|---|---|")
    for g in p["gemms"]:
        print(f"| {g['op']} | {g['shapes']} | {g['calls']} | {g['ms']:.3f} | {g['tflops']:.0f} |")
    sys.stdout.flush()


def engine_for(family, device, n: int = 1, quantization=None):
    speed = DiffusionSpeed.from_config(EngineConfig(device=str(device), quantization=quantization))
    return DiffusionEngine.from_family(family, max_num_seqs=n, speed=speed)


def tasks_for(family, params: DiffusionParams, n: int, stagger: int = 1) -> list:
    tasks = []
    for i in range(n):
        task = family.new_task(f"p{i}", {"prompt": "x"}, dataclasses.replace(params, seed=i))
        family.encode([task])
        family.prepare(task)
        task.step_index = min(i * stagger, params.num_inference_steps - 2)    # different timesteps, one forward
        tasks.append(task)
    return tasks


def repeat_step(engine, tasks):
    """One runner step of `tasks` that starts from their state at this call each time it runs (step
    index and latents), so timed steps repeat the same work."""
    start = [(t.step_index, t.latents.clone()) for t in tasks]

    def step():
        for task, (index, latents) in zip(tasks, start):
            task.step_index, task.latents = index, latents.clone()
        engine.runner.step(tasks)
    return step


def first_then_timed(step, device, s: dict, warmup: int) -> tuple[float, float]:
    """(seconds of the first call of `step`, compile included; then its median ms after `warmup` calls)."""
    start = time.perf_counter()
    step()
    dit_bench.sync(device)
    first = time.perf_counter() - start
    return first, dit_bench.timed(step, device, s["iters"], warmup) * 1e3


def run_section(label, family, params, n, floor_row_s, device, s, quantization=None) -> None:
    engine = engine_for(family, device, n, quantization)
    tasks = tasks_for(family, params, n)
    step = repeat_step(engine, tasks)
    first, ms = first_then_timed(step, device, s, s["warmup"])
    print(f"{label}: first step {first:.2f} s (compile included), "
          f"attention {engine.accel.routers['dit'].name}, compiled blocks {engine.accel.compiled_blocks}", flush=True)
    rows = sum(t.num_rows for t in tasks)
    print(f"{label}: {ms:.2f} ms per step, {rows} rows, floor {rows * floor_row_s * 1e3:.2f} ms", flush=True)
    show(label, profile_step(step, device), rows * floor_row_s * 1e3)


def setup(doc: str, sections: str, argv=None):
    """The scripts' command line (--only SECTIONS, --smoke) and device: (sections, shapes, device, dtype,
    smoke); prints the device."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=sections)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the script)")
    args = ap.parse_args(argv)
    s = dit_bench.SMOKE if args.smoke else dit_bench.FULL
    config = EngineConfig(device="cpu" if args.smoke else "auto").resolved("diffusion")
    device, dtype = config.torch_device(), config.torch_dtype()
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}",
          flush=True)
    return set(args.only.split(",")), s, device, dtype, args.smoke


def flux_family(s: dict, smoke: bool, device, dtype):
    """(its config, a FLUX.1-dev-shaped bench family with random weights)."""
    from diffusers import FluxTransformer2DModel

    cfg = dict(dit_bench.FLUX, **s.get("flux_cfg", {}))
    return cfg, dit_bench.build(dit_bench.BenchFlux, FluxTransformer2DModel, cfg, dit_bench.flux_vae_for(s, smoke),
                                dit_bench.FLUX_SCHEDULER, s["flux"]["text"], device, dtype)


def wan_family(s: dict, smoke: bool, device, dtype):
    """(its config, a Wan2.1-1.3B-shaped bench family with random weights, the CFG video params)."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    cfg = dict(dit_bench.WAN, **s.get("wan_cfg", {}))
    vae = AutoencoderKLWan(**(dict(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
                                   scale_factor_temporal=2, scale_factor_spatial=2) if smoke else {}))
    w = s["wan"]
    wan = dit_bench.build(dit_bench.BenchWan, WanTransformer3DModel, cfg, vae, dit_bench.WAN_SCHEDULER, w["text"],
                          device, dtype)
    params = DiffusionParams(height=w["height"], width=w["width"], num_frames=w["frames"], num_inference_steps=50,
                             guidance_scale=5.0, seed=0)
    return cfg, wan, params


def main(argv=None) -> None:
    only, s, device, dtype, smoke = setup(__doc__, "flux,batch,fp8,wan", argv)
    rate = dit_bench.matmul_rate(device, dtype, s["matmul"])
    print(f"matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    if only & {"flux", "batch", "fp8"}:
        cfg, flux = flux_family(s, smoke, device, dtype)
        # fp8 last: it swaps the family's linear layers for good
        for size, n, label, wanted in ((s["flux"]["size"], 1, "FLUX 1024^2, 1 row", "flux"),
                                       (s["thr"]["size"], 1, "FLUX 512^2, 1 task", "batch"),
                                       (s["thr"]["size"], 8, "FLUX 512^2, 8 tasks", "batch"),
                                       (s["flux"]["size"], 1, "FLUX 1024^2, 1 row, fp8", "fp8")):
            if wanted not in only:
                continue
            tokens = (size // flux.multiple) ** 2
            params = DiffusionParams(height=size, width=size, num_inference_steps=50, guidance_scale=3.5, seed=0)
            run_section(label, flux, params, n, dit_bench.flux_flops(cfg, tokens, s["flux"]["text"]) / rate,
                        device, s, quantization="fp8" if wanted == "fp8" else None)
        del flux
        dit_bench._free(device)
    if "wan" in only:
        cfg, wan, params = wan_family(s, smoke, device, dtype)
        w = s["wan"]
        lat = ((w["frames"] - 1) // wan.t_scale + 1, w["height"] // wan.s_scale, w["width"] // wan.s_scale)
        run_section("Wan2.1-1.3B 832x480x81, CFG", wan, params, 1,
                    dit_bench.wan_flops(cfg, *lat, w["text"]) / rate, device, dict(s, iters=2))


if __name__ == "__main__":
    main()
