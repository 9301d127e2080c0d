"""`ARPrompt.layer_embeds` (rows added after the first decoder layers, Qwen3-Omni's deepstack): checked
at the engine's door, and handed to the model chunk by chunk for exactly the prompt rows prefilled."""

import pytest
import torch

from omnistage.ar.conditioning import Conditioning
from omnistage.params import ParamError
from omnistage.stage import ARPrompt


def _cond(layers):
    prompt = ARPrompt(prompt_token_ids=list(range(6)), layer_embeds=layers)
    return Conditioning.of(prompt, 6, 4, False, torch.device("cpu"), torch.float32)


def test_bad_shape_names_the_field():
    with pytest.raises(ParamError, match=r"layer_embeds must be \[layers, 6, 4\]"):
        _cond(torch.zeros(2, 5, 4))


def test_fill_layers_gives_the_chunk_rows_and_zeros_past_the_prompt():
    layers = torch.arange(2 * 6 * 4, dtype=torch.float32).view(2, 6, 4)
    cond = _cond(layers)
    assert cond is not None and not cond.cacheable and cond.needs_embeds
    adds = torch.zeros(3, 5, 4)                  # positions 4..8: two prompt rows, then generated ones
    cond.fill_layers(adds, 4)
    assert torch.equal(adds[:2, :2], layers[:, 4:6])
    assert not adds[:2, 2:].any() and not adds[2].any()
    later = torch.zeros(2, 3, 4)
    cond.fill_layers(later, 6)
    assert not later.any()
