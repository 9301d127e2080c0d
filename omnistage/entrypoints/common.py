"""Shared by the offline and async entry points: model resolution, engine config, prompt shaping."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Sequence

from omnistage.config import EngineConfig
from omnistage.models import registry
from omnistage.params import DiffusionParams, ParamError, SamplingParams
from omnistage.pipeline.build import detect_pipeline
from omnistage.pipeline.orchestrator import Orchestrator
from omnistage.pipeline.deploy_config import pinned_stages
from omnistage.pipeline.memory import plan_gpu_memory

_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


def resolve_model(model: Optional[str]) -> str:
    if model is None:
        from omnistage.models.default_model import default_model_path

        return default_model_path()
    return model


def build_orchestrator(model: Optional[str], device: str, dtype: str, deploy_config: Any = None,
                       generation_config: str = "auto", override_generation_config: Optional[dict] = None,
                       **engine_kwargs) -> Orchestrator:
    """`deploy_config`: a YAML path or dict of pipeline overrides (see pipeline/deploy_config.py).
    `generation_config` ("auto" | "vllm" | FOLDER) and `override_generation_config` (HF keys) give
    the main AR stage's request defaults (`pipeline.build.read_generation_config`); the embedded
    default model (model None) starts from its recommended ones (`default_model.GENERATION_DEFAULTS`).

    The EngineConfig is built here once, its device resolved; `detect_pipeline` resolves each
    stage's copy of it (after the overrides), and everything downstream reads those values."""
    unknown = set(engine_kwargs) - _ENGINE_FIELDS
    if unknown:
        raise TypeError(f"unknown engine options {sorted(unknown)}; known: {sorted(_ENGINE_FIELDS)}")
    config = EngineConfig(device=device, dtype=dtype, **engine_kwargs).resolved()
    if config.device == "cpu":
        config.apply_cpu_threads()
    if model is None:
        from omnistage.models.default_model import GENERATION_DEFAULTS

        override_generation_config = {**GENERATION_DEFAULTS, **(override_generation_config or {})}
    spec = detect_pipeline(resolve_model(model), config, deploy_config, generation_config, override_generation_config)
    spec = plan_gpu_memory(spec, pinned=pinned_stages(deploy_config))   # stages sharing a GPU split it
    return Orchestrator(spec)


def per_prompt(params: Any, n: int, default_factory) -> list:
    """One params object for all prompts, a list with one per prompt, or None for the default."""
    if params is None:
        return [default_factory() for _ in range(n)]
    if isinstance(params, (list, tuple)):
        if len(params) != n:
            raise ValueError(f"got {len(params)} params objects for {n} prompts")
        return list(params)
    return [params] * n


def default_params_for(orch: Orchestrator, entry_stage: Optional[str] = None):
    """What builds the default params of the stage a request enters at (default: the main stage):
    its params class with the stage's default request params (`StageSpec.params`: e.g. the model's
    generation-config sampling defaults)."""
    spec = orch.spec.stage(entry_stage) if entry_stage else orch.spec.main_stage
    cls = getattr(orch.stages[spec.name], "params_type", None)
    if cls is None:
        cls = DiffusionParams if spec.kind == "diffusion" else SamplingParams
    return functools.partial(cls, **spec.params) if spec.params else cls


class ChatRenderer:
    """Chat messages -> the main stage's inputs: the model's own renderer (its registry entry's
    `chat_renderer`, e.g. an omni model's processor and media encoders) or else the tokenizer's chat
    template."""

    def __init__(self, orch: Orchestrator):
        self.custom = None
        target = registry.entry(orch.spec.model).chat_renderer if orch.spec.model else None
        if target is not None:
            self.custom = registry.load_attr(target)(orch.spec)
        self.tokenizer = orch.tokenizer
        # the tool-call format the registry declares (the chat template may show another one)
        self.tool_parser = registry.entry(orch.spec.model).tool_parser if orch.spec.model else None

    @property
    def media_types(self) -> tuple[str, ...]:
        """Content-part kinds besides text that messages may carry ("image", "audio", "video")."""
        return tuple(getattr(self.custom, "media_types", ()))

    def __call__(self, messages: Sequence[dict], chat_template_kwargs: Optional[dict] = None,
                 tools: Optional[list[dict]] = None) -> dict:
        """`tools`: OpenAI function definitions the template shows the model (tokenizer templates only)."""
        if self.custom is not None:
            if tools:
                raise ParamError("tools", "this model's chat renderer does not take tools")
            return self.custom(list(messages), chat_template_kwargs)
        return render_chat(self.tokenizer, messages, chat_template_kwargs, tools=tools)


