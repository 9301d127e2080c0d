"""Diffusion transformer benchmark on one GPU: our engine's step beside diffusers' module call and
the compute floor, plus step-batching throughput.

Everything is built in code from configs with random bf16 weights (random weights time exactly like
real ones; nothing is downloaded): a Wan2.1-1.3B-shaped `WanTransformer3DModel` and a
FLUX.1-dev-shaped `FluxTransformer2DModel` (19 + 38 blocks, 11.9B), each inside our family class
(`diffusion/pipelines/wan.py`, `flux.py`) with random prompt embeddings of the real shape standing
in for the text encoders. One run measures:
  - per-step time at Wan 480x832x81 frames (CFG: 2 rows) and FLUX 1024x1024 (guidance-distilled:
    1 row): ours = `DiffusionRunner.step` (stack rows + CFG rows, ONE forward, guide, solver update),
    diffusers = the module calls diffusers' pipeline makes per step on the same weights (Wan: a
    conditional and an unconditional call; FLUX: one call);
  - the compute floor = analytic FLOPs of those forwards (every matmul + attention QK^T and PV) /
    the bf16 matmul rate measured in the same run (8192^3);
  - throughput (benchmarks/dit_throughput.py) of 8 concurrent 512x512 FLUX requests (20 steps, decode
    included) on a FLUX family of its own: diffusers' `FluxPipeline.__call__` one request at a time (the
    same random prompt embeddings passed as `prompt_embeds`), and our `DiffusionEngine` with step batching
    (max_num_seqs=8) and one at a time (max_num_seqs=1) with the CUDA default
    (`DiffusionSpeed.from_config`: merged projections + regional compile + probed attention), so both
    ratios (ours batched vs ours one at a time, vs diffusers one at a time) are printed, beside the
    floor (the denoiser FLOPs of all 160 row-steps at the measured rate); --extended adds both eager;
  - the speed features (benchmarks/dit_speed.py): per workload diffusers + regional compile, ours
    eager with each lossless attention backend (cuDNN / flash / efficient SDPA, FlexAttention) and
    with "auto" (the load-time probe's choice), ours default (compile + probed attention), + 8-bit
    attention, + FP8, + both, each with first-call (compile) seconds and its error vs the eager bf16
    forward; fast-path kernels vs references (`kernels`); eager vs each compile mode on a FLUX DiT with
    fewer blocks (`modes`); CUDA kernels of a FLUX block eager vs compiled (`fusion`); offload modes
    on Wan-14B-shaped blocks (`offload`).
Every row is printed as it is measured ("[seconds] name: ...").
Also checks that our batched forward equals diffusers' separate calls and (in --smoke) that the
analytic FLOP count equals torch's FlopCounterMode. Prints a markdown table last; --out writes JSON
after every section (a run cut short keeps what finished). --no-speed skips the speed rows;
--only picks sections (wan, flux, throughput, offload, kernels, modes, fusion; default on the GPU:
wan, flux, throughput, kernels). Each of `--only flux,throughput` and `--only wan` is meant to fit one
device call (< 200 s and < 150 s on an H200).

    PYTHONPATH=<dir with diffusers 0.42.1 + importlib_metadata + zipp>:. python benchmarks/dit_bench.py --out dit.json
    PYTHONPATH=...:. python benchmarks/dit_bench.py --only flux,throughput --out dit_flux.json   # < 200 s
    PYTHONPATH=...:. python benchmarks/dit_bench.py --only wan --out dit_wan.json               # < 150 s
    PYTHONPATH=...:. python benchmarks/dit_bench.py --only modes,fusion,kernels --out dit_modes.json
    python benchmarks/dit_bench.py --smoke      # tiny shapes on CPU (what CI runs; compile rows skipped)
    python benchmarks/dit_bench.py --smoke --only fusion   # inductor's fused kernels of one block, on the CPU
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from omnistage.config import EngineConfig  # noqa: E402
from omnistage.diffusion.pipelines.flux import FluxFamily  # noqa: E402
from omnistage.diffusion.pipelines.wan import WanFamily  # noqa: E402
from omnistage.diffusion.runner import DiffusionRunner  # noqa: E402
from omnistage.diffusion.task import Conditioning  # noqa: E402
from omnistage.params import DiffusionParams  # noqa: E402

import dit_speed  # noqa: E402  (benchmarks/dit_speed.py: the speed-feature rows)
import dit_throughput  # noqa: E402  (benchmarks/dit_throughput.py: the throughput rows)

OUT_PATH = None                                         # --out: results are saved after every section

WAN = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
           text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
           qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
FLUX = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
            num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
            axes_dims_rope=(16, 56, 56))
FLUX_VAE = dict(block_out_channels=[128, 256, 512, 512], layers_per_block=2, latent_channels=16, norm_num_groups=32)
WAN_SCHEDULER = {"_class_name": "UniPCMultistepScheduler", "prediction_type": "flow_prediction",
                 "use_flow_sigmas": True, "flow_shift": 3.0, "num_train_timesteps": 1000, "solver_order": 2}
FLUX_SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
                  "max_image_seq_len": 4096, "max_shift": 1.15, "num_train_timesteps": 1000, "shift": 3.0,
                  "use_dynamic_shifting": True}
FULL = dict(wan=dict(height=480, width=832, frames=81, text=512), flux=dict(size=1024, text=512),
            thr=dict(size=512, n=8, steps=20), matmul=8192, iters=3, warmup=1,
            wan_iters=2)                # Wan steps take ~1 s: fewer timed calls keep `--only wan` in its time
SMOKE = dict(wan=dict(height=32, width=32, frames=5, text=16), flux=dict(size=64, text=16),
             thr=dict(size=64, n=4, steps=2), matmul=256, iters=1, warmup=1,
             wan_cfg=dict(num_attention_heads=2, attention_head_dim=16, text_dim=32, ffn_dim=64, num_layers=2,
                          in_channels=4, out_channels=4, freq_dim=16, rope_max_seq_len=32),
             flux_cfg=dict(in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
                           num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                           axes_dims_rope=(4, 6, 6)),
             flux_vae=dict(block_out_channels=[8, 16], layers_per_block=1, latent_channels=4, norm_num_groups=4))


# ---- families with random prompt embeddings in place of the text encoders ---------------------------
class _RandomText:
    text_len = 512

    def encode(self, tasks) -> None:
        for task in tasks:
            task.cond = self.random_cond()
            if task.do_cfg:
                task.uncond = self.random_cond()


class BenchWan(_RandomText, WanFamily):
    def random_cond(self) -> Conditioning:
        dim = self.experts[0].config.text_dim
        return Conditioning(embeds=torch.randn(self.text_len, dim, device=self.device, dtype=self.dtype))


class BenchFlux(_RandomText, FluxFamily):
    def random_cond(self) -> Conditioning:
        cfg = self.transformer.config
        return Conditioning(embeds=torch.randn(self.text_len, cfg.joint_attention_dim, device=self.device,
                                               dtype=self.dtype),
                            pooled=torch.randn(cfg.pooled_projection_dim, device=self.device, dtype=self.dtype))


def build(cls, module_cls, cfg: dict, vae, scheduler: dict, text_len: int, device, dtype):
    torch.manual_seed(0)
    with torch.device(device):
        transformer = module_cls(**cfg)
    transformer.eval().requires_grad_(False)
    keep = getattr(transformer, "_keep_in_fp32_modules", None) or []
    for name, p in transformer.named_parameters():     # dtypes as from_pretrained(dtype=...) leaves them
        if not any(k in name.split(".") for k in keep):
            p.data = p.data.to(dtype)
    family = cls("", {}, {"transformer": transformer, "vae": vae.to(device, dtype).eval(), "scheduler": scheduler},
                 torch.device(device), dtype)
    family.text_len = text_len
    return family


# ---- analytic FLOPs (multiply-add = 2) ---------------------------------------------------------------
def wan_flops(cfg: dict, frames_lat: int, h_lat: int, w_lat: int, text: int) -> float:
    """One row of WanTransformer3DModel (text-to-video): every matmul / conv + attention QK^T and PV."""
    pt, ph, pw = cfg["patch_size"]
    s = (frames_lat // pt) * (h_lat // ph) * (w_lat // pw)
    d, f = cfg["num_attention_heads"] * cfg["attention_head_dim"], cfg["ffn_dim"]
    embed = 2 * s * cfg["in_channels"] * pt * ph * pw * d + 2 * text * (cfg["text_dim"] * d + d * d)
    embed += 2 * (cfg["freq_dim"] * d + d * d + d * 6 * d)
    layer = 2 * s * d * d * 4 + 4 * s * s * d                       # self-attention: q k v o + core
    layer += 2 * s * d * d * 2 + 2 * text * d * d * 2 + 4 * s * text * d  # cross-attention
    layer += 2 * s * d * f * 2                                      # feed-forward
    return embed + cfg["num_layers"] * layer + 2 * s * d * cfg["out_channels"] * pt * ph * pw


def flux_flops(cfg: dict, n: int, text: int) -> float:
    """One row of FluxTransformer2DModel: n image tokens, `text` text tokens."""
    d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    f, s = 4 * d, n + text
    out = cfg.get("out_channels") or cfg["in_channels"]
    embed = 2 * n * cfg["in_channels"] * d + 2 * text * cfg["joint_attention_dim"] * d
    embed += 2 * (256 * d + d * d) * (2 if cfg["guidance_embeds"] else 1)   # timestep (+ guidance) embedders
    embed += 2 * (cfg["pooled_projection_dim"] * d + d * d)
    double = 2 * s * (4 * d * d + 2 * d * f) + 4 * s * s * d + 2 * 2 * d * 6 * d
    single = 2 * s * (3 * d * d + d * f + (d + f) * d) + 4 * s * s * d + 2 * d * 3 * d
    tail = 2 * d * 2 * d + 2 * n * d * cfg["patch_size"] ** 2 * out
    return embed + cfg["num_layers"] * double + cfg["num_single_layers"] * single + tail


def counted_flops(fn) -> float:
    """FLOPs torch's FlopCounterMode sees (attention through the math kernel, so it is counted)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        fn()
    return float(counter.get_total_flops())


