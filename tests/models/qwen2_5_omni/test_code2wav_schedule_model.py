"""benchmarks/code2wav_schedule_model.py drives the real code2wav window and first-chunk code on a fake
clock: every stream's audio arrives whole (500 codes = 10 s, chunk by chunk), larger first chunks mean
fewer batches and a later first audio, and the rule's row is the rule's size."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_schedule_model_runs_the_real_windows():
    spec = importlib.util.spec_from_file_location("sched", os.path.join(ROOT, "benchmarks", "code2wav_schedule_model.py"))
    model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model)
    small, big = model.run(8, 3.1e-3, 1.5, 12), model.run(8, 3.1e-3, 1.5, 48)
    assert small["batches"] > big["batches"] and small["ttfa"] < big["ttfa"]
    assert model.run(8, 3.1e-3, 1.5)["first_codes"] == 24 and model.run(2, 3.1e-3, 1.5)["first_codes"] == 12
    assert 0 < small["rtf"] < 1
