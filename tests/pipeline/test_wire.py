"""`pipeline.wire`: what crosses a stage-process boundary comes back equal, tensors included.

A tensor keeps its dtype (bfloat16 too), shape and device; large arrays go through shared memory
and the segment is gone once read. The CUDA paths (IPC and staged copies) run in
`benchmarks/check_cuda.py` on the GPU.
"""

import dataclasses
import os

import numpy as np
import pytest
import torch

from omnistage.outputs import AudioOutput, RequestOutput
from omnistage.params import SamplingParams
from omnistage.pipeline import wire
from omnistage.stage import HiddenStates, StageOutput


def _shm_segments() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
@pytest.mark.parametrize("shape", [(), (0, 3), (5, 7), (300, 128)])   # 300x128 fp32 goes by shared memory
def test_tensors_keep_dtype_shape_and_values(dtype, shape):
    t = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 50).to(dtype)
    back = wire.decode(wire.encode({"t": t, "view": t.T if t.dim() == 2 else t}))
    for got, want in ((back["t"], t), (back["view"], t.T if t.dim() == 2 else t)):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
        assert got.device.type == "cpu" and torch.equal(got, want)


def test_stage_output_with_tensors_and_arrays_round_trips_and_frees_shared_memory():
    before = _shm_segments()
    hidden = torch.randn(1000, 64).to(torch.bfloat16)          # 128 KB: shared memory
    audio = np.random.RandomState(0).randn(48000).astype(np.float32)
    out = StageOutput("r1", RequestOutput("r1", prompt_token_ids=[1, 2], audio=AudioOutput(audio, 24000)),
                      False, hidden=HiddenStates(3, hidden, hidden[:2]), timings={"encode": 0.5})
    data = wire.encode([out, SamplingParams(max_tokens=3, stop_token_ids=[7])])
    assert _shm_segments() - before                          # the arrays wait in shared memory
    got, params = wire.decode(data)
    assert _shm_segments() == before                         # ... and are unlinked once read
    assert params == SamplingParams(max_tokens=3, stop_token_ids=[7])
    assert got.request_id == "r1" and got.hidden.start == 3 and got.timings == {"encode": 0.5}
    assert got.hidden.hidden.dtype == torch.bfloat16 and torch.equal(got.hidden.hidden, hidden)
    assert torch.equal(got.hidden.inputs, hidden[:2])
    np.testing.assert_array_equal(got.output.audio.samples, audio)
    assert dataclasses.replace(got, hidden=None) == dataclasses.replace(out, hidden=None, output=got.output)


def test_unknown_objects_and_foreign_classes_are_refused():
    with pytest.raises(TypeError, match="cannot cross"):
        wire.encode({"f": object()})
    bad = wire._encoder.encode({wire._TYPE: "os:system"})
    with pytest.raises(ValueError, match="refusing to build os:system"):
        wire.decode(bad)


def test_stage_messages_round_trip_and_refusals_keep_their_field():
    from omnistage.params import ParamError
    from omnistage.pipeline.stage_messages import CallError, CallReply, CallStage, StageOutputs, StopStage

    call = CallStage(3, "add_request", ["r1", {"prompt": "hi"}, SamplingParams(max_tokens=2), None])
    assert wire.decode(wire.encode(call)) == call
    assert wire.decode(wire.encode(StopStage())) == StopStage()
    outs = StageOutputs([StageOutput("r1", RequestOutput("r1", finished=True), True)], {"num_running": 0.0})
    assert wire.decode(wire.encode(outs)) == outs
    with pytest.raises(ParamError) as refused:
        SamplingParams(top_p=2)
    reply = wire.decode(wire.encode(CallReply(3, error=CallError.of(refused.value))))
    raised = reply.error.exception()
    assert isinstance(raised, ParamError) and raised.field == "top_p" and str(raised).startswith("top_p must")
    plain = wire.decode(wire.encode(CallError.of(ValueError("no such voice")))).exception()
    assert type(plain) is ValueError and str(plain) == "no such voice"
    assert type(CallError.of(KeyError("x")).exception()) is RuntimeError


def test_tts_params_with_reference_audio_round_trip_and_fingerprint_without_shared_memory():
    from omnistage.codec.speech import TTSParams

    ref = np.linspace(-1, 1, 48000, dtype=np.float32)          # 192 kB: shared memory when sent
    params = TTSParams(task_type="Base", ref_audio=(ref, 24000), ref_text="hi", max_new_tokens=64)
    back = wire.decode(wire.encode(params))
    assert back.ref_audio[1] == 24000 and np.array_equal(back.ref_audio[0], ref) and back == params
    before = _shm_segments()
    key = wire.fingerprint(params)
    assert key == wire.fingerprint(TTSParams(task_type="Base", ref_audio=(ref.copy(), 24000), ref_text="hi",
                                             max_new_tokens=64))
    assert key != wire.fingerprint(TTSParams(task_type="Base", ref_audio=(ref * 0.5, 24000), ref_text="hi",
                                             max_new_tokens=64))
    assert _shm_segments() <= before                            # no segment left behind by a key


def test_inline_mode_carries_large_arrays_in_the_message():
    """`encode(..., inline=True)` (a stage process on another host) creates no shared-memory segment:
    tensors, arrays and images of any size ride in the bytes, and come back equal."""
    from PIL import Image

    t = torch.randn(300, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    a = np.arange(200_000, dtype=np.float32)
    image = Image.fromarray(np.arange(256 * 256 * 3, dtype=np.uint8).reshape(256, 256, 3) % 251)
    before = _shm_segments()
    data = wire.encode({"t": t, "a": a, "image": image}, inline=True)
    assert _shm_segments() == before and len(data) > t.numel() * 2 + a.nbytes
    back = wire.decode(data)
    assert back["t"].dtype == torch.bfloat16 and torch.equal(back["t"], t)
    np.testing.assert_array_equal(back["a"], a)
    assert back["image"].tobytes() == image.tobytes()
    wire.set_inline_default(True)               # a stage process started with `inline`
    try:
        data = wire.encode(a)
        assert _shm_segments() == before and wire.decode(data).tobytes() == a.tobytes()
    finally:
        wire.set_inline_default(False)
