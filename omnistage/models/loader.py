"""Load a transformers-layout checkpoint folder into a native model (stage process, CPU or CUDA).

In: a folder with config.json and model.safetensors or sharded model-*.safetensors + index json
(or, marked `load_format="dummy"`, config files only: `models/dummy.py` draws the weights).
Out: the model on the target device and dtype, in eval mode, with weights streamed file by file.
"""

from __future__ import annotations

import copy
import functools
import json
import os
from typing import Callable, Iterator

import torch
from safetensors import safe_open
from transformers import AutoConfig

from omnistage.models import dummy
from omnistage.models.registry import entry_for_architecture, load_attr


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, n) for n in names]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return [single]
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
    return [os.path.join(model_dir, f) for f in files]


def read_tensors(model_dir: str, wanted: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the checkpoint tensors whose name `wanted` accepts (others are not read);
    of a dummy folder, drawn tensors of the checkpoint's names and shapes."""
    if dummy.is_dummy(model_dir):
        for name, (shape, dtype) in dummy.checkpoint_shapes(model_dir).items():
            if wanted(name):
                yield name, dummy.draw(name, shape, dtype)
        return
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if wanted(name):
                    yield name, f.get_tensor(name)


def config_copy(model_dir: str):
    """The folder's transformers config (`AutoConfig`), read once per folder; a private copy (callers
    may change it)."""
    return copy.deepcopy(_cached_config(os.path.realpath(model_dir)))


@functools.lru_cache(maxsize=4)
def _cached_config(model_dir: str):
    return AutoConfig.from_pretrained(model_dir)


def load_thinker_encoders(model_cls, model_dir: str, prefixes: tuple[str, ...], device, dtype):
    """An omni checkpoint's transformers thinker model (`model_cls`) without decoder layers -- token
    embeddings, audio and vision encoders, rope index -- loaded from the tensors under `prefixes`."""
    from transformers.initialization import no_init_weights

    config = config_copy(model_dir).thinker_config
    config.text_config.num_hidden_layers = 0
    with torch.device(device), no_init_weights():   # every weight is loaded below; buffers are built here
        model = model_cls._from_config(config, dtype=dtype)
    state = {}
    for name, tensor in read_tensors(model_dir, lambda n: n.startswith(prefixes)):
        name = name[len("thinker."):]
        state[name.replace("model.embed_tokens.", "language_model.embed_tokens.")] = tensor
    missing, _ = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith("language_model.norm")]   # unused: no decoder layers
    if missing:
        raise ValueError(f"{model_dir}: thinker encoder weights missing from the checkpoint: {missing[:5]}")
    return model.eval()


def iter_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    return read_tensors(model_dir, lambda name: True)


def checkpoint_names(model_dir: str) -> list[str]:
    """The checkpoint's tensor names (headers only; of a dummy folder, the names it would hold)."""
    if dummy.is_dummy(model_dir):
        return list(dummy.checkpoint_shapes(model_dir))
    names = []
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            names.extend(f.keys())
    return names


def load_model(model_dir: str, config, device: torch.device, dtype: torch.dtype, max_positions: int):
    arch = (getattr(config, "architectures", None) or ["?"])[0]
    cls = load_attr(entry_for_architecture(arch).decoder)
    with torch.device("meta"):
        model = cls(config, max_positions)
    model = model.to_empty(device=device)
    if dummy.is_dummy(model_dir):               # drawn where it runs, in the dtype it runs in
        dummy.init_dummy_(model.to(dtype=dtype))
    else:
        model.load_weights(iter_weights(model_dir))
    model.to(dtype=dtype)
    model.rotary.build(device)
    return model.eval()


def eos_ids(model_dir: str, tokenizer) -> frozenset[int]:
    """End-of-sequence ids: generation_config.json's `eos_token_id` (one or a list) and the tokenizer's."""
    ids: set[int] = set()
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def load_causal_lm(model_dir: str, device: torch.device, dtype: torch.dtype, max_positions: int | None):
    """An AR stage's loader for a plain LLM folder (the registry's component contract): (native
    decoder, its config, tokenizer, eos ids); `max_positions` None = the model's own limit."""
    from transformers import AutoTokenizer

    config = load_config(model_dir)
    limit = getattr(config, "max_position_embeddings", None) or 4096
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_model(model_dir, config, device, dtype, min(max_positions or limit, limit))
    return model, config, tokenizer, eos_ids(model_dir, tokenizer)


def load_config(model_dir: str):
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model folder {model_dir!r} does not exist")
    return AutoConfig.from_pretrained(model_dir)


def lm_shape(config) -> dict[str, int]:
    """The numbers of a decoder-only LM's config that size its KV cache and activations."""
    heads = config.num_attention_heads
    return {"layers": config.num_hidden_layers,
            "kv_heads": getattr(config, "num_key_value_heads", None) or heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
            "hidden": config.hidden_size, "intermediate": config.intermediate_size, "vocab": config.vocab_size,
            "max_positions": getattr(config, "max_position_embeddings", None) or 4096}
