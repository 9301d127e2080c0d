"""The sampler's top-k path against the full-sort reference, and the device-side penalty counts (CPU)."""

import numpy as np
import pytest
import torch

from omnistage.ar.penalties import TokenCounts
from omnistage.ar.sampler import _top_k_top_p_fast, _top_k_top_p_sorted
from omnistage.ar.sequence import Sequence
from omnistage.params import SamplingParams


def sorted_stable(logits, k, top_p):
    """The full-sort filter with the order of a stable sort (equal logits: lowest index first), which is
    what CUDA's sort of a large vocabulary gives."""
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    v = logits.shape[-1]
    drop = torch.arange(v)[None, :] >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    drop |= probs.cumsum(-1) - probs >= top_p[:, None]
    drop[:, 0] = False
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def rows(s: int, g: torch.Generator):
    k = torch.randint(1, 80, (s,), generator=g)
    k[0] = 1
    top_p = torch.rand(s, generator=g) * 0.9 + 0.1
    top_p[1] = 1.0
    return k, top_p


@pytest.mark.parametrize("vocab", [768, 5000])
def test_top_k_path_equals_full_sort(vocab):
    g = torch.Generator().manual_seed(vocab)
    for trial in range(20):
        logits = torch.randn(16, vocab, generator=g) * (1 + trial % 4)
        k, top_p = rows(16, g)
        fast = _top_k_top_p_fast(logits, k, top_p, int(k.max()))
        assert torch.equal(fast, _top_k_top_p_sorted(logits, k, top_p))
        assert torch.equal(fast, sorted_stable(logits, k, top_p))


def test_top_k_path_takes_equal_logits_at_the_cut_lowest_index_first():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        # bf16-like logits: few distinct values, so equal logits sit at the k-th and top-p cuts
        logits = (torch.randn(16, 3000, generator=g) * 2).to(torch.bfloat16).float().round()
        k, top_p = rows(16, g)
        fast = _top_k_top_p_fast(logits, k, top_p, int(k.max()))
        ref = sorted_stable(logits, k, top_p)
        assert torch.equal(fast, ref)
        assert torch.equal(torch.isfinite(fast).sum(-1), torch.isfinite(_top_k_top_p_sorted(logits, k, top_p)).sum(-1))


def test_penalty_counts_are_incremental_and_rebuilt_when_a_token_was_not_kept():
    vocab = 50
    seqs = [Sequence(f"s{i}", f"s{i}", 0, [1, 2, 3, i], SamplingParams(repetition_penalty=1.2), 0.0) for i in range(3)]
    seqs.insert(1, Sequence("plain", "plain", 0, [4], SamplingParams(), 0.0))
    pen = np.array([True, False, True, True])
    tc = TokenCounts(torch.device("cpu"))

    def step(tokens, keep=True):
        plan = {k: torch.from_numpy(v) for k, v in tc.plan(seqs, pen).items()}
        tc.apply(plan, vocab)
        counts, prompt = tc.gather(plan, True)
        for i, q in enumerate(seqs):
            expect = np.bincount(q.output_token_ids, minlength=vocab) if pen[i] else np.zeros(vocab)
            assert np.array_equal(counts[i].numpy(), expect)
            seen = np.zeros(vocab, bool)
            if pen[i]:
                seen[q.token_ids[:q.prompt_len]] = True
            assert np.array_equal(prompt[i].numpy(), seen)
        tc.add_sampled(plan, torch.tensor(tokens), seqs, pen)
        if keep:
            for q, t in zip(seqs, tokens):
                q.token_ids.append(t)

    step([5, 6, 7, 5])
    step([5, 6, 9, 9])
    step([8, 8, 8, 8], keep=False)          # e.g. the engine dropped the step: rows are rebuilt from the lists
    step([9, 1, 2, 3])
    tc.release("s0")
    seqs[0] = Sequence("new", "new", 0, [7, 7], SamplingParams(frequency_penalty=1.0), 0.0)
    step([1, 1, 1, 1])                      # a new sequence takes the freed row: it starts from zero
    step([2, 2, 2, 2])
