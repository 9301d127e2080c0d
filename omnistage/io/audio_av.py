"""Compressed audio through PyAV (FFmpeg): mp3, opus and aac, encoded chunk by chunk (API-server process).

In: mono float32 samples in [-1, 1] at any rate, fed in chunks. Out: the bytes of one stream, piece by
piece (`AVAudioEncoder.encode` / `finish`; `b"".join` of all pieces is the file): MP3 (libmp3lame,
no Xing header, so nothing is rewritten at the end), Ogg Opus (libopus at the nearest rate Opus
allows: 24 kHz for a 22.05 kHz voice; Ogg pages come out about once a second) and AAC in ADTS frames
(FFmpeg's aac). All three stream: each piece is playable after the ones before it. MP3 and AAC
decoders add the codec's priming samples (about 50 ms and 90 ms); Opus records its pre-skip, so
it decodes to the input's length. `audio_duration` decodes any file FFmpeg reads and returns its
length in seconds (what `omnistage bench` uses for the real-time factor).
"""

from __future__ import annotations

import io

import numpy as np

# format -> (FFmpeg muxer, encoder, muxer options)
CODECS = {"mp3": ("mp3", "libmp3lame", {"write_xing": "0"}),
          "opus": ("ogg", "libopus", {}),
          "aac": ("adts", "aac", {})}


class _Sink:
    """A write-only file for the muxer: what it writes is taken as it comes (no seeking back)."""

    def __init__(self):
        self.parts: list[bytes] = []

    def write(self, data) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out, self.parts = b"".join(self.parts), []
        return out


def _encoder_rate(codec: str, rate: int) -> int:
    """`rate` when the encoder takes it, else the smallest rate above it that it takes (else its highest)."""
    import av

    rates = av.codec.Codec(codec, "w").audio_rates
    if not rates or rate in rates:
        return rate
    above = sorted(r for r in rates if r >= rate)
    return above[0] if above else max(rates)


class AVAudioEncoder:
    """One mp3 / opus / aac stream: `encode(chunk)` -> bytes ready so far, `finish()` -> the rest."""

    def __init__(self, fmt: str, sample_rate: int):
        import av

        muxer, codec, options = CODECS[fmt]
        self.sample_rate = sample_rate
        self._sink = _Sink()
        self._container = av.open(self._sink, mode="w", format=muxer, options=options)
        self._stream = self._container.add_stream(codec, rate=_encoder_rate(codec, sample_rate))
        self._stream.layout = "mono"
        self._done = False

    def encode(self, chunk: np.ndarray) -> bytes:
        import av

        x = np.clip(np.asarray(chunk, dtype=np.float32).reshape(-1), -1.0, 1.0)
        if len(x):
            frame = av.AudioFrame.from_ndarray(x[None, :], format="flt", layout="mono")
            frame.sample_rate = self.sample_rate
            for packet in self._stream.encode(frame):   # PyAV resamples to the encoder's format and rate
                self._container.mux(packet)
        return self._sink.take()

    def finish(self) -> bytes:
        if not self._done:
            self._done = True
            for packet in self._stream.encode(None):
                self._container.mux(packet)
            self._container.close()
        return self._sink.take()


def encode_av(samples: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """The whole signal as one mp3 / opus / aac file."""
    enc = AVAudioEncoder(fmt, sample_rate)
    return enc.encode(samples) + enc.finish()


def audio_duration(data: bytes) -> float:
    """Seconds of audio in a file FFmpeg can read (wav, flac, mp3, ogg / opus, aac, ...); decodes it all."""
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        samples, rate = 0, None
        for frame in container.decode(stream):
            samples += frame.samples
            rate = frame.sample_rate
    return samples / rate if rate else 0.0
