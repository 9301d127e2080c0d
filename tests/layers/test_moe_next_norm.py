"""The MoE decode down launch with the residual add + RMSNorm after the block folded in (`_token_down_kernel`
NEXT_NORM, `triton_moe_small.small_down(next_norm=)`), through Triton's interpreter (CPU): against the same
launch without it followed by the reference add + `fused.rms_norm_ref`, at T = 1, 2, 5, with and without
split-K, with the shared-expert term, and the whole block (`routed_moe_small(prenorm=, next_norm=)`) against
the PyTorch reference chain; and tiny Qwen3-MoE decoders (the thinker's: deepstack rows and a reported
layer; the talker's: a shared expert) with the decode MoE kernels forced on CPU tensors, the next norm
folded vs not, against the PyTorch path. The interpreter rounds float16 casts to nearest as CUDA does and truncates
bfloat16 ones, so h is checked bit for bit in float32 / float16 and within one bfloat16 step in bfloat16."""

import pytest

from interpreted import run_in_interpreter

CHECK = """
import json, torch
from omnistage.layers import fused, moe, triton_decode, triton_moe_small
from omnistage.layers.triton_moe_tiles import SmallTiles
torch.manual_seed(0)
e, h, i = 6, 40, 24                           # H, I not multiples of the tiles; 5 column blocks of 8
tiles = {1: SmallTiles(up_n=8, up_k=16, down_n=8, down_k=8, route_r=4, route_k=16, route_warps=1),
         2: SmallTiles(up_n=8, up_k=16, up_split=2, down_n=8, down_k=8, down_split=2)}
down, block = [], []


def errs(got, want):
    return [(got.float() - want.float()).abs().max().item(), want.float().abs().max().item()]


for dt in (torch.float32, torch.float16, torch.bfloat16):
    w2 = (torch.randn(e, h, i) * 0.2).to(dt)
    w13 = (torch.randn(e, 2 * i, h) * 0.2).to(dt)
    gate = (torch.randn(e, h) * 0.3).to(dt)
    nw = (1 + 0.1 * torch.randn(h)).to(dt)
    for t in (1, 2, 5):
        for k in (2, 3):                      # 3: a slot past top_k in the [4, ...] tile
            mid = torch.randn(t * k, i).to(dt)
            w, ids = moe.route(torch.randn(t, e), k, True)
            res = torch.randn(t, h).to(dt)
            for shared in (None, (torch.randn(t, h).to(dt), torch.randn(t, 1).to(dt))):
                for split, tl_ in tiles.items():
                    out = triton_moe_small.small_down(mid, w2, w, ids, tl_, shared)
                    normed, hsum = triton_moe_small.small_down(mid, w2, w, ids, tl_, shared, (res, nw, 1e-6))
                    want_h = out + res
                    want_n = fused.rms_norm_ref(hsum, nw, 1e-6)     # of the launch's own h (bfloat16)
                    down.append([str(dt), t, k, split, shared is not None, torch.equal(hsum, want_h),
                                 *errs(hsum, want_h), *errs(normed, want_n), str(normed.dtype)])
        if dt is torch.bfloat16:              # truncated router logits may pick other experts than torch's
            continue
        # the thinker layer's block: prenorm in the router launch, the next norm in the down launch
        x, res, nw2 = torch.randn(t, h).to(dt), torch.randn(t, h).to(dt), (1 + 0.1 * torch.randn(h)).to(dt)
        normed, hs = fused.rms_norm(x, nw, 1e-6, res)
        wr, idr = moe.route(torch.nn.functional.linear(normed, gate), 2, True)
        after_h = moe.fused_moe_ref(normed, w13, w2, wr, idr) + hs
        after_n = fused.rms_norm_ref(after_h, nw2, 1e-6)
        for split, tl_ in tiles.items():
            got_n, got_h = triton_moe_small.routed_moe_small(x, gate, w13, w2, 2, True, tiles=tl_,
                                                             prenorm=(res, nw, 1e-6), next_norm=(None, nw2, 1e-6))
            block.append([str(dt), t, split, *errs(got_h, after_h), *errs(got_n, after_n)])
    left = int(triton_decode.counters(w2, torch.device("cpu")).abs().sum())
    assert left == 0, f"{left}: tickets left non-zero"
print(json.dumps({"down": down, "block": block}))
"""

