"""Qwen2.5-Omni end to end on the tiny checkpoint (fp32, CPU): thinker -> talker -> code2wav.

References are transformers' own `Qwen2_5OmniForConditionalGeneration.generate` (greedy thinker and
talker). transformers 5.x drops an all-ones attention mask inside `generate`, and the talker's
forward adds the codec pad / bos embeddings to its last two prompt rows and computes its 3-D rope
index only when it gets a mask; `keep_talker_mask` hands the mask back, which restores what the
model computes in transformers 4.x and the original Qwen code (what omnistage implements).
"""

import asyncio
import base64
import io
import time

import numpy as np
import pytest
import torch
from omni_testutil import openai_client
from PIL import Image

from omnistage.testing.qwen2_5_omni import CODEC_BOS, CODEC_EOS, CODEC_PAD, VOICES
from omnistage.params import SamplingParams

SAMPLES_PER_CODE = 2 * 240                      # DiT repeats x BigVGAN hop
NO_STOP = [CODEC_PAD, CODEC_BOS, CODEC_EOS]     # a talker that never stops: fixed audio length
DEPLOY = {"stages": {"talker": {"params": {"max_tokens": 40}}}}   # keep the random talker short


def image_and_audio_message(text="What is this?"):
    image = Image.fromarray((np.random.RandomState(0).rand(60, 90, 3) * 255).astype("uint8"))
    audio = (np.random.RandomState(1).randn(11025) * 0.1).astype("float32")     # 0.5 s at 22.05 kHz
    return [{"role": "user", "content": [{"type": "image", "image": image},
                                         {"type": "audio", "audio": (audio, 22050)},
                                         {"type": "text", "text": text}]}]


def video_message(text="What happens?"):
    frames = (np.random.RandomState(2).rand(4, 56, 84, 3) * 255).astype("uint8")   # 2 temporal patches
    return [{"role": "user", "content": [{"type": "video", "video": frames}, {"type": "text", "text": text}]}]


TEXT_MESSAGE = [{"role": "user", "content": "Tell me a story."}]
MEDIA_MESSAGES = {"image+audio": image_and_audio_message, "video": video_message}


@pytest.fixture(scope="module")
def omni(omni_dir):
    from omnistage import Omni

    # 16-token steps: prompts prefill in several chunks, so the talker's prompt rows are gathered
    # from several thinker outputs.
    with Omni(omni_dir, device="cpu", dtype="float32", max_num_batched_tokens=16, deploy_config=DEPLOY) as o:
        yield o


def keep_talker_mask(talker):
    def hook(module, args, kwargs):
        if kwargs.get("attention_mask") is None:
            cache = kwargs.get("cache")
            rows = kwargs["inputs_embeds"] if kwargs.get("inputs_embeds") is not None else kwargs["input_ids"]
            past = cache.get_seq_length() if cache is not None else 0
            kwargs["attention_mask"] = torch.ones(1, past + rows.shape[1], dtype=torch.long)
        return args, kwargs
    return talker.register_forward_pre_hook(hook, with_kwargs=True)


def hf_generate(hf_omni, omni_processor, messages, voice, thinker_tokens, talker_tokens):
    """(thinker ids, talker codes) of transformers' greedy generate."""
    from omnistage.models.qwen2_5_omni.processor import build_thinker_inputs

    inputs = build_thinker_inputs(omni_processor, messages)
    kwargs = dict(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask, **inputs.features)
    for name in ("pixel_values", "pixel_values_videos"):   # see test_tiny_omni.py: keeps them off the talker
        if name in kwargs:
            kwargs["thinker_" + name] = kwargs.pop(name)
    codes = []
    generate = hf_omni.talker.generate

    def record(*args, **kw):
        out = generate(*args, **kw)
        codes.extend(out[0, kw["input_ids"].shape[1]:].tolist())
        return out

    handle = keep_talker_mask(hf_omni.talker)
    hf_omni.talker.generate = record
    try:
        ids, _ = hf_omni.generate(**kwargs, speaker=voice, thinker_max_new_tokens=thinker_tokens,
                                  thinker_do_sample=False, talker_do_sample=False,
                                  talker_max_new_tokens=talker_tokens)
    finally:
        del hf_omni.talker.generate
        handle.remove()
    stop = next((i for i, c in enumerate(codes) if c in (CODEC_PAD, CODEC_EOS)), len(codes))
    return ids[0, inputs.input_ids.shape[1]:].tolist(), codes[:stop]


