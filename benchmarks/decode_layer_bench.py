"""The fused small-M decode kernels (layers/triton_decode.py) on one GPU: tiles, one decoder layer, errors.

    PYTHONPATH=$PWD python benchmarks/decode_layer_bench.py            # (ii) + (iii): the layer, fused vs unfused
    PYTHONPATH=$PWD python benchmarks/decode_layer_bench.py --sweep    # (i): tile sweep, prints `TILES = {...}`
        [--models 1.5B | 7B] [--layers qkv,o,gate_up,down] [--weights bf16,fp8] [--rows 1,2,4,8] [--budget 55]
        [--space small | narrow | wide]
    (each tile is a compile the first time, about a second: the default `small` space (<= 8 candidates per layer and M)
    sweeps one layer x one weight kind x M = 1, 2, 4, 8 in ~60 s, e.g. `--layers qkv --weights bf16`; `wide`
    tries ~10x more, so split its runs by --weights / --layers; Triton's cache makes a repeated run fast)

(i) For each decoder GEMV of the Qwen2.5-1.5B and -7B shapes with the fusions the layer runs (qkv: residual
    add + RMSNorm prologue, bias, rotary + KV write; o: residual epilogue; gate_up: RMSNorm prologue,
    SiLU*mul; down: residual),
    bf16 and FP8 weights, M = 1, 2, 4, 8: every candidate tile (BLOCK_N, BLOCK_K, SPLIT_K, dot, warps, stages)
    of `--space` timed in a CUDA graph (checked against `triton_decode.reference` first), the best beside the
    default tiles, cuBLAS (bf16 F.linear, the GEMV alone), the floor (weight bytes / copy bandwidth) and how
    many candidates the entry tried; then the best tiles as a Python dict to paste into
    layers/triton_decode_tiles.py. Stops at `--budget` seconds
    (what was swept so far still printed).
(ii) One Qwen2 decoder layer (random weights, 256-token contexts) in a CUDA graph, fused
    (`triton_decode.ENABLED`) vs unfused, M = 1, 2, 4, 8, bf16 and FP8, and x 28 layers.
(iii) The same layer's output (the residual stream after it), fused vs unfused: max abs error and the peak.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gemv_bench import copy_bandwidth, graph_us, rel_err  # noqa: E402

MODELS = {"1.5B": dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2),
          "7B": dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4)}
ROWS = (1, 2, 4, 8)
CONTEXT, BLOCK = 256, 16


def layer_model(shape: dict, fp8: bool):
    """A one-layer Qwen2 of `shape` on CUDA in bf16 (optionally FP8 linears) with its KV cache bound."""
    from transformers import Qwen2Config

    from omnistage.models.llama import Qwen2ForCausalLM
    from omnistage.testing.llm import draw_norms_and_biases

    cfg = Qwen2Config(**shape, num_hidden_layers=1, vocab_size=1024, max_position_embeddings=4096)
    with torch.device("cuda"):                  # weights drawn on the GPU (the 7B layer is 0.9 GB in float32)
        model = Qwen2ForCausalLM(cfg, 4096).to(torch.bfloat16).eval()
    draw_norms_and_biases(model, (0.8, 1.2), 0.02)
    if fp8:
        model.quantize_fp8()
    model.rotary.build(torch.device("cuda"))
    attn = model.layers[0].self_attn
    blocks = max(ROWS) * CONTEXT // BLOCK + 1
    attn.kv_cache = torch.randn(2, blocks, BLOCK, attn.num_kv_heads, attn.head_dim, device="cuda",
                                dtype=torch.bfloat16)
    return model


def decode_inputs(model, m: int):
    from omnistage.layers.attention import AttentionMetadata

    per = CONTEXT // BLOCK
    tables = torch.arange(m * per, device="cuda").view(m, per)
    ctx = torch.full((m,), CONTEXT, device="cuda")
    pos = ctx - 1
    slots = tables[:, -1] * BLOCK + pos % BLOCK
    meta = AttentionMetadata(slot_mapping=slots, num_decodes=m, decode_block_tables=tables, decode_ctx_lens=ctx)
    hidden = model.config.hidden_size
    x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
    return x, res, model.rotary.tables(pos), meta


def layer_table() -> None:
    from omnistage.layers import triton_decode

    print("| shape | weights | M | unfused layer us | fused layer us | speed-up | x 28 layers ms (fused) "
          "| max abs err fused vs unfused | peak |")
    print("|---|---|---|---|---|---|---|---|---|")
    torch.manual_seed(0)
    for name, shape in MODELS.items():
        for fp8 in (False, True):
            model = layer_model(shape, fp8)
            layer = model.layers[0]
            for m in ROWS:
                x, res, rope, meta = decode_inputs(model, m)
                times, outs = {}, {}
                for fused_on in (False, True):
                    triton_decode.ENABLED = fused_on
                    with torch.inference_mode():
                        out, r = layer(x, res, rope, meta)
                        outs[fused_on] = out if r is None else out + r
                        times[fused_on] = graph_us(lambda _: layer(x, res, rope, meta))
                triton_decode.ENABLED = True
                err = (outs[True].float() - outs[False].float()).abs().max().item()
                print(f"| {name} | {'fp8' if fp8 else 'bf16'} | {m} | {times[False]:.1f} | {times[True]:.1f} "
                      f"| {times[False] / times[True]:.2f}x | {28 * times[True] / 1e3:.3f} | {err:.2e} "
                      f"| {outs[False].float().abs().max().item():.2f} |", flush=True)
            del model
            torch.cuda.empty_cache()


def gemv_cases(shape: dict):
    """(layer name, weight rows N, K, decode_gemv keyword arguments but the weights) per decoder GEMV."""
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    qkv = h + 2 * shape["num_key_value_heads"] * (h // shape["num_attention_heads"])
    return [("qkv", qkv, h, dict(residual=True, norm=True, bias=True, rope=True)), ("o", h, h, dict(add=True)),
            ("gate_up", 2 * inter, h, dict(norm=True, gated=True)), ("down", h, inter, dict(add=True))]


# the "small" space: (BLOCK_N, K step in bytes of each weight row, use_dot, warps, stages). The tiles that won
# the session-7 sweep (benchmarks/RESULTS.md, 1.5B, bf16 and FP8), then CUDA-core tiles of 16-64 weight rows
# with K steps of 128-512 elements (M == 1) or 128 (M > 1), given in elements (scaled by the weight's bytes).
SMALL_M1_WON = [(4, 1024, False, 4, 2), (8, 1024, False, 4, 2), (8, 2048, False, 8, 2)]
SMALL_M1_CORE = [(16, 512, False, 4, 3), (32, 256, False, 4, 3), (64, 128, False, 8, 3)]
SMALL_MN_WON = [(16, 512, True, 4, 3), (32, 256, True, 4, 2)]
SMALL_MN_CORE = [(16, 128, False, 4, 3), (32, 128, False, 8, 3)]
SMALL_MAX = 8                # candidates per (layer, M): the first pass, then K-split neighbours of the fastest


def small_candidates(m: int, cols: int, k: int, weight_bytes: int, sms: int):
    """The "small" space's first pass: each tile once, at the K split `triton_decode.tiles`' rule would give
    it (the fewest power-of-two slices, each at least two K steps, that give every SM 4 programs). With M
    > 1 the `tl.dot` tiles (16 padded rows) are one compile for M = 2, 4 and 8."""
    from omnistage.layers.triton_decode import MAX_SPLIT

    won, core = (SMALL_M1_WON, SMALL_M1_CORE) if m == 1 else (SMALL_MN_WON, SMALL_MN_CORE)
    tiles = won + [(bn, bk * weight_bytes, dot, w, st) for bn, bk, dot, w, st in core]
    for bn, kbytes, dot, warps, stages in tiles:
        bk = kbytes // weight_bytes
        if bk > k:
            continue
        split = 1
        while split < MAX_SPLIT and -(-cols // bn) * split < 4 * sms and k >= 4 * split * bk:
            split *= 2
        yield bn, bk, split, dot, warps, stages


def split_neighbours(cfg: tuple, k: int):
    """The "small" space's second pass: one of the first pass's fastest tiles at half and at twice its K
    split (a runtime argument: no new compile)."""
    from omnistage.layers.triton_decode import MAX_SPLIT

    bn, bk, split, dot, warps, stages = cfg
    for s in (split // 2, split * 2):
        if 1 <= s <= MAX_SPLIT and k >= s * bk:
            yield bn, bk, s, dot, warps, stages


def candidates(m: int, k: int, weight_bytes: int, space: str):
    """(BLOCK_N, BLOCK_K, SPLIT_K, use_dot, num_warps, num_stages) to time ("narrow", "wide": every split
    of 1-16); each tile (all but SPLIT_K, a runtime argument) is a compile. "narrow": the session-7 set;
    "wide" adds CUDA-core tiles of 16-64 weight rows with short K steps and deep pipelines (M == 1) and
    CUDA-core tiles at M = 2..8."""
    if m == 1:      # (BLOCK_N, K step in bytes of each weight row, warps, stages)
        tiles = [(4, 1024, 4, 2), (8, 1024, 4, 2), (8, 2048, 8, 2), (16, 1024, 8, 2)]
        if space == "wide":
            tiles += [(bn, bk * weight_bytes, w, st) for bn, bk, w, st in
                      itertools.product((16, 32, 64), (64, 128, 256), (4, 8), (3, 4, 5))]
        dots = [False] * len(tiles)
    else:
        tiles = [(16, 256, 4, 2), (16, 512, 4, 3), (32, 256, 4, 2)]
        dots = [True] * len(tiles)
        if space == "wide":
            core = [(bn, bk * weight_bytes, w, st) for bn, bk, w, st in
                    itertools.product((8, 16, 32), (64, 128), (4, 8), (3, 4))]
            tiles, dots = tiles + core, dots + [False] * len(core)
    for ((bn, kbytes, warps, stages), dot), split in itertools.product(zip(tiles, dots), (1, 2, 4, 8, 16)):
        bk = kbytes // weight_bytes
        if bk <= k and k >= split * bk:
            yield bn, bk, split, dot, warps, stages


def sweep(models: list[str], rows: list[int], budget: float, layers: list[str], weights: list[str],
          space: str) -> None:
    from omnistage.layers import triton_decode
    from omnistage.layers.fp8_linear import quantize_rows

    start = time.time()
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bw / 1e9:.0f} GB/s\n")
    print(f"candidate space: {space}")
    print("| shape | layer (N x K) | weights | M | default us | best us | best tile | candidates tried "
          "| cuBLAS bf16 us | floor us | best % of floor |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    best_tiles: dict = {}
    torch.manual_seed(0)
    for name in models:
        for layer, n, k, flags in gemv_cases(MODELS[name]):
            if layer not in layers:
                continue
            w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
            for fp8 in [kind == "fp8" for kind in weights]:
                w, scale = quantize_rows(w16) if fp8 else (w16, None)
                for m in rows:
                    if time.time() - start > budget:
                        print(f"\n(budget of {budget:.0f} s spent: the rest not swept)")
                        return print_tiles(best_tiles)
                    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                    out_cols = n // 2 if flags.get("gated") else n
                    kw = dict(bias=torch.randn(n, device="cuda", dtype=torch.bfloat16) * 0.02 if flags.get("bias")
                              else None, residual=torch.randn_like(x) if flags.get("residual") else None,
                              norm_weight=torch.ones(k, device="cuda", dtype=torch.bfloat16) if flags.get("norm")
                              else None, gated=bool(flags.get("gated")),
                              add=torch.randn(m, out_cols, device="cuda", dtype=torch.bfloat16) if flags.get("add")
                              else None)
                    if flags.get("rope"):
                        kw["rope"] = sweep_rope(MODELS[name], m)
                    ref = first(triton_decode.reference(x, w, scale, **kw))
                    default = graph_us(lambda _: triton_decode.decode_gemv(x, w, scale, **kw))
                    two = bool(flags.get("gated") or flags.get("rope"))     # pairs of weight rows per column
                    pool = (small_candidates(m, n // 2 if two else n, k, w.element_size(), sms) if space == "small"
                            else candidates(m, k, w.element_size(), space))

                    def timer(cfg):
                        return time_tile(x, w, scale, kw, ref, cfg)

                    timed, tried = time_all(pool, timer, start + budget)
                    if space == "small":        # the fastest tiles again at their neighbouring K splits
                        top = [cfg for _, cfg in timed[:max(1, (SMALL_MAX - tried) // 2)]]
                        more, tried_more = time_all((c for cfg in top for c in split_neighbours(cfg, k)), timer,
                                                    start + budget)
                        timed, tried = sorted(timed + more), tried + tried_more
                    best = timed[0] if timed else (float("inf"), None)
                    cublas = graph_us(lambda _: F.linear(x, w16))
                    floor = n * k * w.element_size() / bw * 1e6
                    best_tiles[(m, n, k, w.element_size(), two)] = best[1]
                    print(f"| {name} | {layer} ({n} x {k}) | {'fp8' if fp8 else 'bf16'} | {m} | {default:.1f} "
                          f"| {best[0]:.1f} | {best[1]} | {tried} | {cublas:.1f} | {floor:.1f} "
                          f"| {100 * floor / best[0]:.0f}% |",
                          flush=True)
    print_tiles(best_tiles)


def time_all(cfgs, timer, deadline: float) -> tuple[list[tuple[float, tuple]], int]:
    """([(us, tile)] of the tiles of `cfgs` that ran, fastest first; how many were tried before `deadline`)."""
    timed, tried = [], 0
    for cfg in cfgs:
        if time.time() > deadline:
            break
        tried += 1
        t = timer(cfg)
        if t is not None:
            timed.append((t, cfg))
    return sorted(timed), tried


def time_tile(x, w, scale, kw: dict, ref: torch.Tensor, cfg: tuple):
    """GPU us of one `decode_gemv` call with tile `cfg` in a CUDA graph; None when its output is off `ref`
    or the compiler refuses the tile (registers, shared memory)."""
    from omnistage.layers import triton_decode

    try:
        if rel_err(first(triton_decode.decode_gemv(x, w, scale, **kw, config=cfg)), ref) > 2e-2:
            return None
        return graph_us(lambda _: triton_decode.decode_gemv(x, w, scale, **kw, config=cfg))
    except Exception:
        return None


def sweep_rope(shape: dict, m: int):
    """The qkv epilogue's inputs for M rows: rotary angles, a KV cache and distinct slots (Qwen2: no q/k norms)."""
    from omnistage.layers import triton_decode

    heads, kvh = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = shape["hidden_size"] // heads
    angle = torch.rand(m, d // 2, device="cuda") * 6
    cache = torch.zeros(2, m, BLOCK, kvh, d, device="cuda", dtype=torch.bfloat16)
    return triton_decode.Rope(torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1), heads, kvh, d,
                              cache, torch.arange(m, device="cuda") * BLOCK)


