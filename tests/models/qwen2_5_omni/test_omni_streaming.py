"""Qwen2.5-Omni's streamed audio: a small first chunk (per request or chosen from the load), then
bigger ones (a ramp: each chunk twice the one before, up to the stage's chunk), and no seam: the
streamed waveform equals the whole-answer waveform within a stated tolerance, whatever the chunk sizes.

Tolerance (tiny checkpoint, 60 codes = 1.2 s, waveform rms 0.34, default left context 2 DiT blocks
and look-ahead 1): max |streamed - whole| < 5e-3 of a [-1, 1] waveform. Measured for first chunks of
4, 10 and 25 codes and the stage's 12: chunks of up to 24 codes with the default ramp (`chunk_growth` 2)
2.1e-3, 9.6e-4, 9.2e-4, 1.1e-3; up to 48: 2.1e-3, 9.6e-4, 9.2e-4, 1.1e-3; up to 48, growth 3: 2.1e-3,
1.5e-3, 9.2e-4, 7.9e-4; up to 24, no ramp: 2.1e-3, 8.8e-4, 9.2e-4, 1.1e-3; the omni pipeline's
options over 250 codes (12, 24, 48, 96, 70): 1.3e-3 (no ramp, 12, 96, 96, 46: 8.4e-4). The noise is
positional (one draw per mel frame from the request's seed), so the difference is only the ODE state
outside each window, whatever the chunk sizes.
"""

import numpy as np
import pytest
import torch
from omni_testutil import single_thread

from omnistage.codec.engine import CodecEngine
from omnistage.models.qwen2_5_omni.code2wav import (Code2Wav, Code2WavParams, CodecInput, chunk_after,
                                                    first_chunk_for_load)
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
    """Engines by (chunk_codes, chunk_growth), first chunk 12 codes (built once each)."""
    engines = {}

    def get(chunk, growth):
        if (chunk, growth) not in engines:
            engines[chunk, growth] = CodecEngine(Code2Wav(omni_dir, chunk_codes=chunk, first_chunk_codes=12,
                                                          chunk_growth=growth))
        return engines[chunk, growth]
    return get


# (chunk_codes, chunk_growth, the request's first chunk, the chunks' codes over 60 codes): the default ramp
# doubles each chunk up to chunk_codes; growth 3 triples it; None jumps to chunk_codes after the first.
@pytest.mark.parametrize("chunk, growth, first, sizes", [
    (24, 2, 4, [4, 8, 16, 24, 8]), (24, 2, 10, [10, 20, 24, 6]), (24, 2, 25, [25, 24, 11]),
    (48, 2, 4, [4, 8, 16, 32]), (48, 2, 10, [10, 20, 30]), (48, 2, None, [12, 24, 24]), (48, 3, 4, [4, 12, 36, 8]),
    (24, None, 4, [4, 24, 24, 8]), (24, None, 10, [10, 24, 24, 2]), (24, None, 25, [25, 24, 11])])
def test_streamed_waveform_equals_the_whole_answer_for_any_chunk_schedule(chunked, whole_wav, chunk, growth, first,
                                                                          sizes):
    params = Code2WavParams(voice="Ethan", seed=SEED, initial_codec_chunk_frames=first)
    chunks = stream(chunked(chunk, growth), f"first-{first}", codes(60), params)
    assert [c.shape[0] for c in chunks] == [n * SAMPLES_PER_CODE for n in sizes]
    wav = np.concatenate(chunks)
    assert wav.shape == whole_wav.shape
    assert np.abs(wav - whole_wav).max() < WAV_TOL


def test_the_pipeline_ramp_streams_the_whole_answer(omni_dir):
    """The omni pipeline's code2wav options on a 5 s answer: the whole ramp (12, 24, 48), a steady
    96-code chunk and the rest, as the talker streams 10 codes at a time."""
    from omnistage.models.qwen2_5_omni.pipeline import CODE2WAV_OPTIONS

    whole = CodecEngine(Code2Wav(omni_dir))
    whole.add_request("w", codes(250), Code2WavParams(voice="Ethan", seed=SEED))
    while whole.has_unfinished():
        outs = whole.step()
    engine = CodecEngine(Code2Wav(omni_dir, **CODE2WAV_OPTIONS))
    chunks = stream(engine, "ramp", codes(250), Code2WavParams(voice="Ethan", seed=SEED), piece=10)
    assert [c.shape[0] for c in chunks] == [n * SAMPLES_PER_CODE for n in (12, 24, 48, 96, 70)]
    assert np.abs(np.concatenate(chunks) - outs[-1].output.audio.samples).max() < WAV_TOL