def test_detected_pipeline_and_talker_defaults(omni_dir):
    from omnistage.config import EngineConfig
    from omnistage.pipeline.build import detect_pipeline

    spec = detect_pipeline(omni_dir, EngineConfig(device="cpu"))
    assert [(s.name, s.kind, s.final_output) for s in spec.stages] == [
        ("thinker", "ar", "text"), ("talker", "ar", None), ("code2wav", "codec", "audio")]
    assert spec.route("thinker", ["text"]) == ["thinker"]
    assert spec.route("thinker", ["text", "audio"]) == ["thinker", "talker", "code2wav"]
    params = SamplingParams(**spec.stage("talker").params)
    assert (params.temperature, params.top_k, params.top_p, params.repetition_penalty) == (0.9, 40, 0.8, 1.05)
    assert params.stop_token_ids == [CODEC_PAD, CODEC_EOS] and params.bad_token_ids == [CODEC_BOS]
    assert all(e.streaming for e in spec.edges)


@pytest.mark.parametrize("kind", ["text", "image+audio", "video"])
def test_thinker_ids_and_talker_codes_equal_transformers(omni, hf_omni, omni_processor, kind):
    messages = TEXT_MESSAGE if kind == "text" else MEDIA_MESSAGES[kind]()
    hf_ids, hf_codes = hf_generate(hf_omni, omni_processor, messages, "Ethan", 10, 30)
    prompt = dict(omni.render_chat(messages), modalities=["text", "audio"], voice="Ethan")
    assert ("prompt_embeds" in prompt) == ("mrope_positions" in prompt) == (kind != "text")
    talker = omni.orchestrator.stages["talker"]
    seen, step = {}, talker.step

    def record():
        outs = step()
        seen.update({o.request_id: o.output.outputs[0].token_ids for o in outs})
        return outs

    talker.step = record
    try:
        thinker = SamplingParams(max_tokens=10, temperature=0)
        greedy = SamplingParams(**{**omni.orchestrator.spec.stage("talker").params, "temperature": 0,
                                   "max_tokens": 30})
        out = omni.generate(prompt, thinker, sampling_params_list=[thinker, greedy, None], use_tqdm=False)[0]
    finally:
        del talker.step
    assert out.outputs[0].token_ids == hf_ids
    (codes,) = seen.values()
    assert codes[:len(hf_codes)] == hf_codes and len(codes) in (len(hf_codes), len(hf_codes) + 1)  # + stop code
    assert out.audio.samples.shape == (len(hf_codes) * SAMPLES_PER_CODE,)


def test_offline_chat_returns_text_and_24khz_audio_per_voice(omni):
    params = SamplingParams(max_tokens=6, temperature=0)
    outs = {v: omni.chat(TEXT_MESSAGE, params, modalities=["text", "audio"], voice=v, use_tqdm=False)[0]
            for v in VOICES}
    for out in outs.values():
        assert out.finished and len(out.outputs[0].token_ids) == 6 and out.outputs[0].text
        audio = out.audio
        assert audio.sample_rate == 24000 and audio.samples.dtype == np.float32
        assert audio.samples.size > 0 and np.isfinite(audio.samples).all()
    assert not np.array_equal(outs["Chelsie"].audio.samples[:4800], outs["Ethan"].audio.samples[:4800])
    text_only = omni.chat(TEXT_MESSAGE, params, use_tqdm=False)[0]
    assert text_only.audio is None and text_only.outputs[0].token_ids == outs["Ethan"].outputs[0].token_ids
    with pytest.raises(ValueError, match=r"voice must be one of \['Chelsie', 'Ethan'\]"):
        omni.chat(TEXT_MESSAGE, params, modalities=["text", "audio"], voice="Nobody", use_tqdm=False)
    assert not any(s.has_unfinished() for s in omni.orchestrator.stages.values())


