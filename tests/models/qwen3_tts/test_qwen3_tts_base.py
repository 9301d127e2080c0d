"""Qwen3-TTS Base (voice cloning) on the tiny Base folder against qwen-tts 0.1.1 (fixtures/).

The reference voice's codes (speech-tokenizer encoder) and x-vector (speaker encoder) equal the
reference's; the talker's codes of every codebook equal it for in-context cloning (`ref_text`) and
x-vector-only, greedy and seeded, for a 16 kHz reference (resampled) and with all text in the
prompt (`non_streaming_mode`); two concurrent cloning requests with different voices each equal
their solo output; the waveform (the reference frames
decoded as left context and cut off) is within 1e-4 of the reference's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnistage.codec.speech import MAX_REF_AUDIO_SECONDS
from omnistage.params import ParamError
from tts_testutil import frames_of, params_of, reference, run_all, seeded_params_of

BASE = ["base_icl_greedy", "base_xvector_greedy", "base_icl_sampled", "base_xvector_sampled", "base_icl_16k_greedy",
        "base_icl_non_streaming_greedy"]
WAV_ATOL = 1e-4


def test_reference_voice_encoding_equals_reference(talkers, cases):
    encoder = talkers["base"].model.prompts.references
    for name in ("base_icl_greedy", "base_icl_16k_greedy"):
        ref = reference(name)
        voice = encoder.encode(ref["ref_audio"], cases[name].get("ref_rate", 24000), with_codes=True)
        np.testing.assert_array_equal(voice.codes.numpy(), ref["ref_code"])
        np.testing.assert_allclose(voice.xvector.float().numpy(), ref["spk_embedding"], atol=1e-4, rtol=1e-4)
        assert len(set(ref["ref_code"][:, 0].tolist())) > 1          # the tiny encoder's codes are not constant


@pytest.mark.parametrize("name", BASE)
def test_base_codes_equal_reference(name, talkers, cases):
    case = cases[name]
    out = run_all(talkers["base"], {name: (case["text"], seeded_params_of(case))})[name]
    np.testing.assert_array_equal(frames_of(out), reference(name)["codes"])
    ref_code = reference(name).get("ref_code")
    context = out.output.context_frames
    assert (context is None) if ref_code is None else (context.tolist() == ref_code.tolist())


def test_two_concurrent_cloning_requests_equal_their_solo_outputs(talkers, cases):
    """Different voices (another reference, another mode, sampled beside greedy), together and one
    joining the other's running batch: no state passes between requests."""
    engine = talkers["base"]
    names = ["base_icl_greedy", "base_icl_16k_greedy", "base_xvector_sampled"]
    reqs = {n: (cases[n]["text"], seeded_params_of(cases[n])) for n in names}
    for stagger in (0, 2):
        outs = run_all(engine, {f"{n}@{stagger}": r for n, r in reqs.items()}, stagger=stagger)
        for n in names:
            np.testing.assert_array_equal(frames_of(outs[f"{n}@{stagger}"]), reference(n)["codes"])


def test_cloned_waveform_equals_reference(tts_folders, cases):
    """Omni (talker + decoder stage): in-context cloning continues the reference's frames (decoded
    as left context, not output); the reference's cut keeps one sample of them (fixtures/README.md)."""
    from omnistage import Omni

    names = ["base_icl_greedy", "base_xvector_greedy"]
    with Omni(tts_folders["base"], device="cpu", dtype="float32") as omni:
        outs = omni.generate([cases[n]["text"] for n in names], [params_of(cases[n]) for n in names])
    for name, out in zip(names, outs):
        ref = reference(name)["wav"]
        assert out.audio.sample_rate == 24000 and len(out.audio.samples) == 11 * 1920
        np.testing.assert_allclose(out.audio.samples, ref[len(ref) - 11 * 1920:], atol=WAV_ATOL)


def test_base_bad_input_names_the_field(talkers, cases):
    from omnistage.models.qwen3_tts.prompt import Qwen3TTSParams

    engine = talkers["base"]
    voice = (reference("base_icl_greedy")["ref_audio"], 24000)
    for params, field in ((Qwen3TTSParams(), "ref_audio"),
                          (Qwen3TTSParams(ref_audio=voice), "ref_text"),
                          (Qwen3TTSParams(ref_audio=voice, ref_text="Hi.", instructions="Loud."), "instructions"),
                          (Qwen3TTSParams(ref_audio=voice, ref_text="Hi.", task_type="CustomVoice"), "task_type")):
        with pytest.raises(ParamError) as err:
            engine.add_request("bad", "Hello there.", params)
        assert err.value.field == field, (params, err.value)
        assert not engine.has_unfinished()
    too_long = np.zeros(int((MAX_REF_AUDIO_SECONDS + 1) * 16000), np.float32)
    with pytest.raises(ParamError) as err:
        Qwen3TTSParams(ref_audio=(too_long, 16000), ref_text="Hi.")
    assert err.value.field == "ref_audio" and f"{MAX_REF_AUDIO_SECONDS:g} seconds" in str(err.value)
    with torch.inference_mode():
        assert engine.voices() == []
