"""Audio encoding for responses: float32 samples -> WAV, PCM, FLAC, MP3, Opus, AAC (API-server process).

In: mono float32 samples in [-1, 1] and their sample rate. Out: bytes of a whole file
(`encode_audio`) or of a byte stream built chunk by chunk (`AudioStreamEncoder`): PCM is raw
16-bit little-endian samples; a streamed WAV is a header whose sizes say "unknown length"
(0xFFFFFFFF, as streaming servers write it; libsndfile, ffmpeg and browsers read to the end) followed
by PCM; FLAC needs the whole signal for its header, so a FLAC stream is sent as one piece at the end;
MP3, Opus (in Ogg) and AAC (ADTS) go through PyAV (`io/audio_av.py`) and stream as they are encoded.
`decode_audio` reads an uploaded file (chat audio input) back into mono float32 samples, refusing
files whose header says they are too long or too fast-sampled before decoding any sample.
"""

from __future__ import annotations

import io
import struct
from typing import Optional

import numpy as np

from omnistage.io.audio_av import CODECS, AVAudioEncoder, encode_av
from omnistage.io.media import MediaError

AUDIO_FORMATS = ("wav", "pcm", "flac", "mp3", "opus", "aac")
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac", "mp3": "audio/mpeg",
               "opus": "audio/ogg", "aac": "audio/aac"}
_UNKNOWN_SIZE = 0xFFFFFFFF


def check_format(fmt: str) -> str:
    if fmt not in AUDIO_FORMATS:
        raise ValueError(f"response_format must be one of {', '.join(AUDIO_FORMATS)}, got {fmt!r}")
    return fmt


def to_pcm16(samples: np.ndarray) -> bytes:
    """float32 in [-1, 1] -> 16-bit little-endian PCM (values outside are clipped)."""
    x = np.clip(np.asarray(samples, dtype=np.float32).reshape(-1), -1.0, 1.0)
    return (x * 32767.0).round().astype("<i2").tobytes()


def wav_header(sample_rate: int, num_samples: Optional[int] = None) -> bytes:
    """44-byte PCM16 mono WAV header; `num_samples` None writes the streaming "unknown" sizes."""
    data = _UNKNOWN_SIZE if num_samples is None else 2 * num_samples
    riff = _UNKNOWN_SIZE if num_samples is None else 36 + data
    return struct.pack("<4sI4s4sIHHIIHH4sI", b"RIFF", riff, b"WAVE", b"fmt ", 16, 1, 1, sample_rate,
                       2 * sample_rate, 2, 16, b"data", data)


def encode_audio(samples: np.ndarray, sample_rate: int, fmt: str = "wav") -> bytes:
    check_format(fmt)
    if fmt == "pcm":
        return to_pcm16(samples)
    if fmt == "wav":
        pcm = to_pcm16(samples)
        return wav_header(sample_rate, len(pcm) // 2) + pcm
    if fmt in CODECS:
        return encode_av(samples, sample_rate, fmt)
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, np.asarray(samples, dtype=np.float32).reshape(-1), sample_rate, format="FLAC", subtype="PCM_16")
    return buf.getvalue()


class AudioStreamEncoder:
    """Bytes of one audio stream, fed chunk by chunk; `b"".join` of all returned pieces is the file."""

    def __init__(self, fmt: str, sample_rate: int):
        self.fmt = check_format(fmt)
        self.sample_rate = sample_rate
        self._started = False
        self._held: list[np.ndarray] = []       # FLAC only: everything, encoded at the end
        self._av = AVAudioEncoder(fmt, sample_rate) if fmt in CODECS else None   # mp3 / opus / aac

    def encode(self, chunk: np.ndarray) -> bytes:
        if self._av is not None:
            return self._av.encode(chunk)
        if self.fmt == "flac":
            self._held.append(np.asarray(chunk, dtype=np.float32).reshape(-1))
            return b""
        head = b""
        if not self._started and self.fmt == "wav":
            head = wav_header(self.sample_rate)
        self._started = True
        return head + to_pcm16(chunk)

    def finish(self) -> bytes:
        if self._av is not None:
            return self._av.finish()
        if self.fmt == "flac":
            samples = np.concatenate(self._held) if self._held else np.zeros(0, np.float32)
            return encode_audio(samples, self.sample_rate, "flac")
        return self.encode(np.zeros(0, np.float32)) if not self._started else b""


DEFAULT_MAX_AUDIO_BYTES = 25 * 1024 * 1024      # OpenAI's audio upload limit
DEFAULT_MAX_AUDIO_SECONDS = 600.0               # 10 minutes
DEFAULT_MAX_SAMPLE_RATE = 96000                 # Hz: with 10 minutes, at most 230 MB of decoded mono float32
_BLOCK_VALUES = 1 << 20                         # samples (frames x channels) read per block: 4 MB of float32


def decode_audio(data: bytes, max_bytes: int = DEFAULT_MAX_AUDIO_BYTES,
                 max_seconds: float = DEFAULT_MAX_AUDIO_SECONDS, max_sample_rate: int = DEFAULT_MAX_SAMPLE_RATE,
                 field: str = "audio") -> tuple[np.ndarray, int]:
    """Untrusted audio file bytes (WAV, FLAC, OGG, MP3: what libsndfile reads) -> (float32 mono, rate).

    The header's length and sample rate are checked before any sample is decoded; the file is then
    read in blocks, mixed down to mono block by block, and reading stops past `max_seconds` whatever
    the header said. Raises `MediaError` (a ValueError) with a message fit for a 4xx, naming `field`,
    when the payload is empty, too large, too long, sampled too fast or unreadable.
    """
    import soundfile as sf

    if not isinstance(data, (bytes, bytearray)) or len(data) == 0:
        raise MediaError(f"{field} is empty or not bytes")
    if len(data) > max_bytes:
        raise MediaError(f"{field} is {len(data)} bytes; the limit is {max_bytes} bytes")
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            rate = int(f.samplerate)
            blocks = _read_mono(f, max_seconds, max_sample_rate, field)
    except MediaError:
        raise
    except Exception as e:                      # libsndfile raises several types for bad input
        raise MediaError(f"{field} could not be decoded as audio ({type(e).__name__}: {e})") from None
    if not blocks:
        raise MediaError(f"{field} has no samples")
    return np.concatenate(blocks), rate


def _read_mono(f, max_seconds: float, max_sample_rate: int, field: str) -> list[np.ndarray]:
    """An open SoundFile -> its samples as mono float32 blocks; MediaError past the limits."""
    rate, channels = int(f.samplerate), max(1, int(f.channels))
    if not 0 < rate <= max_sample_rate:
        raise MediaError(f"{field} has a sample rate of {rate} Hz; the limit is {max_sample_rate} Hz")
    limit = int(max_seconds * rate)             # samples per channel
    if f.frames > limit:                        # from the header: nothing is decoded yet
        raise MediaError(f"{field} is {f.frames / rate:g} seconds long; the limit is {max_seconds:g} seconds")
    blocks, total = [], 0
    while True:
        block = f.read(max(1, _BLOCK_VALUES // channels), dtype="float32", always_2d=True)
        if len(block) == 0:
            return blocks
        total += len(block)
        if total > limit:                       # the header under-stated the length
            raise MediaError(f"{field} is longer than its header says; the limit is {max_seconds:g} seconds")
        blocks.append(block.mean(axis=1) if channels > 1 else block[:, 0].copy())
