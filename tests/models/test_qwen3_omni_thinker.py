"""Qwen3-Omni's thinker on the tiny checkpoint (fp32, CPU) against transformers' own model.

The native thinker (Qwen3-MoE decoder with `layers.moe`, interleaved MRoPE, deepstack rows) serves
the registry's text-only pipeline; its greedy ids equal `Qwen3OmniMoeThinkerForConditionalGeneration.generate`
for a text prompt, an image + audio prompt and a video prompt (prefilled in 16-token chunks), alone
and batched; the hidden states it reports for the talker are transformers' `hidden_states
[accept_hidden_layer]`; the openai client's chat with an audio input over a live server answers the
same text as the offline chat.
"""

import base64
import io
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from omnistage.params import SamplingParams  # noqa: E402

NEW = 10                                        # tokens per answer


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def q3_dir(tmp_path_factory) -> str:
    from omnistage.testing.qwen3_omni import make_tiny_qwen3_omni

    return make_tiny_qwen3_omni(str(tmp_path_factory.mktemp("q3") / "tiny-qwen3_omni"))


@pytest.fixture(scope="module")
def hf(q3_dir):
    from omnistage.testing.qwen3_omni import load_reference

    return load_reference(q3_dir)


@pytest.fixture(scope="module")
def processor(q3_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(q3_dir)


@pytest.fixture(scope="module")
def omni(q3_dir):
    from omnistage import Omni

    with Omni(q3_dir, device="cpu", dtype="float32", max_num_batched_tokens=16) as o:
        yield o


def text_message():
    return [{"role": "user", "content": "What is the capital of France?"}]


def image_and_audio_message():
    image = Image.fromarray((np.random.RandomState(0).rand(60, 90, 3) * 255).astype("uint8"))
    audio = (np.random.RandomState(1).randn(11025) * 0.1).astype("float32")     # 0.5 s at 22.05 kHz
    return [{"role": "user", "content": [{"type": "image", "image": image},
                                         {"type": "audio", "audio": (audio, 22050)},
                                         {"type": "text", "text": "What is this?"}]}]


def video_message():
    frames = (np.random.RandomState(2).rand(4, 56, 84, 3) * 255).astype("uint8")   # 2 temporal patches
    return [{"role": "user", "content": [{"type": "video", "video": frames}, {"type": "text", "text": "What happens?"}]}]


MESSAGES = {"text": text_message, "image+audio": image_and_audio_message, "video": video_message}
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)


