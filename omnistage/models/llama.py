"""Native decoder LMs: Llama (incl. SmolLM2), Qwen2 / Qwen2.5 and Qwen3 (dense).

In: flattened token ids and positions of one engine step plus `AttentionMetadata`; out: hidden
states [T, hidden], and logits for the rows the runner asks for. The three families share one
structure; they differ in declared flags: Qwen2 has q/k/v biases, Qwen3 normalises q and k per
head and may set `head_dim` explicitly. Weights load from transformers checkpoints by name, with
q/k/v and gate/up stacked into single matrices so each is one GEMM. Under tensor parallelism the
model declares its `tp_plan` and is built as one rank's shard (parallel/tensor.py). With
`quantization="fp8"` the AR engine calls `quantize_fp8` after loading: the decoder layers' linear
layers (`FP8_LINEARS`) become `layers.fp8_linear.Fp8Linear` (one scale per output row; the stacked
q|k|v and gate|up rows each keep their own scale, so stacking changes nothing); the embeddings,
lm_head, norms, MoE routers and experts stay in the model dtype.

A layer's elementwise work goes through `layers.fused` (one Triton kernel each on CUDA): the residual
add rides with the next RMSNorm (layers pass (hidden, residual) along), the Qwen3 q/k norms and the
KV-cache write ride with the rotary (on a decode-only step all three inside the decode attention kernel,
`attention.rope_attend`), and the MLP's activation with its product. Each token's rotary
cos / sin rows are looked up once per forward. At <= 8 rows on CUDA each linear may instead be one
`layers.triton_decode` GEMV (bf16 and FP8 weights alike) where its measured tiles table says it beats
this path (`OMNISTAGE_DECODE_KERNELS`: 0 never, 1 always, unset by the table): qkv with the residual add +
input norm (+ bias) as its prologue, o alone, the dense MLP's gate_up with the residual add + norm and
SiLU*mul, down with the residual add; a dense layer with the fused MLP hands on its residual stream whole,
`(h, None)`.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.layers import fused, triton_decode
from omnistage.layers.attention import AttentionMetadata, rope_attend
from omnistage.layers.fp8_linear import quantize_fp8
from omnistage.layers.norm import RMSNorm
from omnistage.layers.rotary import RotaryEmbedding
from omnistage.parallel.tensor import TPPlan, apply_plan, vocab_logits

_ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class Attention(nn.Module):
    def __init__(self, config, qkv_bias: bool, qk_norm: bool, o_bias: bool):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_dim ** -0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.kv_cache: torch.Tensor | None = None               # [2, blocks, block_size, KVH, D], bound by the runner

    # per rank under tensor parallelism: the plan splits num_heads / num_kv_heads (parallel/tensor.py)
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """x [T, hidden]; rope: the step's cos, sin rows [T, head_dim] (`RotaryEmbedding.tables`)."""
        return self.o_proj(self._attend(self.qkv_proj(x), rope, meta))

    def forward_prenorm(self, x: torch.Tensor, residual: Optional[torch.Tensor], norm: RMSNorm, rope,
                        meta: AttentionMetadata, owner: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(o, h): the attention block's output before its residual add, and h = x + residual (x with
        residual None), `norm` the input RMSNorm. Per linear (`triton_decode.chooses`): qkv as one GEMV with
        the residual add + norm (+ bias) inside, or the norm kernel + `qkv_proj`; o as one GEMV (split-K
        reduced in-kernel) or `o_proj`. `owner`: whose split-K tickets (`triton_decode.counters`; the layer's:
        stages sharing a GPU run their layers side by side on their own streams)."""
        qkv_lin, o_lin = self.qkv_proj, self.o_proj
        if triton_decode.chooses(x, qkv_lin, triton_decode.fusion(norm=True, bias=qkv_lin.bias is not None)):
            qkv = triton_decode.decode_gemv(x, *triton_decode.weights(qkv_lin), residual=residual,
                                            norm_weight=norm.weight, eps=norm.eps,
                                            tickets=triton_decode.counters(owner, x.device))
            qkv, h = (qkv, x) if residual is None else qkv
        else:
            normed, h = (norm(x), x) if residual is None else norm(x, residual)
            qkv = qkv_lin(normed)
        o = self._attend(qkv, rope, meta)
        if triton_decode.chooses(o, o_lin, triton_decode.fusion(bias=o_lin.bias is not None)):
            return triton_decode.decode_gemv(o, *triton_decode.weights(o_lin),
                                             tickets=triton_decode.counters(owner, o.device)), h
        return o_lin(o), h

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, q + 2 kv] -> q [T, H, D], k and v [T, KVH, D] (views)."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim),
                v.view(t, self.num_kv_heads, self.head_dim))

    def _attend(self, qkv: torch.Tensor, rope, meta: AttentionMetadata) -> torch.Tensor:
        """qkv [T, q + 2 kv] -> rotary (+ q/k norms) and KV write, attention -> [T, q_size] (`rope_attend`)."""
        t = qkv.shape[0]
        out = rope_attend(*self._heads(qkv), *rope, self.kv_cache, meta, self.scale, self.q_norm, self.k_norm)
        return out.reshape(t, self.q_size)


class MLP(nn.Module):
    def __init__(self, config, bias: bool):
        super().__init__()
        self.inter = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.inter, bias=bias)
        self.down_proj = nn.Linear(self.inter, config.hidden_size, bias=bias)
        self.act = None if config.hidden_act == "silu" else _ACTS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act is None:
            return self.down_proj(fused.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)     # this rank's halves under tensor parallelism
        return self.down_proj(self.act(gate) * up)

    def fused_forward(self, o: torch.Tensor, h: torch.Tensor, norm: RMSNorm, tickets: torch.Tensor) -> torch.Tensor:
        """A decode step's MLP block at <= triton_decode.MAX_M rows (SiLU) after the attention output o and
        the residual stream h: norm(o + h) -> gate_up -> silu * mul (one kernel), down + the residual add
        (one kernel) -> the residual stream."""
        act, h = triton_decode.decode_gemv(o, *triton_decode.weights(self.gate_up_proj), residual=h,
                                           norm_weight=norm.weight, eps=norm.eps, gated=True, tickets=tickets)
        return triton_decode.decode_gemv(act, *triton_decode.weights(self.down_proj), add=h, tickets=tickets)

    def fuses(self, x: torch.Tensor) -> bool:
        """Whether rows like `x` take `fused_forward` (`triton_decode.chooses` both of its launches; SiLU only)."""
        bias = self.gate_up_proj.bias is not None
        return (self.act is None and triton_decode.chooses(x, self.gate_up_proj, triton_decode.fusion(
            norm=True, bias=bias, gated=True)) and triton_decode.chooses(x, self.down_proj, triton_decode.fusion(
                bias=bias, add=True)))


class DecoderLayer(nn.Module):
    def __init__(self, config, qkv_bias, qk_norm, o_bias, mlp_bias):
        super().__init__()
        self.self_attn = Attention(config, qkv_bias, qk_norm, o_bias)
        self.mlp = MLP(config, mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, rope, meta):
        """(x, residual): this layer's input is x + residual (residual None: x alone) -> the same pair
        for the next layer, so each residual add runs inside the norm (or GEMV prologue) that follows it.
        At decode sizes on CUDA each linear may take a `triton_decode` GEMV with the norm / residual add /
        SiLU*mul inside (`Attention.forward_prenorm`, `MLP.fuses`); a fused MLP returns (h, None)."""
        o, h = self.self_attn.forward_prenorm(x, residual, self.input_layernorm, rope, meta, self)
        mlp = self.mlp
        if isinstance(mlp, MLP) and mlp.fuses(o):
            return mlp.fused_forward(o, h, self.post_attention_layernorm, triton_decode.counters(self, o.device)), None
        normed, h = self.post_attention_layernorm(o, h)
        return self.mlp(normed), h


class LlamaForCausalLM(nn.Module):
    """Llama-structured decoder; subclasses set the per-family flags."""

    qk_norm = False
    # tensor parallelism (parallel/tensor.py): heads, stacked q|k|v and gate|up split by output, o / down by input
    tp_plan = TPPlan(attention="layers.*.self_attn", qkv="layers.*.self_attn.qkv_proj",
                     column={"layers.*.mlp.gate_up_proj": 2},
                     row=("layers.*.self_attn.o_proj", "layers.*.mlp.down_proj"), vocab=("embed_tokens", "lm_head"))

    # the linear layers (last name part) inside `layers.*` that `quantize_fp8` swaps; dense MLPs and MoE
    # shared experts both name theirs gate_up_proj / down_proj, routers (`mlp.gate`) are left alone
    FP8_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

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
            DecoderLayer(config, self.qkv_bias(config), self.qk_norm, att_bias, mlp_bias)
            for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        apply_plan(self, self.tp_plan)

    # ---- engine-facing interface --------------------------------------------------------------
    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rotary.tables(positions)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, meta)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return vocab_logits(hidden, weight, self.config.vocab_size)

    def quantize_fp8(self, ignored: tuple = ()) -> int:
        """FP8 weights for the decoder layers' `FP8_LINEARS` whose name (e.g. "layers.3.self_attn.o_proj")
        contains none of `ignored`; returns how many were swapped. Call after the weights are loaded."""
        return sum(quantize_fp8(layer, ignored, f"layers.{i}.", self.FP8_LINEARS) for i, layer in enumerate(self.layers))

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
            owner = self.get_submodule(target.rpartition(".")[0])
            with torch.no_grad():
                if hasattr(owner, "load_shard"):        # a tensor-parallel shard takes its slice itself
                    owner.load_shard(param, tensor, shard)
                elif shard is None:
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
