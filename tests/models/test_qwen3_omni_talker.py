"""Qwen3-Omni's talker, code predictor and code2wav against transformers on the tiny checkpoint (fp32, greedy).

transformers' `Qwen3OmniMoeForConditionalGeneration.generate` gives the reference: thinker ids, the
talker's codes (all codebooks, read where its code2wav takes them) and the waveform. The same thinker
output (its input rows and the `accept_hidden_layer` rows, from a thinker forward over the
generated sequence) goes through our thinker -> talker adapter into our AR engine serving the talker
component, and the codes into our code2wav codec stage. Prompts with an image or a video also carry
the talker's 3-D rope positions, checked against transformers' talker rope index.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnistage.adapters import EdgeContext
from omnistage.outputs import CompletionOutput, RequestOutput
from omnistage.stage import HiddenStates, StageOutput

THINKER_TOKENS = 8
TALKER_TOKENS = 12
# fp32 rounding grows through the vocoder's upsampling stack (~1e-5 of full scale measured);
# the streamed decode's left context covers the tiny model's receptive field (1 layer, window 8).
WAV_ATOL = 1e-4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from omnistage.testing.qwen3_omni import make_tiny_qwen3_omni

    return make_tiny_qwen3_omni(str(tmp_path_factory.mktemp("qwen3_omni")))


@pytest.fixture(scope="module")
def ref(folder):
    from omnistage.testing.qwen3_omni import load_reference

    return load_reference(folder)


def chat_inputs(folder, text: str, audio=None) -> dict:
    """The processor's inputs of a system turn + a user turn (text, and an audio part when given)."""
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(folder)
    parts = ([{"type": "audio", "audio": audio}] if audio is not None else []) + [{"type": "text", "text": text}]
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": parts}]
    rendered = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    out = proc(text=[rendered], audio=[audio] if audio is not None else None, return_tensors="pt")
    return {k: v for k, v in out.items() if v is not None}


def reference_run(ref, inputs: dict, speaker: str) -> dict:
    """transformers' generate: thinker ids, talker codes [G, T], waveform; plus the thinker rows."""
    taken = []
    hook = ref.code2wav.register_forward_pre_hook(lambda m, args: taken.append(args[0].clone()))
    try:
        with torch.no_grad():
            seqs, wav = ref.generate(**inputs, speaker=speaker, thinker_max_new_tokens=THINKER_TOKENS,
                                     thinker_do_sample=False, talker_do_sample=False,
                                     talker_max_new_tokens=TALKER_TOKENS, talker_repetition_penalty=1.0)
            whole = dict(inputs, input_ids=seqs[:, :-1], attention_mask=torch.ones_like(seqs[:, :-1]))
            rows = ref.thinker(**whole, output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    layer = ref.config.talker_config.accept_hidden_layer
    return {"seqs": seqs[0], "codes": taken[0][0].numpy(), "wav": wav.reshape(-1).numpy(),
            "inputs": rows[0][0], "hidden": rows[layer][0], "prompt_len": inputs["input_ids"].shape[1]}


@pytest.fixture(scope="module")
def run(ref, folder):
    return reference_run(ref, chat_inputs(folder, "hello there, say something"), "Ethan")


@pytest.fixture(scope="module")
def audio_run(ref, folder):
    tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(8000) / 16000)).astype(np.float32)
    return reference_run(ref, chat_inputs(folder, "what is it", tone), "aiden")


def thinker_output(run: dict, prompt_len: int, upto: int, finished: bool, start: int = 0) -> StageOutput:
    """The thinker's StageOutput after computing positions start..upto-1 (prompt + generated rows)."""
    seqs = run["seqs"].tolist()
    generated = seqs[prompt_len:min(upto + 1, len(seqs))] if not finished else seqs[prompt_len:]
    comp = CompletionOutput(0, token_ids=generated, finish_reason="length" if finished else None)
    out = RequestOutput("r", prompt_token_ids=seqs[:prompt_len], outputs=[comp], finished=finished)
    return StageOutput("r", out, finished, hidden=HiddenStates(start, run["hidden"][start:upto], run["inputs"][start:upto]))


def talker_engine(folder):
    from omnistage.ar.engine import AREngine
    from omnistage.config import EngineConfig
    from omnistage.models.registry import component_loader

    return AREngine(folder, EngineConfig(device="cpu", dtype="float32", block_size=8),
                    loader=component_loader("qwen3_omni.talker"))


