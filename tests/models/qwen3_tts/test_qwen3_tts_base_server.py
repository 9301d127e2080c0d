"""Qwen3-TTS Base over HTTP: the real server on loopback and the real openai client / httpx.

Cloning with `ref_audio` as a data URL (+ `ref_text`, or `x_vector_only_mode`), with an uploaded
voice (used twice: its reference is encoded once), and the 400s naming the field: no `ref_audio`,
no `ref_text` outside x-vector-only mode, an undecodable or too long reference.
"""

from __future__ import annotations

import base64
import io
import json
import shutil

import numpy as np
import pytest

from omnistage.codec.speech import MAX_REF_AUDIO_SECONDS


def _wav(samples: np.ndarray, rate: int) -> bytes:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()


def _data_url(samples: np.ndarray, rate: int) -> str:
    return "data:audio/wav;base64," + base64.b64encode(_wav(samples, rate)).decode()


def test_base_speech_with_data_url_and_uploaded_voice(tts_folders, tmp_path):
    import httpx
    import openai
    import soundfile as sf
    from live_server import live_server
    from tts_testutil import reference

    from omnistage.entrypoints.async_omni import AsyncOmni
    from omnistage.entrypoints.openai.api_server import build_app
    from omnistage.entrypoints.openai.serving_speech import SpeechOptions

    folder = str(tmp_path / "base")                         # a small limit: 7 frames at most
    shutil.copytree(tts_folders["base"], folder)
    with open(f"{folder}/generation_config.json", encoding="utf-8") as f:
        gen = json.load(f)
    with open(f"{folder}/generation_config.json", "w", encoding="utf-8") as f:
        json.dump(dict(gen, max_new_tokens=8, do_sample=False), f)
    voice = reference("base_icl_greedy")["ref_audio"]
    engine = AsyncOmni(folder, device="cpu", dtype="float32")
    encoder = engine.orchestrator.stages["talker"].model.prompts.references
    try:
        app = build_app(engine, "qwen3-tts", speech_options=SpeechOptions(speaker_samples_dir=str(tmp_path / "voices")))
        with live_server(app, timeout=180.0) as url, \
                openai.OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0, timeout=180) as client:
            def speak(**fields) -> np.ndarray:
                audio = client.audio.speech.create(model="qwen3-tts", voice=fields.pop("voice", None),
                                                   input="Hello there.", extra_body=fields)
                samples, rate = sf.read(io.BytesIO(audio.content), dtype="float32")
                assert rate == 24000 and 0 < len(samples) <= 7 * 1920 and len(samples) % 1920 == 0
                return samples

            url_voice = _data_url(voice, 24000)
            icl = speak(task_type="Base", ref_audio=url_voice, ref_text="The old engineer kept a notebook.")
            xvec = speak(task_type="Base", ref_audio=url_voice, x_vector_only_mode=True)
            assert not np.array_equal(icl[:len(xvec)], xvec[:len(icl)])
            assert encoder.encoded == 2                     # x-vector only needs no codes: another entry

            up = httpx.post(url + "/v1/audio/voices", data={"name": "engineer", "consent": "Synthetic test voice.",
                                                            "ref_text": "The old engineer kept a notebook."},
                            files={"audio_sample": ("v.wav", _wav(voice, 24000), "audio/wav")}, timeout=60)
            assert up.status_code == 201, up.text
            for _ in range(2):                              # the uploaded voice = the same reference and text
                np.testing.assert_allclose(speak(voice="engineer"), icl, atol=1e-5)
            assert encoder.encoded == 2                     # reused: encoded once, for the data URL request

            long = np.zeros(int((MAX_REF_AUDIO_SECONDS + 1) * 8000), np.float32)
            bad = [(dict(task_type="Base"), "ref_audio"),
                   (dict(task_type="Base", ref_audio=url_voice), "ref_text"),
                   (dict(task_type="Base", ref_audio=base64.b64encode(b"RIFF garbage" * 50).decode(),
                         ref_text="Hi."), "ref_audio"),
                   (dict(task_type="Base", ref_audio=_data_url(long, 8000), ref_text="Hi."), "ref_audio"),
                   (dict(task_type="CustomVoice", ref_audio=url_voice, ref_text="Hi."), "task_type")]
            for fields, param in bad:
                with pytest.raises(openai.BadRequestError) as err:
                    speak(**fields)
                assert err.value.body["param"] == param, (fields, err.value.body)
            assert not engine.orchestrator.stages["talker"].has_unfinished()
    finally:
        engine.close()
