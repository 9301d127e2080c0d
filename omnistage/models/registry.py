"""The one model registry: everything omnistage serves, one entry per architecture (any process).

An entry declares what a model brings, as "module:attribute" strings that are imported only when
used, so reading the registry imports no model code and a stage process imports only its own model:

  * `match`: the names a checkpoint folder gives: config.json `model_type` (multi-network
    checkpoints) or `architectures[0]`, or model_index.json `_class_name` (diffusers folders);
  * `decoder`: the native decoder class an AR stage runs for a plain LLM checkpoint;
  * `components`: AR parts of a multi-network checkpoint (component name -> loader, see `ar_loader`);
  * `family`: the diffusion family class serving a diffusers folder;
  * `pipeline`: `builder(model_dir, engine: EngineConfig) -> PipelineSpec`; None = the kind's
    default pipeline (`pipeline/build.py`);
  * `adapters`: edge adapters it registers (adapter name -> function of one upstream output, or a
    class built per edge with the edge's options: `omnistage/adapters.py`);
  * `codecs`: codec back ends it registers (back-end name -> the codec model class, whose
    `from_stage_spec(spec)` builds the stage's `CodecEngine`);
  * `chat_renderer`: class built with the `PipelineSpec`, turning chat messages (text, image,
    audio, video parts) into the main stage's inputs; None = the tokenizer's chat template;
  * `tool_parser`: the tool-call format its chat answers use ("hermes", "llama3_json"), for
    checkpoints whose chat template does not show it.

Adding a model = one folder under `models/` + one entry in `MODELS`.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

KINDS = ("llm", "omni", "diffusion", "speech")


@dataclass(frozen=True)
class ModelEntry:
    name: str                                   # registry key; also `PipelineSpec.model`
    kind: str                                   # "llm" | "omni" | "diffusion" | "speech" (a TTS back end, no folder)
    match: tuple[str, ...] = ()                 # checkpoint names this entry serves (see the module docstring)
    decoder: Optional[str] = None               # "module:Class" of the native AR decoder
    components: dict[str, str] = field(default_factory=dict)  # AR component name -> "module:loader"
    family: Optional[str] = None                # "module:Class" of the DiffusionFamily
    pipeline: Optional[str] = None              # "module:builder"; None = the kind's default pipeline
    adapters: dict[str, str] = field(default_factory=dict)    # edge adapter name -> "module:function|Class"
    codecs: dict[str, str] = field(default_factory=dict)      # codec back end name -> "module:ModelClass"
    chat_renderer: Optional[str] = None         # "module:Class" built with the PipelineSpec
    tool_parser: Optional[str] = None           # tool-call format of its answers (entrypoints/openai/tool_calls.py)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"model entry {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")


_LLAMA = "omnistage.models.llama"
_DIFFUSERS = "omnistage.diffusion.pipelines"
_OMNI = "omnistage.models.qwen2_5_omni"
_TTS = "omnistage.models.qwen3_tts"
_Q3O = "omnistage.models.qwen3_omni"

MODELS: tuple[ModelEntry, ...] = (
    ModelEntry("llama", "llm", ("LlamaForCausalLM", "MistralForCausalLM"), decoder=f"{_LLAMA}:LlamaForCausalLM",
               tool_parser="llama3_json"),
    ModelEntry("qwen2", "llm", ("Qwen2ForCausalLM",), decoder=f"{_LLAMA}:Qwen2ForCausalLM", tool_parser="hermes"),
    ModelEntry("qwen3", "llm", ("Qwen3ForCausalLM",), decoder=f"{_LLAMA}:Qwen3ForCausalLM", tool_parser="hermes"),
    ModelEntry(
        "qwen2_5_omni", "omni", ("qwen2_5_omni",),
        components={"qwen2_5_omni.thinker": f"{_OMNI}.stages:load_thinker",
                    "qwen2_5_omni.talker": f"{_OMNI}.stages:load_talker"},
        pipeline=f"{_OMNI}.pipeline:omni_pipeline",
        adapters={"qwen2_5_omni.thinker_to_talker": f"{_OMNI}.adapters:ThinkerToTalker",
                  "qwen2_5_omni.talker_to_code2wav": f"{_OMNI}.adapters:talker_to_code2wav"},
        codecs={"qwen2_5_omni_code2wav": f"{_OMNI}.code2wav:Code2Wav"},
        chat_renderer=f"{_OMNI}.pipeline:OmniChatRenderer", tool_parser="hermes"),
    ModelEntry(
        "qwen3_omni", "omni", ("qwen3_omni_moe",),
        components={"qwen3_omni.thinker": f"{_Q3O}.thinker:load_thinker",
                    "qwen3_omni.talker": f"{_Q3O}.talker:load_talker"},
        pipeline=f"{_Q3O}.pipeline:qwen3_omni_pipeline",
        adapters={"qwen3_omni.thinker_to_talker": f"{_Q3O}.adapters:ThinkerToTalker",
                  "qwen3_omni.talker_to_code2wav": f"{_TTS}.pipeline:talker_to_decoder"},
        codecs={"qwen3_omni_code2wav": f"{_Q3O}.code2wav:Code2WavStage"},
        chat_renderer=f"{_Q3O}.pipeline:Qwen3OmniChatRenderer", tool_parser="hermes"),
    ModelEntry(
        "qwen3_tts", "omni", ("qwen3_tts",),
        components={"qwen3_tts.talker": f"{_TTS}.talker:load_talker"},
        pipeline=f"{_TTS}.pipeline:qwen3_tts_pipeline",
        adapters={"qwen3_tts.talker_to_decoder": f"{_TTS}.pipeline:talker_to_decoder"},
        codecs={"qwen3_tts_decoder": f"{_TTS}.codec:Qwen3TTSDecoderStage"}),
    ModelEntry("qwen_image", "diffusion", ("QwenImagePipeline",), family=f"{_DIFFUSERS}.qwen_image:QwenImageFamily"),
    ModelEntry("qwen_image_edit", "diffusion", ("QwenImageEditPipeline",),
               family=f"{_DIFFUSERS}.qwen_image_edit:QwenImageEditFamily"),
    ModelEntry("flux", "diffusion", ("FluxPipeline",), family=f"{_DIFFUSERS}.flux:FluxFamily"),
    ModelEntry("sd3", "diffusion", ("StableDiffusion3Pipeline",), family=f"{_DIFFUSERS}.sd3:SD3Family"),
    ModelEntry("z_image", "diffusion", ("ZImagePipeline",), family=f"{_DIFFUSERS}.z_image:ZImageFamily"),
    ModelEntry("wan", "diffusion", ("WanPipeline",), family=f"{_DIFFUSERS}.wan:WanFamily"),
    ModelEntry("wan_i2v", "diffusion", ("WanImageToVideoPipeline",), family=f"{_DIFFUSERS}.wan:WanI2VFamily"),
    # Speech back ends and the glue that puts one behind any chat LM (a cascade: pipeline/build.py).
    ModelEntry("piper", "speech",
               adapters={"text_to_tts": "omnistage.codec.speech:text_to_tts",
                         "text_to_text": "omnistage.codec.speech:text_to_text"},
               codecs={"piper": "omnistage.models.piper.tts:PiperTTS"}),
)


def load_attr(target: str) -> Any:
    """"module:attribute" -> the attribute (imports the module)."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def entry(name: str) -> ModelEntry:
    for e in MODELS:
        if e.name == name:
            return e
    raise ValueError(f"model must be one of {sorted(e.name for e in MODELS)}, got {name!r}")


