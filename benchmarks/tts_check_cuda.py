"""Qwen3-TTS on the GPU: the tiny talker's greedy codes (every codebook) equal qwen-tts' fixtures
with and without CUDA graphs, alone and 8 at once (float32 on cuda; the CUDA path of the AR
runner's frame head and frame rows). Prints one line per check; exits 1 when one differs.

    PYTHONPATH=. python benchmarks/tts_check_cuda.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "..", "tests", "models", "qwen3_tts")
sys.path.insert(0, TESTS)

from tts_testutil import frames_of, params_of, reference, run_all  # noqa: E402

from omnistage.ar.engine import AREngine  # noqa: E402
from omnistage.config import EngineConfig  # noqa: E402
from omnistage.models.qwen3_tts.talker import load_talker  # noqa: E402
from omnistage.testing.qwen3_tts import make_tiny_qwen3_tts  # noqa: E402

GREEDY = ["custom_voice_greedy", "custom_voice_instruct_streaming_text", "voice_design_greedy"]


def main() -> int:
    with open(os.path.join(TESTS, "fixtures", "cases.json"), encoding="utf-8") as f:
        cases = json.load(f)
    root = tempfile.mkdtemp(prefix="tts-check-")
    folders = {v: make_tiny_qwen3_tts(os.path.join(root, v), v) for v in ("custom_voice", "voice_design")}
    bad = 0
    for graphs in (True, False):
        engines = {v: AREngine(f, EngineConfig(device="cuda", dtype="float32", max_model_len=512, cuda_graphs=graphs),
                               loader=load_talker) for v, f in folders.items()}
        for name in GREEDY:
            c = cases[name]
            got = frames_of(run_all(engines[c["variant"]], {name: (c["text"], params_of(c))})[name])
            same = got.shape == reference(name)["codes"].shape and (got == reference(name)["codes"]).all()
            bad += not same
            print(f"cuda_graphs={graphs} {name}: {'equal' if same else 'DIFFERENT'}")
        c = cases["custom_voice_greedy"]
        outs = run_all(engines["custom_voice"], {f"r{i}": (c["text"], params_of(c)) for i in range(8)})
        same = all((frames_of(o) == reference("custom_voice_greedy")["codes"]).all() for o in outs.values())
        bad += not same
        print(f"cuda_graphs={graphs} 8 at once: {'equal' if same else 'DIFFERENT'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
