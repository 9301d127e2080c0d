"""The runner's CUDA paths (pinned staging, table diffs on the device, CUDA-graph static inputs, top-k
against CUDA's sort); skipped without a GPU. The CPU side of the same code is in test_step_inputs.py."""

import pytest
import torch

from omnistage.ar.engine import AREngine
from omnistage.ar.sampler import _top_k_top_p_fast, _top_k_top_p_sorted
from omnistage.config import EngineConfig
from omnistage.models.loader import load_causal_lm

from test_sampling_pins import CONFIGS, PROMPTS, run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_top_k_path_equals_cuda_sort_on_bf16_logits():
    """bf16 logits tie often at the k-th / top-p cut: CUDA's large-vocabulary sort is stable, and the
    top-k path keeps equal logits lowest index first, so both keep the same tokens."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for vocab in (151936, 32000):
        x = (torch.randn(256, vocab, device="cuda", generator=g) * 3).bfloat16().float()
        k = torch.randint(1, 200, (256,), device="cuda", generator=g)
        p = torch.rand(256, device="cuda", generator=g) * 0.5 + 0.5
        assert torch.equal(_top_k_top_p_fast(x, k, p, int(k.max())), _top_k_top_p_sorted(x, k, p))


@pytest.mark.parametrize("max_num_batched_tokens", [16, 4096])
def test_cuda_graphs_equal_eager_and_tables_match_host(tiny_models, max_num_batched_tokens):
    """Seeded / penalised / unseeded configs in one batch: CUDA graphs on == off; a small KV pool forces
    preemption (tables rewritten); the device block tables equal the host mirror afterwards."""
    outs = []
    for graphs in (False, True):
        eng = AREngine(tiny_models["qwen2"], EngineConfig(device="cuda", dtype="float32", block_size=4,
                                                          num_kv_blocks=20, cuda_graphs=graphs, max_num_seqs=8,
                                                          max_num_batched_tokens=max_num_batched_tokens),
                       loader=load_causal_lm)
        outs.append(run(eng, [(name, PROMPTS[i], sp) for i, (name, sp) in enumerate(CONFIGS.items())]))
        rows = eng.runner.rows
        assert torch.equal(rows.dev.cpu(), torch.from_numpy(rows.host))
        assert eng.stats()["num_preemptions"] > 0
    assert outs[0] == outs[1]
