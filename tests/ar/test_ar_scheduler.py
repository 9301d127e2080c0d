"""The AR scheduler and block manager with fake runner outputs (no model, no torch in the code under test)."""

import sys

from omnistage.ar.kv_cache import BlockManager
from omnistage.ar.scheduler import Scheduler
from omnistage.ar.sequence import SeqStatus, Sequence
from omnistage.params import SamplingParams


def make(num_blocks=16, block_size=4, max_seqs=8, budget=32, prefix=True):
    bm = BlockManager(num_blocks, block_size, prefix)
    return bm, Scheduler(bm, max_seqs, budget)


def seq(i, n_prompt, max_tokens=8, base=0):
    return Sequence(f"s{i}", f"r{i}", 0, list(range(base, base + n_prompt)), SamplingParams(max_tokens=max_tokens), 0.0)


def run_step(sch, token=7):
    out = sch.schedule()
    sampled = {s.seq.seq_id: token for s in out.scheduled if s.samples}
    sch.update(out, sampled)
    return out, sampled


def test_scheduler_module_imports_no_torch():
    import omnistage.ar.scheduler  # noqa: F401
    assert "torch" not in sys.modules or all(
        "torch" not in getattr(sys.modules[m], "__file__", "") for m in ("omnistage.ar.scheduler",))
    src = open(omnistage.ar.scheduler.__file__).read() + open(omnistage.ar.kv_cache.__file__).read()
    assert "import torch" not in src


def test_chunked_prefill_respects_budget_and_fcfs():
    bm, sch = make(budget=10)
    a, b = seq(0, 14), seq(1, 3)
    sch.add(a)
    sch.add(b)
    out, sampled = run_step(sch)
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [("s0", 10)]
    assert sampled == {}                                      # a's prompt is not finished: no token
    out, sampled = run_step(sch)
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [("s0", 4), ("s1", 3)]
    assert set(sampled) == {"s0", "s1"}
    out, _ = run_step(sch)                                    # both decode one token
    assert [(s.seq.seq_id, s.num_new_tokens, s.start) for s in out.scheduled] == [("s0", 1, 14), ("s1", 1, 3)]


def test_max_num_seqs_caps_running():
    bm, sch = make(max_seqs=2, budget=100)
    for i in range(4):
        sch.add(seq(i, 2))
    out, _ = run_step(sch)
    assert len(out.scheduled) == 2 and len(sch.waiting) == 2


def test_prefix_cache_shares_full_blocks_and_leaves_one_token():
    bm, sch = make(num_blocks=16, block_size=4, budget=100)
    a = seq(0, 9)                                             # blocks: [0-3][4-7][8]
    sch.add(a)
    run_step(sch)
    b = seq(1, 9)                                             # same prompt
    sch.add(b)
    out, _ = run_step(sch)
    sb = next(s for s in out.scheduled if s.seq is b)
    assert b.num_cached_tokens == 8 and sb.start == 8 and sb.num_new_tokens == 1
    assert b.block_table[:2] == a.block_table[:2]
    c = seq(2, 8)                                             # fully cached prompt: last token recomputed
    sch.add(c)
    out, _ = run_step(sch)
    sc = next(s for s in out.scheduled if s.seq is c)
    assert sc.start == 4 and sc.num_new_tokens == 4


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    bm, sch = make(num_blocks=6, block_size=4, budget=100)
    a = seq(0, 8)
    sch.add(a)
    run_step(sch)
    sch.finish(a, "stop")
    assert bm.num_free_blocks == 6 and len(bm.cached) == 2    # a's full blocks stay cached while free
    b = seq(1, 9)
    sch.add(b)
    run_step(sch)
    assert b.num_cached_tokens == 8
    head, second = b.block_hashes[0], b.block_hashes[1]
    sch.finish(b, "stop")
    c = seq(2, 20, base=100)                                  # unrelated, needs 5 of the 6 blocks
    sch.add(c)
    run_step(sch)
    # Tails are evicted before heads: the shared prefix's first block survives, its second does not.
    assert head in bm.cached and second not in bm.cached and bm.num_free_blocks == 1


def test_preemption_when_pool_runs_dry_then_recompute():
    bm, sch = make(num_blocks=4, block_size=4, budget=100)
    a, b = seq(0, 4, max_tokens=8), seq(1, 4, max_tokens=8, base=50)
    sch.add(a)
    sch.add(b)
    run_step(sch)                                             # 1 block each, then a decode needs a 2nd
    for _ in range(12):
        out, _ = run_step(sch)
        if out.preempted:
            break
    assert out.preempted and out.preempted[0] is b and b.status == SeqStatus.WAITING
    assert b.num_computed_tokens == 0 and b.block_table == []
    sch.finish(a, "length")
    out, _ = run_step(sch)                                    # b is readmitted and recomputes
    assert out.scheduled[0].seq is b and b.status == SeqStatus.RUNNING
    assert sch.num_preemptions >= 1


def test_abort_frees_blocks():
    bm, sch = make()
    a = seq(0, 10)
    sch.add(a)
    run_step(sch)
    assert bm.num_free_blocks < 16
    sch.abort(a)
    assert bm.num_free_blocks == 16 and not sch.has_unfinished() and a.finish_reason == "abort"


def test_reset_prefix_cache_forgets_content_and_keeps_running_sequences():
    bm, sch = make(num_blocks=16, block_size=4, budget=100)
    a = seq(0, 9, max_tokens=20)                              # running: holds 3 blocks
    done = seq(1, 8, base=50)
    sch.add(a)
    sch.add(done)
    run_step(sch)
    sch.finish(done, "stop")                                  # its 2 full blocks stay cached while free
    held = list(a.block_table)
    assert bm.reset_prefix_cache() == 4                       # a's 2 full blocks + done's 2
    assert not bm.cached and all(h is None for h in bm.hash_of)
    assert a.block_table == held and a.status == SeqStatus.RUNNING
    b = seq(2, 9)                                             # a's prompt again: nothing to share now
    sch.add(b)
    run_step(sch)
    assert b.num_cached_tokens == 0 and not set(b.block_table) & set(held)
    for _ in range(4):                                        # a goes on decoding; its new full blocks are shared again
        run_step(sch)
    assert a.status == SeqStatus.RUNNING and len(a.token_ids) == 9 + 6
    assert bm.cached and bm.num_free_blocks + sum(len(s.block_table) for s in (a, b)) == 16