def test_thinker_to_talker_adapter_gathers_rows_and_ends_the_stream(omni_dir):
    """Hand-made thinker outputs: prompt rows in two chunks (one row resent, as after a preemption),
    the row of g_0 starts the talker, later rows stream, the finish adds tts_eos and the pad row."""
    from omnistage.models.qwen2_5_omni.adapters import ThinkerToTalker
    from omnistage.outputs import CompletionOutput, RequestOutput
    from omnistage.adapters import EdgeContext
    from omnistage.pipeline.build import edge_adapter
    from omnistage.spec import EdgeSpec
    from omnistage.stage import ARPrompt, HiddenStates, StageOutput

    adapter = edge_adapter(EdgeSpec("thinker", "talker", "qwen2_5_omni.thinker_to_talker", options={"model_dir": omni_dir}))
    assert isinstance(adapter, ThinkerToTalker) and adapter.upstream_inputs == {"return_hidden_states": True}
    cond, width = adapter.cond, adapter.cond.weight.shape[1]
    media = next(iter(cond.media_ids))
    prompt_ids = [5, media, 7, 8]
    rows = torch.randn(7, width, generator=torch.Generator().manual_seed(0))
    embeds = torch.randn(7, width, generator=torch.Generator().manual_seed(1))

    def out(start, end, finished=False):
        comp = CompletionOutput(0, token_ids=[1] * max(0, end - 4))
        return StageOutput("r", RequestOutput("r", prompt_token_ids=prompt_ids, outputs=[comp]), finished,
                           hidden=HiddenStates(start, rows[start:end], embeds[start:end]))

    ctx = EdgeContext({"voice": "Ethan"}, ARPrompt(prompt_token_ids=prompt_ids), {})
    assert adapter(out(0, 3), ctx) is None and adapter(out(2, 4), ctx) is None
    x = adapter(out(4, 5), ctx)
    assert len(x) == 1 and not x.finished and x.head_units == 1
    first = x.slice(0, 1, False)
    assert first.prompt_token_ids == [cond.codec_mask_id] * 4 + [cond.codec_pad_id, cond.codec_bos_id]
    text = embeds[:5] + rows[:5]
    text[1] = rows[1]                           # the media row keeps only its hidden state
    w, b = cond.weight, cond.bias
    expected = torch.cat([text[:4] @ w.T + b, ((cond.voices["Ethan"] + cond.codec_pad) @ w.T + b)[None],
                          ((text[4] + cond.codec_bos) @ w.T + b)[None]])
    torch.testing.assert_close(first.prompt_embeds, expected)
    assert first.stream_extra and first.mrope_positions is None
    x = adapter(out(5, 7, finished=True), ctx)
    assert len(x) == 4 and x.finished
    last = x.slice(1, 4, True)
    torch.testing.assert_close(last.rows, torch.cat([(embeds[5:7] + rows[5:7]) @ w.T + b,
                                                     (cond.tts_eos @ w.T + b)[None]]))
    torch.testing.assert_close(last.pad, cond.tts_pad @ w.T + b)
    with pytest.raises(RuntimeError, match="never arrived"):
        adapter(out(3, 4), EdgeContext({}, {}, {}))


def test_talker_input_in_blocks_slices_as_its_rows_one_by_one():
    """The adapter's rows in blocks (as projected per thinker step): every piece equals the stacked
    rows, and a piece that is one whole block is that block (no copy)."""
    from omnistage.models.qwen2_5_omni.adapters import TalkerInput
    from omnistage.stage import ARPrompt

    rows = torch.randn(7, 4, generator=torch.Generator().manual_seed(0))
    blocks, pad, prompt = [rows[:3], rows[3:4], rows[4:7]], torch.zeros(4), ARPrompt(prompt_token_ids=[1])
    x = TalkerInput(prompt, blocks, False, pad, ends=[3, 4, 7], count=7)
    one_by_one = TalkerInput(prompt, list(rows.unbind(0)), False, pad)
    assert len(x) == len(one_by_one) == 8
    for a in range(1, 8):
        for b in range(a, 9):
            assert torch.equal(x.slice(a, b, b == 8).rows, one_by_one.slice(a, b, b == 8).rows), (a, b)
    assert x.slice(4, 5, False).rows is blocks[1] and x.slice(5, 8, True).rows is blocks[2]
    assert x.slice(5, 8, True).pad is pad and x.slice(1, 1, False).rows.shape == (0, 4)


@pytest.fixture(scope="module")
def async_omni(omni_dir):
    from omnistage.entrypoints.async_omni import AsyncOmni

    engine = AsyncOmni(omni_dir, device="cpu", dtype="float32", deploy_config=DEPLOY)
    yield engine
    engine.close()


