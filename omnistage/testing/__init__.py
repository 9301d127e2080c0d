"""Tiny checkpoints in real formats, built in code for tests, benchmarks and `omnistage make-tiny`.

Nothing here is used while serving: `llm` (tokenizer + Llama / Qwen2 / Qwen3 decoders), `diffusion`
(every diffusers family) and `qwen2_5_omni` (thinker + talker + token2wav), `qwen3_tts` (talker +
code predictor + speech tokenizer, three variants), `qwen3_omni` (MoE thinker + MoE talker + code
predictor + code2wav) each write random
checkpoints with `save_pretrained`, so the real loading code runs on them. Runs in the caller's
process, on the CPU, in seconds.

``make_tiny(out_dir, kind) -> list[str]`` runs the builder registered under ``kind`` in
``TINY_BUILDERS`` (``"all"`` runs every builder) and returns the folders written.
"""

from __future__ import annotations

import os
from collections.abc import Callable



def _build_llms(out_dir: str) -> list[str]:
    from omnistage.testing.llm import _LM_CLASSES, make_tiny_lm

    return [make_tiny_lm(os.path.join(out_dir, f"tiny-{arch}"), arch) for arch in _LM_CLASSES]


# Diffusion kinds (`omnistage.testing.diffusion.DIFFUSION_TINY_BUILDERS`); imported only when built,
# so making a tiny LLM never imports diffusers.
DIFFUSION_KINDS = ("qwen-image", "flux", "flux-schnell", "sd3", "z-image", "wan", "wan2.2", "wan-i2v",
                   "qwen-image-edit")


def _diffusion_builder(kind: str) -> Callable[[str], list[str]]:
    def build(out_dir: str) -> list[str]:
        from omnistage.testing.diffusion import DIFFUSION_TINY_BUILDERS

        return [DIFFUSION_TINY_BUILDERS[kind](os.path.join(out_dir, f"tiny-{kind}"))]

    return build


def _build_omni(out_dir: str) -> list[str]:
    from omnistage.testing.qwen2_5_omni import make_tiny_qwen2_5_omni

    return [make_tiny_qwen2_5_omni(os.path.join(out_dir, "tiny-qwen2_5_omni"))]


def _build_qwen3_tts(out_dir: str) -> list[str]:
    from omnistage.testing.qwen3_tts import VARIANTS, make_tiny_qwen3_tts

    return [make_tiny_qwen3_tts(os.path.join(out_dir, f"tiny-qwen3_tts-{v}"), v) for v in VARIANTS]


def _build_qwen3_omni(out_dir: str) -> list[str]:
    from omnistage.testing.qwen3_omni import make_tiny_qwen3_omni

    return [make_tiny_qwen3_omni(os.path.join(out_dir, "tiny-qwen3_omni"))]


# kind -> builder(out_dir) returning the folders it wrote. Other model families register here.
TINY_BUILDERS: dict[str, Callable[[str], list[str]]] = {"llm": _build_llms, "qwen2_5_omni": _build_omni,
                                                     "qwen3_tts": _build_qwen3_tts, "qwen3_omni": _build_qwen3_omni}
TINY_BUILDERS.update({kind: _diffusion_builder(kind) for kind in DIFFUSION_KINDS})
# What `omnistage make-tiny --kind` accepts (its --help and README list exactly these; importing this
# package imports no torch, so --help stays instant).
TINY_KINDS = (*TINY_BUILDERS, "all")


def make_tiny(out_dir: str, kind: str = "llm") -> list[str]:
    """Builds the tiny checkpoints of ``kind`` (a key of ``TINY_BUILDERS``, or "all") under ``out_dir``."""
    if kind == "all":
        return [path for build in TINY_BUILDERS.values() for path in build(out_dir)]
    if kind not in TINY_BUILDERS:
        raise ValueError(f"kind={kind!r} is not a tiny model kind; allowed: {', '.join(TINY_KINDS)}")
    return TINY_BUILDERS[kind](out_dir)
