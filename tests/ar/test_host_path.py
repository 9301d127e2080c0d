"""The AR engine's lean host path (ar/engine.py, ar/runner.py) changes no output. Tiny random
Llama, CPU, fp32.

* Rows that sample greedily with nothing else take the argmax of their logits without building a
  `SamplingBatch` (on CUDA the decode graph's own argmax, `ar/cuda_graphs.py`; on the CPU the same
  op eagerly); a batch where any row needs more (penalties, logprobs, stop strings...) samples all
  rows through `sampler.sample`. Greedy ids are the same either way, and equal transformers'.
* `output_kind="final_only"` requests get one output, at the end, whose text is decoded once (no
  stop string) or incrementally (stop strings): identical to the last of the streamed outputs.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from omnistage.ar import runner as runner_mod
from omnistage.ar.engine import AREngine
from omnistage.config import EngineConfig
from omnistage.models.loader import load_causal_lm
from omnistage.params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = ["Hello", "café naïve 日本語", "One two three four five six seven"]
OTHERS = {                                      # rows that need the sampler's full path
    "logprobs": ("The harbour town", SamplingParams(max_tokens=8, temperature=0, logprobs=2, ignore_eos=True)),
    "penalty": ("Rain again", SamplingParams(max_tokens=8, temperature=0, repetition_penalty=1.3, ignore_eos=True)),
    "stop": ("Once upon a time", SamplingParams(max_tokens=10, temperature=0.8, seed=3, stop=["e"])),
    "banned": ("Numbers:", SamplingParams(max_tokens=6, min_tokens=4, temperature=0)),
}


def _run(path, requests: dict, **cfg) -> tuple[dict, dict[str, list]]:
    """(request id -> finished output, request id -> every output it got), stepping until done."""
    engine = AREngine(path, EngineConfig(device="cpu", dtype="float32", block_size=8, **cfg), loader=load_causal_lm)
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    final, seen = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None
            seen.setdefault(out.request_id, []).append(out.output)
            if out.finished:
                final[out.request_id] = out.output
    return final, seen


def _summary(out, values: bool = True) -> list:
    """What a user sees of an output; `values=False` leaves out the logprob values (a float that
    depends on the batch's shape, like every matmul's)."""
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason,
             None if c.logprobs is None else [(t.chosen.token_id, t.chosen.decoded, [x.token_id for x in t.top])
                                              + ((t.chosen.logprob, [x.logprob for x in t.top]) if values else ())
                                              for t in c.logprobs])
            for c in out.outputs]


def _logprob_values(out) -> list[float]:
    return [v for c in out.outputs for t in c.logprobs or () for v in [t.chosen.logprob] + [x.logprob for x in t.top]]


@pytest.fixture
def sample_calls(monkeypatch):
    """How often the runner called the full sampler (a counter around the real function)."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    real = runner_mod.sample
    monkeypatch.setattr(runner_mod, "sample", counted)
    return calls


def test_greedy_rows_mixed_with_full_path_rows_change_no_ids(tiny_models, sample_calls):
    path = tiny_models["llama"]
    greedy = {f"g{i}": (p, GREEDY) for i, p in enumerate(PROMPTS)}
    alone, _ = _run(path, greedy)
    assert not sample_calls                     # every step took the argmax path
    mixed, _ = _run(path, {**greedy, **OTHERS})
    assert sample_calls                         # steps with the other rows sampled the whole batch
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for rid in greedy:
        ids = alone[rid].prompt_token_ids
        want = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
        assert alone[rid].outputs[0].token_ids == want
        assert _summary(mixed[rid]) == _summary(alone[rid])
    for rid, req in OTHERS.items():             # each as it is alone: every one of its steps on the full path
        solo, _ = _run(path, {rid: req})
        assert _summary(mixed[rid], values=False) == _summary(solo[rid], values=False), rid
        assert _logprob_values(mixed[rid]) == pytest.approx(_logprob_values(solo[rid]), abs=1e-4)


