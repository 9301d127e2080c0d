"""MP3 / Opus / AAC encoding through PyAV (`omnistage.io.audio`): the bytes decode (with PyAV, FFmpeg's
decoders) to the input signal: the same length within the codec's priming (MP3 and AAC decoders add
about 50 / 90 ms; Opus trims its pre-skip: within 5 ms), and, once aligned, the same waveform (SNR
over 12 dB, where a wrong rate or a dropped chunk gives about 0 dB). Streamed pieces join to a file
that decodes the same, and MP3 / AAC pieces come out before the end (they stream)."""

import io

import numpy as np
import pytest

from omnistage.io.audio import AUDIO_FORMATS, MEDIA_TYPES, AudioStreamEncoder, encode_audio
from omnistage.io.audio_av import audio_duration

av = pytest.importorskip("av")
RATE = 22050
EXTRA_S = {"mp3": 0.12, "aac": 0.15, "opus": 0.005}   # decoded length - input length, at most


def _signal(seconds: float = 1.5) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 1.3 * t)
    return (0.4 * envelope * (np.sin(2 * np.pi * 220 * t) + 0.5 * np.sin(2 * np.pi * 660 * t))).astype(np.float32)


def _decode(data: bytes) -> np.ndarray:
    """Mono float32 at RATE (Opus decodes at 48 kHz: resampled back)."""
    import soxr

    with av.open(io.BytesIO(data)) as c:
        frames = [f.to_ndarray().reshape(-1) for f in c.decode(c.streams.audio[0])]
        rate = c.streams.audio[0].rate
    x = np.concatenate(frames).astype(np.float32)
    return soxr.resample(x, rate, RATE) if rate != RATE else x


def _snr_db(ref: np.ndarray, got: np.ndarray) -> float:
    """SNR of `got` against `ref` at the lag (up to 0.2 s of priming) that lines them up best."""
    lags = range(0, int(0.2 * RATE))
    window = ref[: RATE // 2]
    lag = max(lags, key=lambda k: float(np.dot(window, got[k:k + len(window)])) if k + len(window) <= len(got) else -1)
    aligned = got[lag:lag + len(ref)]
    ref = ref[: len(aligned)]
    return 10 * np.log10(np.sum(ref ** 2) / max(np.sum((ref - aligned) ** 2), 1e-12))


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac"])
def test_whole_file_decodes_to_the_input(fmt):
    x = _signal()
    data = encode_audio(x, RATE, fmt)
    assert fmt in AUDIO_FORMATS and MEDIA_TYPES[fmt].startswith("audio/")
    extra = audio_duration(data) - len(x) / RATE
    assert -0.005 <= extra <= EXTRA_S[fmt]
    assert _snr_db(x, _decode(data)) > 12


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac"])
def test_stream_pieces_join_to_a_file(fmt):
    x = _signal(3.0)
    enc = AudioStreamEncoder(fmt, RATE)
    pieces = [enc.encode(x[i:i + 2205]) for i in range(0, len(x), 2205)]   # 100 ms chunks, as TTS sends
    before_end = sum(len(p) for p in pieces)
    pieces.append(enc.finish())
    data = b"".join(pieces)
    if fmt in ("mp3", "aac"):
        assert before_end > len(data) / 2       # most bytes leave before the end: it streams
    else:
        assert before_end > 0                   # Ogg: the header pages at least
    assert -0.005 <= audio_duration(data) - 3.0 <= EXTRA_S[fmt]
    assert _snr_db(x, _decode(data)) > 12


def test_audio_duration_of_wav_and_flac():
    x = _signal(1.0)
    for fmt in ("wav", "flac"):
        assert audio_duration(encode_audio(x, RATE, fmt)) == pytest.approx(1.0, abs=1e-3)
