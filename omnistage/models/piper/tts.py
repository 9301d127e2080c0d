"""`PiperTTS`: Piper voices as the codec model of a text-to-speech `CodecEngine` stage (registry back
end "piper"; runs in the TTS stage's process).

In: a request's input is a string (spoken whole) or a `TTSInput` (sentences; `finished=False` when
an upstream LM streams more), its params a `TTSParams` (voice, speed; `capabilities()` says it serves preset voices only). A chunk is the request's next
sentence: each step synthesizes the next piece of it for up to `max_batch_sentences` requests,
round-robin. A piece is one sentence as the phonemizer splits it, of at most
`max_phonemes_per_step` phonemes: a longer one is cut after its last pause (`,` `;` `:`) or word
break within the bound, and the rest follows in the next steps, so the work of one step, and what
one request can hold up the others, is bounded whatever the text. Out (through the engine): the
cumulative `AudioOutput` (float32 mono in [-1, 1] at the voice's native rate, 22050 Hz for the
bundled voice), the sentences spoken so far as `prompt` and their phoneme ids as
`prompt_token_ids`. A request finishes when its input is finished and every sentence is spoken.

Voices are the stage option `voices` (`voices.py`). Models load on first use and are shared by the
presets that name them; their noise is drawn from a seed of the sentence and voice (`seeded.py`), so
the same text with the same voice and speed gives the same audio, alone or under load. Piper's exported graph pads a batch to its longest item and returns no
per-item audio lengths, so each piece runs its own forward; the step still serves several
requests, which is what keeps time-to-first-audio flat under load. Sentences are cleaned for
speech once more as they arrive (`codec.speech.clean_for_speech`); `decode` changes no state until
every piece of its batch is synthesized, so the engine can retry a failed batch piece by piece.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Optional, Union

import numpy as np

from omnistage.codec.engine import CodecEngine
from omnistage.codec.speech import SpeechCapabilities, TTSInput, TTSParams, check_speech_params, clean_for_speech
from omnistage.models.piper.seeded import SeededVoice
from omnistage.models.piper.voices import DEFAULT_VOICE, INSTALL_HINT, VoiceSpec, piper_available, voices_from_options

logger = logging.getLogger(__name__)

_PAUSES = frozenset(",;:")                      # phonemes after which a long sentence is best cut


class PiperState:
    """One request's sentences: those to speak, those spoken, and what they gave."""

    def __init__(self, voice: VoiceSpec, params: TTSParams):
        self.voice = voice
        self.params = params
        self.pending: deque[str] = deque()      # sentences not (completely) spoken yet
        self.rest: Optional[list[list[str]]] = None  # phonemes of pending[0] not spoken yet; None = not phonemized
        self.spoken: list[str] = []             # sentences spoken, in order
        self.phoneme_ids: list[int] = []        # phoneme ids of the spoken sentences
        self.sample_rate = 0                    # Hz of the loaded voice model; 0 until the first sentence