# ---- timing --------------------------------------------------------------------------------------------
sync = dit_throughput.sync


def timed(fn, device, iters: int, warmup: int) -> float:
    """Median seconds of `fn()` over `iters` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_rate(device, dtype, n: int) -> float:
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n ** 3 / timed(lambda: a @ b, device, iters=10, warmup=3)


# ---- one step: ours vs diffusers -----------------------------------------------------------------------
def step_bench(family, params: DiffusionParams, diffusers_call, flops_row: float, rate: float, s: dict,
               counted=None) -> dict:
    """Ours: the runner's step on one task. Diffusers: `diffusers_call(task)` (the pipeline's module calls)."""
    task = family.new_task("bench", {"prompt": "x"}, params)
    family.encode([task])
    family.prepare(task)
    runner = DiffusionRunner(family)
    with torch.no_grad():
        ref = diffusers_call(task)              # diffusers' rows, stacked cond then uncond
        x = torch.cat([family.model_input(task)] * (2 if task.do_cfg else 1))
        t = family.model_timestep(task).reshape(1).expand(x.shape[0]).to(x.device)
        conds = [task.cond] + ([task.uncond] if task.do_cfg else [])
        ours = family.denoise(family.key(task), x, t, conds, [task] * len(conds))
    err = ((ours.float() - ref.float()).norm() / ref.float().norm()).item()
    device = family.device
    ours_s = timed(lambda: runner.step([task]), device, s["iters"], s["warmup"])
    with torch.no_grad():
        theirs_s = timed(lambda: diffusers_call(task), device, s["iters"], s["warmup"])
    rows = task.num_rows
    out = {"rows": rows, "ours_s": ours_s, "diffusers_s": theirs_s, "tflops": rows * flops_row / 1e12,
           "floor_s": rows * flops_row / rate, "rel_diff_vs_diffusers": err}
    if counted is not None:
        out["counted_tflops_row"] = counted_flops(lambda: counted(task)) / 1e12
        out["analytic_tflops_row"] = flops_row / 1e12
    return out


def wan_call(family):
    model = family.experts[0]

    def call(task, rows=("cond", "uncond")):
        x, t = family.model_input(task), family.model_timestep(task).reshape(1).to(family.device)
        outs = [model(hidden_states=x, timestep=t, encoder_hidden_states=getattr(task, r).embeds[None],
                      return_dict=False)[0] for r in rows if getattr(task, r) is not None]
        return torch.cat(outs)
    return call


def flux_call(family):
    model = family.transformer

    def call(task):
        x = family.model_input(task)
        t = family.model_timestep(task).reshape(1).to(family.device)
        g = torch.tensor([task.params.guidance_scale], device=family.device, dtype=torch.float32)
        text = task.cond.embeds[None]
        txt_ids = torch.zeros(text.shape[1], 3, device=family.device, dtype=text.dtype)
        return model(hidden_states=x, timestep=t, guidance=g if family.guidance_embeds else None,
                     pooled_projections=task.cond.pooled[None], encoder_hidden_states=text, txt_ids=txt_ids,
                     img_ids=task.static["img_ids"], return_dict=False)[0]
    return call


# ---- main --------------------------------------------------------------------------------------------------
SECTIONS = ("wan", "flux", "throughput", "offload", "kernels", "modes", "fusion")
# offload met its targets: --only offload; compile modes and the fusion count: --only modes / fusion
GPU_DEFAULT = ("wan", "flux", "throughput", "kernels")
SMOKE_DEFAULT = tuple(p for p in SECTIONS if p != "fusion")   # inductor's C++ build of a block: ~2 min on 2 cores


def flux_vae_for(s: dict, smoke: bool):
    from diffusers import AutoencoderKL

    kw = dict(in_channels=3, out_channels=3, use_quant_conv=False, use_post_quant_conv=False, scaling_factor=0.3611,
              shift_factor=0.1159)
    if smoke:
        return AutoencoderKL(down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                             **kw, **s["flux_vae"])
    return AutoencoderKL(down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                         **kw, **FLUX_VAE)


def run(smoke: bool, speed: bool = True, only: tuple = SECTIONS, extended: bool = False) -> dict:
    from diffusers import AutoencoderKLWan, FluxTransformer2DModel, WanTransformer3DModel

    s = SMOKE if smoke else FULL
    config = EngineConfig(device="cpu" if smoke else "auto").resolved("diffusion")   # as a diffusion stage runs
    device, dtype = config.torch_device(), config.torch_dtype()
    bench = types.SimpleNamespace(sync=sync, timed=timed, build=build, BenchWan=BenchWan, WAN_SCHEDULER=WAN_SCHEDULER,
                                  DEVICE=device, DTYPE=dtype)      # what dit_speed's rows use
    wan_cfg, flux_cfg = dict(WAN, **s.get("wan_cfg", {})), dict(FLUX, **s.get("flux_cfg", {}))
    res: dict = {"smoke": smoke, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "dtype": str(dtype), "commit": _commit(), "sections": list(only)}
    import diffusers
    res["diffusers"] = diffusers.__version__
    rate = matmul_rate(device, dtype, s["matmul"])
    res["matmul_tflops"] = rate / 1e12
    if device.type == "cuda" and "kernels" in only:
        dit_speed.guarded(res, "kernels", lambda: dit_speed.kernel_row(device, dtype))
        print("kernels:", res["kernels"], flush=True)

    if "wan" in only:
        wan_vae = AutoencoderKLWan(**(dict(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1,
                                           temperal_downsample=[True], scale_factor_temporal=2,
                                           scale_factor_spatial=2) if smoke else {}))
        w = s["wan"]
        wan = build(BenchWan, WanTransformer3DModel, wan_cfg, wan_vae, WAN_SCHEDULER, w["text"], device, dtype)
        lat = ((w["frames"] - 1) // wan.t_scale + 1, w["height"] // wan.s_scale, w["width"] // wan.s_scale)
        wan_params = DiffusionParams(height=w["height"], width=w["width"], num_frames=w["frames"],
                                     num_inference_steps=50, guidance_scale=5.0, seed=0)
        call = wan_call(wan)
        sw = dict(s, iters=s.get("wan_iters", s["iters"]))
        res["wan"] = step_bench(wan, wan_params, call, wan_flops(wan_cfg, *lat, w["text"]), rate, sw,
                                counted=(lambda task: call(task, rows=("cond",))) if smoke else None)
        res["wan"]["shape"] = f"{w['width']}x{w['height']}x{w['frames']}"
        _save(res)
        if speed:
            dit_speed.guarded(res["wan"], "speed",
                              lambda: dit_speed.speed_rows(bench, wan, wan_params, call, sw, smoke, extended))
            _save(res)
        del wan
        _free(device)

    f = s["flux"]
    if "flux" in only or "fusion" in only:
        flux = build(BenchFlux, FluxTransformer2DModel, flux_cfg, flux_vae_for(s, smoke), FLUX_SCHEDULER, f["text"],
                     device, dtype)
        if "fusion" in only:                    # what the compile fuses (CPU: the generated C++ code)
            dit_speed.guarded(res, "fused_code", lambda: dit_speed.fused_code_row(bench, flux))
            if device.type == "cuda":
                dit_speed.guarded(res, "fusion", lambda: dit_speed.fusion_row(bench, flux))
            _save(res)
    if "flux" in only:
        tokens = (f["size"] // flux.multiple) ** 2
        flux_params = DiffusionParams(height=f["size"], width=f["size"], num_inference_steps=50, guidance_scale=3.5,
                                      seed=0)
        call = flux_call(flux)
        res["flux"] = step_bench(flux, flux_params, call, flux_flops(flux_cfg, tokens, f["text"]), rate, s,
                                 counted=call if smoke else None)
        res["flux"]["shape"] = f"{f['size']}x{f['size']}"
        _save(res)
        if speed:
            dit_speed.guarded(res["flux"], "speed",
                              lambda: dit_speed.speed_rows(bench, flux, flux_params, call, s, smoke, extended))
            _save(res)
    if "flux" in only or "fusion" in only:
        del flux
        _free(device)

    if "throughput" in only:
        family = build(BenchFlux, FluxTransformer2DModel, flux_cfg, flux_vae_for(s, smoke), FLUX_SCHEDULER,
                       16 if smoke else 512, device, dtype)
        t = s["thr"]
        flops_row = flux_flops(flux_cfg, (t["size"] // family.multiple) ** 2, family.text_len)
        label = f"FLUX.1-dev ({flux_cfg['num_layers']}+{flux_cfg['num_single_layers']} blocks)"
        res["throughput"] = dit_throughput.throughput_rows(family, label, t, flops_row, rate, extended)
        del family
        _save(res)
        _free(device)
    if speed and "modes" in only:
        dit_speed.guarded(res, "modes", lambda: dit_speed.mode_rows(bench, s, smoke))
        _save(res)
        _free(device)
    if speed and "offload" in only:
        dit_speed.guarded(res, "offload", lambda: dit_speed.offload_rows(bench, s, smoke))
    return res


def _free(device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _save(res: dict) -> None:
    if OUT_PATH:
        with open(OUT_PATH, "w") as f:
            json.dump(res, f, indent=2)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        return "?"


def table(res: dict) -> str:
    rows = ["| workload | ours s/step | diffusers s/step | floor s/step | ours / floor | ours vs diffusers rel. diff |",
            "|---|---|---|---|---|---|"]
    names = {"wan": "Wan2.1-1.3B shape, {shape} frames, CFG ({rows} rows)",
             "flux": "FLUX.1-dev shape, {shape}, guidance-distilled ({rows} row)"}
    for key, label in names.items():
        r = res.get(key)
        if r is None:
            continue
        rows.append(f"| {label.format(**r)} | {r['ours_s']:.4f} | {r['diffusers_s']:.4f} | {r['floor_s']:.4f} "
                    f"({r['tflops']:.1f} TFLOP) | {r['ours_s'] / r['floor_s']:.2f} | "
                    f"{r['rel_diff_vs_diffusers']:.1e} |")
    rows += dit_throughput.throughput_table(res.get("throughput"))
    rows += dit_speed.table(res)
    rows.append(f"\nbf16 matmul rate (measured, {res['device']}): {res['matmul_tflops']:.3g} TFLOP/s; "
                f"torch {res['torch']}, diffusers {res['diffusers']}, commit {res['commit']}")
    return "\n".join(rows)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (checks the script, not the GPU)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--no-speed", action="store_true", help="only the baseline rows (no compile / fp8 / offload rows)")
    ap.add_argument("--extended", action="store_true",
                    help="also the rows that cost extra compiles or minutes: compile with unmerged projections, "
                         "eager throughput")
    ap.add_argument("--only", default=None,
                    help=f"comma-separated sections to run, among {', '.join(SECTIONS)} (default: "
                         f"{', '.join(SMOKE_DEFAULT)} with --smoke, else {', '.join(GPU_DEFAULT)})")
    args = ap.parse_args(argv)
    only = (tuple(p.strip() for p in args.only.split(",") if p.strip()) if args.only is not None
            else SMOKE_DEFAULT if args.smoke else GPU_DEFAULT)
    bad = [p for p in only if p not in SECTIONS]
    if bad:
        ap.error(f"--only: unknown section(s) {bad}; choose among {', '.join(SECTIONS)}")
    global OUT_PATH
    OUT_PATH = args.out
    if importlib.util.find_spec("diffusers") is None:
        raise SystemExit("dit_bench needs diffusers==0.42.1 (+ importlib_metadata, zipp): pip install --no-deps "
                         "--target DIR <wheels> and put DIR on PYTHONPATH")
    extended = args.extended or args.smoke      # the smoke run checks every code path
    return report(lambda: run(args.smoke, speed=not args.no_speed, only=only, extended=extended), table, args.out)


def report(run_fn, table_fn, out) -> dict:
    """A benchmark's ending: run it, add its wall time, write the JSON to `out` (if given), print its table."""
    start = time.perf_counter()
    res = run_fn()
    res["wall_s"] = time.perf_counter() - start
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=2)
    print(table_fn(res))
    return res


if __name__ == "__main__":
    main()
