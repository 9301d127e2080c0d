"""Measured tiles of `triton_decode.decode_gemv` and whether they beat the unfused path (data only; imported by
triton_decode, any process).

`TILES`: (M, N, K, weight bytes, fusion) -> `Tile`. `fusion` names what rides in the launch
(`triton_decode.fusion`: "norm" = the residual add + RMSNorm prologue, "bias", "gated" = SiLU*mul, "add" =
the residual-add epilogue; "" = the GEMV alone). With `OMNISTAGE_DECODE_KERNELS` unset a decoder linear runs
the Triton kernel only where its entry has `us` below `unfused_us` (cuBLAS plus the launches the fusion
replaces, same run); entries without `unfused_us` only give tiles (for `OMNISTAGE_DECODE_KERNELS=1`).

Session 9, run 4 (`--sweep --models q3 --layers qkv|o --weights bf16`, H200, torch 2.11; benchmarks/RESULTS.md):
the Qwen3-Omni thinker's qkv (residual add + RMSNorm prologue) and o (alone). Only o at M = 2 and 4 beats the
unfused path (by ~0.4 us); at M = 1 (bs1 decode) neither does, so the thinker's bs1 step stays unfused.
Session 11, run 3 (`--sweep --models talker --rows 1,8 --weights bf16`): Qwen2.5-Omni's talker at M = 1 takes
qkv (with the norm prologue and bias: 4.7 vs 5.2 us) and o (3.4 vs 6.0) fused; its gate_up / down stay cuBLAS.
Session 7, run 2 (`--sweep --models 1.5B`): the 1.5B o, gate_up and down with the fusions of the layer then,
tiles only.
"""

from typing import NamedTuple, Optional


class Tile(NamedTuple):
    """One measured entry of `TILES`."""

    config: tuple[int, int, int, bool, int, int]  # (BLOCK_N, BLOCK_K, SPLIT_K, use_dot, num_warps, num_stages)
    us: float                                     # the Triton launch, us (one call in a CUDA graph, H200)
    unfused_us: Optional[float] = None            # cuBLAS + the launches the fusion replaces, us; None: not measured


