"""The code2wav stage against transformers' token2wav on the same codes and noise seed.

Measured on the tiny checkpoint (seed 7, 60 codes = 1.2 s; mel std 2.1, waveform rms 0.34):
  * whole mode: bit-identical to transformers' `Qwen2_5OmniToken2WavModel.forward` (max |diff| 0).
  * chunked (first 12 codes, then 24), max |diff| vs whole, past / future DiT blocks:
      2 / 1 (default): mel 1.8e-3, waveform 1.1e-3 (rms 4.6e-5)
      4 / 2:           mel 8.4e-6, waveform 4.4e-6
      0 / 0:           mel 0.19,   waveform 0.75 (clicks at each joint: no vocoder right context)
  * batched vs alone: max |diff| ~1e-6 (float rounding of different GEMM shapes).
  * `fused_dit=True` (the CUDA default) vs the reference path on the CPU: max |diff| ~1e-6, with
    FusedDiT's kernel-count flags on (complex rotary, aligned masks, split input projection) or off.
  * `vocoder_dtype="bfloat16"` (BigVGAN under bf16 autocast), whole mode: waveform max |diff| 2.1e-2
    of peak 1.0, rms 3.8e-3 (rms of the waveform 0.34).
  * `dit_dtype="bfloat16"` (attention / MLP linears in bf16), whole mode vs float32: waveform 3.0e-4,
    mel 5.6e-3 (chunked 12 / 24: waveform 1.1e-3, as the float32 chunked decode).
"""

import numpy as np
import pytest
import torch
from omni_testutil import single_thread

from omnistage.codec.engine import CodecEngine
from omnistage.models.qwen2_5_omni.code2wav import Code2Wav, Code2WavParams, CodecInput, vocoder_context
from omnistage.models.qwen2_5_omni.code2wav_ode import tf32_matmuls
from omnistage.params import ParamError

SEED = 7


def codes(n: int, seed: int = 5) -> list[int]:
    return torch.randint(0, 8192, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine, requests):
    """requests: [(id, codes, params)] -> {id: (waveform, mel, number of outputs)}."""
    live = {}
    for rid, c, params in requests:
        engine.add_request(rid, c, params)
        live[rid] = engine.requests[rid].state
    done, counts = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            counts[out.request_id] = counts.get(out.request_id, 0) + 1
            if out.finished:
                assert out.output.audio.sample_rate == 24000 and out.output.audio.samples.dtype == np.float32
                done[out.request_id] = (out.output.audio.samples, live[out.request_id].mel, counts[out.request_id])
    return done


@pytest.fixture(scope="module")
def whole(omni_dir):
    return CodecEngine(Code2Wav(omni_dir))


@pytest.fixture(scope="module")
def reference(whole):
    with single_thread():                       # module fixtures run before the per-test autouse one
        return run(whole, [("ref", codes(60), Code2WavParams(voice="Ethan", seed=SEED))])["ref"]


