"""`AsyncOmni`: the asyncio entry point used by the server (event loop + one engine thread).

The engine loop runs in a background thread (model forwards block), taking commands from a queue
between steps (`AddRequest`, `AbortRequest`, `ResetPrefixCache`, `StopEngine`: the event loop's
messages to that thread; the requests queued together are handed to the orchestrator together,
`Orchestrator.add_requests`, so that a stage process prefills them in one step) and pushing each
request's partial outputs to that request's asyncio queue through `loop.call_soon_threadsafe`.
`generate` is an async generator of cumulative `RequestOutput`s; leaving it early (client gone,
task cancelled) aborts the request in the engine. A request that fails raises its own typed error
(`request_error`): refused input, a run-time failure of that request, or `EngineDeadError` when the
engine or a stage holding it is down.
`close` stops the engine thread and ends every request still open with `EngineDeadError`, then
closes the stages (and their processes); a server drains first (`num_requests` says how many are
open). A stage that is down (its process restarting) refuses the requests that need it with
`EngineDeadError` naming it; `stage_states` says which.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional, Union

from omnistage.entrypoints.common import ChatRenderer, Speech, build_orchestrator, default_params_for
from omnistage.entrypoints.progress_log import ProgressLog
from omnistage.outputs import RequestOutput
from omnistage.stage import StageDeadError

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine, or a stage holding the request, is down (the server's 503)."""


def request_error(error: Exception) -> Exception:
    """What `generate` raises for a request the orchestrator failed (`Orchestrator.pop_errors`):
    `EngineDeadError` when a stage holding it went down; its own `ValueError` / `ParamError` when its
    input was refused (a 400); its own `RequestFailedError` when it failed at run time (a 500 with
    that message: the engine is fine, the request is not)."""
    if isinstance(error, StageDeadError):
        return EngineDeadError(str(error))
    return error


@dataclass
class AddRequest:
    """Start a request (event loop -> engine thread)."""

    request_id: str
    prompt: Any                                 # as given to `generate`: text, token ids or a prompt dict
    params: Any                                 # the entry stage's params; None = its default
    stage_params: Optional[list]                # params per stage (`sampling_params_list`); None = from the spec
    entry_stage: Optional[str]                  # the stage the request starts at; None = the first
    arrival_time: float                         # time.time() when `generate` was called
    accepted: asyncio.Future                    # resolved once the orchestrator took it; its exception if refused


@dataclass
class AbortRequest:
    """Drop a request at the next step boundary (event loop -> engine thread)."""

    request_id: str                             # a request added before; unknown ids are ignored


@dataclass
class ResetPrefixCache:
    """Drop the prefix cache of every AR stage between two steps (event loop -> engine thread)."""

    done: asyncio.Future                        # resolved with {stage name: cached blocks forgotten}


@dataclass
class StopEngine:
    """Close the orchestrator and end the engine thread (sent once, by `close`)."""

    reason: str                                 # the error message requests still open end with


Command = Union[AddRequest, AbortRequest, ResetPrefixCache, StopEngine]


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:                                    # the loop is closed: nobody is left to read it
            pass


