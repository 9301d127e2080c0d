"""Small-M linear layers on one GPU: the Triton GEMV (layers/triton_gemv.py) vs cuBLAS vs the floor.

For each decoder linear of the Qwen2.5-1.5B and Qwen2.5-7B shapes (qkv, o, gate_up, down) and M = 1,
4, 16 rows it prints the GPU time of one call (20 calls captured in a CUDA graph, replayed, so launch
cost is out, as in the engine's decode graphs):
  - fp8 gemv: W8A16, FP8 weight + per-row scale (what `quantization="fp8"` runs at <= 16 rows)
  - fp8 _scaled_mm: W8A8 as above 16 rows (activations quantized per token, M padded to 16)
  - bf16 gemv: the same kernel on bf16 weights (not used by the engine unless it beats cuBLAS here)
  - bf16 cuBLAS: F.linear (what bf16 runs)
  - floors: weight bytes / measured copy bandwidth, FP8 and bf16
and the kernels' max error against their PyTorch references (relative to the largest output).

    PYTHONPATH=$PWD python benchmarks/gemv_bench.py [--sweep]   # --sweep: FP8 tile sweep at M = 1, 1.5B shapes
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SHAPES = {"1.5B": {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960)},
          "7B": {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}}
ROWS = (1, 4, 16)
CALLS = 20


def copy_bandwidth() -> float:
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (start.elapsed_time(end) / 1e3)


def graph_us(launch, calls: int = CALLS, trials: int = 1, replays: int = 10) -> float:
    """GPU microseconds per call of `launch(i)` for i < calls, all captured in one CUDA graph: each call
    run once first (on a side stream, as capture wants: compiles, autotuning, and no host sync left for
    the capture), the graph replayed 3 times, then `trials` timings of `replays` replays, the median."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):
            launch(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            launch(i)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * calls))
    return sorted(times)[len(times) // 2]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def main() -> None:
    from omnistage.layers import triton_gemv
    from omnistage.layers.fp8_linear import Fp8Linear

    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bw / 1e9:.0f} GB/s\n")
    print("| shape | layer (N x K) | M | fp8 gemv us | fp8 _scaled_mm us | bf16 gemv us | bf16 cuBLAS us "
          "| floor fp8 / bf16 us | fp8 gemv % of floor | err fp8 / bf16 gemv |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    torch.manual_seed(0)
    for model, layers in SHAPES.items():
        for name, (n, k) in layers.items():
            lin = torch.nn.Linear(k, n, bias=name == "qkv", device="cuda", dtype=torch.bfloat16)
            fp8 = Fp8Linear.from_linear(lin)
            w, b = lin.weight.detach(), None if lin.bias is None else lin.bias.detach()
            for m in ROWS:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                x16 = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
                g8 = triton_gemv.gemv(x, fp8.weight_fp8, fp8.weight_scale, fp8.bias)
                e8 = rel_err(g8, triton_gemv.reference(x, fp8.weight_fp8, fp8.weight_scale, fp8.bias))
                e16 = rel_err(triton_gemv.gemv(x, w, None, b), triton_gemv.reference(x, w, None, b))
                t8 = graph_us(lambda _: triton_gemv.gemv(x, fp8.weight_fp8, fp8.weight_scale, fp8.bias))
                tsm = graph_us(lambda _: fp8.scaled_mm(*triton_gemv.quantize_rows(x16), torch.bfloat16))   # W8A8
                t16 = graph_us(lambda _: triton_gemv.gemv(x, w, None, b))
                tcb = graph_us(lambda _: F.linear(x, w, b))
                f8, f16 = n * k / bw * 1e6, 2 * n * k / bw * 1e6
                print(f"| {model} | {name} ({n} x {k}) | {m} | {t8:.1f} | {tsm:.1f} | {t16:.1f} | {tcb:.1f} "
                      f"| {f8:.1f} / {f16:.1f} | {100 * f8 / t8:.0f}% | {e8:.1e} / {e16:.1e} |")
    print("\nfp8 _scaled_mm is timed at 16 rows whatever M (it needs M padded to 16); activation quantization "
          "included.")


def sweep() -> None:
    """Tile sweep of the FP8 GEMV at M = 1 (bs1 decode) on the first shape set: per layer the fastest (BLOCK_N, BLOCK_K,
    num_warps, num_stages) and its time beside the default tiles' and the floor."""
    import itertools

    from omnistage.layers import triton_gemv
    from omnistage.layers.fp8_linear import Fp8Linear

    bw = copy_bandwidth()
    print("| shape | layer | M | default us | best us | best (BLOCK_N, BLOCK_K, warps, stages) | floor us |")
    print("|---|---|---|---|---|---|---|")
    torch.manual_seed(0)
    for model, layers in list(SHAPES.items())[:1]:        # the ar_bench model's shapes
        for name, (n, k) in layers.items():
            fp8 = Fp8Linear.from_linear(torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16))
            for m in (1,):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = triton_gemv.reference(x, fp8.weight_fp8, fp8.weight_scale)
                default = graph_us(lambda _: triton_gemv.gemv(x, fp8.weight_fp8, fp8.weight_scale))
                best = (float("inf"), None)
                grid = itertools.product((4, 8, 16, 32) if m == 1 else (16, 32, 64), (256, 512, 1024) if m == 1
                                         else (128, 256), (4, 8), (2, 4))
                for cfg in grid:
                    try:
                        out = triton_gemv.gemv(x, fp8.weight_fp8, fp8.weight_scale, config=cfg)
                        if rel_err(out, ref) > 1e-2:
                            continue
                        t = graph_us(lambda _: triton_gemv.gemv(x, fp8.weight_fp8, fp8.weight_scale, config=cfg))
                    except Exception:                   # a tile the compiler refuses (registers, shared memory)
                        continue
                    best = min(best, (t, cfg))
                print(f"| {model} | {name} ({n} x {k}) | {m} | {default:.1f} | {best[0]:.1f} | {best[1]} | "
                      f"{n * k / bw * 1e6:.1f} |", flush=True)


if __name__ == "__main__":
    import sys

    sweep() if "--sweep" in sys.argv else main()
