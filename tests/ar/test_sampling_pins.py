"""Seeded and penalised sampling pinned to the tokens the engine gave before the host-side rewrite of the
runner and sampler (ar/step_inputs.py, ar/penalties.py, ar/sampler.py): the same seeds must keep giving
the same tokens.

Every config runs in one mixed batch (chunked prefill, greedy and unseeded rows beside seeded ones, so
the default generator's draws are pinned too); the seeded ones also alone, where they must not change.
The expected ids were recorded from commit 8f82a6c (CPU, fp32, tiny random checkpoints built in code).
"""

import pytest

from omnistage.ar.engine import AREngine
from omnistage.config import EngineConfig
from omnistage.models.loader import load_causal_lm
from omnistage.params import SamplingParams

PROMPTS = ["Tell me a story", "x y z", "A much longer prompt that takes a few prefill chunks to get through",
           "hi", "the the the cat sat on the mat the", "café 日本語", "One two three", "again and again"]

CONFIGS = {
    "topk_topp_seed": SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True),
    "small_topk_seed": SamplingParams(max_tokens=20, temperature=1.2, top_k=5, seed=7, ignore_eos=True),
    "minp_seed": SamplingParams(max_tokens=20, temperature=0.8, min_p=0.1, seed=3, ignore_eos=True),
    "penalties_seed": SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, repetition_penalty=1.3,
                                     presence_penalty=0.5, frequency_penalty=0.4, seed=11, ignore_eos=True),
    "greedy_penalties": SamplingParams(max_tokens=16, temperature=0, repetition_penalty=1.5,
                                       frequency_penalty=0.3, ignore_eos=True),
    "unseeded_topk": SamplingParams(max_tokens=12, temperature=1.0, top_k=20, ignore_eos=True),
    "topp_only_bans_seed": SamplingParams(max_tokens=14, temperature=0.7, top_p=0.8, seed=5, min_tokens=6,
                                          stop_token_ids=[3, 4, 5], bad_token_ids=[10, 11, 12], logprobs=2),
    "n3_seed": SamplingParams(n=3, max_tokens=10, temperature=1.0, top_k=100, presence_penalty=-0.5, seed=21,
                              ignore_eos=True),
}

EXPECTED: dict[str, list[list[int]]] = {
    'topk_topp_seed': [[496, 80, 335, 154, 223, 612, 303, 54, 532, 394, 485, 762, 404, 306, 482, 359, 306, 534, 82, 573]],
    'small_topk_seed': [[709, 8, 591, 660, 708, 516, 477, 571, 448, 118, 128, 11, 265, 118, 679, 122, 439, 630, 719, 526]],
    'minp_seed': [[215, 346, 498, 82, 166, 215, 482, 296, 82, 106, 136, 98, 308, 644, 684, 223, 767, 468, 734, 365]],
    'penalties_seed': [[734, 303, 506, 482, 116, 739, 709, 689, 125, 63, 357, 649, 293, 701, 468, 422, 248, 71, 80, 49]],
    'greedy_penalties': [[609, 224, 669, 559, 144, 28, 26, 63, 33, 419, 597, 335, 357, 172, 319, 732]],
    'unseeded_topk': [[366, 374, 756, 144, 250, 529, 311, 303, 284, 68, 573, 171]],
    'topp_only_bans_seed': [[82, 677, 754, 82, 521, 140, 564, 354, 111, 754, 82, 284, 287, 210]],
    'n3_seed': [[548, 109, 9, 372, 69, 225, 163, 537, 163, 348], [548, 267, 308, 611, 502, 308, 217, 69, 424, 542], [548, 109, 537, 391, 562, 612, 246, 644, 446, 436]],
}


def engine(path, **kw) -> AREngine:
    kw.setdefault("block_size", 8)
    return AREngine(path, EngineConfig(device="cpu", dtype="float32", **kw), loader=load_causal_lm)


def run(eng: AREngine, items) -> dict[str, list[list[int]]]:
    for name, prompt, sp in items:
        eng.add_request(name, prompt, sp)
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.output.outputs]
    return done


@pytest.fixture(scope="module")
def mixed(tiny_models):
    eng = engine(tiny_models["qwen2"], max_num_batched_tokens=16)
    return run(eng, [(name, PROMPTS[i], sp) for i, (name, sp) in enumerate(CONFIGS.items())])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_mixed_batch_tokens_are_pinned(name, mixed):
    assert mixed[name] == EXPECTED[name]


@pytest.mark.parametrize("name", [n for n, sp in CONFIGS.items() if sp.seed is not None])
def test_seeded_alone_equals_pinned(name, tiny_models):
    i = list(CONFIGS).index(name)
    assert run(engine(tiny_models["qwen2"]), [(name, PROMPTS[i], CONFIGS[name])])[name] == EXPECTED[name]
