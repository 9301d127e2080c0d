"""`benchmarks/step_cache_bench.py --smoke`: the GPU step-cache benchmark's code paths on tiny CPU
shapes -- threshold 0 equals no cache, a threshold skips steps, mixed settings batched equal alone."""

import importlib.util
import os

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "step_cache_bench.py")


def test_smoke_run(capsys):
    spec = importlib.util.spec_from_file_location("step_cache_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    res = bench.main(["--smoke"])
    assert res["tea_cache_threshold0_max_diff"] == 0 and res["cache_dit_threshold0_max_diff"] == 0
    assert res["rows"] and all(r["computed_steps"] + r["cached_steps"] == bench.SMOKE["steps"] for r in res["rows"])
    assert any(r["cached_steps"] > 0 for r in res["rows"])
    assert res["mixed"]["max_batch_tasks"] == 2 and res["mixed"]["cached_steps_equal_alone"]
    assert res["mixed"]["max_pixel_diff_vs_alone"] <= 2
    assert "| no cache |" in capsys.readouterr().out
