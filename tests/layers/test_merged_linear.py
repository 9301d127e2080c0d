"""Merged projections (layers/merged_linear.py) on a diffusers FLUX single block built in code.

The merged block equals the original (q|k|v|MLP-in as one GEMM: one GEMM per call, nothing kept
after it), traces under torch.compile as one graph (fullgraph, "eager" backend: dynamo only, no C++
build), and a group that cannot merge is left as it is.
"""

from __future__ import annotations

import copy

import torch

from omnistage.layers.merged_linear import LinearPart, MergedLinear, merge_linears

GROUP = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")


def _block_and_inputs():
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    torch.manual_seed(0)
    block = FluxSingleTransformerBlock(dim=32, num_attention_heads=2, attention_head_dim=16).eval()
    x, txt, temb = torch.randn(2, 12, 32), torch.randn(2, 4, 32), torch.randn(2, 32)
    rot = (torch.randn(16, 16), torch.randn(16, 16))
    return block, (x, txt, temb, rot)


@torch.no_grad()
def test_merged_block_equals_the_original_and_compiles_as_one_graph():
    block, args = _block_and_inputs()
    ref = block(*args)
    merged = copy.deepcopy(block)
    assert merge_linears(merged, GROUP)
    group = merged.proj_mlp.group
    assert isinstance(group, MergedLinear) and group.proj.out_features == 3 * 32 + 4 * 32
    assert all(isinstance(merged.get_submodule(n), LinearPart) for n in GROUP)
    assert sum(p.numel() for p in merged.parameters()) == sum(p.numel() for p in block.parameters())
    out = merged(*args)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert group.gemms == 1 and group._output is None and group._input is None
    explain = torch._dynamo.explain(merged.forward)(*args)
    assert explain.graph_count == 1 and explain.graph_break_count == 0, explain.break_reasons
    compiled = torch.compile(merged.forward, fullgraph=True, dynamic=True, backend="eager")
    for a, b in zip(compiled(*args), ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert group._output is None and group._left == 0


def test_a_group_that_cannot_merge_stays():
    block, _ = _block_and_inputs()
    assert not merge_linears(block, ("attn.to_q", "attn.no_such_layer"))
    assert not merge_linears(block, ("attn.to_q", "proj_out"))      # proj_out reads 160 features, to_q 32
    assert type(block.attn.to_q) is torch.nn.Linear and type(block.proj_out) is torch.nn.Linear
