"""GPU correctness checks of the shared stage layout and of async scheduling for conditioned rows
(run on the GPU machine before `omni_bench.py`; CPU tests cover the same on the reference paths).

- The tiny Qwen2.5-Omni (fp32, CUDA, CUDA graphs on) in the shared layout (every stage in this
  process, each on its own CUDA stream, pipeline/shared.py) against the process-per-stage layout:
  4 requests at once (text + audio, greedy thinker and talker, seeded code2wav noise); thinker ids and
  talker codes must be equal, waveforms within 1e-3 (fp32; code2wav's batches depend on timing).
- The same pipeline, shared layout, with the AR stages' `async_scheduling` on and off: the talker's
  and thinker's conditioned rows (prompt embeddings, M-RoPE, streamed rows, hidden-state reports,
  repetition penalty) queued ahead on the device and in CUDA graphs give the same ids and codes.
Prints one line per check and a table; exits 1 when one fails.

    python benchmarks/check_shared_layout.py [--work /tmp/omnicheck] [--device cpu]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

MESSAGES = ["Tell me a story.", "Sing it again.", "What is the harbour like?", "Count to five."]


def run(path: str, deploy: dict, device: str) -> tuple[list, dict]:
    """(outputs, request id -> talker codes) of the 4 requests under `deploy`."""
    from omnistage import Omni, SamplingParams
    from omnistage.models.qwen2_5_omni.code2wav import Code2WavParams

    with Omni(path, device=device, dtype="float32", deploy_config=deploy) as omni:
        talker_params = omni.orchestrator.spec.stage("talker").params
        thinker = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        talker = SamplingParams(**{**talker_params, "temperature": 0, "max_tokens": 60})
        prompts = [dict(omni.render_chat([{"role": "user", "content": m}]), modalities=["text", "audio"],
                        voice=("Ethan", "Chelsie")[i % 2]) for i, m in enumerate(MESSAGES)]
        codes: dict = {}
        stage = omni.orchestrator.stages["talker"]
        if hasattr(stage, "engine"):            # in this process: record what the talker reports
            step = stage.step

            def record():
                outs = step()
                codes.update({o.request_id: o.output.outputs[0].token_ids for o in outs})
                return outs

            stage.step = record
        outs = omni.generate(prompts, thinker, sampling_params_list=[thinker, talker, Code2WavParams(seed=7)],
                             use_tqdm=False)
    return outs, codes


def compare(name: str, got: list, want: list, got_codes: dict, want_codes: dict, tol: float) -> bool:
    ids_equal = all(g.outputs[0].token_ids == w.outputs[0].token_ids for g, w in zip(got, want))
    shapes = all(g.audio.samples.shape == w.audio.samples.shape for g, w in zip(got, want))
    err = max(float(np.abs(g.audio.samples - w.audio.samples).max()) for g, w in zip(got, want)) if shapes else float("inf")
    compared = bool(got_codes and want_codes)  # codes are seen only for a talker in this process
    codes_equal = list(got_codes.values()) == list(want_codes.values()) if compared else "n/a (audio compared)"
    ok = ids_equal and shapes and err <= tol and codes_equal in (True, "n/a (audio compared)")
    print(f"| {name} | thinker ids equal: {ids_equal} | talker codes equal: {codes_equal} | "
          f"max |wav diff| {err:.2e} (tol {tol:g}) | {'ok' if ok else 'FAIL'} |")
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/omnicheck")
    ap.add_argument("--device", default="cuda", help="cuda (the check) or cpu (a smoke run of the script)")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from omnistage.testing.qwen2_5_omni import make_tiny_qwen2_5_omni

    path = os.path.join(args.work, "tiny-qwen2_5_omni")
    if not os.path.exists(os.path.join(path, "spk_dict.pt")):
        make_tiny_qwen2_5_omni(path)
    # full fp32 everywhere (no TF32: the layouts would set it for different processes); code2wav's
    # batches depend on timing, so waveforms are compared within fp32 batch-composition noise
    fp32 = {"code2wav": {"options": {"tf32": False}}}
    shared, shared_codes = run(path, {"stage_layout": "shared", "stages": fp32}, args.device)
    apart, _ = run(path, {"stage_layout": "process", "stages": fp32}, args.device)
    sync, sync_codes = run(path, {"stage_layout": "shared", "stages": {
        **fp32, "thinker": {"async_scheduling": False}, "talker": {"async_scheduling": False}}}, args.device)
    print("| check | ids | codes | waveform | verdict |\n|---|---|---|---|---|")
    ok = compare("shared layout vs process per stage", shared, apart, {}, {}, 1e-3)
    ok &= compare("shared layout: async scheduling vs sync", shared, sync, shared_codes, sync_codes, 1e-3)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
