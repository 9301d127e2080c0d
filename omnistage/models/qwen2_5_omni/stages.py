"""Qwen2.5-Omni's thinker text LM and talker as AR-stage components (the AR stage's process).

Declared as components of the model's registry entry (`models/registry.py`); an AR `StageSpec` whose
`options["component"]` names one is served by `AREngine` from the omni checkpoint folder itself:

  * "qwen2_5_omni.thinker": the thinker's text decoder (`thinker.model.*` + `thinker.lm_head`) as our
    native `Qwen2ForCausalLM`, with the text config's `rope_parameters` (incl. `mrope_section`), so
    a prompt with images gets 3-D rope positions; tokenizer and eos ids from the folder.
  * "qwen2_5_omni.talker": the talker's decoder (`talker.model.layers/norm`) with `lm_head` =
    `talker.codec_head` and an embedding table folded from the codec table and the input
    projection: `embed[c] = codec_embed[c] @ W^T` (talker width). The projection is linear, so a
    row `W (text + codec_embed[c]) + b` equals `embed[c] + (W text + b)`; the second term is what
    the thinker -> talker adapter streams (`adapters.py`). No tokenizer; eos = codec pad and eos.

Loader contract (`ar.engine.ModelLoader`): `loader(model_dir, device, dtype, max_positions) -> (model,
text_config, tokenizer or None, eos_ids)`. Only the tensors of the component are read from the safetensors
(a `load_format="dummy"` folder's decoders are drawn in place: `models/dummy.py`).
"""

from __future__ import annotations

import copy
from typing import Optional

import torch

from omnistage.models.llama import Qwen2ForCausalLM
from omnistage.models import dummy
from omnistage.models.loader import checkpoint_names, config_copy, eos_ids, read_tensors
from omnistage.models.qwen2_5_omni.weights import talker_weights, thinker_text_weights

THINKER = "qwen2_5_omni.thinker"
TALKER = "qwen2_5_omni.talker"


def omni_config(model_dir: str):
    """The folder's `Qwen2_5OmniConfig`, a private copy (callers may change it)."""
    return config_copy(model_dir)


def _build(config, weights, device: torch.device, dtype: torch.dtype,
           max_positions: Optional[int]) -> Qwen2ForCausalLM:
    """`max_positions`: rope table length; None (or more than the model has) = the model's own."""
    max_positions = min(max_positions or config.max_position_embeddings, config.max_position_embeddings)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config, max_positions)
    model = model.to_empty(device=device).to(dtype=dtype)   # weights are cast as they are copied in
    if weights is None:                         # load_format="dummy"
        dummy.init_dummy_(model)
    else:
        model.load_weights(weights)
    model.rotary.build(device)
    return model.eval()


def _has_tensor(model_dir: str, name: str) -> bool:
    return name in checkpoint_names(model_dir)


def _thinker_eos(model_dir: str, tokenizer, text_config) -> frozenset[int]:
    eos = getattr(text_config, "eos_token_id", None)
    extra = eos if isinstance(eos, list) else [eos] if eos is not None else []
    return frozenset(int(i) for i in eos_ids(model_dir, tokenizer) | set(extra))


def load_thinker(model_dir: str, device: torch.device, dtype: torch.dtype, max_positions: int):
    from transformers import AutoTokenizer

    config = omni_config(model_dir).thinker_config.text_config
    # The real checkpoints ship an untied `thinker.lm_head`; the text config's default says tied.
    config.tie_word_embeddings = not _has_tensor(model_dir, "thinker.lm_head.weight")
    config.architectures = ["Qwen2ForCausalLM"]
    weights = None if dummy.is_dummy(model_dir) else thinker_text_weights(read_tensors(
        model_dir, lambda n: n.startswith("thinker.model.") or n == "thinker.lm_head.weight"))
    model = _build(config, weights, device, dtype, max_positions)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return model, config, tokenizer, _thinker_eos(model_dir, tokenizer, config)


def load_talker(model_dir: str, device: torch.device, dtype: torch.dtype, max_positions: int):
    talker = omni_config(model_dir).talker_config
    config = copy.copy(talker)
    config.tie_word_embeddings = False
    config.architectures = ["Qwen2ForCausalLM"]
    weights = None                                  # load_format="dummy": drawn in place
    if not dummy.is_dummy(model_dir):
        tensors = dict(talker_weights(read_tensors(model_dir, lambda n: n.startswith("talker."))))
        codec = tensors.pop("codec_embed.weight").to(device, torch.float32)
        proj = tensors.pop("input_proj.weight").to(device, torch.float32)
        tensors.pop("input_proj.bias")              # streamed by the adapter with each text vector
        tensors["model.embed_tokens.weight"] = codec @ proj.T
        weights = tensors.items()
    model = _build(config, weights, device, dtype, max_positions)
    eos = frozenset({int(talker.tts_codec_pad_token_id), int(talker.tts_codec_end_token_id)})
    return model, config, None, eos

