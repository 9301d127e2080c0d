"""`StageClient`: one stage engine in its own process, behind the `StageEngine` interface.

The orchestrator's process holds the client; `python -m omnistage.pipeline.stage_client CMD OUT CHK`
is the stage's process, started on this host or under a Ray actor (`pipeline.launch`). Control
messages (`pipeline.stage_messages`) go over zmq sockets (commands in, outputs out, checks; ipc files,
or tcp for a Ray actor), encoded by `pipeline.wire` (msgspec; arrays through shared memory, or inline
when the process runs on another host). One client is one replica; `pipeline.replicas` balances several.
The stage process steps its engine whenever it has work, so it runs concurrently with the other
stages; `step()` here only collects what it has produced. `add_request` and the optional
`check_params` and `reset_prefix_cache` are round trips, so a bad request raises here as it would in-process, a
`ParamError` with its field (check verdicts and results are remembered per params value; checks go
over their own channel, answered by a thread of the stage process even mid-step, so any thread may
check: the HTTP routes do it on the event loop); `add_requests` is one round trip for a batch of new
requests (one message: the process takes them all between the same two steps, and a refusal stays
its request's); `submit`
(add_request for requests handed on by an upstream stage), `add_input` and `abort` are one-way, so
the orchestrator never waits for a busy downstream stage; `voices` is read once at start, as are
what entry points read of a main stage (`max_model_len`, and the `tokenizer`, loaded here from the
folder the stage's tokenizer came from) and the engine's plain `_ATTRIBUTES` (a diffusion stage's
`output_kind`, `takes_image`, ...). The client's sockets are used from the orchestrator's thread only.

When the stage process dies, every request it held gets a finished `StageOutput` whose `error`
is fatal at once (the orchestrator fails just those requests, and the server answers 503), and a
fresh process starts in the background: `step()` polls it, never waits for it, so the other stages
keep stepping. While it loads, `state` is "restarting" and the client refuses work (`add_request`
raises `StageDeadError` naming the stage; a request handed on by `submit` comes back failed); once
it is ready `state` is "ready" again (`last_recovery_s` says how long that took), and after
`max_restart_attempts` failed starts in a row it is "failed". The stage process ignores SIGINT and
SIGTERM: a signal to the whole process group (Ctrl-C, systemd) must not cut the requests the server
is draining; it exits on `StopStage` or when the orchestrator's process is gone. A step
that raises in the stage process fails only the requests the engine holds (finished
`StageOutput`s with a non-fatal `error`), and an output that cannot be encoded fails only its
request; the process serves on.
"""

from __future__ import annotations

import copy
import importlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Optional

import zmq

from omnistage.outputs import RequestOutput
from omnistage.pipeline import wire
from omnistage.pipeline.output_deltas import DeltaPacker, DeltaUnpacker
from omnistage.pipeline.step_profiler import StepProfiler
from omnistage.pipeline.stage_messages import (CallError, CallReply, CallStage, InitStage, StageFatal, StageOutputs,
                                               StageReady, StageStarting, StopStage)
from omnistage.stage import StageDeadError, StageError, StageOutput, add_each

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 100                             # stage process: wait for commands when it has no work
_WAIT_MS = 5                                    # orchestrator: wait at most this long for any stage process
_OPTIONAL = ("add_input", "check_params", "voices", "reset_prefix_cache")
# plain attributes of an engine that entry points read (a diffusion stage: what it makes and takes and
# its limits and what its speed features chose at load; a TTS stage: its speech capabilities)
_ATTRIBUTES = ("output_kind", "takes_image", "takes_mask", "default_fps", "limits", "speech_capabilities",
               "speed_info")
STATES = ("ready", "restarting", "failed")      # what `StageClient.state` may say


