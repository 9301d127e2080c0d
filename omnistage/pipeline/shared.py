"""`SharedStage`: a stage engine in the orchestrator's process on a CUDA stream of its own (`runner:
shared`; the engine thread of the entry point's process).

The shared layout puts every stage of one GPU in one process, driven by the orchestrator's one step
loop: no CUDA context per stage, and the GPU runs the stages' queued work side by side instead of
time-slicing between processes (where the talker's decode waits behind code2wav's ODE graphs). In:
the engine built for the stage (`pipeline.build.build_engine`), its device, its `StageSpec.priority`,
and whether its outputs feed another stage. Out: the engine's own interface (every attribute is the
engine's), with device work ordered:

* each step runs under the stage's stream; a stage with `priority` > 0 gets a high-priority
  stream, so its kernels are picked before those of normal stages (code2wav) when both are queued;
* before a step the stage's stream waits for the default stream (the edge adapters' work and the
  inputs they handed over); after a step the default stream waits for the stage's stream only when
  the stage feeds another stage (its hidden states), so no stage waits for a sink stage's bulk work;
* `add_request` / `add_input` run on the stage's stream too (the engine's copies of its inputs are
  its stream's), after the default stream's queued work only when they hand over CUDA tensors
  (codec ids do not wait); `add_inputs` takes all of a step's pieces for the stage under one such
  wait. Tensors handed to a stage (inputs, streamed rows) and reported by it (hidden
  states) are marked in use by the other stream (`record_stream`), so the caching allocator never
  reuses their memory while queued work still reads it.

On a CPU there are no streams: the stage behaves as an inline one. A step that raises fails only the
requests the stage holds (the orchestrator's `_step_stage`, as for inline stages).

Programmatic dependent launch (`layers/pdl.py`) is off in a process where a shared stage's GPU runs another
of its stages too (`side_by_side`; the orchestrator calls `keep_kernels_apart` before it builds the stages, so
no graph is captured with it). Why: on an H200 the Qwen2.5-Omni 7B shape in this layout hung at 32 streams
with it on, four runs of four (benchmarks/RESULTS.md, session 14: every stage's stream busy and none
finishing, the GPU at 100%, from the moment code2wav's first 32-row batch ran beside the thinker's last and
the talker's early decode steps), and served all 32 with it off (`OMNISTAGE_PDL=0`), while 1 to 16 streams
were as fast either way. The mechanism is not found (each stream's PDL chain, by layers/pdl.py's rules,
waits only on kernels already resident); a stage process, the AR engine alone and the inline layout (one
stream) keep PDL.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Optional

import torch

from omnistage.config import concrete_device
from omnistage.layers import pdl
from omnistage.spec import PipelineSpec
from omnistage.stage import SCALARS, add_inputs_each, message_fields


def _tensors(obj: Any, depth: int = 0):
    """The CUDA tensors in an input or output (dataclasses, lists, dicts), a few levels deep."""
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda:
            yield obj
        return
    if depth > 4:
        return
    if isinstance(obj, dict):
        items = obj.values()
    elif isinstance(obj, (list, tuple)):
        items = obj
    else:
        items = (getattr(obj, name) for name in message_fields(obj))
    for item in items:
        if not isinstance(item, SCALARS):      # (codec ids: a list of ints)
            yield from _tensors(item, depth + 1)


class SharedStage:
    def __init__(self, engine: Any, device: torch.device, priority: int = 0, feeds_others: bool = True):
        self.engine = engine
        self.feeds_others = feeds_others        # its outputs go to another stage: the default stream waits for it
        self.stream: Optional[torch.cuda.Stream] = None   # None on a CPU
        if device.type == "cuda":
            low, high = torch.cuda.Stream.priority_range()   # e.g. (0, -5): lower numbers run first
            self.stream = torch.cuda.Stream(device, priority=max(high, low - priority) if priority > 0 else low)
            self.default = torch.cuda.default_stream(device)

    def __getattr__(self, name: str) -> Any:   # everything not defined here is the engine's
        return getattr(self.__dict__["engine"], name)

    @contextlib.contextmanager
    def _on_stream(self, *handed_in: Any, wait: bool = True):
        """Runs the block on the stage's stream, after the default stream's queued work; the tensors of
        `handed_in` (made on the default stream) stay allocated until the stage's work on them is done.
        `wait` False: only when `handed_in` holds CUDA tensors (host-only inputs, such as codec ids,
        depend on no queued work; the stage's next step waits for the default stream all the same)."""
        if self.stream is None:
            yield
            return
        tensors = [t for obj in handed_in for t in _tensors(obj)]
        if wait or tensors:
            self.stream.wait_stream(self.default)
        for t in tensors:
            t.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            yield

    def add_request(self, request_id: str, inputs: Any, params: Any = None, arrival_time: Optional[float] = None):
        with self._on_stream(inputs, wait=False):   # the engine's copies of the inputs are made on its stream
            return self.engine.add_request(request_id, inputs, params, arrival_time)

    def step(self) -> list:
        with self._on_stream():
            outputs = self.engine.step()
        if self.stream is not None and self.feeds_others:
            self.default.wait_stream(self.stream)
            for out in outputs:
                for t in _tensors(out.hidden):
                    t.record_stream(self.default)
        return outputs


def _add_input(self: SharedStage, request_id: str, piece: Any) -> None:
    with self._on_stream(piece, wait=False):
        self.engine.add_input(request_id, piece)


def _add_inputs(self: SharedStage, items: list[tuple[str, Any]]) -> list[Optional[Exception]]:
    """Every (request_id, piece) of a step's pieces under one stream wait (none for host-only pieces)."""
    with self._on_stream(*(piece for _, piece in items), wait=False):
        return add_inputs_each(self.engine, items)


def shared_stage(engine: Any, device: torch.device, priority: int, feeds_others: bool) -> SharedStage:
    """`engine` (on `device`) as a shared stage; `add_input` / `add_inputs` exist only when the engine
    has `add_input` (the orchestrator checks `hasattr` for streaming edges)."""
    stage = SharedStage(engine, device, priority, feeds_others)
    if hasattr(engine, "add_input"):
        stage.add_input = _add_input.__get__(stage)
        stage.add_inputs = _add_inputs.__get__(stage)
    return stage


def side_by_side(spec: PipelineSpec) -> list[str]:
    """The shared stages whose GPU also runs another stage of the orchestrator's process (inline or shared): their
    kernels run beside that stage's, on streams of their own."""
    in_process = [(s, concrete_device(s.engine.device)) for s in spec.stages if s.runner != "process"]
    per_device = collections.Counter(device for _, device in in_process)
    return [s.name for s, device in in_process
            if s.runner == "shared" and device.startswith("cuda") and per_device[device] > 1]


def keep_kernels_apart(spec: PipelineSpec) -> None:
    """Before the stages are built: PDL off where `side_by_side` names stages (the module docstring says why)."""
    names = side_by_side(spec)
    if names:
        pdl.disable(f"stages {', '.join(names)} share a GPU in this process (pipeline/shared.py)")
