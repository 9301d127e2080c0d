"""Qwen2.5-Omni's code2wav alone on one GPU: ms per DiT evaluation and per chunk (an ODE batch of 36
evaluations, CUDA graph as served) by rows and variant, BigVGAN per chunk, the error of each variant
against the plain float32 reference path, transformers' `sample`, and the FLOP floor. Random weights of
the 7B checkpoint's token2wav shape (transformers' defaults: DiT 22 layers x 1024, BigVGAN 1536
channels; codec table 8448 rows, as in omni_bench.py), drawn on the GPU (no folder, no CPU init),
time exactly like real ones. Each row prints as it is measured; ~60 s on an H200.

    python benchmarks/code2wav_bench.py [--reps 3] [--capture] [--out c2w.json]
    python benchmarks/code2wav_bench.py --smoke     # the tiny checkpoint on the CPU: checks the script runs

Variants (`Code2WavODE` options; the stage's are `fused_dit`, `dit_dtype`, `tf32`):
  ref-tf32   reference path (transformers' layers op by op), float32 with TF32 matmuls (the old default)
  ref-bf16   reference path, `dit_dtype: bfloat16`
  fused-tf32 `dit_fused.py` (q|k|v GEMM, block-local attention, fused AdaLN steps), float32 + TF32
  fused-bf16 `dit_fused.py`, bf16 linears and attention
Rows: steady chunks (96 codes: the 264-frame window) at 1 / 8 / 32 rows, first chunks (12 codes: 48 frames)
at 1 / 8. Floor = the DiT's linear FLOPs (x2 rows: CFG) at the H200's dense bf16 peak (989 TFLOP/s).
Error = max |mel - plain fp32 reference mel| / its std, 8 steady rows, same noise and codes. BigVGAN:
float32 eager and from graphs, and bf16 autocast (`vocoder_dtype`) with its waveform error.
`--capture` adds the start-up capture of the omni pipeline's code2wav stage (a config-only folder served
with load_format="dummy").
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
VARIANTS = {"ref-tf32": dict(fused=False, tf32=True), "ref-bf16": dict(fused=False, tf32=True, dit_dtype="bfloat16"),
            "fused-tf32": dict(fused=True, tf32=True), "fused-bf16": dict(fused=True, tf32=True, dit_dtype="bfloat16")}


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
    mel = torch.randn(rows, 80, frames, device=device) - 5
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


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/omnibench")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--capture", action="store_true", help="also time the omni pipeline's start-up capture")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--smoke", action="store_true", help="tiny checkpoint, CPU, 1 rep, eager")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from omnistage.models.qwen2_5_omni.code2wav_ode import Code2WavODE
    from omnistage.models.qwen2_5_omni.token2wav import DeviceVocoder, load_token2wav

    t0 = time.perf_counter()
    if args.smoke:
        from omnistage.testing.qwen2_5_omni import make_tiny_qwen2_5_omni

        folder = os.path.join(args.work, "tiny-qwen2_5_omni")
        if not os.path.exists(os.path.join(folder, "spk_dict.pt")):
            make_tiny_qwen2_5_omni(folder)
        device, args.reps, args.capture = torch.device("cpu"), 1, False
        model, speakers = load_token2wav(folder, device)
        cases, steady = [("steady", 2, 48), ("first", 1, 24)], ("steady", 2, 48)
    else:
        device = torch.device("cuda")
        model, speakers = build_7b_token2wav(device)
        cases = [("steady", r, 264) for r in (1, 8, 32)] + [("first", r, 48) for r in (1, 8)]
        steady = ("steady", 8, 264)
    dit, vocoder = model.code2wav_dit_model, model.code2wav_bigvgan_model
    dit_bf16 = copy.deepcopy(dit)               # Code2WavODE converts a bf16 variant's blocks in place
    flops = linear_params(dit) * 2
    graphs = 64 if device.type == "cuda" else 0
    res: dict = {"cases": [], "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                 "shape": "tiny" if args.smoke else "7B shape", "flops_per_frame_eval": flops}
    say(f"code2wav DiT, {res['shape']}, {res['device']}: ms per chunk (ODE batch of {EVALS} DiT evaluations, "
        f"CUDA graph) and per evaluation; built in {time.perf_counter() - t0:.1f} s")
    say("| variant | chunk | rows | frames | ms / chunk | ms / evaluation | floor ms / chunk | x floor |")
    say("|---|---|---|---|---|---|---|---|")
    mels: dict = {}
    for name, opts in VARIANTS.items():
        ode = Code2WavODE(dit_bf16 if opts.get("dit_dtype") else dit, speakers, device, max_graphs=graphs, **opts)
        for case, r, f in cases:
            try:
                ms, mel = time_ode(ode, r, f, args.reps)
            except Exception as e:              # a variant that fails on this machine is reported, not hidden
                res.setdefault("failed", {})[name] = f"{type(e).__name__}: {e}"
                say(f"| {name} | FAILED: {type(e).__name__}: {str(e)[:300]} |")
                break
            floor = EVALS * flops * 2 * r * f / BF16_PEAK * 1000
            row = {"variant": name, "case": case, "rows": r, "frames": f, "ms": ms, "floor_ms": floor}
            res["cases"].append(row)
            if (case, r, f) == steady:
                mels[name] = mel
            say(f"| {name} | {case} | {r} | {f} | {ms:.1f} | {ms / EVALS:.2f} | {floor:.2f} | {ms / floor:.1f} |")
        del ode
    ref = Code2WavODE(dit, speakers, device, fused=False, tf32=False)   # plain float32, eager: the reference
    _, ref_mel = time_ode(ref, steady[1], steady[2], 1)
    res["error_vs_fp32"] = {v: float((m - ref_mel).abs().max() / ref_mel.std()) for v, m in mels.items()}
    say("max |mel - plain fp32 reference mel| / its std (%d steady rows): " % steady[1]
        + ", ".join(f"{k} {v:.2e}" for k, v in res["error_vs_fp32"].items()))
    vocode = DeviceVocoder(vocoder)
    voc_frames = 256 if device.type == "cuda" else 64   # a later chunk's 192 frames + BigVGAN context
    voc_rows = (1, 8, 32) if device.type == "cuda" else (1, 2)
    res["vocoder_ms"] = {r: time_vocoder(vocode.forward, r, voc_frames, args.reps, device) for r in voc_rows}
    say(f"BigVGAN ({voc_frames} mel frames per row, float32, cuDNN defaults), eager: "
        + ", ".join(f"{r} rows {ms:.1f} ms" for r, ms in res["vocoder_ms"].items()))
    vocode_bf16 = DeviceVocoder(vocoder, torch.bfloat16)   # `vocoder_dtype: bfloat16`
    res["vocoder_bf16_ms"] = {r: time_vocoder(vocode_bf16, r, voc_frames, args.reps, device) for r in voc_rows}
    mel = torch.randn(2, 80, voc_frames, generator=torch.Generator().manual_seed(3)).to(device) - 5
    wav, wav_bf16 = vocode.forward(mel), vocode_bf16(mel)
    res["vocoder_bf16_error"] = [float((wav - wav_bf16).abs().max()), float((wav - wav_bf16).pow(2).mean().sqrt()),
                                 float(wav.pow(2).mean().sqrt())]
    say("BigVGAN bf16 autocast, eager: "
        + ", ".join(f"{r} rows {ms:.1f} ms" for r, ms in res["vocoder_bf16_ms"].items())
        + " -- waveform max |diff| %.2e, rms diff %.2e (rms %.2e)" % tuple(res["vocoder_bf16_error"]))
    if device.type == "cuda":                   # as served: graphs (code2wav captures them at start-up)
        start = time.perf_counter()
        vocode.capture([1, 8, 32], [voc_frames], 80)
        res["vocoder_capture_s"] = time.perf_counter() - start
        res["vocoder_graph_ms"] = {r: time_vocoder(vocode, r, voc_frames, args.reps, device) for r in (1, 8, 32)}
        say(f"BigVGAN from graphs (3 captured in {res['vocoder_capture_s']:.1f} s): "
            + ", ".join(f"{r} rows {ms:.1f} ms" for r, ms in res["vocoder_graph_ms"].items()))
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
    del dit, dit_bf16, model, ref, vocode, vocode_bf16
    if args.capture:                            # the omni pipeline's code2wav as it starts
        from omni_bench import build_checkpoint
        from omnistage.models import dummy
        from omnistage.models.qwen2_5_omni.code2wav import Code2Wav
        from omnistage.models.qwen2_5_omni.pipeline import CODE2WAV_OPTIONS

        torch.cuda.empty_cache()
        folder = build_checkpoint(os.path.join(args.work, "omni_7b_config_only"), weights=False)
        dummy.use_dummy_weights(folder)
        c2w = Code2Wav(folder, device=device, **CODE2WAV_OPTIONS)
        res["capture"] = {"seconds": c2w.capture_seconds, "graphs": c2w.ode.graphs.captures,
                          "batch_sizes": c2w.batch_sizes, "windows": c2w.graph_frames,
                          "memory_gib": torch.cuda.max_memory_reserved() / 2**30}
        c = res["capture"]
        say(f"start-up capture (omni pipeline options): {c['graphs']} graphs (rows {c['batch_sizes']} x windows "
            f"{c['windows']}) in {c['seconds']:.1f} s, {c['memory_gib']:.1f} GiB reserved")
    res["seconds"] = time.perf_counter() - t0
    say(f"total {res['seconds']:.1f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
