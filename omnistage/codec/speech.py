"""What a text-to-speech stage takes: `TTSInput` (sentences), `TTSParams` (voice, speed), and the text
rules that cut a growing text into speakable sentences (pure functions; any process).

A TTS stage receives a request either whole (a plain string, `TTSInput(finished=True)`) or streamed
from an upstream LM as the text grows: the text -> TTS adapter sends each sentence once it is
complete, and the last piece with `finished=True`. `TTSInput` supports the orchestrator's streaming
protocol (`len()` counts units produced so far, `slice()` cuts a piece), so the orchestrator forwards
pieces without knowing what a sentence is. `text_to_tts` is the LM -> TTS edge adapter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

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
MAX_SENTENCE_CHARS = 300                        # longer runs without an end are cut at a clause boundary


@dataclass
class TTSParams:
    voice: Optional[str] = None                 # voice name; None = the stage's default voice
    speed: float = 1.0                          # speech-rate multiplier in [0.25, 4.0]; 2.0 = twice as fast
    instructions: Optional[str] = None          # style prompt; accepted, ignored by voices that take none

    def __post_init__(self) -> None:
        lo, hi = SPEED_RANGE
        check_param(isinstance(self.speed, (int, float)) and lo <= self.speed <= hi, "speed", f"in [{lo}, {hi}]",
                    self.speed)
        check_param(self.voice is None or isinstance(self.voice, str), "voice", "a string", self.voice)


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


def clean_for_speech(text: str) -> str:
    """Drops markdown marks and list bullets and folds whitespace: what a voice should read."""
    text = _LIST_MARK.sub("", text)
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


def split_sentences(text: str, final: bool) -> tuple[list[str], str]:
    """Complete sentences of a (growing) text, cleaned for speech, and the unfinished rest.

    With `final` the rest is the text's last sentence (it will not grow any more). Sentences that
    clean to nothing (only markdown or whitespace) are dropped. Calling this on a longer version of
    the same text never changes the sentences already returned: a sentence ends only where the
    following whitespace has already arrived.
    """
    sentences: list[str] = []
    start = 0
    for m in _SENTENCE_END.finditer(text):
        if not _ends_sentence(text, m.end()) or m.end() <= start:
            continue
        piece = clean_for_speech(text[start:m.end()])
        start = m.end()
        if piece:
            sentences.append(piece)
    rest = text[start:]
    while len(rest) > MAX_SENTENCE_CHARS:       # a run-on without an end: cut at the last clause mark
        cut = max(rest.rfind(c, 0, MAX_SENTENCE_CHARS) for c in ",;:")
        cut = cut + 1 if cut > 0 else rest.rfind(" ", 0, MAX_SENTENCE_CHARS)
        if cut <= 0:
            break
        piece = clean_for_speech(rest[:cut])
        if piece:
            sentences.append(piece)
        rest = rest[cut:]
    if final:
        piece = clean_for_speech(rest)
        if piece:
            sentences.append(piece)
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
