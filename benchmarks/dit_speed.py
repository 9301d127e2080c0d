"""The speed-feature rows of `dit_bench.py` (imported by it; one GPU run, or --smoke on CPU).

Per workload (a family built by dit_bench with random bf16 weights at real shapes), one task, per-step
seconds of:
  diffusers + compile   diffusers' own regional compile (`compile_repeated_blocks`) of the same
                        module, the pipeline's module calls per step (undone afterwards)
  ours eager, NAME      our runner's step with the DiT attention pinned to NAME (EAGER_BACKENDS: the
                        SDPA kernels cuDNN / flash / efficient, FlexAttention), no compile
  ours eager, auto      "auto" as a CUDA stage runs it: the backend the load-time probe measured fastest
                        on the family's attention shape (diffusion/attention.py `probe`; its timings kept)
  ours compile, unmerged     (`extended` only) regional compile, projections left separate
  ours default          `DiffusionSpeed.from_config` for CUDA: merged projections (one GEMM per group
                        of `merged_projections`) + regional compile + the probed attention backend
  ours + sage           the default with SAGE_ATTN for the DiT (8-bit attention; lossy)
  ours + fp8            the default with the DiT blocks' linear layers in FP8, merged ones included (lossy;
                        applied last; the activation quantization compiles into the blocks' kernels)
  ours + fp8 + sage     both (quantization="fp8", attention_backend="sage"; lossy)
each with its first-call seconds (compile included) and the relative error of one denoiser output vs
the eager bf16 forward (the correctness block: compiled vs eager, sage vs SDPA, fp8 vs bf16).
`mode_rows`: eager vs each `diffusion_compile_mode` on a FLUX-shaped DiT with fewer blocks.
`offload_rows`: peak memory and step time of a Wan-14B-shaped DiT with fewer blocks (stated in the
row) resident / model-level / layerwise. `fusion_row`: CUDA kernels of one FLUX single block, eager vs
compiled, separate vs merged projections (what the compile fuses). Every row runs in try/except (a
failing row prints its error and the others still run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import traceback

import torch

from omnistage.config import EngineConfig
from omnistage.diffusion.attention import AttentionRouter
from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.speed import DiffusionSpeed, dit_blocks, quantize_fp8

WAN14B = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
              out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
              qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)


# one eager row each (the 8-bit one has its compiled rows: ours + sage, ours + fp8 + sage)
EAGER_BACKENDS = ("CUDNN_ATTN", "FLASH_ATTN", "EFFICIENT_ATTN", "FLEX_ATTN")


def guarded(rows: dict, name: str, fn) -> None:
    """rows[name] = fn(), or {"error": ...} (printed) when it raises; prints the row as it is measured."""
    start = time.perf_counter()
    try:
        rows[name] = fn()
    except Exception as e:                      # one failing row must not lose the table
        traceback.print_exc()
        rows[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    print(f"[{time.perf_counter() - start:6.1f} s] {name}: {_short(rows[name])}", flush=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _short(row) -> str:
    """A row for the progress print: its floats rounded, nested dicts left out."""
    if not isinstance(row, dict):
        return str(row)[:200]
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                     if not isinstance(v, dict))[:300]


def _one_output(family, task, phase=None) -> torch.Tensor:
    """One denoiser output at the task's saved start state (`task.static["bench_start"]`), so that rows
    run after steps advanced the task still compare the same forward."""
    latents, index = task.latents, task.step_index
    task.latents, task.step_index = task.static["bench_start"]
    try:
        return _forward(family, task, phase)
    finally:
        task.latents, task.step_index = latents, index


def _forward(family, task, phase) -> torch.Tensor:
    x = torch.cat([family.model_input(task)] * (2 if task.do_cfg else 1))
    t = family.model_timestep(task).reshape(1).expand(x.shape[0]).to(x.device)
    conds = [task.cond] + ([task.uncond] if task.do_cfg else [])
    with torch.no_grad(), (phase("denoise") if phase else contextlib.nullcontext()):
        return family.denoise(family.key(task), x, t, conds, [task] * len(conds)).float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _first_and_steady(fn, bench, s) -> tuple[float, float]:
    bench.sync(bench.DEVICE)
    start = time.perf_counter()
    fn()
    bench.sync(bench.DEVICE)
    first = time.perf_counter() - start
    return first, bench.timed(fn, bench.DEVICE, s["iters"], 0)


def speed_rows(bench, family, params, diffusers_call, s: dict, smoke: bool, extended: bool = False) -> dict:
    """The rows above for one workload; mutates `family` (compile, FP8): run it last on that family.
    `extended` adds the unmerged compile row (one more compile of every block)."""
    rows: dict = {}
    task = family.new_task("speed", {"prompt": "x"}, params)
    family.encode([task])
    family.prepare(task)
    task.static["bench_start"] = (task.latents.clone(), task.step_index)
    eager = _one_output(family, task)
    on_gpu = family.device.type == "cuda"

    def diffusers_compiled():
        model = family.experts[0] if hasattr(family, "experts") else family.transformer
        model.compile_repeated_blocks(dynamic=True)
        try:
            with torch.no_grad():
                first, steady = _first_and_steady(lambda: diffusers_call(task), bench, s)
                latents, index = task.latents, task.step_index
                task.latents, task.step_index = task.static["bench_start"]
                out = diffusers_call(task).float()
                task.latents, task.step_index = latents, index
        finally:
            for m in model.modules():           # undo: the next rows run our own compile
                m._compiled_call_impl = None
        return {"step_s": steady, "first_s": first, "rel_err_vs_eager": _rel(out[: eager.shape[0]], eager)}
    if on_gpu:
        guarded(rows, "diffusers + compile", diffusers_compiled)

    def ours(attention: str, probe: bool = False):
        def row():
            engine = DiffusionEngine.from_family(family, speed=DiffusionSpeed(
                attention={"dit": attention, "text_encoder": "auto"}, compile=False, probe_attention=probe))
            first, steady = _first_and_steady(lambda: engine.runner.step([task]), bench, s)
            out = {"step_s": steady, "first_s": first, "attention": engine.accel.routers["dit"].name,
                   "rel_err_vs_eager": _rel(_one_output(family, task, engine.accel.phase), eager)}
            if engine.accel.attention_probe is not None:
                out["probe"] = engine.accel.attention_probe.as_dict()
            return out
        return row
    for name in (EAGER_BACKENDS if on_gpu else ("MATH_ATTN",)):
        guarded(rows, f"ours eager, {name}", ours(name))
    guarded(rows, "ours eager, auto (probed at load)", ours("auto", probe=True))

    default = DiffusionSpeed.from_config(EngineConfig(device=str(family.device)))   # compile: CUDA only
    holder: dict = {}

    def ours_with(speed):
        def row():
            engine = DiffusionEngine.from_family(family, speed=speed)
            holder["engine"] = engine
            first, steady = _first_and_steady(lambda: engine.runner.step([task]), bench, s)
            return {"step_s": steady, "first_s": first, "compiled_blocks": engine.accel.compiled_blocks,
                    "merged_groups": engine.accel.merged_groups, "attention": engine.accel.routers["dit"].name,
                    "rel_err_vs_eager": _rel(_one_output(family, task, engine.accel.phase), eager)}
        return row
    if on_gpu and extended:                     # before the default row merges the family's projections
        guarded(rows, "ours compile, unmerged", ours_with(dataclasses.replace(default, merge_projections=False)))
    guarded(rows, "ours default", ours_with(default))
    engine = holder.get("engine")
    if engine is None:
        return rows
    base_router = engine.accel.routers["dit"]

    def ours_sage():
        engine.accel.routers["dit"] = AttentionRouter("SAGE_ATTN", family.device)
        try:
            first, steady = _first_and_steady(lambda: engine.runner.step([task]), bench, s)
            return {"step_s": steady, "first_s": first,
                    "rel_err_vs_eager": _rel(_one_output(family, task, engine.accel.phase), eager)}
        finally:
            engine.accel.routers["dit"] = base_router
    guarded(rows, "ours + sage", ours_sage)

    def ours_fp8():
        name = "transformer" if "transformer" in family.c else next(iter(family.c))
        layers = sum(quantize_fp8(b) for blocks in dit_blocks(family, name).values() for b in blocks)
        first, steady = _first_and_steady(lambda: engine.runner.step([task]), bench, s)
        return {"step_s": steady, "first_s": first, "fp8_layers": layers,
                "rel_err_vs_eager": _rel(_one_output(family, task, engine.accel.phase), eager)}
    guarded(rows, "ours + fp8", ours_fp8)
    guarded(rows, "ours + fp8 + sage", ours_sage)      # quantization="fp8", attention_backend="sage"
    return rows


def mode_rows(bench, s: dict, smoke: bool) -> dict:
    """Compile modes (`diffusion_compile_mode`) on a FLUX.1-dev-shaped DiT with fewer blocks (per-block
    work is the real one at 1024^2, so a mode's gain per block carries to the 57 blocks), one row each:
    eager and each mode of COMPILE_MODES (first call = its compile), in bf16 and then with FP8."""
    from diffusers import FluxTransformer2DModel

    import dit_bench
    from omnistage.config import COMPILE_MODES

    cfg = dict(dit_bench.FLUX, **s.get("flux_cfg", {}))
    cfg.update(num_layers=1 if smoke else 2, num_single_layers=2 if smoke else 4)
    f = s["flux"]
    family = bench.build(dit_bench.BenchFlux, FluxTransformer2DModel, cfg, dit_bench.flux_vae_for(s, smoke),
                         dit_bench.FLUX_SCHEDULER, f["text"], bench.DEVICE, bench.DTYPE)
    from omnistage.params import DiffusionParams
    task = family.new_task("m", {"prompt": "x"}, DiffusionParams(height=f["size"], width=f["size"],
                                                                 num_inference_steps=50, guidance_scale=3.5, seed=0))
    family.encode([task])
    family.prepare(task)
    rows: dict = {"shape": f"FLUX.1-dev blocks ({cfg['num_layers']} + {cfg['num_single_layers']} of 19 + 38), "
                           f"{f['size']}x{f['size']}, 1 row"}
    on_gpu = bench.DEVICE.type == "cuda"
    # bf16 rows first: FP8 swaps the family's linear layers for good (max-autotune also tunes _scaled_mm)
    for quant in (None, "fp8"):
        for mode in ("eager",) + COMPILE_MODES:
            def row(mode=mode, quant=quant):
                speed = DiffusionSpeed.from_config(EngineConfig(device=str(bench.DEVICE), quantization=quant))
                speed = dataclasses.replace(speed, compile=on_gpu and mode != "eager",
                                            compile_mode="default" if mode == "eager" else mode)
                engine = DiffusionEngine.from_family(family, speed=speed)
                first, steady = _first_and_steady(lambda: engine.runner.step([task]), bench, s)
                return {"step_s": steady, "first_s": first, "compiled_blocks": engine.accel.compiled_blocks}
            guarded(rows, f"{quant} {mode}" if quant else mode, row)
    return rows


def cuda_kernels(fn, bench) -> int:
    """CUDA kernels one call of `fn` launches (after two warm calls), from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        fn()
        fn()
        bench.sync(bench.DEVICE)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            bench.sync(bench.DEVICE)
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def offload_rows(bench, s: dict, smoke: bool) -> dict:
    """Wan-14B-shaped DiT (first `layers` of its 40 blocks; per-block work and weights are the real
    ones, so step time and offloaded memory scale with the block count), one row, no CFG."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    cfg = dict(WAN14B, num_layers=2 if smoke else 8)
    if smoke:
        cfg.update(s["wan_cfg"], num_layers=2)
    w = s["wan"]
    rows: dict = {"shape": f"Wan2.1-14B blocks ({cfg['num_layers']} of 40), {w['width']}x{w['height']}x{w['frames']}, 1 row"}
    vae_kw = dict(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
                  scale_factor_temporal=2, scale_factor_spatial=2) if smoke else {}
    from omnistage.params import DiffusionParams
    params = DiffusionParams(height=w["height"], width=w["width"], num_frames=w["frames"], num_inference_steps=50,
                             guidance_scale=1.0, seed=0)
    for mode in (None, "model", "layerwise"):
        def row(mode=mode):
            family = bench.build(bench.BenchWan, WanTransformer3DModel, cfg, AutoencoderKLWan(**vae_kw),
                                 bench.WAN_SCHEDULER, w["text"], bench.DEVICE, bench.DTYPE)
            engine = DiffusionEngine.from_family(family, speed=DiffusionSpeed(compile=False, offload=mode))
            task = family.new_task("o", {"prompt": "x"}, params)
            family.encode([task])
            family.prepare(task)
            if bench.DEVICE.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            step = bench.timed(lambda: engine.runner.step([task]), bench.DEVICE, s["iters"], s["warmup"])
            peak = torch.cuda.max_memory_allocated() / 2**30 if bench.DEVICE.type == "cuda" else 0.0
            block = family.experts[0].blocks[0]
            block_gib = sum(t.numel() * t.element_size() for t in list(block.parameters())) / 2**30
            out = {"step_s": step, "peak_gib": peak, "block_gib": block_gib, "blocks": cfg["num_layers"]}
            if mode == "layerwise" and bench.DEVICE.type == "cuda":
                out["peak_by_part_gib"] = peak_by_part(block, lambda: engine.runner.step([task]))
            if mode == "model":                 # what a phase change costs: the DiT off and back on
                off = engine.accel.model_offload
                start = time.perf_counter()
                off.use(["text_encoder"])
                off.use(["dit"])
                bench.sync(bench.DEVICE)
                out["dit_swap_s"] = time.perf_counter() - start
            return out
        guarded(rows, mode or "resident", row)
    return rows


def peak_by_part(block, step) -> dict:
    """Where a step's activation memory peaks: for each child of one block, the most memory allocated
    while it ran above what was allocated when it started (GiB), and the step's peak over its start."""
    import torch

    marks: dict = {}
    top = [0]                                  # the step's peak across the resets below

    def pre(name):
        def hook(module, args):
            torch.cuda.synchronize()
            top[0] = max(top[0], torch.cuda.max_memory_allocated())
            marks[name] = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        return hook

    def post(name):
        def hook(module, args, output):
            torch.cuda.synchronize()
            marks[name] = (torch.cuda.max_memory_allocated() - marks[name]) / 2**30
        return hook

    handles = []
    for name, child in block.named_children():
        handles += [child.register_forward_pre_hook(pre(name)), child.register_forward_hook(post(name))]
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:
        step()
        torch.cuda.synchronize()
    finally:
        for h in handles:
            h.remove()
    out = {k: round(v, 3) for k, v in marks.items() if isinstance(v, float)}
    top[0] = max(top[0], torch.cuda.max_memory_allocated())
    out["step_over_start"] = round((top[0] - start) / 2**30, 3)
    out["start"] = round(start / 2**30, 3)
    return out


def fusion_row(bench, flux_family) -> dict:
    """CUDA kernels per call of one FLUX single-stream block at 1024^2, eager vs compiled, with its
    projections separate and merged (q|k|v|mlp as one GEMM, on a copy of the block)."""
    import copy

    from omnistage.layers.merged_linear import merge_linears

    block = flux_family.transformer.single_transformer_blocks[0]
    d = block.attn.to_q.in_features if hasattr(block.attn, "to_q") else 3072
    n = 4608
    x = torch.randn(1, n, d, device=bench.DEVICE, dtype=bench.DTYPE)
    temb = torch.randn(1, d, device=bench.DEVICE, dtype=bench.DTYPE)
    half = block.attn.heads and (d // block.attn.heads)
    rot = (torch.randn(n, half, device=bench.DEVICE), torch.randn(n, half, device=bench.DEVICE))
    txt = torch.randn(1, 512, d, device=bench.DEVICE, dtype=bench.DTYPE)
    x = x[:, 512:]

    merged = copy.deepcopy(block)
    for group in flux_family.merged_projections["single_transformer_blocks"]:
        merge_linears(merged, group)
    out = {}
    for name, b in (("", block), ("merged_", merged)):
        out[f"{name}eager_kernels"] = cuda_kernels(lambda: b(x, txt, temb, rot), bench)
        compiled = torch.compile(b, dynamic=True)
        out[f"{name}compiled_kernels"] = cuda_kernels(lambda: compiled(x, txt, temb, rot), bench)
        out[f"{name}compiled_s"] = bench.timed(lambda: compiled(x, txt, temb, rot), bench.DEVICE, 5, 1)
    del merged
    return out


# which elementwise work a fused kernel's name says it holds (inductor names a kernel after its ops):
# work -> (ops its name must list, ops it must not)
FUSED_WORK = {"AdaLN modulation + norm": (("native_layer_norm", "mul", "add"), ()),
              "rotary": (("neg", "stack", "unbind"), ()), "q / k RMSNorm": (("rsqrt", "mean", "pow"), ()),
              "gated residual": (("add", "mul"), ("layer_norm", "rsqrt", "gelu", "silu"))}


def fused_code_row(bench, flux_family) -> dict:
    """What inductor makes of one FLUX single-stream block (any device; on this CPU too): the aten ops
    the eager block dispatches, and the compiled code's fused kernels (their names list the ops each
    one holds) and extern calls (GEMMs, attention). A kernel holding a layer norm with its scale / shift
    is the AdaLN modulation fused into the norm; neg + stack + unbind is the rotary; the gate multiply
    plus residual add fused after the output GEMM is the gated residual."""
    import re

    from torch._inductor.utils import run_and_get_code
    from torch.utils._python_dispatch import TorchDispatchMode

    block = flux_family.transformer.single_transformer_blocks[0]
    d, heads = block.attn.to_q.in_features, block.attn.heads
    n, t = (64, 8) if bench.DEVICE.type == "cpu" else (4096, 512)
    dev, dt = bench.DEVICE, bench.DTYPE
    x, txt, temb = torch.randn(1, n, d, device=dev, dtype=dt), torch.randn(1, t, d, device=dev, dtype=dt), \
        torch.randn(1, d, device=dev, dtype=dt)
    rot = (torch.randn(n + t, d // heads, device=dev), torch.randn(n + t, d // heads, device=dev))

    class Ops(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Ops.count += 1
            return func(*args, **(kwargs or {}))
    with torch.no_grad(), Ops():
        block(x, txt, temb, rot)
    start = time.perf_counter()
    with torch.no_grad():
        _, codes = run_and_get_code(torch.compile(block.forward, dynamic=True), x, txt, temb, rot)
    code = "\n".join(codes)
    kernels = sorted(set(re.findall(r"^(\w*fused\w*) = async_compile", code, re.M)))
    externs = re.findall(r"extern_kernels\.(\w+)\(|torch\.ops\.aten\.(_scaled_dot_product\w+)\.\w+\(", code)
    found = {work: [k for k in kernels if all(op in k for op in need) and not any(op in k for op in bar)]
             for work, (need, bar) in FUSED_WORK.items()}
    return {"tokens": n + t, "eager_aten_ops": Ops.count, "fused_kernels": kernels,
            "extern_calls": [a or b for a, b in externs], "compile_s": time.perf_counter() - start,
            "fused_work": {work: bool(ks) for work, ks in found.items()}}


def table(res: dict) -> list[str]:
    """Markdown lines of the speed rows (whatever of them ran)."""
    lines = []
    modes = res.get("modes")
    if modes:
        lines += ["", f"| compile mode: {modes.get('shape', '')} | s/step | first call s |", "|---|---|---|"]
        for name, r in modes.items():
            if isinstance(r, dict):
                lines.append(f"| {name} | error: {r['error'][:120]} | |" if "error" in r else
                             f"| {name} | {r['step_s']:.4f} | {r['first_s']:.1f} |")
    for key, label in (("wan", "Wan2.1-1.3B CFG"), ("flux", "FLUX.1-dev")):
        speed = res.get(key, {}).get("speed")
        if not speed:
            continue
        base = res[key]
        lines += ["", f"| {label} {base.get('shape', '')} | s/step | first call s | rel. err vs eager bf16 | floor s/step |",
                  "|---|---|---|---|---|",
                  f"| diffusers (eager) | {base['diffusers_s']:.4f} | - | - | {base['floor_s']:.4f} |"]
        for name, r in speed.items():
            if "error" in r:
                lines.append(f"| {name} | error: {r['error'][:120]} | | | |")
                continue
            chosen = f" ({r['attention']})" if "auto" in name and "attention" in r else ""
            lines.append(f"| {name}{chosen} | {r['step_s']:.4f} | {r['first_s']:.1f} | {r['rel_err_vs_eager']:.1e} | |")
    kern = res.get("kernels")
    if kern:
        lines.append("\nfast paths vs references (FLUX shapes, rel. error): " +
                     ", ".join(f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}" for k, v in kern.items()))
    code = res.get("fused_code")
    if code and "error" not in code:
        lines.append(f"\ninductor on one FLUX single block ({code['tokens']} tokens): {code['eager_aten_ops']} eager aten "
                     f"ops -> {len(code['fused_kernels'])} fused kernels + {len(code['extern_calls'])} extern calls "
                     f"({', '.join(sorted(set(code['extern_calls'])))}); fused: " +
                     ", ".join(f"{w} {'yes' if ok else 'NO'}" for w, ok in code["fused_work"].items()))
    fusion = res.get("fusion")
    if fusion and "error" not in fusion:
        lines.append(f"\nCUDA kernels per FLUX single block call: eager {fusion['eager_kernels']}, "
                     f"compiled {fusion['compiled_kernels']} ({fusion['compiled_s'] * 1e3:.2f} ms); merged "
                     f"projections: eager {fusion.get('merged_eager_kernels')}, compiled "
                     f"{fusion.get('merged_compiled_kernels')} ({fusion.get('merged_compiled_s', 0) * 1e3:.2f} ms)")
    off = res.get("offload")
    if off:
        lines += ["", f"| offload: {off.get('shape', '')} | s/step | peak GiB | peak GiB at 40 blocks (extrapolated) |",
                  "|---|---|---|---|"]
        for mode in ("resident", "model", "layerwise"):
            r = off.get(mode)
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {mode} | error: {r['error'][:120]} | | |")
                continue
            extra = 0.0 if mode == "layerwise" else (40 - r["blocks"]) * r["block_gib"]
            swap = f" (DiT off + on: {r['dit_swap_s']:.2f} s)" if "dit_swap_s" in r else ""
            lines.append(f"| {mode}{swap} | {r['step_s']:.4f} | {r['peak_gib']:.2f} | {r['peak_gib'] + extra:.2f} |")
            if "peak_by_part_gib" in r:
                lines.append("| layerwise step, GiB above the start of each block part: " +
                             ", ".join(f"{k} {v}" for k, v in r["peak_by_part_gib"].items()) + " | | | |")
    return lines


def kernel_row(device, dtype) -> dict:
    """Fast paths vs their references on one real shape (FLUX attention, a FLUX MLP projection)."""
    import torch.nn.functional as F

    from omnistage.layers import fp8_linear, quant_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 24, 4608, 128, device=device, dtype=dtype) for _ in range(3))
    exact = F.scaled_dot_product_attention(q, k, v).float()
    fast = quant_attention.sage_attention(q, k, v).float()
    ref = quant_attention.reference(q, k, v).float()
    lin = torch.nn.Linear(3072, 12288, device=device, dtype=dtype)
    x = torch.randn(4608, 3072, device=device, dtype=dtype)
    f8 = fp8_linear.Fp8Linear.from_linear(lin)
    x8, xs = fp8_linear.quantize_rows(x)
    fp8_ref = fp8_linear.reference(x8, xs, f8.weight_fp8, f8.weight_scale, f8.bias, dtype).float()
    with torch.no_grad():
        fp8_fast, full = f8(x).float(), lin(x).float()
    return {"sage_kernel_vs_reference": _rel(fast, ref), "sage_vs_sdpa": _rel(fast, exact),
            "sage_kernel_used": quant_attention.kernel_supports(q, k, v),
            "fp8_scaled_mm_vs_reference": _rel(fp8_fast, fp8_ref), "fp8_vs_bf16": _rel(fp8_fast, full),
            "fp8_fast_path_used": f8._fast(x)}