def _declared(what: str) -> dict[str, str]:
    """name -> target of every entry's `what` ("components", "adapters" or "codecs")."""
    found: dict[str, str] = {}
    for e in MODELS:
        found.update(getattr(e, what))
    return found


def _lookup(what: str, label: str, name: Optional[str]) -> Any:
    declared = _declared(what)
    if name not in declared:
        raise ValueError(f"{label} must be one of {sorted(declared)}, got {name!r}")
    return load_attr(declared[name])


def adapter_target(name: str) -> Any:
    """The registered edge adapter (a function or an adapter class) named `name`."""
    return _lookup("adapters", "adapter", name)


def codec_class(name: Optional[str]) -> Any:
    """The codec model class of the back end `name`; its `from_stage_spec(spec)` builds the stage engine."""
    return _lookup("codecs", "backend", name)


def component_loader(name: str) -> Any:
    """The loader of an AR component: `loader(model_dir, device, dtype, max_positions) -> (model,
    text config, tokenizer or None, eos ids)`."""
    return _lookup("components", "component", name)


def diffusion_family(model_dir: str) -> type:
    """The DiffusionFamily class serving a diffusers folder."""
    found = entry_for_folder(model_dir)
    if found.family is None:
        raise ValueError(f"{model_dir} is not a diffusers folder (it holds a {found.name} checkpoint)")
    return load_attr(found.family)


def supported_architectures() -> list[str]:
    return sorted(m for e in MODELS if e.kind in ("llm", "omni") for m in e.match)


def read_folder_names(model_dir: str) -> tuple[str, list[str]]:
    """("diffusers", [_class_name]) or ("transformers", [model_type, architectures[0]]) of a folder."""
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model folder {model_dir!r} does not exist")
    index = os.path.join(model_dir, "model_index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            return "diffusers", [json.load(f).get("_class_name", "")]
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise ValueError(f"{model_dir} has neither config.json (transformers) nor model_index.json (diffusers)")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    return "transformers", [config.get("model_type") or "", (config.get("architectures") or ["?"])[0]]


def entry_for_architecture(architecture: str) -> ModelEntry:
    for e in MODELS:
        if e.kind == "llm" and architecture in e.match:
            return e
    raise ValueError(f"architecture {architecture!r} is not supported; supported: "
                     f"{', '.join(supported_architectures())}")


def entry_for_folder(model_dir: str) -> ModelEntry:
    """The entry serving a local checkpoint folder (a clear error naming what is supported)."""
    layout, names = read_folder_names(model_dir)
    kinds = ("diffusion",) if layout == "diffusers" else ("omni", "llm")
    for name in names:
        for e in MODELS:
            if e.kind in kinds and name and name in e.match:
                return e
    if layout == "diffusers":
        supported = sorted(m for e in MODELS if e.kind == "diffusion" for m in e.match)
        raise ValueError(f"diffusers pipeline {names[0]!r} is not supported; supported: {', '.join(supported)}")
    return entry_for_architecture(names[-1])     # raises, naming the supported architectures
