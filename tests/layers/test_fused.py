"""layers.fused: each PyTorch reference against the plain formula, the Triton kernels against the
references (Triton's interpreter on CPU), and the native model (stacked QKV / gate-up GEMMs, fused
residual norms) against transformers' logits on the same checkpoint."""

import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from interpreted import run_in_interpreter
from omnistage.layers import fused, kernel_check
from omnistage.layers.attention import AttentionMetadata, PrefillChunk
from omnistage.layers.rotary import RotaryEmbedding, rope_inv_freq
from omnistage.models.loader import load_causal_lm



def test_cpu_runs_the_references():
    assert not fused.use_triton(torch.zeros(1))


def test_rms_norm_is_the_formula():
    torch.manual_seed(0)
    x, r, w = torch.randn(5, 48), torch.randn(5, 48), torch.randn(48)
    want = lambda h: (h.double() / (h.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * w.double())  # noqa: E731
    assert torch.allclose(fused.rms_norm(x, w, 1e-6).double(), want(x), atol=1e-5)
    out, res = fused.rms_norm(x, w, 1e-6, r)
    assert torch.equal(res, x + r)
    assert torch.allclose(out.double(), want(x + r), atol=1e-5)


def test_silu_and_mul_is_the_formula():
    x = torch.randn(3, 2 * 20)
    g, u = x[:, :20].double(), x[:, 20:].double()
    assert torch.allclose(fused.silu_and_mul(x).double(), g * torch.sigmoid(g) * u, atol=1e-6)


def _config(**rope):
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, rope_parameters=rope or None)