MODEL = """
import json, torch
from transformers import Qwen3MoeConfig
from omnistage.layers import moe, triton_moe_small
from omnistage.layers.attention import AttentionMetadata
from omnistage.models.qwen3_omni.thinker import Qwen3MoeForCausalLM
from omnistage.testing.llm import draw_norms_and_biases
torch.manual_seed(0)
rows = []
small = moe._small_path
# (shared expert width, dtype, dense layers: a dense layer after a folded MoE one takes the normed rows)
for shared, dt, dense in ((0, torch.float32, []), (40, torch.float32, []), (0, torch.float16, []),
                          (0, torch.float32, [1])):
    cfg = Qwen3MoeConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, num_hidden_layers=3, vocab_size=100, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=dense, norm_topk_prob=True)
    cfg.shared_expert_intermediate_size = shared
    model = Qwen3MoeForCausalLM(cfg, 64, report_layer=2)
    draw_norms_and_biases(model, (0.5, 1.5), 0.1)
    sparse = [layer for layer in model.layers if isinstance(layer.mlp, moe.SparseMoeBlock)]
    for layer in sparse:                        # the MoE block's experts start empty
        layer.mlp.w13.data.normal_(0, 0.2)
        layer.mlp.w2.data.normal_(0, 0.2)
    model = model.to(dt)
    model.rotary.build(torch.device("cpu"))
    m, bs, blocks = 2, 4, 8
    cache = torch.randn(2, blocks, bs, 2, 16).to(dt)
    ctx, tables = torch.tensor([5, 9]), torch.arange(blocks).view(2, 4)
    pos = ctx - 1
    meta = AttentionMetadata(slot_mapping=tables[torch.arange(m), pos // bs] * bs + pos % bs, num_decodes=m,
                             decode_block_tables=tables, decode_ctx_lens=ctx)
    ids = torch.randint(0, 100, (m,))
    for adds in (None, torch.randn(2, m, 64).to(dt)):   # deepstack after layers 0, 1 (1: the reported one)
        res = {}
        for mode in ("torch", "kernels", "folded"):
            moe._small_path = small if mode == "torch" else (lambda x, k: x.shape[0] * k <= 64)
            moe.NORM_FOLD = mode == "folded"
            for layer in model.layers:
                layer.self_attn.kv_cache = cache.clone()
            with torch.no_grad():
                res[mode] = model(ids, pos, meta, layer_adds=adds)
            # the down launch's tickets are made by its first NEXT_NORM call (these tiles: no split-K)
            res[mode] += (sum("_decode_counters" in layer.mlp.w2.__dict__ for layer in sparse), len(sparse))
        moe._small_path, moe.NORM_FOLD = small, True
        want = res["torch"]
        for mode in ("kernels", "folded"):
            rows.append([str(dt), shared, adds is not None, mode, *res[mode][2:]]
                        + [[(a.float() - b.float()).abs().max().item(), b.float().abs().max().item()]
                           for a, b in zip(res[mode][:2], want[:2])])
print(json.dumps(rows))
"""

STEP = {"torch.float32": 2 ** -23, "torch.float16": 2 ** -10, "torch.bfloat16": 2 ** -7}   # one rounding, relative


@pytest.fixture(scope="module")
def interpreted():
    return run_in_interpreter("-c", CHECK)


def test_down_launch_with_the_next_norm_equals_down_then_the_reference_norm(interpreted):
    """h = out + residual as torch adds it (bit for bit where the interpreter rounds as CUDA); the normed rows
    within two roundings of the model dtype of `fused.rms_norm_ref` of that h (h * rstd and the weight
    product; rstd's float32 sum runs in another order than torch's mean), also with split-K (the split
    finisher takes the row ticket) and the shared-expert term; the model dtype out."""
    rows = interpreted["down"]
    assert len(rows) == 3 * 3 * 2 * 2 * 2
    for dt, t, k, split, shared, same_h, err_h, peak_h, err_n, peak_n, out_dt in rows:
        case = (dt, t, k, split, shared)
        assert out_dt == dt, case
        if dt == "torch.bfloat16":
            assert err_h <= STEP[dt] * peak_h, (case, err_h, peak_h)
        else:
            assert same_h, (case, err_h)
        assert err_n <= 2 * STEP[dt] * peak_n + 1e-6, (case, err_n, peak_n)


def test_block_with_both_norms_folded_equals_the_reference_chain(interpreted):
    """RMSNorm(x + residual) -> router -> experts -> + h -> RMSNorm, three launches against the PyTorch
    reference: float32 to rounding of sums, float16 within 4e-3 of the peak (the K slots summed in float32)."""
    rows = interpreted["block"]
    assert len(rows) == 2 * 3 * 2
    tol = {"torch.float32": 1e-5, "torch.float16": 4e-3}
    for dt, t, split, err_h, peak_h, err_n, peak_n in rows:
        assert err_h <= tol[dt] * peak_h and err_n <= tol[dt] * peak_n, (dt, t, split, err_h, err_n)


def test_decoders_with_the_next_norm_folded_equal_the_pytorch_path():
    """A decode step of 2 rows through 3 layers: the decode kernels (forced on CPU tensors; on CUDA
    `moe._small_path` picks them) with the next norm folded into the down launch, and without (`NORM_FOLD`
    off: the norm after the block by itself), both equal the PyTorch path's final normed rows and reported
    layer, with deepstack rows (the reported layer's own deepstack step keeps its norm unfolded), the
    talker's shared expert, and a dense layer among the MoE ones."""
    rows = run_in_interpreter("-c", MODEL)
    assert len(rows) == 4 * 2 * 2
    tol = {"torch.float32": 1e-5, "torch.float16": 4e-3}
    for dt, shared, adds, mode, folded, sparse, (err, peak), (err_rep, peak_rep) in rows:
        case = (dt, shared, adds, mode, sparse)
        if not adds:                            # each model's first run: only the folded one folds, every MoE layer
            assert folded == (sparse if mode == "folded" else 0), (case, folded)
        assert err <= tol[dt] * peak and err_rep <= tol[dt] * peak_rep, (case, err, err_rep)
