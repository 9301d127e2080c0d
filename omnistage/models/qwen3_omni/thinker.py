"""Qwen3-Omni's thinker text decoder (Qwen3-MoE) as the AR component "qwen3_omni.thinker" (the AR stage's process).

In: one engine step's flattened token ids, positions (1-D, or [3, T] multimodal-rope rows), attention
metadata, optional input rows (token embeddings with audio / vision encoder rows merged by the chat
renderer) and `layer_adds` [L, T, H] (deepstack: the vision encoder's intermediate features, added to
the visual prompt rows after decoder layers 0..L-1, as transformers' `_deepstack_process` does).
Out: the last hidden states after the final norm [T, H] and, with `report_layer` set, also the hidden
states after that many layers (transformers' `hidden_states[accept_hidden_layer]`: what the talker
reads); logits through the thinker's own `lm_head`.

The decoder is `models.llama`'s Qwen3 structure (GQA attention with per-head q/k RMSNorm and the
config's `head_dim`, fused residual norms) with `layers.moe.SparseMoeBlock` as the MLP of every layer
transformers makes sparse (`decoder_sparse_step`, `mlp_only_layers`); the others keep the dense MLP. A
MoE layer hands its post-attention residual add + RMSNorm to the block (`forward_normed`: at decode sizes
on CUDA inside the router launch, one launch fewer per layer).
Rope is Qwen3-Omni's interleaved MRoPE (`mrope_interleaved`; transformers always interleaves here).
Weights: `thinker.model.*` (experts one by one, or fused as transformers holds them in memory) and
`thinker.lm_head.weight`; the audio and vision towers are the chat renderer's (`processor.py`). A
`load_format="dummy"` folder's decoder is drawn in place (`models/dummy.py`).

Loader contract (`ar.engine.ModelLoader`): `load_thinker(model_dir, device, dtype, max_positions) ->
(model, text_config, tokenizer, eos_ids)`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Optional

import torch

from omnistage.layers.attention import AttentionMetadata
from omnistage.layers.moe import SparseMoeBlock
from omnistage.models.llama import DecoderLayer, Qwen3ForCausalLM
from omnistage.models import dummy, loader
from omnistage.models.loader import eos_ids

THINKER = "qwen3_omni.thinker"
_MOE_NAME = re.compile(r"layers\.(\d+)\.mlp\.(.+)")


def is_sparse(config, layer: int) -> bool:
    """Whether decoder layer `layer` has a MoE block (transformers' rule for Qwen3-MoE decoders)."""
    return (layer not in (config.mlp_only_layers or []) and config.num_experts > 0
            and (layer + 1) % config.decoder_sparse_step == 0)


class MoeDecoderLayer(DecoderLayer):
    """A Qwen3 decoder layer whose MLP is a sparse MoE block."""

    def __init__(self, config, shared_expert_intermediate: int = 0):
        super().__init__(config, qkv_bias=bool(getattr(config, "attention_bias", False)), qk_norm=True,
                         o_bias=bool(getattr(config, "attention_bias", False)), mlp_bias=False)
        self.mlp = SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                                  config.moe_intermediate_size, bool(config.norm_topk_prob),
                                  shared_expert_intermediate)

    def forward(self, x, residual, rope, meta):
        """`DecoderLayer.forward` with the post-attention residual add + RMSNorm handed to the MoE block
        (`SparseMoeBlock.forward_normed`: at decode sizes on CUDA inside its router launch). The attention
        half is `Attention.forward_prenorm` (qkv and o each a `triton_decode` GEMV where its tiles table measured
        that faster; at bs1 neither is: the input norm, qkv, the attention launches, o, router, gate-up, down)."""
        o, h = self.self_attn.forward_prenorm(x, residual, self.input_layernorm, rope, meta, self)
        return self.mlp.forward_normed(o, h, self.post_attention_layernorm)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE decoder: MoE layers per the config (with a shared expert when the config sets
    `shared_expert_intermediate_size`, as Qwen3-Omni's talker does), deepstack rows, an optional
    reported layer."""

    def __init__(self, config, max_positions: int, report_layer: Optional[int] = None):
        super().__init__(config, max_positions)
        shared = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)   # the talker has one
        for i in range(config.num_hidden_layers):
            if is_sparse(config, i):
                self.layers[i] = MoeDecoderLayer(config, shared)
        if report_layer is not None and not 0 <= report_layer <= config.num_hidden_layers:
            raise ValueError(f"report_layer must be in [0, {config.num_hidden_layers}], got {report_layer}")
        self.report_layer = report_layer        # hidden states after this many layers are reported too

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                inputs_embeds: Optional[torch.Tensor] = None, layer_adds: Optional[torch.Tensor] = None):
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rotary.tables(positions)
        residual = None
        reported = x if self.report_layer == 0 else None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, rope, meta)
            if i + 1 == self.report_layer:      # transformers records a layer's output before deepstack
                reported = x if residual is None else x + residual   # a fused dense layer: (h, None)
            if layer_adds is not None and i < len(layer_adds):
                x = x + layer_adds[i]
        out = self.norm(x) if residual is None else self.norm(x, residual)[0]
        return out if self.report_layer is None else (out, reported)

    # ---- loading -------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Dense weights as `LlamaForCausalLM.load_weights` loads them; each MoE layer's by its block."""
        got: dict[int, set[str]] = {i: set() for i, layer in enumerate(self.layers) if isinstance(layer, MoeDecoderLayer)}

        def dense() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                m = _MOE_NAME.fullmatch(name[len("model."):] if name.startswith("model.") else name)
                if m is not None and int(m[1]) in got:
                    got[int(m[1])] |= self.layers[int(m[1])].mlp.load_weights([(m[2], tensor)])
                else:
                    yield name, tensor

        super().load_weights(dense())
        for i, names in got.items():
            missing = sorted(self.layers[i].mlp.expected_weights() - names)
            if missing:
                raise ValueError(f"checkpoint is missing weights of layer {i}'s MoE block: {missing[:8]}")

    def _shard_sizes(self, target: str) -> list[int]:
        if ".gate_up_proj." in target:           # a dense layer among MoE ones: its own width
            inter = self.layers[int(target.split(".")[1])].mlp.inter
            return [inter, inter]
        return super()._shard_sizes(target)

    def _expected_shards(self, name: str) -> list:
        if re.search(r"\.mlp\.(gate\.weight|w13|w2|shared_expert)", name):
            return []                            # checked per block in load_weights
        return super()._expected_shards(name)


def thinker_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint pairs -> the decoder's names: `thinker.model.X` (or transformers' in-memory
    `thinker.model.language_model.X`) -> `model.X`, `thinker.lm_head.weight` -> `lm_head.weight`;
    the towers are skipped."""
    for name, tensor in weights:
        if name == "thinker.lm_head.weight":
            yield "lm_head.weight", tensor
            continue
        for prefix in ("thinker.model.language_model.", "thinker.model."):
            if name.startswith(prefix):
                rest = name[len(prefix):]
                if not rest.startswith(("audio_tower.", "visual.")):
                    yield "model." + rest, tensor
                break


def read_tensors(model_dir: str, prefixes: tuple[str, ...]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the checkpoint tensors whose name starts with one of `prefixes`."""
    return loader.read_tensors(model_dir, lambda name: name.startswith(prefixes))


