"""Correctness of the AR fast paths at 7B scale on one GPU (issue #9's checks); prints a small table.

A Qwen2.5-7B-shaped decoder (hidden 3584, 28 layers, 28 q / 4 kv heads, intermediate 18944, vocab
152064) in bf16 with random weights drawn on the GPU: no checkpoint is written, the folder holds a
config.json and the in-code tokenizer only, and every engine draws the same weights from one seed.
One 128-token random prompt, 128 new tokens, greedy, eos ignored:

  1. bf16 ids, fast path (fused Triton kernels, CUDA graphs, async scheduling) == the eager reference
     path (`layers.fused.ENABLED = False`, no graphs); the first divergence if any, with the fast
     path's top-1 / top-2 log-prob gap there (a near tie is rounding, a wide gap a bug), and the
     largest log-prob difference before it.
  2. quantization="fp8" (fast path) against bf16 over the same 128 positions: teacher-forced along
     the bf16 fast path's ids (one request per position, prompt + the first j ids, the prefix cache
     holding the rest, so every position after the first is a <= 16-row W8A16 step as in decode),
     on the bf16 top-20 tokens: max abs log-prob error (the logit error up to each row's log-sum-exp
     shift), relative error (RMS of the errors / RMS of the bf16 log-probs centred per position),
     how often FP8's top-1 is bf16's greedy token; and FP8's own greedy ids' first divergence from bf16's.

    PYTHONPATH=$PWD python benchmarks/ar_check_7b.py [--work /tmp/ar7b] [--tokens 128]
    (--smoke --device cpu: the same steps on a 2-layer model, to check the script itself)
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import time

import torch

QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, max_position_embeddings=4096, tie_word_embeddings=False,
                 rms_norm_eps=1e-6, rope_theta=1000000.0)
SMOKE = dict(QWEN25_7B, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=4096)   # --smoke: the script's logic on any device, in seconds
TOP = 20                                        # log-probs compared per position


def config_folder(path: str, shape: dict) -> str:
    from transformers import Qwen2Config

    from omnistage.testing.llm import make_tokenizer

    if not os.path.exists(os.path.join(path, "config.json")):
        os.makedirs(path, exist_ok=True)
        Qwen2Config(**shape, architectures=["Qwen2ForCausalLM"], dtype="bfloat16").save_pretrained(path)
        make_tokenizer(path)
    return path


def random_loader(model_dir, device, dtype, max_positions):
    """`ar.engine.ModelLoader`: the native Qwen2 decoder with weights drawn on the device from seed 0
    (`models/dummy.init_dummy_`: matrices N(0, 0.02), biases 0, norm weights 1)."""
    from transformers import AutoConfig, AutoTokenizer

    from omnistage.models.dummy import init_dummy_
    from omnistage.models.llama import Qwen2ForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config, min(max_positions or 4096, 4096))
    model = model.to_empty(device=device).to(dtype=dtype)
    init_dummy_(model)                          # load_format="dummy"'s draws: N(0, 0.02), norms 1
    model.rotary.build(device)
    return model.eval(), config, AutoTokenizer.from_pretrained(model_dir), frozenset()


def on_engine(path: str, device: str, fused_on: bool, graphs: bool, work, quantization=None):
    """work(engine) on a fresh engine, which is released before this returns (one 7B model at a time)."""
    from omnistage.ar.engine import AREngine
    from omnistage.config import EngineConfig
    from omnistage.layers import fused

    fused.ENABLED = fused_on                    # read at capture and at every call
    engine = AREngine(path, EngineConfig(device=device, dtype="bfloat16", max_num_seqs=4, max_model_len=1024,
                                         num_kv_blocks=512, cuda_graphs=graphs, quantization=quantization),
                      loader=random_loader)
    try:
        return work(engine)
    finally:
        engine.close()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        fused.ENABLED = True


def generate(engine, prompt: list[int], new: int, logprobs=None, tag: str = "r") -> tuple[list[int], list]:
    from omnistage.params import SamplingParams

    engine.add_request(tag, {"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, logprobs=logprobs))
    out = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out = o.output.outputs[0]
    return out.token_ids, (out.logprobs or [])


def teacher_forced(engine, prompt: list[int], ids: list[int]) -> list:
    """Position j's top-TOP log-probs given prompt + ids[:j], one request after the other."""
    return [generate(engine, prompt + ids[:j], 1, TOP, tag=f"tf{j}")[1][0] for j in range(len(ids))]


