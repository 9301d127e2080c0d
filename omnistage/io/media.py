"""Media encode / decode for the entry points (runs wherever the caller runs; no torch).

In / out:
- `encode_image(PIL image, "png" | "jpeg" | "webp") -> bytes`
- `decode_image(bytes, max_bytes=..., max_pixels=...) -> PIL image (RGB)`; raises ValueError with a
  message fit for a 4xx when the payload is too large, not an image, or decodes to too many pixels
- `encode_mp4(uint8 frames [T, H, W, 3], fps) -> bytes` (H.264 via PyAV, yuv420p; odd sizes are padded
  by one pixel by the encoder's needs) and `decode_mp4(bytes) -> uint8 frames [T, H, W, 3]`
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

IMAGE_FORMATS = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG", "webp": "WEBP"}
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024      # 20 MiB upload cap
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096          # decoded size cap (decompression bombs)


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
