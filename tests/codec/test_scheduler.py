"""The codec scheduler with fake requests: a request's state counts the units (sentences, code chunks)
it has received and decoded; a chunk is the index of its next unit, its "audio" a string."""

import subprocess
import sys

import pytest

from omnistage.codec.scheduler import CodecBatch, CodecRequest, CodecScheduler


class Units:
    def __init__(self, received: int = 0):
        self.received = received                # units given so far
        self.decoded = 0                        # units decoded so far


def ready(req: CodecRequest):
    state = req.state
    return state.decoded if state.decoded < state.received else None


def decode(batch: CodecBatch) -> list[str]:
    """What a codec model's `decode` does to the states: each moves past its chunk."""
    audio = []
    for req, chunk in zip(batch.requests, batch.chunks):
        assert chunk == req.state.decoded
        req.state.decoded += 1
        audio.append(f"{req.request_id}{chunk}")
    return audio


def add(sched: CodecScheduler, rid: str, received: int, input_done: bool = True, key=None) -> CodecRequest:
    req = CodecRequest(rid, Units(received), batch_key=key, input_done=input_done)
    sched.add(req)
    return req


def step(sched: CodecScheduler) -> list[tuple[str, object, bool]]:
    batch = sched.schedule()
    return [(r.request.request_id, r.chunk, r.finished) for r in sched.update(batch, decode(batch))]


def test_round_robin_up_to_the_batch_limit_and_finish():
    sched = CodecScheduler(ready, max_batch=2)
    for rid, n in (("a", 2), ("b", 1), ("c", 2)):
        add(sched, rid, n)
    assert sched.num_ready() == 3
    assert step(sched) == [("a", "a0", False), ("b", "b0", True)]     # b had one unit: done
    assert list(sched.requests) == ["c", "a"]                          # served requests went to the back
    assert step(sched) == [("c", "c0", False), ("a", "a1", True)]
    assert step(sched) == [("c", "c1", True)]
    assert not sched.requests and step(sched) == []


def test_one_batch_shares_the_key_of_the_least_recently_served_ready_request():
    sched = CodecScheduler(ready, max_batch=8)
    add(sched, "idle", 0, input_done=False, key="x")                  # not ready: its key does not count
    add(sched, "a", 2, key="y")
    add(sched, "b", 2, key="x")
    add(sched, "c", 2, key="y")
    batch = sched.schedule()
    assert [r.request_id for r in batch.requests] == ["a", "c"] and batch.chunks == [0, 0]
    sched.update(batch, decode(batch))
    assert [r.request_id for r in sched.schedule().requests] == ["b"]  # now the oldest-served ready one


def test_streamed_input_waits_and_finishes_without_a_chunk():
    sched = CodecScheduler(ready, max_batch=4)
    req = add(sched, "s", 1, input_done=False)
    assert step(sched) == [("s", "s0", False)]
    assert step(sched) == [] and sched.num_ready() == 0 and "s" in sched.requests   # waits for input
    req.state.received += 1
    assert step(sched) == [("s", "s1", False)]
    req.input_done = True                       # the last piece held no unit: finished, nothing decoded
    assert step(sched) == [("s", None, True)]
    assert req.chunks == ["s0", "s1"] and req.metrics.finished_time >= req.metrics.first_token_time
    add(sched, "empty", 0)
    assert step(sched) == [("empty", None, True)] and not sched.requests


def test_abort_and_ids():
    sched = CodecScheduler(ready, max_batch=1)
    add(sched, "a", 3)
    with pytest.raises(ValueError, match="already in use"):
        add(sched, "a", 1)
    sched.abort("a")
    sched.abort("never-added")
    assert not sched.requests and len(sched.schedule()) == 0
    with pytest.raises(ValueError, match="max_batch must be an integer >= 1"):
        CodecScheduler(ready, max_batch=0)


def test_scheduler_and_engine_import_no_torch():
    code = "import sys, omnistage.codec.engine, omnistage.codec.scheduler; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_first_chunks_go_before_later_ones():
    """A request with no audio yet (its listener waits) is served before requests whose audio plays,
    even when the batch is full with them."""
    sched = CodecScheduler(ready, max_batch=2)
    add(sched, "a", 3)
    add(sched, "b", 3)
    assert step(sched) == [("a", "a0", False), ("b", "b0", False)]
    add(sched, "new", 2)
    assert [r.request_id for r in sched.schedule().requests] == ["new", "a"]
    assert step(sched) == [("new", "new0", False), ("a", "a1", False)]
    assert step(sched) == [("b", "b1", False), ("new", "new1", True)]      # then round-robin again


def test_first_chunks_alone_make_a_batch_of_their_own():
    """With `first_alone` (code2wav), a batch with a first chunk takes no later chunk, however much room
    is left; without first chunks waiting, later ones fill the batch as usual."""
    sched = CodecScheduler(ready, max_batch=4, first_alone=True)
    add(sched, "a", 3)
    add(sched, "b", 3)
    assert step(sched) == [("a", "a0", False), ("b", "b0", False)]
    add(sched, "new", 2)
    assert [r.request_id for r in sched.schedule().requests] == ["new"]
    assert step(sched) == [("new", "new0", False)]
    assert [r.request_id for r in sched.schedule().requests] == ["a", "b", "new"]
