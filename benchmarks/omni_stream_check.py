"""Qwen2.5-Omni code2wav streaming on the GPU: the streamed waveform against transformers' whole-answer
token2wav, for several first-chunk sizes, and the first chunk the load picks.

On the 7B-shape random checkpoint of `omni_bench.py` (token2wav in fp32, TF32 DiT matmuls and CUDA
graphs as the code2wav stage runs them in its own process, the pipeline's chunk options), per
first chunk (`initial_codec_chunk_frames` 4, 10, 25, and none = chosen by the load):
  * max |streamed - transformers' `Qwen2_5OmniToken2WavModel` on all codes| / its peak, one request
    of 300 codes (6 s) with the same seed (the reference library, same run);
  * the first chunk's decode seconds (code2wav's part of the time to first audio) and the codes it
    waits for (first chunk + one look-ahead block: the floor the talker must reach first);
then, for 1, 8 and 32 requests arriving together, the first-chunk sizes the load picks and how
many ODE runs replayed from CUDA graphs. Prints a markdown table.

    python benchmarks/omni_stream_check.py [--work /tmp/omnibench]
    python benchmarks/omni_stream_check.py --smoke       # tiny checkpoint, CPU (no graphs, no TF32)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import torch

CODES = 300


def _codes(n: int, seed: int, high: int) -> list[int]:
    return torch.randint(0, high, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _reference(path: str, device: str, codes: list[int], seed: int, voice: str) -> np.ndarray:
    """transformers' token2wav on all codes, its noise from `torch.manual_seed(seed)`."""
    from omnistage.models.qwen2_5_omni.code2wav import load_token2wav

    model, speakers = load_token2wav(path, device)
    spk = speakers[voice]
    torch.manual_seed(seed)
    with torch.no_grad():
        wav = model(torch.tensor([codes], device=device), conditioning=spk["cond"].float().to(device),
                    reference_mel=spk["ref_mel"].float().to(device))
    return wav.reshape(-1).float().cpu().numpy()


def _stream(engine, codes: list[int], first, seed: int, voice: str) -> tuple[np.ndarray, float]:
    """(waveform, seconds of the first chunk's step) of one request fed all codes at once."""
    from omnistage.models.qwen2_5_omni.code2wav import Code2WavParams

    engine.add_request("s", codes, Code2WavParams(voice=voice, seed=seed, initial_codec_chunk_frames=first))
    chunks, first_s = [], None
    while engine.has_unfinished():
        start = time.perf_counter()
        outs = engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        first_s = first_s if first_s is not None else time.perf_counter() - start
        chunks += [o.audio_chunk for o in outs if o.audio_chunk.size]
    return np.concatenate(chunks), first_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", default="/tmp/omnibench")
    parser.add_argument("--smoke", action="store_true", help="tiny checkpoint on the CPU")
    args = parser.parse_args()
    from omnistage.codec.engine import CodecEngine
    from omnistage.models.qwen2_5_omni.code2wav import Code2Wav, Code2WavParams
    from omnistage.models.qwen2_5_omni.pipeline import CODE2WAV_OPTIONS

    if args.smoke:
        from omnistage.testing.qwen2_5_omni import make_tiny_qwen2_5_omni

        path, device, high = make_tiny_qwen2_5_omni(os.path.join(tempfile.mkdtemp(), "omni")), "cpu", 8000
    else:
        from omni_bench import build_checkpoint

        path, device, high = build_checkpoint(os.path.join(args.work, "qwen2_5_omni_7b_shape"), weights=True), "cuda", 8000
        torch.backends.cuda.matmul.allow_tf32 = True          # the reference decode at TF32, as the stage runs its own
    voice, seed, codes = "Ethan", 3, _codes(CODES, 0, high)
    ref = _reference(path, device, codes, seed, voice)
    engine = CodecEngine(Code2Wav(path, device=device, **CODE2WAV_OPTIONS))
    model = engine.model
    rows = []
    for first in (4, 10, 25, None):
        wav, first_s = _stream(engine, codes, first, seed, voice)
        size = first if first is not None else CODE2WAV_OPTIONS["first_chunk_codes"]
        err = float(np.abs(wav - ref).max() / np.abs(ref).max()) if wav.shape == ref.shape else float("nan")
        rows.append((f"{first}" if first else f"load ({size})", err, first_s, size + model.future // model.repeats))
    print("| first chunk (codes) | max abs diff / peak vs transformers | first chunk decode s | codes before first audio |")
    print("|---|---|---|---|")
    for name, err, first_s, wait in rows:
        print(f"| {name} | {err:.2e} | {first_s:.3f} | {wait} |")
    print("\n| requests arriving together | first chunks picked (codes) | ODE graph replays / captures |")
    print("|---|---|---|")
    for n in (1, 8, 32):
        graphs = model.ode.graphs
        before = (graphs.replays, graphs.captures) if graphs is not None else (0, 0)
        for i in range(n):
            engine.add_request(f"n{n}-{i}", _codes(120, i, high), Code2WavParams(seed=i))
        picked = sorted({r.state.first_frames // model.repeats for r in engine.requests.values()})
        while engine.has_unfinished():
            engine.step()
        after = (graphs.replays, graphs.captures) if graphs is not None else (0, 0)
        print(f"| {n} | {picked} | {after[0] - before[0]} / {after[1] - before[1]} |")


if __name__ == "__main__":
    main()