TILES: dict[tuple[int, int, int, int, str], Tile] = {
    (1, 5120, 2048, 2, "norm"): Tile((8, 512, 1, False, 4, 2), 10.0, 7.9),    # q3 qkv bf16 (cuBLAS alone 6.5)
    (2, 5120, 2048, 2, "norm"): Tile((32, 128, 4, True, 4, 2), 15.6, 7.8),    # q3 qkv bf16 (cuBLAS alone 6.2)
    (4, 5120, 2048, 2, "norm"): Tile((32, 128, 4, True, 4, 2), 15.7, 7.5),    # q3 qkv bf16 (cuBLAS alone 6.0)
    (8, 5120, 2048, 2, "norm"): Tile((32, 128, 4, True, 4, 2), 16.0, 6.9),    # q3 qkv bf16 (cuBLAS alone 5.4)
    (1, 2048, 4096, 2, ""): Tile((16, 512, 4, False, 4, 3), 8.1, 7.7),        # q3 o bf16 (rule 8.4)
    (2, 2048, 4096, 2, ""): Tile((32, 128, 8, True, 4, 2), 6.9, 7.4),         # q3 o bf16 (rule 9.3): fused
    (4, 2048, 4096, 2, ""): Tile((32, 128, 8, True, 4, 2), 6.9, 7.2),         # q3 o bf16 (rule 9.3): fused
    (8, 2048, 4096, 2, ""): Tile((32, 128, 8, True, 4, 2), 7.0, 6.8),         # q3 o bf16 (rule 9.3)
    # Qwen2.5-Omni-7B's talker, session 11 run 3 (`--sweep --models talker --weights bf16 --rows 1,8`)
    (1, 2560, 896, 2, "norm+bias"): Tile((4, 512, 1, False, 4, 2), 4.7, 5.2),   # qkv (cuBLAS alone 3.6): fused
    (8, 2560, 896, 2, "norm+bias"): Tile((32, 128, 4, True, 4, 2), 8.0, 5.4),   # qkv
    (1, 896, 1536, 2, ""): Tile((8, 1024, 1, False, 8, 2), 3.4, 6.0),           # o (cuBLAS 6.0): fused
    (8, 896, 1536, 2, ""): Tile((16, 256, 1, True, 4, 3), 4.5, 4.3),            # o
    (1, 37888, 896, 2, "norm+gated"): Tile((32, 128, 1, True, 4, 2), 23.9, 23.3),   # gate_up (cuBLAS 19.4)
    (8, 37888, 896, 2, "norm+gated"): Tile((32, 128, 1, True, 4, 2), 25.0, 23.8),   # gate_up (cuBLAS 19.9)
    # down + add: 11.2 / 11.5 us vs cuBLAS 11.3 (the layer's add rides in the next norm): tiles only
    (1, 896, 18944, 2, "add"): Tile((32, 128, 16, True, 4, 2), 11.2),
    (8, 896, 18944, 2, "add"): Tile((32, 128, 16, True, 4, 2), 11.5),
    (1, 1536, 1536, 2, "add"): Tile((4, 512, 1, False, 4, 2), 4.0),    # 1.5B o bf16 (rule 4.4)
    (2, 1536, 1536, 2, "add"): Tile((16, 256, 1, True, 4, 3), 4.8),    # 1.5B o bf16 (rule 5.8)
    (4, 1536, 1536, 2, "add"): Tile((16, 256, 1, True, 4, 3), 4.8),    # 1.5B o bf16 (rule 5.9)
    (8, 1536, 1536, 2, "add"): Tile((16, 256, 1, True, 4, 3), 4.8),    # 1.5B o bf16 (rule 5.9)
    (1, 1536, 1536, 1, "add"): Tile((4, 1024, 1, False, 4, 2), 3.6),   # 1.5B o fp8 (rule 4.0)
    (2, 17920, 1536, 2, "norm+gated"): Tile((32, 128, 2, True, 4, 2), 24.6),   # 1.5B gate_up bf16 (rule 35.5)
    (4, 17920, 1536, 2, "norm+gated"): Tile((32, 128, 2, True, 4, 2), 24.6),   # 1.5B gate_up bf16 (rule 35.1)
    (8, 17920, 1536, 2, "norm+gated"): Tile((32, 128, 2, True, 4, 2), 25.3),   # 1.5B gate_up bf16 (rule 35.2)
    (1, 17920, 1536, 1, "norm+gated"): Tile((8, 1024, 1, False, 4, 2), 17.1),  # 1.5B gate_up fp8 (rule 20.5)
    (2, 17920, 1536, 1, "norm+gated"): Tile((32, 256, 1, True, 4, 2), 19.8),   # 1.5B gate_up fp8 (rule 52.3)
    (4, 17920, 1536, 1, "norm+gated"): Tile((32, 256, 1, True, 4, 2), 20.1),   # 1.5B gate_up fp8 (rule 52.9)
    (8, 17920, 1536, 1, "norm+gated"): Tile((32, 256, 1, True, 4, 2), 20.2),   # 1.5B gate_up fp8 (rule 53.2)
    (2, 1536, 8960, 2, "add"): Tile((32, 128, 8, True, 4, 2), 9.4),    # 1.5B down bf16 (rule 13.0)
    (4, 1536, 8960, 2, "add"): Tile((32, 128, 8, True, 4, 2), 9.6),    # 1.5B down bf16 (rule 13.1)
    (8, 1536, 8960, 2, "add"): Tile((32, 128, 8, True, 4, 2), 9.6),    # 1.5B down bf16 (rule 12.9)
    (1, 1536, 8960, 1, "add"): Tile((8, 1024, 4, False, 4, 2), 9.5),   # 1.5B down fp8 (rule 9.6)
    (2, 1536, 8960, 1, "add"): Tile((32, 256, 8, True, 4, 2), 10.5),   # 1.5B down fp8 (rule 15.9)
    (4, 1536, 8960, 1, "add"): Tile((32, 256, 8, True, 4, 2), 10.5),   # 1.5B down fp8 (rule 15.9)
    (8, 1536, 8960, 1, "add"): Tile((32, 256, 8, True, 4, 2), 10.6),   # 1.5B down fp8 (rule 15.6)
}