class StageClient:
    def __init__(self, spec, start_timeout_s: float = 180.0, max_restart_attempts: int = 3,
                 replica: Optional[int] = None, wait: bool = True):
        """`replica`: this client's index among its stage's replicas (None: the stage has one).
        `wait=False` returns once the process is spawned: `wait_started()` then waits for it to be
        ready (the orchestrator starts every stage process before waiting for any)."""
        from omnistage.pipeline.launch import launcher_for

        self.spec = spec
        self.label = repr(spec.name) if replica is None else f"{spec.name!r} (replica {replica})"
        self._launcher = launcher_for(spec)     # where the stage process runs: this host or a Ray actor
        self.start_timeout_s = start_timeout_s
        self.max_restart_attempts = max_restart_attempts
        self._ctx = zmq.Context()
        self._dir = tempfile.mkdtemp(prefix="omnistage-stage-")
        self._seq = 0
        self._generation = 0
        self._held: set[str] = set()            # requests the stage process holds
        self._ready: list[StageOutput] = []     # outputs received while waiting for a reply
        self._deltas = DeltaUnpacker()          # the cumulative outputs the process sends as deltas
        self._stats: dict[str, float] = {}
        self._checked: dict[bytes, tuple] = {}  # wire.fingerprint(params) -> check_params (error or None, result)
        self._state = "ready"                   # one of STATES; see `state`
        self._down_since = 0.0                  # time.monotonic() the process was found dead
        self._attempts = 0                      # starts tried since it died
        self._failure: Optional[str] = None     # why the last start failed
        self.restarts = 0                       # how many times the stage process was replaced
        self.last_recovery_s: Optional[float] = None   # seconds from the last death to ready again
        self.proc: Optional[subprocess.Popen] = None
        self._chk: Optional[zmq.Socket] = None  # check_params channel, usable from any thread (under the lock)
        self._check_lock = threading.Lock()
        self.spawned_at = time.monotonic()      # when the first process was started ...
        self.ready_at: Optional[float] = None   # ... and when it said it is ready (`wait_started`)
        try:
            self._spawn()
        except BaseException:
            self.close()
            raise
        if wait:
            self.wait_started()

    def wait_started(self) -> None:
        """Waits until the first stage process is ready and reads what it reports (once); on a failed
        start the client is closed and the error raised."""
        if self.ready_at is not None:
            return
        try:
            ready = None
            while ready is None:
                ready = self._poll_start(100)
        except BaseException:
            self.close()
            raise
        self.ready_at = time.monotonic()
        self._voice_list = ready.voices or []   # read once: other threads may ask for it
        self.params_type = _import(ready.params_type) if ready.params_type else None
        self.max_model_len = ready.max_model_len
        self.tokenizer = None
        if ready.tokenizer:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(ready.tokenizer)
        for name, value in ready.attributes.items():
            setattr(self, name, value)
        for name in _OPTIONAL:                  # offer only the optional verbs the engine has
            if name in ready.methods:
                setattr(self, name, getattr(self, "_" + name))

    # ---- process management ---------------------------------------------------------------------
    def _spawn(self) -> None:
        """Starts a stage process and sends it the stage to build; `_poll_start` says when it is ready."""
        self._generation += 1
        self._launcher.prepare(self.start_timeout_s)
        self._inline = self._launcher.remote    # another host: arrays inline in the messages
        base = os.path.join(self._dir, f"{self.spec.name}-{self._generation}")
        self._cmd = self._ctx.socket(zmq.PUSH)
        self._out = self._ctx.socket(zmq.PULL)
        cmd, out = self._bind(self._cmd, base, "cmd"), self._bind(self._out, base, "out")
        with self._check_lock:                  # a check in another thread may still hold the old socket
            if self._chk is not None:
                self._chk.close()
            self._chk = self._ctx.socket(zmq.REQ)
            self._chk.setsockopt(zmq.REQ_RELAXED, 1)    # a request left unanswered by a dead process
            self._chk.setsockopt(zmq.REQ_CORRELATE, 1)  # does not block the next one
            chk = self._bind(self._chk, base, "chk")
        self.proc = self._launcher.start(["-m", "omnistage.pipeline.stage_client", cmd, out, chk]
                                         + (["inline"] if self._inline else []))
        init = InitStage(self._launcher.stage_spec(self.spec))
        self._init: Optional[bytes] = wire.encode(init, self._inline)   # sent by `_poll_start`
        self._deadline = time.monotonic() + self.start_timeout_s
        self._start_step: Optional[tuple[str, float]] = None   # the process's last `StageStarting`, when

    def _bind(self, sock: zmq.Socket, base: str, name: str) -> str:
        """Binds `sock` where the launcher's process can reach it; the endpoint to connect to."""
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self._launcher.endpoint(base, name))
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def _poll_start(self, timeout_ms: int) -> Optional[StageReady]:
        """The starting process's `StageReady`, or None while it still loads (waits up to `timeout_ms`);
        RuntimeError when it cannot start (it said why, exited, or took longer than `start_timeout_s`)."""
        if self._init is not None:              # a PUSH socket blocks until the process has connected
            try:
                self._cmd.send(self._init, zmq.NOBLOCK)
                self._init = None
            except zmq.Again:
                pass
        if self._out.poll(timeout_ms):
            msg = wire.decode(self._out.recv())
            if isinstance(msg, StageFatal):
                raise RuntimeError(f"stage {self.label} failed to start: {msg.message}")
            if isinstance(msg, StageStarting):
                self._start_step = (msg.message, time.monotonic())
            return msg if isinstance(msg, StageReady) else None
        if self.proc.poll() is not None:
            raise RuntimeError(f"stage {self.label} process exited with {self.proc.returncode} at start"
                               f"{self._last_step()}")
        if time.monotonic() > self._deadline:
            self._stop_process(0)
            raise RuntimeError(f"stage {self.label} did not start in {self.start_timeout_s:.0f} s"
                               f"{self._last_step()}; its process was stopped")
        return None

    def _last_step(self) -> str:
        """Where a start that failed had got to, for its error message."""
        if self._start_step is None:
            return " (it reported no start-up step: still starting Python / importing)"
        message, at = self._start_step
        return f" (its last start-up step, {time.monotonic() - at:.0f} s before: {message})"

    @property
    def state(self) -> str:
        """"ready", "restarting" (its process died; a new one loads) or "failed" (it could not be
        restarted). Safe to read from any thread; a death not yet noticed by `step` reads "restarting"."""
        if self._state == "ready" and self.proc is not None and self.proc.poll() is not None:
            return "restarting"
        return self._state

    @property
    def unavailable(self) -> Optional[str]:
        """Why the stage takes no requests now (names it, says what to do), or None when it does."""
        state = self.state
        if state == "restarting":
            return f"stage {self.label} is restarting after its process died; try again in a few seconds"
        if state == "failed":
            return f"stage {self.label} is down: {self._failure}; restart the server"
        return None

    def _on_death(self) -> None:
        """The stage process is gone: fail every request it held now and start a new one in the background."""
        reason = f"stage {self.label} process died (exit code {self.proc.returncode}); it is being restarted"
        logger.error(reason)
        self._ready.extend(_failed(rid, reason) for rid in sorted(self._held))
        self._held.clear()
        self._deltas.clear()
        self._down_since = time.monotonic()
        self._attempts = 0
        self._respawn()

    def _respawn(self) -> None:
        self._stop_process(0)
        self._cmd.close()
        self._out.close()
        self._attempts += 1
        self._state = "restarting"
        try:
            self._spawn()
        except Exception as e:                  # e.g. no memory left for a process
            self._give_up(f"it could not be started: {e!r}")

    def _advance_restart(self) -> None:
        """One look at the process being started (never waits): ready, retry, or give up."""
        try:
            ready = self._poll_start(0)
        except RuntimeError as e:
            logger.error("%s (attempt %d of %d)", e, self._attempts, self.max_restart_attempts)
            if self._attempts >= self.max_restart_attempts:
                self._give_up(str(e))
            else:
                self._respawn()
            return
        if ready is not None:
            self._state = "ready"
            self.restarts += 1
            self.last_recovery_s = time.monotonic() - self._down_since
            logger.warning("stage %s is back after %.1f s (restart %d)", self.label, self.last_recovery_s,
                           self.restarts)

    def _give_up(self, why: str) -> None:
        self._state, self._failure = "failed", why
        logger.error("stage %s is down for good: %s", self.label, why)

    def _stop_process(self, grace_s: float) -> None:
        """Stops the stage process: `StopStage` and up to `grace_s` to exit, then SIGKILL."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self._cmd.send(wire.encode(StopStage(), self._inline), zmq.NOBLOCK)
            self.proc.wait(timeout=grace_s)
        except Exception:
            self.proc.kill()
            self.proc.wait(timeout=5)

    def close(self) -> None:
        try:
            self._stop_process(5)
            self._launcher.close()
        finally:
            self._ctx.destroy(linger=0)
            shutil.rmtree(self._dir, ignore_errors=True)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ---- messages -------------------------------------------------------------------------------
    def _send(self, command: Any) -> bool:
        """Sends a command; False when the process turned out dead (its requests are failed and a
        new one starts). A PUSH socket whose peer died blocks a plain send for ever: never wait on it."""
        data = wire.encode(command, self._inline)
        while True:
            try:
                self._cmd.send(data, zmq.NOBLOCK)
                return True
            except zmq.Again:                   # no peer, or its queue is full
                if self.proc.poll() is not None:
                    self._on_death()
                    return False
                self._cmd.poll(10, zmq.POLLOUT)

    def _receive(self, msg: Any) -> None:
        if isinstance(msg, StageOutputs):
            self._stats = msg.stats
            outs = self._deltas.unpack(msg.outputs, msg.deltas, self._held)
            for out in outs:
                if out.finished:
                    self._held.discard(out.request_id)
            self._ready.extend(outs)

    def _call(self, method: str, *args) -> Any:
        """A round trip: the stage runs `method(*args)` between two steps and answers."""
        self._seq += 1
        seq = self._seq
        if self.unavailable is not None or not self._send(CallStage(seq, method, list(args))):
            raise StageDeadError(self.unavailable)
        while True:
            if self._out.poll(50):
                msg = wire.decode(self._out.recv())
                if isinstance(msg, CallReply) and msg.seq == seq:
                    if msg.error is not None:
                        raise msg.error.exception()
                    return msg.result
                self._receive(msg)
            elif self.proc.poll() is not None:
                self._on_death()
                raise StageDeadError(self.unavailable)

    # ---- StageEngine ----------------------------------------------------------------------------
    def add_request(self, request_id: str, inputs: Any, params: Any, arrival_time: Optional[float] = None) -> None:
        [error] = self.add_requests([(request_id, inputs, params, arrival_time)])
        if error is not None:
            raise error

    def add_requests(self, requests: list[tuple]) -> list[Optional[Exception]]:
        """`add_request` for each (request_id, inputs, params, arrival_time), in one message and one
        reply: the stage process takes all of them between the same two steps, so requests that
        arrive together are prefilled in one step. Per request: None (taken), why it was refused
        (each alone: `ParamError`, `ValueError`), or `StageDeadError` for all when the process is
        down or died before answering (the ones it took are lost with it). One message, not one per
        request: a process that died between two sends would leave replies awaited for ever on the
        sockets of its replacement."""
        try:
            verdicts = self._call("add_requests", [list(r) for r in requests])
        except StageDeadError as e:
            return [e] * len(requests)
        errors: list[Optional[Exception]] = []
        for (request_id, *_), verdict in zip(requests, verdicts):
            errors.append(verdict.exception() if verdict is not None else None)
            if verdict is None:
                self._held.add(request_id)
        return errors

    def submit(self, request_id: str, inputs: Any, params: Any, arrival_time: Optional[float] = None) -> None:
        """`add_request` without waiting for the stage process (it may be mid-step): for requests
        handed on by an upstream stage. A refusal comes back as a finished output whose
        `error` says why (the orchestrator fails the request with it), as does a stage that is down."""
        command = CallStage(0, "add_request", [request_id, inputs, params, arrival_time])
        if self.unavailable is not None or not self._send(command):
            self._ready.append(_failed(request_id, self.unavailable))
            return
        self._held.add(request_id)

    def _add_input(self, request_id: str, piece: Any) -> None:
        if request_id in self._held:
            self._send(CallStage(0, "add_input", [request_id, piece]))

    def _check_params(self, params: Any) -> Any:
        """A round trip the first time a params value is seen; its verdict and result (a diffusion
        stage's resolved params) are remembered (checks are pure functions of the params: a voice
        name, ODE settings, sizes)."""
        key = wire.fingerprint(params)          # e.g. a TTSParams' reference audio: no shared memory for a key
        if key in self._checked:
            verdict, result = self._checked[key]
        else:
            verdict, result = None, None
            try:
                result = self._check_call(params)
            except ValueError as e:
                verdict = CallError.of(e)
            if len(self._checked) < 1024:
                self._checked[key] = (verdict, result)
        if verdict is not None:
            raise verdict.exception()
        return copy.copy(result)                # a copy per caller: the remembered one stays as it was

    def _check_call(self, params: Any) -> Any:
        """`check_params` over the check channel, answered by a thread of the stage process at once
        (mid-step too), so that any thread may ask: the server's event loop does, for the image and
        video routes. The stage's engine's check is a pure function of the params."""
        with self._check_lock:
            proc, sock = self.proc, self._chk
            sock.send(wire.encode(CallStage(1, "check_params", [params]), self._inline))
            while not sock.poll(50):
                if proc.poll() is not None:     # the engine thread restarts it
                    raise RuntimeError(f"stage {self.label} process died; try again")
            reply = wire.decode(sock.recv())
        if reply.error is not None:
            raise reply.error.exception()
        return reply.result

    def _reset_prefix_cache(self) -> int:
        return self._call("reset_prefix_cache")

    def _voices(self) -> list:
        return list(self._voice_list)

    def abort(self, request_id: str) -> None:
        if request_id in self._held:
            self._held.discard(request_id)
            self._deltas.forget(request_id)
            self._send(CallStage(0, "abort", [request_id]))

    @property
    def placement(self) -> tuple[Optional[str], bool]:
        """(the Ray node id its process runs on, None without Ray; whether that is another node)."""
        return getattr(self._launcher, "node_id", None), self._launcher.remote

    @property
    def in_flight(self) -> int:
        """Requests the stage process holds (added, not yet finished, failed or aborted)."""
        return len(self._held)

    def has_unfinished(self) -> bool:
        """Requests held or outputs to collect, or a process to (re)start: `step` has something to do."""
        return bool(self._held) or bool(self._ready) or self.state == "restarting"

    def stats(self) -> dict[str, float]:
        return dict(self._stats)

    def step(self) -> list[StageOutput]:
        """What the stage process has sent since the last call (never waits: see `wait_any`); notices
        a dead process and moves a restart along."""
        if self._state == "ready":
            while self._out.poll(0):
                self._receive(wire.decode(self._out.recv()))
            if self.proc.poll() is not None:
                self._on_death()
        elif self._state == "restarting":
            self._advance_restart()
        outs, self._ready = self._ready, []
        return outs


def _failed(request_id: str, reason: str) -> StageOutput:
    """The last output of a request that a stage process lost or could not take: a fatal error."""
    return StageOutput(request_id, RequestOutput(request_id, finished=True), True,
                       error=StageError(reason, fatal=True))


def wait_any(clients: list[Any], timeout_ms: int = _WAIT_MS) -> None:
    """Blocks until one of the clients' stage processes has sent something (or `timeout_ms`), so an
    orchestrator whose work all sits in stage processes sleeps instead of spinning (`clients`: stage
    clients or replica sets)."""
    clients = [r for c in clients for r in getattr(c, "replicas", [c])]   # a ReplicaSet's clients
    if any(c._ready for c in clients):
        return
    poller = zmq.Poller()
    for c in clients:
        if c.state == "ready":                  # a restarting one's socket may be closed
            poller.register(c._out, zmq.POLLIN)
    poller.poll(timeout_ms)


def _import(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


# ---- the stage's process --------------------------------------------------------------------------
def _answer_checks(ctx: zmq.Context, addr: str, engine: Any) -> None:
    """The stage process's check thread: `engine.check_params` for every request on the check channel."""
    sock = ctx.socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    while True:
        msg = wire.decode(sock.recv())
        try:
            reply = CallReply(msg.seq, engine.check_params(*msg.args))
        except Exception as e:                  # a refusal (ParamError keeps its field) or a bug: both answered
            reply = CallReply(msg.seq, error=CallError.of(e))
        sock.send(wire.encode(reply))


