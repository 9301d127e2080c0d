"""Native decoder LMs: Llama (incl. SmolLM2), Qwen2 / Qwen2.5 and Qwen3 (dense).

In: flattened token ids and positions of one engine step plus `AttentionMetadata`; out: hidden
states [T, hidden], and logits for the rows the runner asks for. The three families share one
structure; they differ in declared flags: Qwen2 has q/k/v biases, Qwen3 normalises q and k per
head and may set `head_dim` explicitly. Weights load from transformers checkpoints by name, with
q/k/v and gate/up stacked into single matrices so each is one GEMM.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.layers.attention import AttentionMetadata, paged_attention
from omnistage.layers.norm import RMSNorm
from omnistage.layers.rotary import RotaryEmbedding

_ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class Attention(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding, qkv_bias: bool, qk_norm: bool, o_bias: bool):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_dim ** -0.5
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        self.kv_cache: torch.Tensor | None = None               # [2, blocks, block_size, KVH, D], bound by the runner

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        o = paged_attention(q, k, v, self.kv_cache, meta, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, config, bias: bool):
        super().__init__()
        self.inter = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.inter, bias=bias)
        self.down_proj = nn.Linear(self.inter, config.hidden_size, bias=bias)
        self.act = _ACTS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config, rotary, qkv_bias, qk_norm, o_bias, mlp_bias):
        super().__init__()
        self.self_attn = Attention(config, rotary, qkv_bias, qk_norm, o_bias)
        self.mlp = MLP(config, mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, positions, meta):
        x = x + self.self_attn(self.input_layernorm(x), positions, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Llama-structured decoder; subclasses set the per-family flags."""

    qk_norm = False

    def qkv_bias(self, config) -> bool:
        return bool(getattr(config, "attention_bias", False))

    def __init__(self, config, max_positions: int):
        super().__init__()
        self.config = config
        att_bias = bool(getattr(config, "attention_bias", False))
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.rotary = RotaryEmbedding(config, max_positions)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, self.rotary, self.qkv_bias(config), self.qk_norm, att_bias, mlp_bias)
            for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    # ---- engine-facing interface --------------------------------------------------------------
    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        for layer in self.layers:
            x = layer(x, positions, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    # ---- loading -------------------------------------------------------------------------------
    _STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith("model."):
                name = name[len("model."):]
            if "rotary_emb" in name or (name.startswith("lm_head") and self.lm_head is None):
                continue
            parts = name.split(".")
            target, shard = name, None
            if len(parts) >= 2 and parts[-2] in self._STACKED:
                fused, shard = self._STACKED[parts[-2]]
                target = ".".join(parts[:-2] + [fused, parts[-1]])
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            param = params[target]
            with torch.no_grad():
                if shard is None:
                    param.copy_(tensor)
                else:
                    sizes = self._shard_sizes(target)
                    offset = sum(sizes[:shard])
                    param.narrow(0, offset, sizes[shard]).copy_(tensor)
            loaded.add(f"{target}#{shard}")
        expected = {f"{n}#{s}" for n in params for s in self._expected_shards(n)}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")

    def _shard_sizes(self, target: str) -> list[int]:
        attn = self.layers[0].self_attn
        if ".qkv_proj." in target:
            return [attn.q_size, attn.kv_size, attn.kv_size]
        inter = self.layers[0].mlp.inter
        return [inter, inter]

    def _expected_shards(self, name: str) -> list:
        if ".qkv_proj." in name:
            return [0, 1, 2]
        if ".gate_up_proj." in name:
            return [0, 1]
        return [None]


class Qwen2ForCausalLM(LlamaForCausalLM):
    def qkv_bias(self, config) -> bool:
        return True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
