"""What a text-to-speech stage takes: `TTSInput` (sentences), `TTSParams` (voice, speed), and the text
rules that cut a growing text into speakable sentences (pure functions; any process).

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

from omnistage.params import check_param
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


@dataclass
class TTSParams:
    voice: Optional[str] = None                 # voice name; None = the stage's default voice
    speed: float = 1.0                          # speech-rate multiplier in [0.25, 4.0]; 2.0 = twice as fast
    instructions: Optional[str] = None          # style prompt; accepted, ignored by voices that take none
    # Qwen3-TTS fields (vLLM-Omni's names, PEER-REFERENCE.md D.3); voices that take none ignore them.
    task_type: Optional[str] = None             # "CustomVoice" | "VoiceDesign" | "Base"; None = the model's own
    language: Optional[str] = None              # "Auto" or a language the model names; None = "Auto"
    ref_audio: Any = None                       # Base: reference voice, (float32 mono samples, Hz) or a data URL / base64 string
    ref_text: Optional[str] = None              # Base: transcript of ref_audio (in-context cloning)
    x_vector_only_mode: bool = False            # Base: clone from the speaker embedding alone (no ref_text needed)
    max_new_tokens: Optional[int] = None        # most codec frames to generate; None = the model's limit

    def __post_init__(self) -> None:
        lo, hi = SPEED_RANGE
        check_param(isinstance(self.speed, (int, float)) and lo <= self.speed <= hi, "speed", f"in [{lo}, {hi}]",
                    self.speed)
        check_param(self.voice is None or isinstance(self.voice, str), "voice", "a string", self.voice)
        check_param(self.max_new_tokens is None or (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1),
                    "max_new_tokens", "an integer >= 1", self.max_new_tokens)


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