class _StartSteps(logging.Handler):
    """Sends the INFO (and louder) log records of the stage's build, made in the serving thread, to the
    client as `StageStarting` messages (the out socket belongs to that thread)."""

    def __init__(self, out: Any):
        super().__init__(logging.INFO)
        self.out = out
        self.thread = threading.get_ident()

    def send(self, message: str) -> None:
        self.out.send(wire.encode(StageStarting(message)))

    def emit(self, record: logging.LogRecord) -> None:
        if threading.get_ident() == self.thread:
            try:
                self.send(record.getMessage())
            except Exception:                   # a log line must never fail the start
                pass


def _serve(cmd_addr: str, out_addr: str, chk_addr: Optional[str] = None, inline: Optional[str] = None) -> None:
    """The stage process's loop; `inline` ("inline"): the orchestrator is on another host (`wire`)."""
    wire.set_inline_default(inline == "inline")
    ctx = zmq.Context()
    cmd, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    cmd.connect(cmd_addr)
    out.connect(out_addr)
    parent = os.getppid()
    for sig in (signal.SIGINT, signal.SIGTERM):  # the orchestrator's process decides when to stop
        signal.signal(sig, signal.SIG_IGN)
    spec = wire.decode(cmd.recv()).spec     # an InitStage
    steps = _StartSteps(out)                    # the build's log lines go to the client as it starts
    logging.getLogger("omnistage").addHandler(steps)
    try:
        from omnistage.pipeline.build import build_engine

        if spec.engine.device == "cpu":         # leave a core to the other processes, as in-process stages do
            spec.engine.apply_cpu_threads()
        steps.send(f"building the {spec.kind} engine on {spec.engine.device}")
        engine = build_engine(spec)             # the engine itself, here
    except Exception as e:
        out.send(wire.encode(StageFatal(repr(e))))
        return
    finally:
        logging.getLogger("omnistage").removeHandler(steps)
    if chk_addr is not None and hasattr(engine, "check_params"):
        threading.Thread(target=_answer_checks, args=(ctx, chk_addr, engine), name="stage-checks",
                         daemon=True).start()
    ptype = getattr(engine, "params_type", None)
    out.send(wire.encode(StageReady(
        params_type=f"{ptype.__module__}:{ptype.__qualname__}" if ptype else None,
        methods=[m for m in _OPTIONAL if hasattr(engine, m)],
        voices=engine.voices() if hasattr(engine, "voices") else None,
        max_model_len=getattr(engine, "max_model_len", None),
        tokenizer=getattr(getattr(engine, "tokenizer", None), "name_or_path", None),
        attributes={name: getattr(engine, name) for name in _ATTRIBUTES if hasattr(engine, name)})))
    held: set[str] = set()                      # requests the engine holds (added, not finished or aborted)
    deltas = DeltaPacker()                      # what was sent of each request's cumulative output
    profiler = StepProfiler.from_env(spec.name)  # OMNISTAGE_TORCH_PROFILER_DIR: tables of some steps
    try:
        _loop(engine, cmd, out, parent, spec.name, held, deltas, profiler)
    finally:
        if profiler is not None:
            profiler.close()