def first_divergence(a: list[int], b: list[int]):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def lp_errors(ref: list, other: list) -> tuple[float, float, int]:
    """(max abs, relative, entries compared) log-prob error on ref's top tokens that `other` also lists;
    relative = RMS of the errors / RMS of ref's log-probs centred per position (log V taken out, so a
    flat random-weight distribution does not make it look small)."""
    diffs, centred = [], []
    for r, o in zip(ref, other):
        theirs = {c.token_id: c.logprob for c in o.top}
        mean = sum(c.logprob for c in r.top) / max(len(r.top), 1)
        for c in r.top:
            if c.token_id in theirs:
                diffs.append(theirs[c.token_id] - c.logprob)
                centred.append(c.logprob - mean)
    if not diffs:
        return math.nan, math.nan, 0
    rel = math.sqrt(sum(d * d for d in diffs) / max(sum(c * c for c in centred), 1e-30))
    return max(abs(d) for d in diffs), rel, len(diffs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/ar7b")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="a 2-layer model instead of the 7B shape")
    args = ap.parse_args()
    t0 = time.perf_counter()
    shape = SMOKE if args.smoke else QWEN25_7B
    path = config_folder(os.path.join(args.work, "smoke" if args.smoke else "qwen2.5-7b-shape"), shape)
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(100, shape["vocab_size"] - 100, (128,), generator=g).tolist()
    n = args.tokens

    def fast(engine):
        generate(engine, prompt[:16], 4, tag="warm")                  # Triton compiles outside the comparison
        return generate(engine, prompt, n, tag="fast")[0], generate(engine, prompt, n, TOP, tag="fast-lp")

    def fp8(engine):
        generate(engine, prompt[:16], 4, tag="warm")
        return generate(engine, prompt, n, tag="fp8")[0], teacher_forced(engine, prompt, fast_ids)

    fast_ids, (fast_ids_lp, fast_lp) = on_engine(path, args.device, True, True, fast)
    eager_ids, eager_lp = on_engine(path, args.device, False, False, lambda e: generate(e, prompt, n, TOP, tag="eager"))
    fp8_ids, fp8_lp = on_engine(path, args.device, True, True, fp8, quantization="fp8")

    div = first_divergence(fast_ids, eager_ids)
    upto = n if div is None else div
    before = lp_errors(fast_lp[:upto], eager_lp[:upto])
    gap = "-"
    if div is not None and len(fast_lp[div].top) > 1:
        gap = f"{fast_lp[div].top[0].logprob - fast_lp[div].top[1].logprob:.4f}"
    fp8_abs, fp8_rel, compared = lp_errors(fast_lp, fp8_lp)
    top1 = sum(lp.top[0].token_id == t for lp, t in zip(fp8_lp, fast_ids))
    fp8_div = first_divergence(fast_ids, fp8_ids)

    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    print(f"\n{gpu}, torch {torch.__version__}, {'smoke' if args.smoke else 'Qwen2.5-7B'} shape, random bf16, "
          f"{n} greedy tokens after a 128-token prompt ({time.perf_counter() - t0:.0f} s)\n")
    print("| check | result |")
    print("|---|---|")
    same = "equal" if fast_ids == fast_ids_lp else "differ"
    print(f"| bf16 fast path ids with / without logprobs requested | {same} |")
    print(f"| bf16 fast (fused, graphs) == eager reference (unfused, no graphs), {n} ids | "
          f"{'equal' if div is None else f'first divergence at token {div}'} |")
    print(f"| fast path's top-1 - top-2 log-prob gap at that token | {gap} |")
    print(f"| max abs log-prob diff fast vs eager over the {upto} tokens before it (top-{TOP}) | {before[0]:.4f} |")
    print(f"| fp8 vs bf16, teacher-forced {n} positions, top-{TOP}: max abs log-prob error | {fp8_abs:.4f} |")
    print(f"| fp8 vs bf16: relative error (RMS error / RMS of centred log-probs, {compared} entries) | {fp8_rel:.4f} |")
    print(f"| fp8 top-1 == bf16 greedy token | {top1} / {n} |")
    fp8_same = "equal" if fp8_div is None else f"first divergence at token {fp8_div}"
    print(f"| fp8 greedy ids vs bf16 greedy ids | {fp8_same} |")


if __name__ == "__main__":
    main()
