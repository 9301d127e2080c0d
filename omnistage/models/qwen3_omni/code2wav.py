"""Qwen3-Omni's code2wav as a codec stage: talker frames (all G codebooks) -> 24 kHz audio (the
code2wav stage's process; registry back end "qwen3_omni_code2wav").

The network is the same family as Qwen3-TTS' 12 Hz decoder (`models/qwen3_tts/decoder.py`), and
runs on that code with two differences, declared here:
  * codes -> latent: one table of G x codebook rows, code g of a frame looked up at g * codebook +
    code, the G rows averaged (no VQ projections, no pre-conv, no transformer in/out projections);
  * its transposed convs trim (kernel - stride) samples on both sides, so each looks one input step
    ahead (less than one frame in all) and a decode of T frames ends `tail_loss` samples short of
    T * 1920 (transformers' `Qwen3OmniMoeCode2Wav.forward` does the same).

Weights: the checkpoint's `code2wav.*` tensors, config.json `code2wav_config`; decoded in float32.
Streaming, batching and chunk sizes are the Qwen3-TTS decoder stage's (`Qwen3TTSDecoderStage`): a
small first chunk, then larger ones, each with left context and one frame of look-ahead, batched
across requests with right padding, in its growing chunk schedule (`chunk_frames_next`), padded on a GPU
to the longest window of its place in that schedule (`windows`), each shape met at start-up.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from omnistage.models.loader import read_tensors
from omnistage.params import check_param
from omnistage.models.qwen3_tts.codec import SAMPLE_RATE, Qwen3TTSDecoderStage
from omnistage.models.qwen3_tts.decoder import SpeechDecoder

PREFIX = "code2wav."


@dataclass
class VoiceParams:
    """What a Qwen3-Omni request says of its audio: the talker's speaker (the vocoder has no options)."""

    voice: Optional[str] = None                 # a speaker of config.json talker_config.speaker_id (any case)


class Code2WavDecoder(SpeechDecoder):
    """Qwen3-Omni's code2wav network on its weights (see the module docstring)."""

    both_sided_trim = True

    def _latent(self, codes: torch.Tensor) -> torch.Tensor:
        book = int(self.config["codebook_size"])
        offset = torch.arange(self.groups, device=codes.device)[None, :, None] * book
        return F.embedding(codes + offset, self.w["code_embedding.weight"]).mean(1).transpose(1, 2)


def load_code2wav(model_dir: str, device: torch.device) -> Code2WavDecoder:
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)["code2wav_config"]
    weights = {name[len(PREFIX):]: t.to(device, torch.float32)
               for name, t in read_tensors(model_dir, lambda n: n.startswith(PREFIX))}
    if not weights:
        raise ValueError(f"{model_dir}: the checkpoint has no {PREFIX}* tensors (an audio-out Qwen3-Omni is needed)")
    return Code2WavDecoder(config, weights)


class Code2WavStage(Qwen3TTSDecoderStage):
    """The codec model of the code2wav stage: `FramesInput` pieces in, audio chunks out. It also
    answers for the pipeline's voices (the talker's speakers): listed, and checked before any work."""

    params_type = VoiceParams

    def __init__(self, model_dir: str, device: Any = "cpu", **options):
        super().__init__(model_dir, device, **options)
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            speakers = json.load(f)["talker_config"].get("speaker_id") or {}
        self.speakers = sorted(name.lower() for name in speakers)

    def voices(self) -> list[dict[str, Any]]:
        # any_case: the talker looks speakers up lowercased, so "Ethan" names "ethan" (HTTP checks agree)
        return [{"id": v, "name": v, "sample_rate": SAMPLE_RATE, "backend": "qwen3_omni", "any_case": True}
                for v in self.speakers]

    def check_params(self, params: Optional[VoiceParams]) -> None:
        voice = getattr(params, "voice", None)
        check_param(voice is None or voice.lower() in self.speakers, "voice", f"one of {self.speakers}", voice)

    @staticmethod
    def load_decoder(model_dir: str, device: torch.device) -> SpeechDecoder:
        return load_code2wav(model_dir, device)
