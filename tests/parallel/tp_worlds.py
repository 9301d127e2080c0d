"""AR engines at TP=1 and TP=2 on the same folder, for tests/parallel/test_tensor_parallel.py.

In: a model folder, its loader, prompts, sampling params and EngineConfig options. Out: `both` ->
{"want": TP=1 greedy ids per prompt, "got": TP=2's, "ranks": TP=2 had its other rank, "num_heads":
attention heads on rank 0's first layer, "num_preemptions": the TP=2 engine's count}.

Which process runs it: `engine` / `run` wherever called (the test process for its TP=1 references);
`both` in a worker of the test module's process pool (spawned, not daemonic): that worker is rank 0
of the TP=2 engine and spawns rank 1. Two TP=2 engines then start at once, one per core, instead of
one core waiting while the other imports torch for a rank.
"""

from __future__ import annotations

from omnistage.ar.engine import AREngine
from omnistage.config import EngineConfig
from omnistage.models.loader import load_causal_lm
from omnistage.params import SamplingParams

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog and then runs far away.", "a b c d e f g h"]
GREEDY = SamplingParams(max_tokens=12, temperature=0)


def engine(path, tp, loader=load_causal_lm, **kw) -> AREngine:
    kw = {"block_size": 8, "max_num_batched_tokens": 16, **kw}
    cfg = EngineConfig(device="cpu", dtype="float32", tensor_parallel_size=tp, **kw)
    return AREngine(path, cfg, loader=loader)


def run(eng: AREngine, prompts, params=GREEDY) -> list[list[int]]:
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            assert out.error is None, out.error
            if out.finished:
                done[out.request_id] = out.output
    return [done[str(i)].outputs[0].token_ids for i in range(len(prompts))]


def both(path, prompts, loader=load_causal_lm, params=GREEDY, **kw) -> dict:
    want = run(engine(path, 1, loader, **kw), prompts, params)
    two = engine(path, 2, loader, **kw)
    try:
        ranks, heads = two.runner.ranks is not None, two.model.layers[0].self_attn.num_heads
        got = run(two, prompts, params)
        preemptions = two.stats()["num_preemptions"]
    finally:
        two.close()
    return {"want": want, "got": got, "ranks": ranks, "num_heads": heads, "num_preemptions": preemptions}
