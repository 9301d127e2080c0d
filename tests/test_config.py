"""`EngineConfig.resolve_dtype`: what `dtype="auto"` runs a checkpoint in."""

import pytest
import torch

from omnistage import config
from omnistage.config import EngineConfig

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_on_cpu_uses_bfloat16_only_where_the_cpu_computes_in_it(monkeypatch, native):
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: native)
    auto = EngineConfig()
    half = torch.bfloat16 if native else torch.float32
    assert auto.resolve_dtype(torch.bfloat16, CPU) == half and auto.resolve_dtype(torch.float16, CPU) == half
    assert auto.resolve_dtype(torch.float32, CPU) == torch.float32 and auto.resolve_dtype(None, CPU) == torch.float32
    assert auto.resolve_dtype(torch.bfloat16, CUDA) == torch.bfloat16   # a GPU keeps the checkpoint's dtype
    assert EngineConfig(dtype="bfloat16").resolve_dtype(torch.float32, CPU) == torch.bfloat16   # asked for: kept


def test_cpu_flags_are_read():
    assert isinstance(config.cpu_has_native_bf16(), bool)
