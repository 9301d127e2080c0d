"""code2wav's Triton kernels, run under Triton's interpreter on CPU tensors, against their references:
  * `bigvgan_fused.py`'s anti-aliased SnakeBeta (both kernels) matches transformers' module: float32
    within 1e-5 of the output's peak; a bf16 input within a bf16 rounding of the float32 module on the
    same input; lengths shorter than the filters (replicate padding on both sides at once).
  * `dit_kernels.rope_first_head` matches `dit_fused`'s complex-multiply path (q's and k's first head
    rotated, everything else untouched) within float32 rounding, bf16 within one bf16 rounding.
  * `dit_kernels.block_attention` matches a dense float64 attention under the block-local rule (look
    back / ahead, keys past a row's length masked, a padded query sees itself) within 1e-5 of the
    output's peak, frames not a multiple of the block. float32 only: the interpreter's `tl.dot` misreads
    bf16 operands (Triton 3.x); bf16 on the GPU is checked by benchmarks/code2wav_bench.py's error row
    (the whole ODE against the plain float32 reference)."""

from interpreted import run_in_interpreter

CHECK = """
import json, torch
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniAntiAliasedActivation1d, Qwen2_5OmniSnakeBeta)
from omnistage.models.qwen2_5_omni import bigvgan_fused
g = torch.Generator().manual_seed(0)
out = {}
for length, tiled in ((3, False), (300, False), (3, True), (300, True)):
    bigvgan_fused.TILED = tiled
    act = Qwen2_5OmniAntiAliasedActivation1d(activation=Qwen2_5OmniSnakeBeta(2))
    with torch.no_grad():
        act.act.alpha.copy_(torch.randn(2, generator=g) * 0.5)
        act.act.beta.copy_(torch.randn(2, generator=g) * 0.5)
    x = torch.randn(1, 2, length, generator=g) * 2
    for dtype in (torch.float32, torch.bfloat16):
        xin = x.to(dtype)
        with torch.no_grad():
            ref = act(xin.float())
        got = bigvgan_fused.snake_aa(xin, *bigvgan_fused.prepare(act))
        assert got.dtype == dtype and got.shape == ref.shape
        out[f"{length}-{tiled}-{dtype}"] = [float((got.float() - ref).abs().max()), float(ref.abs().max())]
from omnistage.models.qwen2_5_omni import dit_fused, dit_kernels
angles = torch.randn(2, 5, 4, generator=g)
rot = torch.complex(angles.cos(), angles.sin())[:, :, None]
for dtype in (torch.float32, torch.bfloat16):
    qkv = torch.randn(2, 5, 3, 3, 8, generator=g).to(dtype)
    ref, got = qkv.clone(), qkv.clone()
    dit_fused.rope_first_head(ref, rot)         # the complex-multiply path (CPU tensors)
    dit_kernels.rope_first_head(got, rot)
    out[f"rope-{dtype}"] = [float((got.float() - ref.float()).abs().max()), float(ref.float().abs().max())]


def dense(qkv, lengths, back, ahead, block):
    rows, frames, _, heads, d = qkv.shape
    q, k, v = qkv.double().unbind(2)
    f = torch.arange(frames)
    window = (f[None, :] // block >= f[:, None] // block - back) & (f[None, :] // block <= f[:, None] // block + ahead)
    res = []
    for r in range(rows):
        keep = torch.where((f < lengths[r])[:, None], window & (f[None, :] < lengths[r]), torch.eye(frames, dtype=torch.bool))
        s = torch.einsum("qhd,khd->hqk", q[r], k[r]) * d ** -0.5
        res.append(torch.einsum("hqk,khd->qhd", s.masked_fill(~keep, float("-inf")).softmax(-1), v[r]))
    return torch.stack(res).flatten(2)


for back, ahead in ((0, 0), (1, 0), (0, 1)):
    for dtype in (torch.float32,):              # the interpreter's tl.dot misreads bf16 operands
        qkv = torch.randn(2, 53, 3, 2, 16, generator=g).to(dtype)
        lengths = torch.tensor([53, 30], dtype=torch.int32)
        got = dit_kernels.block_attention(qkv, lengths, back, ahead, 8)
        ref = dense(qkv, lengths.tolist(), back, ahead, 8)
        assert got.dtype == dtype and got.shape == ref.shape
        out[f"attn-{back}{ahead}-{dtype}"] = [float((got.double() - ref).abs().max()), float(ref.abs().max())]
print(json.dumps(out))
"""


def test_fused_activation_matches_transformers_in_the_interpreter():
    errs = run_in_interpreter("-c", CHECK)
    assert len(errs) == 13
    for key, (err, peak) in errs.items():
        assert err <= (1e-5 if key.endswith("float32") else 2 ** -7) * peak, (key, err, peak)


def test_vocoder_with_fused_activations_runs_transformers_blocks(omni_dir):
    """`DeviceVocoder(fused=True)` walks the AMP blocks itself; on a CPU its activations are the modules,
    so the waveform is transformers' to the bit."""
    import torch

    from omnistage.models.qwen2_5_omni.token2wav import DeviceVocoder, load_token2wav

    model, _ = load_token2wav(omni_dir)
    vocoder = model.code2wav_bigvgan_model
    fused = DeviceVocoder(vocoder, fused=True)
    assert fused.tables and all(t is not None for t in fused.tables.values())
    mel = torch.randn(2, vocoder.config.mel_dim, 20, generator=torch.Generator().manual_seed(0)) - 5
    torch.testing.assert_close(fused(mel), DeviceVocoder(vocoder)(mel), rtol=0, atol=0)
