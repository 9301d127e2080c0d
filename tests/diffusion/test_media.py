"""omnistage.io.media: image encode / safe decode, MP4 round trip."""

import io

import numpy as np
import pytest
from PIL import Image

from omnistage.io.media import decode_image, decode_mp4, encode_image, encode_mp4


def test_mp4_round_trip_keeps_frame_count_and_size():
    t = np.linspace(0, 1, 9)[:, None, None, None]
    frames = (np.ones((9, 48, 64, 3)) * t * 255).astype(np.uint8)
    data = encode_mp4(frames, fps=8)
    assert data[4:8] == b"ftyp"
    back = decode_mp4(data)
    assert back.shape == (9, 48, 64, 3) and back.dtype == np.uint8
    assert np.abs(back.astype(int) - frames.astype(int)).mean() < 4


def test_mp4_rejects_bad_frames():
    with pytest.raises(ValueError, match="uint8"):
        encode_mp4(np.zeros((2, 8, 8, 3), dtype=np.float32))


@pytest.mark.parametrize("fmt,magic", [("png", b"\x89PNG"), ("jpeg", b"\xff\xd8"), ("webp", b"RIFF")])
def test_image_encode_decode(fmt, magic):
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (16, 24, 3), dtype=np.uint8))
    data = encode_image(img, fmt)
    assert data.startswith(magic)
    assert decode_image(data).size == (24, 16)


def test_decode_image_rejects_corrupt_large_and_huge_inputs():
    with pytest.raises(ValueError, match="could not be decoded"):
        decode_image(b"definitely not an image")
    with pytest.raises(ValueError, match="empty"):
        decode_image(b"")
    png = encode_image(Image.new("RGB", (64, 64)), "png")
    with pytest.raises(ValueError, match="limit is 10 bytes"):
        decode_image(png, max_bytes=10)
    with pytest.raises(ValueError, match="pixels"):
        decode_image(png, max_pixels=100)
    truncated = png[: len(png) // 2]
    with pytest.raises(ValueError):
        decode_image(truncated)


def test_unknown_output_format():
    with pytest.raises(ValueError, match="png, jpeg, webp"):
        encode_image(Image.new("RGB", (4, 4)), "gif")