def hf_ids(hf, processor, messages) -> list[int]:
    from omnistage.models.qwen2_5_omni.processor import build_thinker_inputs

    inputs = build_thinker_inputs(processor, messages)
    with torch.no_grad():
        seq = hf.thinker.generate(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                                  **inputs.features, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    return seq[0, inputs.input_ids.shape[1]:].tolist()


def test_registry_picks_the_thinker_pipeline(q3_dir):
    from omnistage.config import EngineConfig
    from omnistage.models.registry import entry_for_folder, load_attr

    entry = entry_for_folder(q3_dir)
    assert entry.name == "qwen3_omni"
    spec = load_attr(entry.pipeline)(q3_dir, EngineConfig(device="cpu"))
    assert [s.name for s in spec.stages] == ["thinker", "talker", "code2wav"]   # the talker joined (part 2)
    assert spec.main_stage.name == "thinker" and spec.main_stage.final_output == "text"


@pytest.mark.parametrize("kind", list(MESSAGES))
def test_thinker_greedy_ids_equal_transformers(omni, hf, processor, kind):
    messages = MESSAGES[kind]()
    out = omni.chat(messages, GREEDY, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == hf_ids(hf, processor, messages)


def test_media_prompts_carry_deepstack_rows_and_3d_positions(omni):
    prompt = omni.render_chat(video_message())
    n = len(prompt["prompt_token_ids"])
    deep = prompt["layer_embeds"]
    assert deep.shape == (1, n, 64)                          # one deepstack layer in the tiny vision tower
    visual = deep.abs().sum(-1)[0] > 0
    assert 0 < int(visual.sum()) < n                         # rows only at the video placeholders
    assert not torch.equal(prompt["mrope_positions"][1], torch.arange(n))
    assert "layer_embeds" not in omni.render_chat(text_message())


def test_batched_equals_alone(omni):
    convs = [m() for m in MESSAGES.values()]
    together = omni.chat(convs, GREEDY, use_tqdm=False)
    alone = [omni.chat(c, GREEDY, use_tqdm=False)[0] for c in convs]
    assert [list(o.outputs[0].token_ids) for o in together] == [list(o.outputs[0].token_ids) for o in alone]


def test_reported_hidden_states_are_the_accept_hidden_layer(omni, hf, processor):
    """Through the AR engine (chunked prefill, deepstack rows): `HiddenStates.hidden` of every prompt
    row equals transformers' `hidden_states[accept_hidden_layer]`, `inputs` its `hidden_states[0]`."""
    from omnistage.models.qwen2_5_omni.processor import build_thinker_inputs

    messages = image_and_audio_message()
    engine = omni.orchestrator.stages["thinker"]
    engine.add_request("hidden", dict(omni.render_chat(messages), return_hidden_states=True),
                       SamplingParams(max_tokens=1, temperature=0))
    rows, inputs = [], []
    while engine.has_unfinished():
        for out in engine.step():
            if out.hidden is not None:
                rows.append(out.hidden.hidden)
                inputs.append(out.hidden.inputs)
    got, got_inputs = torch.cat(rows), torch.cat(inputs)
    batch = build_thinker_inputs(processor, messages)
    with torch.no_grad():
        ref = hf.thinker(input_ids=batch.input_ids, attention_mask=batch.attention_mask, **batch.features,
                         output_hidden_states=True)
    layer = hf.config.talker_config.accept_hidden_layer
    n = batch.input_ids.shape[1]
    torch.testing.assert_close(got[:n], ref.hidden_states[layer][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_inputs[:n], ref.hidden_states[0][0], atol=1e-5, rtol=1e-5)


def test_dense_layers_among_moe_layers_load_and_match(tmp_path):
    """`mlp_only_layers` keeps a dense MLP in that layer (its own width); logits equal transformers'."""
    from omnistage.layers.attention import AttentionMetadata, PrefillChunk
    from omnistage.layers.moe import SparseMoeBlock
    from omnistage.models.qwen3_omni.thinker import load_thinker
    from omnistage.testing.qwen3_omni import load_reference, make_tiny_qwen3_omni

    path = make_tiny_qwen3_omni(str(tmp_path / "dense1"), seed=3, text_overrides={"mlp_only_layers": [1]})
    model = load_thinker(path, torch.device("cpu"), torch.float32, None)[0]
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers] == [True, False, True]
    ids = torch.randint(0, 700, (13,), generator=torch.Generator().manual_seed(0))
    attn = model.attention_layers[0]
    for a in model.attention_layers:
        a.kv_cache = torch.zeros(2, 4, 4, attn.num_kv_heads, attn.head_dim)
    pos = torch.arange(13)
    meta = AttentionMetadata(slot_mapping=pos, prefills=[PrefillChunk(0, 13, 13, torch.arange(4))])
    with torch.no_grad():
        got = model.compute_logits(model(ids, pos, meta)[0])
        want = load_reference(path).thinker(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _wav_base64(seconds=0.5, rate=16000) -> str:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, (np.sin(np.arange(int(seconds * rate)) * 0.05) * 0.3).astype("float32"), rate, format="WAV")
    return base64.b64encode(buf.getvalue()).decode()


def test_openai_client_chat_with_audio_input_answers_as_offline(q3_dir, omni):
    import openai
    import soundfile as sf
    from live_server import live_server

    from omnistage.entrypoints.async_omni import AsyncOmni
    from omnistage.entrypoints.openai.api_server import build_app

    wav = _wav_base64()
    samples, rate = sf.read(io.BytesIO(base64.b64decode(wav)), dtype="float32")
    offline = omni.chat([{"role": "user", "content": [{"type": "audio", "audio": (samples, rate)},
                                                      {"type": "text", "text": "Answer me."}]}],
                        GREEDY, use_tqdm=False)[0].outputs[0].text
    engine = AsyncOmni(q3_dir, device="cpu", dtype="float32")
    try:
        with live_server(build_app(engine, "tiny-q3"), timeout=120) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            messages = [{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}},
                {"type": "text", "text": "Answer me."}]}]
            reply = client.chat.completions.create(model="tiny-q3", messages=messages, max_tokens=NEW,
                                                   temperature=0, extra_body={"ignore_eos": True})
            assert reply.choices[0].message.content == offline
            assert reply.usage.completion_tokens == NEW
    finally:
        engine.close()


