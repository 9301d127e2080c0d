"""Online FP8 linear layers (any process; CUDA fast paths, PyTorch references everywhere).

In: an `nn.Linear` (any float dtype). `Fp8Linear.from_linear` quantizes its weight once to
float8_e4m3fn with one float32 scale per output channel (amax / 448). Out: x @ W^T + b in x's dtype.
`quantize_fp8(module, ignored)` swaps a module's linear layers (the DiT blocks' in diffusion/speed.py;
an AR decoder's through its `quantize_fp8`, models/llama.py).

Two regimes by the number of rows M of a forward:
  M > GEMV_MAX_M (prefill, DiT tokens): W8A8. The activations are quantized per token the same way
       (dynamic scales; one Triton launch on CUDA, `triton_gemv.quantize_rows`); CUDA (H100 / H200,
       both dims multiples of 16): `torch._scaled_mm` with the row-wise scales, bias fused, float32
       accumulation; elsewhere `reference`: the same quantized values dequantized and multiplied in
       float32 (the two differ by accumulation order).
  M <= GEMV_MAX_M (decode steps, short prefill chunks): W8A16. The activations stay in their 16-bit dtype; CUDA:
       `layers/triton_gemv.py` reads the FP8 weight once and scales each output row in-register
       (at small M the bytes are all in the weight, and `_scaled_mm` wants M padded to 16);
       elsewhere its PyTorch `reference`, so CPU tests run the same maths. (A dense decoder layer at
       <= 8 rows on CUDA reads `weight_fp8` / `weight_scale` itself: `layers/triton_decode.py`'s fused GEMVs.)
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from omnistage.layers import triton_gemv

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0                      # largest finite float8_e4m3fn
GEMV_MAX_M = triton_gemv.MAX_M       # rows up to which a forward is W8A16 (the GEMV), above W8A8


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] -> (float8 [..., K], float32 scales [..., 1]): one scale per row (amax / 448)."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12) / FP8_MAX
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def reference(x8: torch.Tensor, x_scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
              bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """Dequantized matmul: (x8 * x_scale) @ (w8 * w_scale)^T + bias, in float32."""
    out = (x8.float() * x_scale) @ (w8.float() * w_scale).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


class Fp8Linear(nn.Module):
    """A drop-in for `nn.Linear` at inference: `weight_fp8` [N, K], `weight_scale` [N, 1], `bias`."""

    def __init__(self, weight_fp8: torch.Tensor, weight_scale: torch.Tensor, bias: Optional[torch.Tensor]):
        super().__init__()
        self.in_features, self.out_features = weight_fp8.shape[1], weight_fp8.shape[0]
        self.register_buffer("weight_fp8", weight_fp8)
        self.register_buffer("weight_scale", weight_scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        w8, scale = quantize_rows(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(w8, scale, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
        if x2.shape[0] <= GEMV_MAX_M:
            out = self.w8a16(x2.to(out_dtype))
            return out.reshape(*shape[:-1], self.out_features)
        fast = self._fast(x2)
        # compiled (the DiT blocks): inductor fuses quantize_rows' ops itself
        one_launch = fast and not torch.compiler.is_compiling()
        x8, x_scale = triton_gemv.quantize_rows(x2, FP8_MAX) if one_launch else quantize_rows(x2)
        if fast:
            out = self.scaled_mm(x8, x_scale, out_dtype)
        else:
            out = reference(x8, x_scale, self.weight_fp8, self.weight_scale, self.bias, out_dtype)
        return out.reshape(*shape[:-1], self.out_features)

    def scaled_mm(self, x8: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """The fast path: row-wise scaled FP8 matmul, bias fused (torch runs it on CPU too, for tests)."""
        return torch._scaled_mm(x8, self.weight_fp8.t(), scale_a=x_scale, scale_b=self.weight_scale.t(),
                                bias=None if self.bias is None else self.bias.to(out_dtype), out_dtype=out_dtype)

    def w8a16(self, x2: torch.Tensor) -> torch.Tensor:
        """Small M: 16-bit activations times the dequantized weight (the Triton GEMV on CUDA)."""
        if x2.is_cuda and triton_gemv.triton is not None and x2.dtype in (torch.bfloat16, torch.float16):
            return triton_gemv.gemv(x2, self.weight_fp8, self.weight_scale, self.bias)
        return triton_gemv.reference(x2, self.weight_fp8, self.weight_scale, self.bias)

    def _fast(self, x2: torch.Tensor) -> bool:
        return (x2.is_cuda and triton_gemv.triton is not None and x2.dtype in (torch.bfloat16, torch.float16)
                and self.in_features % 16 == 0 and self.out_features % 16 == 0)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, fp8_e4m3 "
                f"(W8A16 up to {GEMV_MAX_M} rows, W8A8 above)")


def quantize_fp8(module: nn.Module, ignored: tuple = (), prefix: str = "", only: Optional[tuple] = None) -> int:
    """Swap every nn.Linear under `module` for an `Fp8Linear` whose name (`prefix` + its name inside
    `module`, e.g. "transformer_blocks.3.img_mlp.net.2") contains none of `ignored` and, when `only` is
    given, whose last name part is one of `only`; returns the count."""
    swaps = [(name, m) for name, m in module.named_modules() if isinstance(m, nn.Linear)
             and not any(part in prefix + name for part in ignored)
             and (only is None or name.rpartition(".")[2] in only)]
    for name, linear in swaps:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, Fp8Linear.from_linear(linear))
    return len(swaps)


def quantize_decoder(model: nn.Module, ignored: tuple = ()) -> int:
    """An AR stage's `quantization="fp8"`: the model's own `quantize_fp8(ignored)` (which linear layers
    it declares, models/llama.py) after loading; a model without one is a start-up error."""
    quantize = getattr(model, "quantize_fp8", None)
    if quantize is None:
        raise ValueError(f"quantization='fp8' is not supported for {type(model).__name__}; unset quantization "
                         "for this stage")
    swapped = quantize(tuple(ignored))
    log.info("fp8: %d linear layers of %s quantized (ignored_layers=%s)", swapped, type(model).__name__, list(ignored))
    return swapped
