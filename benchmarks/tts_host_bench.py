"""Host cost of a Qwen3-TTS talker step at 1, 8 and 64 rows, on the CPU (no GPU needed).

The tiny CustomVoice folder (`omnistage.testing.qwen3_tts`) runs N concurrent requests of --frames
frames each (min_new_tokens holds codec eos back, so every answer is full length; sampled with
generation_config's temperature / top-k / repetition penalty, as the GPU bench) through the talker
stage's step as its stage process runs it: `AREngine.step()`, then `wire.encode` of the step's
`StageOutputs` (what `stage_client._serve` sends: as deltas where the tree has `pipeline/output_deltas.py`), then the talker -> decoder edge the orchestrator
runs on each output (`talker_to_decoder(out).slice(sent, len)`). Per decode step (every row decoding,
one torch thread, process CPU time) it times the whole, and the device-side work inside it: the
talker forward, its logits and the code predictor's frame function (`FramePredictor._frame`, what one
CUDA graph replays on the GPU), and the talker's sampling (`sampler.sample`: its sort / noise compute
on the CPU, launches on a GPU) on its own. What is left is host work, which an H200 pays as well (tiny
models make the compute small). Prints a table (ms per step) and the cProfile top entries at the largest N.

    PYTHONPATH=$PWD python benchmarks/tts_host_bench.py [--rows 1,8,64] [--frames 48] [--profile 25]

"Before": the same script with PYTHONPATH at an older checkout (`git archive <commit> | tar -x -C DIR`).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ar_host_bench import Timer, print_table  # noqa: E402  (the AR host bench's timer and table)


def build(folder: str, rows: int, frames: int):
    from omnistage.ar.engine import AREngine
    from omnistage.config import EngineConfig
    from omnistage.models.qwen3_tts.talker import load_talker

    blocks = rows * (-(-(64 + frames) // 16) + 1)
    engine = AREngine(folder, EngineConfig(device="cpu", dtype="float32", max_model_len=512, num_kv_blocks=blocks,
                                           max_num_seqs=rows, max_num_batched_tokens=max(2048, 64 * rows)),
                      loader=load_talker)
    device = Timer()
    model = engine.model
    model.forward = device.wrap(model.forward)
    model.compute_logits = device.wrap(model.compute_logits)
    head = model.frame_head
    head._frame = device.wrap(head._frame)
    from omnistage.ar import runner as runner_mod

    sampler = Timer()                           # the talker's sampling: its ops run on the device on a GPU
    runner_mod.sample = sampler.wrap(runner_mod.sample)
    device.sampler = sampler
    return engine, device


def run(engine, device: Timer, rows: int, frames: int, profile: bool = False) -> dict:
    from omnistage.models.qwen3_tts.pipeline import talker_to_decoder
    from omnistage.models.qwen3_tts.prompt import Qwen3TTSParams
    from omnistage.pipeline import wire
    from omnistage.pipeline.stage_messages import StageOutputs

    params = Qwen3TTSParams(voice="vivian", language="english", max_new_tokens=frames + 1, min_new_tokens=frames)
    for i in range(rows):
        engine.add_request(f"r{i}", f"Hello there number {i}, this is a test.", params)
    sent: dict[str, int] = {}
    try:                                        # outputs as deltas (absent in older trees: sent whole)
        from omnistage.pipeline.output_deltas import DeltaPacker

        packer = DeltaPacker()
    except ImportError:
        packer = None
    totals, devices, samplers = [], [], []
    prof = cProfile.Profile() if profile else None
    while engine.has_unfinished():
        decode_only = all(s.num_computed_tokens >= s.prompt_len for s in engine.scheduler.running) \
            and len(engine.scheduler.running) == rows and not engine.scheduler.waiting
        device.seconds, device.on = 0.0, decode_only
        device.sampler.seconds, device.sampler.on = 0.0, decode_only
        if prof is not None and decode_only:
            prof.enable()
        t = time.process_time()
        with torch.inference_mode():
            outs = engine.step()
            if packer is None:
                wire.encode(StageOutputs(outs, engine.stats()))
            else:
                packed, deltas, state = packer.pack(outs)
                wire.encode(StageOutputs(packed, engine.stats(), deltas))
                packer.commit(state)
            for out in outs:                    # the orchestrator's edge to the decoder stage
                frames_so_far = talker_to_decoder(out)
                frames_so_far.slice(sent.get(out.request_id, 0), len(frames_so_far), out.finished)
                sent[out.request_id] = len(frames_so_far)
        took = time.process_time() - t
        if prof is not None and decode_only:
            prof.disable()
        device.on = device.sampler.on = False
        if decode_only and outs:
            totals.append(took)
            devices.append(device.seconds)
            samplers.append(device.sampler.seconds)
    hosts = [a - b - c for a, b, c in zip(totals, devices, samplers)]
    return {"steps": len(totals), "step_ms": 1e3 * statistics.median(totals),
            "device_ms": 1e3 * statistics.median(devices), "sampler_ms": 1e3 * statistics.median(samplers),
            "host_ms": 1e3 * statistics.median(hosts), "profile": prof}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--frames", type=int, default=48)
    ap.add_argument("--profile", type=int, default=25, help="cProfile entries to print (0: none)")
    args = ap.parse_args()
    from omnistage.testing.qwen3_tts import make_tiny_qwen3_tts

    torch.set_num_threads(1)
    levels = [int(n) for n in args.rows.split(",")]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny_qwen3_tts(tmp + "/cv", "custom_voice")
        for n in levels:
            engine, device = build(folder, n, args.frames)
            run(engine, device, min(n, 2), 6)  # warm-up
            results[n] = run(engine, device, n, args.frames)
        if args.profile:                        # a run of its own: the profiler slows what it watches
            engine, device = build(folder, levels[-1], args.frames)
            prof = run(engine, device, levels[-1], args.frames, profile=True)["profile"]
    print_table(["rows", "decode steps", "step ms (CPU)", "device ms", "sampler ms", "host ms", "host us / row"],
                [[str(n), str(r["steps"]), f"{r['step_ms']:.2f}", f"{r['device_ms']:.2f}", f"{r['sampler_ms']:.2f}",
                  f"{r['host_ms']:.2f}", f"{1e3 * r['host_ms'] / n:.1f}"] for n, r in results.items()])
    if args.profile:
        print(f"\ncProfile of the {levels[-1]}-row decode steps, top {args.profile} by own time:")
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(args.profile)


if __name__ == "__main__":
    main()