def greedy(ref):
    from omnistage.params import SamplingParams

    talker = ref.config.talker_config
    vocab, eos = talker.text_config.vocab_size, talker.codec_eos_token_id
    return SamplingParams(temperature=0.0, max_tokens=TALKER_TOKENS, stop_token_ids=[eos],
                          bad_token_ids=[i for i in range(vocab - 1024, vocab) if i != eos])


def talk(engine, inputs: dict, params) -> dict[str, np.ndarray]:
    """Talker inputs per request -> frames [G, T] per request, all requests stepping together."""
    for rid, ti in inputs.items():
        engine.add_request(rid, ti.slice(0, 1, False), params)
        engine.add_input(rid, ti.slice(1, len(ti), True))
    frames = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                c = out.output.outputs[0]
                frames[out.request_id] = np.array([[t] + list(k) for t, k in zip(c.token_ids, c.codes)]).T
    return frames


def adapter_input(folder, run: dict, voice: str, cut: int = 0, entry=None):
    """The talker's input from the whole thinker output (less its last `cut` rows: a shorter answer);
    `entry`: the thinker's `ARPrompt` the request entered with."""
    from omnistage.models.registry import adapter_target
    from omnistage.adapters import build_adapter

    adapter = build_adapter("qwen3_omni.thinker_to_talker", adapter_target("qwen3_omni.thinker_to_talker"),
                            {"model_dir": folder})
    n = run["inputs"].shape[0] - cut
    out = thinker_output(run, run["prompt_len"], n, True)
    out.output.outputs[0].token_ids = out.output.outputs[0].token_ids[:len(out.output.outputs[0].token_ids) - cut]
    return adapter(out, EdgeContext({"voice": voice}, entry, {}))


def test_talker_codes_equal_transformers_all_codebooks_batched_as_alone(folder, ref, run):
    engine = talker_engine(folder)
    inputs = {"Ethan": adapter_input(folder, run, "Ethan"), "short": adapter_input(folder, run, "chelsie", cut=4)}
    assert not torch.equal(inputs["Ethan"].prompt.prompt_embeds, inputs["short"].prompt.prompt_embeds)
    together = talk(engine, inputs, greedy(ref))
    want = run["codes"]                         # transformers leaves out the last sampled frame
    assert want.shape[0] == 4 and want.shape[1] >= 4
    np.testing.assert_array_equal(together["Ethan"][:, :want.shape[1]], want)
    alone = talk(engine, {"short": inputs["short"]}, greedy(ref))
    np.testing.assert_array_equal(alone["short"], together["short"])
    assert not np.array_equal(together["short"], together["Ethan"])


def test_talker_codes_equal_transformers_with_audio_in_the_user_turn(folder, ref, audio_run):
    """Audio placeholders take hidden_projection of the accept_hidden_layer rows (1-D positions, as
    transformers' rope index gives audio)."""
    audio_id = ref.config.thinker_config.audio_token_id
    assert audio_run["seqs"].tolist().count(audio_id) > 0
    got = talk(talker_engine(folder), {"r": adapter_input(folder, audio_run, "aiden")}, greedy(ref))["r"]
    np.testing.assert_array_equal(got[:, :audio_run["codes"].shape[1]], audio_run["codes"])


def media_message(kind: str) -> list[dict]:
    """A system turn + a user turn with an image (or a 2-temporal-patch video) and a question."""
    rng = np.random.RandomState(5)
    if kind == "image":
        from PIL import Image

        part = {"type": "image", "image": Image.fromarray((rng.rand(60, 90, 3) * 255).astype("uint8"))}
    else:
        part = {"type": "video", "video": (rng.rand(4, 56, 84, 3) * 255).astype("uint8")}
    return [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [part, {"type": "text", "text": "what is it?"}]}]


@pytest.mark.parametrize("kind", ["image", "video"])
def test_talker_codes_equal_transformers_with_an_image_or_a_video(folder, ref, kind):
    """The talker prompt's 3-D rope positions (the rope index of the user turn's ids, from the thinker
    prompt's) and the delta of its generated positions: all codebooks equal transformers'."""
    from transformers import AutoProcessor

    from omnistage.models.qwen2_5_omni.processor import build_thinker_inputs
    from omnistage.models.qwen3_omni.processor import thinker_prompt
    from omnistage.stage import ARPrompt

    inputs = build_thinker_inputs(AutoProcessor.from_pretrained(folder), media_message(kind))
    features = {k: v for k, v in inputs.features.items() if v is not None}
    want = reference_run(ref, dict(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask, **features),
                         "Ethan")
    entry = ARPrompt(prompt_token_ids=inputs.input_ids[0].tolist(), **thinker_prompt(ref.thinker.model, inputs))
    ti = adapter_input(folder, want, "Ethan", entry=entry)
    pos = ti.prompt.mrope_positions
    assert pos is not None and not torch.equal(pos[1], pos[2])   # the media rows have their own h / w rows
    got = talk(talker_engine(folder), {"r": ti}, greedy(ref))["r"]
    assert want["codes"].shape[1] >= 4
    np.testing.assert_array_equal(got[:, :want["codes"].shape[1]], want["codes"])


