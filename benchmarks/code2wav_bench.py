"""Qwen2.5-Omni's code2wav alone on one GPU: ms per DiT evaluation and per chunk (an ODE batch of 36
evaluations, CUDA graph as served) by rows and variant, BigVGAN per chunk from graphs in float32 and
bf16, the error of each variant against the plain float32 reference path, and the FLOP floor. Random
weights of the 7B checkpoint's token2wav shape (transformers' defaults: DiT 22 layers x 1024, BigVGAN
1536 channels; codec table 8448 rows, as in omni_bench.py), drawn on the GPU (no folder, no CPU init),
time exactly like real ones. Each row prints as it is measured; the defaults take < 60 s on an H200.

    python benchmarks/code2wav_bench.py [--only dit|vocoder] [--reps 2] [--profile 8] [--out c2w.json]
    python benchmarks/code2wav_bench.py --variants ref-tf32,ref-bf16,fused-tf32,fused-bf16 --hf --capture
    python benchmarks/code2wav_bench.py --smoke     # the tiny checkpoint on the CPU: checks the script runs

DiT variants (`Code2WavODE` options; the stage's are `fused_dit`, `dit_dtype`, `tf32`; `dit_fused.py`'s
kernel-count flags are attributes of `FusedDiT`, on by default):
  fused-bf16        `dit_fused.py` in bf16 as served (the CUDA default), every FusedDiT flag on
  s7                fused-bf16 with the flags off: session 7's path (7 rotary kernels, GELU apart, masks
                    padded, the whole input projection per evaluation)
  no-complex-rope / no-gelu-gemm / no-aligned-masks / no-split-input-proj / no-block-attention
                    fused-bf16 with that flag off
  fused-tf32        `dit_fused.py` in float32 + TF32
  ref-tf32 / ref-bf16   the reference path (transformers' layers op by op), TF32 / bf16 linears
Rows: the first variant at steady chunks (96 codes: the 264-frame window) of `--rows` (1 / 8 / 16 / 32) and
first chunks (12 codes: 48 frames) of `--first-rows` (1 / 8); the others at `--ablate-rows` (1 / 8 steady,
first at 1). Floor = the DiT's linear FLOPs (x2 rows: CFG) at the H200's dense bf16 peak (989 TFLOP/s).
Error = max |mel - plain fp32 reference mel| / its std, 8 steady rows, same noise and codes.
BigVGAN (`--only vocoder`): from graphs as served, float32 (cuDNN's TF32 default) and bf16 autocast
(`vocoder_dtype`), each with transformers' activations and with `bigvgan_fused.py`'s (`fused_vocoder`;
"tiled": its other kernel, `TILED`), and bf16 fused with cuDNN autotuning while capturing, at steady inputs (256 mel frames) of `--voc-rows`
rows and a first chunk's (48 frames), with the waveform error vs float32 with transformers' activations.
`--profile N` prints the GPU kernels of one eager fused-bf16 ODE batch of N steady rows (per evaluation);
`--hf` adds transformers' own `sample`; `--capture` the start-up capture of the omni pipeline's code2wav
stage (a config-only folder served with load_format="dummy").
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SETTINGS = (10, 0.5, -1.0)                      # Code2WavParams().ode_key(): 10 time points, CFG 0.5, sway -1
EVALS = 36                                      # DiT evaluations per chunk: 9 RK4 steps x 4
BF16_PEAK = 989e12                              # H200 dense bf16 FLOP/s
FLAGS = ("complex_rope", "gelu_gemm", "aligned_masks", "split_input_proj", "block_attention")   # FusedDiT's kernel-count flags
BF16 = dict(fused=True, tf32=True, dit_dtype="bfloat16")
VARIANTS = {"fused-bf16": (BF16, ()), "s7": (BF16, FLAGS),
            **{f"no-{f.replace('_', '-')}": (BF16, (f,)) for f in FLAGS},
            "fused-tf32": (dict(fused=True, tf32=True), ()),
            "ref-tf32": (dict(fused=False, tf32=True), ()), "ref-bf16": (dict(fused=False, tf32=True, dit_dtype="bfloat16"), ())}


def build_7b_token2wav(device: torch.device):
    """(token2wav module of the 7B shape with random weights on `device`, speakers)."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel

    from omni_bench import omni_7b_config
    from omnistage.testing import qwen2_5_omni as tiny

    config = omni_7b_config(tiny._token_ids(tiny.make_omni_tokenizer()))
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2_5OmniToken2WavModel._from_config(config.token2wav_config, attn_implementation="sdpa")
    speakers = tiny.make_speakers(config, torch.Generator().manual_seed(1))
    return model.float().eval(), speakers


