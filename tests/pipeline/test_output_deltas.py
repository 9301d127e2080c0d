"""Stage outputs sent as deltas (`pipeline/output_deltas.py`) arrive as the cumulative outputs they were."""

from __future__ import annotations

import numpy as np

from omnistage.outputs import CompletionOutput, RequestOutput
from omnistage.pipeline import wire
from omnistage.pipeline.output_deltas import DeltaPacker, DeltaUnpacker
from omnistage.pipeline.stage_messages import StageOutputs
from omnistage.stage import StageOutput


def _output(rid: str, ids: list, codes: list, prompt: list, context=None, finished=False) -> StageOutput:
    comp = CompletionOutput(0, text=f"{len(ids)}", token_ids=list(ids), codes=[list(c) for c in codes] or None,
                            finish_reason="stop" if finished else None)
    return StageOutput(rid, RequestOutput(rid, prompt_token_ids=list(prompt), outputs=[comp], finished=finished,
                                          context_frames=context), finished)


def _send(packer: DeltaPacker, unpacker: DeltaUnpacker, outs: list[StageOutput]) -> tuple[list[StageOutput], int]:
    packed, deltas, state = packer.pack(outs)
    data = wire.encode(StageOutputs(packed, {}, deltas))
    packer.commit(state)
    msg = wire.decode(data)
    return unpacker.unpack(msg.outputs, msg.deltas), len(data)


def test_deltas_rebuild_cumulative_outputs_and_send_only_the_new_items():
    packer, unpacker = DeltaPacker(), DeltaUnpacker()
    context = np.arange(12, dtype=np.int32).reshape(4, 3)
    ids, codes, prompt = [], [], [7] * 30
    kept = []
    sizes = []
    for step in range(40):
        ids.append(100 + step)
        codes.append([step, step + 1, step + 2])
        # the codec stage's prompt grows; an AR stage's stays (both are lists that only grow)
        outs = [_output("a", ids, codes, prompt, context), _output("b", ids[:1], [], prompt[:step])]
        got, size = _send(packer, unpacker, outs)
        sizes.append(size)
        a, b = got
        assert a.output.outputs[0].token_ids == ids and a.output.outputs[0].codes == codes
        assert a.output.prompt_token_ids == prompt and a.output.outputs[0].text == f"{step + 1}"
        np.testing.assert_array_equal(a.output.context_frames, context)
        assert b.output.prompt_token_ids == prompt[:step] and b.output.outputs[0].codes is None
        kept.append(a)
    # each output has lists of its own: an earlier one still reads what it said then
    assert kept[3].output.outputs[0].token_ids == ids[:4]
    assert sizes[-1] < sizes[5] + 64                 # the message does not grow with the answer
    # a list that did not just grow (its item where the last one sent ended differs; shorter) is sent whole
    changed = ids[:-1] + [999, 1000]
    got, _ = _send(packer, unpacker, [_output("a", changed, codes, prompt[:-1], context, finished=True)])
    assert got[0].output.outputs[0].token_ids == changed and got[0].output.prompt_token_ids == prompt[:-1]
    # a finished (or aborted) request is forgotten on both sides: the id starts afresh
    packer.forget("b")
    unpacker.forget("b")
    got, _ = _send(packer, unpacker, [_output("a", [5], [[1, 2, 3]], [1]), _output("b", [9], [], [2])])
    assert got[0].output.outputs[0].token_ids == [5] and got[1].output.prompt_token_ids == [2]
    # a delta still on its way when the receiver forgot the request (aborted there) is dropped
    unpacker.forget("b")
    got, _ = _send(packer, unpacker, [_output("a", [5, 6], [[1, 2, 3]] * 2, [1]), _output("b", [9, 8], [], [2])])
    assert [o.request_id for o in got] == ["a"] and got[0].output.outputs[0].token_ids == [5, 6]
