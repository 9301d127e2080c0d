"""Qwen3-Omni as an omnistage pipeline (thinker -> talker -> code2wav), and its chat input (entry point's
process, at start-up).

`qwen3_omni_pipeline(model_dir, engine)` (registry entry "qwen3_omni", config.json `model_type`
"qwen3_omni_moe") returns, on the engine's device:

  thinker  (ar, component "qwen3_omni.thinker")   final output: text; with audio asked for, it reports
     |     its input rows and the hidden states after `talker_config.accept_hidden_layer` layers
     |  qwen3_omni.thinker_to_talker, streaming: each step's rows (`adapters.py`)
  talker   (ar, component "qwen3_omni.talker")    codebook 0 per step + codebooks 1..G-1 from its
     |     frame head (MTP code predictor); transformers' talker sampling defaults (`talker_params`)
     |  qwen3_omni.talker_to_code2wav, streaming: every frame as it is sampled
  code2wav (codec "qwen3_omni_code2wav")          final output: audio (24 kHz); a small first chunk,
           then larger ones, with left context, batched across requests

A checkpoint without audio output (`enable_audio_output` false, or no `talker.*` tensors) gets the
thinker alone. A request asks for `modalities` ["text"] (the thinker alone) or ["text", "audio"]
and a `voice` (a speaker of config.json `talker_config.speaker_id`, any case; default "ethan").
On a GPU each stage runs in its own process and the stages share the GPU by the memory plan
(`pipeline/memory.py`), as for Qwen2.5-Omni: each stage's `memory` hints name the checkpoint
tensors it loads and its decoder's shape; the chat renderer's weights are `renderer_weights`.

`Qwen3OmniChatRenderer(spec)` is the registry entry's `chat_renderer`: chat messages with text,
image, audio and video (frames only) parts -> the thinker's `ARPrompt` fields (`processor.py`). The
audio and vision encoders run here, in the entry point's process, on the thinker's device. Its
`read_aloud(text, params)` serves `/v1/audio/speech` and `Omni.speak` (`models/read_aloud.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from omnistage.codec.speech import SpeechCapabilities
from omnistage.config import EngineConfig
from omnistage.models.loader import lm_shape
from omnistage.models.qwen3_omni.adapters import load_constants
from omnistage.models.qwen3_omni.processor import ENCODER_WEIGHTS
from omnistage.models.qwen3_omni.talker import TALKER, talker_text_config
from omnistage.models.qwen3_omni.thinker import THINKER, omni_config
from omnistage.models.read_aloud import ReadAloud
from omnistage.spec import EdgeSpec, PipelineSpec, StageSpec

THINKER_WEIGHTS = ["thinker.model.", "thinker.lm_head."]
TALKER_WEIGHTS = ["talker."]
CODE2WAV_WEIGHTS = ["code2wav."]
# 2 frames (160 ms of audio) first for a quick first packet, then chunks as long as the audio so far
# (2, 4, 8, 16) up to 24 (fewer, larger decodes; code2wav.Code2WavStage); 25 frames of left context as
# transformers' chunked_decode.
CODE2WAV_OPTIONS = {"first_chunk_frames": 2, "chunk_frames": 24, "left_context_frames": 25}


def talker_params(config) -> dict[str, Any]:
    """transformers' talker `generate` defaults (`Qwen3OmniMoeForConditionalGeneration.generate`)
    as `SamplingParams` fields (the ids it suppresses, vocab - 1024 up but codec eos, the talker
    model masks itself: `Qwen3OmniTalker.compute_logits`)."""
    eos = config.talker_config.codec_eos_token_id
    return {"temperature": 0.9, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.05, "stop_token_ids": [eos],
            "max_tokens": 4096}


def has_audio_output(model_dir: str) -> bool:
    """The checkpoint speaks: audio output enabled and its talker weights present (headers only)."""
    from omnistage.models.loader import checkpoint_names

    if not getattr(omni_config(model_dir), "enable_audio_output", True):
        return False
    return any(name.startswith(TALKER_WEIGHTS[0]) for name in checkpoint_names(model_dir))


def qwen3_omni_pipeline(model_dir: str, engine: EngineConfig) -> PipelineSpec:
    config = omni_config(model_dir)
    runner = "process" if engine.torch_device().type == "cuda" else "inline"
    thinker = StageSpec("thinker", "ar", model_dir, engine, final_output="text", runner=runner,
                        options={"component": THINKER},
                        memory={"weights_prefix": THINKER_WEIGHTS,
                                "lm_shape": lm_shape(config.thinker_config.text_config)})
    if not has_audio_output(model_dir):
        return PipelineSpec([thinker], [], model="qwen3_omni", renderer_weights=ENCODER_WEIGHTS)
    voice = load_constants(model_dir).default_voice
    talker = StageSpec("talker", "ar", model_dir, dataclasses.replace(engine, max_model_len=None), runner=runner,
                       options={"component": TALKER}, params=talker_params(config),
                       memory={"weights_prefix": TALKER_WEIGHTS, "lm_shape": lm_shape(talker_text_config(model_dir))})
    code2wav = StageSpec("code2wav", "codec", model_dir, engine, final_output="audio", runner=runner,
                         backend="qwen3_omni_code2wav", options=dict(CODE2WAV_OPTIONS),
                         memory={"weights_prefix": CODE2WAV_WEIGHTS, "weights_dtype": "float32"})  # runs in fp32
    edges = [EdgeSpec("thinker", "talker", "qwen3_omni.thinker_to_talker", chunk_size=1,
                      options={"model_dir": model_dir, "default_voice": voice}),
             EdgeSpec("talker", "code2wav", "qwen3_omni.talker_to_code2wav", chunk_size=1)]
    return PipelineSpec([thinker, talker, code2wav], edges, model="qwen3_omni", renderer_weights=ENCODER_WEIGHTS)


class Qwen3OmniChatRenderer(ReadAloud):
    """Chat messages -> the thinker's request inputs, a dict of `ARPrompt` fields; `read_aloud(text,
    params)`: the thinker request that makes the talker speak `text` (`models/read_aloud.py`)."""

    media_types = ("image", "audio", "video")   # message parts this renderer reads besides text
    voices_any_case = True                      # speakers match in any case, as the talker looks them up
    # code2wav's first chunk is a stage option (CODE2WAV_OPTIONS), not a request field
    read_aloud_capabilities = SpeechCapabilities(task_types=("CustomVoice",), languages=("Auto",))

    def __init__(self, spec: PipelineSpec):
        from transformers import AutoProcessor

        from omnistage.config import checkpoint_dtype
        from omnistage.models.qwen3_omni.processor import load_thinker_encoders

        stage = spec.main_stage
        self.processor = AutoProcessor.from_pretrained(stage.model_dir)
        engine = stage.engine.resolved("ar", checkpoint_dtype(stage.model_dir))
        self.encoders = load_thinker_encoders(stage.model_dir, engine.torch_device(), engine.torch_dtype())
        speakers = getattr(omni_config(stage.model_dir).talker_config, "speaker_id", None) or {}
        self.voices = sorted(name.lower() for name in speakers)   # for read-aloud's check

    @torch.no_grad()
    def __call__(self, messages: list[dict], chat_template_kwargs: Optional[dict] = None) -> dict[str, Any]:
        from omnistage.models.qwen2_5_omni.processor import build_thinker_inputs
        from omnistage.models.qwen3_omni.processor import thinker_prompt

        inputs = build_thinker_inputs(self.processor, list(messages), **(chat_template_kwargs or {}))
        return {"prompt": inputs.text, "prompt_token_ids": inputs.input_ids[0].tolist(),
                **thinker_prompt(self.encoders, inputs)}
