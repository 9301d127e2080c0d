"""Start-up tile choice of the MoE decode kernels, timed on the device (stage process, CUDA only).

In: one decode call's own tensors (x [T, H], the router weight [E, H], w13 [E, 2I, H], w2 [E, H, I]).
Out: the `SmallTiles` that `triton_moe_small.routed_moe_small` launches with.

`tiles_for(...)` keeps one choice per (device, T bucket, top_k, H, I, E): T = 1, then powers of two (the
decode graphs' batch sizes 1, 2, 4, 8). The first call of a key outside CUDA-graph capture (the eager
warm-up steps the AR engine runs before capturing each batch size) times each kernel's candidates
(`triton_moe_tiles.candidates`: router, gate-up and down separately, each a few launches on the call's
own weights and random rows, with L2 flushed before each, CUDA events), keeps the fastest of each, logs the choice and
stores it in `CHOSEN` (the benchmarks print it). During capture, off CUDA, or with
OMNISTAGE_MOE_TUNE=0 it returns `triton_moe_tiles.small_tiles` (the measured table / rule) untimed.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import fields, replace

import torch

from omnistage.layers import triton_gemv, triton_moe_small
from omnistage.layers.triton_moe_tiles import SmallTiles, candidates, small_tiles

log = logging.getLogger(__name__)

ENABLED = os.environ.get("OMNISTAGE_MOE_TUNE", "1") == "1"
REPEATS = 10                                    # timed launches per candidate (after one untimed: the compile)
_HOLD_CYCLES = 1_000_000                        # ~0.5 ms of GPU clock, longer than a Triton launch's host cost
_FLUSH_BYTES = 96 << 20                         # written between launches: more than an H100 / H200 L2 (50 MB)

# (device, T bucket, top_k, hidden, moe_intermediate, experts) -> the tiles chosen in this process
CHOSEN: dict[tuple, SmallTiles] = {}
# the same key -> seconds the tuning of it took (compiles of new candidates included; the benchmarks print it)
SECONDS: dict[tuple, float] = {}
_flush: dict[torch.device, torch.Tensor] = {}


def bucket(t: int) -> int:
    """The T bucket of `t` rows: 1, 2, 4, 8, ... (the next power of two)."""
    return 1 << max(0, t - 1).bit_length()


def tiles_for(x: torch.Tensor, gate: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
              norm_topk_prob: bool) -> SmallTiles:
    """The tiles for this call (see the module docstring); times the candidates on its first eager call."""
    t, h = x.shape
    inter, e = w2.shape[2], gate.shape[0]
    key = (x.device, bucket(t), top_k, h, inter, e)
    hit = CHOSEN.get(key)
    if hit is not None:
        return hit
    base = small_tiles(t, top_k, h, inter, triton_gemv._num_sms(x.device))
    if not ENABLED or not x.is_cuda or torch.cuda.is_current_stream_capturing():
        return base
    start = time.perf_counter()
    try:
        chosen = _tune(x, gate, w13, w2, top_k, norm_topk_prob, base)
    except torch.cuda.OutOfMemoryError:         # no room for the flush buffer: keep the table's tiles, said
        _flush.clear()
        log.warning("MoE tile tuning skipped (out of GPU memory); tiles %s", base)
        chosen = base
    CHOSEN[key] = chosen
    SECONDS[key] = time.perf_counter() - start
    log.info("MoE decode tiles for T=%d (bucket %d), top_k %d, hidden %d, width %d, %d experts: %s (tuned in %.1f s)",
             t, key[1], top_k, h, inter, e, chosen, SECONDS[key])
    return chosen


def _time(fn, device: torch.device) -> float:
    """Median milliseconds of `fn()` over REPEATS launches, each after an L2 flush; inf if it cannot run."""
    if device not in _flush:
        _flush[device] = torch.empty(_FLUSH_BYTES, dtype=torch.uint8, device=device)
    try:
        fn()                                    # compiles
        times = []
        for _ in range(REPEATS):
            _flush[device].zero_()
            torch.cuda._sleep(_HOLD_CYCLES)     # the GPU waits while the host queues the launch: no launch gap timed
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    except Exception as err:                    # a tile the device cannot run (resources): never chosen
        log.debug("MoE tile candidate failed: %s", err)
        return float("inf")
    return sorted(times)[len(times) // 2]


def _best(tiles: list[SmallTiles], run, device: torch.device) -> SmallTiles:
    times = [_time(lambda c=c: run(c), device) for c in tiles]
    for c, ms in zip(tiles, times):             # the fields each candidate changes from the first (the base)
        log.debug("MoE tile candidate %s: %.1f us", {f.name: getattr(c, f.name) for f in fields(c)
                                                      if getattr(c, f.name) != getattr(tiles[0], f.name)}, ms * 1e3)
    return tiles[min(range(len(tiles)), key=times.__getitem__)]


def _fields(tiles: SmallTiles, prefix: str) -> dict:
    return {f.name: getattr(tiles, f.name) for f in fields(tiles) if f.name.startswith(prefix)}


def _tune(x, gate, w13, w2, top_k, norm, base: SmallTiles) -> SmallTiles:
    dev = x.device
    # random rows, not the call's: the graphs' warm-up steps run on zero rows, which route every token
    # to the same experts (a T > 1 step would then read each expert once instead of T times)
    x = torch.randn(x.shape, device=dev, dtype=torch.float32).to(x.dtype)
    route = _best(candidates(base, "route"), lambda c: triton_moe_small.small_route(x, gate, top_k, norm, c), dev)
    weights, ids = triton_moe_small.small_route(x, gate, top_k, norm, base)
    up = _best(candidates(base, "up"), lambda c: triton_moe_small.small_gate_up(x, w13, ids, c), dev)
    mid = triton_moe_small.small_gate_up(x, w13, ids, base)
    down = _best(candidates(base, "down"), lambda c: triton_moe_small.small_down(mid, w2, weights, ids, c), dev)
    torch.cuda.synchronize(dev)
    _flush.pop(dev, None)                       # back to the allocator: the graphs and the KV cache may want it
    return replace(base, **_fields(route, "route_"), **_fields(up, "up_"), **_fields(down, "down_"))
