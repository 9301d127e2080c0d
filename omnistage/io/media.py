"""Media encode / decode for the entry points (runs wherever the caller runs; no torch).

In / out:
- `encode_image(PIL image, "png" | "jpeg" | "webp") -> bytes`
- `decode_image(bytes, max_bytes=..., max_pixels=...) -> PIL image (RGB)`; raises ValueError with a
  message fit for a 4xx when the payload is too large, not an image, or decodes to too many pixels
- `encode_mp4(uint8 frames [T, H, W, 3], fps) -> bytes` (H.264 via PyAV, yuv420p; odd sizes are padded
  by one pixel by the encoder's needs) and `decode_mp4(bytes) -> uint8 frames [T, H, W, 3]`
- `decode_video(bytes, fps=2.0, max_bytes=..., max_frames=..., max_pixels=...) -> (uint8 frames
  [T, H, W, 3], frames per second)`: untrusted video (any container / codec PyAV reads) sampled by
  timestamp at `fps` (every frame when the source is slower; the rate returned is the one the frames
  have); raises ValueError fit for a 4xx when the payload is too large, not a video, has frames over
  `max_pixels`, or would give more than `max_frames` frames (i.e. is longer than max_frames / fps s)
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

IMAGE_FORMATS = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG", "webp": "WEBP"}
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024      # 20 MiB upload cap
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096          # decoded size cap (decompression bombs)
DEFAULT_VIDEO_FPS = 2.0                         # frames per second sampled from an input video (Qwen's rate)
DEFAULT_MAX_VIDEO_BYTES = 32 * 1024 * 1024      # 32 MiB upload cap
DEFAULT_MAX_VIDEO_FRAMES = 64                   # sampled frames kept: 32 s at 2 fps
DEFAULT_MAX_VIDEO_PIXELS = 1920 * 1080          # per frame; with 64 frames at most ~400 MB decoded


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
        raise ValueError(f"{field} is empty or not bytes")
    if len(data) > max_bytes:
        raise ValueError(f"{field} is {len(data)} bytes; the limit is {max_bytes} bytes")
    try:
        with Image.open(io.BytesIO(data)) as probe:
            w, h = probe.size
            if w * h > max_pixels:
                raise ValueError(f"{field} is {w}x{h} pixels; the limit is {max_pixels} pixels")
            probe.verify()
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            return img.convert("RGB")
    except ValueError:
        raise
    except Exception as e:  # PIL raises many types for corrupt input
        raise ValueError(f"{field} could not be decoded as an image ({type(e).__name__}: {e})") from None


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
                 field: str = "video") -> tuple[np.ndarray, float]:
    """Decode untrusted video bytes into RGB frames sampled at `fps` (see the module docstring)."""
    import av

    if not isinstance(data, (bytes, bytearray)) or len(data) == 0:
        raise ValueError(f"{field} is empty or not bytes")
    if len(data) > max_bytes:
        raise ValueError(f"{field} is {len(data)} bytes; the limit is {max_bytes} bytes")
    frames: list[np.ndarray] = []
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise ValueError(f"{field} has no video stream")
            stream = container.streams.video[0]
            rate = float(stream.average_rate) if stream.average_rate else None   # the source's frames/s
            start, last = None, -1              # first frame's time (s); the last slot a frame was kept in
            for count, frame in enumerate(container.decode(stream)):
                t = frame.time if frame.time is not None else count / (rate or fps)
                start = t if start is None else start
                slot = int((t - start) * fps + 1e-6)    # slots of 1 / fps s: the first frame of each is kept
                if slot <= last:
                    continue
                last = slot
                if frame.width * frame.height > max_pixels:
                    raise ValueError(f"{field} frames are {frame.width}x{frame.height} pixels; the limit is "
                                     f"{max_pixels} pixels")
                if len(frames) == max_frames:
                    raise ValueError(f"{field} gives more than {max_frames} frames at {fps:g} frames per second; "
                                     f"the limit is {max_frames / fps:g} seconds")
                frames.append(frame.to_ndarray(format="rgb24"))
                if frames[-1].shape != frames[0].shape:
                    raise ValueError(f"{field} changes frame size mid-stream; all frames must be one size")
    except av.error.FFmpegError as e:           # before ValueError: some of PyAV's errors are ValueErrors
        raise ValueError(f"{field} could not be decoded as a video ({type(e).__name__}: {e})") from None
    except ValueError:                          # ours, naming the field
        raise
    except Exception as e:                      # PyAV raises other types for some corrupt input too
        raise ValueError(f"{field} could not be decoded as a video ({type(e).__name__}: {e})") from None
    if not frames:
        raise ValueError(f"{field} has no frames")
    return np.stack(frames), min(fps, rate) if rate else fps
