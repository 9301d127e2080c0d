"""OpenAI chat media parts -> decoded parts (`entrypoints/openai/chat_media.py`): video_url data URLs
decoded with PyAV to RGB frames sampled at 2 fps, and bad video payloads answered with 400s naming
the field. No model: MP4s are written here with PyAV (`omnistage.io.media.encode_mp4`)."""

import base64
import re

import numpy as np
import pytest

from omnistage.entrypoints.openai import chat_media
from omnistage.entrypoints.openai.errors import OpenAIError
from omnistage.entrypoints.openai.protocol import ContentPart
from omnistage.io.media import encode_mp4

FIELD = "messages[0].content"


def mp4_data_url(frames: np.ndarray, fps: int) -> str:
    return "data:video/mp4;base64," + base64.b64encode(encode_mp4(frames, fps=fps)).decode()


def video_part(url) -> ContentPart:
    return ContentPart(type="video_url", video_url={"url": url})


def flat_frames(levels, height=56, width=84) -> np.ndarray:
    """One flat grey frame per level: H.264 keeps flat frames within a few levels."""
    return np.repeat(np.asarray(levels, dtype=np.uint8)[:, None, None, None], 3, axis=-1) * np.ones(
        (1, height, width, 3), dtype=np.uint8)


def test_video_url_decodes_to_frames_sampled_at_2_fps():
    levels = np.arange(25) * 10                 # 25 frames at 10 fps: 2.5 s
    part = chat_media.decode_part(video_part(mp4_data_url(flat_frames(levels), fps=10)), FIELD)
    assert chat_media.kind("video_url") == "video" and part["type"] == "video" and part["fps"] == 2.0
    frames = part["video"]
    assert frames.dtype == np.uint8 and frames.shape == (5, 56, 84, 3)
    # the first frame of every half second: source frames 0, 5, 10, 15, 20
    np.testing.assert_allclose(frames.reshape(5, -1).mean(-1), levels[::5], atol=4)
    slow = chat_media.decode_part(video_part(mp4_data_url(flat_frames([0, 100, 200]), fps=1)), FIELD)
    assert slow["video"].shape[0] == 3 and slow["fps"] == 1.0   # a slower source keeps every frame


@pytest.mark.parametrize("url, message", [
    ("https://example.com/clip.mp4", "must be a base64 data URL .*remote URLs are not fetched"),
    ("data:video/mp4;base64,not base64!", "is not valid base64"),
    ("data:video/mp4;base64," + base64.b64encode(b"not a video at all" * 8).decode(),
     "could not be decoded as a video"),
    (None, "must be a base64 data URL"),
])
def test_bad_video_url_is_a_400_naming_the_field(url, message):
    with pytest.raises(OpenAIError, match=re.escape(f"{FIELD}.video_url.url ") + message) as e:
        chat_media.decode_part(video_part(url), FIELD)
    assert e.value.status == 400 and e.value.param == f"{FIELD}.video_url.url"


def test_too_long_video_is_a_400_naming_the_limit():
    long = mp4_data_url(flat_frames(np.zeros(66), height=16, width=16), fps=2)    # 33 s at 2 fps
    with pytest.raises(OpenAIError, match=r"video_url.url gives more than 64 frames .* the limit is 32 seconds") as e:
        chat_media.decode_part(video_part(long), FIELD)
    assert e.value.status == 400 and e.value.param == f"{FIELD}.video_url.url"
