"""From a model folder to running stages: pipeline detection and stage construction (entry point's
process for `detect_pipeline`; the stage's own process for `build_engine`).

`detect_pipeline(model_dir, engine, deploy_config)` returns the `PipelineSpec` to run: the registry's
pipeline with the deploy config's overrides, and each stage's `EngineConfig` resolved once for its
kind (`resolve_stage`: a concrete device and dtype, `config.py`). What runs later -- the memory
planner, the stage processes, the engines -- reads those values; `build_engine` resolves only a spec
that did not come from here (tests), the same way.

Everything model-specific comes from the model registry (`models/registry.py`): the entry serving
the folder gives the pipeline builder (or the kind's default pipeline, here), the AR loaders, the
diffusion family, the codec back ends and the edge adapters. The engines themselves import no model
code: they are handed what they run.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any, Optional

from omnistage.adapters import EdgeAdapter, build_adapter
from omnistage.config import EngineConfig, checkpoint_dtype
from omnistage.models import registry
from omnistage.params import GENERATION_CONFIG_KEYS, DiffusionParams, SamplingParams, generation_defaults
from omnistage.pipeline.deploy_config import apply_deploy_config
from omnistage.spec import EdgeSpec, PipelineSpec, StageSpec

# The speech back end a chat LM is cascaded with when it is installed.
CASCADE_TTS_BACKEND = "piper"


def default_tts_backend() -> Optional[str]:
    """The TTS back end a chat LM is cascaded with, or None when none is installed."""
    from omnistage.models.piper.voices import piper_available

    return CASCADE_TTS_BACKEND if piper_available() else None


def tts_cascade(llm: StageSpec) -> PipelineSpec:
    """`llm` followed by the installed TTS back end, streaming one sentence at a time (if installed)."""
    backend = default_tts_backend()
    if backend is None:
        return PipelineSpec([llm])
    tts = StageSpec("tts", "codec", "", EngineConfig(device="cpu"), final_output="audio", backend=backend)
    return PipelineSpec([llm, tts], [EdgeSpec("llm", "tts", "text_to_tts", chunk_size=1, first_chunk_size=1)])


def resolve_stage(spec: StageSpec) -> StageSpec:
    """`spec` with its `EngineConfig` resolved for its kind (`EngineConfig.resolved`); an AR stage's
    `auto` dtype follows its checkpoint's."""
    ckpt = checkpoint_dtype(spec.model_dir) if spec.kind == "ar" and spec.engine.dtype == "auto" else None
    return dataclasses.replace(spec, engine=spec.engine.resolved(spec.kind, ckpt))


def _registry_pipeline(model_dir: str, engine: EngineConfig) -> PipelineSpec:
    entry = registry.entry_for_folder(model_dir)
    if entry.pipeline is not None:
        return registry.load_attr(entry.pipeline)(model_dir, engine)
    if entry.kind == "diffusion":
        return PipelineSpec([StageSpec("dit", "diffusion", model_dir, engine, final_output="image")])
    return tts_cascade(StageSpec("llm", "ar", model_dir, engine, final_output="text"))


GENERATION_CONFIG_MODES = ("auto", "vllm")     # `--generation-config`: the model's file, none; or a FOLDER


