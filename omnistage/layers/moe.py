"""Sparse mixture-of-experts MLP: routing, the expert GEMMs, and the block the decoders use (stage process).

In: hidden rows x [T, H] of one engine step. Out: [T, H], the weighted sum of each row's top-k experts
(SiLU(gate) * up, then down), plus a sigmoid-gated shared expert where the model has one.

  route(router_logits [T, E], top_k, norm_topk_prob) -> (topk_weights fp32 [T, K], topk_ids int64 [T, K])
        softmax over all experts in float32, then the k largest (renormalised to sum 1 when asked),
        exactly as transformers' Qwen3-MoE / Qwen3-Omni routers do
  fused_moe(x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights, topk_ids) -> [T, H]
        on CUDA with Triton: `triton_moe.fused_moe` (rows sorted by expert, one grouped-GEMM launch for
        gate-up with SiLU * up fused, one for down with the routing weight; no host syncs, so CUDA
        graphs capture it), or at decode sizes (T*K <= `triton_moe_small.SMALL_PAIRS`) `fused_moe_small`
        (no sort: one GEMV program per pair, then one per token summing its K experts); the router is
        then one Triton launch too (`triton_moe_small.route`); elsewhere `fused_moe_ref`, the PyTorch
        reference: the rows sorted by expert and one matmul pair per expert that has rows
  routed_moe(x, gate [E, H], w13, w2, top_k, norm_topk_prob) -> [T, H]
        the router GEMM, `route` + `fused_moe`, what the block runs; at decode sizes on CUDA
        `triton_moe_small.routed_moe_small` (three launches: the router GEMV with softmax and top-k in its
        last program, gate-up, down) in tiles timed on the device at start-up (`moe_tune`); up to
        `triton_moe_small.ROUTER_ROWS` rows the router is that one launch before the sorted kernels too
  SparseMoeBlock(hidden, num_experts, top_k, moe_intermediate, norm_topk_prob, shared_expert_intermediate=0)
        the module; `load_weights` takes the checkpoint's names relative to the block
        (`experts.{e}.gate_proj|up_proj|down_proj.weight`, `gate.weight`, `shared_expert.*`,
        `shared_expert_gate.weight`) or transformers' fused in-memory ones (`experts.gate_up_proj`,
        `experts.down_proj`)

The reference rounds to the model dtype where transformers' block does (gate-up output, the product,
down output, then times the routing weight cast to the model dtype), so in float32 both agree to
rounding of sums. `fused.ENABLED` (OMNISTAGE_FUSED_KERNELS) switches the Triton path off too.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.layers import fused, moe_tune, triton_gemv, triton_moe, triton_moe_small
from omnistage.layers.triton_moe_tiles import small_tiles


def _triton(t: torch.Tensor) -> bool:
    """Whether `t`'s MoE work takes the Triton kernels (CUDA, fused kernels on, Triton installed)."""
    return fused.use_triton(t) and triton_moe.triton is not None


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights float32 [T, K], expert ids int64 [T, K]); see the module docstring."""
    if _triton(router_logits):
        return triton_moe_small.route(router_logits, top_k, norm_topk_prob)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] = [gate | up] per expert; w2 [E, H, I]; topk_* [T, K] -> [T, H]."""
    if _triton(x):
        if topk_ids.numel() <= triton_moe_small.SMALL_PAIRS:   # decode: one GEMV pair, no sort
            return triton_moe_small.fused_moe_small(x, w13, w2, topk_weights, topk_ids)
        return triton_moe.fused_moe(x, w13, w2, topk_weights, topk_ids)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)


