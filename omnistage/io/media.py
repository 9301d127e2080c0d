"""Media encode / decode for the entry points (runs wherever the caller runs; no torch).

In / out:
- `encode_image(PIL image, "png" | "jpeg" | "webp") -> bytes`
- `decode_image(bytes, max_bytes=..., max_pixels=...) -> PIL image (RGB)`; raises `MediaError` (a
  ValueError) with a message fit for a 4xx when the payload is too large, not an image, or its header
  says it is too many pixels (checked before the pixels are decoded)
- `encode_mp4(uint8 frames [T, H, W, 3], fps) -> bytes` (H.264 via PyAV, yuv420p; odd sizes are padded
  by one pixel by the encoder's needs) and `decode_mp4(bytes) -> uint8 frames [T, H, W, 3]`
- `decode_video(bytes, fps=2.0, max_bytes=..., max_frames=..., max_pixels=..., max_decoded_pixels=...)
  -> (uint8 frames [T, H, W, 3], frames per second)`: untrusted video (any container / codec PyAV
  reads) sampled by timestamp at `fps` (every frame when the source is slower; the rate returned is
  the one the frames have). Raises `MediaError` fit for a 4xx when the payload is too large, not a
  video, has frames over `max_pixels`, would give more than `max_frames` frames (i.e. is longer than
  max_frames / fps s), or would make the decoder produce more than `max_decoded_pixels` pixels in all
  (a short clip of very many frames). Frame size, length and frame count are read from the
  container's header BEFORE decoding; while decoding, the same limits hold (a header may lie or say
  nothing) and only the kept frames are converted to RGB, so memory stays at the kept frames.
The decoders are CPU-bound: the HTTP layer calls them in a worker thread, off the event loop.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

IMAGE_FORMATS = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG", "webp": "WEBP"}
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024      # 20 MiB upload cap
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096          # decoded size cap (decompression bombs)
DEFAULT_VIDEO_FPS = 2.0                         # frames per second sampled from an input video (Qwen's rate)
DEFAULT_MAX_VIDEO_BYTES = 32 * 1024 * 1024      # 32 MiB upload cap
DEFAULT_MAX_VIDEO_FRAMES = 64                   # sampled frames kept: 32 s at 2 fps
DEFAULT_MAX_VIDEO_PIXELS = 1920 * 1080          # per frame; with 64 frames at most ~400 MB decoded
DEFAULT_MAX_VIDEO_DECODED_PIXELS = 1920 * 1080 * 960   # decoding work: 32 s of 1080p at 30 frames per second


class MediaError(ValueError):
    """Untrusted media refused (too large, too long, unreadable); the message names the field and the
    limit, fit for a 400."""


def encode_image(image: Any, fmt: str = "png", quality: int = 95) -> bytes:
    key = fmt.lower()
    if key not in IMAGE_FORMATS:
        raise ValueError(f"output_format must be one of png, jpeg, webp; got {fmt!r}")
    buf = io.BytesIO()
    img = image.convert("RGB") if IMAGE_FORMATS[key] == "JPEG" and image.mode != "RGB" else image
    kwargs = {"quality": quality} if IMAGE_FORMATS[key] in ("JPEG", "WEBP") else {}
    img.save(buf, format=IMAGE_FORMATS[key], **kwargs)
    return buf.getvalue()


def decode_image(data: bytes, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
                 max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, field: str = "image") -> Any:
    """Decode untrusted image bytes safely into an RGB PIL image."""
    from PIL import Image

    if not isinstance(data, (bytes, bytearray)) or len(data) == 0:
        raise MediaError(f"{field} is empty or not bytes")
    if len(data) > max_bytes:
        raise MediaError(f"{field} is {len(data)} bytes; the limit is {max_bytes} bytes")
    try:
        with Image.open(io.BytesIO(data)) as probe:
            w, h = probe.size
            if w * h > max_pixels:
                raise MediaError(f"{field} is {w}x{h} pixels; the limit is {max_pixels} pixels")
            probe.verify()
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            return img.convert("RGB")
    except MediaError:
        raise
    except Exception as e:  # PIL raises many types for corrupt input
        raise MediaError(f"{field} could not be decoded as an image ({type(e).__name__}: {e})") from None


def encode_mp4(frames: np.ndarray, fps: int = 16, crf: int = 18) -> bytes:
    """uint8 [T, H, W, 3] -> MP4 bytes (H.264, yuv420p)."""
    import av

    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] < 1:
        raise ValueError(f"frames must be uint8 [T, H, W, 3] with T >= 1, got {frames.dtype} {frames.shape}")
    t, h, w, _ = frames.shape
    # yuv420p needs even sizes: pad by edge replication, the decoder gets the padded size back
    ph, pw = h + (h % 2), w + (w % 2)
    if (ph, pw) != (h, w):
        frames = np.pad(frames, ((0, 0), (0, ph - h), (0, pw - w), (0, 0)), mode="edge")
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=int(fps))
        stream.width, stream.height, stream.pix_fmt = pw, ph, "yuv420p"
        stream.options = {"crf": str(crf)}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def decode_mp4(data: bytes) -> np.ndarray:
    """MP4 bytes -> uint8 [T, H, W, 3] (all frames of the first video stream)."""
    import av

    with av.open(io.BytesIO(data), mode="r") as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    if not frames:
        raise ValueError("the video has no frames")
    return np.stack(frames)


def decode_video(data: bytes, fps: float = DEFAULT_VIDEO_FPS, max_bytes: int = DEFAULT_MAX_VIDEO_BYTES,
                 max_frames: int = DEFAULT_MAX_VIDEO_FRAMES, max_pixels: int = DEFAULT_MAX_VIDEO_PIXELS,
                 max_decoded_pixels: int = DEFAULT_MAX_VIDEO_DECODED_PIXELS,
                 field: str = "video") -> tuple[np.ndarray, float]:
    """Decode untrusted video bytes into RGB frames sampled at `fps` (see the module docstring)."""
    import av

    if not isinstance(data, (bytes, bytearray)) or len(data) == 0:
        raise MediaError(f"{field} is empty or not bytes")
    if len(data) > max_bytes:
        raise MediaError(f"{field} is {len(data)} bytes; the limit is {max_bytes} bytes")
    limits = _VideoLimits(fps, max_frames, max_pixels, max_decoded_pixels, field)
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise MediaError(f"{field} has no video stream")
            stream = container.streams.video[0]
            rate = limits.check_header(container, stream)
            frames = _sample_frames(container, stream, rate, limits)
    except MediaError:                          # ours, naming the field
        raise
    except Exception as e:                      # PyAV raises FFmpegError and other types for corrupt input
        raise MediaError(f"{field} could not be decoded as a video ({type(e).__name__}: {e})") from None
    if not frames:
        raise MediaError(f"{field} has no frames")
    return np.stack(frames), min(fps, rate) if rate else fps


@dataclass
class _VideoLimits:
    """What `decode_video` accepts; every check raises MediaError naming `field` and the limit."""

    fps: float                                  # frames kept per second of video
    max_frames: int                             # frames kept at most
    max_pixels: int                             # width * height of one frame
    max_decoded_pixels: int                     # width * height summed over every frame decoded
    field: str                                  # the request field the video came in

    def too_long(self, seconds: Optional[float] = None) -> MediaError:
        length = f" (it is {seconds:g} s long)" if seconds is not None else ""
        return MediaError(f"{self.field} gives more than {self.max_frames} frames at {self.fps:g} frames per "
                          f"second{length}; the limit is {self.max_frames / self.fps:g} seconds")

    def check_size(self, width: int, height: int) -> None:
        if width * height > self.max_pixels:
            raise MediaError(f"{self.field} frames are {width}x{height} pixels; the limit is {self.max_pixels} "
                             "pixels")

    def too_much(self, frames: int, width: int, height: int) -> MediaError:
        return MediaError(f"{self.field} has {frames} frames of {width}x{height} pixels; decoding more than "
                          f"{self.max_decoded_pixels} pixels (e.g. {self.max_decoded_pixels // (width * height)} "
                          "frames of this size) is refused")

    def check_header(self, container: Any, stream: Any) -> Optional[float]:
        """Size, length and frame count from the container's header, before anything is decoded;
        returns the source's frames per second (None when the header does not say)."""
        import av

        width, height = stream.codec_context.width, stream.codec_context.height
        self.check_size(width, height)
        rate = float(stream.average_rate) if stream.average_rate else None
        seconds = None
        if stream.duration is not None and stream.time_base is not None:
            seconds = float(stream.duration * stream.time_base)
        elif container.duration is not None:
            seconds = container.duration / av.time_base
        if seconds is not None and seconds * self.fps > self.max_frames + 1e-6:
            raise self.too_long(seconds)
        frames = stream.frames or (int(seconds * rate) if seconds is not None and rate else 0)
        if width and height and frames * width * height > self.max_decoded_pixels:
            raise self.too_much(frames, width, height)
        return rate


def _sample_frames(container: Any, stream: Any, rate: Optional[float], limits: _VideoLimits) -> list[np.ndarray]:
    """The first decoded frame of every 1 / fps s slot as RGB; the limits hold while decoding too
    (headers may lie): only kept frames are converted, and decoding stops at the first one over."""
    frames: list[np.ndarray] = []
    start, last, decoded = None, -1, 0          # first frame's time (s); the last slot kept; pixels decoded
    for count, frame in enumerate(container.decode(stream)):
        limits.check_size(frame.width, frame.height)
        decoded += frame.width * frame.height
        if decoded > limits.max_decoded_pixels:
            raise limits.too_much(count + 1, frame.width, frame.height)
        t = frame.time if frame.time is not None else count / (rate or limits.fps)
        start = t if start is None else start
        slot = int((t - start) * limits.fps + 1e-6)    # slots of 1 / fps s: the first frame of each is kept
        if slot <= last:
            continue
        last = slot
        if len(frames) == limits.max_frames:
            raise limits.too_long()
        frames.append(frame.to_ndarray(format="rgb24"))
        if frames[-1].shape != frames[0].shape:
            raise MediaError(f"{limits.field} changes frame size mid-stream; all frames must be one size")
    return frames
