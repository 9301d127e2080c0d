"""A / B of DiT step variants on the GPU (random bf16 weights at real shapes; one run, ~3 min).

    PYTHONPATH=<diffusers wheels>:. python benchmarks/dit_variants.py [--only gemm,flux,wan] [--smoke]

gemm  sustained TFLOP/s of the GEMM shapes the profile (profile_dit.py) shows, 50 back-to-back calls each:
      FLUX single block's merged q|k|v|mlp projection (4608 x 3072 -> 21504) against q|k|v and mlp apart;
      an MLP up-projection with its tanh GELU as a separate op against cuBLASLt's GELU epilogue
      (`torch._addmm_activation`), at FLUX and Wan2.1-1.3B shapes, with the two outputs' largest
      difference; the 8192^3 matmul rate over 10 calls (what dit_bench's floor uses) and over 200.
flux  FLUX.1-dev 1024^2 one row, our default step compiled with `dynamic` True (today's default), False
      (static shapes), and None (torch's automatic dynamic: static first, then only the changed dims
      symbolic), the last after a 512^2 step so that its graph is the recompiled one; per variant the
      step ms and the profile's kernel ms by kind.
wan   Wan2.1-1.3B 832x480x81 CFG, dynamic True and False.
graph FLUX.1-dev at 512^2 (1 task) and 1024^2: the compiled denoiser call as the runner makes it, against
      the same call captured once in a CUDA graph and replayed (inputs fixed): what a whole-forward graph
      per step shape would save where the step is host-bound (profile_dit: 512^2 runs 57 ms for 37 ms of
      kernels), with the largest difference of the two outputs; then the runner's step with our
      `step_graphs` and with the blocks compiled in mode "reduce-overhead" (inductor's per-block CUDA
      graph trees) beside the default.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dit_bench  # noqa: E402
import profile_dit  # noqa: E402
from omnistage.config import EngineConfig  # noqa: E402
from omnistage.diffusion.engine import DiffusionEngine  # noqa: E402
from omnistage.diffusion.speed import DiffusionSpeed  # noqa: E402
from omnistage.params import DiffusionParams  # noqa: E402


def rate(fn, flops: float, device, iters: int = 50) -> float:
    for _ in range(3):
        fn()
    dit_bench.sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    dit_bench.sync(device)
    return flops * iters / (time.perf_counter() - start) / 1e12


def gemm_rows(device, dtype, smoke: bool) -> None:
    print("\n| GEMM (M x K -> N) | variant | TFLOP/s sustained (50 calls) | max abs diff vs unfused |\n|---|---|---|---|")
    scale = 16 if smoke else 1
    m, k = 4608 // scale, 3072 // scale
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(21504 // scale, k, device=device, dtype=dtype) * k ** -0.5
    b = torch.randn(21504 // scale, device=device, dtype=dtype)
    nq = 9216 // scale
    flops = 2 * m * k * w.shape[0]
    print(f"| {m} x {k} -> {w.shape[0]} | merged, one GEMM | {rate(lambda: F.linear(x, w, b), flops, device):.0f} | - |")
    wq, wm, bq, bm = w[:nq].contiguous(), w[nq:].contiguous(), b[:nq].contiguous(), b[nq:].contiguous()
    print(f"| {m} x {k} -> {nq} + {w.shape[0] - nq} | two GEMMs | "
          f"{rate(lambda: (F.linear(x, wq, bq), F.linear(x, wm, bm)), flops, device):.0f} | - |")
    for label, mm, kk, nn in (("FLUX mlp", 4608, 3072, 12288), ("FLUX double ff", 4096, 3072, 12288),
                              ("Wan ffn", 65520, 1536, 8960)):
        mm, kk, nn = mm // scale, kk // scale, nn // scale
        a = torch.randn(mm, kk, device=device, dtype=dtype)
        wt = torch.randn(nn, kk, device=device, dtype=dtype) * kk ** -0.5
        bias = torch.randn(nn, device=device, dtype=dtype)
        f = 2 * mm * kk * nn
        unfused = F.gelu(F.linear(a, wt, bias), approximate="tanh")
        fused = torch._addmm_activation(bias, a, wt.t(), use_gelu=True)
        diff = (fused.float() - unfused.float()).abs().max().item()
        print(f"| {label} {mm} x {kk} -> {nn} | linear, then gelu(tanh) | "
              f"{rate(lambda: F.gelu(F.linear(a, wt, bias), approximate='tanh'), f, device):.0f} | 0 |")
        print(f"| {label} {mm} x {kk} -> {nn} | GELU epilogue (_addmm_activation) | "
              f"{rate(lambda: torch._addmm_activation(bias, a, wt.t(), use_gelu=True), f, device):.0f} | {diff:.3g} |")
        print(f"| {label} {mm} x {kk} -> {nn} | linear alone | {rate(lambda: F.linear(a, wt, bias), f, device):.0f} | - |")
    n = 8192 // scale
    a, c = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for iters in (10, 200):
        print(f"| {n}^3 matmul | {iters} calls | {rate(lambda: a @ c, 2 * n ** 3, device, iters):.0f} | - |")
    sys.stdout.flush()


def step_variant(label, family, params, warm_params, dynamic, device, s) -> None:
    speed = dataclasses.replace(DiffusionSpeed.from_config(EngineConfig(device=str(device))), compile_dynamic=dynamic)
    engine = DiffusionEngine.from_family(family, speed=speed)
    start = time.perf_counter()
    if warm_params is not None:                 # a first shape: the step below recompiles (automatic dynamic)
        engine.runner.step(profile_dit.tasks_for(family, warm_params, 1))
    warm_s = time.perf_counter() - start
    step = profile_dit.repeat_step(engine, profile_dit.tasks_for(family, params, 1))
    first, ms = profile_dit.first_then_timed(step, device, s, s["warmup"])
    first += warm_s
    p = profile_dit.profile_step(step, device)
    kinds = ", ".join(f"{k} {v:.1f}" for k, v in p["kind_ms"].items())
    print(f"| {label} | dynamic={dynamic} | {ms:.2f} | {first:.1f} | {kinds} |", flush=True)


def graph_rows(family, sizes, device, s) -> None:
    """The denoiser call of one task eager (compiled blocks) and replayed from a CUDA graph."""
    speed = DiffusionSpeed.from_config(EngineConfig(device=str(device)))
    engine = DiffusionEngine.from_family(family, speed=speed)
    runner = engine.runner
    print("\n| FLUX denoiser call | compiled, as the runner calls it (ms) | CUDA graph replay (ms) | max abs diff |"
          "\n|---|---|---|---|")
    for size in sizes:
        params = DiffusionParams(height=size, width=size, num_inference_steps=50, guidance_scale=3.5, seed=0)
        task = profile_dit.tasks_for(family, params, 1)[0]
        key = family.key(task)
        x = family.model_input(task)
        t = family.model_timestep(task).reshape(1).expand(x.shape[0]).to(x.device)
        conds = [task.cond]

        def call():
            with runner.phase("denoise"), runner.constants(key):
                return runner.denoise(key, x, t, conds, [task], [0])
        eager_ms = dit_bench.timed(call, device, s["iters"], s["warmup"]) * 1e3
        if device.type != "cuda":
            print(f"| {size}^2 | {eager_ms:.2f} | - | - |", flush=True)
            continue
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    call()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = call()
            want = call()
            graph.replay()
            diff = (out.float() - want.float()).abs().max().item()
            graph_ms = dit_bench.timed(graph.replay, device, s["iters"], s["warmup"]) * 1e3
            print(f"| {size}^2 | {eager_ms:.2f} | {graph_ms:.2f} | {diff:.3g} |", flush=True)
            del graph, out
        except Exception as e:                  # a capture that fails is a finding, not a crash
            print(f"| {size}^2 | {eager_ms:.2f} | capture failed: {type(e).__name__}: {str(e)[:120]} | - |",
                  flush=True)
    step_rows(family, sizes, device, s)         # the engine's step graphs and torch's per-block graphs


def step_rows(family, sizes, device, s) -> None:
    """The runner's step, 1 task: our default; with `step_graphs` (diffusion/step_graphs.py: the whole
    denoiser call replayed from one CUDA graph per shape); with the blocks compiled in mode
    "reduce-overhead" (inductor's CUDA graph trees per block; not a `diffusion_compile_mode` users can
    pick: measured here first); FP8 without and with step graphs. Per row the largest difference of the
    latents after one step from the default's, or from FP8's for the FP8 rows (same seed, same start)."""
    print("\n| FLUX step, 1 task | variant | ms per step | first call s | max abs diff of the stepped latents |"
          "\n|---|---|---|---|---|")
    base = DiffusionSpeed.from_config(EngineConfig(device=str(device)))
    first_out: dict = {}
    fp8 = DiffusionSpeed.from_config(EngineConfig(device=str(device), quantization="fp8"))
    for label, speed in (("default", base), ("step graphs", dataclasses.replace(base, step_graphs=True)),
                         ("reduce-overhead", dataclasses.replace(base, compile_mode="reduce-overhead")),
                         ("fp8", fp8), ("fp8 + step graphs", dataclasses.replace(fp8, step_graphs=True))):
        try:
            engine = DiffusionEngine.from_family(family, speed=speed)
            for size in sizes:
                params = DiffusionParams(height=size, width=size, num_inference_steps=50, guidance_scale=3.5, seed=0)
                torch.manual_seed(0)                # the bench's random prompt embeddings: the same per variant
                tasks = profile_dit.tasks_for(family, params, 1)
                step = profile_dit.repeat_step(engine, tasks)
                first, ms = profile_dit.first_then_timed(step, device, s, s["warmup"] + 2)
                step()
                out = tasks[0].latents.float()
                ref = first_out.setdefault((size, label.startswith("fp8")), out)   # fp8 rows against fp8
                print(f"| {size}^2 | {label} | {ms:.2f} | {first:.1f} | {(out - ref).abs().max().item():.3g} |",
                      flush=True)
            graphs = engine.accel.graphs
            if graphs is not None:
                print(f"step graphs: {graphs.captures} captured, {graphs.replays} replays, failed {graphs.failed}",
                      flush=True)
        except Exception as e:
            print(f"| - | {label} | failed: {type(e).__name__}: {str(e)[:150]} | - | - |", flush=True)


def main(argv=None) -> None:
    only, s, device, dtype, smoke = profile_dit.setup(__doc__, "gemm,flux,wan,graph", argv)
    with torch.no_grad():
        if "gemm" in only:
            gemm_rows(device, dtype, smoke)
    if only & {"flux", "wan"}:
        print("\n| step | compile | ms per step | first call s (compile) | kernel ms by kind |\n|---|---|---|---|---|")
    if "flux" in only:
        _, flux = profile_dit.flux_family(s, smoke, device, dtype)

        def fp(size):
            return DiffusionParams(height=size, width=size, num_inference_steps=50, guidance_scale=3.5, seed=0)
        big, small = fp(s["flux"]["size"]), fp(s["thr"]["size"])
        for dynamic, warm in ((True, None), (False, None), (None, small)):
            step_variant(f"FLUX {s['flux']['size']}^2" + (" after a 512^2 step" if warm else ""), flux, big, warm,
                         dynamic, device, s)
        del flux
        dit_bench._free(device)
    if "graph" in only:
        _, flux = profile_dit.flux_family(s, smoke, device, dtype)
        with torch.no_grad():
            graph_rows(flux, (s["thr"]["size"], s["flux"]["size"]), device, s)
        del flux
        dit_bench._free(device)
    if "wan" in only:
        _, wan, params = profile_dit.wan_family(s, smoke, device, dtype)
        for dynamic in (True, False):
            step_variant("Wan2.1-1.3B CFG", wan, params, None, dynamic, device, dict(s, iters=2))


if __name__ == "__main__":
    main()
