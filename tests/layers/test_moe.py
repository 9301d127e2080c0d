"""layers.moe: routing as transformers routes, the PyTorch reference of the expert GEMMs equal to
transformers' Qwen3-Omni sparse MoE blocks (thinker: no shared expert; talker: sigmoid-gated shared
expert, no top-k renormalisation) on the same weights, loading from per-expert checkpoint names, and
the Triton fused MoE equal to the reference through Triton's interpreter (CPU)."""

import pytest
import torch

from interpreted import run_in_interpreter
from omnistage.layers import moe



def _hf_block(kind: str):
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as m
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeTalkerTextConfig, Qwen3OmniMoeTextConfig)

    shape = dict(hidden_size=48, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24)
    if kind == "thinker":
        cfg, cls = Qwen3OmniMoeTextConfig(norm_topk_prob=True, **shape), m.Qwen3OmniMoeThinkerTextSparseMoeBlock
    else:
        cfg, cls = Qwen3OmniMoeTalkerTextConfig(norm_topk_prob=False, **shape), m.Qwen3OmniMoeTalkerTextSparseMoeBlock
        cfg.shared_expert_intermediate_size = 40           # read by transformers, not declared
    torch.manual_seed(0)
    block = cls(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():                     # experts start empty and routers at zero
            p.normal_(0.0, 0.5)
    return cfg, block


def _per_expert(state: dict) -> list[tuple[str, torch.Tensor]]:
    """transformers' fused in-memory expert tensors as a checkpoint stores them: one per expert."""
    out = []
    for name, t in state.items():
        if name == "experts.gate_up_proj":
            for e, w in enumerate(t):
                gate, up = w.chunk(2, dim=0)
                out += [(f"experts.{e}.gate_proj.weight", gate), (f"experts.{e}.up_proj.weight", up)]
        elif name == "experts.down_proj":
            out += [(f"experts.{e}.down_proj.weight", w) for e, w in enumerate(t)]
        else:
            out.append((name, t))
    return out


def test_route_is_softmax_then_topk():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    w, ids = moe.route(logits, 2, norm_topk_prob=False)
    p = torch.softmax(logits, -1)
    assert ids.tolist() == [[1, 2]] and torch.allclose(w, p[:, [1, 2]]) and w.dtype == torch.float32
    w, _ = moe.route(logits, 2, norm_topk_prob=True)
    assert torch.allclose(w.sum(-1), torch.ones(1))


@pytest.mark.parametrize("kind", ["thinker", "talker"])
def test_sparse_moe_block_equals_transformers(kind):
    cfg, hf = _hf_block(kind)
    shared = 40 if kind == "talker" else 0
    ours = moe.SparseMoeBlock(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                              cfg.norm_topk_prob, shared)
    assert ours.load_weights(_per_expert(hf.state_dict())) == ours.expected_weights()
    x = torch.randn(3, 7, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(x)
        got = ours(x.view(-1, cfg.hidden_size)).view_as(want)
    assert torch.allclose(got, want, atol=1e-5 * want.abs().max().item()), (got - want).abs().max()


def test_load_weights_names_what_it_does_not_know():
    block = moe.SparseMoeBlock(8, 2, 1, 4, True)
    with pytest.raises(ValueError, match="experts.5.gate_proj"):
        block.load_weights([("experts.5.gate_proj.weight", torch.zeros(4, 8))])


CHECK = """
import json, torch
from omnistage.layers import fused, moe, triton_moe, triton_moe_small
torch.manual_seed(0)
grouped, grouped_tiles, small, routes, routers = [], [], [], [], []
# float16 for the 16-bit rounding path: the interpreter cannot do bfloat16 dots (see layers/kernel_check.py)
for t, e, k, h, i, bm, dt in [(5, 8, 2, 64, 32, 16, torch.float32), (23, 4, 3, 40, 24, 16, torch.float32),
                              (9, 8, 2, 64, 32, 16, torch.float16)]:
    x, w13, w2 = torch.randn(t, h).to(dt), (torch.randn(e, 2 * i, h) * 0.2).to(dt), (torch.randn(e, h, i) * 0.2).to(dt)
    w, ids = moe.route(torch.randn(t, e), k, True)
    ref = moe.fused_moe_ref(x, w13, w2, w, ids)
    grouped.append(((triton_moe.fused_moe(x, w13, w2, w, ids, block_m=bm).float() - ref.float()).abs().max().item(),
                    ref.float().abs().max().item(), str(dt)))
    # launch shapes other than the defaults (`SortedTiles`): K steps that leave H and I remainders, 8 warps
    tiles = triton_moe.SortedTiles(up_n=16, up_k=32, up_warps=8, up_stages=2, down_n=32, down_k=16, down_stages=4)
    grouped_tiles.append(((triton_moe.fused_moe(x, w13, w2, w, ids, block_m=bm, tiles=tiles).float()
                           - ref.float()).abs().max().item(), ref.float().abs().max().item(), str(dt)))
# the one-launch align (what fused_moe runs up to ALIGN_PAIRS pairs) against align's torch ops: 6 experts
# (not a power of two), blocks of 4, an expert run longer than a block, 128 experts of the thinker's prefill
aligns = []
for t, k, e, bm in [(9, 2, 6, 4), (23, 3, 4, 16), (128, 8, 128, 16)]:
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    aligns.append([torch.equal(a, b) for a, b in zip(triton_moe.align(ids, e, bm),
                                                      triton_moe.align_one_launch(ids, e, bm))])
# the decode path (no sort), the one-launch router and the router GEMV with its top-k; H and I not multiples
# of the tiles, 6 experts (not a multiple of route_r = 4)
for t, e, k, h, i, dt in [(1, 8, 2, 64, 32, torch.float32), (5, 6, 3, 40, 24, torch.float32),
                          (3, 8, 2, 64, 32, torch.float16)]:
    x, w13, w2 = torch.randn(t, h).to(dt), (torch.randn(e, 2 * i, h) * 0.2).to(dt), (torch.randn(e, h, i) * 0.2).to(dt)
    logits = torch.randn(t, e)
    for norm in (True, False):
        w, ids = moe.route(logits, k, norm)
        w_k, ids_k = triton_moe_small.route(logits, k, norm)
        routes.append((torch.equal(ids, ids_k), (w - w_k).abs().max().item()))
    ref = moe.fused_moe_ref(x, w13, w2, w, ids)
    # default tiles, then K steps that leave H and I remainders, narrow column tiles, unrolled K loops
    tiles_b = triton_moe_small.SmallTiles(up_n=8, up_k=32, up_unroll=2, down_n=4, down_k=16, down_unroll=2,
                                    route_r=4, route_k=16, route_warps=1)
    # split-K gate-up and down (H 40, I 24: short last slices)
    tiles_c = triton_moe_small.SmallTiles(up_n=8, up_k=16, up_split=2, down_n=8, down_k=8, down_split=2)
    for tiles in (None, tiles_b, tiles_c):
        got = triton_moe_small.fused_moe_small(x, w13, w2, w, ids, tiles=tiles)
        small.append(((got.float() - ref.float()).abs().max().item(), ref.float().abs().max().item(), str(dt)))
    # the block's path: router weight in (logits as nn.Linear stores them); the router's and the split
    # gate-up's tickets were used by the calls before (each launch resets its own)
    gate = (torch.randn(e, h) * 0.3).to(dt)
    w, ids = moe.route(torch.nn.functional.linear(x, gate), k, False)
    ref = moe.fused_moe_ref(x, w13, w2, w, ids)
    for tiles in (tiles_b, tiles_c):                                # tiles_c: the default router tiles
        w_k, ids_k = triton_moe_small.small_route(x, gate, k, False, tiles)
        routers.append((torch.equal(ids, ids_k), (w - w_k).abs().max().item(), str(dt)))
        got = triton_moe_small.routed_moe_small(x, gate, w13, w2, k, False, tiles=tiles)
        small.append(((got.float() - ref.float()).abs().max().item(), ref.float().abs().max().item(), str(dt)))
    # with a shared expert's output and gate logit added in the down launch (the talker's block)
    shared = (torch.randn(t, h).to(dt), torch.randn(t, 1).to(dt))
    want = ref + torch.sigmoid(shared[1]) * shared[0]
    got = triton_moe_small.routed_moe_small(x, gate, w13, w2, k, False, tiles=tiles_b, shared=shared)
    small.append(((got.float() - want.float()).abs().max().item(), want.float().abs().max().item(), str(dt)))
    # the residual add + RMSNorm inside the router launch (the thinker layer's post-attention norm)
    res, nw = torch.randn(t, h).to(dt), (1 + 0.1 * torch.randn(h)).to(dt)
    hsum = x + res
    normed = fused.rms_norm_ref(hsum, nw, 1e-6)
    w, ids = moe.route(torch.nn.functional.linear(normed, gate), k, False)
    want = moe.fused_moe_ref(normed, w13, w2, w, ids)
    for tiles in (tiles_b, tiles_c):                                # K steps, or all of H in one (tiles_c)
        got, got_h = triton_moe_small.routed_moe_small(x, gate, w13, w2, k, False, tiles=tiles,
                                                       prenorm=(res, nw, 1e-6))
        small.append(((got.float() - want.float()).abs().max().item(), want.float().abs().max().item(), str(dt)))
        small.append(((got_h.float() - hsum.float()).abs().max().item(), hsum.float().abs().max().item(), str(dt)))
print(json.dumps({"grouped": grouped, "grouped_tiles": grouped_tiles, "aligns": aligns, "small": small, "routes": routes, "routers": routers}))
"""


@pytest.fixture(scope="module")
def interpreted():
    """CHECK's results, run once through Triton's interpreter (CPU)."""
    return run_in_interpreter("-c", CHECK)


def test_triton_fused_moe_equals_reference_in_the_interpreter(interpreted):
    errs = interpreted["grouped"]
    assert len(errs) == 3
    for err, peak, dtype in errs:
        assert err <= (1e-5 if dtype == "torch.float32" else 4e-3) * peak, (err, peak, dtype)


def test_triton_fused_moe_with_other_tiles_equals_reference_in_the_interpreter(interpreted):
    """The grouped GEMMs at launch shapes other than the defaults (`triton_moe_tiles.SortedTiles`, what
    `benchmarks/moe_bench.py --prefill` sweeps): the same sums to rounding."""
    errs = interpreted["grouped_tiles"]
    assert len(errs) == 3
    for err, peak, dtype in errs:
        assert err <= (1e-5 if dtype == "torch.float32" else 4e-3) * peak, (err, peak, dtype)


def test_one_launch_align_equals_the_torch_align_in_the_interpreter(interpreted):
    """`triton_moe.align_one_launch` (`_align_kernel`): the sorted pair ids, each block's expert and the
    padded total equal `align`'s, element for element (the same stable order)."""
    assert interpreted["aligns"] == [[True, True, True]] * 3


def test_small_t_moe_and_router_equal_reference_in_the_interpreter(interpreted):
    """The decode path (T*K <= SMALL_PAIRS): float32 to rounding of sums; 16-bit within 4e-3 of the
    peak (the K slots are summed in float32, the reference adds them in the model dtype)."""
    assert len(interpreted["small"]) == 30
    for err, peak, dtype in interpreted["small"]:
        assert err <= (1e-5 if dtype == "torch.float32" else 4e-3) * peak, (err, peak, dtype)
    for same_ids, err in interpreted["routes"]:
        assert same_ids and err <= 1e-6
    # the router GEMV + top-k: the experts of the reference's logits; weights to float32 rounding, or within
    # a few float16 steps (its logits are rounded once from float32 sums, the CPU reference's may differ by one)
    assert len(interpreted["routers"]) == 6
    for same_ids, err, dtype in interpreted["routers"]:
        assert same_ids and err <= (1e-6 if dtype == "torch.float32" else 4e-3), (err, dtype)


def test_talker_block_with_its_shared_inputs_merged_equals_the_unmerged_one():
    """The talker block's shared-expert gate | up and its sigmoid gate read the same rows: merged into one
    GEMM (`layers.merged_linear.merge_linears`, what the talker's loader does) the block's output stays."""
    from omnistage.layers.merged_linear import LinearPart, merge_linears

    torch.manual_seed(0)
    block = moe.SparseMoeBlock(24, 8, 2, 16, False, 40)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(5, 24)
    with torch.no_grad():
        want = block(x)
        assert merge_linears(block, ("shared_expert.gate_up_proj", "shared_expert_gate"))
        assert isinstance(block.shared_expert_gate, LinearPart)
        got = block(x)
    assert torch.allclose(got, want, atol=1e-6 * want.abs().max().item()), (got - want).abs().max()
    assert block.shared_expert.gate_up_proj.group.gemms == 1


def test_align_pads_each_expert_to_the_block():
    from omnistage.layers import triton_moe

    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    sorted_ids, block_expert, total = triton_moe.align(ids, 4, 4)
    n = ids.numel()
    assert total.item() == 12                          # experts 0, 1, 2 -> one block of 4 each
    assert block_expert[:3].tolist() == [0, 1, 2]
    runs = sorted_ids[:12].view(3, 4)
    flat = ids.reshape(-1)
    for e, run in enumerate(runs):
        real = run[run < n]
        assert sorted(real.tolist()) == (flat == e).nonzero().flatten().tolist()


def test_start_up_tiles_off_cuda_are_the_table_and_candidates_start_from_it():
    """`moe_tune` times candidates on CUDA only (benchmarks/moe_bench.py checks that on the GPU); off CUDA
    it returns `small_tiles`' choice untimed, and each kernel's candidate list starts with that choice."""
    from omnistage.layers import moe_tune, triton_moe_tiles

    x, gate = torch.randn(1, 2048), torch.randn(128, 2048)
    w13, w2 = torch.empty(128, 2 * 768, 2048), torch.empty(128, 2048, 768)
    base = triton_moe_tiles.small_tiles(1, 8, 2048, 768, 4)
    assert moe_tune.tiles_for(x, gate, w13, w2, 8, True) == base and not moe_tune.CHOSEN
    assert [moe_tune.bucket(t) for t in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    for which in ("route", "up", "down"):
        tiles = triton_moe_tiles.candidates(base, which)
        assert tiles[0] == base and len(set(tiles)) == len(tiles) > 3
