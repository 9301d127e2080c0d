"""`CodecEngine`: a codec stage -- a text-to-speech voice or a code-to-waveform vocoder -- as a
`StageEngine` around a codec model (the stage's process).

In: `add_request(request_id, inputs, params)` where inputs is what the model's `take` reads (a
`TTSInput` or text for a voice, a `CodecInput` or a list of ids for a vocoder; `finished=False`
while an upstream stage streams more through `add_input`) and params an instance of the model's
`params_type` (None = its defaults). Out: each `step()` returns one `StageOutput` per request that
changed: `output.audio` is the cumulative `AudioOutput` (float32 mono in [-1, 1] at the model's
rate), `output.prompt` / `prompt_token_ids` what the model says it has read (text spoken, phoneme or
codec ids), `audio_chunk` the samples added this step (empty when none), `output.metrics.audio` when the
audio came out of this stage (`AudioTiming`: first / last audio, underruns); the last one has
`finished=True`.

A step is schedule -> decode -> update: the `CodecScheduler` picks the ready chunks (round-robin, one
batch key, up to the model's `max_batch`), the model decodes them in one call, the scheduler files
the audio and says which requests changed or finished. A model with `launch` / `collect` that says
it is `asynchronous` (code2wav on a GPU) keeps one batch in flight instead: a step files the
launched batch once the device is done with it (else returns at once: the step loop goes on to the
other stages of its process) and then launches the next, so the host never waits for the device's
decode. A request whose `take`, `ready` or decode
raises fails alone (a finished `StageOutput` whose `error` says why; the stage serves on): when a
batch of several fails, each chunk is decoded again on its own, so the others in it survive. The
engine owns the requests and their audio; the model (`CodecModel`, implemented in the model's
folder: `models/qwen2_5_omni/code2wav.py`, `models/piper/tts.py`) owns everything that knows what a
chunk is. A back end's `from_stage_spec(spec)` builds its model and returns the engine around it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Hashable, Optional, Protocol

import numpy as np

from omnistage.codec.scheduler import CodecBatch, CodecReport, CodecRequest, CodecScheduler
from omnistage.outputs import AudioOutput, AudioTiming, RequestMetrics, RequestOutput
from omnistage.stage import StageError, StageOutput

logger = logging.getLogger(__name__)


class CodecModel(Protocol):
    """What a codec back end implements for `CodecEngine`. `state` is the model's own per-request
    object (`new_state`); a chunk is whatever `ready` returns and `decode` reads back."""

    params_type: type                           # request params class; `params_type()` = the defaults
    max_batch: int                              # most requests one `decode` call serves
    # optional `first_chunks_alone = True`: first chunks decode in batches of their own (scheduler.py)

    def voices(self) -> list[dict[str, Any]]: ...          # one {"id", "name", "sample_rate", "backend", ...} per voice

    # A model that sizes a request's chunks by the stage's load declares `on_load(active)`: the engine
    # calls it with the number of requests it holds right before each `new_state` and before each step.

    # A TTS model also declares `capabilities()`, a `SpeechCapabilities` (codec/speech.py): the task
    # types, languages and fields it honours, which its `check_params` enforces.

    def check_params(self, params: Any) -> None: ...       # raises ValueError naming the field and the allowed values

    def new_state(self, params: Any) -> Any: ...           # a new request's state, the stage's defaults filled in

    def batch_key(self, state: Any) -> Hashable: ...       # requests with equal keys may share one `decode`

    def take(self, state: Any, piece: Any) -> bool: ...    # validates, appends a piece; returns its `finished`

    def ready(self, state: Any, input_done: bool) -> Optional[Any]: ...  # next chunk; None: wait / nothing left

    # audio per chunk, states moved past them; when it raises, decoding the same chunks again must be safe
    # (the engine retries each chunk alone): Piper moves no state until all are done, code2wav rewrites its own
    def decode(self, states: list, chunks: list) -> list[np.ndarray]: ...

    # A model whose decode is device work may split it: `launch(states, chunks) -> pending` queues it and
    # returns at once, `collect(pending, wait) -> audio` (None while the device works and `wait` is false)
    # moves the states and returns `decode`'s result; with `asynchronous = True` the engine then keeps one
    # batch in flight (below) instead of calling `decode`.

    def sample_rate(self, state: Any) -> int: ...          # Hz of the request's audio

    def prompt(self, state: Any) -> tuple[Optional[str], list[int]]: ...  # (text read so far, ids read so far)

    def stats(self) -> dict[str, float]: ...               # the model's counters (seconds per phase, batches)


@dataclass
class _Decoded:
    """A batch whose launch failed, decoded chunk by chunk at once (`CodecEngine._launch`)."""

    batch: CodecBatch                           # the requests whose chunk decoded
    audio: list                                 # their audio, in order


class CodecEngine:
    def __init__(self, model: CodecModel):
        self.model = model
        self.params_type = model.params_type
        self.scheduler = CodecScheduler(self._ready, model.max_batch, bool(getattr(model, "first_chunks_alone", False)))
        self._audio_seconds = 0.0
        self._decode_seconds = 0.0             # wall seconds in `model.decode` (host included), all batches
        self._decoded = [0, 0]                 # batches, chunks decoded
        self._failed: dict[str, str] = {}      # request id -> why it failed; reported (and dropped) by the next step
        self._async = bool(getattr(model, "asynchronous", False))   # launch / collect instead of decode
        self._inflight: Optional[tuple[CodecBatch, Any, float]] = None   # launched batch, its pending, start

    @property
    def requests(self) -> dict[str, CodecRequest]:
        """The unfinished requests by id, in round-robin order."""
        return self.scheduler.requests

    def voices(self) -> list[dict[str, Any]]:
        return self.model.voices()

    @property
    def speech_capabilities(self) -> Optional[dict[str, Any]]:
        """A TTS model's `SpeechCapabilities` (`describe()`d: plain data for any process); None for
        models that declare none (vocoders)."""
        caps = getattr(self.model, "capabilities", None)
        return caps().describe() if callable(caps) else None

    def check_params(self, params: Any) -> None:
        """Raises ValueError for params this stage cannot serve (an unknown voice)."""
        self.model.check_params(params)

    def add_request(self, request_id: str, inputs: Any, params: Any = None,
                    arrival_time: Optional[float] = None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params if params is not None else self.params_type()
        self.model.check_params(params)
        self._report_load()
        state = self.model.new_state(params)
        req = CodecRequest(request_id, state, self.model.batch_key(state),
                           metrics=RequestMetrics(arrival_time=arrival_time or time.time()))
        self._take(req, inputs)
        self.scheduler.add(req)

    def add_input(self, request_id: str, piece: Any) -> None:
        """More input for a streamed request (the last piece has `finished=True`)."""
        req = self.requests.get(request_id)
        if req is not None:                     # an aborted request's late input is dropped
            self._take(req, piece)

    def _take(self, req: CodecRequest, piece: Any) -> None:
        if req.input_done:
            raise ValueError(f"request {req.request_id!r} already received its last input")
        req.input_done = self.model.take(req.state, piece)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self._failed.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> dict[str, float]:
        ready = self.scheduler.num_ready()
        return {"num_running": ready, "num_waiting": len(self.requests) - ready,
                "audio_seconds_total": self._audio_seconds, "decode_seconds_total": self._decode_seconds,
                "decode_batches_total": self._decoded[0], "decode_chunks_total": self._decoded[1],
                **self.model.stats()}

    def _report_load(self) -> None:
        """The model's `on_load` (if it has one) with the requests held now: at each arrival and step."""
        on_load = getattr(self.model, "on_load", None)
        if on_load is not None:
            on_load(len(self.requests))

    def step(self) -> list[StageOutput]:
        self._report_load()                     # the load at each step too (not only at each arrival)
        if self._async:                         # file the batch the device finished, then launch the next
            batch, audio = self._collect()
            reports = self.scheduler.update(batch, audio)
            if self._inflight is None:
                self._launch(self.scheduler.schedule())
                if not len(batch):              # done at once (a CPU): filed in this step, as `decode` would
                    batch, audio = self._collect()
                    if len(batch):
                        reports = self.scheduler.update(batch, audio)
        else:
            batch, audio = self._decode(self.scheduler.schedule())
            reports = self.scheduler.update(batch, audio)
        outputs = []
        for report in reports:
            if report.request.request_id not in self._failed:
                try:
                    outputs.append(self._output(report))
                except Exception as e:
                    self._fail(report.request.request_id, "reporting", e)
        failed, self._failed = self._failed, {}
        for rid, why in failed.items():
            self.scheduler.abort(rid)
            outputs.append(StageOutput.failed(rid, StageError(why)))
        return outputs

    def _ready(self, req: CodecRequest) -> Optional[Any]:
        """The model's next chunk of `req`; None once it failed (its `ready` raising fails it)."""
        if req.request_id in self._failed:
            return None
        try:
            return self.model.ready(req.state, req.input_done)
        except Exception as e:
            self._fail(req.request_id, "preparing the next chunk", e)
            return None

    def _decode(self, batch: CodecBatch) -> tuple[CodecBatch, list[np.ndarray]]:
        """The batch's audio. When the model raises on a batch of several, each chunk is decoded again
        alone: only the requests whose chunk fails alone fail; returns the batch of those that did not."""
        if not len(batch):
            return batch, []
        start = time.perf_counter()
        try:
            return batch, self.model.decode([r.state for r in batch.requests], batch.chunks)
        except Exception as e:
            if len(batch) == 1:
                self._fail(batch.requests[0].request_id, "decoding", e)
                return CodecBatch(), []
            logger.warning("codec batch of %d failed (%s); decoding its chunks one by one", len(batch), e)
        finally:
            self._decode_seconds += time.perf_counter() - start
            self._decoded[0] += 1
            self._decoded[1] += len(batch)
        return self._each_alone(batch)

    def _launch(self, batch: CodecBatch) -> None:
        """Queues the batch's decode (`model.launch`); a launch that raises decodes its chunks one by one now
        and leaves them for the next `_collect`."""
        if not len(batch):
            return
        start = time.perf_counter()
        self._decoded[0] += 1
        self._decoded[1] += len(batch)
        try:
            pending = self.model.launch([r.state for r in batch.requests], batch.chunks)
        except Exception as e:
            logger.warning("codec batch of %d failed at launch (%s); decoding its chunks one by one", len(batch), e)
            pending = _Decoded(*self._each_alone(batch))
        self._inflight = (batch, pending, start)

    def _collect(self) -> tuple[CodecBatch, list[np.ndarray]]:
        """The batch in flight and its audio once the device is done with it (an empty batch before), less
        the requests aborted or failed since its launch; when collecting raises, each chunk is decoded alone."""
        if self._inflight is None:
            return CodecBatch(), []
        batch, pending, start = self._inflight
        if isinstance(pending, _Decoded):       # decoded one by one at launch
            batch, audio = pending.batch, pending.audio
        else:
            try:
                audio = self.model.collect(pending, wait=False)
            except Exception as e:
                logger.warning("codec batch of %d failed (%s); decoding its chunks one by one", len(batch), e)
                batch, audio = self._each_alone(batch)
            if audio is None:
                return CodecBatch(), []
        self._inflight = None
        self._decode_seconds += time.perf_counter() - start
        kept, kept_audio = CodecBatch(), []
        for req, chunk, wav in zip(batch.requests, batch.chunks, audio):
            if self.requests.get(req.request_id) is req and req.request_id not in self._failed:
                kept.requests.append(req)
                kept.chunks.append(chunk)
                kept_audio.append(wav)
        return kept, kept_audio

    def _each_alone(self, batch: CodecBatch) -> tuple[CodecBatch, list[np.ndarray]]:
        """Each chunk of `batch` decoded on its own; the batch of those that did not fail, and their audio."""
        kept, audio = CodecBatch(), []
        for req, chunk in zip(batch.requests, batch.chunks):
            try:
                audio.append(self.model.decode([req.state], [chunk])[0])
            except Exception as e:
                self._fail(req.request_id, "decoding", e)
                continue
            kept.requests.append(req)
            kept.chunks.append(chunk)
        return kept, audio

    def _fail(self, request_id: str, what: str, error: Exception) -> None:
        if request_id not in self._failed:
            logger.warning("codec request %s failed while %s", request_id, what, exc_info=error)
            self._failed[request_id] = f"{what} failed: {type(error).__name__}: {error}"

    def _output(self, report: CodecReport) -> StageOutput:
        req = report.request
        chunk = report.chunk if report.chunk is not None else np.zeros(0, np.float32)
        self._audio_seconds += len(chunk) / self.model.sample_rate(req.state)
        if len(chunk):                          # the stage's own view of a listener's playback
            if req.metrics.audio is None:
                req.metrics.audio = AudioTiming()
            req.metrics.audio.add(time.time(), len(chunk) / self.model.sample_rate(req.state))
        samples = np.concatenate(req.chunks) if req.chunks else np.zeros(0, np.float32)
        prompt, ids = self.model.prompt(req.state)
        out = RequestOutput(request_id=req.request_id, prompt=prompt, prompt_token_ids=list(ids),
                            finished=report.finished, metrics=req.metrics,
                            audio=AudioOutput(samples=samples, sample_rate=self.model.sample_rate(req.state)))
        return StageOutput(req.request_id, out, report.finished, audio_chunk=chunk)