def test_interleaved_mrope_tables_equal_transformers(q3_dir):
    """`mrope_interleaved` rope rows: cos / sin per token equal transformers' thinker rotary embedding."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextRotaryEmbedding

    from omnistage.layers.rotary import RotaryEmbedding
    from omnistage.models.qwen3_omni.thinker import omni_config, thinker_text_config

    ours = RotaryEmbedding(thinker_text_config(q3_dir), 256).build(torch.device("cpu"))
    theirs = Qwen3OmniMoeThinkerTextRotaryEmbedding(omni_config(q3_dir).thinker_config.text_config)
    pos = torch.randint(0, 256, (3, 11), generator=torch.Generator().manual_seed(0))
    cos, sin = theirs(torch.zeros(1, dtype=torch.float32), pos[:, None])
    got_cos, got_sin = ours.tables(pos)
    torch.testing.assert_close(got_cos, cos[0])
    torch.testing.assert_close(got_sin, sin[0])


def test_the_moe_decoder_with_a_shared_expert_equals_the_talker_decoder(q3_dir, hf):
    """`Qwen3MoeForCausalLM` on the talker's text config (a sigmoid-gated shared expert in every layer,
    no top-k renormalisation) equals transformers' talker model on the same input rows."""
    import copy

    from omnistage.layers.attention import AttentionMetadata, PrefillChunk
    from omnistage.models.qwen3_omni.thinker import Qwen3MoeForCausalLM, omni_config, read_tensors

    config = copy.deepcopy(omni_config(q3_dir).talker_config.text_config)
    config.rope_parameters = {**config.rope_parameters, "mrope_interleaved": True}
    config.tie_word_embeddings = False
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config, 64)
    model = model.to_empty(device="cpu")

    def weights():
        for name, tensor in read_tensors(q3_dir, ("talker.model.", "talker.codec_head.")):
            if name == "talker.model.codec_embedding.weight":
                yield "model.embed_tokens.weight", tensor
            elif name.startswith("talker.model."):
                yield "model." + name[len("talker.model."):], tensor
            else:
                yield "lm_head.weight", tensor

    model.load_weights(weights())
    model.rotary.build(torch.device("cpu"))
    assert model.layers[0].mlp.shared_expert is not None and not model.layers[0].mlp.norm_topk_prob
    x = torch.randn(9, config.hidden_size, generator=torch.Generator().manual_seed(0))
    attn = model.attention_layers[0]
    for a in model.attention_layers:
        a.kv_cache = torch.zeros(2, 3, 4, attn.num_kv_heads, attn.head_dim)
    pos = torch.arange(9)
    meta = AttentionMetadata(slot_mapping=pos, prefills=[PrefillChunk(0, 9, 9, torch.arange(3))])
    with torch.no_grad():
        got = model(torch.zeros(9, dtype=torch.long), pos, meta, inputs_embeds=x)
        want = hf.talker.model(inputs_embeds=x[None]).last_hidden_state[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