def _rotated(x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """Dimension i and i + D/2 are one pair, turned by angle[t, i] (the rotate-half convention)."""
    half = x.shape[-1] // 2
    a, b = x[..., :half].double(), x[..., half:].double()
    c, s = angle.cos()[:, None, :], angle.sin()[:, None, :]
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


@pytest.mark.parametrize("mrope", [False, True])
def test_rotary_turns_each_pair_by_position_times_frequency(mrope):
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if mrope:
        rope["mrope_section"] = [4, 6, 6]
    rot = RotaryEmbedding(_config(**rope), 64).build(torch.device("cpu"))
    inv_freq = rope_inv_freq(rot.config)[0].double()
    t = 7
    pos = torch.randint(0, 64, (3, t)) if mrope else torch.randint(0, 64, (t,))
    if mrope:   # frequency i takes its position from row 0 (temporal), 1 (height) or 2 (width) by section
        row = torch.repeat_interleave(torch.tensor([0, 1, 2]), torch.tensor([4, 6, 6]))
        angle = pos[row].T.double() * inv_freq
    else:
        angle = pos[:, None].double() * inv_freq
    q, k, v = torch.randn(t, 2, 32), torch.randn(t, 1, 32), torch.randn(t, 1, 32)
    cache = torch.zeros(2, 2, 4, 1, 32)
    slots = torch.tensor([5, 0, 1, 2, 7, 6, 3])
    qr, kr = fused.rotary_and_cache(q, k, v, *rot.tables(pos), cache, slots)
    assert torch.allclose(qr.double(), _rotated(q, angle), atol=1e-5)
    assert torch.allclose(kr.double(), _rotated(k, angle), atol=1e-5)
    flat = cache.view(2, -1, 1, 32)
    assert torch.equal(flat[0, slots], kr) and torch.equal(flat[1, slots], v)


def test_triton_kernels_match_references_in_the_interpreter():
    errs = run_in_interpreter("-m", "omnistage.layers.kernel_check")
    assert len(errs) == 25                      # every check ran (the last: 8-bit attention, float16)
    for name, (err, peak) in errs.items():
        assert err <= kernel_check.limit(name) * peak, (name, err, peak)


# tiny Qwen2 (q/k/v biases) and Qwen3 (q/k norms) decoders, GQA, over one decode-only step: Attention._attend's
# decode kernel with norms, rotary and KV write folded in (forced on CPU tensors; on CUDA `decode_fuses` picks it)
# vs the reference path (rotary_and_cache + attend), final hidden states and every layer's cache
DECODE_ONLY = r"""
import json, torch
from transformers import Qwen2Config, Qwen3Config
from omnistage.layers import attention
from omnistage.layers.attention import AttentionMetadata
from omnistage.models.llama import Qwen2ForCausalLM, Qwen3ForCausalLM
from omnistage.testing.llm import draw_norms_and_biases

torch.manual_seed(0)
out = []
fuses = attention.decode_fuses
for cls, cfgc, dt in [(Qwen2ForCausalLM, Qwen2Config, torch.float32), (Qwen3ForCausalLM, Qwen3Config, torch.float16)]:
    cfg = cfgc(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               num_hidden_layers=2, vocab_size=100)
    model = cls(cfg, 128)
    draw_norms_and_biases(model, (0.5, 1.5), 0.1)
    model = model.to(dt)
    model.rotary.build(torch.device("cpu"))
    bs, ctx = 16, torch.tensor([3, 17, 40])                   # 17: the new token first in its block
    tables = torch.arange(9).view(3, 3)
    pos = ctx - 1
    meta = AttentionMetadata(slot_mapping=tables[torch.arange(3), pos // bs] * bs + pos % bs, num_decodes=3,
                             decode_block_tables=tables, decode_ctx_lens=ctx)
    cache = torch.randn(2, 9, bs, 2, 16).to(dt)
    ids = torch.randint(0, 100, (3,))
    res = {}
    for on in (False, True):
        attention.decode_fuses = (lambda q, c, m: m.num_decodes == q.shape[0] and not m.prefills) if on else fuses
        caches = [cache.clone() for _ in model.layers]
        for layer, c in zip(model.layers, caches):
            layer.self_attn.kv_cache = c
        with torch.no_grad():
            res[on] = (model(ids, pos, meta), caches)
    attention.decode_fuses = fuses
    err = lambda a, b: [(a.float() - b.float()).abs().max().item(), b.float().abs().max().item()]  # noqa: E731
    out.append([str(dt), err(res[True][0], res[False][0])] + [err(a, b) for a, b in zip(res[True][1], res[False][1])])
print(json.dumps(out))
"""


def test_decode_only_attention_folds_norms_rotary_and_kv_write_in_the_interpreter():
    out = run_in_interpreter("-c", DECODE_ONLY)
    assert len(out) == 2
    for dt, *errs in out:                       # the hidden states, then each layer's KV cache
        for err, peak in errs:
            assert err <= kernel_check.limit(dt) * peak, (dt, err, peak)


@pytest.fixture(scope="module")
def perturbed(tiny_models, tmp_path_factory):
    """The tiny checkpoints with random biases and norm weights (HF initialises them to 0 and 1), so
    that loading the stacked q/k/v biases and Qwen3's q/k norms is tested too."""
    out = {}
    for arch, path in tiny_models.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    p.add_(0.3 * torch.randn(p.shape, generator=g))
        folder = str(tmp_path_factory.mktemp(arch))
        model.save_pretrained(folder)
        for f in os.listdir(path):
            if "token" in f:                               # the loader reads the tokenizer too
                shutil.copy(os.path.join(path, f), folder)
        out[arch] = (folder, model)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_native_model_logits_match_transformers(arch, perturbed):
    folder, hf = perturbed[arch]
    model = load_causal_lm(folder, torch.device("cpu"), torch.float32, None)[0]
    if arch == "qwen2":
        assert model.layers[0].self_attn.qkv_proj.bias.abs().sum() > 0
    ids = torch.randint(0, hf.config.vocab_size, (1, 13), generator=torch.Generator().manual_seed(2))
    want = hf(ids).logits[0]
    # the prompt in two chunks (9 then 4 tokens, the second over cached context), block size 4
    attn = model.attention_layers[0]
    caches = [torch.zeros(2, 5, 4, attn.num_kv_heads, attn.head_dim) for _ in model.attention_layers]
    for a, c in zip(model.attention_layers, caches):
        a.kv_cache = c
    table = torch.tensor([3, 0, 4, 1])
    got = []
    with torch.no_grad():
        for start, n in ((0, 9), (9, 4)):
            pos = torch.arange(start, start + n)
            meta = AttentionMetadata(slot_mapping=table[pos // 4] * 4 + pos % 4,
                                     prefills=[PrefillChunk(0, n, start + n, table)])
            got.append(model.compute_logits(model(ids[0, start:start + n], pos, meta)))
    assert torch.allclose(torch.cat(got), want, atol=1e-4), (torch.cat(got) - want).abs().max()
