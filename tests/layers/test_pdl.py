"""layers.pdl and the kernels that use it, through Triton's interpreter (CPU): the router's top-k by ranks
(`triton_moe_small._top_k`) equal, bit for bit, to the repeated-argmax formulation it replaced (kept here) and
to torch.topk where no probabilities tie; and the PDL-aware kernels (MoE block, paged decode attention and its
combine, RMSNorm) giving identical results with OMNISTAGE_PDL=1 and =0. The interpreter runs their PDL
branches (gdc_wait / gdc_launch_dependents are no-ops there), not PDL itself: that needs an sm_90 GPU
(benchmarks/moe_check_cuda.py --decode, decode_attn_bench.py and q3_thinker_bench.py time it)."""

import pytest
import torch

from interpreted import run_in_interpreter
from omnistage.layers import pdl

TOP_K = r"""
import json, torch, triton
import triton.language as tl
from omnistage.layers import triton_moe_small as tms


@triton.jit
def _top_k_old(z, es, ok, TOP_K: tl.constexpr, NORM: tl.constexpr, BLOCK_S: tl.constexpr):
    # `_top_k` as session 9 left it: TOP_K sequential argmax reductions
    z = tl.where(ok, z, -float("inf"))
    e = tl.exp(z - tl.max(z, axis=0))
    p = tl.where(ok, e / tl.sum(e, axis=0), -1.0)
    slots = tl.arange(0, BLOCK_S)
    weights = tl.zeros((BLOCK_S,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_S,), dtype=tl.int32)
    for slot in tl.static_range(TOP_K):
        best = tl.argmax(p, axis=0, tie_break_left=True)
        weights = tl.where(slots == slot, tl.max(p, axis=0), weights)
        ids = tl.where(slots == slot, best.to(tl.int32), ids)
        p = tl.where(es == best, -2.0, p)
    if NORM:
        weights = weights / tl.sum(weights, axis=0)
    return weights, ids


@triton.jit
def _rows(logits_ptr, w_ptr, ids_ptr, num_experts, OLD: tl.constexpr, TOP_K: tl.constexpr, NORM: tl.constexpr,
          BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0)
    es = tl.arange(0, BLOCK_E)
    ok = es < num_experts
    z = tl.load(logits_ptr + row * num_experts + es, mask=ok, other=0.0)
    if OLD:
        w, ids = _top_k_old(z, es, ok, TOP_K, NORM, BLOCK_S)
    else:
        w, ids = tms._top_k(z, es, ok, TOP_K, NORM, BLOCK_S)
    slots = tl.arange(0, BLOCK_S)                       # every slot, the zero ones past TOP_K too
    tl.store(w_ptr + row * BLOCK_S + slots, w)
    tl.store(ids_ptr + row * BLOCK_S + slots, ids)


def top_k(logits, k, norm, old):
    t, e = logits.shape
    bs = triton.next_power_of_2(k)
    w, ids = torch.empty(t, bs), torch.empty(t, bs, dtype=torch.int32)
    _rows[(t,)](logits, w, ids, e, OLD=old, TOP_K=k, NORM=norm, BLOCK_E=triton.next_power_of_2(e), BLOCK_S=bs)
    return w, ids


g = torch.Generator().manual_seed(0)
cases = []
for e, k in [(128, 8), (6, 3), (60, 4), (5, 5), (128, 1), (3, 2)]:
    ties = torch.randint(-2, 3, (40, e), generator=g).float()           # few distinct values: many exact ties
    ties[0] = 0.0                                                       # every expert tied
    ties[1, :] = -5.0
    ties[1, -min(e, 2 * k):] = 1.0                                      # a tie across the k-th place, at the end
    rand = torch.randn(40, e, generator=g) * 3
    for name, logits in (("ties", ties), ("random", rand)):
        for norm in (True, False):
            w_old, i_old = top_k(logits, k, norm, True)
            w_new, i_new = top_k(logits, k, norm, False)
            w_route, i_route = tms.route(logits, k, norm)             # `_route_kernel`: the entry that uses it
            case = dict(e=e, k=k, name=name, norm=norm, same=torch.equal(w_old, w_new) and torch.equal(i_old, i_new),
                        route_same=torch.equal(w_route, w_new[:, :k]) and torch.equal(i_route, i_new[:, :k].long()))
            if name == "random":                                       # distinct probabilities: torch.topk's order
                p = torch.softmax(logits, -1)
                want_w, want_i = torch.topk(p, k, dim=-1)
                want_w = want_w / want_w.sum(-1, keepdim=True) if norm else want_w
                case.update(topk_ids=torch.equal(i_new[:, :k].long(), want_i),
                            topk_err=(w_new[:, :k] - want_w).abs().max().item())
            cases.append(case)
print(json.dumps(cases))
"""

