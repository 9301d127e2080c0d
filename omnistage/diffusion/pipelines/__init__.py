"""Model families of the diffusion engine, chosen by the `_class_name` in a folder's model_index.json.

In: a diffusers pipeline class name. Out: the `DiffusionFamily` subclass that serves it (one file per
family in this package). Families import lazily so loading one model does not import the others.
"""

from __future__ import annotations

import importlib

# model_index `_class_name` -> "module:Class" of the family serving it
FAMILIES: dict[str, str] = {
    "QwenImagePipeline": "qwen_image:QwenImageFamily",
    "QwenImageEditPipeline": "qwen_image_edit:QwenImageEditFamily",
    "FluxPipeline": "flux:FluxFamily",
    "StableDiffusion3Pipeline": "sd3:SD3Family",
    "ZImagePipeline": "z_image:ZImageFamily",
    "WanPipeline": "wan:WanFamily",
    "WanImageToVideoPipeline": "wan:WanI2VFamily",
}


def family_for(class_name: str):
    spec = FAMILIES.get(class_name)
    if spec is None:
        raise ValueError(f"diffusers pipeline {class_name!r} is not supported; supported: {', '.join(FAMILIES)}")
    module, cls = spec.split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)
