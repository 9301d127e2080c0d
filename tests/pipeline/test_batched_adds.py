"""Requests added together (`Orchestrator.add_requests`) with the tiny Llama's LM stage in its own
process, shared and inline: they are prefilled in one step and answer as the in-process engine does; a
bad request in the batch is refused alone, naming its field; an abort of one leaves the others; a
stage process that dies as a batch reaches it refuses or fails that batch (503-style
`StageDeadError` naming the stage) instead of leaving the engine thread waiting for a reply, and
serves again once it is back."""

import threading
import time

import pytest

from omnistage.params import ParamError, SamplingParams
from omnistage.stage import StageDeadError

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
PROMPTS = [f"the lighthouse keeper counted {i} ships before dawn" for i in range(8)]


def _orchestrator(folder: str, runner: str):
    from omnistage.entrypoints.common import build_orchestrator

    return build_orchestrator(folder, "cpu", "float32", deploy_config={"stages": {"llm": {"runner": runner}}},
                              num_kv_blocks=256)


@pytest.fixture(scope="module")
def process_orch(tiny_models):
    orch = _orchestrator(tiny_models["llama"], "process")
    try:
        yield orch
    finally:
        orch.close()


def _run(orch, deadline_s: float = 120) -> dict:
    """Steps until nothing is left; request id -> its final output."""
    finals, deadline = {}, time.monotonic() + deadline_s
    while orch.has_unfinished():
        assert time.monotonic() < deadline, "the requests did not finish"
        finals.update((o.request_id, o) for o in orch.step() if o.finished)
    return finals


def _batch(tag: str) -> list[dict]:
    """8 good requests, then: a prompt over max_model_len, max_tokens over what is left, a repeated id."""
    good = [dict(request_id=f"{tag}-{i}", inputs=p, params=PARAMS) for i, p in enumerate(PROMPTS)]
    return good + [dict(request_id=f"{tag}-long", inputs=" ".join(["word"] * 5000), params=PARAMS),
                   dict(request_id=f"{tag}-tokens", inputs="hello", params=SamplingParams(max_tokens=10 ** 6)),
                   dict(request_id=f"{tag}-0", inputs="again", params=PARAMS)]


def _steps(orch) -> float:
    return orch.stats().get("steps_total", 0)


def test_a_batch_is_prefilled_in_one_step_and_refuses_only_its_bad_requests(tiny_models, process_orch):
    inline = _orchestrator(tiny_models["llama"], "inline")
    shared = _orchestrator(tiny_models["llama"], "shared")   # on a CPU: no streams, the in-process path
    answers = {}
    for name, orch in (("inline", inline), ("shared", shared), ("process", process_orch)):
        before = _steps(orch)
        errors = orch.add_requests(_batch(name))
        assert errors[:8] == [None] * 8
        assert isinstance(errors[8], ValueError) and "max_model_len" in str(errors[8])
        assert isinstance(errors[9], ParamError) and errors[9].field == "max_tokens"
        assert isinstance(errors[10], ValueError) and "already in use" in str(errors[10])
        orch.abort(f"{name}-3")
        finals = _run(orch)
        time.sleep(0.2)                         # the stage process's last stats
        orch.step()
        assert sorted(finals) == sorted(f"{name}-{i}" for i in range(8) if i != 3)
        answers[name] = {rid.split("-")[1]: out.outputs[0].token_ids for rid, out in finals.items()}
        assert all(len(ids) == 4 for ids in answers[name].values())
        assert _steps(orch) - before == 4, name   # one prefill step for all 8, then 3 decode steps
    assert answers["process"] == answers["shared"] == answers["inline"]
    assert not inline.routes and not shared.routes and not process_orch.routes


def _killing(client, after_send: bool):
    """Wraps the client's command send: the stage process is SIGKILLed just before (or just after)
    the next `add_requests` message goes out; restores the send once it has."""
    send = client._send

    def killing_send(command):
        if getattr(command, "method", None) != "add_requests":
            return send(command)
        client._send = send
        if not after_send:
            client.proc.kill()
            client.proc.wait()
            time.sleep(0.3)                     # zmq drops the dead peer's pipe
        sent = send(command)
        if after_send:
            client.proc.kill()
            client.proc.wait()
        return sent

    client._send = killing_send


@pytest.mark.parametrize("after_send", [False, True], ids=["before-send", "after-send"])
def test_a_stage_process_killed_as_a_batch_reaches_it_fails_the_batch_and_recovers(process_orch, after_send):
    orch, client = process_orch, process_orch.stages["llm"]
    restarts = client.restarts
    _killing(client, after_send)
    result = {}
    adding = threading.Thread(target=lambda: result.update(errors=orch.add_requests(
        [dict(request_id=f"killed-{after_send}-{i}", inputs=p, params=PARAMS) for i, p in enumerate(PROMPTS)])),
        daemon=True)
    adding.start()
    adding.join(60)
    assert not adding.is_alive(), "add_requests is still waiting for the dead stage process"
    refused = [e for e in result["errors"] if e is not None]
    assert all(isinstance(e, StageDeadError) and "stage 'llm'" in str(e) for e in refused), refused
    finals, failed, deadline = {}, {}, time.monotonic() + 120
    while client.state != "ready" or orch.has_unfinished():   # taken ones fail once the death is seen
        assert time.monotonic() < deadline, "the stage did not come back"
        finals.update((o.request_id, o) for o in orch.step() if o.finished)
        failed.update(orch.pop_errors())
        time.sleep(0.01)
    taken = [f"killed-{after_send}-{i}" for i, e in enumerate(result["errors"]) if e is None]
    assert not finals and sorted(failed) == sorted(taken)
    assert all(isinstance(e, StageDeadError) for e in failed.values())
    if not after_send:                          # the process was dead before the batch was sent
        assert len(refused) == len(PROMPTS) and "is restarting" in str(refused[0])
    assert client.restarts == restarts + 1 and not orch.routes
    assert orch.add_requests([dict(request_id=f"back-{after_send}", inputs=PROMPTS[0], params=PARAMS)]) == [None]
    back = _run(orch)
    assert len(back[f"back-{after_send}"].outputs[0].token_ids) == 4
