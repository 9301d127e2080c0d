"""`load_format="dummy"`: a tiny Qwen3-Omni folder with no weight file serves chat with text and audio
out over HTTP (the real openai client); a plain LLM folder without weights generates offline; bad values
fail at start-up naming the option."""

from __future__ import annotations

import base64
import io
import os

import pytest

NEW = 4                                         # thinker tokens


@pytest.fixture(scope="module")
def q3_config_only(tmp_path_factory):
    from omnistage.testing.qwen3_omni import make_tiny_qwen3_omni

    path = make_tiny_qwen3_omni(str(tmp_path_factory.mktemp("q3_dummy")), weights=False)
    assert not [f for f in os.listdir(path) if f.endswith(".safetensors")]
    return path


def test_qwen3_omni_serves_text_and_audio_without_weight_files(q3_config_only):
    import openai
    import soundfile as sf
    from live_server import live_server

    from omnistage.entrypoints.async_omni import AsyncOmni
    from omnistage.entrypoints.openai.api_server import build_app

    engine = AsyncOmni(q3_config_only, device="cpu", dtype="float32", load_format="dummy",
                       deploy_config={"stages": {"talker": {"params": {"max_tokens": 6}}}})
    try:
        assert [s.name for s in engine.orchestrator.spec.stages] == ["thinker", "talker", "code2wav"]
        with live_server(build_app(engine, "tiny-q3"), timeout=180) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            reply = client.chat.completions.create(
                model="tiny-q3", messages=[{"role": "user", "content": "hello"}], max_tokens=NEW, temperature=0,
                modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"},
                extra_body={"ignore_eos": True})
            message = reply.choices[0].message
            samples, rate = sf.read(io.BytesIO(base64.b64decode(message.audio.data)), dtype="float32")
            assert reply.usage.completion_tokens == NEW and message.content
            assert rate == 24000 and samples.size >= 1920
    finally:
        engine.close()


def test_plain_llm_generates_without_weight_files(tmp_path):
    from omnistage import Omni
    from omnistage.params import SamplingParams
    from omnistage.testing.llm import make_tiny_lm

    path = make_tiny_lm(str(tmp_path / "lm"), "qwen3")
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            os.remove(os.path.join(path, name))
    with Omni(path, device="cpu", dtype="float32", load_format="dummy") as omni:
        out = omni.generate("hi", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3


def test_dummy_draws_norms_at_one_and_routers_nonzero():
    import torch

    from omnistage.layers.moe import SparseMoeBlock
    from omnistage.models.dummy import DUMMY_STD, init_dummy_

    block = SparseMoeBlock(32, 8, 2, 16, True, 0)
    norm = torch.nn.Module()
    norm.input_layernorm = torch.nn.LayerNorm(32)
    for m in (block, norm):
        torch.nn.init.constant_(next(m.parameters()), float("nan"))
        init_dummy_(m)
    again = init_dummy_(SparseMoeBlock(32, 8, 2, 16, True, 0))
    for (name, p), q in zip(block.named_parameters(), again.parameters()):
        assert torch.equal(p, q), name          # a fixed seed: the same weights at every start
        assert abs(p.std().item() - DUMMY_STD) < 0.005, name
    assert torch.equal(norm.input_layernorm.weight, torch.ones(32))
    assert torch.equal(norm.input_layernorm.bias, torch.zeros(32))


def test_bad_load_format_fails_at_start_up_naming_the_option(q3_config_only, capsys):
    from omnistage import Omni
    from omnistage.entrypoints.cli import build_parser

    with pytest.raises(ValueError, match="load_format must be one of auto, dummy; got 'zeros'"):
        Omni(q3_config_only, device="cpu", load_format="zeros")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", q3_config_only, "--load-format", "zeros"])
    err = capsys.readouterr().err
    assert "--load-format" in err and "'auto'" in err and "'dummy'" in err