def speech_stage(orch: Orchestrator) -> Optional[str]:
    """Name of the stage that turns text into speech (a TTS stage: `TTSParams` + voices), or None."""
    from omnistage.codec.speech import TTSParams

    main = orch.spec.main_stage                 # a model whose entry stage takes text + TTSParams (Qwen3-TTS)
    engine = orch.stages[main.name]
    if getattr(engine, "params_type", None) is TTSParams and hasattr(engine, "voices"):
        return main.name
    found = orch.stage_for("audio")             # a vocoder fed codec ids does not read text
    if found is None or not hasattr(found[1], "voices") or getattr(found[1], "params_type", None) is not TTSParams:
        return None
    return found[0]


class Speech:
    """Text -> speech requests for either kind of pipeline that speaks: one with a TTS stage (the text
    enters there with its `TTSParams`), or a model whose chat renderer reads aloud (an omni model:
    `read_aloud(text, params)` gives the main stage's prompt, whose audio the pipeline speaks)."""

    def __init__(self, orch: Orchestrator, renderer: ChatRenderer):
        self.orch = orch
        self.stage = speech_stage(orch)         # the TTS stage, or None
        # an omni model reads aloud when its pipeline speaks (a thinker-only checkpoint does not)
        speaks = "audio" in orch.spec.output_modalities()
        reader = renderer.custom if self.stage is None and speaks else None
        self.reader = reader if callable(getattr(reader, "read_aloud", None)) else None

    @property
    def available(self) -> bool:
        return self.stage is not None or self.reader is not None

    def check(self, params: Any) -> None:
        """Raises `ParamError` naming a `TTSParams` field the pipeline cannot honour."""
        if self.reader is not None:
            self.reader.check_read_aloud(params)
            return
        check = getattr(self.orch.stages.get(self.stage), "check_params", None) if self.stage else None
        if check is not None:
            check(params)

    def request(self, text: str, params: Any) -> tuple[Any, Any, Optional[str]]:
        """(prompt, params, entry stage) of a request that speaks `text` with `params` (`TTSParams`)."""
        if self.stage is None and self.reader is None:
            raise ValueError("this pipeline has no speech stage and does not read aloud")
        if self.reader is None:
            return text, params, self.stage
        self.check(params)
        prompt, thinker = self.reader.read_aloud(text, params)
        return prompt, thinker, None


def render_chat(tokenizer, messages: Sequence[dict], chat_template_kwargs: Optional[dict] = None,
                add_generation_prompt: bool = True, tools: Optional[list[dict]] = None) -> dict:
    """Messages -> engine input through the model's chat template (no second BOS added): a dict of
    `ARPrompt` fields, to which the entry points may add `modalities` / `voice`."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; use generate() / completions instead")
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
                                         tools=tools or None, **(chat_template_kwargs or {}))
    return {"prompt": text, "add_special_tokens": False}


def engine_kwargs_from_args(args) -> dict:
    """The engine options of parsed CLI arguments (`omnistage serve` / `generate`), for Omni / AsyncOmni."""
    names = ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "num_kv_blocks", "seed", "tensor_parallel_size",
             "deploy_config", "load_format",
             "cache_backend", "cache_config", "vae_use_tiling",
             "attention_backend", "quantization", "ignored_layers", "enforce_eager", "diffusion_compile_mode",
             "diffusion_compile_dynamic", "enable_cpu_offload",
             "enable_layerwise_offload", "num_replicas", "distributed_executor_backend", "ray_address",
             "generation_config", "override_generation_config")
    kwargs = {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}
    parallel = {k: getattr(args, k) for k in ("ulysses_degree", "ring_degree", "cfg_parallel_size")
                if getattr(args, k, None) is not None}
    if parallel:
        kwargs["parallel_config"] = parallel
    return kwargs