class PiperTTS:
    """The codec model (`codec/engine.py: CodecModel`) of the Piper TTS stage."""

    params_type = TTSParams

    def __init__(self, voices: Optional[dict[str, Union[str, dict]]] = None, default_voice: Optional[str] = None,
                 max_batch_sentences: int = 8, max_phonemes_per_step: int = 160, device: Any = "cpu"):
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
        if not isinstance(max_phonemes_per_step, int) or max_phonemes_per_step < 8:
            raise ValueError(f"max_phonemes_per_step must be an integer >= 8, got {max_phonemes_per_step!r}")
        self.max_batch = max_batch_sentences
        self.max_phonemes = max_phonemes_per_step
        self.use_cuda = str(device).startswith("cuda")
        self._models: dict[str, Any] = {}       # model path -> loaded PiperVoice
        self._seeded: dict[str, SeededVoice] = {}   # model path -> its session with the noise as inputs
        self._synth_seconds = 0.0

    @classmethod
    def from_stage_spec(cls, spec) -> CodecEngine:
        """The TTS stage's engine; options are `voices`, `default_voice`, `max_batch_sentences`,
        `max_phonemes_per_step`."""
        return CodecEngine(cls(device=spec.engine.torch_device(), **spec.options))

    # ---- voices ---------------------------------------------------------------------------------
    def voices(self) -> list[dict[str, Any]]:
        return [v.describe() for v in self.voice_specs.values()]

    def capabilities(self) -> SpeechCapabilities:
        """Preset voices only (no cloning, no voice design); `language` is "Auto" or a voice's own
        (each voice speaks one language); no codec tokens, so no generation fields."""
        codes = sorted({v.language for v in self.voice_specs.values() if v.language})
        return SpeechCapabilities(task_types=("CustomVoice",), languages=("Auto", *codes))

    def _model(self, voice: VoiceSpec):
        model = self._models.get(voice.model_path)
        if model is None:
            import onnxruntime
            from piper import PiperVoice

            cuda = self.use_cuda and "CUDAExecutionProvider" in onnxruntime.get_available_providers()
            start = time.perf_counter()
            model = PiperVoice.load(voice.model_path, voice.config_path, use_cuda=cuda)
            # its noise drawn from a seed (`seeded.py`): a sentence sounds the same whatever runs beside it
            self._seeded[voice.model_path] = seeded = SeededVoice(voice.model_path, model.session.get_providers())
            model.session = seeded.session
            logger.info("Piper voice %s loaded in %.2f s (%s)", voice.name, time.perf_counter() - start,
                        "cuda" if cuda else "cpu")
            self._models[voice.model_path] = model
        return model

    def _speak(self, state: PiperState, sentence: str) -> tuple[np.ndarray, list[int], list[list[str]]]:
        """Synthesizes the next piece of `sentence` (the head of `state.pending`) without changing
        `state`: (its audio, its phoneme ids, the phonemes of the sentence left after it)."""
        voice, model = state.voice, self._model(state.voice)
        phonemes = state.rest if state.rest is not None else [p for p in model.phonemize(sentence) if p]
        if not phonemes:
            return np.zeros(0, np.float32), [], []
        piece, rest = next_piece(phonemes, self.max_phonemes)
        length = voice.length_scale if voice.length_scale is not None else model.config.length_scale
        config = model.config
        scales = (config.noise_scale if voice.noise_scale is None else voice.noise_scale, length / state.params.speed,
                  config.noise_w_scale if voice.noise_w_scale is None else voice.noise_w_scale)
        speaker = None if config.num_speakers <= 1 else (
            config.default_speaker_id if voice.speaker_id is None else voice.speaker_id)   # as Piper picks it
        ids = model.phonemes_to_ids(piece)
        audio = self._seeded[voice.model_path].synthesize(ids, scales, speaker, voice.name).astype(np.float32)
        audio = audio.reshape(-1)
        peak = float(np.abs(audio).max()) if audio.size else 0.0
        audio = audio / peak if peak > 1e-8 else np.zeros_like(audio)   # Piper's own normalization
        return np.clip(audio, -1.0, 1.0), ids, rest

    # ---- CodecModel -------------------------------------------------------------------------------
    def check_params(self, params: Optional[TTSParams]) -> None:
        """Raises ParamError naming the field Piper cannot honour (an unknown voice, cloning, ...)."""
        check_speech_params(params, self.capabilities(), self.voice_specs)

    def new_state(self, params: TTSParams) -> PiperState:
        return PiperState(self.voice_specs[params.voice or self.default_voice], params)

    def batch_key(self, state: PiperState) -> None:
        return None                             # every sentence runs its own forward: any mix batches

    def take(self, state: PiperState, piece: Any) -> bool:
        if isinstance(piece, dict):
            piece = piece.get("prompt", piece.get("input"))
        if isinstance(piece, str):
            piece = TTSInput.from_text(piece)
        if not isinstance(piece, TTSInput):
            raise ValueError("a TTS input must be text or a TTSInput")
        cleaned = (clean_for_speech(s) for s in piece.sentences)
        state.pending.extend(s for s in cleaned if s)
        return piece.finished

    def ready(self, state: PiperState, input_done: bool) -> Optional[str]:
        return state.pending[0] if state.pending else None

    def decode(self, states: list[PiperState], chunks: list[str]) -> list[np.ndarray]:
        """Speaks the next piece of each state's next sentence (`chunks`), one forward each; the
        states move on only once all of them are synthesized."""
        spoken = []
        for state, sentence in zip(states, chunks):
            start = time.perf_counter()
            spoken.append(self._speak(state, sentence))
            self._synth_seconds += time.perf_counter() - start
        audio = []
        for state, sentence, (wav, ids, rest) in zip(states, chunks, spoken):
            state.sample_rate = self._model(state.voice).config.sample_rate
            state.phoneme_ids.extend(ids)
            state.rest = rest or None
            if not rest:                        # the sentence is spoken
                state.pending.popleft()
                state.spoken.append(sentence)
            audio.append(wav)
        return audio

    def sample_rate(self, state: PiperState) -> int:
        return state.sample_rate or state.voice.sample_rate

    def prompt(self, state: PiperState) -> tuple[Optional[str], list[int]]:
        return " ".join(state.spoken), state.phoneme_ids

    def stats(self) -> dict[str, float]:
        return {"synthesis_seconds_total": self._synth_seconds}


def next_piece(sentences: list[list[str]], most: int) -> tuple[list[str], list[list[str]]]:
    """The phonemes one forward speaks next, and the phoneme sentences left after them: the first
    sentence whole when it has at most `most` phonemes, else its first `most` cut after the last
    pause in their second half, or at the last word break, or right there."""
    first, later = sentences[0], sentences[1:]
    if len(first) <= most:
        return first, later
    window = first[:most]
    cut = max((i + 1 for i, p in enumerate(window) if p in _PAUSES and i >= most // 2), default=0)
    if cut == 0:
        cut = max((i for i, p in enumerate(window) if p == " "), default=0)
    if cut == 0:
        cut = most
    rest = first[cut:]
    if rest and rest[0] == " ":
        rest = rest[1:]
    return first[:cut], ([rest] if rest else []) + later
