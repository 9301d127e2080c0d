"""The thinker's text LM and the talker run as plain Qwen2 decoders from the mapped weights."""

import pytest
import torch

from omnistage.models.loader import iter_weights
from omnistage.models.qwen2_5_omni.weights import export_thinker_text, talker_config, talker_weights

PROMPTS = ["Tell me a story.", "What is the capital of France?", "café 日本語"]


@pytest.fixture(scope="module")
def thinker_as_qwen2(omni_dir, tmp_path_factory):
    return export_thinker_text(omni_dir, str(tmp_path_factory.mktemp("thinker-qwen2")))


def test_thinker_text_on_our_ar_engine_equals_hf_thinker_generate(thinker_as_qwen2, hf_omni, omni_processor):
    from omnistage.ar.engine import AREngine
    from omnistage.models.loader import load_causal_lm
    from omnistage.config import EngineConfig
    from omnistage.params import SamplingParams

    engine = AREngine(thinker_as_qwen2, EngineConfig(device="cpu", dtype="float32", block_size=8), loader=load_causal_lm)
    expected = {}
    for i, prompt in enumerate(PROMPTS):
        text = omni_processor.apply_chat_template([{"role": "user", "content": prompt}],
                                                  add_generation_prompt=True, tokenize=False)
        ids = omni_processor(text=text, return_tensors="pt")["input_ids"]
        out = hf_omni.thinker.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                       do_sample=False)
        expected[str(i)] = out[0, ids.shape[1]:].tolist()
        engine.add_request(str(i), ids[0].tolist(), SamplingParams(max_tokens=12, temperature=0))
    got = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.output.outputs[0].token_ids
    assert got == expected


def test_talker_is_a_qwen2_decoder_over_projected_embeddings(omni_dir, hf_omni):
    from transformers import Qwen2ForCausalLM

    weights = dict(talker_weights(iter_weights(omni_dir)))
    proj = torch.nn.Linear(*weights["input_proj.weight"].shape[::-1])
    proj.load_state_dict({"weight": weights.pop("input_proj.weight"), "bias": weights.pop("input_proj.bias")})
    codec_embed = weights.pop("codec_embed.weight")
    assert codec_embed.shape == hf_omni.talker.get_input_embeddings().weight.shape
    qwen2 = Qwen2ForCausalLM(talker_config(hf_omni.config)).eval()
    missing = qwen2.load_state_dict(weights, strict=False).missing_keys
    assert missing == ["model.embed_tokens.weight"]   # unused: the decoder is fed embeddings
    embeds = torch.randn(2, 9, hf_omni.config.talker_config.embedding_size, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(9)[None].expand(2, -1)
    with torch.no_grad():
        expected = hf_omni.talker(inputs_embeds=embeds.clone(), position_ids=positions).logits
        got = qwen2(inputs_embeds=proj(embeds), position_ids=positions).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

    # The projection is linear, so it folds into the codec table: a decode row's input
    # proj(text_j + codec_embed[c]) equals proj(text_j) + (codec_embed @ W^T)[c], i.e. the talker is a
    # Qwen2 with a [codec vocab, talker hidden] table plus one additive vector per text position.
    folded = codec_embed @ proj.weight.T
    codes = torch.tensor([[8293, 17, 4000, 8292, 5, 6, 7, 8, 9]] * 2)
    with torch.no_grad():
        expected = hf_omni.talker(inputs_embeds=embeds + codec_embed[codes], position_ids=positions).logits
        got = qwen2(inputs_embeds=proj(embeds) + folded[codes], position_ids=positions).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)   # reassociated sums