def routed_moe(x: torch.Tensor, gate: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
               norm_topk_prob: bool, shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The router (x @ gate^T, gate [E, H]), `route`, then `fused_moe`, plus sigmoid(gate) * shared for
    `shared` = (a shared expert's output [T, H], its gate logits [T, 1]); at decode sizes on CUDA three
    launches (`triton_moe_small.routed_moe_small`: the router with its softmax and top-k, gate-up, down with the
    shared term) in the tiles `moe_tune` measured at start-up."""
    if _small_path(x, top_k):
        tiles = moe_tune.tiles_for(x, gate, w13, w2, top_k, norm_topk_prob)
        return triton_moe_small.routed_moe_small(x, gate, w13, w2, top_k, norm_topk_prob, tiles=tiles, shared=shared)
    if _triton(x) and x.shape[0] <= triton_moe_small.ROUTER_ROWS:
        # the router GEMV with its top-k (one launch, the gate weight re-read from L2 per row) beats
        # cuBLAS' GEMM + the route launch up to a few dozen rows
        tiles = small_tiles(x.shape[0], top_k, x.shape[1], w2.shape[2], triton_gemv._num_sms(x.device))
        weights, ids = triton_moe_small.small_route(x, gate, top_k, norm_topk_prob, tiles)
    else:
        weights, ids = route(F.linear(x, gate), top_k, norm_topk_prob)
    out = fused_moe(x, w13, w2, weights, ids)
    if shared is not None:
        out = out + torch.sigmoid(shared[1]) * shared[0]
    return out


def _small_path(x: torch.Tensor, top_k: int) -> bool:
    """Whether rows like `x` take the decode kernels (`triton_moe_small.routed_moe_small`)."""
    return _triton(x) and x.shape[0] * top_k <= triton_moe_small.SMALL_PAIRS


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """The PyTorch reference of `fused_moe`: (row, slot) pairs sorted by expert, one matmul pair per
    expert with rows, each pair's output times its weight added into its row."""
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    rows = order // k                                      # token of each sorted pair
    weights = topk_weights.reshape(-1)[order].to(x.dtype)
    out = torch.zeros_like(x)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        sel = slice(start, start + n)
        h = fused.silu_and_mul(F.linear(x[rows[sel]], w13[expert]))
        h = F.linear(h, w2[expert]) * weights[sel, None]
        out.index_add_(0, rows[sel], h)
        start += n
    return out


class SharedExpert(nn.Module):
    """The dense SiLU MLP every row also goes through (checkpoint names gate_proj / up_proj / down_proj)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.inter = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused.silu_and_mul(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ a sigmoid-gated shared expert when `shared_expert_intermediate` > 0)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, moe_intermediate: int, norm_topk_prob: bool,
                 shared_expert_intermediate: int = 0):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.inter = moe_intermediate
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * moe_intermediate, hidden))   # [gate | up] per expert
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, moe_intermediate))
        self.shared_expert = SharedExpert(hidden, shared_expert_intermediate) if shared_expert_intermediate else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared_expert_intermediate else None

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """(block(norm(x + residual)), x + residual), `norm` an RMSNorm (`weight`, `eps`): what a decoder
        layer's post-attention norm + MLP do. At decode sizes on CUDA without a shared expert the residual
        add and the norm run inside the router launch (`triton_moe_small.routed_moe_small(prenorm=)`)."""
        if self.shared_expert is None and _small_path(x, self.top_k):
            tiles = moe_tune.tiles_for(x, self.gate.weight, self.w13, self.w2, self.top_k, self.norm_topk_prob)
            return triton_moe_small.routed_moe_small(x, self.gate.weight, self.w13, self.w2, self.top_k,
                                                     self.norm_topk_prob, tiles=tiles,
                                                     prenorm=(residual, norm.weight, norm.eps))
        normed, h = norm(x, residual)
        return self(normed), h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        shared = None
        if self.shared_expert is not None:
            shared = (self.shared_expert(x), self.shared_expert_gate(x))
        return routed_moe(x, self.gate.weight, self.w13, self.w2, self.top_k, self.norm_topk_prob, shared)

    # ---- loading -------------------------------------------------------------------------------
    def expected_weights(self) -> set[str]:
        """The names `load_weights` must see once each (per-expert names for the routed experts)."""
        names = {"gate.weight"}
        names |= {f"experts.{e}.{p}.weight" for e in range(self.num_experts)
                  for p in ("gate_proj", "up_proj", "down_proj")}
        if self.shared_expert is not None:
            names |= {f"shared_expert.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
            names.add("shared_expert_gate.weight")
        return names

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies weights named relative to the block; returns the names of `expected_weights` it covered
        (a fused `experts.gate_up_proj` covers every expert's gate and up). Unknown names raise."""
        loaded: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights:
                loaded |= self._load_one(name, tensor)
        return loaded

    def _load_one(self, name: str, tensor: torch.Tensor) -> set[str]:
        parts = name.split(".")
        inter = self.inter
        if name == "gate.weight":
            self.gate.weight.copy_(tensor)
        elif name == "experts.gate_up_proj":
            self.w13.copy_(tensor)
            return {f"experts.{e}.{p}.weight" for e in range(self.num_experts) for p in ("gate_proj", "up_proj")}
        elif name == "experts.down_proj":
            self.w2.copy_(tensor)
            return {f"experts.{e}.down_proj.weight" for e in range(self.num_experts)}
        elif parts[0] == "experts" and len(parts) == 4 and parts[1].isdigit() and int(parts[1]) < self.num_experts:
            e, proj = int(parts[1]), parts[2]
            if proj == "gate_proj":
                self.w13[e, :inter].copy_(tensor)
            elif proj == "up_proj":
                self.w13[e, inter:].copy_(tensor)
            elif proj == "down_proj":
                self.w2[e].copy_(tensor)
            else:
                raise ValueError(f"unexpected MoE weight {name!r}")
        elif parts[0] == "shared_expert" and self.shared_expert is not None and len(parts) == 3:
            shared = self.shared_expert
            if parts[1] == "gate_proj":
                shared.gate_up_proj.weight[:shared.inter].copy_(tensor)
            elif parts[1] == "up_proj":
                shared.gate_up_proj.weight[shared.inter:].copy_(tensor)
            elif parts[1] == "down_proj":
                shared.down_proj.weight.copy_(tensor)
            else:
                raise ValueError(f"unexpected MoE weight {name!r}")
        elif name == "shared_expert_gate.weight" and self.shared_expert_gate is not None:
            self.shared_expert_gate.weight.copy_(tensor)
        else:
            raise ValueError(f"unexpected MoE weight {name!r}")
        return {name}
