"""Online FP8 W8A8 linear layers (any process; CUDA fast path, PyTorch reference everywhere).

In: an `nn.Linear` (any float dtype). `Fp8Linear.from_linear` quantizes its weight once to
float8_e4m3fn with one float32 scale per output channel (amax / 448); each forward quantizes the
activations per token the same way (dynamic scales). Out: x @ W^T + b in x's dtype.

  CUDA (H100 / H200, both dims multiples of 16): `torch._scaled_mm` with the row-wise scales,
       bias fused, float32 accumulation.
  elsewhere (CPU tests, odd shapes): `reference`: the same quantized values dequantized and
       multiplied in float32, so the two differ only by accumulation order.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0                      # largest finite float8_e4m3fn


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
        x8, x_scale = quantize_rows(x2)
        out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
        if self._fast(x2):
            out = self.scaled_mm(x8, x_scale, out_dtype)
        else:
            out = reference(x8, x_scale, self.weight_fp8, self.weight_scale, self.bias, out_dtype)
        return out.reshape(*shape[:-1], self.out_features)

    def scaled_mm(self, x8: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """The fast path: row-wise scaled FP8 matmul, bias fused (torch runs it on CPU too, for tests)."""
        return torch._scaled_mm(x8, self.weight_fp8.t(), scale_a=x_scale, scale_b=self.weight_scale.t(),
                                bias=None if self.bias is None else self.bias.to(out_dtype), out_dtype=out_dtype)

    def _fast(self, x2: torch.Tensor) -> bool:
        return (x2.is_cuda and x2.dtype in (torch.bfloat16, torch.float16) and self.in_features % 16 == 0
                and self.out_features % 16 == 0)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8_e4m3 W8A8"