def test_whole_mode_matches_transformers_token2wav(hf_omni, reference):
    spk = hf_omni.speaker_map["Ethan"]
    torch.manual_seed(SEED)
    with torch.no_grad():
        expected = hf_omni.token2wav(torch.tensor([codes(60)]), conditioning=spk["cond"].float(),
                                     reference_mel=spk["ref_mel"].float()).reshape(-1).numpy()
    wav, _, _ = reference
    assert wav.shape == expected.shape == (60 * 480,)
    np.testing.assert_allclose(wav, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("past, future, mel_tol, wav_tol", [(2, 1, 1e-2, 5e-3), (4, 2, 5e-4, 1e-4)])
def test_chunked_mode_stays_close_to_whole_decode(omni_dir, reference, past, future, mel_tol, wav_tol):
    engine = CodecEngine(Code2Wav(omni_dir, chunk_codes=24, first_chunk_codes=12, past_blocks=past,
                                  future_blocks=future))
    wav, mel, outputs = run(engine, [("a", codes(60), Code2WavParams(voice="Ethan", seed=SEED))])["a"]
    ref_wav, ref_mel, _ = reference
    assert outputs == 3                         # chunks of 12, 24 and 24 codes (the ramp: 24 at once)
    assert wav.shape == ref_wav.shape
    assert (mel - ref_mel).abs().max() < mel_tol
    assert np.abs(wav - ref_wav).max() < wav_tol


def test_streamed_codes_give_audio_before_the_input_ends(omni_dir, reference):
    engine = CodecEngine(Code2Wav(omni_dir, chunk_codes=24, first_chunk_codes=12))
    all_codes = codes(60)
    engine.add_request("s", CodecInput(all_codes[:20], finished=False), Code2WavParams(voice="Ethan", seed=SEED))
    assert engine.step() == []                  # 12 codes + one future block (12 codes) not there yet
    engine.add_input("s", CodecInput(all_codes[20:30], finished=False))
    (first,) = engine.step()                    # first chunk: 12 codes = 0.24 s
    assert not first.finished and first.audio_chunk.shape == (12 * 480,)
    engine.add_input("s", CodecInput(all_codes[30:], finished=True))
    pieces = [first.audio_chunk]
    while engine.has_unfinished():
        pieces += [o.audio_chunk for o in engine.step()]
    wav = np.concatenate(pieces)
    assert np.abs(wav - reference[0]).max() < 5e-3


def test_batched_requests_decode_as_if_alone(omni_dir):
    requests = [(f"r{i}", codes(n, seed=i), Code2WavParams(voice=v, seed=i))
                for i, (n, v) in enumerate([(22, "Ethan"), (35, "Chelsie"), (9, "Ethan")])]
    for options in ({}, {"chunk_codes": 24, "first_chunk_codes": 12}):
        engine = CodecEngine(Code2Wav(omni_dir, **options))
        together = run(engine, requests)
        stats = engine.stats()
        assert stats["dit_rows_total"] > stats["dit_batches_total"]  # several requests per ODE forward
        alone_engine = CodecEngine(Code2Wav(omni_dir, **options))
        for request in requests:
            alone = run(alone_engine, [request])[request[0]][0]
            np.testing.assert_allclose(together[request[0]][0], alone, rtol=0, atol=1e-5)


def test_bf16_dit_stays_close_to_the_float32_whole_decode(omni_dir, reference):
    engine = CodecEngine(Code2Wav(omni_dir, dit_dtype="bfloat16"))
    wav, mel, _ = run(engine, [("b", codes(60), Code2WavParams(voice="Ethan", seed=SEED))])["b"]
    ref_wav, ref_mel, _ = reference
    assert next(engine.model.dit.transformer_blocks[0].ff.parameters()).dtype == torch.bfloat16
    assert (mel - ref_mel).abs().max() < 2e-2
    assert 0 < np.abs(wav - ref_wav).max() < 2e-3


def test_bf16_vocoder_stays_close_to_the_float32_whole_decode(omni_dir, reference):
    engine = CodecEngine(Code2Wav(omni_dir, vocoder_dtype="bfloat16"))
    wav, mel, _ = run(engine, [("v", codes(60), Code2WavParams(voice="Ethan", seed=SEED))])["v"]
    ref_wav, ref_mel, _ = reference
    torch.testing.assert_close(mel, ref_mel, rtol=0, atol=0)   # the DiT is untouched
    assert wav.dtype == np.float32 and 0 < np.abs(wav - ref_wav).max() < 5e-2
    assert np.sqrt(np.mean((wav - ref_wav) ** 2)) < 1e-2


def test_windows_padded_to_a_captured_length_decode_as_unpadded(omni_dir):
    """The rule that lets a short window (a request's tail, a first chunk beside later ones) replay a
    longer window's graph: frames padded after a window are masked, so its frames decode as without."""
    options = {"chunk_codes": 24, "first_chunk_codes": 12}
    requests = [(f"p{i}", codes(n, seed=i), Code2WavParams(voice="Ethan", seed=i)) for i, n in enumerate([31, 17])]
    plain = run(CodecEngine(Code2Wav(omni_dir, **options)), requests)
    padded = CodecEngine(Code2Wav(omni_dir, **options))
    padded.model.graph_frames = [160]           # every window here is shorter: all padded to 160 frames
    for rid, (wav, mel, _) in run(padded, requests).items():
        np.testing.assert_allclose(wav, plain[rid][0], rtol=0, atol=1e-5)
    assert padded.stats()["dit_graphed_batches_total"] == padded.stats()["dit_batches_total"]


def test_fused_dit_decodes_as_the_reference_path(omni_dir, reference):
    """`fused_dit` (dit_fused.py: merged q|k|v, block-local attention, fused AdaLN steps) on the CPU,
    through PyTorch's kernels: whole mode, and batches of chunks padded to a longer window."""
    engine = CodecEngine(Code2Wav(omni_dir, fused_dit=True))
    assert engine.model.ode.fused is not None
    wav, mel, _ = run(engine, [("f", codes(60), Code2WavParams(voice="Ethan", seed=SEED))])["f"]
    np.testing.assert_allclose(wav, reference[0], rtol=0, atol=1e-5)
    for flag in ("complex_rope", "aligned_masks", "split_input_proj"):   # session 7's kernels (the bench's "s7")
        setattr(engine.model.ode.fused, flag, False)
    wav, _, _ = run(engine, [("s7", codes(60), Code2WavParams(voice="Ethan", seed=SEED))])["s7"]
    np.testing.assert_allclose(wav, reference[0], rtol=0, atol=1e-5)
    options = {"chunk_codes": 24, "first_chunk_codes": 12}
    requests = [(f"q{i}", codes(n, seed=i), Code2WavParams(voice="Ethan", seed=i)) for i, n in enumerate([31, 17])]
    plain = run(CodecEngine(Code2Wav(omni_dir, **options)), requests)
    fused = CodecEngine(Code2Wav(omni_dir, fused_dit=True, **options))
    fused.model.graph_frames = [170]            # padded to 170 frames: a partial last DiT block, masked keys
    for rid, (wav, _, _) in run(fused, requests).items():
        np.testing.assert_allclose(wav, plain[rid][0], rtol=0, atol=1e-5)
    stats = fused.stats()
    assert 0 < stats["dit_padding_frames_total"] < stats["dit_frames_total"]


def test_tf32_is_set_for_the_block_only():
    before = torch.backends.cuda.matmul.allow_tf32
    with pytest.raises(RuntimeError):
        with tf32_matmuls(not before):
            assert torch.backends.cuda.matmul.allow_tf32 is (not before)
            raise RuntimeError("a failed ODE run restores the flag too")
    assert torch.backends.cuda.matmul.allow_tf32 is before
    with tf32_matmuls(None):                    # a CPU stage leaves the flag alone
        assert torch.backends.cuda.matmul.allow_tf32 is before


@pytest.mark.parametrize("options, message", [
    ({"dit_dtype": "float16"}, "dit_dtype must be one of"),
    ({"fused_dit": "yes"}, "fused_dit must be true, false or null"),
    ({"fused_vocoder": 1}, "fused_vocoder must be true, false or null"),
    ({"vocoder_dtype": "float16"}, "vocoder_dtype must be one of"),
    ({"max_batch_requests": 0}, r"max_batch_requests must be an integer in \[1, 64\]"),
    ({"tf32": "yes"}, "tf32 must be true or false"),
    ({"chunk_growth": 1}, r"chunk_growth must be an integer in \[2, 16\] or null"),
    ({"chunk_growth": 17}, r"chunk_growth must be an integer in \[2, 16\] or null"),
    ({"chunk_growth": 2.0}, "chunk_growth must be an integer"),
    ({"chunk_growth": True}, "chunk_growth must be an integer")])
def test_bad_stage_options_name_the_option(omni_dir, options, message):
    with pytest.raises(ValueError, match=message):
        Code2Wav(omni_dir, **options)


def test_vocoder_context_bounds_bigvgan_receptive_field(whole, reference):
    """BigVGAN over [s - ctx, e + ctx] of exact mel reproduces the whole decode's samples of [s, e)."""
    _, mel, _ = reference
    ctx, hop = vocoder_context(whole.model.vocoder.config), 240
    with torch.no_grad():
        full = whole.model.vocoder(mel.T[None]).reshape(-1)
        s, e = 40, 70
        part = whole.model.vocoder(mel[s - ctx: e + ctx].T[None]).reshape(-1)[ctx * hop: (ctx + e - s) * hop]
        short = whole.model.vocoder(mel[s - 2: e + 2].T[None]).reshape(-1)[2 * hop: (2 + e - s) * hop]
    torch.testing.assert_close(part, full[s * hop: e * hop], rtol=0, atol=1e-6)
    assert (short - full[s * hop: e * hop]).abs().max() > 1e-3   # too little context shows


def test_bad_requests_are_refused_and_abort_drops(whole):
    with pytest.raises(ValueError, match="voice must be one of"):
        whole.add_request("x", [1, 2], Code2WavParams(voice="Nobody"))
    with pytest.raises(ValueError, match="codec ids must be in"):
        whole.add_request("y", [1, 99999], Code2WavParams())
    with pytest.raises(ValueError, match="num_steps"):
        Code2WavParams(num_steps=1)
    whole.add_request("z", CodecInput([1, 2, 3], finished=False), None)
    whole.abort("z")
    assert not whole.has_unfinished()
    whole.add_request("empty", [], None)
    (out,) = whole.step()
    assert out.finished and out.output.audio.samples.shape == (0,)


@pytest.mark.parametrize("field, value", [("num_steps", 1), ("guidance_scale", -1.0), ("seed", -3)])
def test_bad_params_name_their_field(field, value):
    with pytest.raises(ParamError, match=f"^{field} must be") as e:
        Code2WavParams(**{field: value})
    assert e.value.field == field
