"""Qwen2.5-Omni's thinker text LM and talker as plain Qwen2 decoders: configs and weight-name maps.

In: the names and tensors of a Qwen2.5-Omni checkpoint (on disk, real and tiny alike, the layout is
`thinker.model.*` = text LM, `thinker.audio_tower.*`, `thinker.visual.*`, `thinker.lm_head`,
`talker.model.*`, `talker.thinker_to_talker_proj`, `talker.codec_head`, `token2wav.*`; transformers
5.x renames `thinker.model.*` to `thinker.model.language_model.*` only in memory).
Out: Qwen2 configs and `(qwen2_name, tensor)` pairs, which load into transformers'
`Qwen2ForCausalLM` or omnistage's native `Qwen2ForCausalLM` unchanged.

  checkpoint name                               Qwen2 name (thinker text LM)
  thinker.model.embed_tokens.weight             model.embed_tokens.weight
  thinker.model.layers.N.self_attn.{q,k,v}_proj.{weight,bias}, .o_proj.weight   model.layers.N.(same)
  thinker.model.layers.N.mlp.{gate,up,down}_proj.weight                         model.layers.N.(same)
  thinker.model.layers.N.{input,post_attention}_layernorm.weight                model.layers.N.(same)
  thinker.model.norm.weight                     model.norm.weight
  thinker.lm_head.weight                        lm_head.weight (untied in the real 7B / 3B)
  thinker.audio_tower.*, thinker.visual.*       (encoders; not part of the decoder)

  talker.model.embed_tokens.weight  [codec vocab, thinker hidden]   codec_embed.weight (extra: its
        width is the *thinker's* hidden size; codec embeddings are added to thinker states before
        `thinker_to_talker_proj`, so the Qwen2 decoder itself never embeds ids)
  talker.model.layers.N.* / talker.model.norm.weight                model.layers.N.* / model.norm.weight
  talker.codec_head.weight                                          lm_head.weight
  talker.thinker_to_talker_proj.{weight,bias} [talker hidden, thinker hidden]  input_proj.* (extra:
        applied to every input embedding before layer 0)

Text-only input makes both models' 3D M-RoPE collapse to plain 1D RoPE (all three position rows are
equal, so each rotary section reads the same angle), which is why a plain Qwen2 reproduces them;
multimodal prompts need the 3D positions of `get_rope_index` (see docs/qwen2_5_omni_notes.md).
Runs in whichever process loads a model; CPU or CUDA.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import torch


def _qwen2_config(src, vocab_size: int, **extra):
    from transformers import Qwen2Config

    rope = dict(src.rope_parameters or {})
    rope.pop("mrope_section", None)             # 1D rope: the sections only matter for 3D positions
    head_dim = getattr(src, "head_dim", None) or src.hidden_size // src.num_attention_heads
    return Qwen2Config(
        vocab_size=vocab_size, hidden_size=src.hidden_size, intermediate_size=src.intermediate_size,
        num_hidden_layers=src.num_hidden_layers, num_attention_heads=src.num_attention_heads,
        num_key_value_heads=src.num_key_value_heads, head_dim=head_dim, hidden_act=src.hidden_act,
        max_position_embeddings=src.max_position_embeddings, rms_norm_eps=src.rms_norm_eps,
        rope_parameters={"rope_type": rope.get("rope_type", "default"), "rope_theta": rope["rope_theta"]},
        tie_word_embeddings=False, use_sliding_window=False, architectures=["Qwen2ForCausalLM"],
        dtype="float32", **extra)


def thinker_text_config(omni_config):
    """A `Qwen2Config` for the thinker's text decoder (`omni_config`: a `Qwen2_5OmniConfig`)."""
    text = omni_config.thinker_config.text_config
    return _qwen2_config(text, text.vocab_size, eos_token_id=text.eos_token_id, pad_token_id=text.pad_token_id)


def talker_config(omni_config):
    """A `Qwen2Config` for the talker's decoder (vocab = codec ids; inputs come as embeddings)."""
    talker = omni_config.talker_config
    return _qwen2_config(talker, talker.vocab_size, eos_token_id=talker.tts_codec_end_token_id,
                         pad_token_id=talker.tts_codec_pad_token_id)


def thinker_text_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint (name, tensor) pairs -> the thinker text LM's Qwen2 pairs (see the module table)."""
    for name, tensor in weights:
        for prefix in ("thinker.model.language_model.", "thinker.model."):  # on-disk and in-memory layouts
            if name.startswith(prefix):
                rest = name[len(prefix):]
                if not rest.startswith(("audio_tower.", "visual.")):
                    yield "model." + rest, tensor
                break
        else:
            if name == "thinker.lm_head.weight":
                yield "lm_head.weight", tensor


def talker_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint pairs -> talker Qwen2 pairs plus the extras `codec_embed.weight` and
    `input_proj.{weight,bias}` (thinker width -> talker width)."""
    for name, tensor in weights:
        if name == "talker.model.embed_tokens.weight":
            yield "codec_embed.weight", tensor
        elif name.startswith("talker.model."):
            yield "model." + name[len("talker.model."):], tensor
        elif name == "talker.codec_head.weight":
            yield "lm_head.weight", tensor
        elif name.startswith("talker.thinker_to_talker_proj."):
            yield "input_proj." + name.rsplit(".", 1)[1], tensor


def export_thinker_text(omni_dir: str, out_dir: str) -> str:
    """Writes the thinker's text decoder as a plain `Qwen2ForCausalLM` folder (config, safetensors,
    tokenizer, generation config) that any Qwen2 loader, omnistage's AR engine included, serves.
    Text-only prompts give the same greedy ids as the thinker (tests/models/qwen2_5_omni/test_weights.py)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from omnistage.models.loader import iter_weights

    omni_config = AutoConfig.from_pretrained(omni_dir)
    config = thinker_text_config(omni_config)
    os.makedirs(out_dir, exist_ok=True)
    config.save_pretrained(out_dir)
    state = {name: t.contiguous() for name, t in thinker_text_weights(iter_weights(omni_dir))}
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    AutoTokenizer.from_pretrained(omni_dir).save_pretrained(out_dir)
    GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
                     do_sample=False).save_pretrained(out_dir)
    return out_dir
