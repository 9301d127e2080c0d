"""benchmarks/edge_host_bench.py runs on the tiny checkpoint (CPU): every talker code is its own
piece on the talker -> code2wav edge (chunk_size 1), both edges report host time, and the torch-call
count sees the thinker -> talker edge's tensor work and none on the codec edge's decode pieces."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_edge_host_bench_smoke(omni_dir, capsys):
    spec = importlib.util.spec_from_file_location("edge_host_bench", os.path.join(ROOT, "benchmarks", "edge_host_bench.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    [run] = bench.main(["--model", omni_dir, "--levels", "2", "--tokens", "6", "--codes", "12", "--torch-calls"])
    codec, rows = run[("talker", "code2wav")], run[("thinker", "talker")]
    assert codec["pieces"] == 2 * 12 and codec["seconds"] > 0
    assert 2 <= rows["pieces"] <= 2 * 6 and rows["seconds"] > 0
    calls = run["torch_calls"]
    assert calls[("thinker", "talker")] >= 2 and calls[("talker", "code2wav")] < 1
    out = capsys.readouterr().out
    assert "| 2 | talker->code2wav | 24 |" in out and "torch calls per piece" in out
