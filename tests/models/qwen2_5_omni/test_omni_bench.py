"""benchmarks/omni_bench.py --smoke runs end to end on the tiny checkpoint (CPU), transformers included."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_omni_bench_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("omni_bench", os.path.join(ROOT, "benchmarks", "omni_bench.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    res = bench.main(["--smoke", "--work", str(tmp_path), "--levels", "1,2", "--talker-codes", "26"])
    assert [r["concurrency"] for r in res["ours"]] == [1, 2] and len(res["hf"]) == 1
    for r in res["ours"] + res["hf"]:
        assert abs(r["audio_s_per_request"] - 26 * 480 / 24000) < 1e-9
        assert 0 < r["ttfa_mean_s"] <= r["ttfa_max_s"] and r["rtf_mean"] > 0
    assert "| omnistage AsyncOmni, streaming, 2 |" in capsys.readouterr().out
