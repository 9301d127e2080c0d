"""`FramePredictor` (the code predictor's own decoder): the batch-bucket path the GPU replays as CUDA
graphs -- rows padded up to the bucket, every input a device tensor -- gives each row what the
plain path gives it, greedy and sampled, greedy rows beside sampled ones. On the CPU the capture is
left out (`run` calls the frame function on the padded inputs); benchmarks/tts_check_cuda.py
compares the captured graphs on a GPU."""

from __future__ import annotations

import torch


class _Uncaptured:
    """`GraphCache.run` without the capture: the same padded inputs, the function run eagerly."""

    def __init__(self):
        self.keys = []

    def run(self, key, inputs, fn):
        self.keys.append(key)
        return fn(*inputs)


def test_bucket_path_equals_plain_path(talkers):
    from omnistage.ar.sampler import SamplingBatch
    from omnistage.params import SamplingParams

    head = talkers["custom_voice"].model.frame_head
    n = 3
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, head.code0.weight.shape[1], generator=g)
    code0 = torch.randint(0, 128, (n,), generator=g)
    for params in ([SamplingParams(temperature=0.0)] * n,
                   [SamplingParams(temperature=0.9), SamplingParams(temperature=0.0),
                    SamplingParams(temperature=0.7, top_k=5, top_p=0.8)]):
        def batch():
            return SamplingBatch(params=params,
                                 generators=[torch.Generator().manual_seed(7 + i) for i in range(n)])

        assert head.graphs is None                              # the CPU runs the plain path
        plain_codes, plain_rows = head(hidden, code0, batch())
        head.graphs = _Uncaptured()
        try:
            codes, rows = head(hidden, code0, batch())
            assert head.graphs.keys[0][0] == 4                  # 3 rows padded to the bucket of 4
        finally:
            head.graphs = None
        assert torch.equal(codes, plain_codes) and torch.equal(rows, plain_rows)
        assert codes.shape == (n, 3)
    greedy_row = head(hidden, code0, SamplingBatch(params=[SamplingParams(temperature=0.0)] * n,
                                                   generators=[None] * n))[0][1]
    assert torch.equal(plain_codes[1], greedy_row)             # a greedy row beside sampled ones stays greedy


def test_top_k_sampling_equals_the_whole_vocabulary_filter():
    """`pick` over each row's top-k logits only draws what the whole-vocabulary sort + filter draws
    for the same noise (per-row temperature, top-k, top-p; a row with top-k below the most)."""
    from omnistage.models.qwen3_tts.predictor import pick

    g = torch.Generator().manual_seed(3)
    logits = 3 * torch.randn(6, 300, generator=g)
    noise = torch.empty(6, 300).exponential_(generator=g)
    temp = torch.tensor([0.9, 0.7, 1.0, 1.3, 0.9, 0.5])
    top_k = torch.tensor([50, 50, 5, 50, 1, 20])
    top_p = torch.tensor([1.0, 0.8, 1.0, 0.5, 1.0, 0.95])
    whole = pick(logits, temp, top_k, top_p, noise)
    assert torch.equal(pick(logits, temp, top_k, top_p, noise, k_most=50), whole)
    assert whole[4] == logits[4].argmax()                       # top-k 1 is greedy


def test_fused_kernels_path_equals_reference_in_the_triton_interpreter(tts_folders):
    """The frame function on `layers/fused.py`'s Triton kernels (the interpreter runs them on CPU
    tensors: the cache layout, strided q/k views and per-head norms reach the kernels as on CUDA)
    gives the codes of its PyTorch reference path (float32, sampled on the same draws)."""
    import os

    from interpreted import run_in_interpreter

    script = os.path.join(os.path.dirname(__file__), "predictor_triton.py")
    out = run_in_interpreter(script, tts_folders["custom_voice"], HF_HUB_OFFLINE="1")
    for mode, (equal, calls) in out.items():
        assert calls > 0 and equal, (mode, out)


SAMPLING_CHECK = """
import json, torch
from omnistage.layers.triton_sampling import pick_top_k_top_p
from omnistage.models.qwen3_tts.predictor import pick_ref
g = torch.Generator().manual_seed(0)
logits = torch.randn(8, 100, generator=g) * 3
temp = torch.tensor([0.9, 1.0, 0.5, 1.3, 0.9, 0.7, 1.0, 0.8])
top_k = torch.tensor([50, -1, 1, 5, 50, 64, 0, 20])
top_p = torch.tensor([1.0, 0.3, 1.0, 0.9, 0.5, 0.05, 0.8, 1.0])
noise = torch.empty(8, 100).exponential_(generator=g)
ref = pick_ref(logits, temp, top_k, top_p, noise)
got = pick_top_k_top_p(logits, temp, top_k, top_p, noise)
print(json.dumps([got.tolist(), ref.tolist()]))
"""


def test_sampling_kernel_equals_pick_in_the_triton_interpreter():
    """`layers/triton_sampling.py`'s one-program-per-row draw (top-k -1 / 0: all; top-p below 1 too)
    picks the ids of `pick_ref`'s whole-vocabulary reference for the same logits and noise."""
    from interpreted import run_in_interpreter

    got, ref = run_in_interpreter("-c", SAMPLING_CHECK)
    assert len(got) == 8 and got == ref
