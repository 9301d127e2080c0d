"""A stage process that cannot start fails within its start-up timeout with an error naming the stage
and the last start-up step it reported, and its process is stopped (never a hang). The stage process
here blocks for good before it reports anything -- a `sitecustomize` on its PYTHONPATH sleeps at
interpreter start -- as a real start stuck on a device or a file would. (A FIFO as config.json, the
first version of this test, read as an empty file after other tests had run in the same session.)"""

import os
import time

import pytest

TIMEOUT_S = 8.0                                 # generous: the process first imports torch on a loaded machine


def test_a_stage_stuck_at_start_fails_in_bounded_time_naming_it(tmp_path, monkeypatch):
    from omnistage.config import EngineConfig
    from omnistage.pipeline.stage_client import StageClient
    from omnistage.spec import StageSpec

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import time\ntime.sleep(600)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p))
    spec = StageSpec("code2wav", "codec", str(tmp_path), EngineConfig(device="cpu"), final_output="audio",
                     backend="qwen2_5_omni_code2wav", runner="process")
    start = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        StageClient(spec, start_timeout_s=TIMEOUT_S)
    message = str(e.value)
    assert message.startswith(f"stage 'code2wav' did not start in {TIMEOUT_S:.0f} s (")
    assert message.endswith("; its process was stopped")
    assert "reported no start-up step" in message
    assert time.monotonic() - start < TIMEOUT_S + 15
