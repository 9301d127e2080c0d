"""Profile Qwen2.5-Omni talker decode steps on CUDA: step time by batch size and sampling settings.

    python benchmarks/profile_talker.py OMNI_DIR [--no-code2wav]   # e.g. omni_bench.py's 7B-shape folder
First, ms per code2wav ODE batch (graphs and TF32 on and off). Then ms per talker step at batch 1 and 8 with greedy sampling and with the talker's own defaults
(temperature/top-k/top-p/repetition penalty/banned ids, per-request seeds), then the top CPU ops of
the sampled batch-8 steps.
"""

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from omnistage.ar.engine import AREngine
from omnistage.config import EngineConfig
from omnistage.models.qwen2_5_omni.pipeline import talker_params
from omnistage.models.qwen2_5_omni.stages import TALKER, omni_config
from omnistage.models.registry import component_loader
from omnistage.params import SamplingParams
from omnistage.stage import ExtraRows


def start(eng: AREngine, n: int, params: SamplingParams) -> None:
    width = eng.model.embed_tokens.weight.shape[1]
    for i in range(n):
        rid = f"r{i}"
        eng.add_request(rid, {"prompt_token_ids": [0] * 40, "stream_extra": True,
                              "prompt_embeds": torch.randn(40, width, dtype=eng.dtype, device=eng.device)},
                        params.clone(seed=i) if params.seed is not None else params)
        eng.add_input(rid, ExtraRows(finished=True, pad=torch.randn(width)))
    for _ in range(3):
        eng.step()


def main() -> None:
    path = sys.argv[1]
    eng = AREngine(path, EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=8, num_kv_blocks=2048),
                   loader=component_loader(TALKER))
    defaults = SamplingParams(**{**talker_params(omni_config(path)), "max_tokens": 2000, "seed": 0,
                                 "stop_token_ids": [], "ignore_eos": True})   # fixed batch while timing
    greedy = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)
    for name, params in (("greedy", greedy), ("talker defaults", defaults)):
        for n in (1, 8):
            start(eng, n, params)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(50):
                eng.step()
            torch.cuda.synchronize()
            print(f"{name}, batch {n}: {(time.perf_counter() - t) / 50 * 1000:.2f} ms per step")
            if name != "greedy":
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        eng.step()
                    torch.cuda.synchronize()
                table = prof.key_averages()
                print(f"{name}, batch {n}: top CUDA kernels over 10 steps")
                print(table.table(sort_by="self_cuda_time_total", row_limit=25))
                if n == 8:
                    print(table.table(sort_by="cpu_time_total", row_limit=25))
            for i in range(n):
                eng.abort(f"r{i}")
            eng.step()


@torch.inference_mode()
def code2wav(path: str) -> None:
    """ms per ODE batch of steady chunks (the pipeline's chunk settings), graphs on and off."""
    from omnistage.models.qwen2_5_omni.code2wav import Code2Wav, Code2WavParams
    from omnistage.models.qwen2_5_omni.pipeline import CODE2WAV_OPTIONS

    for graphs, tf32 in ((True, True), (True, False), (False, True)):
        options = {**CODE2WAV_OPTIONS, "tf32": tf32, "max_batch_requests": 8}
        eng = Code2Wav(path, device="cuda", cuda_graphs=graphs, **options)
        print(f"code2wav DiT dtype {next(eng.dit.parameters()).dtype}, windows {sorted(eng.graph_frames)}")
        frames = max(eng._steady_windows())
        for n in (1, 8):
            noise = torch.zeros(n, frames, eng.mel_dim)
            codes = torch.zeros(n, frames // eng.repeats + 1, dtype=torch.long)
            args = (noise, codes, [eng.default_voice] * n, [frames] * n, Code2WavParams().ode_key(), graphs)
            eng.ode.run(*args)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(3):
                eng.ode.run(*args)
            torch.cuda.synchronize()
            print(f"code2wav ODE, graphs {graphs}, tf32 {tf32}, batch {n}, {frames} frames: "
                  f"{(time.perf_counter() - t) / 3 * 1000:.1f} ms")
        del eng
        import gc

        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    import glob
    import os

    if not glob.glob(os.path.join(sys.argv[1], "*.safetensors")):   # a config-only folder: random weights
        from omnistage.models import dummy

        dummy.use_dummy_weights(sys.argv[1])
    if "--no-code2wav" not in sys.argv:
        code2wav(sys.argv[1])
    main()
