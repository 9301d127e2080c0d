"""`layers/ada_norm.py`: the PyTorch reference is transformers' DiT arithmetic, and the Triton kernel
(run under Triton's interpreter on CPU tensors) matches the reference: float32 within 1e-5 of the
output's peak, a bfloat16 output within one bf16 rounding (2^-7 relative)."""

import torch
import torch.nn.functional as F

from interpreted import run_in_interpreter
from omnistage.layers.ada_norm import ada_norm

CHECK = """
import json, torch
from omnistage.layers.ada_norm import _ada_norm_triton, ada_norm_ref
g = torch.Generator().manual_seed(0)
out = {}
for n in (48, 64):
    x, r = torch.randn(5, 3, n, generator=g).to(torch.bfloat16), torch.randn(5, 3, n, generator=g)
    shift, scale, gate = (torch.randn(n, generator=g) for _ in range(3))
    for name, args in (("plain", (x.float(), shift, scale, 1e-6)), ("residual", (x, shift, scale, 1e-6, r, gate))):
        for dtype in (torch.float32, torch.bfloat16):
            h, y = _ada_norm_triton(*args, *([None, None] if name == "plain" else []), dtype)
            h_ref, y_ref = ada_norm_ref(*args, *([None, None] if name == "plain" else []), dtype)
            key = f"{name}-{n}-{dtype}"
            out[key] = [float((h - h_ref).abs().max()), float((y.float() - y_ref.float()).abs().max()),
                        float(y_ref.float().abs().max())]
print(json.dumps(out))
"""


def test_reference_is_the_dit_block_arithmetic():
    g = torch.Generator().manual_seed(1)
    x, r = torch.randn(2, 7, 32, generator=g), torch.randn(2, 7, 32, generator=g)
    shift, scale, gate = (torch.randn(32, generator=g) for _ in range(3))
    h, y = ada_norm(x, shift, scale, 1e-6, residual=r, gate=gate, out_dtype=torch.bfloat16)
    expected_h = r + gate * x
    torch.testing.assert_close(h, expected_h, rtol=0, atol=0)
    expected = (F.layer_norm(expected_h, (32,), eps=1e-6) * (1 + scale) + shift).to(torch.bfloat16)
    torch.testing.assert_close(y, expected, rtol=0, atol=0)


def test_triton_kernel_matches_the_reference_in_the_interpreter():
    errs = run_in_interpreter("-c", CHECK)
    assert len(errs) == 8
    for key, (h_err, y_err, peak) in errs.items():
        assert h_err <= 1e-5 * peak, key
        assert y_err <= (1e-5 if key.endswith("float32") else 2 ** -7) * peak, (key, y_err, peak)
