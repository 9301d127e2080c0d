"""DiT parallelism benchmark: step time of one request per mode beside one device, outputs checked.

Shapes (random weights time like real ones; nothing is downloaded; benchmarks/dit_bench.py's families
with random prompt embeddings in place of the text encoders): FLUX.1-dev at 1024x1024 (guidance-
distilled: one row per step) and Wan2.1-14B-shaped at 480x832x81 frames (40 heads x 128, 40 blocks; CFG:
two rows per step). Each mode is a real `DiffusionEngine` with `parallel_config` (rank 0 here, the other
ranks spawned, each building the same seeded weights on its own device): one device, ulysses_degree=N,
ring_degree=N, cfg_parallel_size=2 (Wan only; FLUX-dev runs no CFG rows) and tensor_parallel_size=N.
Per mode: median seconds per denoising step (after a warm-up step; encode and decode excluded), the
speed-up over one device, the floor (one device's step / N: perfect scaling) and the largest difference
of the final latents from the one-device run (bf16 on GPU: sums in another order move bf16 results by
~1e-2 relative; fp32 on CPU: ~1e-5). Prints a markdown table; --out writes JSON.

    python benchmarks/dit_parallel_bench.py --world 2 --out dit_parallel.json     # 2 GPUs (issue #15)
    python benchmarks/dit_parallel_bench.py --world 1                             # 1 GPU: degree 1 only
    python benchmarks/dit_parallel_bench.py --tiny                                # CPU, gloo, world 2
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from omnistage.config import EngineConfig  # noqa: E402
from omnistage.diffusion.engine import DiffusionEngine  # noqa: E402
from omnistage.params import DiffusionParams  # noqa: E402

import dit_bench  # noqa: E402  (the shapes and the random-text families)

WAN14B = dict(dit_bench.WAN, num_attention_heads=40, ffn_dim=13824, num_layers=40, in_channels=16, out_channels=16)
FULL = dict(flux=dict(cfg=dit_bench.FLUX, size=1024, text=512, steps=4),
            wan=dict(cfg=WAN14B, height=480, width=832, frames=81, text=512, steps=4))
TINY = dict(flux=dict(cfg=dict(dit_bench.FLUX, **dit_bench.SMOKE["flux_cfg"]), size=64, text=512, steps=3),
            wan=dict(cfg=dict(WAN14B, **dit_bench.SMOKE["wan_cfg"]), height=16, width=16, frames=5, text=16, steps=3))


def make_family(kind: str, shapes: dict, device, dtype):
    """The benchmark family of `kind` on `device`: every rank calls this and gets the same seeded weights
    (dit_bench.build: made under manual_seed(0) on the device; CUDA's generator gives every device the same
    numbers for one seed, and the latent check below would show it if not)."""
    from diffusers import AutoencoderKL, AutoencoderKLWan, FluxTransformer2DModel, WanTransformer3DModel

    s = shapes[kind]
    # a small VAE with FLUX's 8x downsampling (4 levels), so the latent sizes are the real ones
    small = dict(block_out_channels=[8, 8, 16, 16], layers_per_block=1, latent_channels=s["cfg"]["in_channels"] // 4,
                 norm_num_groups=4)
    if kind == "flux":
        vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
                            up_block_types=["UpDecoderBlock2D"] * 4, use_quant_conv=False, use_post_quant_conv=False,
                            scaling_factor=0.3611, shift_factor=0.1159, **small)
        family = dit_bench.build(dit_bench.BenchFlux, FluxTransformer2DModel, s["cfg"], vae, dit_bench.FLUX_SCHEDULER,
                                 s["text"], device, dtype)
    else:
        z = s["cfg"]["in_channels"]
        vae = AutoencoderKLWan(base_dim=8, z_dim=z, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
                               latents_mean=[0.0] * z, latents_std=[1.0] * z, scale_factor_temporal=4,
                               scale_factor_spatial=8)
        family = dit_bench.build(dit_bench.BenchWan, WanTransformer3DModel, s["cfg"], vae, dit_bench.WAN_SCHEDULER,
                                 s["text"], device, dtype)
    return family


def _seeded_text(family):
    """Random prompt embeddings drawn from a fixed seed, so every mode gets the same conditioning."""
    encode = family.encode

    def run(tasks):
        torch.manual_seed(1234)
        encode(tasks)

    family.encode = run


def params_for(kind: str, s: dict) -> DiffusionParams:
    if kind == "flux":
        return DiffusionParams(height=s["size"], width=s["size"], num_inference_steps=s["steps"], seed=0,
                               guidance_scale=3.5)
    return DiffusionParams(height=s["height"], width=s["width"], num_frames=s["frames"], guidance_scale=5.0,
                           num_inference_steps=s["steps"], seed=0)


def run_mode(kind: str, shapes: dict, device: str, dtype, parallel) -> dict:
    """Median step seconds and final latents of one request on one engine of this mode."""
    config = EngineConfig(device=device, dtype=str(dtype)[6:], parallel_config=parallel, enforce_eager=True)
    config = config.resolved("diffusion")
    loader = functools.partial(make_family, kind, shapes)
    family = loader(config.torch_device(), dtype)
    _seeded_text(family)
    engine = DiffusionEngine.from_family(family, max_num_seqs=1, config=config, rank_loader=loader)
    latents = {}
    decode = family.decode_batch

    def keep(tasks):
        latents.update({t.request_id: t.latents.float().cpu() for t in tasks})
        return decode(tasks)

    family.decode_batch = keep
    try:
        engine.add_request("r", {"prompt": "a benchmark"}, params_for(kind, shapes[kind]))
        steps = []
        while engine.has_unfinished():
            before = engine.runner.num_forwards
            engine.step()
            if engine.runner.num_forwards > before:
                steps.append(engine.runner.last_step_time)
    finally:
        engine.close()
    return {"step_s": statistics.median(steps[1:] or steps), "latents": latents["r"]}


def modes(kind: str, world: int) -> list[tuple[str, dict | None]]:
    out = [("one device", None)]
    if world > 1:
        out += [(f"ulysses={world}", {"ulysses_degree": world}), (f"ring={world}", {"ring_degree": world})]
        if kind == "wan" and world == 2:
            out.append(("cfg=2", {"cfg_parallel_size": 2}))
        out.append((f"tp={world}", {"tensor_parallel_size": world}))
    return out


def run(tiny: bool, world: int) -> dict:
    shapes = TINY if tiny else FULL
    device = "cpu" if tiny else "cuda:0"
    dtype = torch.float32 if tiny else torch.bfloat16
    tol = 1e-4 if tiny else 5e-2
    res = {"device": "cpu (gloo)" if tiny else torch.cuda.get_device_name(0), "world": world, "torch": torch.__version__,
           "rows": []}
    for kind in ("flux", "wan"):
        base = None
        for name, parallel in modes(kind, world):
            start = time.perf_counter()
            r = run_mode(kind, shapes, device, dtype, parallel)
            row = {"model": kind, "mode": name, "step_s": r["step_s"], "wall_s": time.perf_counter() - start}
            if base is None:
                base = r
                row.update(speedup=1.0, floor_s=r["step_s"], max_err=0.0)
            else:
                n = (parallel or {}).get("cfg_parallel_size", world)
                err = (r["latents"] - base["latents"]).abs().max().item()
                scale = base["latents"].abs().max().item()
                row.update(speedup=base["step_s"] / r["step_s"], floor_s=base["step_s"] / n, max_err=err,
                           ok=err <= tol * max(scale, 1.0))
            res["rows"].append(row)
            print(row, flush=True)
    return res


def table(res: dict) -> str:
    lines = [f"DiT parallel on {res['device']}, world {res['world']} (torch {res['torch']})", "",
             "| model | mode | s / step | speed-up | floor s / step | max latent diff | equal |",
             "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['model']} | {r['mode']} | {r['step_s']:.4f} | {r['speedup']:.2f}x | {r['floor_s']:.4f} | "
                     f"{r['max_err']:.2e} | {'yes' if r.get('ok', True) else 'NO'} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on CPU ranks over gloo (world 2)")
    ap.add_argument("--world", type=int, default=None, help="ranks of the parallel modes (default: 2 tiny, else GPUs)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    world = args.world or (2 if args.tiny else min(torch.cuda.device_count(), 2))
    return dit_bench.report(lambda: run(args.tiny, world), table, args.out)


if __name__ == "__main__":
    main()