def omni_config(model_dir: str):
    """The folder's `Qwen3OmniMoeConfig`, a private copy (callers may change it)."""
    return loader.config_copy(model_dir)


def interleaved_mrope(config):
    """`config` (a text config, changed in place) with its rope declared as transformers runs it for
    Qwen3-Omni's thinker and talker: interleaved MRoPE, whatever the config's `interleaved` key says,
    over `mrope_section` (transformers' default [24, 20, 20] when the config has none)."""
    config.rope_parameters = {**(config.rope_parameters or {}), "mrope_interleaved": True}
    config.rope_parameters.setdefault("mrope_section", [24, 20, 20])
    return config


def thinker_text_config(model_dir: str):
    """The thinker's text config as our decoder reads it: interleaved MRoPE declared, untied lm_head."""
    config = interleaved_mrope(omni_config(model_dir).thinker_config.text_config)
    config.tie_word_embeddings = False
    config.architectures = ["Qwen3MoeForCausalLM"]
    return config


def accept_hidden_layer(model_dir: str) -> int:
    """The thinker layer whose output the talker reads (`talker_config.accept_hidden_layer`)."""
    return int(omni_config(model_dir).talker_config.accept_hidden_layer)


def load_thinker(model_dir: str, device: torch.device, dtype: torch.dtype, max_positions: Optional[int]):
    from transformers import AutoTokenizer

    config = thinker_text_config(model_dir)
    limit = config.max_position_embeddings
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config, min(max_positions or limit, limit),
                                    report_layer=accept_hidden_layer(model_dir))
    model = model.to_empty(device=device).to(dtype=dtype)   # weights are cast as they are copied in
    if dummy.is_dummy(model_dir):               # load_format="dummy": drawn in place
        dummy.init_dummy_(model)
    else:
        model.load_weights(thinker_weights(read_tensors(model_dir, ("thinker.model.", "thinker.lm_head."))))
    model.rotary.build(device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = getattr(config, "eos_token_id", None)
    extra = eos if isinstance(eos, list) else [eos] if eos is not None else []
    return model.eval(), config, tokenizer, frozenset(int(i) for i in eos_ids(model_dir, tokenizer) | set(extra))