def inputs(rows: int, frames: int, repeats: int = 2):
    g = torch.Generator().manual_seed(rows * 1000 + frames)
    noise = torch.randn(rows, frames, 80, generator=g)
    codes = torch.randint(0, 8192, (rows, frames // repeats + 1), generator=g)
    return noise, codes


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ode(ode, rows: int, frames: int, reps: int) -> tuple[float, torch.Tensor]:
    """(ms per ODE batch from a graph -- eager on a CPU --, the mel of the last run)."""
    noise, codes = inputs(rows, frames)
    args = (noise, codes, ["Ethan"] * rows, [frames] * rows, SETTINGS, ode.graphs is not None)
    ode.run(*args)                              # warm-up (and the capture when graphed)
    sync(ode.device)
    reps = 1 if rows >= 32 else reps
    start = time.perf_counter()
    for _ in range(reps):
        mel = ode.run(*args)
    sync(ode.device)
    return (time.perf_counter() - start) / reps * 1000, mel.float().clone()


def time_vocoder(vocode, rows: int, frames: int, reps: int, device: torch.device) -> float:
    mel = torch.randn(rows, 80, frames, generator=torch.Generator().manual_seed(rows)).to(device) - 5
    vocode(mel)
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        vocode(mel)
    sync(device)
    return (time.perf_counter() - start) / reps * 1000


def linear_params(dit) -> int:
    return sum(m.weight.numel() for b in dit.transformer_blocks for m in b.modules()
               if isinstance(m, torch.nn.Linear) and m is not b.attn_norm.linear)


def say(line: str) -> None:
    print(line, flush=True)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def make_ode(name: str, dit, dit_bf16, speakers, device, graphs: int):
    from omnistage.models.qwen2_5_omni.code2wav_ode import Code2WavODE

    opts, off = VARIANTS[name]
    ode = Code2WavODE(dit_bf16 if opts.get("dit_dtype") else dit, speakers, device, max_graphs=graphs, **opts)
    for flag in off:
        setattr(ode.fused, flag, False)
    return ode


def bench_dit(args, res, device, dit, speakers, cases_for, steady) -> None:
    flops = linear_params(dit) * 2
    res["flops_per_frame_eval"] = flops
    dit_bf16 = copy.deepcopy(dit)               # Code2WavODE converts a bf16 variant's blocks in place
    graphs = 64 if device.type == "cuda" else 0
    say(f"code2wav DiT, {res['shape']}, {res['device']}: ms per chunk (ODE batch of {EVALS} DiT evaluations, "
        "CUDA graph) and per evaluation")
    say("| variant | chunk | rows | frames | ms / chunk | ms / evaluation | floor ms / chunk | x floor |")
    say("|---|---|---|---|---|---|---|---|")
    mels: dict = {}
    for k, name in enumerate(args.variants.split(",")):
        ode = make_ode(name, dit, dit_bf16, speakers, device, graphs)
        for case, r, f in cases_for(k == 0):
            try:
                ms, mel = time_ode(ode, r, f, args.reps)
            except Exception as e:              # a variant that fails on this machine is reported, not hidden
                res.setdefault("failed", {})[name] = f"{type(e).__name__}: {e}"
                say(f"| {name} | FAILED: {type(e).__name__}: {str(e)[:300]} |")
                break
            floor = EVALS * flops * 2 * r * f / BF16_PEAK * 1000
            res["cases"].append({"variant": name, "case": case, "rows": r, "frames": f, "ms": ms, "floor_ms": floor})
            if (case, r, f) == steady:
                mels[name] = mel
            say(f"| {name} | {case} | {r} | {f} | {ms:.1f} | {ms / EVALS:.2f} | {floor:.2f} | {ms / floor:.1f} |")
        del ode
    from omnistage.models.qwen2_5_omni.code2wav_ode import Code2WavODE

    ref = Code2WavODE(dit, speakers, device, fused=False, tf32=False)   # plain float32, eager: the reference
    _, ref_mel = time_ode(ref, steady[1], steady[2], 1)
    res["error_vs_fp32"] = {v: float((m - ref_mel).abs().max() / ref_mel.std()) for v, m in mels.items()}
    say("max |mel - plain fp32 reference mel| / its std (%d steady rows): " % steady[1]
        + ", ".join(f"{k} {v:.2e}" for k, v in res["error_vs_fp32"].items()))
    if args.profile and device.type == "cuda":
        try:
            profile(make_ode("fused-bf16", dit, dit_bf16, speakers, device, 0), args.profile, steady[2], res)
        except Exception as e:                  # reported, not hidden; the other rows are printed already
            say(f"profile FAILED: {type(e).__name__}: {str(e)[:300]}")


def profile(ode, rows: int, frames: int, res: dict) -> None:
    """The GPU kernels of one eager ODE batch, per DiT evaluation (us) and as a share of the GPU time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    noise, codes = inputs(rows, frames)
    args = (noise, codes, ["Ethan"] * rows, [frames] * rows, SETTINGS, False)
    ode.run(*args)
    sync(ode.device)
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        ode.run(*args)
        sync(ode.device)
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    events.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in events)
    launches = sum(e.count for e in events)
    res["profile"] = {"rows": rows, "gpu_us_per_eval": total / EVALS, "kernels_per_eval": launches / EVALS,
                      "top": [[e.key[:90], e.count / EVALS, e.self_device_time_total / EVALS] for e in events[:18]]}
    say(f"profile, fused-bf16 eager, {rows} steady rows: {total / EVALS / 1000:.2f} ms GPU and "
        f"{launches / EVALS:.0f} kernels per evaluation")
    say("| kernel | per evaluation | us / evaluation | share |")
    say("|---|---|---|---|")
    for name, count, us in res["profile"]["top"]:
        say(f"| {name} | {count:.1f} | {us:.1f} | {us * EVALS / total:.1%} |")


def bench_vocoder(args, res, device, vocoder) -> None:
    from omnistage.models.qwen2_5_omni import bigvgan_fused
    from omnistage.models.qwen2_5_omni.token2wav import DeviceVocoder

    steady, first = (256, 48) if device.type == "cuda" else (64, 24)   # a later chunk's 192 frames + context
    rows = ints(args.voc_rows) if device.type == "cuda" else [1, 2]
    # name: (dtype, fused activations, cuDNN autotuning while capturing); the first is the reference
    # "tiled": `bigvgan_fused.TILED` (the other kernel) while capturing
    kinds = {"fp32": (torch.float32, False, False), "fp32-fused": (torch.float32, True, False),
             "fp32-fused-tiled": (torch.float32, "tiled", False),
             "bf16": (torch.bfloat16, False, False), "bf16-fused": (torch.bfloat16, True, False),
             "bf16-fused-tiled": (torch.bfloat16, "tiled", False),
             "bf16-fused-autotuned": (torch.bfloat16, True, True)}
    mel = torch.randn(2, 80, steady, generator=torch.Generator().manual_seed(3)).to(device) - 5
    wavs, res["vocoder"] = {}, {}
    say(f"BigVGAN from graphs, ms per batch (steady: {steady} mel frames per row; first chunk: {first})")
    say("| dtype | " + " | ".join(f"steady {r}" for r in rows) + f" | first 1 | capture s | max err | rms err |")
    say("|---|" + "---|" * (len(rows) + 4))
    for name, (dtype, fused, autotune) in kinds.items():
        vocode = DeviceVocoder(vocoder, dtype, bool(fused))
        start = time.perf_counter()
        try:
            if device.type == "cuda":
                before = torch.backends.cudnn.benchmark
                torch.backends.cudnn.benchmark = autotune
                bigvgan_fused.TILED = fused == "tiled"
                try:
                    vocode.capture(sorted({*rows, 2}), [first, steady], 80)
                finally:
                    torch.backends.cudnn.benchmark = before
                    bigvgan_fused.TILED = False
            capture = time.perf_counter() - start
            times = [time_vocoder(vocode, r, steady, args.reps, device) for r in rows]
            times.append(time_vocoder(vocode, 1, first, args.reps, device))
            wavs[name] = vocode(mel).clone()
        except Exception as e:                  # a kind that fails on this machine is reported, not hidden
            res.setdefault("failed", {})[name] = f"{type(e).__name__}: {e}"
            say(f"| {name} | FAILED: {type(e).__name__}: {str(e)[:300]} |")
            continue
        ref = wavs["fp32"]
        err = [float((wavs[name] - ref).abs().max()), float((wavs[name] - ref).pow(2).mean().sqrt())]
        res["vocoder"][name] = {"steady_ms": dict(zip(rows, times)), "first_ms": times[-1], "capture_s": capture,
                                "max_err": err[0], "rms_err": err[1], "wav_rms": float(ref.pow(2).mean().sqrt())}
        say(f"| {name} | " + " | ".join(f"{ms:.1f}" for ms in times) + f" | {capture:.1f} | {err[0]:.2e} | {err[1]:.2e} |")
        del vocode
    say(f"waveform rms {res['vocoder']['fp32']['wav_rms']:.2e}; errors vs fp32 over 2 rows")


def bench_hf(res, device, dit, speakers, steady) -> None:
    with torch.no_grad():                       # transformers' own ODE, 1 row, one steady window (eager, fp32)
        noise, codes = inputs(1, steady[2])
        spk = speakers["Ethan"]
        cond, ref_mel_in = spk["cond"].to(device).float(), spk["ref_mel"].to(device).float()
        dit.sample(cond, ref_mel_in, codes.to(device)[:, :steady[2] // 2])
        sync(device)
        start = time.perf_counter()
        dit.sample(cond, ref_mel_in, codes.to(device)[:, :steady[2] // 2])
        sync(device)
        res["transformers_sample_ms_1_row"] = (time.perf_counter() - start) * 1000
    say(f"transformers `sample`, 1 row, {steady[2]} frames, eager fp32: {res['transformers_sample_ms_1_row']:.1f} ms")


def bench_capture(args, res, device) -> None:
    """The omni pipeline's code2wav as it starts."""
    from omni_bench import build_checkpoint
    from omnistage.models import dummy
    from omnistage.models.qwen2_5_omni.code2wav import Code2Wav
    from omnistage.models.qwen2_5_omni.pipeline import CODE2WAV_OPTIONS

    torch.cuda.empty_cache()
    folder = build_checkpoint(os.path.join(args.work, "omni_7b_config_only"))
    dummy.use_dummy_weights(folder)
    c2w = Code2Wav(folder, device=device, **CODE2WAV_OPTIONS)
    res["capture"] = {"seconds": c2w.capture_seconds, "graphs": c2w.ode.graphs.captures,
                      "batch_sizes": c2w.batch_sizes, "windows": c2w.graph_frames,
                      "memory_gib": torch.cuda.max_memory_reserved() / 2**30}
    c = res["capture"]
    say(f"start-up capture (omni pipeline options): {c['graphs']} graphs (rows {c['batch_sizes']} x windows "
        f"{c['windows']}) in {c['seconds']:.1f} s, {c['memory_gib']:.1f} GiB reserved")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/omnibench")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--only", choices=("dit", "vocoder"), default=None, help="run one half only")
    ap.add_argument("--variants", default="fused-bf16,s7,no-complex-rope,no-block-attention,no-split-input-proj",
                    help=f"DiT variants, comma-separated, of {','.join(VARIANTS)}; the first gets every row")
    ap.add_argument("--rows", default="1,8,16,32", help="steady-chunk rows of the first variant")
    ap.add_argument("--first-rows", default="1,8", help="first-chunk rows of the first variant")
    ap.add_argument("--ablate-rows", default="1,8", help="steady rows of the other variants (first chunk: 1 row)")
    ap.add_argument("--voc-rows", default="1,8,32", help="BigVGAN rows (steady inputs)")
    ap.add_argument("--profile", type=int, default=0, metavar="ROWS", help="kernel table of one eager ODE batch")
    ap.add_argument("--hf", action="store_true", help="also time transformers' own `sample` (1 row)")
    ap.add_argument("--capture", action="store_true", help="also time the omni pipeline's start-up capture")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--smoke", action="store_true", help="tiny checkpoint, CPU, 1 rep, eager")
    args = ap.parse_args(argv)
    for name in args.variants.split(","):
        if name not in VARIANTS:
            ap.error(f"--variants: {name!r} is not one of {', '.join(VARIANTS)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from omnistage.models.qwen2_5_omni.token2wav import load_token2wav

    t0 = time.perf_counter()
    if args.smoke:
        from omnistage.testing.qwen2_5_omni import make_tiny_qwen2_5_omni

        folder = os.path.join(args.work, "tiny-qwen2_5_omni")
        if not os.path.exists(os.path.join(folder, "spk_dict.pt")):
            make_tiny_qwen2_5_omni(folder)
        device, args.reps, args.capture = torch.device("cpu"), 1, False
        model, speakers = load_token2wav(folder, device)
        steady = ("steady", 2, 48)

        def cases_for(main_variant: bool) -> list[tuple[str, int, int]]:
            return [steady, ("first", 1, 24)] if main_variant else [steady]
    else:
        device = torch.device("cuda")
        model, speakers = build_7b_token2wav(device)
        steady, first = ("steady", 8, 264), 48

        def cases_for(main_variant: bool) -> list[tuple[str, int, int]]:
            rows, firsts = (args.rows, args.first_rows) if main_variant else (args.ablate_rows, "1")
            return [("steady", r, 264) for r in ints(rows)] + [("first", r, first) for r in ints(firsts)]
    res: dict = {"cases": [], "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                 "shape": "tiny" if args.smoke else "7B shape"}
    say(f"built in {time.perf_counter() - t0:.1f} s")
    dit, vocoder = model.code2wav_dit_model, model.code2wav_bigvgan_model
    if args.only != "vocoder":
        bench_dit(args, res, device, dit, speakers, cases_for, steady)
    if args.only != "dit":
        bench_vocoder(args, res, device, vocoder)
    if args.hf:
        bench_hf(res, device, dit, speakers, steady)
    del dit, model
    if args.capture:
        bench_capture(args, res, device)
    res["seconds"] = time.perf_counter() - t0
    say(f"total {res['seconds']:.1f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
