"""Run as a script under TRITON_INTERPRET=1 (test_predictor.py): the tiny folder's code predictor with
`layers/fused.py`'s Triton kernels (on CPU tensors, in the interpreter) against its PyTorch
reference path, sampled on the same draws (a sampled frame also holds the greedy codes' work: the
kernels are the same). Prints one JSON line: {"sampled": [codes equal, rotary kernel calls]}."""

from __future__ import annotations

import json
import sys

import torch

from omnistage.ar.sampler import SamplingBatch
from omnistage.layers import fused, triton_fused
from omnistage.models.qwen3_tts.talker import load_talker
from omnistage.params import SamplingParams


def main(folder: str) -> None:
    head = load_talker(folder, torch.device("cpu"), torch.float32, 512)[0].frame_head
    n, g = 3, torch.Generator().manual_seed(0)
    hidden = torch.randn(n, head.code0.weight.shape[1], generator=g)
    code0 = torch.randint(0, 128, (n,), generator=g)
    calls = []
    rotary = triton_fused.rotary_and_cache
    triton_fused.rotary_and_cache = lambda *a, **k: (calls.append(1), rotary(*a, **k))[1]
    out = {}
    for mode, temp in (("sampled", 0.9),):
        def batch():
            return SamplingBatch(params=[SamplingParams(temperature=temp)] * n,
                                 generators=[torch.Generator().manual_seed(7 + i) for i in range(n)])
        ref, _ = head(hidden, code0, batch())
        calls.clear()
        fused.use_triton = lambda x: True
        try:
            got, _ = head(hidden, code0, batch())
        finally:
            fused.use_triton = lambda x: False
        out[mode] = [bool(torch.equal(got, ref)), len(calls)]
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