def test_async_streams_text_and_audio_and_audio_starts_before_the_text_ends(async_omni):
    thinker = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    talker = SamplingParams(max_tokens=36, temperature=0, bad_token_ids=NO_STOP)
    prompt = dict(async_omni.render_chat(TEXT_MESSAGE), modalities=["text", "audio"], voice="Chelsie")

    async def run():
        outs = []
        async for out in async_omni.generate(prompt, thinker, sampling_params_list=[thinker, talker, None]):
            outs.append((len(out.outputs[0].token_ids), 0 if out.audio is None else out.audio.samples.size))
        return outs

    outs = asyncio.run(run())
    first_audio = next(i for i, (_, n) in enumerate(outs) if n > 0)
    assert outs[first_audio][0] < 48            # audio began while the thinker was still writing
    assert len({n for _, n in outs if n}) >= 2  # more than one audio chunk
    assert outs[-1] == (48, 36 * SAMPLES_PER_CODE)


def _wav_base64(seconds=0.5, rate=16000) -> str:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, (np.sin(np.arange(int(seconds * rate)) * 0.05) * 0.3).astype("float32"), rate, format="WAV")
    return base64.b64encode(buf.getvalue()).decode()


def test_openai_client_chat_with_audio_in_and_out(async_omni):
    import openai
    import soundfile as sf

    with openai_client(async_omni) as client:
        messages = [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": _wav_base64(), "format": "wav"}},
            {"type": "text", "text": "Answer me."}]}]
        reply = client.chat.completions.create(model="tiny-omni", messages=messages, max_tokens=6, temperature=0,
                                               modalities=["text", "audio"], audio={"voice": "Ethan", "format": "wav"})
        message = reply.choices[0].message
        samples, rate = sf.read(io.BytesIO(base64.b64decode(message.audio.data)), dtype="float32")
        assert rate == 24000 and samples.size > 0 and message.audio.transcript == message.content
        assert reply.usage.completion_tokens == 6
        with pytest.raises(openai.BadRequestError, match="voice must be one of"):
            client.chat.completions.create(model="tiny-omni", messages=TEXT_MESSAGE, max_tokens=2,
                                           modalities=["text", "audio"], audio={"voice": "Nobody", "format": "wav"})


