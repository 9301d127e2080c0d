"""The embedded default (real SmolLM2-135M-Instruct weights) through our engine, against transformers."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from omnistage import Omni, SamplingParams
from omnistage.models.default_model import default_model_path


@pytest.fixture(scope="module")
def omni():
    with Omni(model=None, device="cpu", dtype="float32") as o:
        yield o


def test_answers_a_factual_question(omni):
    out = omni.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(max_tokens=24, temperature=0))[0].outputs[0]
    assert "Paris" in out.text, out.text
    assert out.finish_reason == "stop"                       # ends with <|im_end|>, not the token cap


def test_greedy_ids_equal_transformers_on_real_weights(omni):
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = ["The three primary colors are", "def fibonacci(n):", "Water boils at"]
    outs = omni.generate(prompts, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = omni.tokenizer.encode(prompt)
        ref = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref, prompt
