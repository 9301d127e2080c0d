"""Rotary position embedding with a precomputed cos/sin table indexed by token position.

The inverse frequencies come from transformers' rope initialisers (default, linear, llama3, yarn,
longrope), so every rope variant a checkpoint declares in `rope_parameters` means what it means there.
Multimodal rope (`mrope_section`) picks each frequency's position row (t, h, w) in sections, or
interleaved when `rope_parameters["mrope_interleaved"]` is set (Qwen3-Omni's thinker and talker).
The model looks up each token's cos / sin rows once per forward (`tables`); the rotation itself is
`fused.rotary_and_cache` (a Triton kernel on CUDA, `fused.rotary_ref` elsewhere).
"""

from __future__ import annotations

import torch
from torch import nn


def rope_inv_freq(config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling factor for a transformers config."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq, 1.0
    if rope_type == "dynamic":
        raise ValueError("rope_type 'dynamic' depends on the running length and is not supported yet")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_type {rope_type!r} is not supported; known: default, {', '.join(ROPE_INIT_FUNCTIONS)}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Tables stay float32 whatever the model dtype; `build` makes them on the model's device."""

    def __init__(self, config, max_positions: int):
        super().__init__()
        self.config = config
        self.max_positions = max_positions
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None
        self.section_rows: torch.Tensor | None = None   # multimodal rope: position row of each dim

    def build(self, device: torch.device) -> "RotaryEmbedding":
        inv_freq, scaling = rope_inv_freq(self.config)
        freqs = torch.arange(self.max_positions).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scaling).to(device)
        self.sin = (emb.sin() * scaling).to(device)
        params = getattr(self.config, "rope_parameters", None) or {}
        section = params.get("mrope_section")
        if section:
            if params.get("mrope_interleaved"):
                # Qwen3-VL / Qwen3-Omni: frequency j takes row j % 3 (t, h, w) while that row's section
                # lasts (h: j < 3 * section[1], w: j < 3 * section[2]); every other one is temporal.
                j = torch.arange(sum(section))
                rows = torch.zeros_like(j)
                for r in (1, 2):
                    rows[(j % 3 == r) & (j < 3 * section[r])] = r
            else:
                # Frequency chunk i takes its angle from position row i % 3 (temporal, height, width).
                rows = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(section)])
            # the cos/sin halves are duplicated, so the map repeats for the second half
            self.section_rows = torch.cat([rows, rows]).to(device)
        return self

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] (or [3, T] for multimodal rope) -> cos, sin [T, D] float32, one row per token:
        computed once per forward and shared by every layer."""
        if positions.dim() == 2:
            pick = self.section_rows.view(1, 1, -1).expand(1, positions.shape[1], -1)
            return self.cos[positions].gather(0, pick)[0], self.sin[positions].gather(0, pick)[0]
        return self.cos[positions], self.sin[positions]
