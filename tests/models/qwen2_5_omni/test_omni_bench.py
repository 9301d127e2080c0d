"""benchmarks/omni_bench.py --tiny runs end to end on the tiny checkpoints (CPU): Qwen2.5-Omni with
transformers included, Qwen3-Omni (the shared stage layout; the process layout is the same code with
other deploy settings), each with its time-to-first-audio breakdown by stage."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_omni_bench_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("omni_bench", os.path.join(ROOT, "benchmarks", "omni_bench.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    res = bench.main(["--tiny", "--work", str(tmp_path), "--levels", "1,2", "--talker-codes", "26", "--layouts", "shared",
                      "--stage-devices", "thinker=cpu,talker=cpu,code2wav=cpu"])
    assert [r["concurrency"] for r in res["ours"]] == [1, 2] and len(res["hf"]) == 1
    for r in res["ours"] + res["hf"]:
        assert abs(r["audio_s_per_request"] - 26 * 480 / 24000) < 1e-9
        assert 0 < r["ttfa_mean_s"] <= r["ttfa_p90_s"] <= r["ttfa_max_s"] and 0 < r["rtf_mean"] <= r["rtf_max"]
        assert r["underruns"] >= 0 and r["underrun_s"] >= 0
    assert list(res["layouts"]) == ["shared"]
    assert {name: stage["device"] for name, stage in res["deploy_configs"]["shared"]["stages"].items()} == \
        {"thinker": "cpu", "talker": "cpu", "code2wav": "cpu"}     # --stage-devices reaches the deploy config
    out = capsys.readouterr().out
    assert "| omnistage AsyncOmni streaming, shared, 2 |" in out
    for r in res["ours"]:
        _check_breakdown(r, ["thinker", "talker", "code2wav"])
    assert "| shared, 2 streams |" in out


def _check_breakdown(r: dict, stages: list[str]) -> None:
    """Every stage's first output and every edge's first piece come after the arrival, in pipeline
    order, and the caller's first audio after code2wav's first chunk, at most the measured TTFA."""
    marks = r["ttfa_breakdown_mean_s"]
    names = [f"first {stages[0]}"]
    for src, dst in zip(stages, stages[1:]):
        names += [f"first {src}->{dst}", f"first {dst}"]
    names.append("first audio at caller")
    assert list(marks) == names, marks
    times = list(marks.values())
    assert 0 < times[0] and times == sorted(times) and times[-1] <= r["ttfa_max_s"] + 1e-3


def test_omni_bench_qwen3_omni_tiny(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("omni_bench", os.path.join(ROOT, "benchmarks", "omni_bench.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    res = bench.main(["--model", "qwen3-omni", "--tiny", "--work", str(tmp_path), "--levels", "1",
                      "--layouts", "shared"])
    (r,) = res["ours"]
    assert r["concurrency"] == 1 and r["audio_s_per_request"] > 0 and r["underruns"] >= 0
    _check_breakdown(r, ["thinker", "talker", "code2wav"])
    assert "| shared, 1 streams |" in capsys.readouterr().out


def test_underruns_count_a_listener_running_dry():
    spec = importlib.util.spec_from_file_location("omni_bench", os.path.join(ROOT, "benchmarks", "omni_bench.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    second = bench.SAMPLE_RATE                  # one second of audio per piece
    assert bench.underruns([(0.0, second), (0.5, second), (1.9, second)]) == (0, 0.0)   # always ahead
    count, dry = bench.underruns([(0.0, second), (1.5, second), (2.5, second), (4.0, second)])
    assert count == 2 and abs(dry - 1.0) < 1e-9  # dry 1.0-1.5 and 3.5-4.0