def test_talker_positions_equal_the_rope_index_of_the_talker_ids_over_several_user_turns(folder, ref):
    """Two user turns (an image, then a video) around an assistant turn: `talker_positions` from the
    thinker prompt's positions equals transformers' talker `get_rope_index` of the talker's ids."""
    from transformers import AutoProcessor

    from omnistage.models.qwen2_5_omni.processor import build_thinker_inputs
    from omnistage.models.qwen3_omni.adapters import talker_positions, user_positions
    from omnistage.models.qwen3_omni.processor import thinker_positions

    first, second = media_message("image"), media_message("video")[1]
    messages = first + [{"role": "assistant", "content": "a picture"}, second]
    inputs = build_thinker_inputs(AutoProcessor.from_pretrained(folder), messages)
    ids = inputs.input_ids[0].tolist()
    users = user_positions(ids, ref.config.im_start_token_id, ref.config.user_token_id)
    assert len([k for k in range(1, len(users)) if users[k] != users[k - 1] + 1]) == 1   # two runs
    got, delta = talker_positions(thinker_positions(ref.thinker.model, inputs)[0][:, 0], users, 9)
    talker_ids = torch.tensor([[ids[i] for i in users] + [ref.config.tts_pad_token_id] * 9])
    with torch.no_grad():
        want, want_delta = ref.talker.get_rope_index(talker_ids, inputs["image_grid_thw"], inputs["video_grid_thw"],
                                                     torch.ones_like(talker_ids), False, None,
                                                     inputs["video_second_per_grid"])
    torch.testing.assert_close(got, want[:, 0].long(), rtol=0, atol=0)
    assert delta == int(want_delta.reshape(-1)[0])


def test_adapter_streams_rows_as_the_thinker_computes_them(folder, run):
    from omnistage.models.qwen3_omni.adapters import ThinkerToTalker

    whole = adapter_input(folder, run, "Ethan")
    adapter, ctx = ThinkerToTalker({"model_dir": folder}), EdgeContext({"voice": "ETHAN"}, None, {})
    n, prompt_len = run["inputs"].shape[0], len(run["seqs"]) - THINKER_TOKENS
    got, start = None, 0
    for upto in list(range(prompt_len, n)) + [n]:  # the prefill, then one row per decode step
        got = adapter(thinker_output(run, prompt_len, upto, upto == n, start), ctx) or got
        start = upto
        if got is not None and upto < n:
            assert not got.finished and len(got.rows) <= upto - prompt_len + 1
    assert got.finished and len(got) == len(whole)
    torch.testing.assert_close(got.prompt.prompt_embeds, whole.prompt.prompt_embeds)
    torch.testing.assert_close(torch.stack(got.rows), torch.stack(whole.rows))
    with pytest.raises(ValueError, match="voice must be one of"):
        adapter(thinker_output(run, prompt_len, n, True), EdgeContext({"voice": "nobody"}, None, {}))


def _decode(folder, items: dict[str, np.ndarray], pad_shapes=None, **options) -> dict[str, np.ndarray]:
    """`pad_shapes`: (batch buckets, frame lengths) every batch is padded to, as on CUDA (run eagerly here)."""
    from omnistage.codec.engine import CodecEngine
    from omnistage.models.qwen3_omni.code2wav import Code2WavStage
    from omnistage.models.qwen3_tts.codec import FramesInput

    stage = Code2WavStage(folder, **options)
    if pad_shapes is not None:
        (stage.buckets, stage.windows), stage.padded = pad_shapes, True
    engine = CodecEngine(stage)
    for rid, codes in items.items():
        engine.add_request(rid, FramesInput(codes.T.tolist(), finished=True))
    audio, chunks = {}, {rid: 0 for rid in items}
    while engine.has_unfinished():
        for out in engine.step():
            chunks[out.request_id] += int(out.audio_chunk is not None and len(out.audio_chunk) > 0)
            if out.finished:
                audio[out.request_id] = out.output.audio.samples
    return audio | {f"{rid}#chunks": n for rid, n in chunks.items()}


