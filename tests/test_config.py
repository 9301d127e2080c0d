"""`EngineConfig.resolved`: the device and dtype a stage runs in, `dtype="auto"` per kind."""

import json

import pytest
import torch

from omnistage import config
from omnistage.config import EngineConfig, checkpoint_dtype

CPU, CUDA = "cpu", "cuda:0"


def ar_dtype(checkpoint, device, dtype="auto") -> torch.dtype:
    """What an AR stage whose checkpoint stores `checkpoint` runs in on `device`."""
    return EngineConfig(device=device, dtype=dtype).resolved("ar", checkpoint).torch_dtype()


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_on_cpu_uses_bfloat16_only_where_the_cpu_computes_in_it(monkeypatch, native):
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: native)
    half = torch.bfloat16 if native else torch.float32
    assert ar_dtype("bfloat16", CPU) == half and ar_dtype("float16", CPU) == half
    assert ar_dtype("float32", CPU) == torch.float32 and ar_dtype(None, CPU) == torch.float32
    assert ar_dtype("bfloat16", CUDA) == torch.bfloat16   # a GPU keeps the checkpoint's dtype
    assert ar_dtype("float32", CPU, dtype="bfloat16") == torch.bfloat16   # asked for: kept


def test_cpu_flags_are_read():
    assert isinstance(config.cpu_has_native_bf16(), bool)


def test_diffusion_and_codec_auto_dtypes_ignore_the_checkpoint():
    def dtype(kind, device, asked="auto"):
        return EngineConfig(device=device, dtype=asked).resolved(kind, "float16").dtype

    assert (dtype("diffusion", CPU), dtype("diffusion", CUDA)) == ("float32", "bfloat16")
    assert (dtype("codec", CPU), dtype("codec", CUDA)) == ("float32", "float32")
    assert dtype("diffusion", CUDA, "float16") == "float16" and dtype("codec", CPU, "bfloat16") == "bfloat16"


@pytest.mark.parametrize("cuda", [True, False])
def test_devices_become_concrete_and_resolving_twice_changes_nothing(monkeypatch, cuda):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    auto = EngineConfig(max_num_seqs=4)
    assert auto.resolved().device == ("cuda:0" if cuda else "cpu") and auto.resolved().dtype == "auto"
    assert EngineConfig(device="cuda").resolved().device == "cuda:0"
    assert EngineConfig(device="cuda:1").resolved().device == "cuda:1"
    assert auto.torch_device() == torch.device("cuda:0" if cuda else "cpu")
    for kind in ("ar", "diffusion", "codec"):
        once = auto.resolved(kind, "bfloat16")
        assert once.resolved(kind, "float16") == once and once.max_num_seqs == 4
        assert once.resolved(kind) == once
    assert auto == EngineConfig(max_num_seqs=4)         # a copy: the config given is unchanged


def test_bad_values_name_the_field_and_the_allowed_values():
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16, float16; got 'fp16'"):
        EngineConfig(dtype="fp16")
    with pytest.raises(ValueError, match="kind must be one of ar, diffusion, codec; got 'gan'"):
        EngineConfig(device="cpu").resolved("gan")
    with pytest.raises(ValueError, match="checkpoint_dtype must be one of float32, bfloat16, float16"):
        EngineConfig(device="cpu").resolved("ar", "float64")
    with pytest.raises(ValueError, match="dtype is 'auto'"):
        EngineConfig(device="cpu").torch_dtype()
    with pytest.raises(ValueError, match="memory.weights_dtype must be one of float32, bfloat16, float16"):
        config.dtype_by_name("int8", "memory.weights_dtype")


def test_checkpoint_dtype_reads_config_json(tmp_path):
    assert checkpoint_dtype(str(tmp_path)) is None
    for key, name, expected in (("torch_dtype", "bfloat16", "bfloat16"), ("dtype", "float16", "float16"),
                                ("dtype", "float64", None)):
        (tmp_path / "config.json").write_text(json.dumps({key: name}))
        assert checkpoint_dtype(str(tmp_path)) == expected