def _loop(engine: Any, cmd: Any, out: Any, parent: int, name: str, held: set[str], deltas: DeltaPacker,
          profiler: Optional[StepProfiler]) -> None:
    """Commands between steps, and a step whenever the engine has work, until `StopStage` (or the
    orchestrator's process is gone)."""
    sent = 0
    while os.getppid() == parent:               # the orchestrator's process is gone: stop too
        wait = 0 if engine.has_unfinished() else _IDLE_POLL_MS
        while cmd.poll(wait):
            msg = wire.decode(cmd.recv())
            if isinstance(msg, StopStage):
                return
            try:
                if msg.method == "add_requests":
                    result, error = _add_all(engine, held, *msg.args), None
                else:
                    result, error = getattr(engine, msg.method)(*msg.args), None
                if msg.method == "add_request":
                    held.add(msg.args[0])
                elif msg.method == "abort":
                    held.discard(msg.args[0])
                    deltas.forget(msg.args[0])
            except Exception as e:              # a bad request: tell the caller, keep serving
                result, error = None, CallError.of(e)
                if msg.seq == 0:
                    logger.warning("stage %s: %s failed: %s", name, msg.method, e)
                    if msg.method in ("add_request", "add_input"):   # one-way: the request fails downstream
                        rid = msg.args[0]
                        engine.abort(rid)
                        lost = StageOutput(rid, RequestOutput(rid, finished=True), True,
                                           error=StageError(f"stage {name!r}: {e}", refused=error.bad_request,
                                                            field=error.field))
                        out.send(wire.encode(StageOutputs([lost], engine.stats())))
            if msg.seq:
                out.send(wire.encode(CallReply(msg.seq, result, error)))
            wait = 0
        if engine.has_unfinished():
            if profiler is None:
                had = _step_and_send(engine, out, held, name, deltas)
            else:                               # the step and its send, as the stage runs them
                had = profiler.run(lambda: _step_and_send(engine, out, held, name, deltas))
            sent += had
            if had and sent % 256 == 0 and "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
                sys.modules["torch"].cuda.ipc_collect()   # free blocks whose CUDA IPC readers are done


