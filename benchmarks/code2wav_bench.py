"""Qwen2.5-Omni's code2wav DiT alone on one GPU: ms per ODE batch (36 DiT evaluations) by rows, window
and precision, graphs on and off, the start-up capture time, the error of each precision, transformers'
`sample` on the same weights, and the compute floor. Random weights of the 7B checkpoint's token2wav
shape (transformers' defaults: DiT 22 layers x 1024, BigVGAN 1536 channels; codec table 8448 rows, as
in omni_bench.py) time exactly like real ones. Runs in under two minutes on an H200.

    python benchmarks/code2wav_bench.py [--work /tmp/omnibench] [--reps 3] [--skip-capture] [--out c2w.json]
    python benchmarks/code2wav_bench.py --smoke     # the tiny checkpoint on the CPU: checks the script runs

Rows: steady chunks (96 codes: the 264-frame window of a later chunk) at 1 / 8 / 32 rows, and first
chunks (12 / 24 / 48 codes: 48 / 72 / 120 frames, the sizes the load rule picks) at 1 and 8 rows.
Columns: `tf32` = float32 with TF32 matmuls scoped to the ODE (the stage's default), `fp32` = plain
float32 (`tf32: false`), `bf16` = `dit_dtype: bfloat16`; each from a CUDA graph (as served) and, for
tf32, eagerly. Floor = the DiT's linear FLOPs at the H200's dense bf16 peak (989 TFLOP/s). Error =
max |mel - plain fp32 mel| / std of the fp32 mel for the 8-row steady batch, same noise and codes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SETTINGS = (10, 0.5, -1.0)                      # Code2WavParams().ode_key(): 10 time points, CFG 0.5, sway -1
BF16_PEAK = 989e12                              # H200 dense bf16 FLOP/s
STEADY, FIRSTS = 264, (48, 72, 120)             # mel frames of the windows (chunk 96 codes; first 12 / 24 / 48)


def build_folder(path: str) -> str:
    """A folder with only what code2wav loads: config.json (7B shape), token2wav.* weights, spk_dict.pt."""
    from safetensors.torch import save_file
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel

    from omni_bench import omni_7b_config
    from omnistage.testing import qwen2_5_omni as tiny

    if os.path.exists(os.path.join(path, "spk_dict.pt")):
        return path
    os.makedirs(path, exist_ok=True)
    config = omni_7b_config(tiny._token_ids(tiny.make_omni_tokenizer()))
    torch.manual_seed(0)
    model = Qwen2_5OmniToken2WavModel._from_config(config.token2wav_config)
    save_file({f"token2wav.{k}": v.contiguous() for k, v in model.state_dict().items()},
              os.path.join(path, "model.safetensors"))
    config.save_pretrained(path)
    torch.save(tiny.make_speakers(config, torch.Generator().manual_seed(1)), os.path.join(path, "spk_dict.pt"))
    return path


def inputs(rows: int, frames: int, repeats: int = 2):
    g = torch.Generator().manual_seed(rows * 1000 + frames)
    noise = torch.randn(rows, frames, 80, generator=g)
    codes = torch.randint(0, 8192, (rows, frames // repeats + 1), generator=g)
    return noise, codes


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ode(ode, rows: int, frames: int, graphed: bool, reps: int) -> tuple[float, torch.Tensor]:
    """(ms per ODE batch, the mel of the last run) for `rows` rows of `frames` frames."""
    noise, codes = inputs(rows, frames)
    args = (noise, codes, ["Ethan"] * rows, [frames] * rows, SETTINGS, graphed)
    ode.run(*args)                              # warm-up (and the capture when graphed)
    sync(ode.device)
    start = time.perf_counter()
    reps = 1 if rows >= 32 else reps
    for _ in range(reps):
        mel = ode.run(*args)
    sync(ode.device)
    return (time.perf_counter() - start) / reps * 1000, mel.float().clone()


def linear_params(dit) -> int:
    return sum(m.weight.numel() for b in dit.transformer_blocks for m in b.modules()
               if isinstance(m, torch.nn.Linear) and m is not b.attn_norm.linear)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/omnibench")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-capture", action="store_true", help="skip the start-up capture of the pipeline's graphs")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--smoke", action="store_true", help="tiny checkpoint, CPU, 1 rep, no capture")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from omnistage.models.qwen2_5_omni.code2wav import Code2Wav
    from omnistage.models.qwen2_5_omni.code2wav_ode import Code2WavODE
    from omnistage.models.qwen2_5_omni.token2wav import load_token2wav

    if args.smoke:
        from omnistage.testing.qwen2_5_omni import make_tiny_qwen2_5_omni

        folder = os.path.join(args.work, "tiny-qwen2_5_omni")
        if not os.path.exists(os.path.join(folder, "spk_dict.pt")):
            make_tiny_qwen2_5_omni(folder)
        device, args.reps, args.skip_capture = torch.device("cpu"), 1, True
        cases = [("steady", 2, 48), ("first", 1, 24)]
    else:
        folder = build_folder(os.path.join(args.work, "code2wav_7b_shape"))
        device = torch.device("cuda")
        cases = [("steady", r, STEADY) for r in (1, 8, 32)] + [("first", r, f) for f in FIRSTS for r in (1, 8)]
    res: dict = {"cases": [], "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                 "shape": "tiny" if args.smoke else "7B shape"}
    model, speakers = load_token2wav(folder, device)
    dit = model.code2wav_dit_model
    flops = linear_params(dit) * 2
    variants = {"tf32": Code2WavODE(dit, speakers, device, max_graphs=64, tf32=True),
                "fp32": Code2WavODE(dit, speakers, device, max_graphs=64, tf32=False)}
    mels: dict = {}
    for name, r, f in cases:
        row = {"case": name, "rows": r, "frames": f,
               "floor_ms": 36 * flops * 2 * r * f / BF16_PEAK * 1000}   # x2 rows: CFG
        for v, ode in variants.items():
            row[f"{v}_graph_ms"], mel = time_ode(ode, r, f, True, args.reps)
            mels[(v, name, r, f)] = mel
        row["tf32_eager_ms"], _ = time_ode(variants["tf32"], r, f, False, args.reps)
        res["cases"].append(row)
    del variants
    with torch.no_grad():                       # transformers' own ODE, 1 row, one steady window (eager, fp32)
        noise, codes = inputs(1, STEADY)
        spk = speakers["Ethan"]
        cond, ref = spk["cond"].to(device).float(), spk["ref_mel"].to(device).float()
        dit.sample(cond, ref, codes.to(device)[:, :STEADY // 2])
        sync(device)
        start = time.perf_counter()
        dit.sample(cond, ref, codes.to(device)[:, :STEADY // 2])
        sync(device)
        res["transformers_sample_ms_1_row_steady"] = (time.perf_counter() - start) * 1000
    bf16 = Code2WavODE(dit, speakers, device, max_graphs=64, dit_dtype="bfloat16", tf32=True)   # converts the blocks
    for row in res["cases"]:
        row["bf16_graph_ms"], mel = time_ode(bf16, row["rows"], row["frames"], True, args.reps)
        mels[("bf16", row["case"], row["rows"], row["frames"])] = mel
    steady = next(c for c in cases if c[0] == "steady" and c[1] > 1)      # 8 rows (2 in the smoke run)
    ref = mels[("fp32", *steady)]
    res["error_vs_fp32"] = {v: float((mels[(v, *steady)] - ref).abs().max() / ref.std()) for v in ("tf32", "bf16")}
    del bf16, model, dit
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not args.skip_capture:                   # the omni pipeline's code2wav as it starts (TF32, fp32 DiT)
        from omnistage.models.qwen2_5_omni.pipeline import CODE2WAV_OPTIONS

        c2w = Code2Wav(folder, device=device, **CODE2WAV_OPTIONS)
        res["capture"] = {"seconds": c2w.capture_seconds, "graphs": c2w.ode.graphs.captures,
                          "batch_sizes": c2w.batch_sizes, "windows": c2w.graph_frames,
                          "memory_gib": torch.cuda.max_memory_reserved() / 2**30}
    print(table(res))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


def table(res: dict) -> str:
    lines = [f"code2wav ODE batch, {res['shape']}, {res['device']} (ms per batch of 36 DiT evaluations)", "",
             "| chunk | rows | frames | tf32 graph | fp32 graph | bf16 graph | tf32 eager | floor (bf16 peak) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["cases"]:
        lines.append(f"| {r['case']} | {r['rows']} | {r['frames']} | {r['tf32_graph_ms']:.1f} "
                     f"| {r['fp32_graph_ms']:.1f} | {r['bf16_graph_ms']:.1f} | {r['tf32_eager_ms']:.1f} "
                     f"| {r['floor_ms']:.2f} |")
    hf = res["transformers_sample_ms_1_row_steady"]
    lines += ["", f"transformers `sample`, 1 row, {STEADY} frames, eager fp32: {hf:.1f} ms",
              "max |mel - fp32 mel| / fp32 mel std (steady batch of several rows): "
              + ", ".join(f"{k} {v:.2e}" for k, v in res["error_vs_fp32"].items())]
    if "capture" in res:
        c = res["capture"]
        lines.append(f"start-up capture (omni pipeline options): {c['graphs']} graphs (rows {c['batch_sizes']} x "
                     f"windows {c['windows']}) in {c['seconds']:.1f} s, {c['memory_gib']:.1f} GiB reserved")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