def first(out) -> torch.Tensor:
    """decode_gemv's main output as one tensor: drops h (with a residual), joins the rope epilogue's q, k, v."""
    if isinstance(out, tuple) and len(out) == 2:
        out = out[0]
    return torch.cat([t.reshape(t.shape[0], -1) for t in out], -1) if isinstance(out, tuple) else out


def print_tiles(best: dict) -> None:
    print("\nTILES = {")
    for key, cfg in best.items():
        if cfg is not None:
            print(f"    {key}: {cfg},")
    print("}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--models", default="1.5B", help="the sweep's shapes (the layer table runs both)")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--layers", default="qkv,o,gate_up,down", help="the sweep's GEMVs")
    parser.add_argument("--weights", default="bf16,fp8", help="the sweep's weight kinds")
    parser.add_argument("--space", choices=("small", "narrow", "wide"), default="small",
                        help="the sweep's candidate tiles (small: <= 8 per layer and M, ~60 s per layer x weight kind)")
    parser.add_argument("--budget", type=float, default=55.0)
    args = parser.parse_args()
    if args.sweep:
        sweep(args.models.split(","), [int(r) for r in args.rows.split(",")], args.budget, args.layers.split(","),
              args.weights.split(","), args.space)
    else:
        layer_table()


if __name__ == "__main__":
    main()
