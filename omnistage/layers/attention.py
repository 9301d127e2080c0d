"""Paged attention over the engine's KV cache (runs in the stage's process, CPU or CUDA).

The runner flattens one step's tokens as [decode tokens of D sequences | prefill chunks ...] and
describes them with `AttentionMetadata`. A decoder's attention hands its raw q, k, v rows to
`rope_attend`: (q / k norms) rotary and the KV-cache write (`fused.rotary_and_cache`), then `attend`:
decodes in one batched call over their gathered block tables, prefill chunks each against its own
context. The plain PyTorch path (SDPA, one call per prefill chunk) is the reference and the CPU path;
on CUDA the decodes run `triton_attention` and all prefill chunks one `triton_prefill` launch, whose
chunk tensors are built once per forward and kept on the metadata. A decode-only step on CUDA runs
the norms, rotary and KV write inside the decode kernel too (`triton_attention.rope_decode_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from omnistage.layers import fused, triton_attention, triton_prefill
from omnistage.layers.fused import write_kv


@dataclass
class PrefillChunk:
    q_start: int                                # first row of this chunk in the flattened tokens
    q_len: int                                  # tokens of the chunk
    ctx_len: int                                # context after the chunk (cached + chunk tokens)
    block_table: torch.Tensor                   # [num_blocks] long, the sequence's blocks


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor                  # [T] long: cache slot (block * block_size + offset) per token
    num_decodes: int = 0                        # the first D tokens are single-token decodes
    decode_block_tables: torch.Tensor | None = None  # [D, max_blocks] long, padded with 0
    decode_ctx_lens: torch.Tensor | None = None      # [D] long: context length including the new token
    prefills: list[PrefillChunk] = field(default_factory=list)
    graph_batch: int = 0                        # > 0: replay the CUDA graph captured for this batch size
    graph_tokens: int = 0                       # > 0: replay the prefill graph of this token bucket
    # `prefills` as the prefill kernel's tensors: made by the forward's first attention layer, reused by the rest
    # (a prefill graph hands its static plan: ar/prefill_graphs.py)
    prefill_plan: Optional[triton_prefill.PrefillPlan] = field(default=None, repr=False)

    def plan_prefills(self, block_m: int, device: torch.device) -> triton_prefill.PrefillPlan:
        if self.prefill_plan is None or self.prefill_plan.block_m != block_m:
            self.prefill_plan = triton_prefill.make_plan(self.prefills, block_m, device)
        return self.prefill_plan


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    """SDPA over [..., heads, len, dim] with fewer KV heads than query heads.

    On CPU, SDPA's `enable_gqa` with a mask falls back to a path ~40x slower than repeating the
    KV heads first, so the CPU path repeats them; CUDA kernels handle GQA natively."""
    if q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
    groups = q.shape[-3] // k.shape[-3]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    return F.scaled_dot_product_attention(q, k, v, **kw)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] (this step's, already rotated) -> out [T, H, D]."""
    write_kv(cache, k, v, meta.slot_mapping)
    return attend(q, k, v, cache, meta, scale)


def rope_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: torch.Tensor, meta: AttentionMetadata, scale: float, q_norm=None, k_norm=None) -> torch.Tensor:
    """This step's raw q [T, H, D], k and v [T, KVH, D] (views of the qkv output) and rotary rows cos, sin
    [T, D] -> optional per-head RMSNorm (`q_norm` / `k_norm` modules), rotary, k and v into their cache slots,
    attention -> [T, H, D]. One kernel pair on a decode-only step on CUDA (`decode_fuses`)."""
    if decode_fuses(q, cache, meta):
        return triton_attention.rope_decode_attention(q, k, v, cos, sin, cache, meta.slot_mapping,
                                                      meta.decode_block_tables, meta.decode_ctx_lens, scale,
                                                      q_norm, k_norm)
    q, k = fused.rotary_and_cache(q, k, v, cos, sin, cache, meta.slot_mapping, q_norm, k_norm)
    return attend(q, k, v, cache, meta, scale)


def decode_fuses(q: torch.Tensor, cache: Optional[torch.Tensor], meta: AttentionMetadata) -> bool:
    """Whether `rope_attend` runs in the decode kernel: every row a one-token decode, on CUDA with the kernels
    on, head_dim and block size as the decode kernel needs (`triton_attention.available`)."""
    return (cache is not None and meta.num_decodes == q.shape[0] > 0 and not meta.prefills
            and fused.use_triton(q) and triton_attention.available(q, cache))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
           meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention of this step's rows, whose k, v (rotated, [T, KVH, D]) are already in the cache -> [T, H, D]."""
    d = meta.num_decodes
    fast = fused.use_triton(q)
    if fast and d and not meta.prefills and triton_attention.available(q, cache):
        return triton_attention.paged_decode_attention(q, cache, meta.decode_block_tables, meta.decode_ctx_lens,
                                                       scale)
    out = torch.empty_like(q)
    block_size = cache.shape[2]
    if d and triton_attention.available(q, cache):
        out[:d] = triton_attention.paged_decode_attention(q[:d], cache, meta.decode_block_tables,
                                                          meta.decode_ctx_lens, scale)
    elif d:
        bt = meta.decode_block_tables                                  # [D, MB]
        kc = cache[0][bt].flatten(1, 2).transpose(1, 2)                # [D, KVH, MB*bs, Dh]
        vc = cache[1][bt].flatten(1, 2).transpose(1, 2)
        pos = torch.arange(bt.shape[1] * block_size, device=q.device)
        mask = (pos[None, :] < meta.decode_ctx_lens[:, None])[:, None, None, :]  # [D, 1, 1, L]
        # One query row per head: the query heads that share a KV head become that KV head's query
        # rows ([D, KVH, groups, Dh]), so the KV heads are never repeated (a copy of the whole context).
        kvh, dh = kc.shape[1], q.shape[-1]
        o = F.scaled_dot_product_attention(q[:d].reshape(d, kvh, -1, dh), kc, vc, attn_mask=mask, scale=scale)
        out[:d] = o.reshape(d, -1, dh)
    if meta.prefills and fast and triton_prefill.available(q):
        plan = meta.plan_prefills(triton_prefill.block_m(q.dtype), q.device)
        triton_prefill.prefill_attention(q, k, v, cache, plan, scale, out)
        return out
    for p in meta.prefills:
        qs = q[p.q_start:p.q_start + p.q_len].transpose(0, 1)          # [H, q, Dh]
        if p.ctx_len == p.q_len:                                       # no cached context: use fresh k, v
            kc = k[p.q_start:p.q_start + p.q_len].transpose(0, 1)
            vc = v[p.q_start:p.q_start + p.q_len].transpose(0, 1)
            o = _sdpa(qs, kc, vc, is_causal=True, scale=scale)
        else:
            kc = cache[0][p.block_table].flatten(0, 1)[:p.ctx_len].transpose(0, 1)
            vc = cache[1][p.block_table].flatten(0, 1)[:p.ctx_len].transpose(0, 1)
            qpos = torch.arange(p.ctx_len - p.q_len, p.ctx_len, device=q.device)
            kpos = torch.arange(p.ctx_len, device=q.device)
            mask = kpos[None, :] <= qpos[:, None]
            o = _sdpa(qs, kc, vc, attn_mask=mask, scale=scale)
        out[p.q_start:p.q_start + p.q_len] = o.transpose(0, 1)
    return out
