"""A stage process that cannot start fails within its start-up timeout with an error naming the stage
and the last start-up step it reported, and its process is stopped (never a hang). The stage here is
code2wav over a folder whose config.json is a FIFO nobody writes: its build blocks for good, as a
real load stuck on a device or a file would."""

import os
import time

import pytest

TIMEOUT_S = 8.0                                 # generous: the process first imports torch on a loaded machine


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs a FIFO")
def test_a_stage_stuck_at_start_fails_in_bounded_time_naming_it(tmp_path):
    from omnistage.config import EngineConfig
    from omnistage.pipeline.stage_client import StageClient
    from omnistage.spec import StageSpec

    os.mkfifo(tmp_path / "config.json")
    spec = StageSpec("code2wav", "codec", str(tmp_path), EngineConfig(device="cpu"), final_output="audio",
                     backend="qwen2_5_omni_code2wav", runner="process")
    start = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        StageClient(spec, start_timeout_s=TIMEOUT_S)
    message = str(e.value)
    assert message.startswith(f"stage 'code2wav' did not start in {TIMEOUT_S:.0f} s (")
    assert message.endswith("; its process was stopped")
    assert "building the codec engine on cpu" in message or "reported no start-up step" in message
    assert time.monotonic() - start < TIMEOUT_S + 15
