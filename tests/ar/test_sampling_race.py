"""The AR sampler's counter-based noise and top-k candidate race (`layers/triton_sampling.py`,
`ar/sampler.py`): the Triton kernels (under Triton's interpreter) equal their PyTorch references bit for
bit, the candidate race draws the same ids as the full-vocabulary path (sort, top-p, min-p, race over
every token) for the same keys, and the draws follow the distribution they sample from."""

import numpy as np
import pytest
import torch

from omnistage.ar.sampler import SamplingBatch, _filter, candidates, sample
from omnistage.layers.triton_sampling import (exp_noise_ref, mix32_ref, race_candidates_ref, row_keys)
from omnistage.params import SamplingParams

KERNEL_CHECK = """
import json, torch
from omnistage.layers.triton_sampling import (exp_noise_ref, launch_noise, launch_race, race_candidates_ref,
                                              row_keys)
g = torch.Generator().manual_seed(0)
s, v, width = 6, 300, 40
keys = torch.from_numpy(row_keys([0, 1, 2 ** 40 + 5, 7, 2 ** 63 + 3, 123456789], [0, 1, 2, 3, 1000, 5]))
noise = launch_noise(keys, v)
ref_noise = exp_noise_ref(keys, torch.arange(v))   # the same integers; log may round differently
noise_ok = bool(((noise - ref_noise).abs() <= 1e-6 * ref_noise.clamp(min=1)).all())
logits = torch.randn(s, v, generator=g) * 2
vals, ids = logits.topk(width, dim=-1)
top_k = torch.tensor([40, 1, 5, 0, 17, 40])
top_p = torch.tensor([1.0, 1.0, 0.9, 0.5, 0.3, 0.05])
min_p = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.0, 0.2])
got = launch_race(vals, ids, top_k, top_p, min_p, keys)
ref = race_candidates_ref(vals, ids, top_k, top_p, min_p, keys)
e = torch.empty(s, width).exponential_(generator=g)          # given noise (the generators' path)
got_e = launch_race(vals, ids, top_k, top_p, min_p, None, e)
ref_e = race_candidates_ref(vals, ids, top_k, top_p, min_p, None, e)
print(json.dumps([noise_ok, got.tolist() + got_e.tolist(), ref.tolist() + ref_e.tolist()]))
"""


def test_noise_and_race_kernels_equal_their_references_in_the_triton_interpreter():
    from interpreted import run_in_interpreter

    noise_ok, got, ref = run_in_interpreter("-c", KERNEL_CHECK)
    assert noise_ok
    assert len(got) == 12 and got == ref


def test_the_mixer_is_the_same_in_numpy_and_torch():
    x = np.array([0, 1, 2 ** 31, 2 ** 32 - 1, 0x12345678, 987654321], dtype=np.int64)
    assert mix32_ref(torch.from_numpy(x)).tolist() == mix32_ref(x).tolist()
    assert all(0 <= v < 2 ** 32 for v in mix32_ref(x).tolist())
    assert len(set(mix32_ref(np.arange(10000, dtype=np.int64)).tolist())) == 10000   # a bijection


def test_keys_depend_on_seed_and_draw():
    keys = row_keys([5, 5, 6, 5 + 2 ** 32], [0, 1, 0, 0])
    assert len(set(keys.tolist())) == 4
    assert row_keys([5], [1]).tolist() == [keys[1]]


def test_noise_is_exponential():
    e = exp_noise_ref(torch.from_numpy(row_keys(list(range(64)), [3] * 64)), torch.arange(4096))
    assert e.min() > 0 and torch.isfinite(e).all()
    assert abs(e.mean().item() - 1) < 0.01 and abs(e.var().item() - 1) < 0.03
    # draws of different rows and tokens are uncorrelated
    assert abs(torch.corrcoef(torch.stack([e[0], e[1]]))[0, 1].item()) < 0.05
    assert abs(torch.corrcoef(torch.stack([e[:, 0], e[:, 1]]))[0, 1].item()) < 0.3


def _full_path(logits, params, keys):
    """The full-vocabulary draw: sort-based top-k / top-p / min-p masks, softmax, race over every token."""
    b = SamplingBatch(params)
    probs = _filter(logits, b).softmax(-1)
    return (probs / exp_noise_ref(keys, torch.arange(logits.shape[1]))).argmax(-1)


