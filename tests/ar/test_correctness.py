"""The AR engine against transformers `generate` on the same weights (fp32, CPU, greedy ids identical)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from omnistage.ar.engine import AREngine
from omnistage.models.loader import load_causal_lm
from omnistage.config import EngineConfig
from omnistage.params import SamplingParams

ARCHS = ["llama", "qwen2", "qwen3"]
PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog and then runs far away into the forest.",
    "café naïve 日本語",
    "One two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty",
    "a b",
]


@pytest.fixture(scope="module")
def hf_models(tiny_models):
    return {a: AutoModelForCausalLM.from_pretrained(tiny_models[a], dtype=torch.float32).eval() for a in ARCHS}


def hf_greedy(model, ids: list[int], max_new: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False)
    return out[0, len(ids):].tolist()


def run(engine: AREngine, prompts, params) -> list:
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.output
    return [done[str(i)] for i in range(len(prompts))]


def engine(path, **kw) -> AREngine:
    kw.setdefault("block_size", 8)
    return AREngine(path, EngineConfig(device="cpu", dtype="float32", **kw), loader=load_causal_lm)


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_different_lengths_match_hf(arch, tiny_models, hf_models):
    tok = AutoTokenizer.from_pretrained(tiny_models[arch])
    eng = engine(tiny_models[arch], max_num_batched_tokens=24)   # forces chunked prefill
    outs = run(eng, PROMPTS, SamplingParams(max_tokens=20, temperature=0))
    for prompt, out in zip(PROMPTS, outs):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(hf_models[arch], ids, 20), prompt


@pytest.mark.parametrize("arch", ARCHS)
def test_shared_prefix_with_prefix_cache_matches_hf(arch, tiny_models, hf_models):
    tok = AutoTokenizer.from_pretrained(tiny_models[arch])
    prefix = " ".join(f"word{i}" for i in range(40))
    prompts = [f"{prefix} question {i}?" for i in range(40)]
    eng = engine(tiny_models[arch], max_num_seqs=8)
    outs = run(eng, prompts, SamplingParams(max_tokens=8, temperature=0))
    assert eng.stats()["prefix_cache_hits"] > 0
    assert sum(o.num_cached_tokens > 0 for o in outs) >= 30
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_models[arch], tok.encode(prompt), 8)


@pytest.mark.parametrize("arch", ARCHS)
def test_small_kv_pool_preempts_and_still_matches_hf(arch, tiny_models, hf_models):
    tok = AutoTokenizer.from_pretrained(tiny_models[arch])
    prompts = [f"Story number {i}: once upon a time there was a small robot who" for i in range(6)]
    eng = engine(tiny_models[arch], block_size=4, num_kv_blocks=24, enable_prefix_caching=False)
    outs = run(eng, prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert eng.stats()["num_preemptions"] > 0
    for prompt, out in zip(prompts, outs):
        ids = tok.encode(prompt)
        ref = hf_models[arch].generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref
    assert eng.block_manager.num_free_blocks == 24


def test_seeded_sample_is_batch_invariant(tiny_models):
    path = tiny_models["qwen2"]
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = run(engine(path), ["Tell me a story"], seeded)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=n, temperature=t, ignore_eos=True) for n, t in [(5, 1.0), (30, 0), (12, 0.7)]]
    prompts = ["x y z", "Tell me a story", "A much longer prompt that takes a few prefill chunks to get through", "hi"]
    mixed = run(engine(path, max_num_batched_tokens=16), prompts, [others[0], seeded, others[1], others[2]])
    assert mixed[1].outputs[0].token_ids == alone
    again = run(engine(path), ["Tell me a story"], seeded.clone(seed=99))[0].outputs[0].token_ids
    assert again != alone


def test_repetition_penalty_matches_hf(tiny_models, hf_models):
    path = tiny_models["llama"]
    tok = AutoTokenizer.from_pretrained(path)
    prompt = "the the the cat sat on the mat the"
    out = run(engine(path), [prompt], SamplingParams(max_tokens=16, temperature=0, repetition_penalty=1.5))[0]
    ids = tok.encode(prompt)
    ref = hf_models["llama"].generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                                      repetition_penalty=1.5)[0, len(ids):].tolist()
    assert out.outputs[0].token_ids == ref


def test_presence_frequency_penalties_match_reference(tiny_models, hf_models):
    path, model = tiny_models["qwen3"], hf_models["qwen3"]
    tok = AutoTokenizer.from_pretrained(path)
    prompt = "again and again and again"
    sp = SamplingParams(max_tokens=12, temperature=0, presence_penalty=0.7, frequency_penalty=1.1, ignore_eos=True)
    ids = tok.encode(prompt)
    ref: list[int] = []
    with torch.no_grad():
        for _ in range(12):
            logits = model(torch.tensor([ids + ref])).logits[0, -1]
            counts = torch.bincount(torch.tensor(ref, dtype=torch.long), minlength=logits.shape[0]).float()
            ref.append(int((logits - 1.1 * counts - 0.7 * (counts > 0).float()).argmax()))
    assert run(engine(path), [prompt], sp)[0].outputs[0].token_ids == ref


def test_logprobs_match_hf(tiny_models, hf_models):
    path, model = tiny_models["qwen2"], hf_models["qwen2"]
    tok = AutoTokenizer.from_pretrained(path)
    out = run(engine(path), ["Logprobs please"], SamplingParams(max_tokens=6, temperature=0, logprobs=3,
                                                                  ignore_eos=True))[0].outputs[0]
    ids = tok.encode("Logprobs please")
    with torch.no_grad():
        full = model(torch.tensor([ids + out.token_ids])).logits[0].log_softmax(-1)
    for i, (tid, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        ref = full[len(ids) - 1 + i]
        assert lp.chosen.token_id == tid and lp.top[0].token_id == tid and len(lp.top) == 3
        assert abs(lp.chosen.logprob - ref[tid].item()) < 1e-4
        assert [t.token_id for t in lp.top] == ref.topk(3).indices.tolist()


def test_stop_strings_stop_ids_min_and_max_tokens(tiny_models):
    path = tiny_models["llama"]
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    base = run(engine(path), ["Stop test"], greedy)[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 30

    stop = base.text[len(base.text) // 2: len(base.text) // 2 + 3]
    out = run(engine(path), ["Stop test"], greedy.clone(stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[:base.text.index(stop)] and stop not in out.text

    tid = base.token_ids[4]
    first = base.token_ids.index(tid)
    out = run(engine(path), ["Stop test"], greedy.clone(stop_token_ids=[tid]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == tid and out.token_ids == base.token_ids[:first + 1]

    out = run(engine(path), ["Stop test"], greedy.clone(stop_token_ids=[tid], min_tokens=first + 3))[0].outputs[0]
    assert len(out.token_ids) >= first + 3 and tid not in out.token_ids[:first + 2]


def test_n_completions_and_streamed_text_is_prefix(tiny_models):
    path = tiny_models["qwen2"]
    tok = AutoTokenizer.from_pretrained(path)
    eng = engine(path)
    eng.add_request("r", "café 日本語", SamplingParams(n=3, max_tokens=40, temperature=1.0, seed=7, ignore_eos=True))
    seen: dict[int, list[str]] = {0: [], 1: [], 2: []}
    final = None
    while eng.has_unfinished():
        for o in eng.step():
            for c in o.output.outputs:
                seen[c.index].append(c.text)
            final = o.output
    assert final.finished and len(final.outputs) == 3
    assert len({tuple(c.token_ids) for c in final.outputs}) == 3
    for c in final.outputs:
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        assert all(c.text.startswith(t) for t in seen[c.index])


def test_bad_requests_raise_value_errors(tiny_models):
    eng = engine(tiny_models["qwen2"], max_model_len=64)
    with pytest.raises(ValueError, match="max_tokens"):
        eng.add_request("a", "hello", SamplingParams(max_tokens=1000))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        eng.add_request("b", {"prompt_token_ids": [10**9]})
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    out = run(eng, ["hello"], SamplingParams(max_tokens=2))[0]   # the engine still serves
    assert out.finished and len(out.outputs[0].token_ids) == 2
