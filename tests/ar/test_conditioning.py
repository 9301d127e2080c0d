"""Embedding-level inputs of the AR engine (what omni thinker / talker stages use), against transformers."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from omnistage.ar.engine import AREngine
from omnistage.models.loader import load_causal_lm
from omnistage.config import EngineConfig
from omnistage.params import ParamError, SamplingParams
from omnistage.stage import ExtraRows

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen2(tiny_models):
    path = tiny_models["qwen2"]
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def engine(path, **kw) -> AREngine:
    return AREngine(path, EngineConfig(device="cpu", dtype="float32", block_size=4, **kw), loader=load_causal_lm)


def drain(eng, feed=None) -> dict:
    """Run to completion; collects final outputs and every StageOutput's hidden states per request."""
    finals, datas = {}, {}
    step = 0
    while eng.has_unfinished():
        for o in eng.step():
            datas.setdefault(o.request_id, []).append(o.hidden)
            if o.finished:
                finals[o.request_id] = o.output
        if feed is not None:
            feed(step)
        step += 1
    return finals, datas


def test_prompt_embeds_match_hf_inputs_embeds(qwen2):
    path, hf = qwen2
    torch.manual_seed(0)
    embeds = torch.randn(7, hf.config.hidden_size)
    eng = engine(path)
    eng.add_request("a", {"prompt_token_ids": [0] * 7, "prompt_embeds": embeds}, GREEDY)
    eng.add_request("b", "plain text beside it", GREEDY)          # a plain request in the same batch
    out = drain(eng)[0]["a"].outputs[0].token_ids
    ref = hf.generate(inputs_embeds=embeds[None], max_new_tokens=10, do_sample=False, eos_token_id=None,
                      pad_token_id=0)[0].tolist()
    assert out == ref[-10:]


def test_hidden_states_reported_for_every_position(qwen2):
    path, hf = qwen2
    eng = engine(path, max_num_batched_tokens=5)                   # prompt arrives in chunks
    ids = hf.config.vocab_size // 2 + torch.arange(9)
    eng.add_request("a", {"prompt_token_ids": ids.tolist(), "return_hidden_states": True}, GREEDY)
    finals, datas = drain(eng)
    gen = finals["a"].outputs[0].token_ids
    rows = sorted((d.start, d.hidden, d.inputs) for d in datas["a"])
    assert [r[0] for r in rows] == list(range(0, 9, 5)) + list(range(9, 9 + len(gen) - 1))
    hidden = torch.cat([r[1] for r in rows])
    embeds = torch.cat([r[2] for r in rows])
    full = torch.cat([ids, torch.tensor(gen[:-1])])               # the last token is never fed back
    with torch.no_grad():
        ref = hf(full[None], output_hidden_states=True).hidden_states
    torch.testing.assert_close(embeds, ref[0][0], rtol=0, atol=0)
    torch.testing.assert_close(hidden, ref[-1][0], rtol=1e-4, atol=1e-4)


def test_streamed_extra_rows_wait_and_match_reference(qwen2):
    path, hf = qwen2
    torch.manual_seed(1)
    prompt = torch.randn(5, hf.config.hidden_size)
    extras = torch.randn(12, hf.config.hidden_size)
    pad = torch.randn(hf.config.hidden_size)
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, bad_token_ids=[3])
    eng = engine(path)
    eng.add_request("t", {"prompt_token_ids": [1] * 5, "prompt_embeds": prompt, "stream_extra": True}, sp)
    sent = [0]

    def feed(step):                                                 # 3 rows every other step, then finish
        if step % 2 == 1 and sent[0] < 12:
            eng.add_input("t", ExtraRows(extras[sent[0]:sent[0] + 3]))
            sent[0] += 3
            if sent[0] == 12:
                eng.add_input("t", ExtraRows(finished=True, pad=pad))

    out = drain(eng, feed)[0]["t"].outputs[0].token_ids
    # Reference: recompute the whole sequence each step from explicit input rows.
    emb = hf.get_input_embeddings().weight
    rows, ref = list(prompt), []
    with torch.no_grad():
        for k in range(16):
            logits = hf(inputs_embeds=torch.stack(rows)[None]).logits[0, -1]
            logits[3] = float("-inf")
            tok = int(logits.argmax())
            ref.append(tok)
            rows.append(emb[tok] + (extras[k] if k < 12 else pad))
    assert out == ref and 3 not in out


def test_mrope_with_equal_rows_is_plain_rope(tiny_models):
    path = tiny_models["qwen3"]
    plain = drain_one(engine(path), {"prompt_token_ids": list(range(10, 30))})
    pos = torch.arange(20).expand(3, 20)
    assert drain_one(engine_with_mrope(path), {"prompt_token_ids": list(range(10, 30)), "mrope_positions": pos}) == plain
    shifted = drain_one(engine_with_mrope(path), {"prompt_token_ids": list(range(10, 30)),
                                                  "mrope_positions": pos + torch.tensor([[0], [3], [5]])})
    assert shifted != plain                                          # the h / w rows do reach the rotation


def engine_with_mrope(path):
    """The tiny Qwen3 (head_dim 32) with a multimodal-rope section split of its 16 frequencies."""
    eng = engine(path)
    eng.model.rotary.config.rope_parameters = {**(eng.model.rotary.config.rope_parameters or {}),
                                               "mrope_section": [4, 6, 6]}
    eng.model.rotary.build(torch.device("cpu"))
    return eng


def drain_one(eng, inputs) -> list[int]:
    eng.add_request("x", inputs, GREEDY)
    return drain(eng)[0]["x"].outputs[0].token_ids


def test_dict_prompt_with_an_unknown_field_is_refused_naming_it_and_the_allowed_ones(qwen2):
    path, _ = qwen2
    eng = engine(path)
    with pytest.raises(ParamError, match=r"unknown fields \['prompt_embed'\]; allowed: \['prompt', ") as err:
        eng.add_request("a", {"prompt_token_ids": [1, 2], "prompt_embed": None}, GREEDY)
    assert err.value.field == "prompt" and not eng.has_unfinished()
    with pytest.raises(ValueError, match="without stream_extra"):   # a plain request takes no streamed rows
        eng.add_request("b", [1, 2], GREEDY)
        eng.add_input("b", ExtraRows(finished=True, pad=torch.zeros(4)))
