"""DiffusionScheduler with fake runner outputs: grouping, budgets, fairness, joins and aborts."""

from omnistage.diffusion.scheduler import (DiffusionRunnerOutput, DiffusionScheduler, DiffusionSchedulerOutput,
                                           SchedEntry)


def entry(rid, key="A", steps=3, rows=1, tokens=16):
    return SchedEntry(request_id=rid, key=key, num_rows=rows, tokens_per_row=tokens, num_steps=steps)


def run(s: DiffusionScheduler, out: DiffusionSchedulerOutput):
    """Fake runner: every scheduled request advances one step and keeps its key."""
    return s.update(DiffusionRunnerOutput(stepped=list(out.denoise)))


def test_compatible_requests_share_a_forward_at_different_steps():
    s = DiffusionScheduler(max_num_seqs=4)
    s.add(entry("a", steps=4))
    out = s.schedule()
    assert out.admit == ["a"] and out.denoise == ["a"]
    run(s, out)
    s.add(entry("b", steps=2))                   # joins between steps, a is at step 1
    out = s.schedule()
    assert out.admit == ["b"] and sorted(out.denoise) == ["a", "b"] and out.num_rows == 2
    assert run(s, out) == []
    out = s.schedule()
    assert sorted(out.denoise) == ["a", "b"]
    assert run(s, out) == ["b"]                  # b finishes after its 2 steps, a keeps going
    out = s.schedule()
    assert out.denoise == ["a"]
    assert run(s, out) == ["a"]
    assert not s.has_unfinished()


def test_max_num_seqs_bounds_admission_and_forward():
    s = DiffusionScheduler(max_num_seqs=2)
    for r in "abc":
        s.add(entry(r, steps=1))
    out = s.schedule()
    assert out.admit == ["a", "b"] and out.denoise == ["a", "b"] and s.num_waiting == 1
    assert run(s, out) == ["a", "b"]
    out = s.schedule()
    assert out.admit == ["c"] and out.denoise == ["c"]


def test_token_budget_splits_a_group_but_a_lone_request_always_runs():
    s = DiffusionScheduler(max_num_seqs=8, max_num_batched_tokens=40)
    s.add(entry("big", steps=1, rows=2, tokens=100))   # 200 tokens > budget: runs alone
    s.add(entry("x", steps=1, tokens=16))
    s.add(entry("y", steps=1, tokens=16))
    out = s.schedule()
    assert out.denoise == ["big"]
    run(s, out)
    out = s.schedule()
    assert out.denoise == ["x", "y"] and out.num_tokens == 32


def test_shape_groups_interleave_fairly():
    s = DiffusionScheduler(max_num_seqs=8)
    s.add(entry("a1", key="512", steps=3))
    s.add(entry("a2", key="512", steps=3))
    s.add(entry("b1", key="1024", steps=3))
    seen = []
    while s.has_unfinished():
        out = s.schedule()
        seen.append(out.key)
        assert len({s.running[r].key for r in out.denoise}) == 1
        run(s, out)
    assert seen == ["512", "1024"] * 3         # strict alternation: no group waits two rounds


def test_no_starvation_under_a_steady_stream():
    s = DiffusionScheduler(max_num_seqs=16)
    s.add(entry("lonely", key="B", steps=2))
    rounds = 0
    while "lonely" in s.running or any(e.request_id == "lonely" for e in s.waiting):
        s.add(entry(f"a{rounds}", key="A", steps=2))   # group A never empties
        run(s, s.schedule())
        rounds += 1
        assert rounds < 10
    assert rounds <= 4


def test_keys_change_between_steps():
    s = DiffusionScheduler(max_num_seqs=4)
    s.add(entry("a", key=("hi", 0), steps=2))
    s.add(entry("b", key=("hi", 0), steps=2))
    out = s.schedule()
    assert sorted(out.denoise) == ["a", "b"]
    # a switches expert after its first step, b does not: they split
    s.update(DiffusionRunnerOutput(stepped=["a", "b"], next_keys={"a": ("lo", 1), "b": ("hi", 0)}))
    keys = set()
    for _ in range(2):
        out = s.schedule()
        keys.add(out.key)
        assert len(out.denoise) == 1
        run(s, out)
    assert keys == {("lo", 1), ("hi", 0)}


def test_abort_waiting_and_running():
    s = DiffusionScheduler(max_num_seqs=1)
    s.add(entry("a", steps=5))
    s.add(entry("b", steps=5))
    run(s, s.schedule())
    assert s.abort("b") and s.abort("a") and not s.abort("zzz")
    assert not s.has_unfinished()
    assert s.schedule().is_empty


def test_failed_requests_are_dropped():
    s = DiffusionScheduler()
    s.add(entry("a"))
    s.schedule()
    assert s.update(DiffusionRunnerOutput(failed={"a": "boom"})) == []
    assert not s.has_unfinished()