@pytest.mark.parametrize("case", range(4))
def test_candidate_race_draws_what_the_full_row_race_draws(case):
    g = torch.Generator().manual_seed(case)
    s, v = 16, 500
    logits = torch.randn(s, v, generator=g) * (1 + case)
    params = [SamplingParams(temperature=0.5 + (i % 4) * 0.3, top_k=[1, 5, 40, 200][(i + case) % 4],
                             top_p=[1.0, 0.9, 0.5, 0.2][i % 4], min_p=[0.0, 0.05][i % 2]) for i in range(s)]
    keys = row_keys(list(range(100 * case, 100 * case + s)), [case] * s)
    width = candidates(params, v)
    assert width == 200
    got = sample(logits.clone(), SamplingBatch(params, keys=keys)).token_ids
    assert got.tolist() == _full_path(logits, params, torch.from_numpy(keys)).tolist()


def _old_path(logits, params, generators):
    """The sampler before the candidate race: full-row filter, per-row generator noise, race."""
    probs = _filter(logits, SamplingBatch(params)).softmax(-1)
    noise = torch.empty_like(probs)
    for i, g in enumerate(generators):
        noise[i].exponential_(generator=g)
    return (probs / noise).argmax(-1)


def test_seeded_generator_rows_draw_the_tokens_they_drew_before():
    """Without keys (the CPU), a seeded row's noise is its generator's V draws in order, as before the
    candidate race: the same tokens for the same seeds (and so the same as transformers' / qwen-tts'
    `torch.multinomial` on the CPU under that seed)."""
    g = torch.Generator().manual_seed(11)
    s, v = 8, 300
    logits = torch.randn(s, v, generator=g) * 2
    params = [SamplingParams(temperature=0.9, top_k=[40, 5, 1, 100][i % 4], top_p=[0.8, 1.0][i % 2], seed=i)
              for i in range(s)]
    for steps in range(3):                     # successive draws advance each generator alike
        gens = [torch.Generator().manual_seed(i * 7 + steps) for i in range(s)]
        old = _old_path(logits, params, gens)
        gens = [torch.Generator().manual_seed(i * 7 + steps) for i in range(s)]
        assert sample(logits.clone(), SamplingBatch(params, gens)).token_ids.tolist() == old.tolist()


def test_multinomial_draws_what_the_generator_race_draws():
    """`torch.multinomial(p, 1)` on the CPU (transformers' sampling) is the race over the generator's draws."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    params = [SamplingParams(temperature=1.0, top_k=50, seed=i) for i in range(4)]
    ours = sample(logits.clone(), SamplingBatch(params, [torch.Generator().manual_seed(i) for i in range(4)]))
    theirs = [torch.multinomial(logits[i].softmax(-1), 1, generator=torch.Generator().manual_seed(i)).item()
              for i in range(4)]
    assert ours.token_ids.tolist() == theirs


def test_rows_without_top_k_race_over_the_full_row():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 64, generator=g)
    params = [SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=0.7, top_k=5),
              SamplingParams(temperature=0)]
    assert candidates(params, 64) == 0
    keys = row_keys([1, 2, 3], [0, 0, 0])
    got = sample(logits.clone(), SamplingBatch(params, keys=keys)).token_ids.tolist()
    full = _full_path(logits, params, torch.from_numpy(keys)).tolist()
    assert got[:2] == full[:2] and got[2] == logits[2].argmax().item()


def test_greedy_rows_in_a_candidate_batch_take_their_argmax():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 100, generator=g)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.9, top_k=10)] * 2
    got = sample(logits.clone(), SamplingBatch(params, keys=row_keys([1, 2, 3, 4], [0] * 4))).token_ids
    assert got[0] == logits[0].argmax() and got[2] == logits[2].argmax()


def test_draws_follow_the_filtered_distribution():
    """Over many keys, each token's frequency matches its probability after temperature, top-k and top-p."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0, -9.0]])
    p = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
    n = 20000
    keys = row_keys(np.arange(n), np.zeros(n))
    ids = race_candidates_ref(*(logits / 0.8).expand(n, -1).topk(5, dim=-1), torch.full((n,), 5),
                              torch.full((n,), 0.9), torch.zeros(n), torch.from_numpy(keys))
    expect = _filter(logits, SamplingBatch([p])).softmax(-1)[0]
    freq = torch.bincount(ids, minlength=8).float() / n
    assert freq[5:].sum() == 0                           # outside top-k / top-p: never drawn
    assert (freq - expect).abs().max() < 0.015, (freq, expect)
