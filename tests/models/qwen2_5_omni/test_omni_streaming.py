"""Qwen2.5-Omni's streamed audio: a small first chunk (per request or chosen from the load), then
bigger ones, and no seam: the streamed waveform equals the whole-answer waveform within a stated
tolerance, whatever the first chunk's size.

Tolerance (tiny checkpoint, 60 codes = 1.2 s, waveform rms 0.34, default left context 2 DiT blocks
and look-ahead 1): max |streamed - whole| < 5e-3 of a [-1, 1] waveform (measured for
first chunks of 4, 10 and 25 codes: 2.1e-3, 8.8e-4, 9.2e-4); the noise is positional (one draw per mel frame from the
request's seed), so the difference is only the ODE state outside each window.
"""

import numpy as np
import pytest
import torch
from omni_testutil import single_thread

from omnistage.codec.engine import CodecEngine
from omnistage.models.qwen2_5_omni.code2wav import Code2Wav, Code2WavParams, CodecInput, first_chunk_for_load
from omnistage.params import ParamError

SEED = 7
SAMPLES_PER_CODE = 480                          # DiT repeats (2) x BigVGAN hop (240)
WAV_TOL = 5e-3


def codes(n: int, seed: int = 5) -> list[int]:
    return torch.randint(0, 8192, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def stream(engine, rid, all_codes, params, piece=7):
    """Feeds the codes `piece` at a time (as the talker would) and steps; returns the audio chunks."""
    engine.add_request(rid, CodecInput(all_codes[:piece], finished=len(all_codes) <= piece), params)
    sent, chunks = piece, []
    while engine.has_unfinished():
        chunks += [o.audio_chunk for o in engine.step() if o.audio_chunk.size]
        if sent < len(all_codes):
            engine.add_input(rid, CodecInput(all_codes[sent:sent + piece], finished=sent + piece >= len(all_codes)))
            sent += piece
    return chunks


@pytest.fixture(scope="module")
def whole_wav(omni_dir):
    with single_thread():
        engine = CodecEngine(Code2Wav(omni_dir))
        engine.add_request("w", codes(60), Code2WavParams(voice="Ethan", seed=SEED))
        while engine.has_unfinished():
            outs = engine.step()
        return outs[-1].output.audio.samples


@pytest.fixture(scope="module")
def chunked(omni_dir):
    return CodecEngine(Code2Wav(omni_dir, chunk_codes=24, first_chunk_codes=12))


@pytest.mark.parametrize("first", [4, 10, 25])
def test_streamed_waveform_equals_the_whole_answer_for_any_first_chunk(chunked, whole_wav, first):
    params = Code2WavParams(voice="Ethan", seed=SEED, initial_codec_chunk_frames=first)
    chunks = stream(chunked, f"first-{first}", codes(60), params)
    assert chunks[0].shape == (first * SAMPLES_PER_CODE,)            # the small first chunk
    assert all(c.shape == (24 * SAMPLES_PER_CODE,) for c in chunks[1:-1])   # then the stage's chunk
    wav = np.concatenate(chunks)
    assert wav.shape == whole_wav.shape
    assert np.abs(wav - whole_wav).max() < WAV_TOL


def test_first_chunk_follows_the_load_when_the_request_sets_none(omni_dir):
    assert [first_chunk_for_load(n, 12, 96) for n in (0, 4, 5, 16, 17, 64, 65, 10**6)] == [12, 12, 24, 24, 48, 48,
                                                                                          96, 96]
    assert first_chunk_for_load(100, 12, 20) == 20 and first_chunk_for_load(0, 30, 24) == 24
    model = Code2Wav(omni_dir, chunk_codes=24, first_chunk_codes=6)
    engine = CodecEngine(model)
    for i in range(6):                          # 0..4 requests already there: 6 codes; 5: 12
        engine.add_request(f"r{i}", CodecInput(codes(30, seed=i), finished=False), Code2WavParams(seed=i))
    firsts = [engine.requests[f"r{i}"].state.first_frames // 2 for i in range(6)]
    assert firsts == [6, 6, 6, 6, 6, 12]
    engine.add_request("own", CodecInput(codes(30), finished=False), Code2WavParams(initial_codec_chunk_frames=3))
    assert engine.requests["own"].state.first_frames == 6                  # its own choice wins
    fixed = CodecEngine(Code2Wav(omni_dir, chunk_codes=24, first_chunk_codes=6, dynamic_first_chunk=False))
    for i in range(7):
        fixed.add_request(f"f{i}", CodecInput(codes(30), finished=False), Code2WavParams(seed=i))
    assert {r.state.first_frames for r in fixed.requests.values()} == {12}


@pytest.mark.parametrize("value", [0, 1025, True, 2.5])
def test_bad_first_chunk_names_the_field(value):
    with pytest.raises(ParamError, match="initial_codec_chunk_frames"):
        Code2WavParams(initial_codec_chunk_frames=value)
