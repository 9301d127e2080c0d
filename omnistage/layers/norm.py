"""RMSNorm computed in float32 and cast back, as the Llama / Qwen checkpoints were trained.

`forward(x, residual)` adds the residual stream first and returns (normed, new residual): one fused
kernel on CUDA (`fused.rms_norm`)."""

from typing import Optional

import torch
from torch import nn

from omnistage.layers import fused


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """x [..., dim] -> normed x; with `residual`: (norm(x + residual), x + residual)."""
        return fused.rms_norm(x, self.weight, self.eps, residual)