PDL_ON_OFF = r"""
import hashlib, json, torch
from omnistage.layers import pdl, triton_attention, triton_fused, triton_moe_small as tms

g = torch.Generator().manual_seed(0)


def rnd(*shape, scale=1.0):
    return scale * torch.randn(*shape, generator=g)


def digest(*ts):
    h = hashlib.sha256()
    for t in ts:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


out = {"on": pdl.on(torch.zeros(1))}
x, r, w = rnd(3, 96), rnd(3, 96), 1 + rnd(96, scale=0.1)
out["rms_norm"] = digest(triton_fused.rms_norm(x, w, 1e-6), *triton_fused.rms_norm(x, w, 1e-6, r))
# the MoE block: router (+ residual add + RMSNorm), gate-up, down; split-K gate-up and down; a shared expert.
# The router over several K steps (`split`) and over all of H in one (the default tiles), with and without the norm
t, e, k, h, i = 2, 8, 2, 40, 24
x, res, nw, gate = rnd(t, h), rnd(t, h), 1 + rnd(h, scale=0.1), rnd(e, h, scale=0.3)
w13, w2 = rnd(e, 2 * i, h, scale=0.2), rnd(e, h, i, scale=0.2)
split = tms.SmallTiles(up_n=8, up_k=16, up_split=2, down_n=8, down_k=8, down_split=2, route_r=4, route_k=16)
shared = (rnd(t, h), rnd(t, 1))
out["moe"] = digest(*tms.routed_moe_small(x, gate, w13, w2, k, True, tiles=split, prenorm=(res, nw, 1e-6)),
                    *tms.routed_moe_small(x, gate, w13, w2, k, True, tiles=tms.SmallTiles(), prenorm=(res, nw, 1e-6)),
                    tms.routed_moe_small(x, gate, w13, w2, k, False, tiles=tms.SmallTiles(), shared=shared),
                    tms.routed_moe_small(x, gate, w13, w2, k, False, tiles=split))
# paged decode attention from raw qkv rows: a batch (contexts of one run: stored by the decode program, the combine
# program returns at once) and a lone row (its context over several splits: the combine launch merges them)
hq, kvh, d, bs, nb, width = 4, 2, 32, 16, 24, 6
q, kn, vn = rnd(3, hq, d), rnd(3, kvh, d), rnd(3, kvh, d)
ang = 10 * rnd(3, d // 2)
cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
ctx = torch.tensor([3, bs + 1, 5 * bs + 7])
tables = torch.randperm(nb, generator=g)[:3 * width].view(3, width)
slots = tables[torch.arange(3), (ctx - 1) // bs] * bs + (ctx - 1) % bs
cache = rnd(2, nb, bs, kvh, d)
got = []
for rows, min_run in ((slice(0, 3), 2), (slice(2, 3), 1)):
    c = cache.clone()
    got += [triton_attention.rope_decode_attention(q[rows], kn[rows], vn[rows], cos[rows], sin[rows], c, slots[rows],
                                                   tables[rows], ctx[rows], d ** -0.5, min_run=min_run), c]
    got.append(triton_attention.paged_decode_attention(q[rows], c, tables[rows], ctx[rows], d ** -0.5, min_run))
out["attention"] = digest(*got)
print(json.dumps(out))
"""


def test_top_k_by_ranks_equals_repeated_argmax_in_the_interpreter():
    """Expert ids and weights identical bit for bit to the old formulation at every slot (ties to the lower
    index, the zero slots past k), through `_route_kernel` too; random logits: torch.topk's experts."""
    cases = run_in_interpreter("-c", TOP_K)
    assert len(cases) == 24
    for case in cases:
        assert case["same"] and case["route_same"], case
        if case["name"] == "random":
            assert case["topk_ids"] and case["topk_err"] <= 1e-6, case


def test_kernels_give_the_same_results_with_pdl_on_and_off_in_the_interpreter():
    on = run_in_interpreter("-c", PDL_ON_OFF, OMNISTAGE_PDL="1")
    off = run_in_interpreter("-c", PDL_ON_OFF, OMNISTAGE_PDL="0")
    assert on.pop("on") is True and off.pop("on") is False       # the PDL branches ran in the first run only
    assert on == off


def test_the_switch_takes_0_or_1_and_leaves_cpu_tensors_off_outside_the_interpreter():
    assert pdl._mode("1") and not pdl._mode("0")
    with pytest.raises(ValueError, match="OMNISTAGE_PDL must be 1"):
        pdl._mode("yes")
    assert pdl.launch(torch.zeros(1)) == {}               # CPU tensors: the kernels launch as without PDL
