"""The fused small-M decode kernels (layers/triton_decode.py) on one GPU: tiles, one decoder layer, errors.

    PYTHONPATH=$PWD python benchmarks/decode_layer_bench.py            # (ii) + (iii): the layer, fused vs unfused
        [--models 1.5B,7B | q3] [--weights bf16,fp8]
    PYTHONPATH=$PWD python benchmarks/decode_layer_bench.py --sweep    # (i): tile sweep, prints `TILES = {...}`
        [--models 1.5B | 7B | q3 | talker] [--layers qkv,o,gate_up,down] [--weights bf16,fp8] [--rows 1,2,4,8] [--budget 55]
        [--space small | narrow | wide]
    (each tile is a compile the first time, about a second: the default `small` space (<= 8 candidates per layer and M)
    sweeps one layer x one weight kind x M = 1, 2, 4, 8 in ~60 s, e.g. `--layers qkv --weights bf16`; `wide`
    tries ~10x more, so split its runs by --weights / --layers; Triton's cache makes a repeated run fast)
    The Qwen3-Omni thinker (q3, ~40 s each):
        --sweep --models q3 --layers qkv --weights bf16;  --sweep --models q3 --layers o --weights bf16
        --models q3 --weights bf16                         # its attention half, unfused / fused / by the table

(i) For each decoder GEMV of the Qwen2.5-1.5B and -7B shapes (q3: the thinker's qkv and o) with the fusions
    `models/llama.py`'s layers choose between (`gemv_cases`), bf16 and FP8 weights, M = 1, 2, 4, 8: every
    candidate tile (BLOCK_N, BLOCK_K, SPLIT_K, dot, warps, stages) of `--space` timed in a CUDA graph
    (checked against `triton_decode.reference` first), the best beside the default tiles, cuBLAS (bf16
    F.linear, the GEMV alone), the unfused path it replaces (`unfused_us`: cuBLAS + the norm / SiLU*mul /
    add launches), the floor (weight bytes / copy bandwidth) and how many candidates the entry tried; then
    the entries as `Tile(config, us, unfused_us)` lines to paste into layers/triton_decode_tiles.py (the
    table-driven choice runs the fused launch where us < unfused_us). Stops at `--budget` seconds (what was
    swept so far still printed).
(ii) One Qwen2 decoder layer (q3: the thinker's attention half, Qwen3 with q / k norms; random weights,
    256-token contexts) in a CUDA graph, unfused, all fused and by the table (`triton_decode.ENABLED` False,
    True, None), M = 1, 2, 4, 8, and x the model's layers.
(iii) The same output (the residual stream after it), fused vs unfused: max abs error and the peak.
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
          "7B": dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4),
          # Qwen3-Omni-30B-A3B's thinker: its attention half (the MoE half is triton_moe_small's); the dense
          # intermediate only sizes the stand-in MLP of the attention-half table
          "q3": dict(hidden_size=2048, intermediate_size=256, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128),
          # Qwen2.5-Omni-7B's talker (hidden 896, head_dim 128 with 12 / 4 heads)
          "talker": dict(hidden_size=896, intermediate_size=18944, num_attention_heads=12, num_key_value_heads=4,
                         head_dim=128)}
ROWS = (1, 2, 4, 8)
CONTEXT, BLOCK = 256, 16


def layer_model(name: str, fp8: bool):
    """A one-layer Qwen2 (q3: Qwen3, q / k norms, no biases) of `name`'s shape on CUDA in bf16 (optionally FP8
    linears) with its KV cache bound."""
    from transformers import Qwen2Config, Qwen3Config

    from omnistage.models.llama import Qwen2ForCausalLM, Qwen3ForCausalLM
    from omnistage.testing.llm import draw_norms_and_biases

    config, cls = (Qwen3Config, Qwen3ForCausalLM) if name == "q3" else (Qwen2Config, Qwen2ForCausalLM)
    cfg = config(**MODELS[name], num_hidden_layers=1, vocab_size=1024, max_position_embeddings=4096)
    with torch.device("cuda"):                  # weights drawn on the GPU (the 7B layer is 0.9 GB in float32)
        model = cls(cfg, 4096).to(torch.bfloat16).eval()
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


MODES = ((False, "unfused"), (True, "fused"), (None, "by the table"))     # triton_decode.ENABLED values


def layer_table(models: list[str], weights: list[str]) -> None:
    """One decoder layer (q3: the thinker's attention half, `Attention.forward_prenorm`: input norm + qkv,
    attention, o) in a CUDA graph with `triton_decode.ENABLED` False (unfused), True (every linear fused)
    and None (each linear as the tiles table says), M = 1, 2, 4, 8; x the model's layers; the error of the
    all-fused output against the unfused one."""
    from omnistage.layers import triton_decode

    print("| shape | part | weights | M | unfused us | fused us | by the table us | table speed-up "
          "| x layers ms (table) | max abs err fused vs unfused | peak |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    torch.manual_seed(0)
    for name in models:
        depth = {"1.5B": 28, "7B": 28, "q3": 48}[name]
        for fp8 in [kind == "fp8" for kind in weights]:
            model = layer_model(name, fp8)
            layer = model.layers[0]

            def run(x, res, rope, meta):
                if name == "q3":
                    o, h = layer.self_attn.forward_prenorm(x, res, layer.input_layernorm, rope, meta, layer)
                    return o + h, None
                return layer(x, res, rope, meta)

            for m in ROWS:
                x, res, rope, meta = decode_inputs(model, m)
                times, outs = {}, {}
                for mode, _ in MODES:
                    triton_decode.ENABLED = mode
                    with torch.inference_mode():
                        out, r = run(x, res, rope, meta)
                        outs[mode] = out if r is None else out + r
                        times[mode] = graph_us(lambda _: run(x, res, rope, meta))
                triton_decode.ENABLED = None
                err = (outs[True].float() - outs[False].float()).abs().max().item()
                print(f"| {name} | {'attention half' if name == 'q3' else 'layer'} | {'fp8' if fp8 else 'bf16'} "
                      f"| {m} | {times[False]:.1f} | {times[True]:.1f} | {times[None]:.1f} "
                      f"| {times[False] / times[None]:.2f}x | {depth * times[None] / 1e3:.3f} | {err:.2e} "
                      f"| {outs[False].float().abs().max().item():.2f} |", flush=True)
            del model
            torch.cuda.empty_cache()


def gemv_cases(name: str):
    """(layer name, weight rows N, K, decode_gemv keyword arguments but the weights) per decoder GEMV, with
    the fusions `models/llama.py`'s layers choose between (qkv: residual add + RMSNorm prologue, the bias of
    Qwen2; o alone; gate_up: residual add + RMSNorm prologue, SiLU*mul; down: residual add). q3: the
    thinker's attention half only, no biases."""
    shape = MODELS[name]
    h, inter, heads = shape["hidden_size"], shape["intermediate_size"], shape["num_attention_heads"]
    d = shape.get("head_dim", h // heads)
    qkv = (heads + 2 * shape["num_key_value_heads"]) * d
    cases = [("qkv", qkv, h, dict(residual=True, norm=True, bias=name != "q3")), ("o", h, heads * d, {})]
    if name != "q3":
        cases += [("gate_up", 2 * inter, h, dict(residual=True, norm=True, gated=True)),
                  ("down", h, inter, dict(add=True))]
    return cases


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
    > 1 the `tl.dot` tiles (16 padded rows) are one compile for M = 2, 4 and 8; M == 1 tries them too (session 9
    run 4: on the thinker's o they ran 6.9 us at M = 2, the CUDA-core tiles 8.1 at M = 1)."""
    from omnistage.layers.triton_decode import MAX_SPLIT

    won, core = (SMALL_M1_WON + SMALL_MN_WON, SMALL_M1_CORE) if m == 1 else (SMALL_MN_WON, SMALL_MN_CORE)
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
    print(f"candidate space: {space}; unfused = cuBLAS (FP8: Fp8Linear) + the launches the fusion replaces")
    print("| shape | layer (N x K) | fusion | weights | M | default us | best us | best tile | candidates tried "
          "| cuBLAS bf16 us | unfused us | floor us | best % of floor | fused wins |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    best_tiles: dict = {}
    torch.manual_seed(0)
    for name in models:
        for layer, n, k, flags in gemv_cases(name):
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
                    ref = first(triton_decode.reference(x, w, scale, **kw))
                    default = graph_us(lambda _: triton_decode.decode_gemv(x, w, scale, **kw))
                    two = bool(flags.get("gated"))      # pairs of weight rows per column
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
                    unfused = unfused_us(x, w16 if scale is None else None, w, scale, kw)
                    floor = n * k * w.element_size() / bw * 1e6
                    parts = triton_decode.fusion(kw["norm_weight"] is not None, kw["bias"] is not None, kw["gated"],
                                                 kw["add"] is not None)
                    best_tiles[(m, n, k, w.element_size(), parts)] = (best[1], best[0], unfused)
                    print(f"| {name} | {layer} ({n} x {k}) | {parts or '-'} | {'fp8' if fp8 else 'bf16'} | {m} "
                          f"| {default:.1f} | {best[0]:.1f} | {best[1]} | {tried} | {cublas:.1f} | {unfused:.1f} "
                          f"| {floor:.1f} | {100 * floor / best[0]:.0f}% | {'yes' if best[0] < unfused else 'no'} |",
                          flush=True)
    print_tiles(best_tiles)


def unfused_us(x, w16, w, scale, kw: dict) -> float:
    """GPU us of what the layer runs instead of one fused launch (in a CUDA graph): the input norm kernel
    (with the residual add) when the launch has the norm prologue, the linear (`nn.Linear`: cuBLAS; FP8:
    `Fp8Linear`), SiLU*mul when gated, the residual add when it has the add epilogue."""
    from torch import nn

    from omnistage.layers import fused
    from omnistage.layers.fp8_linear import Fp8Linear

    if w16 is not None:
        linear = nn.Linear(w.shape[1], w.shape[0], bias=kw["bias"] is not None, device="cuda", dtype=w.dtype)
        linear.weight.data = w16
        if kw["bias"] is not None:
            linear.bias.data = kw["bias"]
    else:
        linear = Fp8Linear(w, scale, kw["bias"])
    nw, res, add = kw["norm_weight"], kw["residual"], kw["add"]

    def run(_):
        xn = x if nw is None else fused.rms_norm(x, nw, 1e-6, res)
        y = linear(xn[0] if isinstance(xn, tuple) else xn)
        if kw["gated"]:
            y = fused.silu_and_mul(y)
        return y if add is None else y + add

    with torch.inference_mode():
        return graph_us(run)


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


def first(out) -> torch.Tensor:
    """decode_gemv's main output: without h (with a residual)."""
    return out[0] if isinstance(out, tuple) else out


def print_tiles(best: dict) -> None:
    """The swept entries as `triton_decode_tiles.TILES` lines (the Triton time and the unfused one beside)."""
    print("\nTILES = {")
    for key, (cfg, us, unfused) in best.items():
        if cfg is not None:
            print(f"    {key}: Tile({cfg}, {us:.1f}, {unfused:.1f}),")
    print("}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--models", default=None,
                        help="1.5B, 7B, q3 (the thinker's attention half), comma-separated; default: the sweep 1.5B, "
                             "the layer table 1.5B,7B")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--layers", default="qkv,o,gate_up,down", help="the sweep's GEMVs")
    parser.add_argument("--weights", default="bf16,fp8", help="weight kinds")
    parser.add_argument("--space", choices=("small", "narrow", "wide"), default="small",
                        help="the sweep's candidate tiles (small: <= 8 per layer and M, ~60 s per layer x weight kind)")
    parser.add_argument("--budget", type=float, default=55.0)
    args = parser.parse_args()
    if args.sweep:
        sweep((args.models or "1.5B").split(","), [int(r) for r in args.rows.split(",")], args.budget, args.layers.split(","),
              args.weights.split(","), args.space)
    else:
        layer_table((args.models or "1.5B,7B").split(","), args.weights.split(","))


if __name__ == "__main__":
    main()
