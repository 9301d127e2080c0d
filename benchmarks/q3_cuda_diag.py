"""Where the tiny Qwen3-Omni's image + audio prompt parts from transformers on CUDA (diagnosis).

Greedy ids of the image + audio prompt (fp32): ours on the CPU, ours on CUDA alone / batched with a
text prompt / with CUDA graphs off / with fused kernels off, and transformers'
thinker on the CPU and on CUDA; then the prompt's feature shapes.

    PYTHONPATH=$PWD python benchmarks/q3_cuda_diag.py [--work /tmp/q3diag]
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/q3diag")
    args = ap.parse_args()
    from PIL import Image

    from omnistage import Omni, SamplingParams
    from omnistage.layers import fused
    from omnistage.models.qwen2_5_omni.processor import build_thinker_inputs
    from omnistage.testing.qwen3_omni import load_reference, make_tiny_qwen3_omni

    path = make_tiny_qwen3_omni(os.path.join(args.work, "tiny-qwen3_omni"))
    image = Image.fromarray((np.random.RandomState(0).rand(60, 90, 3) * 255).astype("uint8"))
    audio = (np.random.RandomState(1).randn(11025) * 0.1).astype("float32")
    text = [{"role": "user", "content": "What is the capital of France?"}]
    ia = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "audio", "audio": (audio, 22050)},
                                       {"type": "text", "text": "What is this?"}]}]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    runs = {}

    def ours(name, convs, **kw):
        try:
            with Omni(path, dtype="float32", **kw) as omni:
                outs = omni.chat(convs, params, use_tqdm=False)
            runs[name] = list(outs[-1].outputs[0].token_ids)
        except Exception as e:                  # a diagnosis goes on past a failing variant
            print(f"{name}: {type(e).__name__}: {e}")

    ours("cpu alone", [ia], device="cpu")
    ours("cuda alone", [ia], device="cuda")
    ours("cuda batched with text", [text, ia], device="cuda")
    ours("cuda graphs off", [ia], device="cuda", cuda_graphs=False)
    fused.ENABLED = False
    ours("cuda fused off, graphs off", [ia], device="cuda", cuda_graphs=False)
    fused.ENABLED = True
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(path)
    inputs = build_thinker_inputs(proc, ia)
    for dev in ("cpu", "cuda"):
        hf = load_reference(path).to(dev)
        feats = {k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in inputs.features.items()}
        with torch.no_grad():
            seq = hf.thinker.generate(input_ids=inputs.input_ids.to(dev), attention_mask=inputs.attention_mask.to(dev),
                                      **feats, max_new_tokens=24, min_new_tokens=24, do_sample=False)
        runs[f"transformers {dev}"] = seq[0, inputs.input_ids.shape[1]:].tolist()
        del hf
    base = runs["transformers cpu"]
    print("prompt tokens", inputs.input_ids.shape[1], "features", {k: tuple(v.shape) for k, v in inputs.features.items() if torch.is_tensor(v)})
    for name, ids in runs.items():
        print(f"{name:32s} first diff vs transformers cpu: {first_diff(ids, base)}  {ids[:12]}")


if __name__ == "__main__":
    main()
