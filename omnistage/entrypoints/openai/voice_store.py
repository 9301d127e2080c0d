"""Uploaded voices: reference audio + transcript + metadata, one file per voice in a server folder
(API-server process; file I/O runs in worker threads).

In: `VoiceStore.add(StoredVoice)` from `POST /v1/audio/voices`, `delete(name)`, look-ups by name.
Out: `describe()` entries for `GET /v1/audio/voices` and, for a speech request naming an uploaded
voice, its `reference(name)` -> (float32 mono samples, rate, ref_text), what a cloning model reads as
`ref_audio` / `ref_text`. The stored form is generic -- the decoded reference and its text, no
model's encoding of it -- so any cloning model can use it and cache its own encoding (keyed by
`StoredVoice.digest`).

A voice is `{directory}/{name}.safetensors`: one float32 tensor `audio` and string metadata (name,
sample_rate, ref_text, speaker_description, consent, created_at, digest). Files are written to a
temporary name and renamed, so a crash leaves no half file. At start the store reads every file's
metadata (not its audio: up to `max_voices` references stay on disk until used), skipping
unreadable ones with a warning; the folder is created only by the first upload.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

logger = logging.getLogger(__name__)

DEFAULT_MAX_VOICES = 1000                       # `--speaker-max-uploaded`: uploaded voices kept at most
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_SUFFIX = ".safetensors"


def default_voice_dir() -> str:
    """`--speaker-samples-dir`'s default: `$XDG_CACHE_HOME/omnistage/voices` (~/.cache without it)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "omnistage", "voices")


@dataclass
class StoredVoice:
    """One uploaded voice (its audio is loaded only when `samples` is given or read back)."""

    name: str                                   # what requests put in `voice`
    sample_rate: int                            # Hz of the reference audio
    seconds: float                              # length of the reference audio
    consent: str                                # the uploader's consent statement or record id, as sent
    ref_text: Optional[str] = None              # transcript of the reference audio (in-context cloning)
    speaker_description: Optional[str] = None   # free text about the speaker
    created_at: int = 0                         # unix seconds of the upload
    digest: str = ""                            # sha256 of the stored samples: a model's cache key
    samples: Optional[np.ndarray] = None        # float32 mono audio; None = still on disk only

    def describe(self) -> dict[str, Any]:
        return {"id": self.name, "name": self.name, "sample_rate": self.sample_rate, "seconds": round(self.seconds, 3),
                "ref_text": self.ref_text, "speaker_description": self.speaker_description,
                "created_at": self.created_at, "uploaded": True}


def _metadata(voice: StoredVoice) -> dict[str, str]:
    meta = {"name": voice.name, "sample_rate": str(voice.sample_rate), "seconds": repr(voice.seconds),
            "consent": voice.consent, "created_at": str(voice.created_at), "digest": voice.digest}
    for key in ("ref_text", "speaker_description"):
        if getattr(voice, key) is not None:
            meta[key] = getattr(voice, key)
    return meta


def _from_metadata(meta: dict[str, str]) -> StoredVoice:
    return StoredVoice(name=meta["name"], sample_rate=int(meta["sample_rate"]), seconds=float(meta["seconds"]),
                       consent=meta["consent"], ref_text=meta.get("ref_text"),
                       speaker_description=meta.get("speaker_description"), created_at=int(meta["created_at"]),
                       digest=meta["digest"])


class VoiceStore:
    """The uploaded voices of one server, persisted in `directory`."""

    def __init__(self, directory: str, max_voices: int = DEFAULT_MAX_VOICES):
        if not isinstance(max_voices, int) or max_voices < 0:
            raise ValueError(f"speaker_max_uploaded must be an integer >= 0, got {max_voices!r}")
        self.directory = os.path.abspath(os.path.expanduser(directory))
        self.max_voices = max_voices
        self._lock = threading.Lock()
        self._voices: dict[str, StoredVoice] = {}   # name -> voice (metadata only)
        self._restore()

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name + _SUFFIX)

    def _restore(self) -> None:
        from safetensors import safe_open

        if not os.path.isdir(self.directory):
            return
        for entry in sorted(os.listdir(self.directory)):
            name = entry[:-len(_SUFFIX)]
            if not entry.endswith(_SUFFIX) or not NAME_RE.match(name):
                continue
            try:
                with safe_open(self._path(name), framework="numpy") as f:
                    voice = _from_metadata(f.metadata() or {})
            except Exception as e:              # a damaged or foreign file: the others still load
                logger.warning("skipping uploaded voice file %s: %s", entry, e)
                continue
            if voice.name == name:
                self._voices[name] = voice
        if self._voices:
            logger.info("restored %d uploaded voices from %s", len(self._voices), self.directory)

    def names(self) -> list[str]:
        return sorted(self._voices)

    def get(self, name: str) -> Optional[StoredVoice]:
        return self._voices.get(name)

    def describe(self) -> list[dict[str, Any]]:
        return [self._voices[n].describe() for n in self.names()]

    def add(self, voice: StoredVoice) -> StoredVoice:
        """Writes `voice` (with its samples) as a new file; ValueError when the name is taken or the
        store is full. Blocking: call it in a worker thread."""
        from safetensors.numpy import save_file

        samples = np.ascontiguousarray(voice.samples, dtype=np.float32).reshape(-1)
        voice.samples, voice.digest = None, hashlib.sha256(samples.tobytes()).hexdigest()
        voice.created_at = voice.created_at or int(time.time())
        with self._lock:
            if voice.name in self._voices:
                raise ValueError(f"a voice named {voice.name!r} exists already; DELETE /v1/audio/voices/"
                                 f"{voice.name} first")
            if len(self._voices) >= self.max_voices:
                raise ValueError(f"the server holds {len(self._voices)} uploaded voices, its limit "
                                 f"(--speaker-max-uploaded); delete one first")
            os.makedirs(self.directory, exist_ok=True)
            tmp = self._path(voice.name) + ".tmp"
            save_file({"audio": samples}, tmp, metadata=_metadata(voice))
            os.replace(tmp, self._path(voice.name))
            self._voices[voice.name] = voice
        return voice

    def delete(self, name: str) -> bool:
        """Removes the voice and its file; False when there is none by that name."""
        with self._lock:
            if self._voices.pop(name, None) is None:
                return False
            try:
                os.remove(self._path(name))
            except FileNotFoundError:
                pass
            return True

    def reference(self, name: str) -> Optional[tuple[np.ndarray, int, Optional[str]]]:
        """(samples, rate, ref_text) of an uploaded voice, read from its file; None when unknown.
        Blocking: call it in a worker thread."""
        from safetensors.numpy import load_file

        voice = self._voices.get(name)
        if voice is None:
            return None
        try:
            samples = load_file(self._path(name))["audio"]
        except FileNotFoundError:               # deleted meanwhile
            return None
        return samples, voice.sample_rate, voice.ref_text
