"""Load a transformers-layout checkpoint folder into a native model (stage process, CPU or CUDA).

In: a folder with config.json and model.safetensors or sharded model-*.safetensors + index json.
Out: the model on the target device and dtype, in eval mode, with weights streamed file by file.
"""

from __future__ import annotations

import json
import os
from typing import Iterator

import torch
from safetensors import safe_open
from transformers import AutoConfig

from omnistage.models.registry import lookup


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


def iter_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def checkpoint_dtype(config) -> torch.dtype | None:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def load_model(model_dir: str, config, device: torch.device, dtype: torch.dtype, max_positions: int):
    arch = (getattr(config, "architectures", None) or ["?"])[0]
    info = lookup(arch)
    with torch.device("meta"):
        model = info.cls(config, max_positions)
    model = model.to_empty(device=device)
    model.load_weights(iter_weights(model_dir))
    model.to(dtype=dtype)
    model.rotary.build(device)
    return model.eval()


def load_config(model_dir: str):
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model folder {model_dir!r} does not exist")
    return AutoConfig.from_pretrained(model_dir)
