"""Qwen3-TTS on the GPU, in one run (prints one line per check, then a table; exits 1 when a check differs):

  1. the tiny talker's greedy codes (every codebook) equal qwen-tts' fixtures with and without the
     AR engine's CUDA graphs, alone and 8 at once -- CustomVoice, VoiceDesign and Base (in-context,
     x-vector only, a 16 kHz reference) -- float32 on cuda;
  2. the code predictor (`predictor.FramePredictor`) at the 1.7B shape (1024 x 5 layers, 16
     codebooks, random weights), greedy and sampled (the same random draws): in float32 its fast
     path (CUDA graphs of the fused frame function) against the plain-PyTorch reference (fused
     kernels off, no graphs; what the CPU tests run) at 1, 8 and 64 rows (>= 99% of codes equal:
     they differ by float32 sum order only); in bf16 graphs == eager exactly at 1, 8, 32, 64 rows;
     then ms per sampled frame of graphs / eager fused / eager reference (the floor: reading the
     predictor's weights G-1 times at the measured copy bandwidth);
  3. each decoder stage (the tiny Qwen3-TTS decoder, the tiny Qwen3-Omni code2wav: its subclass) with the
     pipeline's chunk options, 3 requests of 7, 30 and 61 random frames streamed at once, on cuda with
     CUDA graphs and with graphs off (padded eager, after the start-up decodes of every shape), equals
     the CPU's unpadded decode within 1e-4 of the peak (cuDNN TF32 off for it: padding is what it checks).
  4. the predictor's sampling kernel (layers/triton_sampling.py) == its reference `pick_ref` at 1, 8 and
     64 rows, and us per call of each under a CUDA graph.

Seeded sampling is not compared with the fixtures here: they hold the CPU generator's draws.

    PYTHONPATH=. python benchmarks/tts_check_cuda.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "..", "tests", "models", "qwen3_tts")
sys.path.insert(0, TESTS)
sys.path.insert(0, HERE)

from tts_testutil import decode_all, frames_of, params_of, reference, run_all  # noqa: E402

from omnistage.ar.engine import AREngine  # noqa: E402
from omnistage.config import EngineConfig  # noqa: E402
from omnistage.models.qwen3_tts.talker import load_talker  # noqa: E402
from omnistage.testing.qwen3_tts import make_tiny_qwen3_tts  # noqa: E402

GREEDY = ["custom_voice_greedy", "custom_voice_instruct_streaming_text", "voice_design_greedy", "base_icl_greedy",
          "base_xvector_greedy", "base_icl_16k_greedy"]


def check_fixtures() -> int:
    with open(os.path.join(TESTS, "fixtures", "cases.json"), encoding="utf-8") as f:
        cases = {name: dict(case, name=name) for name, case in json.load(f).items()}
    root = tempfile.mkdtemp(prefix="tts-check-")
    folders = {v: make_tiny_qwen3_tts(os.path.join(root, v), v) for v in ("custom_voice", "voice_design", "base")}
    bad = 0
    for graphs in (True, False):
        engines = {v: AREngine(f, EngineConfig(device="cuda", dtype="float32", max_model_len=512, cuda_graphs=graphs),
                               loader=load_talker) for v, f in folders.items()}
        for name in GREEDY:
            c = cases[name]
            got = frames_of(run_all(engines[c["variant"]], {name: (c["text"], params_of(c))})[name])
            same = got.shape == reference(name)["codes"].shape and (got == reference(name)["codes"]).all()
            bad += not same
            print(f"cuda_graphs={graphs} {name}: {'equal' if same else 'DIFFERENT'}")
        for name in ("custom_voice_greedy", "base_icl_greedy"):
            c = cases[name]
            outs = run_all(engines[c["variant"]], {f"r{i}": (c["text"], params_of(c)) for i in range(8)})
            same = all((frames_of(o) == reference(name)["codes"]).all() for o in outs.values())
            bad += not same
            print(f"cuda_graphs={graphs} {name} 8 at once: {'equal' if same else 'DIFFERENT'}")
    return bad


def _predictor_1_7b(dtype: torch.dtype):
    from torch import nn

    from omnistage.models.qwen3_tts.predictor import FramePredictor
    from omnistage.models.qwen3_tts.talker import CodePredictor
    from omnistage.testing.qwen3_tts import SHAPE_1_7B

    s = SHAPE_1_7B
    cfg = dict(s["predictor"], vocab_size=s["codebook"], num_code_groups=s["groups"], rms_norm_eps=1e-6,
               rope_theta=10000, hidden_act="silu")
    torch.manual_seed(0)
    hidden = s["talker"]["hidden_size"]
    pred = CodePredictor(cfg, hidden).to("cuda", dtype).eval()
    talker_embed = nn.Embedding(s["codebook"] + 1024, hidden).to("cuda", dtype)
    pred.sampling = {"temperature": 0.9, "top_k": 50, "top_p": 1.0}
    return FramePredictor(pred, talker_embed), pred, hidden


def _time(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t) / reps


class _Paths:
    """The predictor's three ways to run a frame on the same weights: `fast` (CUDA graphs of the
    fused frame function), `eager` (the same function, no graphs) and `reference` (no graphs, the
    fused kernels off: every step the plain-PyTorch reference the CPU tests run)."""

    def __init__(self, head):
        self.head, self.graphs = head, head.graphs

    def fast(self, *args):
        return self.head(*args)

    def eager(self, *args):
        self.head.graphs = None
        try:
            return self.head(*args)
        finally:
            self.head.graphs = self.graphs

    def reference(self, *args):
        from omnistage.layers import fused

        fused.ENABLED = False
        try:
            return self.eager(*args)
        finally:
            fused.ENABLED = True


def _batch(params, n: int, seed: int):
    from omnistage.ar.sampler import SamplingBatch

    return SamplingBatch(params=[params] * n,
                         generators=[torch.Generator("cuda").manual_seed(seed + i) for i in range(n)])


def check_predictor() -> int:
    """bf16: fast == eager exactly (greedy, and sampled on the same draws); float32: the fused
    kernels' codes against the reference's (they differ by float32 sum order only: >= 99% equal);
    then ms per frame of each path in bf16."""
    from omnistage.params import SamplingParams

    from ar_bench import copy_bandwidth

    modes = (("greedy", SamplingParams(temperature=0.0)), ("sampled", SamplingParams(temperature=0.9)))
    bad = 0
    head, _, hidden_size = _predictor_1_7b(torch.float32)
    paths = _Paths(head)
    for n in (1, 8, 64):
        hidden = torch.randn(n, hidden_size, device="cuda")
        code0 = torch.randint(0, 2048, (n,), device="cuda")
        for mode, params in modes:
            a, _ = paths.fast(hidden, code0, _batch(params, n, 7))
            b, _ = paths.reference(hidden, code0, _batch(params, n, 7))
            share = (a == b).float().mean().item()
            bad += share < 0.99
            print(f"predictor float32 {mode} rows={n}: fused graphs vs plain-PyTorch reference: "
                  f"{100 * share:.1f}% of codes equal ({'ok' if share >= 0.99 else 'DIFFERENT'})")
    del head, paths
    head, pred, hidden_size = _predictor_1_7b(torch.bfloat16)
    paths = _Paths(head)
    weights = sum(p.numel() * p.element_size() for p in pred.model.layers.parameters())
    floor = 1e3 * (head.groups - 1) * weights / copy_bandwidth()
    rows = []
    for n in (1, 8, 32, 64):
        hidden = torch.randn(n, hidden_size, device="cuda", dtype=torch.bfloat16)
        code0 = torch.randint(0, 2048, (n,), device="cuda")
        for mode, params in modes:
            a, _ = paths.fast(hidden, code0, _batch(params, n, 7))
            b, _ = paths.eager(hidden, code0, _batch(params, n, 7))
            same = torch.equal(a, b)
            bad += not same
            print(f"predictor bf16 {mode} rows={n}: graphs {'equal' if same else 'DIFFERENT'} to eager")
            if mode == "sampled":
                rows.append((n, *(_time(lambda f=f: f(hidden, code0, _batch(params, n, 1)))
                                  for f in (paths.fast, paths.eager, paths.reference))))
    print("| rows | graphs ms / frame | eager fused ms / frame | eager reference ms / frame | floor ms / frame |")
    print("|---|---|---|---|---|")
    for n, f_ms, e_ms, r_ms in rows:
        print(f"| {n} | {f_ms:.2f} | {e_ms:.2f} | {r_ms:.2f} | {floor:.2f} |")
    return bad


def check_decoders() -> int:
    import numpy as np

    from omnistage.models.qwen3_omni.code2wav import Code2WavStage
    from omnistage.models.qwen3_omni.pipeline import CODE2WAV_OPTIONS
    from omnistage.models.qwen3_tts.codec import Qwen3TTSDecoderStage
    from omnistage.models.qwen3_tts.pipeline import DECODER_OPTIONS
    from omnistage.testing.qwen3_omni import make_tiny_qwen3_omni

    root = tempfile.mkdtemp(prefix="decoder-check-")
    stages = (("qwen3_tts decoder", Qwen3TTSDecoderStage, make_tiny_qwen3_tts(os.path.join(root, "cv")),
               DECODER_OPTIONS),
              ("qwen3_omni code2wav", Code2WavStage, make_tiny_qwen3_omni(os.path.join(root, "omni")), CODE2WAV_OPTIONS))
    torch.backends.cudnn.allow_tf32 = False
    bad = 0
    for name, cls, folder, options in stages:
        cpu = cls(folder, **options)
        rng = np.random.default_rng(0)
        book = int(cpu.decoder.config["codebook_size"])
        items = {f"r{n}": rng.integers(0, book, (n, cpu.decoder.groups)) for n in (7, 30, 61)}
        want = decode_all(cpu, items)
        peak = max(float(np.abs(w).max()) for w in want.values())
        for graphs in (True, False):
            stage = cls(folder, device="cuda", cuda_graphs=graphs, **options)
            got = decode_all(stage, items)
            same = all(got[k].shape == want[k].shape for k in items)
            err = max(float(np.abs(got[k] - want[k]).max()) for k in items) / peak if same else float("inf")
            bad += not err <= 1e-4
            print(f"{name} cuda_graphs={graphs}: {'equal' if err <= 1e-4 else 'DIFFERENT'} (max error / peak "
                  f"{err:.1e}; {stage.stats()['decoder_graphed_batches_total']:.0f} of "
                  f"{stage.stats()['decoder_batches_total']:.0f} batches graphed)")
    torch.backends.cudnn.allow_tf32 = True
    return bad


def check_sampling() -> int:
    """The code predictor's sampling kernel (`layers/triton_sampling.py`) against its reference
    `predictor.pick_ref` (torch.topk of the 50 largest + masks) on the same logits and noise: ids equal at
    1, 8, 64 rows (V = 2048, the 1.7B codebook), top-k 50 with top-p 1.0 and 0.8; then us per call
    under a CUDA graph (how the frame graph runs them), kernel vs reference."""
    from omnistage.layers.triton_sampling import pick_top_k_top_p
    from omnistage.models.qwen3_tts.predictor import pick_ref

    bad = 0
    g = torch.Generator(device="cuda").manual_seed(0)
    print("| rows | top-p | ids equal | kernel us | reference us |")
    print("|---|---|---|---|---|")
    for n in (1, 8, 64):
        for top_p in (1.0, 0.8):
            logits = torch.randn(n, 2048, device="cuda", generator=g) * 3
            temp = torch.full((n,), 0.9, device="cuda")
            top_k = torch.full((n,), 50, device="cuda", dtype=torch.long)
            top_ps = torch.full((n,), top_p, device="cuda")
            noise = torch.empty(n, 2048, device="cuda").exponential_(generator=g)
            ref = pick_ref(logits, temp, top_k, top_ps, noise, k_most=50)
            got = pick_top_k_top_p(logits, temp, top_k, top_ps, noise)
            equal = bool(torch.equal(got, ref))
            bad += not equal
            times = []
            for fn in (lambda: pick_top_k_top_p(logits, temp, top_k, top_ps, noise),
                       lambda: pick_ref(logits, temp, top_k, top_ps, noise, k_most=50)):
                graph = torch.cuda.CUDAGraph()
                fn()
                torch.cuda.synchronize()
                with torch.cuda.graph(graph):
                    for _ in range(15):             # a frame's sub-steps
                        fn()
                times.append(1e3 * _time(graph.replay) / 15)
            print(f"| {n} | {top_p} | {equal} | {times[0]:.1f} | {times[1]:.1f} |")
    return bad


def main() -> int:
    bad = check_fixtures() + check_predictor() + check_decoders() + check_sampling()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
