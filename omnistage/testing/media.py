"""Media files in real formats built in code, small on disk but large once decoded (tests, benchmarks).

What a careless or hostile client sends to the chat media routes, each made in about a second or less:
* `silent_flac(seconds, sample_rate)` -> FLAC bytes of digital silence: FLAC stores a constant block
  in a few bytes, so 6 hours at 4 kHz is ~0.3 MB and 86 M samples (345 MB of float32) once decoded.
* `still_mp4(num_frames, width, height, fps)` -> MP4 bytes (H.264) of one grey picture held for
  `num_frames` frames: the first frame is encoded once and its successor, a P-frame that copies it,
  is muxed again for every later frame, so 1920 frames of 1080p are ~65 KB (12 GB of RGB decoded).
  The header says what a real video of that length says (frame count, duration, size); decoders
  decode every frame.
`PeakRSS` measures how much memory decoding such a file takes. Runs in the caller's process; needs
soundfile and PyAV (the server's own media dependencies).
"""

from __future__ import annotations

import io

import numpy as np


def silent_flac(seconds: float, sample_rate: int = 4000) -> bytes:
    """FLAC (16-bit mono) of `seconds` of silence."""
    import soundfile as sf

    buf, left = io.BytesIO(), int(seconds * sample_rate)
    block = np.zeros(1 << 20, np.int16)
    with sf.SoundFile(buf, "w", samplerate=sample_rate, channels=1, format="FLAC", subtype="PCM_16") as f:
        while left:
            f.write(block[:min(left, len(block))])
            left -= min(left, len(block))
    return buf.getvalue()


def still_mp4(num_frames: int, width: int = 1920, height: int = 1080, fps: int = 30, level: int = 90,
              container: str = "mp4") -> bytes:
    """MP4 of `num_frames` frames of one flat grey picture (`level`) at `fps` (see the module doc);
    `container="h264"` gives the raw H.264 stream instead, whose header says neither length nor count."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "ultrafast", "bframes": "0", "keyint": str(max(2, num_frames)), "crf": "30"}
        frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), level, np.uint8), format="rgb24")
        packets = []
        for pts in range(2):
            frame.pts = pts
            packets += list(stream.encode(frame))
        packets += list(stream.encode())
        time_base = packets[0].time_base        # the encoder's; muxing rescales packets in place
        repeat = bytes(packets[1])
        out.mux(packets[0])
        for pts in range(1, num_frames):
            packet = av.Packet(repeat)
            packet.pts = packet.dts = pts
            packet.time_base, packet.stream = time_base, stream
            out.mux(packet)
    return buf.getvalue()


class PeakRSS:
    """`with PeakRSS() as peak: ...` then `peak.growth_mb`: how far this process's resident memory
    (VmRSS, Linux) rose above its level at entry, sampled every millisecond from a thread."""

    def __init__(self, interval_s: float = 0.001):
        self.interval_s = interval_s
        self.growth_mb = 0.0

    @staticmethod
    def rss_mb() -> float:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS in /proc/self/status")

    def __enter__(self) -> "PeakRSS":
        import threading

        self._base, self._peak, self._stop = self.rss_mb(), 0.0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, self.rss_mb())
            self._stop.wait(self.interval_s)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.growth_mb = max(self._peak, self.rss_mb()) - self._base
