"""What a text-to-speech stage takes: `TTSInput` (sentences), `TTSParams` (voice, speed, task fields),
what a TTS model declares it can do (`SpeechCapabilities`, checked by `check_speech_params`), and
the text rules that cut a growing text into speakable sentences (pure functions; any process).

`TTSParams` carries vLLM-Omni's request fields (`task_type`, `language`, `instructions`,
`ref_audio`, `ref_text`, `x_vector_only_mode`, `max_new_tokens`, `initial_codec_chunk_frames`).
Their ranges are checked when the params are built; whether the served model honours them is
checked by its `check_params` against its `SpeechCapabilities`, so a field the model cannot honour
is a `ParamError` naming the field and what the model supports (an HTTP 400), never ignored.

A TTS stage receives a request either whole (a plain string, `TTSInput(finished=True)`) or streamed
from an upstream LM as the text grows: the text -> TTS adapter sends each sentence once it is
complete, and the last piece with `finished=True`. `TTSInput` supports the orchestrator's streaming
protocol (`len()` counts units produced so far, `slice()` cuts a piece), so the orchestrator forwards
pieces without knowing what a sentence is. `text_to_tts` is the LM -> TTS edge adapter.

Whatever text arrives (a user's `input`, an LM's output) is made speakable first (`speakable`):
control and format characters, lone surrogates, private-use and unassigned code points are
dropped, and runs of combining marks are capped, so no voice back end sees what it cannot encode.
A run of text with no sentence end is cut at `MAX_SENTENCE_CHARS` (at a clause mark or a space
when there is one), so no sentence, and no step of a TTS stage, grows with the input.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from omnistage.params import ParamError, check_param
from omnistage.stage import StageOutput

SPEED_RANGE = (0.25, 4.0)                       # OpenAI's range for /v1/audio/speech `speed`
# A sentence ends at . ! ? … (optionally followed by closing quotes / brackets) and then whitespace.
_SENTENCE_END = re.compile(r"[.!?…]+[\"'”’)\]]*(?=\s)|\n\s*\n|\n(?=\s*(?:[-*•]|\d+\.)\s)")
# Words whose final period does not end a sentence.
_ABBREVIATIONS = frozenset({"mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "etc", "e.g", "i.e", "no",
                            "fig", "approx", "inc", "ltd", "co"})
# Markdown that an LM writes and a voice should not read aloud.
_MARKDOWN = re.compile(r"[*_`#>|~]+")
_LIST_MARK = re.compile(r"^\s*(?:[-•]|\d+\.)\s+", re.MULTILINE)
_SPACES = re.compile(r"\s+")
MAX_SENTENCE_CHARS = 300                        # longer runs without an end are cut at a clause mark, a space, or here
MAX_MARKS_PER_CHAR = 3                          # combining marks kept after one base character (more: "zalgo" text)
# Unicode categories no voice reads: control, format, surrogate, private use, unassigned (whitespace is kept).
_UNSPEAKABLE = frozenset({"Cc", "Cf", "Cs", "Co", "Cn"})
_ASCII_UNSPEAKABLE = re.compile(r"[\x00-\x08\x0e-\x1b\x7f]")   # the ASCII controls that are not whitespace


TASK_TYPES = ("CustomVoice", "VoiceDesign", "Base")   # preset speakers | a voice described by `instructions` | cloning
MAX_REF_AUDIO_SECONDS = 30.0                    # longest reference audio a request may carry
MAX_REF_SAMPLE_RATE = 96000                     # Hz, highest sample rate of reference audio
MAX_REF_TEXT_CHARS = 4096                       # longest `ref_text` / `instructions`
MAX_NEW_TOKENS_LIMIT = 16384                    # `max_new_tokens` at most (~22 minutes of 12 Hz codec frames)
MAX_CHUNK_FRAMES = 1024                         # `initial_codec_chunk_frames` at most
_CLONING_FIELDS = ("ref_audio", "ref_text", "x_vector_only_mode")
_GENERATION_FIELDS = ("max_new_tokens", "initial_codec_chunk_frames")


def _optional_text(value: Any, name: str, most: int) -> None:
    check_param(value is None or (isinstance(value, str) and len(value) <= most), name,
                f"a string of at most {most} characters", value if not isinstance(value, str) else value[:40])


def _optional_int(value: Any, name: str, most: int) -> None:
    check_param(value is None or (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= most),
                name, f"an integer in [1, {most}]", value)


def reference_audio(value: Any) -> Optional[tuple[np.ndarray, int]]:
    """`ref_audio` as (float32 mono samples, rate): a 2-item tuple or list (what crosses a process
    boundary), checked against `MAX_REF_AUDIO_SECONDS` and `MAX_REF_SAMPLE_RATE`."""
    if value is None:
        return None
    ok = isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[1], int) and not isinstance(
        value[1], bool)
    check_param(ok, "ref_audio", "(float32 mono samples, sample rate in Hz)", type(value).__name__)
    samples, rate = np.asarray(value[0], dtype=np.float32).reshape(-1), value[1]
    check_param(0 < rate <= MAX_REF_SAMPLE_RATE, "ref_audio", f"sampled at 1 to {MAX_REF_SAMPLE_RATE} Hz", rate)
    seconds = len(samples) / rate
    check_param(0 < seconds <= MAX_REF_AUDIO_SECONDS, "ref_audio",
                f"between 0 and {MAX_REF_AUDIO_SECONDS:g} seconds long", f"{seconds:.2f} s")
    return samples, rate


@dataclass
class TTSParams:
    voice: Optional[str] = None                 # voice name; None = the stage's default voice
    speed: float = 1.0                          # speech-rate multiplier in [0.25, 4.0]; 2.0 = twice as fast
    instructions: Optional[str] = None          # style prompt (VoiceDesign: the voice's description); else may be ignored
    task_type: Optional[str] = None             # one of TASK_TYPES; None = the model's default (its first task type)
    language: Optional[str] = None              # language of the text, "Auto" or one the model lists; None = Auto
    ref_audio: Optional[tuple] = field(default=None, compare=False)  # (float32 mono samples, rate Hz) to clone (Base)
    ref_text: Optional[str] = None              # transcript of `ref_audio` (in-context cloning)
    x_vector_only_mode: bool = False            # clone from the reference's speaker embedding alone (no ref_text)
    max_new_tokens: Optional[int] = None        # codec frames generated at most; None = the model's limit
    initial_codec_chunk_frames: Optional[int] = None  # codec frames in the first streamed chunk; None = the stage's

    def __post_init__(self) -> None:
        lo, hi = SPEED_RANGE
        check_param(isinstance(self.speed, (int, float)) and lo <= self.speed <= hi, "speed", f"in [{lo}, {hi}]",
                    self.speed)
        check_param(self.voice is None or isinstance(self.voice, str), "voice", "a string", self.voice)
        check_param(self.task_type is None or self.task_type in TASK_TYPES, "task_type", f"one of {list(TASK_TYPES)}",
                    self.task_type)
        _optional_text(self.language, "language", 64)
        _optional_text(self.instructions, "instructions", MAX_REF_TEXT_CHARS)
        _optional_text(self.ref_text, "ref_text", MAX_REF_TEXT_CHARS)
        check_param(isinstance(self.x_vector_only_mode, bool), "x_vector_only_mode", "true or false",
                    self.x_vector_only_mode)
        _optional_int(self.max_new_tokens, "max_new_tokens", MAX_NEW_TOKENS_LIMIT)
        _optional_int(self.initial_codec_chunk_frames, "initial_codec_chunk_frames", MAX_CHUNK_FRAMES)
        self.ref_audio = reference_audio(self.ref_audio)


@dataclass(frozen=True)
class SpeechCapabilities:
    """What a TTS model can honour (declared by its codec model's `capabilities()`)."""

    task_types: tuple[str, ...] = ("CustomVoice",)  # task types it serves; the first is its default
    languages: tuple[str, ...] = ("Auto",)          # `language` values it takes
    fields: frozenset = frozenset()                 # of _GENERATION_FIELDS, those it honours

    @property
    def clones(self) -> bool:
        return "Base" in self.task_types

    def describe(self) -> dict[str, Any]:
        return {"task_types": list(self.task_types), "languages": list(self.languages),
                "clones": self.clones, "fields": sorted(self.fields)}


def check_speech_params(params: Optional[TTSParams], caps: SpeechCapabilities, presets) -> None:
    """Raises `ParamError` naming the first field of `params` the model (`caps`, its preset voices
    `presets`) cannot honour, with what it supports; None = the defaults, always fine."""
    if params is None:
        return
    tasks = list(caps.task_types)
    if not caps.clones:                         # cloning first: an uploaded voice sets task_type Base itself
        if params.ref_audio is not None and params.voice is not None and params.voice not in presets:
            raise ParamError("voice", f"voice {params.voice[:40]!r} is an uploaded voice, and this model does not "
                                      f"clone voices; use one of {sorted(presets)}")
        for name in _CLONING_FIELDS:
            if getattr(params, name) not in (None, False):
                raise ParamError(name, f"{name} needs a model that clones voices (task_type Base); this model "
                                       f"serves task types {tasks}")
    if params.task_type is not None and params.task_type not in tasks:
        raise ParamError("task_type", f"task_type must be one of {tasks} for this model, got {params.task_type!r}")
    if params.language is not None and params.language not in caps.languages:
        raise ParamError("language", f"language must be one of {list(caps.languages)} for this model, "
                                     f"got {params.language[:40]!r}")
    for name in _GENERATION_FIELDS:
        if getattr(params, name) is not None and name not in caps.fields:
            raise ParamError(name, f"{name} is not supported by this model (it honours "
                                   f"{sorted(caps.fields) or 'none of ' + str(list(_GENERATION_FIELDS))})")
    task = params.task_type or tasks[0]
    if task == "Base":
        if params.ref_audio is None:
            raise ParamError("ref_audio", "ref_audio is required for task_type Base (the voice to clone)")
        if params.ref_text is None and not params.x_vector_only_mode:
            raise ParamError("ref_text", "ref_text (the reference's transcript) is required for task_type Base "
                                         "unless x_vector_only_mode is true")
        return
    for name in _CLONING_FIELDS:
        if getattr(params, name) not in (None, False):
            raise ParamError(name, f"{name} is only used with task_type Base, got task_type {task!r}")
    if task == "VoiceDesign":
        if not params.instructions:
            raise ParamError("instructions", "instructions (a description of the voice) are required for "
                                             "task_type VoiceDesign")
        return
    check_voice(params, presets)


@dataclass
class TTSInput:
    sentences: list[str] = field(default_factory=list)  # text to speak, one entry per sentence, in order
    finished: bool = True                       # no sentence follows the last one given so far

    def __len__(self) -> int:
        return len(self.sentences)

    def slice(self, start: int, end: int, finished: bool) -> "TTSInput":
        """Sentences [start, end) as a piece of a streamed request."""
        return TTSInput(self.sentences[start:end], finished)

    @classmethod
    def from_text(cls, text: str) -> "TTSInput":
        sentences, rest = split_sentences(text, final=True)
        return cls(sentences + ([rest] if rest else []), True)


def check_voice(params, known) -> None:
    """Raises ParamError naming the valid voices when `params.voice` (None = the default) is not one
    of `known`: what every voice back end's `check_params` says of an unknown voice."""
    voice = getattr(params, "voice", None)
    check_param(voice is None or voice in known, "voice", f"one of {sorted(known)}", voice)


def speakable(text: str) -> str:
    """`text` without what no voice can read: control and format characters (whitespace stays),
    lone surrogates, private-use and unassigned code points; at most `MAX_MARKS_PER_CHAR`
    combining marks after a character; NFC. Works character by character, so a prefix of a
    growing text keeps its result up to its last whitespace."""
    if text.isascii():
        return _ASCII_UNSPEAKABLE.sub("", text)
    kept, marks = [], 0
    for c in text:
        category = unicodedata.category(c)
        if category[0] == "M":
            marks += 1
            if marks > MAX_MARKS_PER_CHAR:
                continue
        elif category in _UNSPEAKABLE and not c.isspace():
            continue
        else:
            marks = 0
        kept.append(c)
    return unicodedata.normalize("NFC", "".join(kept))


def clean_for_speech(text: str) -> str:
    """What a voice should read of `text`: `speakable` characters, no markdown marks or list
    bullets, whitespace folded."""
    text = _LIST_MARK.sub("", speakable(text))
    text = _MARKDOWN.sub("", text)
    return _SPACES.sub(" ", text).strip()


def _ends_sentence(text: str, end: int) -> bool:
    """False when the period at text[end-1] closes an abbreviation or an initial ("Dr.", "J.")."""
    if text[end - 1] != ".":
        return True
    word = re.search(r"([\w.]+)\.$", text[:end])
    if word is None:
        return True
    w = word.group(1).lower()
    return not (w in _ABBREVIATIONS or (len(w) == 1 and w.isalpha()))


def _clause_cut(run: str) -> int:
    """Where to cut a run longer than `MAX_SENTENCE_CHARS` that has no sentence end in its first
    `MAX_SENTENCE_CHARS`: after the last clause mark there, else at the last space, else right
    there (never between a character and its combining marks)."""
    cut = max(run.rfind(c, 0, MAX_SENTENCE_CHARS) for c in ",;:")
    if cut > 0:
        return cut + 1
    cut = run.rfind(" ", 0, MAX_SENTENCE_CHARS)
    if cut > 0:
        return cut
    cut = MAX_SENTENCE_CHARS
    while cut > 1 and unicodedata.category(run[cut])[0] == "M":
        cut -= 1
    return cut


def split_sentences(text: str, final: bool) -> tuple[list[str], str]:
    """Complete sentences of a (growing) text, cleaned for speech, and the unfinished rest.

    With `final` the rest is the text's last sentence (it will not grow any more). Sentences that
    clean to nothing (only markdown, whitespace or unspeakable characters) are dropped. A sentence
    has at most `MAX_SENTENCE_CHARS` characters: a longer run is cut (`_clause_cut`). Calling this
    on a longer version of the same text never changes the sentences already returned: a sentence
    ends only where the following whitespace has already arrived, and a run is cut only once more
    than `MAX_SENTENCE_CHARS` of it are there.
    """
    text = speakable(text)
    sentences: list[str] = []
    start = 0

    def emit(end: int) -> None:
        nonlocal start
        piece = clean_for_speech(text[start:end])
        start = end
        if piece:
            sentences.append(piece)

    for m in _SENTENCE_END.finditer(text):
        if not _ends_sentence(text, m.end()) or m.end() <= start:
            continue
        while m.end() - start > MAX_SENTENCE_CHARS:   # a run-on before this end: cut it first
            emit(start + _clause_cut(text[start:start + MAX_SENTENCE_CHARS + 1]))
        emit(m.end())
    while len(text) - start > MAX_SENTENCE_CHARS:     # a run-on without an end (yet)
        emit(start + _clause_cut(text[start:start + MAX_SENTENCE_CHARS + 1]))
    rest = text[start:]
    if final:
        emit(len(text))
        rest = ""
    return sentences, rest


# ---- edge adapters (declared in the model registry's "piper" entry) ------------------------------
def text_to_tts(out: StageOutput) -> TTSInput:
    """LM text so far -> the complete sentences in it (all of it once the LM has finished).

    Speaks the first completion (choice 0). A sentence counts as complete once the whitespace after
    its final punctuation has arrived, so a sentence once returned never changes as the text grows.
    """
    comps = out.output.outputs
    text = comps[0].text if comps else ""
    sentences, _ = split_sentences(text, final=out.finished)
    return TTSInput(sentences, finished=out.finished)


def text_to_text(out: StageOutput) -> Optional[dict]:
    """LM text -> a prompt for another text stage (e.g. a rewriter); whole output only."""
    if not out.finished:
        return None
    comps = out.output.outputs
    return {"prompt": comps[0].text if comps else ""}
