"""A model of Qwen2.5-Omni's code2wav streaming under load, on a fake clock (CPU, seconds; no weights).

    python benchmarks/code2wav_schedule_model.py [--streams 8,32] [--kappa 1.0,1.5,2.0]

What is real: the chunk windows (`Code2Wav.ready` / `_window` and the ramp, `chunk_growth` 2) and the
first-chunk rule (`first_chunk_for_load`). What is modelled: the talker gives every stream one code per
`step` seconds (all streams start together); code2wav runs one batch at a time, first chunks before
later ones, up to 32 chunks; a batch takes kappa x (DiT ODE + BigVGAN) ms, from H200 fits of
code2wav_bench.py (DiT: 35.8 / 128 / 526 ms at 1 / 8 / 32 rows of 264 mel frames; BigVGAN 12.7 / 77 /
298 ms at 256 frames); kappa > 1 stands for the GPU time the thinker and talker take beside it.
Per row: the underruns (and seconds dry) of a listener playing each stream from its first chunk, the
batches, RTF (last chunk / 10 s of audio) and mean TTFA (first chunk after the first code).

Used for the first-chunk rule of session 12 (benchmarks/RESULTS.md): at 32 streams with kappa 1.5 the
model gives RTF 0.71 (H200: 0.68) and, with every first chunk at 48 codes, TTFA 0.94 s (H200: 1.14 s).
A model is not a measurement: omni_bench.py on the GPU decides.
"""

from __future__ import annotations

import argparse
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omnistage.models.qwen2_5_omni.code2wav import Code2Wav, first_chunk_for_load  # noqa: E402

BATCHES = (1, 2, 4, 8, 12, 16, 24, 32)          # the ODE graphs' row counts
CODES = 500                                     # codes per answer: 10 s of audio


def windows_model():
    """The pipeline's code2wav geometry (chunk 96 codes, first 12, mel frames = 2 per code) with
    `Code2Wav`'s own window and schedule methods bound to it."""
    m = types.SimpleNamespace(first_chunk_frames=24, chunk_frames=192, future=24, past=48, block=24, repeats=2,
                              dynamic_first_chunk=True, voc_ctx=40, growth=2, first_chunk_load="arrival")
    for name in ("_window", "_first_sizes", "_schedule", "ready"):
        setattr(m, name, getattr(Code2Wav, name).__get__(m))
    m.graph = sorted(Code2Wav._steady_windows(m))
    return m


class _State:                                   # the part of Code2WavState that `ready` reads
    by_load = False

    def __init__(self, first_frames: int):
        self.first_frames, self.codes, self.done = first_frames, [], 0


def dit_ms(rows: int, frames: int) -> float:
    return max(28.0, 0.0628 * rows * frames)


def voc_ms(frames: int) -> float:
    return max(5.5, 0.0363 * frames)


def run(n: int, step: float, kappa: float, first_codes=None, t0: float = 0.15) -> dict:
    """`first_codes`: every stream's first chunk (codes); None: the rule at the load of all n streams."""
    m = windows_model()
    size = first_chunk_for_load(n, 12, 96) if first_codes is None else first_codes
    reqs = [dict(state=_State(size * 2), pieces=[], input_done=False) for _ in range(n)]
    order, live = list(range(n)), set(range(n))
    t, inflight, batches = 0.0, None, 0
    while live or inflight:
        t += step
        have = min(CODES, max(0, int((t - t0) / step)))
        for r in reqs:
            r["state"].codes = [0] * have
            r["input_done"] = have >= CODES
        if inflight and t >= inflight[0]:
            for i, (s, e, _, _) in inflight[1]:
                reqs[i]["state"].done = e
                reqs[i]["pieces"].append((t, (e - s) / 100.0))      # 100 mel frames per second of audio
                order.remove(i)
                order.append(i)
            live -= {i for i in live if reqs[i]["input_done"] and m.ready(reqs[i]["state"], True) is None}
            inflight = None
        if inflight is None:
            ready = [(i, m.ready(reqs[i]["state"], reqs[i]["input_done"])) for i in order if i in live]
            ready = sorted(((i, c) for i, c in ready if c is not None), key=lambda x: bool(reqs[x[0]]["pieces"]))
            batch = []
            for i, c in ready:                  # first chunks go alone, before any later chunk
                if len(batch) == 32 or (batch and not reqs[batch[0][0]]["pieces"] and reqs[i]["pieces"]):
                    break
                batch.append((i, c))
            if batch:
                longest = max(c[3] - c[2] for _, c in batch)
                frames = next((w for w in m.graph if w >= longest), longest)
                rows = next(b for b in BATCHES if b >= len(batch))
                vocoder = sum(c[1] - max(0, c[0] - 40) + 24 for _, c in batch)
                inflight = (t + kappa * (dit_ms(rows, frames) + voc_ms(vocoder)) / 1000, batch)
                batches += 1
    dry, dry_s = 0, 0.0
    for r in reqs:
        played = r["pieces"][0][0]
        for j, (arrived, seconds) in enumerate(r["pieces"]):
            if j and arrived > played:
                dry, dry_s = dry + 1, dry_s + arrived - played
            played = max(played, arrived) + seconds
    return {"first_codes": size, "underruns": dry, "dry_s": dry_s, "batches": batches,
            "rtf": max(r["pieces"][-1][0] for r in reqs) / (CODES / 50),
            "ttfa": sum(r["pieces"][0][0] - t0 for r in reqs) / n}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="8,32")
    ap.add_argument("--kappa", default="1.0,1.5,2.0")
    args = ap.parse_args(argv)
    steps = {1: 2.7e-3, 8: 3.1e-3, 16: 4.3e-3, 32: 6.0e-3}      # talker s per step under load (H200, session 12)
    print("| streams | kappa | first chunk codes | underruns (s dry) | batches | RTF | TTFA s |\n|---|---|---|---|---|---|---|")
    for n in (int(x) for x in args.streams.split(",")):
        for kappa in (float(x) for x in args.kappa.split(",")):
            for first in (None, 12, 24, 48):
                r = run(n, steps.get(n, 6.0e-3), kappa, first)
                label = f"{r['first_codes']} (the rule)" if first is None else str(first)
                print(f"| {n} | {kappa} | {label} | {r['underruns']} ({r['dry_s']:.2f}) | {r['batches']} | "
                      f"{r['rtf']:.3f} | {r['ttfa']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