def test_openai_client_chat_with_a_video_url(async_omni, omni):
    """An MP4 data URL (vLLM's `video_url` part) is read as frames at 2 fps: the answer equals the
    offline chat on those frames; an undecodable one is a 400 naming the field."""
    import openai

    from omnistage.io.media import decode_video, encode_mp4

    frames = (np.random.RandomState(3).rand(10, 56, 84, 3) * 255).astype("uint8")
    mp4 = encode_mp4(frames, fps=5)                     # 2 s -> 4 frames at 2 fps
    url = "data:video/mp4;base64," + base64.b64encode(mp4).decode()
    decoded, fps = decode_video(mp4)
    assert decoded.shape == (4, 56, 84, 3) and fps == 2.0
    offline = omni.chat([{"role": "user", "content": [{"type": "video", "video": decoded, "fps": fps},
                                                      {"type": "text", "text": "What happens?"}]}],
                        SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0]
    with openai_client(async_omni) as client:
        reply = client.chat.completions.create(model="tiny-omni", max_tokens=6, temperature=0, messages=[
            {"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                         {"type": "text", "text": "What happens?"}]}])
        assert reply.choices[0].message.content == offline.outputs[0].text
        assert reply.usage.prompt_tokens == len(offline.prompt_token_ids)
        bad = "data:video/mp4;base64," + base64.b64encode(b"x" * 64).decode()
        with pytest.raises(openai.BadRequestError, match="video_url.url could not be decoded as a video") as e:
            client.chat.completions.create(model="tiny-omni", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": bad}}, {"type": "text", "text": "What happens?"}]}])
        assert e.value.param == "messages[0].content.video_url.url"


def test_every_stage_in_its_own_process_gives_the_same_text_codes_and_audio(omni, omni_dir):
    """The GPU layout on CPU: thinker, talker and code2wav each in a stage process (tensors -- hidden
    states, prompt embeddings, codes -- cross through `pipeline.wire`). Greedy text, talker codes and
    waveform equal the in-process pipeline's, for a text and an image+audio prompt, two at once."""
    from omnistage import Omni
    from omnistage.models.qwen2_5_omni.code2wav import Code2WavParams

    deploy = {"stages": {"thinker": {"runner": "process"}, "code2wav": {"runner": "process"},
                         "talker": {"runner": "process", "params": {"max_tokens": 40}}}}
    thinker = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    talker = SamplingParams(**{**omni.orchestrator.spec.stage("talker").params, "temperature": 0, "max_tokens": 24})
    prompts = [dict(omni.render_chat(m), modalities=["text", "audio"], voice=v)
               for m, v in ((TEXT_MESSAGE, "Ethan"), (image_and_audio_message(), "Chelsie"))]
    per_stage = [thinker, talker, Code2WavParams(seed=7)]       # the same initial noise in both runs
    want = omni.generate(prompts, thinker, sampling_params_list=per_stage, use_tqdm=False)
    with Omni(omni_dir, device="cpu", dtype="float32", max_num_batched_tokens=16, deploy_config=deploy) as apart:
        from omnistage.pipeline.stage_client import StageClient

        clients = list(apart.orchestrator.stages.values())
        assert all(isinstance(s, StageClient) for s in clients)
        # the three processes load at the same time: each was spawned before any of them was ready
        assert max(c.spawned_at for c in clients) < min(c.ready_at for c in clients)
        assert apart.tokenizer is not None and apart.orchestrator.max_model_len == omni.orchestrator.max_model_len
        got = apart.generate(prompts, thinker, sampling_params_list=per_stage, use_tqdm=False)
        stats = apart.orchestrator.stats()
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.audio.samples.shape == w.audio.samples.shape and g.audio.samples.size > 0
        np.testing.assert_allclose(g.audio.samples, w.audio.samples, atol=1e-5)
    assert stats["edge:thinker->talker:bytes"] > 0 and stats["edge:talker->code2wav:pieces"] > 0


def test_stage_process_takes_handed_on_requests_without_waiting_and_reports_refusals(omni_dir):
    """`submit` is one-way: a request the code2wav process refuses (an id outside the codec table)
    comes back as a finished output naming the reason, and the next request decodes; a refused voice
    is remembered, and still refused, without another round trip."""
    from omnistage.models.qwen2_5_omni.code2wav import Code2WavParams
    from omnistage.config import EngineConfig
    from omnistage.spec import StageSpec
    from omnistage.pipeline.stage_client import StageClient

    spec = StageSpec("code2wav", "codec", omni_dir, EngineConfig(device="cpu"), final_output="audio",
                     runner="process", backend="qwen2_5_omni_code2wav", options={"chunk_codes": 24})
    client = StageClient(spec)
    try:
        client.submit("bad", [5, 10**6], Code2WavParams(seed=0))
        client.submit("good", list(range(30)), Code2WavParams(seed=0))
        done, deadline = {}, time.time() + 60
        while len(done) < 2 and time.time() < deadline:
            done.update({o.request_id: o for o in client.step() if o.finished})
            time.sleep(0.01)
        assert "codec ids must be in" in done["bad"].error.message and done["bad"].output.audio is None
        assert done["good"].output.audio.samples.size == 30 * SAMPLES_PER_CODE and not client.has_unfinished()
        for _ in range(2):
            with pytest.raises(ValueError, match="voice must be one of"):
                client.check_params(Code2WavParams(voice="Nobody"))
        assert len(client._checked) == 1
    finally:
        client.close()


def test_capabilities_of_the_omni_pipeline(async_omni):
    """GET /v1/capabilities' object for Qwen2.5-Omni: chat with audio out (its speakers as voices)
    and image / audio / video parts in; /v1/audio/speech reads the text aloud (thinker -> talker)."""
    from omnistage.entrypoints.openai.capabilities import capabilities
    from omnistage.entrypoints.openai.serving_images import MediaLimits

    caps = capabilities(async_omni, "tiny-omni", MediaLimits())
    assert caps["tasks"] == ["chat", "chat_audio", "speech"] and caps["images"] is None
    assert caps["chat"]["output_modalities"] == ["text", "audio"]
    assert sorted(caps["chat"]["input_media"]) == ["audio", "image", "video"]
    assert [v["id"] for v in caps["audio"]["voices"]] == list(VOICES)
    assert all(v["sample_rate"] == 24000 for v in caps["audio"]["voices"])
