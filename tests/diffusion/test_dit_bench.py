"""`benchmarks/dit_bench.py --smoke`: the GPU benchmark's code paths on tiny CPU shapes.

Checks what the H200 run relies on: our batched forward equals diffusers' separate module calls, the
analytic FLOP formulas equal torch's FlopCounterMode, step batching puts all requests in one forward.
"""

import importlib.util
import json
import os

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "dit_bench.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("dit_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_run(bench, tmp_path, capsys):
    out = tmp_path / "dit.json"
    res = bench.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text())["smoke"] is True
    for key, rows in (("wan", 2), ("flux", 1)):
        r = res[key]
        assert r["rows"] == rows and r["ours_s"] > 0 and r["diffusers_s"] > 0 and r["floor_s"] > 0
        assert r["rel_diff_vs_diffusers"] < 1e-4
        assert r["counted_tflops_row"] == pytest.approx(r["analytic_tflops_row"], rel=1e-6)
    thr = res["throughput"]
    assert thr["batched"]["max_batch_tasks"] == 4 and thr["one_at_a_time"]["max_batch_tasks"] == 1
    assert "| step batching (max_num_seqs=8) |" in capsys.readouterr().out
    for key in ("wan", "flux"):                 # the speed rows ran (eager on CPU), fast paths near eager
        speed = res[key]["speed"]
        assert all("error" not in r for r in speed.values()), speed
        assert speed["ours default"]["rel_err_vs_eager"] < 1e-5
        assert speed["ours + sage"]["rel_err_vs_eager"] < 0.05 and speed["ours + fp8"]["rel_err_vs_eager"] < 0.1
    assert all("error" not in res["offload"][mode] for mode in ("resident", "model", "layerwise"))


def test_flop_formulas_at_real_shapes(bench):
    """Hand-checked totals. FLUX.1-dev at 1024^2: 19 double blocks (image and text tokens each through
    their own 12 D^2 weights), 38 single blocks over all 4608 tokens, attention 4 S^2 D a block: 74 TFLOP.
    Wan2.1-1.3B at 480x832x81 (32760 tokens, 30 blocks): 283 TFLOP."""
    wan = bench.wan_flops(bench.WAN, 21, 60, 104, 512) / 1e12
    flux = bench.flux_flops(bench.FLUX, 4096, 512) / 1e12
    assert wan == pytest.approx(283.0, rel=0.01) and flux == pytest.approx(74.4, rel=0.01)
