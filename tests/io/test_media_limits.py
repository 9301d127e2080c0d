"""Untrusted chat media (`omnistage.io.audio.decode_audio`, `omnistage.io.media.decode_video`) are
refused from their headers before decoding when too long, too many frames or too large, and the same
limits hold while decoding when a header says nothing. Files are built in code
(`omnistage.testing.media`): a 6-hour FLAC of silence (~0.3 MB; 345 MB of float32 decoded) and an MP4
of 1920 1080p frames (~65 KB; 64 kept frames are 400 MB of RGB).

Memory bound: decoding a refused file must raise this process's resident memory by less than
`MAX_GROWTH_MB` = 64 MB (sampled every millisecond, `PeakRSS`); before the header checks the same
files took +700 MB (FLAC) and +400 MB (MP4).
"""

import re

import numpy as np
import pytest

from omnistage.io.audio import decode_audio
from omnistage.io.media import MediaError, decode_video
from omnistage.testing.media import PeakRSS, silent_flac, still_mp4

MAX_GROWTH_MB = 64


@pytest.fixture(scope="module")
def six_hours_flac() -> bytes:
    return silent_flac(6 * 3600, sample_rate=4000)


def test_six_hours_of_flac_is_refused_from_its_header(six_hours_flac):
    assert len(six_hours_flac) < 1_000_000
    with PeakRSS() as peak, pytest.raises(MediaError, match=r"^clip is 21600 seconds long; the limit is 600 "
                                                            r"seconds$"):
        decode_audio(six_hours_flac, field="clip")
    assert peak.growth_mb < MAX_GROWTH_MB, f"+{peak.growth_mb:.0f} MB to refuse a 6-hour FLAC"


def test_audio_duration_and_rate_limits_are_arguments():
    thirty = silent_flac(30, sample_rate=4000)
    samples, rate = decode_audio(thirty)
    assert rate == 4000 and samples.dtype == np.float32 and samples.shape == (120000,)
    with pytest.raises(MediaError, match="audio is 30 seconds long; the limit is 20 seconds"):
        decode_audio(thirty, max_seconds=20)
    with pytest.raises(MediaError, match="audio has a sample rate of 4000 Hz; the limit is 2000 Hz"):
        decode_audio(thirty, max_sample_rate=2000)


def test_stereo_audio_is_mixed_to_mono_block_by_block():
    import io

    import soundfile as sf

    t = np.arange(3 * 16000) / 16000
    left, right = np.sin(2 * np.pi * 220 * t), 0.5 * np.sin(2 * np.pi * 330 * t)
    buf = io.BytesIO()
    sf.write(buf, np.stack([left, right], axis=1).astype(np.float32), 16000, format="WAV", subtype="FLOAT")
    samples, rate = decode_audio(buf.getvalue())
    assert rate == 16000 and samples.shape == (48000,)
    np.testing.assert_allclose(samples, (left + right) / 2, atol=1e-6)


def test_mp4_of_many_1080p_frames_is_refused_from_its_header():
    data = still_mp4(1920, 1920, 1080, fps=30)                         # 64 s
    assert len(data) < 200_000
    with PeakRSS() as peak, pytest.raises(MediaError, match=re.escape(
            "video gives more than 64 frames at 2 frames per second (it is 64 s long); the limit is 32 seconds")):
        decode_video(data)
    assert peak.growth_mb < MAX_GROWTH_MB, f"+{peak.growth_mb:.0f} MB to refuse 1920 1080p frames"


def test_a_short_clip_of_very_many_frames_is_refused_from_its_header():
    data = still_mp4(1920, 1920, 1080, fps=960)                        # 2 s, but 1920 frames to decode
    with PeakRSS() as peak, pytest.raises(MediaError, match=r"video has 1920 frames of 1920x1080 pixels; decoding "
                                                            r"more than 1990656000 pixels .* is refused"):
        decode_video(data)
    assert peak.growth_mb < MAX_GROWTH_MB
    with pytest.raises(MediaError, match=r"video frames are 2560x1440 pixels; the limit is 2073600 pixels"):
        decode_video(still_mp4(2, 2560, 1440))


def test_limits_hold_while_decoding_a_stream_whose_header_says_nothing():
    """A raw H.264 stream has no duration or frame count: frames are sampled by their timestamps
    (25 frames per second, FFmpeg's guess), and decoding stops at the first frame over a limit."""
    raw = still_mp4(400, 320, 240, container="h264")                     # 16 s at 25 fps
    frames, fps = decode_video(raw)
    assert frames.shape == (32, 240, 320, 3) and fps == 2.0
    assert abs(int(frames.mean()) - 90) <= 3
    with pytest.raises(MediaError, match=r"gives more than 20 frames at 2 frames per second; the limit is 10 seconds"):
        decode_video(raw, max_frames=20)
    with pytest.raises(MediaError, match=r"has 101 frames of 320x240 pixels; decoding more than 7680000 pixels"):
        decode_video(raw, max_decoded_pixels=100 * 320 * 240)


def test_video_limits_are_arguments_checked_from_the_header():
    ten_seconds = still_mp4(300, 64, 48, fps=30)
    frames, fps = decode_video(ten_seconds)
    assert frames.shape == (20, 48, 64, 3) and fps == 2.0                # only the kept frames are converted
    with pytest.raises(MediaError, match=r"gives more than 10 frames at 2 frames per second \(it is 10 s long\)"):
        decode_video(ten_seconds, max_frames=10)
    with pytest.raises(MediaError, match=r"frames are 64x48 pixels; the limit is 1000 pixels"):
        decode_video(ten_seconds, max_pixels=1000)
