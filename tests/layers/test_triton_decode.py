"""layers.triton_decode under Triton's interpreter (CPU): the fused small-M GEMVs against their PyTorch
reference (M = 1..8, 16-bit and FP8 weights, every prologue / epilogue, split-K), the split-K reduce
deterministic with its tickets reset after each launch (what a CUDA-graph replay needs), and tiny
Llama / Qwen2 / Qwen3 models and a Qwen3-MoE thinker whose decoder layers take the fused path equal to the
unfused path; the fused path is not forced on by default (the tiles table picks it per linear).

The interpreter truncates float32 -> bfloat16 casts (CUDA rounds to nearest) and cannot do bfloat16
dots, so the tight checks run float16 and the bfloat16 one (M = 1) allows a few bfloat16 steps."""

from interpreted import run_in_interpreter

CHECK = r"""
import json, torch
from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig
from omnistage.layers import triton_decode as td
from omnistage.layers.attention import AttentionMetadata
from omnistage.layers.fp8_linear import quantize_rows
from omnistage.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from omnistage.models.qwen3_omni.thinker import Qwen3MoeForCausalLM
from omnistage.testing.llm import draw_norms_and_biases

torch.manual_seed(0)
out = {"gemv": [], "layers": [], "opt_in": not td.ENABLED}     # by the table unless OMNISTAGE_DECODE_KERNELS=1

def err(a, b):
    return [(a.float() - b.float()).abs().max().item(), b.float().abs().max().item()]

# (M, N, K, dtype, fp8 weight, fusions, tile or None: tiles()); tiles' split-K: (BLOCK_N, BLOCK_K, SPLIT_K, dot, ..)
for m, n, k, dt, fp8, fl, cfg in [
    (1, 40, 96, torch.float16, True, "bias norm res", None),
    (1, 24, 130, torch.float16, False, "add", (8, 16, 4, False, 4, 2)),
    (1, 16, 64, torch.bfloat16, True, "gated norm", (4, 16, 2, False, 4, 2)),
    (2, 48, 80, torch.float16, True, "gated norm", (16, 16, 2, True, 4, 2)),
    (3, 40, 200, torch.float16, False, "add bias", (16, 32, 4, True, 4, 2)),
    (5, 32, 64, torch.float16, False, "gated res norm bias", None),
    (8, 56, 160, torch.float16, True, "add", (16, 16, 8, True, 4, 2)),
]:
    x, w = torch.randn(m, k).to(dt), torch.randn(n, k) * k ** -0.5
    w8, scale = quantize_rows(w) if fp8 else (w.to(dt), None)
    cols = n // 2 if "gated" in fl else n
    kw = dict(bias=torch.randn(n).to(dt) if "bias" in fl else None,
              residual=torch.randn(m, k).to(dt) if "res" in fl else None,
              norm_weight=(torch.rand(k) + 0.5).to(dt) if "norm" in fl else None,
              gated="gated" in fl, add=torch.randn(m, cols).to(dt) if "add" in fl else None)
    ref = td.reference(x, w8, scale, **kw)
    got = td.decode_gemv(x, w8, scale, **kw, config=cfg)
    again = td.decode_gemv(x, w8, scale, **kw, config=cfg)
    if kw["residual"] is not None:
        out["gemv"].append([str(dt), err(got[1], ref[1])])
        ref, got, again = ref[0], got[0], again[0]
    out["gemv"].append([str(dt), err(got, ref)])
    assert torch.equal(got, again), "split-K result changed between launches"

assert not td.counters(td._OWN, torch.device("cpu")).any(), "split-K tickets left non-zero"
assert td.tiles(1, 40, 96, 1, False, 4)[2] == 1 and td.tiles(1, 24, 4096, 2, False, 4)[2] > 1

# models: every decoder layer through DecoderLayer.forward (the thinker's: MoeDecoderLayer.forward), the
# fused path forced on CPU tensors (on CUDA `serves` and the tiles table pick it) vs the unfused path, over a
# decode step of M rows with 3..12-token contexts
serves = td.serves
moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[],
           norm_topk_prob=True)
for cls, cfgc, m, dt, fp8 in [(Qwen2ForCausalLM, Qwen2Config, 1, torch.float16, False),
                              (Qwen2ForCausalLM, Qwen2Config, 8, torch.float16, True),
                              (Qwen3ForCausalLM, Qwen3Config, 3, torch.float16, True),
                              (LlamaForCausalLM, LlamaConfig, 1, torch.float16, False),
                              (Qwen3MoeForCausalLM, Qwen3MoeConfig, 2, torch.float16, False)]:
    cfg = cfgc(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               num_hidden_layers=2, vocab_size=100, **(moe if cls is Qwen3MoeForCausalLM else {}))
    model = cls(cfg, 64)
    draw_norms_and_biases(model, (0.5, 1.5), 0.1)
    for layer in model.layers:                  # the MoE block's experts start empty
        for w in (getattr(layer.mlp, "w13", None), getattr(layer.mlp, "w2", None)):
            if w is not None:
                w.data.normal_(0, 0.2)
    if fp8:
        model.quantize_fp8()
    model = model.to(dt)
    model.rotary.build(torch.device("cpu"))
    bs, blocks = 4, 4 * 8
    cache = torch.randn(2, blocks, bs, 2, 16).to(dt)
    ctx = torch.tensor([5, 9, 3, 12, 7, 4, 10, 6][:m])
    tables = torch.arange(blocks).view(8, 4)[:m]
    pos = ctx - 1
    meta = AttentionMetadata(slot_mapping=tables[torch.arange(m), pos // bs] * bs + pos % bs, num_decodes=m,
                             decode_block_tables=tables, decode_ctx_lens=ctx)
    ids = torch.randint(0, 100, (m,))
    res = {}
    for fused_on in (False, True):
        td.serves = (lambda x, *lin: x.shape[0] <= td.MAX_M) if fused_on else serves
        td.ENABLED = fused_on
        caches = [cache.clone() for _ in model.layers]
        for layer, c in zip(model.layers, caches):
            layer.self_attn.kv_cache = c
        with torch.no_grad():
            res[fused_on] = (model(ids, pos, meta), caches)
    td.serves, td.ENABLED = serves, None
    assert all("_decode_counters" in layer.__dict__ and not td.counters(layer, torch.device("cpu")).any()
               for layer in model.layers), "a layer's tickets missing or left non-zero"
    out["layers"].append([str(dt), err(res[True][0], res[False][0])]
                         + [err(a, b) for a, b in zip(res[True][1], res[False][1])])
print(json.dumps(out))
"""


