"""Qwen2.5-Omni as an omnistage pipeline, and its chat input (entry point's process, at start-up).

`omni_pipeline(model_dir, engine)` (picked by `detect_pipeline` for config.json `model_type`
"qwen2_5_omni") returns three stages on the engine's device:

  thinker  (ar, component "qwen2_5_omni.thinker")  final output: text
     |  qwen2_5_omni.thinker_to_talker, streaming: one vector per thinker token
  talker   (ar, component "qwen2_5_omni.talker")   codec ids; sampling defaults of transformers'
     |  qwen2_5_omni.talker_to_code2wav, streaming: every code as it is sampled
  code2wav (codec "qwen2_5_omni_code2wav")          final output: audio (24 kHz), chunked decode

A request asks for `modalities` ["text"] (the default: the thinker alone) or ["text", "audio"],
and a `voice` (a key of spk_dict.pt, default "Chelsie"). On a GPU each stage runs in its own process
and the stages share the GPU: each stage's `memory` hints name the checkpoint tensors it loads
(`weights_prefix`) and, for the AR stages, the shape of its decoder (`lm_shape`), so that the
entry point's memory plan (`pipeline/memory.py`) can give every stage its own share of the GPU
from the weights' sizes (the KV caches split what is left in proportion to what each can use);
`renderer_weights` names what the chat renderer loads next to them.

`OmniChatRenderer(spec)` is the model's `chat_renderer` (registry entry "qwen2_5_omni"): chat messages with text, image, audio
and video (frames only) parts -> the thinker's inputs (`processor.py`): prompt ids (one placeholder
per encoder row), merged `prompt_embeds` when there is media, and 3-D rope positions + delta when
there is an image or a video.
The audio and vision encoders run here, in the entry point's process, on the thinker's device.
Its `read_aloud(text, params)` is the thinker request that makes the talker speak `text`
(`models/read_aloud.py`: `/v1/audio/speech` and `Omni.speak` on an omni folder).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import torch

from omnistage.config import EngineConfig
from omnistage.models.qwen2_5_omni.adapters import DEFAULT_VOICE
from omnistage.models import loader
from omnistage.models.loader import lm_shape
from omnistage.models.read_aloud import ReadAloud
from omnistage.models.qwen2_5_omni.stages import TALKER, THINKER, omni_config
from omnistage.spec import EdgeSpec, PipelineSpec, StageSpec

# Tensor-name prefixes each part loads (stages.py, code2wav.py, `load_thinker_encoders` below).
THINKER_WEIGHTS = ["thinker.model.", "thinker.lm_head."]
TALKER_WEIGHTS = ["talker."]
CODE2WAV_WEIGHTS = ["token2wav."]
RENDERER_WEIGHTS = ("thinker.audio_tower.", "thinker.visual.", "thinker.model.embed_tokens.")
# Measured on an H200 (7B shape, random bf16 weights, 1 stream, 6 s answers; benchmarks/omni_bench.py):
# each chunk costs about the same (36 DiT evaluations, launch-bound), so larger chunks decode faster
# than real time: chunk 48 -> RTF 1.7, 96 -> 0.98, 192 -> 0.86 (with code2wav in its own process).
# 32 requests per ODE batch: at 32 streams every ready chunk decodes in one batch (graphs for 1..32 rows).
# chunk_growth 2: after the first chunk each is twice the one before, up to chunk_codes (12, 24, 48, 96, ...):
# a jump from the first chunk straight to 96 codes left every stream dry once at 8 streams (H200: 8 underruns,
# 2.74 s dry), the talker's 96 codes and their decode taking longer than the first chunk plays.
CODE2WAV_OPTIONS = {"first_chunk_codes": 12, "chunk_codes": 96, "chunk_growth": 2, "past_blocks": 2,
                    "future_blocks": 1, "max_batch_requests": 32}
# code2wav's device memory besides its weights: its ODE graphs' static inputs (~1.5 GiB for 1..32 rows)
# and their shared pool (a 32-row ODE's activations), and BigVGAN's graphs' pool (a 32-row chunk's
# activations: ~80 MB per row of 256 mel frames at the 7B shape); an estimate for the memory plan
CODE2WAV_WORKSPACE_BYTES = 8 * 2**30
# Where the stages run on a GPU: "process" (one process each) or "shared" (all in the serving process, each
# on a CUDA stream of its own); benchmarks/omni_bench.py measures both. Shared, measured on one H200
# (benchmarks/RESULTS.md, session 5): TTFA 0.50 / 0.87 s at 1 / 8 streams against 0.90 / 2.28 s for
# process-per-stage in session 4.
GPU_STAGE_LAYOUT = "shared"


def talker_params(config) -> dict[str, Any]:
    """transformers' talker `generate` defaults as `SamplingParams` fields (docs/qwen2_5_omni_notes.md)."""
    talker = config.talker_config
    stops = [talker.tts_codec_pad_token_id, talker.tts_codec_end_token_id]
    # Ids the code2wav DiT has no row for (real checkpoint: 8194..8447) could only crash the decode.
    table = config.token2wav_config.dit_config.num_embeds + 1
    bad = [talker.tts_codec_start_token_id] + [i for i in range(table, talker.vocab_size) if i not in stops
                                               and i != talker.tts_codec_start_token_id]
    return {"temperature": 0.9, "top_k": 40, "top_p": 0.8, "repetition_penalty": 1.05, "stop_token_ids": stops,
            "bad_token_ids": bad, "max_tokens": min(4096, talker.max_position_embeddings // 2)}


def voices(model_dir: str) -> list[str]:
    return list(torch.load(os.path.join(model_dir, "spk_dict.pt"), weights_only=True))


def omni_pipeline(model_dir: str, engine: EngineConfig) -> PipelineSpec:
    config = omni_config(model_dir)
    names = voices(model_dir)
    default_voice = DEFAULT_VOICE if DEFAULT_VOICE in names else names[0]
    # On a GPU every stage runs in the serving process (GPU_STAGE_LAYOUT "shared"), each engine on a CUDA
    # stream of its own (the talker's and thinker's at high priority), so their GPU work overlaps and the
    # hidden states they pass stay on the device. `stage_layout: process` in a deploy config gives each
    # stage its own process instead (tensors cross by `pipeline.wire`).
    runner = GPU_STAGE_LAYOUT if engine.torch_device().type == "cuda" else "inline"
    # Requests that feed the talker report hidden states and so skip the prefix cache (see
    # `ar/conditioning.Conditioning.cacheable`); text-only requests keep it.
    # In the shared layout (`stage_layout: shared`) the thinker's and talker's decode steps run on
    # high-priority CUDA streams: code2wav's chunk decodes fill the GPU around them.
    thinker = StageSpec("thinker", "ar", model_dir, engine, final_output="text", runner=runner, priority=1,
                        options={"component": THINKER},
                        memory={"weights_prefix": THINKER_WEIGHTS, "lm_shape": lm_shape(config.thinker_config.text_config)})
    talker = StageSpec("talker", "ar", model_dir, dataclasses.replace(engine, max_model_len=None),
                       runner=runner, priority=2, options={"component": TALKER},
                       memory={"weights_prefix": TALKER_WEIGHTS, "lm_shape": lm_shape(config.talker_config)},
                       params=talker_params(config))
    # code2wav's chunk decodes (36 DiT evaluations each) in their own process overlap the talker's
    # steps instead of stalling them (H200, chunk 96: RTF 1.17 inline, 0.98 apart).
    code2wav = StageSpec("code2wav", "codec", model_dir, engine, final_output="audio", runner=runner,
                         backend="qwen2_5_omni_code2wav", options={
                             **CODE2WAV_OPTIONS, "default_voice": default_voice},
                         memory={"weights_prefix": CODE2WAV_WEIGHTS, "weights_dtype": "float32",   # runs in fp32
                                 "workspace_bytes": CODE2WAV_WORKSPACE_BYTES})
    edges = [EdgeSpec("thinker", "talker", "qwen2_5_omni.thinker_to_talker", chunk_size=1,
                      options={"model_dir": model_dir, "default_voice": default_voice}),
             EdgeSpec("talker", "code2wav", "qwen2_5_omni.talker_to_code2wav", chunk_size=1)]
    return PipelineSpec([thinker, talker, code2wav], edges,
                        model="qwen2_5_omni",
                        renderer_weights=RENDERER_WEIGHTS)


def load_thinker_encoders(model_dir: str, device: torch.device, dtype: torch.dtype):
    """What `processor.py` uses of transformers' thinker -- the token embeddings, the audio and
    vision encoders, `get_rope_index` -- as a `Qwen2_5OmniThinkerModel` without decoder layers."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniThinkerModel

    return loader.load_thinker_encoders(Qwen2_5OmniThinkerModel, model_dir, RENDERER_WEIGHTS, device, dtype)


class OmniChatRenderer(ReadAloud):
    """Chat messages -> the thinker's request inputs, a dict of `ARPrompt` fields (the entry points
    add the request's `modalities` / `voice` to it; see the module docstring)."""

    media_types = ("image", "audio", "video")   # message parts this renderer reads besides text

    def __init__(self, spec: PipelineSpec):
        from transformers import AutoProcessor

        from omnistage.config import checkpoint_dtype

        stage = spec.main_stage
        self.processor = AutoProcessor.from_pretrained(stage.model_dir)
        # the thinker stage's device and dtype: its config as the AR engine resolves it (resolved already
        # when the spec comes from `detect_pipeline`)
        engine = stage.engine.resolved("ar", checkpoint_dtype(stage.model_dir))
        self.device = engine.torch_device()
        self.model = load_thinker_encoders(stage.model_dir, self.device, engine.torch_dtype())
        self.config = self.model.config
        self.voices = voices(stage.model_dir)   # preset speakers (spk_dict.pt), for read-aloud's check

    @torch.no_grad()
    def __call__(self, messages: list[dict], chat_template_kwargs: Optional[dict] = None) -> dict[str, Any]:
        from omnistage.models.qwen2_5_omni.processor import (build_thinker_inputs, thinker_input_embeds,
                                                             thinker_positions)

        inputs = build_thinker_inputs(self.processor, list(messages), **(chat_template_kwargs or {}))
        out: dict[str, Any] = {"prompt": inputs.text, "prompt_token_ids": inputs.input_ids[0].tolist()}
        if all(inputs[k] is None for k in ("input_features", "pixel_values", "pixel_values_videos")):
            return out                          # text only: the thinker's own embedding lookup
        out["prompt_embeds"] = thinker_input_embeds(self, inputs)[0]
        if inputs["image_grid_thw"] is not None or inputs["video_grid_thw"] is not None:   # else 1-D
            positions, delta = thinker_positions(self, inputs)
            out["mrope_positions"] = positions[:, 0].cpu()
            out["mrope_delta"] = int(delta.reshape(-1)[0])
        return out

    def get_rope_index(self, *args):
        """processor.py reads `model`, `config`, `device` and this from what it takes as the thinker."""
        return self.model.get_rope_index(*args)