def test_chunk_schedule_ramps_up_to_the_stage_chunk():
    def schedule(first, chunk, growth, total):
        sizes, done = [], 0
        while done < total:
            sizes.append(min(chunk_after(done, first, chunk, growth), total - done))
            done += sizes[-1]
        return sizes
    assert schedule(12, 96, 2, 500) == [12, 24, 48, 96, 96, 96, 96, 32]   # the omni pipeline, 10 s at 1 stream
    assert schedule(24, 96, 2, 500) == [24, 48, 96, 96, 96, 96, 44]       # ... at 8 streams
    assert schedule(12, 96, 3, 200) == [12, 36, 96, 56]
    assert schedule(12, 96, None, 200) == [12, 96, 92]
    assert schedule(96, 96, 2, 200) == [96, 96, 8] and schedule(200, 96, 2, 300) == [200, 96, 4]


def test_every_window_of_the_ramp_has_a_graph(omni_dir):
    """The windows `ready` gives the chunks of each first size the stage picks, up to its steady
    chunks, are the ones the graphs are captured for (no first-use shape, no padding); likewise the
    vocoder inputs. The omni pipeline's options (tiny checkpoint: DiT blocks of 24 mel frames, as the
    real one): the ramp's windows (96, 168) replace the old second chunk's 240 frames."""
    from omnistage.models.qwen2_5_omni.pipeline import CODE2WAV_OPTIONS

    model = Code2Wav(omni_dir, **CODE2WAV_OPTIONS)
    assert model.growth == 2
    windows = model._steady_windows()
    assert windows == {48, 72, 96, 120, 168, 216, 264}
    old = Code2Wav(omni_dir, **{**CODE2WAV_OPTIONS, "chunk_growth": None})
    assert old._steady_windows() == {48, 72, 120, 216, 240, 264}
    ctx, future = model.voc_ctx, model.future
    for first in (12, 24, 48, 96):
        model.on_load({12: 0, 24: 5, 48: 33, 96: 257}[first])
        state = model.new_state(Code2WavParams(seed=0))
        assert state.first_frames == 2 * first
        state.codes = codes(1000)
        seen = []
        while len(seen) < 8:
            s, e, ws, we = model.ready(state, False)
            seen.append(we - ws)
            assert e - max(0, s - ctx) + min(future, ctx) in model._vocoder_lengths()
            state.mel = torch.zeros(e, model.mel_dim)
        assert set(seen) <= windows and seen[-1] == 264, (first, seen)   # steady: 96 codes + 2 + 1 blocks


def test_first_chunk_follows_the_load_when_the_request_sets_none(omni_dir):
    assert [first_chunk_for_load(n, 12, 96) for n in (0, 4, 5, 32, 33, 256, 257, 10**6)] == [12, 12, 24, 24, 48, 48,
                                                                                            96, 96]
    assert first_chunk_for_load(100, 12, 20) == 20 and first_chunk_for_load(0, 30, 24) == 24
    model = Code2Wav(omni_dir, chunk_codes=24, first_chunk_codes=6, first_chunk_load="arrival")
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


def test_first_chunks_sized_at_schedule_count_requests_that_arrive_together(omni_dir):
    """`first_chunk_load: schedule`: 6 requests added before one step all see a load of 6 (12-code first
    chunks, where "arrival" gives the first five 6); a request that sets its own size keeps it."""
    model = Code2Wav(omni_dir, chunk_codes=24, first_chunk_codes=6, cuda_graphs=False)   # default: schedule
    engine = CodecEngine(model)
    for i in range(6):
        engine.add_request(f"r{i}", CodecInput(codes(30, seed=i), finished=False), Code2WavParams(seed=i))
    engine.add_request("own", CodecInput(codes(30), finished=False), Code2WavParams(initial_codec_chunk_frames=3))
    while any(r.state.done == 0 for r in engine.requests.values()):
        engine.step()
    done = {rid: r.state.done // 2 for rid, r in engine.requests.items()}     # codes decoded: the first chunk
    assert done == {**{f"r{i}": 12 for i in range(6)}, "own": 3}
    with pytest.raises(ValueError, match="first_chunk_load must be one of arrival, schedule"):
        Code2Wav(omni_dir, chunk_codes=24, first_chunk_load="later")


@pytest.mark.parametrize("value", [0, 1025, True, 2.5])
def test_bad_first_chunk_names_the_field(value):
    with pytest.raises(ParamError, match="initial_codec_chunk_frames"):
        Code2WavParams(initial_codec_chunk_frames=value)
