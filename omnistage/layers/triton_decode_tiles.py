"""Measured tiles of `triton_decode.decode_gemv` (data only; imported by triton_decode, any process).

`TILES`: (M, N, K, weight bytes, two rows per column: gated or rotary pairs) -> (BLOCK_N, BLOCK_K, SPLIT_K,
use_dot, num_warps, num_stages), from `benchmarks/decode_layer_bench.py --sweep --models 1.5B` on an H200
(session 7, run 2; benchmarks/RESULTS.md). Only the entries that beat `triton_decode.tiles`' rule; the
comments give that rule's time and the entry's (one call in a CUDA graph, with the layer's fusions).
The 7B shape is not swept yet (it runs the rule).
"""

TILES: dict[tuple[int, int, int, int, bool], tuple[int, int, int, bool, int, int]] = {
    (1, 2048, 1536, 2, True): (8, 1024, 1, False, 8, 2),   # 1.5B qkv bf16: 7.0 -> 6.5 us
    (2, 2048, 1536, 2, True): (16, 256, 2, True, 4, 3),   # 1.5B qkv bf16: 9.5 -> 8.9 us
    (4, 2048, 1536, 2, True): (16, 256, 2, True, 4, 3),   # 1.5B qkv bf16: 9.6 -> 9.0 us
    (8, 2048, 1536, 2, True): (16, 256, 2, True, 4, 3),   # 1.5B qkv bf16: 9.8 -> 9.1 us
    (1, 2048, 1536, 1, True): (4, 1024, 1, False, 4, 2),   # 1.5B qkv fp8: 5.8 -> 5.7 us
    (2, 2048, 1536, 1, True): (32, 256, 4, True, 4, 2),   # 1.5B qkv fp8: 18.8 -> 9.1 us
    (4, 2048, 1536, 1, True): (32, 256, 4, True, 4, 2),   # 1.5B qkv fp8: 19.0 -> 9.3 us
    (8, 2048, 1536, 1, True): (32, 256, 4, True, 4, 2),   # 1.5B qkv fp8: 19.2 -> 9.3 us
    (1, 1536, 1536, 2, False): (4, 512, 1, False, 4, 2),   # 1.5B o bf16: 4.4 -> 4.0 us
    (2, 1536, 1536, 2, False): (16, 256, 1, True, 4, 3),   # 1.5B o bf16: 5.8 -> 4.8 us
    (4, 1536, 1536, 2, False): (16, 256, 1, True, 4, 3),   # 1.5B o bf16: 5.9 -> 4.8 us
    (8, 1536, 1536, 2, False): (16, 256, 1, True, 4, 3),   # 1.5B o bf16: 5.9 -> 4.8 us
    (1, 1536, 1536, 1, False): (4, 1024, 1, False, 4, 2),   # 1.5B o fp8: 4.0 -> 3.6 us
    (2, 17920, 1536, 2, True): (32, 128, 2, True, 4, 2),   # 1.5B gate_up bf16: 35.5 -> 24.6 us
    (4, 17920, 1536, 2, True): (32, 128, 2, True, 4, 2),   # 1.5B gate_up bf16: 35.1 -> 24.6 us
    (8, 17920, 1536, 2, True): (32, 128, 2, True, 4, 2),   # 1.5B gate_up bf16: 35.2 -> 25.3 us
    (1, 17920, 1536, 1, True): (8, 1024, 1, False, 4, 2),   # 1.5B gate_up fp8: 20.5 -> 17.1 us
    (2, 17920, 1536, 1, True): (32, 256, 1, True, 4, 2),   # 1.5B gate_up fp8: 52.3 -> 19.8 us
    (4, 17920, 1536, 1, True): (32, 256, 1, True, 4, 2),   # 1.5B gate_up fp8: 52.9 -> 20.1 us
    (8, 17920, 1536, 1, True): (32, 256, 1, True, 4, 2),   # 1.5B gate_up fp8: 53.2 -> 20.2 us
    (2, 1536, 8960, 2, False): (32, 128, 8, True, 4, 2),   # 1.5B down bf16: 13.0 -> 9.4 us
    (4, 1536, 8960, 2, False): (32, 128, 8, True, 4, 2),   # 1.5B down bf16: 13.1 -> 9.6 us
    (8, 1536, 8960, 2, False): (32, 128, 8, True, 4, 2),   # 1.5B down bf16: 12.9 -> 9.6 us
    (1, 1536, 8960, 1, False): (8, 1024, 4, False, 4, 2),   # 1.5B down fp8: 9.6 -> 9.5 us
    (2, 1536, 8960, 1, False): (32, 256, 8, True, 4, 2),   # 1.5B down fp8: 15.9 -> 10.5 us
    (4, 1536, 8960, 1, False): (32, 256, 8, True, 4, 2),   # 1.5B down fp8: 15.9 -> 10.5 us
    (8, 1536, 8960, 1, False): (32, 256, 8, True, 4, 2),   # 1.5B down fp8: 15.6 -> 10.6 us
}
