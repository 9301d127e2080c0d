"""Qwen3-Omni as an omnistage pipeline, and its chat input (entry point's process, at start-up).

`qwen3_omni_pipeline(model_dir, engine)` (picked by the registry for config.json `model_type`
"qwen3_omni_moe") returns, on the engine's device:

  thinker  (ar, component "qwen3_omni.thinker")   final output: text; reports the hidden states after
           `talker_config.accept_hidden_layer` layers (with the input rows) when asked
           (`return_hidden_states`), which is what the talker reads

The talker (MoE + code predictor) and code2wav stages join it behind the thinker (issue #13, part 2);
until then the pipeline answers text. On a GPU the thinker runs in its own process; its `memory`
hints name the tensors it loads and its decoder's shape, so the memory plan can size its KV cache;
`renderer_weights` names what the chat renderer loads next to it.

`Qwen3OmniChatRenderer(spec)` is the registry entry's `chat_renderer`: chat messages with text,
image, audio and video (frames only) parts -> the thinker's `ARPrompt` fields (`processor.py`). The
audio and vision encoders run here, in the entry point's process, on the thinker's device.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from omnistage.config import EngineConfig
from omnistage.models.loader import lm_shape
from omnistage.models.qwen3_omni.processor import ENCODER_WEIGHTS
from omnistage.models.qwen3_omni.thinker import THINKER, omni_config
from omnistage.spec import PipelineSpec, StageSpec

THINKER_WEIGHTS = ["thinker.model.", "thinker.lm_head."]


def qwen3_omni_pipeline(model_dir: str, engine: EngineConfig) -> PipelineSpec:
    text = omni_config(model_dir).thinker_config.text_config
    runner = "process" if engine.torch_device().type == "cuda" else "inline"
    thinker = StageSpec("thinker", "ar", model_dir, engine, final_output="text", runner=runner,
                        options={"component": THINKER},
                        memory={"weights_prefix": THINKER_WEIGHTS, "lm_shape": lm_shape(text)})
    return PipelineSpec([thinker], [], model="qwen3_omni", renderer_weights=ENCODER_WEIGHTS)


class Qwen3OmniChatRenderer:
    """Chat messages -> the thinker's request inputs, a dict of `ARPrompt` fields."""

    media_types = ("image", "audio", "video")   # message parts this renderer reads besides text

    def __init__(self, spec: PipelineSpec):
        from transformers import AutoProcessor

        from omnistage.config import checkpoint_dtype
        from omnistage.models.qwen3_omni.processor import load_thinker_encoders

        stage = spec.main_stage
        self.processor = AutoProcessor.from_pretrained(stage.model_dir)
        engine = stage.engine.resolved("ar", checkpoint_dtype(stage.model_dir))
        self.encoders = load_thinker_encoders(stage.model_dir, engine.torch_device(), engine.torch_dtype())

    @torch.no_grad()
    def __call__(self, messages: list[dict], chat_template_kwargs: Optional[dict] = None) -> dict[str, Any]:
        from omnistage.models.qwen2_5_omni.processor import build_thinker_inputs
        from omnistage.models.qwen3_omni.processor import thinker_prompt

        inputs = build_thinker_inputs(self.processor, list(messages), **(chat_template_kwargs or {}))
        return {"prompt": inputs.text, "prompt_token_ids": inputs.input_ids[0].tolist(),
                **thinker_prompt(self.encoders, inputs)}
