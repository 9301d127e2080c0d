"""`omnistage bench` run as a subprocess against the real server on loopback (a tiny random Llama on
CPU with the Piper voice behind it, and the tiny diffusion servers), and `--offline` through AsyncOmni:
the table it prints and the JSON it writes (numbers present, counts right, no failures)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "omnistage.entrypoints.cli", "bench", "--disable-tqdm", *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def _run(tmp_path, name: str, *args: str) -> tuple[str, dict]:
    out = tmp_path / f"{name}.json"
    proc = _bench(*args, "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, json.loads(out.read_text())


def _check_text_run(table: str, summary: dict, n: int, out_len: int) -> None:
    assert summary["completed"] == n and summary["failed"] == 0 and summary["errors"] == []
    assert summary["total_output_tokens"] == n * out_len and summary["total_input_tokens"] > 0
    assert summary["output_throughput"] > 0 and summary["request_throughput"] > 0
    for stem in ("ttft", "tpot", "itl", "e2el"):
        values = [summary[f"{k}_{stem}_ms"] for k in ("mean", "median", "p90", "p99")]
        assert all(v > 0 for v in values), stem
        assert summary[f"median_{stem}_ms"] <= summary[f"p99_{stem}_ms"]
    for label in ("Successful requests:", "Output token throughput (tok/s):", "TTFT", "ITL", "TPOT", "E2EL"):
        assert label in table


def test_bench_chat_against_the_server(text_server, tmp_path):
    table, summary = _run(tmp_path, "chat", "--base-url", text_server.url, "--task", "chat", "--num-prompts", "6",
                          "--max-concurrency", "3", "--random-input-len", "12", "--random-output-len", "6",
                          "--ignore-eos", "--save-detailed")
    _check_text_run(table, summary, 6, 6)
    assert summary["config"]["model"] == text_server.name and summary["config"]["max_concurrency"] == 3
    assert len(summary["requests"]) == 6 and all(len(r["itl"]) >= 1 for r in summary["requests"])


def test_bench_completions_poisson_from_a_dataset(text_server, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p}) for p in ("The harbour town", "A river ran", "Once")))
    table, summary = _run(tmp_path, "cmpl", "--base-url", text_server.url + "/v1", "--backend", "openai",
                          "--num-prompts", "5", "--request-rate", "20", "--dataset-path", str(data),
                          "--random-output-len", "5", "--ignore-eos")
    _check_text_run(table, summary, 5, 5)
    assert summary["config"]["task"] == "completions" and summary["config"]["request_rate"] == 20.0


def test_bench_speech_reports_ttfp_and_rtf(text_server, tmp_path):
    pytest.importorskip("piper")
    if text_server.engine.speech_stage is None:
        pytest.skip("no speech stage")
    table, summary = _run(tmp_path, "speech", "--base-url", text_server.url, "--task", "speech", "--num-prompts",
                          "2", "--random-input-len", "8", "--voice", "joe", "--audio-format", "mp3")
    assert summary["completed"] == 2 and summary["failed"] == 0
    assert summary["total_audio_seconds"] > 1.0              # 8 words of English, twice
    assert 0 < summary["mean_ttfp_ms"] <= summary["mean_e2el_ms"] and summary["mean_rtf"] > 0
    assert "TTFP" in table and "RTF" in table


def test_bench_offline_on_a_tiny_llm(tiny_models, tmp_path, capsys):
    """In this process (torch is loaded already): `omnistage`'s own `main`, as the console script runs it."""
    from omnistage.entrypoints.cli import main

    out = tmp_path / "offline.json"
    assert main(["bench", "--disable-tqdm", "--offline", "--model", tiny_models["llama"], "--device", "cpu",
                 "--dtype", "float32", "--task", "chat", "--num-prompts", "4", "--max-concurrency", "2",
                 "--random-input-len", "10", "--random-output-len", "5", "--ignore-eos", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    _check_text_run(table, json.loads(out.read_text()), 4, 5)
    assert "offline (AsyncOmni)" in table


def test_bench_bad_options_name_the_option():
    proc = _bench("--request-rate", "0", timeout=60)
    assert proc.returncode != 0 and "--request-rate must be > 0" in proc.stderr
    proc = _bench("--task", "images", "--size", "big", timeout=60)
    assert proc.returncode != 0 and "--size must be WIDTHxHEIGHT" in proc.stderr
    proc = _bench("--base-url", "http://127.0.0.1:1", timeout=60)     # nothing listens there
    assert proc.returncode != 0 and "is the server up?" in proc.stderr


def test_bench_images_and_videos(image_server, video_server, tmp_path):
    table, summary = _run(tmp_path, "images", "--base-url", image_server.url, "--task", "images", "--num-prompts",
                          "2", "--random-input-len", "4", "--size", "64x64", "--num-inference-steps", "2")
    assert summary["completed"] == 2 and summary["failed"] == 0 and summary["mean_e2el_ms"] > 0
    assert "E2EL" in table
    table, summary = _run(tmp_path, "videos", "--base-url", video_server.url, "--task", "videos", "--num-prompts",
                          "2", "--random-input-len", "4", "--size", "32x32", "--num-frames", "5",
                          "--num-inference-steps", "3", "--poll-interval", "0.05", "--save-detailed")
    assert summary["completed"] == 2 and summary["failed"] == 0 and summary["mean_queue_ms"] >= 0
    for req in summary["requests"]:
        assert req["output_bytes"] > 0 and req["progress"][-1][1] == 100.0