def _add_all(engine: Any, held: set[str], requests: list[list]) -> list[Optional[CallError]]:
    """`engine.add_request(*args)` for each of `requests` (a `StageClient.add_requests` batch); per
    request None, or why the engine refused it (the others are taken all the same)."""
    errors = add_each(engine, requests)
    held.update(args[0] for args, e in zip(requests, errors) if e is None)
    return [None if e is None else CallError.of(e) for e in errors]


def _step_and_send(engine: Any, out: Any, held: set[str], name: str, deltas: DeltaPacker) -> int:
    """One step and its outputs sent; 1 when it had outputs, else 0."""
    outs = _step(engine, held, name)
    if not outs:
        return 0
    _send_outputs(out, engine, outs, held, deltas)
    return 1


def _step(engine: Any, held: set[str], name: str) -> list[StageOutput]:
    """One engine step. A step that raises fails every request the engine holds, each reported as a
    finished output with its error (a run-time failure, not a dead stage); the process serves on."""
    try:
        outs = engine.step()
    except Exception as e:
        logger.exception("stage %s: step failed; failing the %d requests it holds", name, len(held))
        why = StageError(f"stage {name!r} failed this step: {type(e).__name__}: {e}")
        outs = [StageOutput.failed(rid, why) for rid in sorted(held)]
        for failed in outs:
            engine.abort(failed.request_id)
    for o in outs:
        if o.finished:
            held.discard(o.request_id)
    return outs


def _send_outputs(out: Any, engine: Any, outs: list[StageOutput], held: set[str],
                  deltas: Optional[DeltaPacker] = None) -> None:
    """Sends a step's outputs, each as a delta of the request's last one sent (`output_deltas`; whole
    without `deltas`); an output that cannot be encoded fails its request alone."""
    stats = engine.stats()
    deltas = deltas or DeltaPacker()
    packed, changes, state = deltas.pack(outs)
    try:
        out.send(wire.encode(StageOutputs(packed, stats, changes)))
        deltas.commit(state)
        return
    except Exception:
        logger.exception("a step's outputs could not be sent together; sending them one by one")
    for o in outs:                              # whole outputs: the receiver takes each as it is
        try:
            data = wire.encode(StageOutputs([o], stats))
            deltas.commit({o.request_id: state[o.request_id]})
        except Exception as e:
            engine.abort(o.request_id)
            held.discard(o.request_id)
            deltas.forget(o.request_id)
            why = StageError(f"its output could not be sent to the orchestrator: {type(e).__name__}: {e}")
            data = wire.encode(StageOutputs([StageOutput.failed(o.request_id, why)], stats))
        out.send(data)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s stage %(levelname)s %(message)s")
    _serve(*sys.argv[1:5])