def test_code2wav_whole_and_streamed_equal_transformers(folder, ref, run):
    a, b = run["codes"], run["codes"][::-1].copy()
    whole = _decode(folder, {"a": a}, first_chunk_frames=64)
    assert np.abs(run["wav"]).max() > 1e-3      # a waveform worth comparing
    assert whole["a"].shape == run["wav"].shape
    np.testing.assert_allclose(whole["a"], run["wav"], atol=WAV_ATOL)
    streamed = _decode(folder, {"a": a, "b": b[:, :7]}, first_chunk_frames=2, chunk_frames=3, left_context_frames=25)
    assert streamed["a#chunks"] >= 3
    np.testing.assert_allclose(streamed["a"], run["wav"], atol=WAV_ATOL)
    with torch.no_grad():
        short = ref.code2wav(torch.as_tensor(b[:, :7])[None]).reshape(-1).numpy()
    assert streamed["b"].shape == short.shape
    np.testing.assert_allclose(streamed["b"], short, atol=WAV_ATOL)
    # padded as on CUDA (2 rows -> 4; windows of 1..29 frames -> 4 or 30): the real samples do not change
    padded = _decode(folder, {"a": a, "b": b[:, :7]}, pad_shapes=([1, 4], [4, 30]), first_chunk_frames=2,
                     chunk_frames=3, left_context_frames=25)
    for k in ("a", "b"):
        assert padded[k].shape == streamed[k].shape
        np.testing.assert_allclose(padded[k], streamed[k], atol=1e-5)


def test_code2wav_chunks_grow_from_a_small_first_one_and_pad_to_few_windows(folder):
    """The pipeline's code2wav options: chunks of 2, 2, 4, 8, 16 frames (each as long as the audio so
    far), then 24; on CUDA every decode window is padded to the longest of its place in that schedule
    (and its rows to a batch bucket)."""
    from omnistage.models.qwen3_omni.code2wav import Code2WavStage
    from omnistage.models.qwen3_omni.pipeline import CODE2WAV_OPTIONS
    from omnistage.models.qwen3_tts.codec import DecoderState

    stage = Code2WavStage(folder, **CODE2WAV_OPTIONS)
    state = DecoderState()
    state.frames, state.start = [[0] * stage.decoder.groups] * 100, 0
    sizes = []
    while (chunk := stage.ready(state, input_done=False)) is not None:
        sizes.append(chunk[1] - chunk[0])
        state.done = chunk[1]
    assert sizes[:7] == [2, 2, 4, 8, 16, 24, 24]
    ahead = stage.decoder.look_ahead
    assert stage.windows == [w + ahead for w in (2, 2 + 2, 4 + 4, 8 + 8, 16 + 16, 25 + 24)]
    assert stage.padded_shape(3, 29 + ahead) == (4, 32 + ahead) and stage.padded_shape(1, 80) == (1, 80)


def test_start_up_warm_up_leaves_the_talker_codes_equal_transformers(folder, ref, run):
    """The warm-up a CUDA engine runs at start-up (`ar/warmup.py`: prefills of each launch-shape class,
    eager decodes, the frame head at every decode batch size), run here on the CPU engine: it writes no request's
    state, so the codes after it still equal transformers'."""
    from omnistage.ar.warmup import warm_up

    engine = talker_engine(folder)
    done = warm_up(engine.runner, 40, 4, [1, 2, 3, 4], 3)
    assert done.prefill_lengths == [1, 2, 3, 4, 5, 6, 7, 8, 16, 17, 18]
    assert done.decodes == [(b, w) for b in (1, 2, 4) for w in (1, 2, 3)]
    assert done.frame_sizes == [1, 2, 3, 4]
    frames = talk(engine, {"Ethan": adapter_input(folder, run, "Ethan")}, greedy(ref))
    want = run["codes"]
    np.testing.assert_array_equal(frames["Ethan"][:, :want.shape[1]], want)


def test_talker_logits_mask_the_ids_transformers_suppresses(folder, ref):
    """vocab - 1024 .. vocab but codec eos are -inf in the talker's own logits (so its params need no
    per-row bad_token_ids); every other id keeps its logit."""
    from omnistage.models.qwen3_omni.pipeline import talker_params

    engine = talker_engine(folder)
    talker = ref.config.talker_config
    vocab, eos = talker.text_config.vocab_size, talker.codec_eos_token_id
    model = engine.runner.model
    logits = model.compute_logits(torch.randn(3, model.embed_tokens.weight.shape[1]))
    banned = torch.zeros(vocab, dtype=torch.bool)
    banned[vocab - 1024:] = True
    banned[eos] = False
    assert torch.isinf(logits[:, banned]).all() and torch.isfinite(logits[:, ~banned]).all()
    assert "bad_token_ids" not in talker_params(ref.config)
