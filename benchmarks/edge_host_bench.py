"""Host cost of Qwen2.5-Omni's stage-to-stage edges, on the CPU (no GPU needed).

The tiny Qwen2.5-Omni (`omnistage.testing.qwen2_5_omni`) runs N concurrent chat requests through
`Omni` (thinker -> talker -> code2wav, one thread, as the shared layout steps them), each with
THINKER_TOKENS text tokens (EOS ignored) and TALKER_CODES codec ids (stop codes banned): the piece
counts of `benchmarks/omni_bench.py`'s round (64 tokens, 500 codes; both edges have chunk_size 1, so
every thinker step hands each request its new hidden-state rows and every talker step its new code).
The orchestrator's edge totals (`edge:<src>-><dst>:seconds` / `:pieces`: the adapter call, the slice
and the hand-over to the downstream stage) are read around the round, in the engine thread's CPU
time (`time.thread_time`; `--wall` for wall time, what `Orchestrator.stats` reports), so other work
on a shared machine counts less. The tiny models' tensors are small: on the CPU a torch op costs
about what its launch costs on a GPU, so the numbers are the host's share of the edges. Prints host
microseconds per piece and milliseconds per request per round for each edge and level; checks
nothing (the tests compare outputs).

    PYTHONPATH=$PWD python benchmarks/edge_host_bench.py [--levels 1,8,32] [--tokens 64] [--codes 500] [--profile 20] [--torch-calls]

"Before": the same script with PYTHONPATH set to an older checkout (`git archive <commit> | tar -x -C DIR`).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import tempfile
import time
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

EDGES = (("thinker", "talker"), ("talker", "code2wav"))
MESSAGES = [{"role": "user", "content": "Tell me a story."}]


def stage_params(tokens: int, codes: int) -> list:
    """The thinker's, talker's and code2wav's params of one request (seeded: every run the same)."""
    from omnistage.models.qwen2_5_omni.code2wav import Code2WavParams
    from omnistage.params import SamplingParams
    from omnistage.testing.qwen2_5_omni import CODEC_BOS, CODEC_EOS, CODEC_PAD

    thinker = SamplingParams(max_tokens=tokens, temperature=0.7, ignore_eos=True, seed=0)
    talker = SamplingParams(max_tokens=codes, temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05,
                            bad_token_ids=[CODEC_PAD, CODEC_BOS, CODEC_EOS], seed=0)
    return [thinker, talker, Code2WavParams(seed=0)]


def run_level(omni, prompt: dict, n: int, tokens: int, codes: int,
              profile: "cProfile.Profile | None" = None) -> dict:
    """One round of n requests; per edge: host seconds and pieces handed over during it."""
    totals = omni.orchestrator.edge_totals
    before = {k: list(totals[k]) for k in EDGES}
    params = stage_params(tokens, codes)
    if profile is not None:
        profile.enable()
    outs = omni.generate([prompt] * n, params[0], sampling_params_list=params, use_tqdm=False)
    if profile is not None:
        profile.disable()
    assert all(o.audio is not None and o.audio.samples.size for o in outs)
    res = {"n": n}
    for key in EDGES:
        seconds, pieces = totals[key][0] - before[key][0], totals[key][2] - before[key][2]
        res[key] = {"seconds": seconds, "pieces": pieces}
    return res


def count_torch_calls(orch) -> dict:
    """Counts the torch calls (ops, tensor methods; not attribute reads) the edges make from now on,
    per edge: on a GPU each op is a launch, or at least a trip through the dispatcher, on the thread
    that launches every shared stage's steps. Wraps the orchestrator's `_forward` and the downstream
    stages' `add_input` / `add_inputs` of this object (the hand-over, wherever it happens)."""
    from torch.overrides import TorchFunctionMode

    counts = {key: 0 for key in EDGES}
    current: list = [None]                      # the edge whose work runs now

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") != "__get__":
                counts[current[0]] += 1
            return func(*args, **(kwargs or {}))

    def wrap(fn, key_of):
        def counted(*args, **kwargs):
            if current[0] is not None:          # inside an edge's work already
                return fn(*args, **kwargs)
            current[0] = key_of(*args)
            try:
                with Mode():
                    return fn(*args, **kwargs)
            finally:
                current[0] = None
        return counted

    orch._forward = wrap(orch._forward, lambda edge, *rest: (edge.src, edge.dst))
    for key in EDGES:
        stage = orch.stages[key[1]]
        for name in ("add_input", "add_inputs"):
            if hasattr(stage, name):
                setattr(stage, name, wrap(getattr(stage, name), lambda *args, key=key: key))
    return counts


