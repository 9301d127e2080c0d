"""The codec engine with a model that launches its decode and collects it later (code2wav on a GPU):
one batch in flight, filed once the "device" is done, aborts and failures while in flight. The model
is a small fake in numpy whose device the test finishes by hand (`done`), so no GPU is needed."""

from typing import Any, Optional

import numpy as np

from omnistage.codec.engine import CodecEngine


class Launched:
    """A codec model: each request is a number of 2-sample chunks; a chunk's audio is its index."""

    params_type = dict
    max_batch = 4
    asynchronous = True                         # the engine uses launch / collect

    def __init__(self):
        self.done = False                       # the fake device finished the batch in flight
        self.launches: list[list[int]] = []     # chunk indexes of each launch
        self.broken: set[int] = set()           # requests (by total chunks) whose collect raises

    def voices(self):
        return []

    def check_params(self, params):
        pass

    def new_state(self, params):
        return {"total": 0, "next": 0}

    def batch_key(self, state):
        return None

    def take(self, state, piece):
        state["total"] += piece
        return True

    def ready(self, state, input_done) -> Optional[int]:
        return state["next"] if state["next"] < state["total"] else None

    def launch(self, states, chunks):
        self.launches.append(list(chunks))
        self.done = False
        return states, chunks

    def collect(self, pending, wait) -> Optional[list[np.ndarray]]:
        if not (wait or self.done):
            return None
        states, chunks = pending
        if any(s["total"] in self.broken for s in states):
            raise RuntimeError("device error")
        for s in states:
            s["next"] += 1
        return [np.full(2, c, np.float32) for c in chunks]

    def decode(self, states, chunks):
        return self.collect(self.launch(states, chunks), wait=True)

    def sample_rate(self, state):
        return 8000

    def prompt(self, state):
        return None, []

    def stats(self):
        return {}


def _outputs(engine) -> dict[str, Any]:
    return {o.request_id: o for o in engine.step()}


def test_one_batch_in_flight_is_filed_when_the_device_is_done():
    model = Launched()
    engine = CodecEngine(model)
    engine.add_request("a", 2)
    engine.add_request("b", 1)
    assert _outputs(engine) == {} and model.launches == [[0, 0]]   # launched, the device still works
    assert _outputs(engine) == {} and len(model.launches) == 1     # nothing new launched meanwhile
    model.done = True
    outs = _outputs(engine)
    assert outs["a"].audio_chunk.tolist() == [0, 0] and not outs["a"].finished
    assert outs["b"].finished and len(model.launches) == 2          # a's next chunk launched at once
    model.done = True
    outs = _outputs(engine)
    assert outs["a"].finished and outs["a"].output.audio.samples.tolist() == [0, 0, 1, 1]
    assert not engine.has_unfinished()


def test_a_request_aborted_in_flight_is_dropped_and_a_failed_batch_decodes_alone():
    model = Launched()
    engine = CodecEngine(model)
    for rid, chunks in (("keep", 1), ("gone", 1)):
        engine.add_request(rid, chunks)
    engine.step()
    engine.abort("gone")
    model.done = True
    assert set(_outputs(engine)) == {"keep"}
    model.broken = {3}                          # collecting a batch with the 3-chunk request raises
    engine.add_request("bad", 3)
    engine.add_request("good", 2)
    engine.step()
    model.done = True
    outs = _outputs(engine)
    assert outs["bad"].error is not None and outs["bad"].finished
    assert outs["good"].audio_chunk.tolist() == [0, 0] and outs["good"].error is None
