"""Qwen3-TTS as an omnistage pipeline, and its talker -> decoder glue (entry point's process).

`qwen3_tts_pipeline(model_dir, engine)` (registry entry "qwen3_tts", config.json `model_type`
"qwen3_tts") returns two stages on the engine's device:

  talker   (ar, component "qwen3_tts.talker")      text + TTSParams in; codec frames out
     |  qwen3_tts.talker_to_decoder, streaming: every frame as it is sampled
  decoder  (codec "qwen3_tts_decoder")             final output: audio (24 kHz), chunked decode

The talker is the entry stage: `Omni(folder).generate(text, TTSParams(...))` and the
`/v1/audio/speech` route (`AsyncOmni.speech_stage`) send the text there. On a GPU each stage runs
in its own process.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

from omnistage.config import EngineConfig
from omnistage.models.loader import lm_shape
from omnistage.models.qwen3_tts.codec import TalkerFrames
from omnistage.models.qwen3_tts.talker import TALKER
from omnistage.spec import EdgeSpec, PipelineSpec, StageSpec
from omnistage.stage import StageOutput

DECODER_BYTES = 3 * 2**30                      # decoder weights (fp32, ~0.5 GiB at 1.7B) + activations of a batch
# First chunk small for a quick first packet (TTFP = prefill + 2 frames + one decode), later chunks
# growing to `chunk_frames` (fewer decoder calls; `Qwen3TTSDecoderStage.chunk_frames_next`).
DECODER_OPTIONS = {"first_chunk_frames": 2, "chunk_frames": 24, "left_context_frames": 25}


def qwen3_tts_pipeline(model_dir: str, engine: EngineConfig) -> PipelineSpec:
    runner = "process" if engine.torch_device().type == "cuda" else "inline"
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        talker_cfg = json.load(f)["talker_config"]
    # memory plan hints (pipeline/memory.py): the talker's tensors and decoder shape; the decoder's
    # weights sit in speech_tokenizer/ (not in the top-level file the plan reads): a workspace covers them
    talker = StageSpec("talker", "ar", model_dir, engine, runner=runner, options={"component": TALKER},
                       memory={"weights_prefix": ["talker."], "lm_shape": lm_shape(SimpleNamespace(**talker_cfg))})
    decoder = StageSpec("decoder", "codec", model_dir, engine, final_output="audio", runner=runner,
                        backend="qwen3_tts_decoder", options=dict(DECODER_OPTIONS),
                        memory={"weights_prefix": [], "weights_dtype": "float32", "workspace_bytes": DECODER_BYTES})
    edges = [EdgeSpec("talker", "decoder", "qwen3_tts.talker_to_decoder", chunk_size=1)]
    return PipelineSpec([talker, decoder], edges, model="qwen3_tts")


def talker_to_decoder(out: StageOutput) -> TalkerFrames:
    """Frames so far (group-0 code + the predictor's codes); once the talker stopped on eos, without
    the eos frame. The talker prompt's `context_frames` (Base in-context cloning) go along as the
    decoder's left context. Frames are built only for the slice sent (`TalkerFrames`)."""
    comps, context = out.output.outputs, out.output.context_frames
    if not comps:
        return TalkerFrames([], [], 0, finished=out.finished, context=context)
    ids, codes = comps[0].token_ids, comps[0].codes or []
    count = min(len(ids), len(codes))
    if out.finished and comps[0].finish_reason == "stop" and count:
        count -= 1
    return TalkerFrames(ids, codes, count, finished=out.finished, context=context)