def table(runs: list[dict], clock: str) -> str:
    rows = [f"| streams | edge | pieces per round | host us per piece ({clock}) | host ms per request per round |",
            "|---|---|---|---|---|"]
    for r in runs:
        for src, dst in EDGES:
            e = r[(src, dst)]
            per_piece = e["seconds"] / e["pieces"] * 1e6 if e["pieces"] else float("nan")
            rows.append(f"| {r['n']} | {src}->{dst} | {e['pieces']} | {per_piece:.1f} | "
                        f"{e['seconds'] / r['n'] * 1e3:.2f} |")
    return "\n".join(rows)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--levels", default="1,8,32", help="concurrent requests per round, comma-separated")
    ap.add_argument("--tokens", type=int, default=64, help="thinker tokens per request")
    ap.add_argument("--codes", type=int, default=500, help="talker codes per request")
    ap.add_argument("--wall", action="store_true", help="wall time (perf_counter) instead of thread CPU time")
    ap.add_argument("--profile", type=int, default=0,
                    help="profile one more round of the last level: its edge calls and top N entries by own time")
    ap.add_argument("--torch-calls", action="store_true",
                    help="one more round of the last level, counting the edges' torch calls per piece")
    ap.add_argument("--work", default=None, help="folder for the tiny checkpoint (default: a temporary one)")
    ap.add_argument("--model", default=None, help="a tiny Qwen2.5-Omni folder to use instead of building one")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)                    # tiny kernels: one thread (as the tests run them)

    from omnistage import Omni
    from omnistage.pipeline import orchestrator
    from omnistage.testing.qwen2_5_omni import make_tiny_qwen2_5_omni

    if not args.wall:                           # the orchestrator's edge timer, in this thread's CPU time
        orchestrator.time = types.SimpleNamespace(perf_counter=time.thread_time, time=time.time)
    path = args.model
    if path is None:
        path = os.path.join(args.work or tempfile.mkdtemp(prefix="edge_host_bench_"), "tiny-qwen2_5_omni")
        if not os.path.exists(os.path.join(path, "config.json")):
            make_tiny_qwen2_5_omni(path)
    levels = [int(x) for x in args.levels.split(",")]
    with Omni(path, device="cpu", dtype="float32") as omni:
        prompt = dict(omni.render_chat(MESSAGES), modalities=["text", "audio"])
        run_level(omni, prompt, 2, 8, 24)       # warm-up, untimed
        runs = [run_level(omni, prompt, n, args.tokens, args.codes) for n in levels]
        prof = cProfile.Profile() if args.profile else None
        if prof is not None:                    # one more round of the last level, profiled (not in the table)
            run_level(omni, prompt, levels[-1], args.tokens, args.codes, prof)
        calls = None
        if args.torch_calls:                    # and one counting the edges' torch calls
            calls = count_torch_calls(omni.orchestrator)
            counted = run_level(omni, prompt, levels[-1], args.tokens, args.codes)
    print(f"tiny Qwen2.5-Omni, CPU, {args.tokens} thinker tokens + {args.codes} talker codes per request")
    print(table(runs, "wall" if args.wall else "thread CPU"))
    if calls is not None:
        print(f"torch calls per piece, {levels[-1]} streams: " + ", ".join(
            f"{src}->{dst} {calls[(src, dst)] / counted[(src, dst)]['pieces']:.2f}" for src, dst in EDGES))
        runs[-1]["torch_calls"] = {key: calls[key] / counted[key]["pieces"] for key in EDGES}
    if prof is not None:
        stats = pstats.Stats(prof)
        stats.sort_stats("cumulative").print_stats(r"orchestrator.py:\d+\((_forward|_hand_over)", args.profile)
        for name in ("_forward_unchecked", "_hand_over", "_send"):
            stats.print_callees(name)
    return runs


if __name__ == "__main__":
    main()