def read_generation_config(folder: str, mode: str = "auto", override: Optional[dict] = None) -> dict:
    """SamplingParams defaults of an AR model (vLLM's `--generation-config`): "auto" reads
    `folder/generation_config.json`, "vllm" reads nothing (the engine's own defaults), any other
    value is a folder whose generation_config.json is read; `override` (HF key names, e.g.
    `{"temperature": 0.2, "max_new_tokens": 256}`) wins over the file. Its `max_tokens` entry is
    the answer cap (EngineConfig.default_max_tokens)."""
    if override is not None and not isinstance(override, dict):
        raise ValueError(f"override_generation_config must be a JSON object, got {override!r}")
    unknown = sorted(set(override or {}) - set(GENERATION_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"override_generation_config keys must be among {sorted(GENERATION_CONFIG_KEYS)}; "
                         f"got {unknown}")
    source = folder if mode == "auto" else None if mode == "vllm" else mode
    if source is not None and mode != "auto" and not os.path.isdir(source):
        raise ValueError(f"generation_config must be auto, vllm or a folder with a generation_config.json; "
                         f"got {mode!r}")
    found: dict = {}
    path = os.path.join(source, "generation_config.json") if source else None
    if path and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            found = generation_defaults(json.load(f), path)
    return {**found, **generation_defaults(override or {}, "override_generation_config")}


def _with_generation_defaults(spec: PipelineSpec, mode: str, override: Optional[dict]) -> PipelineSpec:
    """The main stage, when it is an AR stage, with its generation-config defaults: sampling fields
    as its default request params, `max_new_tokens` as its answer cap."""
    main = spec.main_stage
    if main.kind != "ar":
        return spec
    defaults = read_generation_config(main.model_dir, mode, override)
    cap = defaults.pop("max_tokens", None)
    engine = dataclasses.replace(main.engine, default_max_tokens=cap) if cap is not None else main.engine
    main = dataclasses.replace(main, engine=engine, params={**defaults, **main.params})
    return dataclasses.replace(spec, stages=[main, *spec.stages[1:]])


# EngineConfig fields that say how a deployment scales out, and where its weights come from: the
# pipeline-wide values reach every stage (a pipeline builder may give a stage its own EngineConfig); the
# deploy config then sets them per stage.
SCALE_OUT_FIELDS = ("num_replicas", "distributed_executor_backend", "ray_address", "load_format")


def mark_load_format(spec: StageSpec) -> None:
    """A `load_format="dummy"` stage's folder is marked so in this process: every weight reader of it
    draws instead of reading (`models/dummy.py`)."""
    if spec.engine.load_format == "dummy" and spec.model_dir:
        from omnistage.models.dummy import use_dummy_weights

        use_dummy_weights(spec.model_dir)


def _with_scale_out(spec: PipelineSpec, engine: EngineConfig) -> PipelineSpec:
    scale = {k: getattr(engine, k) for k in SCALE_OUT_FIELDS}
    return dataclasses.replace(spec, stages=[dataclasses.replace(s, engine=dataclasses.replace(s.engine, **scale))
                                             for s in spec.stages])


def detect_pipeline(model_dir: str, engine: EngineConfig, deploy_config: Any = None, generation_config: str = "auto",
                    override_generation_config: Optional[dict] = None) -> PipelineSpec:
    """The pipeline of a local model folder, from the registry entry its config files match, with
    `engine`'s scale-out fields on every stage (`SCALE_OUT_FIELDS`), the main AR stage's
    generation-config defaults (`read_generation_config`), `deploy_config`'s overrides (a YAML path or dict, `pipeline/deploy_config.py`; its stage `params` win) and every
    stage's config resolved. The overrides come first, so that a stage moved to another device gets
    that device's dtype."""
    if engine.load_format == "dummy":           # the registry's builder reads checkpoint names too
        from omnistage.models.dummy import use_dummy_weights

        use_dummy_weights(model_dir)
    spec = _with_scale_out(_registry_pipeline(model_dir, engine.resolved()), engine)
    spec = _with_generation_defaults(spec, generation_config, override_generation_config)
    spec = apply_deploy_config(spec, deploy_config)
    for stage in spec.stages:                   # renderer, adapters and memory planner read weights here
        mark_load_format(stage)
    return dataclasses.replace(spec, stages=[resolve_stage(s) for s in spec.stages])


def build_engine(spec: StageSpec) -> Any:
    """The stage engine of `spec`, in this process (the orchestrator wraps `runner: process` stages
    in a `StageClient`, whose process calls this)."""
    spec = resolve_stage(spec)                  # unchanged when it comes from detect_pipeline
    mark_load_format(spec)                      # this may be the stage's own process
    if spec.kind == "ar":
        from omnistage.ar.engine import AREngine

        component = spec.options.get("component")
        if component is not None:
            loader = registry.component_loader(component)
        else:
            from omnistage.models.loader import load_causal_lm as loader
        if spec.engine.load_format == "dummy":  # tensor-parallel ranks load in processes of their own
            from omnistage.models.dummy import marked_loader

            loader = functools.partial(marked_loader, loader)
        return AREngine(spec.model_dir, spec.engine, loader=loader)
    if spec.kind == "diffusion":
        from omnistage.diffusion.engine import DiffusionEngine

        return DiffusionEngine.from_stage_spec(spec, registry.diffusion_family(spec.model_dir))
    if spec.kind == "codec":
        return registry.codec_class(spec.backend).from_stage_spec(spec)
    raise ValueError(f"stage kind must be ar, diffusion or codec; got {spec.kind!r}")


def edge_adapter(edge: EdgeSpec) -> EdgeAdapter:
    """The adapter of one edge: the registered adapter named by `edge.adapter`, with its options."""
    return build_adapter(edge.adapter, registry.adapter_target(edge.adapter), edge.options)


def params_type(kind: str, engine: Any) -> type:
    """The params class of a stage: its engine's `params_type`, else its kind's."""
    if getattr(engine, "params_type", None) is not None:
        return engine.params_type
    return DiffusionParams if kind == "diffusion" else SamplingParams
