"""Start-up warm-up of an AR stage: what a first request would otherwise pay, done before the stage
reports ready (the stage's process, in `AREngine.__init__`, after the decode graphs are captured).

In: the engine's `ModelRunner` (its model, device, KV cache and tensor-parallel ranks), the most
tokens one step runs and the most sequences. Out: nothing but side effects, and a `WarmUp` record
the engine logs:

  * prefills of representative lengths (`prefill_lengths`), each `runner.profile_step`'s one-chunk
    step over dummy ids (every tensor-parallel rank runs it too). On CUDA a kernel meets a new
    launch-shape class the first time a step has a new kind of row count: Triton compiles a kernel
    anew for each combination of its constexprs (the grouped MoE's tile height follows the rows
    per expert; the decode-size MoE tiles are chosen per row count) and of its integer arguments'
    specialisation (== 1, divisible by 16), and row counts T and pairs T * top-k fall in these
    classes at odd, even and multiple-of-16 T;
  * eager decode steps (decode-only forwards outside the graphs) at power-of-two batch sizes and
    block-table widths `DECODE_WIDTHS`: the decode attention's split count is a constexpr set by both,
    and its table stride is an integer argument. A decode-only forward runs the decode kernel with the
    rotary folded in; a step mixing decodes with a prefill runs its other variant (q rotated first,
    `attention.attend`), so each shape also runs that once;
  * the model's `frame_head` (a multi-codebook talker's code predictor), called as the runner calls
    it after sampling (`ModelRunner._frames`), for one sampled and one greedy request's rows at every
    decode batch size the engine captured: its per-batch-size CUDA graphs are captured here instead
    of on a step of the first requests at that batch size;
  * on CUDA, the sampler's Triton kernels (`triton_sampling.warm_race`: the candidate race at each
    of its compile-time widths, and the full-row noise); their variants do not depend on the batch.

Steps after it find their kernels compiled and graphs captured. The KV cache rows the prefills
write (slot 0) belong to no request, the decodes write the scratch slot (as padded graph rows do);
the frame head keeps no state between calls. Under tensor parallelism only the prefills run (the
other ranks follow those through `RankGroup.profile`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from omnistage.ar.runner import profile_step, split_outputs
from omnistage.ar.sampler import SamplingBatch
from omnistage.layers import triton_sampling
from omnistage.layers.attention import AttentionMetadata, attend
from omnistage.params import SamplingParams

ENABLED = os.environ.get("OMNISTAGE_AR_WARMUP", "1") != "0"   # 0: skip it (to measure a cold first request)
DECODE_SIZES = 8                                # rows 1..8 each: decode-size MoE tiles are chosen per row count
CLASS_BASES = (16, 64, 256, 1024, 4096)         # around each: b, b + 1, b + 2 (multiple of 16, odd, even)
DECODE_WIDTHS = (1, 2, 3, 4, 8, 16, 17, 32, 33, 64, 65)   # block-table widths: each split count, both strides


@dataclass
class WarmUp:
    """What the warm-up ran, for the start-up log."""
    prefill_lengths: list[int]                  # the prefill lengths run, in tokens
    decodes: list[tuple[int, int]]              # (batch size, block-table width) of the eager decode steps run
    frame_sizes: list[int]                      # the batch sizes the frame head ran at ([] without one)
    seconds: float                              # wall time of the whole warm-up (device work waited for)


def prefill_lengths(max_tokens: int) -> list[int]:
    """The prefill lengths run for a step of at most `max_tokens` rows (see the module docstring)."""
    lengths = set(range(1, DECODE_SIZES + 1))
    lengths.update(b + i for b in CLASS_BASES for i in range(3))
    return sorted(n for n in lengths if n <= max_tokens)


def decode_shapes(decode_sizes: list[int], max_blocks: int) -> list[tuple[int, int]]:
    """(rows, table width) of the eager decode steps: the power-of-two sizes of `decode_sizes` and its
    largest, times the `DECODE_WIDTHS` up to `max_blocks`."""
    sizes = [b for b in decode_sizes if b & (b - 1) == 0 or b == decode_sizes[-1]]
    return [(b, w) for b in sizes for w in DECODE_WIDTHS if w <= max_blocks]


@torch.inference_mode()
def decode_step(model, rows: int, width: int, slot: int, device: torch.device) -> None:
    """One eager decode-only forward of `rows` rows at context 1 over [rows, width] block tables (block
    0), keys and values into cache slot `slot`, and the logits; then the decode attention of the first
    layer's shape as a mixed step runs it (reads the cache only)."""
    long = dict(dtype=torch.long, device=device)
    meta = AttentionMetadata(slot_mapping=torch.full((rows,), slot, **long), num_decodes=rows,
                             decode_block_tables=torch.zeros(rows, width, **long),
                             decode_ctx_lens=torch.ones(rows, **long))
    out = model(torch.zeros(rows, **long), torch.zeros(rows, **long), meta)
    model.compute_logits(split_outputs(out)[0])
    attn = model.attention_layers[0]
    q = torch.zeros(rows, attn.num_heads, attn.head_dim, dtype=attn.kv_cache.dtype, device=device)
    kv = q[:, :attn.num_kv_heads]
    attend(q, kv, kv, attn.kv_cache, meta, attn.head_dim ** -0.5)


@torch.inference_mode()
def run_frame_head(head, hidden: int, dtype: torch.dtype, device: torch.device, sizes: list[int]) -> None:
    """`head(last hidden [S, H], code 0 [S], SamplingBatch)` for S in `sizes`, sampled and greedy rows."""
    kinds = (SamplingParams(temperature=1.0), SamplingParams(temperature=0.0))
    for s in sizes:
        last = torch.zeros(s, hidden, dtype=dtype, device=device)
        code0 = torch.zeros(s, dtype=torch.long, device=device)
        for p in kinds:
            head(last, code0, SamplingBatch(params=[p] * s, generators=[None] * s))


def warm_up(runner, max_tokens: int, max_seqs: int, decode_sizes: list[int], max_blocks: int) -> WarmUp:
    """Runs the warm-up on `runner` (its KV cache allocated): prefills up to `max_tokens` rows (logits
    for at most `max_seqs`), eager decodes and the frame head at `decode_sizes` (ascending; tables
    up to `max_blocks` wide)."""
    start = time.perf_counter()
    lengths = prefill_lengths(max_tokens)
    for n in lengths:
        rows = min(n, max_seqs)
        if runner.ranks is not None:            # the other ranks run the same step (its collectives)
            runner.ranks.profile(n, rows)
        profile_step(runner.model, n, rows, runner.device)
    decodes = decode_shapes(decode_sizes, max_blocks) if runner.ranks is None else []
    for rows, width in decodes:
        decode_step(runner.model, rows, width, runner.scratch_slot, runner.device)
    head = getattr(runner.model, "frame_head", None)
    sizes = [s for s in decode_sizes if s <= max_seqs] if head is not None else []
    if sizes:
        weight = runner.model.embed_tokens.weight
        run_frame_head(head, weight.shape[1], weight.dtype, runner.device, sizes)
    if runner.device.type == "cuda":
        if triton_sampling.triton is not None:
            triton_sampling.warm_race(runner.device)   # the sampler's candidate race, each BLOCK
        torch.cuda.synchronize(runner.device)
    return WarmUp(lengths, decodes, sizes, time.perf_counter() - start)
