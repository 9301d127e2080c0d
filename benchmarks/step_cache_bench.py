"""Step-cache benchmark on one GPU: end-to-end seconds of a 28-step FLUX.1-dev-shaped request with
`tea_cache` / `cache_dit` at several thresholds beside the uncached run, through `DiffusionEngine`.

Built like `dit_bench.py` (its FLUX config, random bf16 weights, random prompt embeddings of the real
shape; nothing downloaded). Per setting: seconds (denoise + decode, after a warm-up request), speed-up
over uncached, steps computed / cached, and PSNR of the image against the uncached one of the same
seed. Random weights cannot judge a lossy method's image quality: PSNR is a mechanism check only.
Also: four requests with different cache settings batched into shared forwards, each against itself
run alone (largest pixel difference), and threshold 0 against no cache (must be 0). When the
`cache-dit` library is importable (carried as a wheel), the same weights run through diffusers'
`FluxPipeline` uncached and with cache-dit's DBCache at its four static step masks (8 / 11 / 15 / 18
computed steps of 28) and its dynamic default, so the two caches compare at equal computed steps.

    PYTHONPATH=<dir with diffusers 0.42.1 + importlib_metadata + zipp>:. python benchmarks/step_cache_bench.py --out sc.json
    python benchmarks/step_cache_bench.py --smoke      # tiny shapes on CPU (what CI runs)
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dit_bench  # noqa: E402
from omnistage.config import EngineConfig  # noqa: E402
from omnistage.diffusion.engine import DiffusionEngine  # noqa: E402
from omnistage.params import DiffusionParams  # noqa: E402

SETTINGS = [("tea_cache", {"rel_l1_thresh": t}) for t in (0.25, 0.4, 0.6, 0.8)] + \
           [("cache_dit", {"residual_diff_threshold": t}) for t in (0.12, 0.24, 0.4)] + \
           [("cache_dit", {"residual_diff_threshold": 0.4, "max_continuous_cached_steps": -1})]
FULL = dict(size=1024, steps=28, text=512, batch_size=512)
SMOKE = dict(size=32, steps=8, text=16, batch_size=32)


class FixedTextFlux(dit_bench.BenchFlux):
    """dit_bench's FLUX with the same random prompt embedding for every request (drawn once from a
    fixed seed), so that runs with and without a cache compare like for like."""

    def random_cond(self):
        if not hasattr(self, "_cond"):
            state = torch.random.get_rng_state()
            torch.manual_seed(1234)
            self._cond = super().random_cond()
            torch.random.set_rng_state(state)
        return self._cond


def _flux(smoke: bool, device, dtype):
    from diffusers import AutoencoderKL, FluxTransformer2DModel

    s = dit_bench.SMOKE if smoke else dit_bench.FULL
    cfg = dict(dit_bench.FLUX, **s.get("flux_cfg", {}))
    blocks = 2 if smoke else 4
    vae_cfg = s["flux_vae"] if smoke else dit_bench.FLUX_VAE
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * blocks,
                        up_block_types=["UpDecoderBlock2D"] * blocks, use_quant_conv=False, use_post_quant_conv=False,
                        scaling_factor=0.3611, shift_factor=0.1159, **vae_cfg)
    text = SMOKE["text"] if smoke else FULL["text"]
    return dit_bench.build(FixedTextFlux, FluxTransformer2DModel, cfg, vae, dit_bench.FLUX_SCHEDULER, text,
                           device, dtype)


def _engine(family, backend=None, max_num_seqs: int = 1) -> DiffusionEngine:
    """An engine on the same weights; with a backend its cache wraps the blocks (a wrapper whose engine
    is not running a forward passes calls straight through, so engines on one family coexist)."""
    config = EngineConfig(cache_backend=backend)
    return DiffusionEngine.from_family(family, max_num_seqs=max_num_seqs, config=config)


def _timed(engine, requests: dict) -> tuple[float, dict]:
    dit_bench.sync(engine.device)
    start = time.perf_counter()
    outs = engine.generate(requests)
    dit_bench.sync(engine.device)
    return time.perf_counter() - start, outs


def psnr(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    mse = float(((a - b) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def run(smoke: bool) -> dict:
    s = SMOKE if smoke else FULL
    config = EngineConfig(device="cpu" if smoke else "auto").resolved("diffusion")
    device, dtype = config.torch_device(), config.torch_dtype()
    res: dict = {"smoke": smoke, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "dtype": str(dtype), "commit": dit_bench._commit(), "rows": []}
    size, steps = s["size"], s["steps"]

    def params(seed=0, cache=None, n=steps):
        return DiffusionParams(height=size, width=size, num_inference_steps=n, guidance_scale=3.5, seed=seed,
                               cache_config=cache)

    plain_family, cached = _flux(smoke, device, dtype), {}
    plain = _engine(plain_family)
    plain.generate({"warm": ({"prompt": "x"}, params(n=2))})
    base_s, base = _timed(plain, {"r": ({"prompt": "x"}, params())})
    base_img = base["r"].images[0]
    res["uncached_s"] = base_s
    for backend in ("tea_cache", "cache_dit"):
        cached[backend] = _engine(plain_family, backend, max_num_seqs=4)
        cached[backend].generate({"warm": ({"prompt": "x"}, params(n=2))})
        zero = {"rel_l1_thresh": 0.0} if backend == "tea_cache" else {"residual_diff_threshold": 0.0}
        _, out = _timed(cached[backend], {"z": ({"prompt": "x"}, params(cache=zero))})
        res[f"{backend}_threshold0_max_diff"] = int(np.abs(np.asarray(out["z"].images[0], dtype=int)
                                                           - np.asarray(base_img, dtype=int)).max())
    for backend, cfg in (SETTINGS[::4] if smoke else SETTINGS):
        seconds, out = _timed(cached[backend], {"r": ({"prompt": "x"}, params(cache=cfg))})
        skipped = out["r"].metrics.cached_steps
        res["rows"].append({"backend": backend, "cache_config": cfg, "seconds": seconds, "speedup": base_s / seconds,
                            "computed_steps": steps - skipped, "cached_steps": skipped,
                            "psnr_db": psnr(out["r"].images[0], base_img)})
    eng = cached["tea_cache"]
    mixed = {f"m{i}": ({"prompt": "x"}, params(seed=i, cache={"rel_l1_thresh": t}))
             for i, t in enumerate((0.0, 0.25, 0.6, 0.8)[: 2 if smoke else 4])}
    alone = {rid: eng.generate({rid: r})[rid] for rid, r in mixed.items()}
    eng.runner.max_batch_tasks = 0
    together = eng.generate(mixed)
    res["mixed_thresholds"] = [r[1].cache_config["rel_l1_thresh"] for r in mixed.values()]
    res["mixed"] = {"max_batch_tasks": int(eng.runner.max_batch_tasks),
                    "max_pixel_diff_vs_alone": max(int(np.abs(np.asarray(together[r].images[0], dtype=int)
                                                              - np.asarray(alone[r].images[0], dtype=int)).max())
                                                   for r in mixed),
                    "cached_steps_equal_alone": all(together[r].metrics.cached_steps == alone[r].metrics.cached_steps
                                                    for r in mixed)}
    res["shape"] = f"FLUX.1-dev shape, {size}x{size}, {steps} steps"
    if importlib.util.find_spec("cache_dit") is not None:
        del cached, plain, eng
        res["cache_dit_lib"] = cache_dit_library(_flux(smoke, device, dtype), size, steps)
    return res


def cache_dit_library(family, size: int, steps: int) -> dict:
    """diffusers' FluxPipeline on a fresh copy of the same weights (no omnistage hooks on it): uncached,
    then cache-dit's DBCache with each static step mask and with its dynamic default. Seconds are
    end to end (denoise + decode) after a 2-step warm-up; PSNR against diffusers' own uncached image.
    Both caches run their first block always and none at the end (Fn=1, Bn=0: our defaults)."""
    import cache_dit
    from cache_dit import DBCacheConfig
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    sched = FlowMatchEulerDiscreteScheduler.from_config({k: v for k, v in dit_bench.FLUX_SCHEDULER.items()
                                                          if k != "_class_name"})
    pipe = FluxPipeline(scheduler=sched, vae=family.vae, text_encoder=None, tokenizer=None, text_encoder_2=None,
                        tokenizer_2=None, transformer=family.transformer)
    cond = family.random_cond()

    def call(n=steps):
        gen = torch.Generator(family.device).manual_seed(0)
        dit_bench.sync(family.device)
        start = time.perf_counter()
        img = pipe(prompt_embeds=cond.embeds[None], pooled_prompt_embeds=cond.pooled[None], height=size,
                   width=size, num_inference_steps=n, guidance_scale=3.5, generator=gen).images[0]
        dit_bench.sync(family.device)
        return time.perf_counter() - start, img

    call(2)
    base_s, base_img = call()
    out = {"diffusers_uncached_s": base_s, "version": getattr(cache_dit, "__version__", "?"), "rows": []}
    same = dict(num_inference_steps=steps, Fn_compute_blocks=1, Bn_compute_blocks=0)   # our cache_dit's defaults
    settings = [(f"static {p}", DBCacheConfig(**same, steps_computation_policy="static",
                                              steps_computation_mask=cache_dit.steps_mask(total_steps=steps,
                                                                                          mask_policy=p)))
                for p in ("ultra", "fast", "medium", "slow")]
    settings.append(("dynamic, threshold 0.24", DBCacheConfig(**same, residual_diff_threshold=0.24)))
    for name, cfg in settings:
        cache_dit.enable_cache(pipe, cache_config=cfg)
        call(2)
        seconds, img = call()
        stats = cache_dit.summary(pipe, logging=False)
        cached_steps = len(stats[0].cached_steps) if stats else 0
        cache_dit.disable_cache(pipe)
        out["rows"].append({"setting": name, "seconds": seconds, "speedup": base_s / seconds,
                            "computed_steps": steps - cached_steps, "cached_steps": cached_steps,
                            "psnr_db": psnr(img, base_img)})
    return out


def table(res: dict) -> str:
    rows = [f"| {res['shape']}: setting | seconds | speed-up | computed / cached steps | PSNR vs uncached (dB) |",
            "|---|---|---|---|---|", f"| no cache | {res['uncached_s']:.2f} | 1.00 | all / 0 | - |"]
    for r in res["rows"]:
        cfg = ", ".join(f"{k}={v}" for k, v in r["cache_config"].items())
        rows.append(f"| {r['backend']} {cfg} | {r['seconds']:.2f} | {r['speedup']:.2f} | "
                    f"{r['computed_steps']} / {r['cached_steps']} | {r['psnr_db']:.1f} |")
    m = res["mixed"]
    rows.append(f"\nthreshold 0 vs no cache, largest pixel difference: tea_cache "
                f"{res['tea_cache_threshold0_max_diff']}, cache_dit {res['cache_dit_threshold0_max_diff']}; "
                f"{len(res['mixed_thresholds'])} requests with different thresholds batched ({m['max_batch_tasks']} per forward) vs alone: "
                f"largest pixel difference {m['max_pixel_diff_vs_alone']}, cached steps equal: "
                f"{m['cached_steps_equal_alone']}")
    lib = res.get("cache_dit_lib")
    if lib:
        rows += ["", f"| cache-dit {lib['version']} on diffusers FluxPipeline: setting | seconds | speed-up vs diffusers "
                 "uncached | computed / cached steps | PSNR vs uncached (dB) |", "|---|---|---|---|---|",
                 f"| diffusers, no cache | {lib['diffusers_uncached_s']:.2f} | 1.00 | all / 0 | - |"]
        rows += [f"| {r['setting']} | {r['seconds']:.2f} | {r['speedup']:.2f} | {r['computed_steps']} / "
                 f"{r['cached_steps']} | {r['psnr_db']:.1f} |" for r in lib["rows"]]
    rows.append(f"{res['device']}, torch {res['torch']}, {res['dtype']}, commit {res['commit']}; random weights: "
                "PSNR is a mechanism check, not image quality")
    return "\n".join(rows)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (checks the script, not the GPU)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if importlib.util.find_spec("diffusers") is None:
        raise SystemExit("step_cache_bench needs diffusers==0.42.1 (+ importlib_metadata, zipp) on PYTHONPATH")
    return dit_bench.report(lambda: run(args.smoke), table, args.out)


if __name__ == "__main__":
    main()