def test_final_only_outputs_equal_the_last_streamed_one(tiny_models):
    requests = {
        "greedy": ("café naïve 日本語", SamplingParams(max_tokens=24, temperature=0)),
        "sampled": ("The harbour town", SamplingParams(max_tokens=20, temperature=1.0, seed=5, n=2)),
        "stop": ("Once upon a time", SamplingParams(max_tokens=30, temperature=0.8, seed=3, stop=["e", "th"])),
        "stop_id": ("Numbers:", SamplingParams(max_tokens=16, min_tokens=2, temperature=0.9, seed=1,
                                               stop_token_ids=[40, 41, 42, 43, 44, 45])),
        "logprobs": ("Rain again", SamplingParams(max_tokens=6, temperature=0, logprobs=1, skip_special_tokens=False)),
    }
    path = tiny_models["llama"]
    streamed, seen = _run(path, requests)
    final_only = {rid: (p, sp.clone(output_kind="final_only")) for rid, (p, sp) in requests.items()}
    final, seen_final = _run(path, final_only)
    for rid in requests:
        assert _summary(final[rid]) == _summary(streamed[rid]), rid
        assert len(seen_final[rid]) == 1        # only the finished output was built
        texts = [o.outputs[0].text for o in seen[rid]]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))   # streamed text only grows
    assert any(len(seen[rid]) > 2 for rid in requests)


def test_output_kind_is_checked():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")


def test_graph_inputs_pad_a_decode_batch():
    """The host rows a decode graph's static buffers get (`cuda_graphs.graph_inputs`, numpy, runs on
    any machine), against the same batch padded by hand. The context lengths are the step's, not
    position + 1: the second row is an M-RoPE sequence whose rope position (3) runs behind its 9 tokens."""
    import numpy as np

    from omnistage.ar.cuda_graphs import graph_inputs

    ids, pos, slots, tables = [5, 6, 7], [10, 3, 40], [81, 19, 320], [[2, 9], [1], [4, 8, 12]]
    buf = np.full(4 * (4 + 3), -7, dtype=np.int64)
    graph_inputs(buf, 4, 999, ids, pos, slots, tables, [11, 9, 41])
    assert buf[:16].reshape(4, 4).tolist() == [[5, 6, 7, 0], [10, 3, 40, 0], [81, 19, 320, 999], [11, 9, 41, 1]]
    assert buf[16:].reshape(4, 3).tolist() == [[2, 9, 0], [1, 0, 0], [4, 8, 12], [0, 0, 0]]


def test_penalties_from_the_device_counts_equal_the_per_row_formula():
    """`sampler._apply_penalties` (from the rows' device-side token counts: uploaded in one copy, each
    table landing in one scatter) against the formula applied row by row: repetition over prompt +
    output ids, presence / frequency over output ids; rows without penalties untouched; a PLACEHOLDER
    ending a row's output (async scheduling) reads that row's queued id from the device."""
    import torch
    from penalty_testutil import counts_of, penalized

    from omnistage.ar.sampler import SamplingBatch, _apply_penalties
    from omnistage.ar.sequence import PLACEHOLDER
    from omnistage.params import SamplingParams

    torch.manual_seed(0)
    v = 11
    logits = torch.randn(4, v)
    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5), SamplingParams(),
              SamplingParams(repetition_penalty=0.8, presence_penalty=0.7), SamplingParams(frequency_penalty=0.2)]
    prompts = [[1, 2, 2], [3], [4, 5], [6]]
    outputs = [[2, 7, PLACEHOLDER], [8], [], [9, 9, 10, PLACEHOLDER]]
    pending = torch.tensor([7, 0, 0, 3])
    batch = SamplingBatch(params, [None] * 4, token_counts=counts_of(params, prompts, outputs, v, pending))
    got = _apply_penalties(logits.clone(), batch)
    assert torch.allclose(got, penalized(logits, params, prompts, outputs, pending), atol=1e-6)
