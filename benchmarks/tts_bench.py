"""Qwen3-TTS streaming speech on one GPU: time to first audio packet, RTF and audio-s per wall-s.

Builds once (under --work, default /tmp/ttsbench) a random-weight bf16 CustomVoice folder in the
real layout with Qwen3-TTS-12Hz-1.7B's shape (`omnistage.testing.qwen3_tts.SHAPE_1_7B`: talker
2048 x 28 layers, code predictor 1024 x 5 layers, 16 codebooks, speech-tokenizer decoder; the
tiny text tokenizer, ids below 800) -- random weights time like real ones. Then, through
`AsyncOmni` (talker and decoder stages on one GPU, each in its own process: the pipeline's default
on a GPU), N concurrent requests (N = 1, 8, 32, 64), each: one sentence, --frames frames
(max_new_tokens = frames + 1, min_new_tokens = frames: codec eos is held back, so every answer has
exactly `frames` frames, whatever a random talker samples) = frames / 12.5 s of audio:
  TTFP  request arrival -> its first audio samples reach the caller (mean, p90)
  RTF   (last audio - arrival) / seconds of audio (mean); below 1 = faster than real time
  audio-s/s  all requests' audio seconds / wall seconds of the whole round
and the floor: the audio-s/s if every frame of a step cost only reading the talker and code
predictor weights once at the device's measured copy bandwidth (all requests of a step share that
read; decoder compute left out). The reference library (qwen-tts) pins transformers 4.57 and
cannot run beside omnistage's; its numbers are not in this table (vLLM-Omni reports 47 ms / 75 ms
TTFP at 1 / 8 and ~70 audio-s/s on two H100s). Prints a markdown table, then per level where the
first packet waits (`first_output.py`, from the orchestrator's stamps): mean seconds from arrival to
the talker's first frame, the first frames handed to the decoder, the decoder's first audio and the
caller's first audio.

The code predictor runs as one CUDA graph per batch bucket (`models/qwen3_tts/predictor.py`);
`OMNISTAGE_TTS_PREDICTOR_GRAPHS=0` measures its plain-PyTorch path instead (the stage processes
inherit the variable). `benchmarks/tts_check_cuda.py` checks the two paths give equal codes.

    python benchmarks/tts_bench.py [--work /tmp/ttsbench] [--frames 100] [--out results.json]
    OMNISTAGE_TTS_PREDICTOR_GRAPHS=0 python benchmarks/tts_bench.py --out plain.json
    python benchmarks/tts_bench.py --variant base   # Base: every request clones a 3 s reference (in-context)
    python benchmarks/tts_bench.py --smoke          # the tiny folder on the CPU, 1 and 2 requests
    python benchmarks/tts_bench.py --smoke --levels 1,8 --layout process   # ... at 1 and 8, stage processes
    # tables of 20 talker and decoder steps at 64 rows (the warm-up round and the round's start skipped):
    OMNISTAGE_TORCH_PROFILER_DIR=/tmp/tts_prof OMNISTAGE_PROFILER_WARMUP=30 python benchmarks/tts_bench.py --levels 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # the sibling benchmark modules
from first_output import breakdown_table, first_output_breakdown, mean_breakdown  # noqa: E402

FRAME_S = 1920 / 24000                          # seconds of audio per frame
LEVELS = (1, 8, 32, 64)                         # concurrent requests per round without --levels


def build(work: str, smoke: bool, variant: str = "custom_voice") -> str:
    from omnistage.testing.qwen3_tts import SHAPE_1_7B, TINY, make_tiny_qwen3_tts

    folder = os.path.join(work, f"{'tiny' if smoke else 'qwen3-tts-1.7b-bf16'}-{variant}")
    if not os.path.exists(os.path.join(folder, "speech_tokenizer", "model.safetensors")):
        t = time.perf_counter()
        make_tiny_qwen3_tts(folder, variant, shape=TINY if smoke else SHAPE_1_7B,
                            dtype=torch.float32 if smoke else torch.bfloat16)
        print(f"built {folder} in {time.perf_counter() - t:.0f} s")
    return folder


def weight_bytes(folder: str) -> int:
    """Bytes of the talker decoder and code predictor (what one step must read at least once)."""
    from safetensors import safe_open

    total = 0
    with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            if name.startswith(("talker.model.layers.", "talker.code_predictor.", "talker.codec_head.")):
                t = f.get_slice(name)
                total += (2 if t.get_dtype() in ("BF16", "F16") else 4) * _numel(t.get_shape())
    return total


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a large device-to-device copy (ar_bench's measurement); NaN off the GPU."""
    if not device.startswith("cuda"):
        return float("nan")
    from ar_bench import copy_bandwidth as measured      # benchmarks/ is on sys.path when run as a script

    return measured()


