"""Graceful drain of `omnistage serve` on SIGTERM / SIGINT (API-server process, event-loop thread).

In: the HTTP app, the `AsyncOmni` engine, a drain timeout in seconds, uvicorn's settings. Out: a
uvicorn server (`draining_server`) whose first SIGTERM or SIGINT starts a drain instead of an
immediate shutdown:
  1. stop accepting: `DrainMiddleware` answers every new request (every route, `/health` too, so
     a load balancer stops sending) 503 with `Connection: close`;
  2. wait until nothing is in flight: no HTTP request still being answered (streams included) and
     no engine request still open (video jobs run without an HTTP request), for at most
     `drain_timeout` seconds or until a second signal;
  3. what is still open then is cut: `AsyncOmni.close` ends it with `EngineDeadError` (a stream
     gets an error event and `[DONE]`, a waiting request a 503);
  4. uvicorn shuts down; `run_server` then closes the engine (stage processes stop, their
     temporary folders go) and the process exits 0.
uvicorn's own handler would stop at once and re-raise the signal after shutting down (exit -15,
skipping `engine.close()`); sse-starlette would end every stream at the first signal. Overriding
`handle_exit` on the server class keeps both out of it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from typing import Any, Optional

import uvicorn

from omnistage.entrypoints.openai.body_limit import refuse_and_close
from omnistage.entrypoints.openai.errors import OpenAIError

logger = logging.getLogger(__name__)

_POLL_S = 0.05                                  # how often the drain looks at what is in flight
_CUT_GRACE_S = 5.0                              # after cutting: time for handlers to write their last event


@dataclass
class DrainState:
    """What the middleware and the drain share (event-loop thread only)."""

    draining: bool = False                      # a signal came: new requests get 503
    in_flight: int = 0                          # HTTP requests being answered (refused ones not counted)
    cut: bool = False                           # a second signal: stop waiting for the requests in flight


class DrainMiddleware:
    """Pure ASGI: counts the HTTP requests in flight; once draining, refuses new ones with a 503 (and
    new WebSocket sessions with close code 1013)."""

    def __init__(self, app, state: DrainState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket" and self.state.draining:   # a new session: refused (HTTP 403)
            await send({"type": "websocket.close", "code": 1013, "reason": "the server is shutting down"})
            return
        if scope["type"] != "http":             # open WebSocket sessions are not waited for: they may idle
            await self.app(scope, receive, send)
            return
        if self.state.draining:
            await refuse_and_close(OpenAIError(503, "the server is shutting down and takes no new requests; retry "
                                                   "on another replica or once it is back", code="shutting_down"),
                                   scope, receive, send)
            return
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server; SIGTERM / SIGINT start `drain` (the module docstring has the steps)."""

    def __init__(self, config: uvicorn.Config, engine: Any, state: DrainState, drain_timeout: float):
        super().__init__(config)
        self.engine = engine
        self.drain_state = state
        self.drain_timeout = drain_timeout
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._drain_task: Optional[asyncio.Task] = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        """The signal handler (main thread, between two bytecodes of whatever runs): hand over to the
        loop. Safe to call from any thread."""
        if self._loop is None:                  # not serving yet
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._on_signal, sig)

    def _on_signal(self, sig: int) -> None:
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        if self.drain_state.draining:
            logger.warning("%s again: cutting what is still in flight", name)
            self.drain_state.cut = True
            return
        self.drain_state.draining = True
        logger.warning("%s: draining (%d HTTP requests, %d engine requests in flight; at most %g s)", name,
                       self.drain_state.in_flight, self.engine.num_requests, self.drain_timeout)
        self._drain_task = asyncio.ensure_future(self.drain())

    def _busy(self) -> bool:
        return self.drain_state.in_flight > 0 or self.engine.num_requests > 0

    async def drain(self) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        while self._busy() and loop.time() - started < self.drain_timeout and not self.drain_state.cut:
            await asyncio.sleep(_POLL_S)
        if self._busy():
            logger.warning("drain: cutting %d HTTP / %d engine requests after %.1f s", self.drain_state.in_flight,
                           self.engine.num_requests, loop.time() - started)
            await asyncio.to_thread(self.engine.close, "the server shut down before this request finished "
                                                       f"(drain timeout {self.drain_timeout:g} s)")
            cut = loop.time()
            while self.drain_state.in_flight and loop.time() - cut < _CUT_GRACE_S:
                await asyncio.sleep(_POLL_S)
        else:
            logger.warning("drain: done in %.1f s", loop.time() - started)
        self.should_exit = True


def draining_server(app: Any, engine: Any, drain_timeout: float, **config: Any) -> DrainingServer:
    """A uvicorn server for `app` that drains `engine` on SIGTERM / SIGINT; `config`: `uvicorn.Config`'s
    keyword arguments (host, port, log_level, ...). Run it with `.run()`."""
    if drain_timeout < 0:
        raise ValueError(f"drain_timeout must be >= 0 seconds; got {drain_timeout}")
    state = DrainState()
    settings = {"timeout_graceful_shutdown": _CUT_GRACE_S, **config}
    return DrainingServer(uvicorn.Config(DrainMiddleware(app, state), **settings), engine, state, drain_timeout)