def test_decode_gemv_and_fused_layers_equal_the_references_in_the_interpreter():
    out = run_in_interpreter("-c", CHECK)
    # float16: rounding of the output (and of h / the normed rows where the unfused path stores them) with float32
    # sums in another order; bfloat16 (interpreter casts truncate): a few steps of 2^-8
    tol = {"torch.float16": 4e-3, "torch.bfloat16": 4e-2}
    assert len(out["gemv"]) == 9 and len(out["layers"]) == 5 and out["opt_in"]
    for dt, (e, peak) in out["gemv"]:
        assert e <= tol[dt] * peak, (dt, e, peak)
    for dt, *errs in out["layers"]:             # the final hidden states, then each layer's KV cache
        for e, peak in errs:
            assert e <= 2 * tol[dt] * peak, (dt, e, peak)


def test_the_tiles_table_picks_each_linear_and_the_switch_overrides_it(monkeypatch):
    """Unset, a linear is fused only where its TILES entry measured faster than the unfused path (the thinker's
    o at M = 2 yes, at M = 1 and its qkv no); "1" always, "0" never; other values name the allowed ones."""
    import pytest
    import torch
    from torch import nn

    from omnistage.layers import triton_decode as td

    monkeypatch.setattr(td, "serves", lambda x, *lin: True)     # CUDA + dtype gate: the table alone decides
    o = nn.Linear(4096, 2048, bias=False, dtype=torch.bfloat16)
    qkv = nn.Linear(2048, 5120, bias=False, dtype=torch.bfloat16)
    rows = {m: torch.zeros(m, 4096, dtype=torch.bfloat16) for m in (1, 2)}
    monkeypatch.setattr(td, "ENABLED", None)
    assert td.chooses(rows[2], o, td.fusion()) and not td.chooses(rows[1], o, td.fusion())
    assert not td.chooses(rows[2][:, :2048], qkv, td.fusion(norm=True))
    assert not td.chooses(rows[2], o, td.fusion(add=True))         # no entry: unfused
    monkeypatch.setattr(td, "ENABLED", True)
    assert td.chooses(rows[1], o, td.fusion())
    monkeypatch.setattr(td, "ENABLED", False)
    assert not td.chooses(rows[2], o, td.fusion())
    assert [td._mode(v) for v in ("0", "1", "")] == [False, True, None]
    with pytest.raises(ValueError, match="OMNISTAGE_DECODE_KERNELS must be 0"):
        td._mode("yes")