def _params(variant: str, frames: int):
    import numpy as np

    from omnistage.models.qwen3_tts.prompt import Qwen3TTSParams

    if variant != "base":
        return Qwen3TTSParams(voice="vivian", language="English", max_new_tokens=frames + 1, min_new_tokens=frames)
    t = np.arange(3 * 24000) / 24000                # a 3 s reference voice (the same for every request)
    voice = (0.3 * np.sin(2 * np.pi * (180 + 90 * t) * t)).astype(np.float32)
    return Qwen3TTSParams(language="English", max_new_tokens=frames + 1, min_new_tokens=frames,
                          ref_audio=(voice, 24000),
                          ref_text="The old engineer kept a notebook of every tide.")


async def one(engine, i: int, frames: int, arrival: float, variant: str = "custom_voice") -> dict:
    params = _params(variant, frames)
    first = last = first_wall = metrics = None
    samples = 0
    async for out in engine.generate("The harbour town woke slowly, and the market filled with voices.",
                                     params, f"tts-{i}-{arrival}"):
        if out.audio is not None and len(out.audio.samples) > samples:
            now = time.perf_counter()
            first, first_wall = first or now, first_wall or time.time()
            last, samples = now, len(out.audio.samples)
        metrics = out.metrics or metrics
    seconds = samples / 24000
    return {"ttfp": first - arrival, "rtf": (last - arrival) / max(seconds, 1e-9), "audio_s": seconds,
            "breakdown": first_output_breakdown(metrics, first_wall)}


def _counters(engine) -> dict[str, float]:
    """The engine's cumulative busy counters (seconds and step counts per stage)."""
    return {k: v for k, v in engine.stats().items() if k.endswith(("_total", ":seconds"))}


async def round_of(engine, n: int, frames: int, variant: str = "custom_voice") -> dict:
    before = _counters(engine)
    start = time.perf_counter()
    results = await asyncio.gather(*(one(engine, i, frames, start, variant) for i in range(n)))
    wall = time.perf_counter() - start
    await asyncio.sleep(0.05)                   # the last step's gauges reach the stats
    busy = {k: round(v - before.get(k, 0.0), 3) for k, v in _counters(engine).items() if v != before.get(k, 0.0)}
    ttfp = sorted(r["ttfp"] for r in results)
    return {"n": n, "ttfp_mean_ms": 1e3 * statistics.mean(ttfp), "ttfp_p90_ms": 1e3 * ttfp[int(0.9 * (n - 1))],
            "rtf_mean": statistics.mean(r["rtf"] for r in results),
            "audio_s_per_s": sum(r["audio_s"] for r in results) / wall, "wall_s": round(wall, 3), "busy": busy,
            "ttfp_breakdown_mean_s": mean_breakdown([r["breakdown"] for r in results])}


async def main_async(args) -> list[dict]:
    from omnistage.entrypoints.async_omni import AsyncOmni

    folder = build(args.work, args.smoke, args.variant)
    device = "cpu" if args.smoke else "cuda"
    deploy = {"stage_layout": args.layout} if args.layout else None
    engine = AsyncOmni(folder, device=device, dtype="float32" if args.smoke else "bfloat16", max_num_seqs=64,
                       deploy_config=deploy)
    try:
        sizes = tuple(int(n) for n in args.levels.split(",")) if args.levels else (1, 2) if args.smoke else LEVELS
        for n in sizes:                 # warm-up: each size's first round captures its graphs (predictor
            await round_of(engine, n, 8, args.variant)   # buckets, decoder batches) and grows the allocator
        rows = [await round_of(engine, n, args.frames, args.variant) for n in sizes]
    finally:
        engine.close()
    per_step = weight_bytes(folder) / copy_bandwidth(device)    # seconds to read the weights once
    for r in rows:
        r["floor_audio_s_per_s"] = r["n"] * FRAME_S / per_step
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/ttsbench")
    ap.add_argument("--frames", type=int, default=100)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--variant", choices=("custom_voice", "base"), default="custom_voice")
    ap.add_argument("--levels", help="concurrent requests per round, comma-separated (default 1,8,32,64; "
                                     "--smoke: 1,2)")
    ap.add_argument("--layout", choices=("inline", "shared", "process"),
                    help="a deploy `stage_layout` for every stage (default: the pipeline's: process on a GPU, inline on a CPU)")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.smoke:
        args.frames = min(args.frames, 6)
    rows = asyncio.run(main_async(args))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)
    print("| concurrent | TTFP mean (ms) | TTFP p90 (ms) | RTF mean | audio-s / wall-s | floor audio-s / wall-s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['n']} | {r['ttfp_mean_ms']:.1f} | {r['ttfp_p90_ms']:.1f} | {r['rtf_mean']:.3f} | "
              f"{r['audio_s_per_s']:.1f} | {r['floor_audio_s_per_s']:.0f} |")
    for r in rows:                              # where the time went: per-stage busy seconds and steps
        print(f"busy at {r['n']} (wall {r['wall_s']} s): {r['busy']}")
    print(breakdown_table("TTFP", [(f"{r['n']} concurrent", r["ttfp_breakdown_mean_s"]) for r in rows]))


if __name__ == "__main__":
    main()