class AsyncOmni:
    def __init__(self, model: Optional[str] = None, device: str = "auto", dtype: str = "auto", **engine_kwargs):
        self.orchestrator = build_orchestrator(model, device, dtype, **engine_kwargs)
        self._renderer = ChatRenderer(self.orchestrator)
        self.speech = Speech(self.orchestrator, self._renderer)   # text -> speech requests (speech routes)
        self._commands: "queue.Queue[Command]" = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stats = self.orchestrator.stats()
        self._closed = False
        self._stop_reason = ""                                  # StopEngine.reason, once received
        self.errored: Optional[BaseException] = None
        self.output_hooks: list[Callable[[RequestOutput, float], None]] = []  # e.g. metrics, called per output
        self.output_hooks.append(ProgressLog().on_output)      # progress lines of long requests (INFO)
        self._thread = threading.Thread(target=self._loop, name="omnistage-engine", daemon=True)
        self._thread.start()

    # ---- public --------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.orchestrator.tokenizer

    @property
    def max_model_len(self) -> Optional[int]:
        return self.orchestrator.max_model_len

    @property
    def main_stage_kind(self) -> str:
        return self.orchestrator.spec.main_stage.kind

    @property
    def sampling_defaults(self) -> dict:
        """The main stage's default request params (field -> value: the model's generation-config
        defaults); a request's own fields win over them."""
        return dict(self.orchestrator.spec.main_stage.params)

    def default_params(self, entry_stage: Optional[str] = None):
        return default_params_for(self.orchestrator, entry_stage)()

    @property
    def output_modalities(self) -> list[str]:
        """What a request entering at the main stage may ask for, e.g. ["text", "audio"]."""
        return self.orchestrator.spec.output_modalities()

    @property
    def speech_stage(self) -> Optional[str]:
        """Name of the stage that turns text into speech (entry stage for /v1/audio/speech), or None."""
        return self.speech.stage

    @property
    def speaks(self) -> bool:
        """True when /v1/audio/speech is served: a TTS stage, or a model that reads aloud (omni)."""
        return self.speech.available

    def voices(self) -> list[dict]:
        """Voices of the speech stage: [{id, name, sample_rate, language, ...}] (empty without one)."""
        speech = self.speech_stage
        if speech is not None:
            return self.orchestrator.stages[speech].voices()
        found = self.orchestrator.stage_for("audio")
        return found[1].voices() if found is not None and hasattr(found[1], "voices") else []

    @property
    def media_types(self) -> tuple[str, ...]:
        """Kinds of chat content parts besides text that the model reads ("image", "audio", "video")."""
        return self._renderer.media_types

    @property
    def tool_parser(self) -> Optional[str]:
        """The tool-call format the model's registry entry declares ("hermes", "llama3_json"), or None."""
        return self._renderer.tool_parser

    def render_chat(self, messages, chat_template_kwargs: Optional[dict] = None,
                    tools: Optional[list[dict]] = None) -> dict:
        """Messages -> the main stage's inputs (media parts decoded already; may run encoders: call
        it off the event loop when there is media); `tools` are shown to the chat template."""
        return self._renderer(messages, chat_template_kwargs, tools)

    def stats(self) -> dict[str, float]:
        """Engine gauges as of the last step (running, waiting, kv_cache_usage, ...)."""
        return dict(self._stats)

    @property
    def num_requests(self) -> int:
        """Requests a caller is still reading (`generate` not finished), queued or running."""
        return len(self._streams)

    def stage_states(self) -> dict[str, str]:
        """Stage name -> "ready" | "restarting" | "failed" (empty once closed)."""
        orch = self.orchestrator
        return orch.stage_states() if orch is not None else {}

    def replica_states(self) -> dict[str, list[str]]:
        """Stage name -> each replica's state, for stages with `num_replicas` > 1 (empty once closed)."""
        orch = self.orchestrator
        return orch.replica_states() if orch is not None else {}

    async def generate(self, prompt: Any, params: Any = None, request_id: Optional[str] = None, *,
                       sampling_params_list: Optional[list] = None,
                       entry_stage: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        """Partial outputs of one request. `entry_stage` starts it at another stage than the first
        (e.g. `speech_stage` to speak a text); a dict prompt may carry `modalities` and `voice`."""
        if self.errored is not None:
            raise EngineDeadError(f"the engine stopped: {self.errored!r}")
        if self._closed:
            raise EngineDeadError("the engine is closed")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        accepted = asyncio.get_running_loop().create_future()
        self._commands.put(AddRequest(request_id, prompt, params, sampling_params_list, entry_stage, time.time(),
                                      accepted))
        finished = False
        try:
            await accepted                                      # raises ValueError for a bad request
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(AbortRequest(request_id))

    async def abort(self, request_id: str) -> None:
        self._commands.put(AbortRequest(request_id))

    async def reset_prefix_cache(self) -> dict[str, int]:
        """Drops every AR stage's prefix cache between two engine steps; requests in flight go on.
        Returns stage name -> cached blocks forgotten."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        done = asyncio.get_running_loop().create_future()
        self._commands.put(ResetPrefixCache(done))
        return await done

    def close(self, reason: str = "the engine was closed before this request finished") -> None:
        """Stops the engine: requests still open end with `EngineDeadError(reason)`; stage processes stop."""
        if not self._closed:
            self._closed = True
            self._commands.put(StopEngine(reason))
            self._thread.join(timeout=30)
            if not self._thread.is_alive():
                self._fail_open_requests("the engine is closed")    # callers that raced the close

    # ---- engine thread -------------------------------------------------------------------------
    def _resolve(self, fut: asyncio.Future, exc: Optional[BaseException], result: Any = None) -> None:
        def done():
            if not fut.done():
                fut.set_exception(exc) if exc else fut.set_result(result)
        try:
            fut.get_loop().call_soon_threadsafe(done)
        except RuntimeError:                                    # the loop is closed: nobody waits any more
            pass

    def _handle(self, cmd: Command) -> bool:
        """Runs one command; False once told to stop."""
        if isinstance(cmd, StopEngine):
            self._stop_reason = cmd.reason
            return False
        if isinstance(cmd, AbortRequest):
            if cmd.request_id in self.orchestrator.routes:      # still running: its caller left
                logger.warning("request %s aborted: its caller left (client disconnected, job deleted or "
                               "cancelled)", cmd.request_id)
            self.orchestrator.abort(cmd.request_id)
            return True
        if isinstance(cmd, ResetPrefixCache):
            try:
                self._resolve(cmd.done, None, self.orchestrator.reset_prefix_cache())
            except Exception as e:                              # e.g. a stage process is restarting
                self._resolve(cmd.done, e)
            return True
        adds, after = [cmd], None
        while after is None:                # every request queued behind it joins it (one prefill step)
            try:
                queued = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(queued, AddRequest):
                adds.append(queued)
            else:
                after = queued
        self._add(adds)
        return True if after is None else self._handle(after)

    def _add(self, adds: list[AddRequest]) -> None:
        """Hands the requests to the orchestrator at once (`Orchestrator.add_requests`) and tells each
        caller whether its request was taken."""
        live = []
        for cmd in adds:
            if cmd.request_id in self._streams:
                live.append(cmd)
            else:                                               # the caller left before we started
                self._resolve(cmd.accepted, None)
        errors = self.orchestrator.add_requests([
            dict(request_id=c.request_id, inputs=c.prompt, params=c.params, stage_params=c.stage_params,
                 arrival_time=c.arrival_time, entry_stage=c.entry_stage) for c in live])
        for cmd, e in zip(live, errors):
            if isinstance(e, StageDeadError):                   # a stage it needs is restarting: 503
                e = EngineDeadError(str(e))
            self._resolve(cmd.accepted, e)                      # None, or a bad request: only that caller

    @property
    def is_running(self) -> bool:
        """True while the engine thread serves requests (False once closed or dead)."""
        return self._thread.is_alive() and not self._closed and self.errored is None

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as e:                              # the engine is dead: say so to everyone
            logger.exception("engine thread died")
            self.errored = e
            self._fail_open_requests(f"the engine stopped: {e!r}")

    def _fail_open_requests(self, reason: str) -> None:
        """Ends every open request, and every one about to be accepted, with EngineDeadError(reason)."""
        for stream in list(self._streams.values()):
            stream.put(EngineDeadError(reason))
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, AddRequest):
                self._resolve(cmd.accepted, EngineDeadError(reason))
            elif isinstance(cmd, ResetPrefixCache):
                self._resolve(cmd.done, EngineDeadError(reason))

    def _step_failed(self, error: Exception) -> None:
        """An engine-level failure: the orchestrator's step raised outside any one stage (a stage
        whose step raises fails only the requests it holds, inside the orchestrator). The requests
        the orchestrator holds fail with it; streams whose request it does not hold (not added yet)
        are untouched, and the engine serves on."""
        logger.error("engine step failed", exc_info=error)
        for rid in list(self.orchestrator.routes):
            self.orchestrator.abort(rid)
            stream = self._streams.get(rid)
            if stream is not None:
                stream.put(RuntimeError(f"engine step failed: {error!r}"))

    def _serve(self) -> None:
        running = True
        while running:
            block = not self.orchestrator.has_unfinished()
            try:
                cmd = self._commands.get(block=block, timeout=0.5 if block else None) if block \
                    else self._commands.get_nowait()
                running = self._handle(cmd)
                if running:
                    self._stats = self.orchestrator.stats()
                continue
            except queue.Empty:
                if block:
                    continue
            try:
                outputs = self.orchestrator.step()
            except Exception as e:                              # the orchestrator itself broke (stages fail alone)
                self._step_failed(e)
                outputs = []                                    # requests it failed before still hear why
            self._stats = self.orchestrator.stats()
            for rid, error in self.orchestrator.pop_errors():   # failed requests: each with its own error
                stream = self._streams.get(rid)
                if stream is not None:
                    stream.put(request_error(error))
            now = time.time()
            for out in outputs:
                for hook in self.output_hooks:
                    try:
                        hook(out, now)
                    except Exception:                           # a broken observer must not stop serving
                        logger.exception("output hook failed")
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put(out)
        self._fail_open_requests(self._stop_reason)
        orch, self.orchestrator = self.orchestrator, None
        orch.close()
