"""`TTSParams`' extension fields and `check_speech_params`: ranges checked when built, and what a model
cannot honour refused naming the field, for a preset-only model and for one that clones."""

import numpy as np
import pytest

from omnistage.codec.speech import MAX_REF_AUDIO_SECONDS, SpeechCapabilities, TTSParams, check_speech_params
from omnistage.params import ParamError

PRESETS = {"vivian", "ryan"}
PRESET_ONLY = SpeechCapabilities()
CLONER = SpeechCapabilities(task_types=("Base", "CustomVoice", "VoiceDesign"), languages=("Auto", "English"),
                            fields=frozenset({"max_new_tokens", "initial_codec_chunk_frames"}))
REF = (np.zeros(24000, np.float32), 24000)


def _refused(field, params, caps=CLONER):
    with pytest.raises(ParamError) as e:
        check_speech_params(params, caps, PRESETS)
    assert e.value.field == field, str(e.value)
    return str(e.value)


@pytest.mark.parametrize("kw, field", [
    ({"task_type": "Clone"}, "task_type"), ({"language": 5}, "language"), ({"ref_text": "x" * 5000}, "ref_text"),
    ({"x_vector_only_mode": "yes"}, "x_vector_only_mode"), ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": True}, "max_new_tokens"), ({"initial_codec_chunk_frames": 5000}, "initial_codec_chunk_frames"),
    ({"ref_audio": "data:audio/wav;base64,AAAA"}, "ref_audio"), ({"ref_audio": (np.zeros(10), 0)}, "ref_audio"),
    ({"ref_audio": (np.zeros(int(MAX_REF_AUDIO_SECONDS * 100) + 1), 100)}, "ref_audio"),
    ({"ref_audio": (np.zeros(0), 16000)}, "ref_audio")])
def test_out_of_range_fields_are_refused_when_built(kw, field):
    with pytest.raises(ParamError) as e:
        TTSParams(**kw)
    assert e.value.field == field


def test_reference_audio_survives_the_wire_as_a_list():
    p = TTSParams(ref_audio=[np.ones(800, np.float64), 16000])    # how a tuple crosses a process boundary
    assert p.ref_audio[1] == 16000 and p.ref_audio[0].dtype == np.float32 and p == TTSParams(ref_audio=REF)


def test_a_preset_only_model_names_each_field_it_cannot_honour():
    assert "['CustomVoice']" in _refused("task_type", TTSParams(task_type="Base"), PRESET_ONLY)
    for kw, field in (({"ref_audio": REF}, "ref_audio"), ({"ref_text": "hi"}, "ref_text"),
                      ({"x_vector_only_mode": True}, "x_vector_only_mode"), ({"max_new_tokens": 9}, "max_new_tokens"),
                      ({"language": "English"}, "language"), ({"voice": "nobody"}, "voice")):
        _refused(field, TTSParams(**kw), PRESET_ONLY)
    message = _refused("voice", TTSParams(voice="alice", ref_audio=REF, task_type="Base"), PRESET_ONLY)
    assert "does not clone" in message
    check_speech_params(TTSParams(voice="ryan", language="Auto", instructions="calm"), PRESET_ONLY, PRESETS)
    check_speech_params(None, PRESET_ONLY, PRESETS)


def test_a_cloning_model_checks_each_task_types_inputs():
    assert "required" in _refused("ref_audio", TTSParams(task_type="Base", ref_text="hi"))
    assert "x_vector_only_mode" in _refused("ref_text", TTSParams(task_type="Base", ref_audio=REF))
    check_speech_params(TTSParams(task_type="Base", ref_audio=REF, ref_text="hi", max_new_tokens=100), CLONER, PRESETS)
    check_speech_params(TTSParams(task_type="Base", ref_audio=REF, x_vector_only_mode=True, voice="alice"), CLONER,
                        PRESETS)
    # the model's default task type is its first (Base here): a reference is needed without one
    _refused("ref_audio", TTSParams(voice="vivian"))
    _refused("ref_audio", TTSParams(task_type="CustomVoice", voice="vivian", ref_audio=REF))
    _refused("voice", TTSParams(task_type="CustomVoice", voice="alice"))
    _refused("instructions", TTSParams(task_type="VoiceDesign"))
    check_speech_params(TTSParams(task_type="VoiceDesign", instructions="a deep, slow voice"), CLONER, PRESETS)
    check_speech_params(TTSParams(task_type="CustomVoice", voice="ryan", language="English",
                                  initial_codec_chunk_frames=1), CLONER, PRESETS)
