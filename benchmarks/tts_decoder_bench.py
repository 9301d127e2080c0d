"""Qwen3-TTS' speech-tokenizer decoder on one GPU: ms per decoder call by chunk shape and compute dtype.

Uses the 1.7B-shape random folder `tts_bench.py` builds (under --work; built here when missing). For the
shapes the decoder stage runs -- a request's first chunk (`first_chunk_frames` 4, no left context), a
later chunk (24 frames + 25 of left context = 49), and those batched (8 and 16 windows) -- it times one
call of the decoder (`SpeechDecoder`, float32 as loaded, cuDNN's default TF32 convolutions) against
the same call with `decoder_dtype="bfloat16"` (autocast convolutions / matmuls; weights, residuals
and norms float32), prints the bf16 waveform's rms error relative to the float32 one's rms, and the
ten CUDA kernels that take longest in a first-chunk call (what bounds the time to first packet).
No reference library runs here (qwen-tts pins transformers 4.57, see tts_bench.py) and no floor is
printed: at these sizes the convolutions are far from compute- or bandwidth-bound, the profile says
where the time goes instead.

    python benchmarks/tts_decoder_bench.py [--work /tmp/ttsbench]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tts_check_cuda import _time  # noqa: E402  (ms per call, synchronized)

SHAPES = ((1, 4), (1, 49), (8, 49), (16, 49))   # (windows in the batch, frames per window)


def main() -> None:
    from tts_bench import build

    from omnistage.models.qwen3_tts.codec import Qwen3TTSDecoderStage

    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/ttsbench")
    args = ap.parse_args()
    folder = build(args.work, smoke=False)
    fp32 = Qwen3TTSDecoderStage(folder, device="cuda").decoder
    bf16 = Qwen3TTSDecoderStage(folder, device="cuda", decoder_dtype="bfloat16").decoder
    book = int(fp32.config["codebook_size"])
    g = torch.Generator().manual_seed(0)
    print("| windows x frames | float32 ms | bfloat16 ms | bf16 rms error / signal rms |")
    print("|---|---|---|---|")
    for b, t in SHAPES:
        codes = torch.randint(0, book, (b, fp32.groups, t), generator=g).cuda()
        a, c = fp32(codes), bf16(codes)
        err = ((a - c).pow(2).mean().sqrt() / a.pow(2).mean().sqrt().clamp(min=1e-12)).item()
        print(f"| {b} x {t} | {_time(lambda: fp32(codes)):.2f} | {_time(lambda: bf16(codes)):.2f} | {err:.4f} |")
    codes = torch.randint(0, book, (1, fp32.groups, 4), generator=g).cuda()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fp32(codes)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10))


if __name__ == "__main__":
    main()
