"""The request-body size cap (pure ASGI middleware, event-loop thread of the API server).

In: every HTTP request, before any route reads its body. Out: a 413 in the OpenAI error shape for a
body over `max_body_bytes` (`omnistage serve --max-body-bytes`, `build_app(max_body_bytes=)`), or
the request passed on unchanged. A declared `Content-Length` over the cap is answered at once,
without reading a byte of the body; a body without one (chunked) is counted as it streams in, and
the read that crosses the cap raises `BodyTooLarge`, which FastAPI and the serving code let through
to the 413 handler. Either way the 413 says `Connection: close`, and the rest of the body is then
read and dropped (never kept; at most `DRAIN_BYTES` or `DRAIN_SECONDS`), as web servers linger before
closing: a client still sending when the connection closed would get a reset instead of the 413. The drain
runs while the response is still open (its body sent, the final empty body message held back): uvicorn
answers `receive()` with a disconnect once a response is complete, and a close with the client's bytes
unread resets the connection, which can drop the 413 before the client reads it.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from omnistage.entrypoints.openai.errors import OpenAIError

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024       # a 20 MB upload fits, base64 included; a 50 MB prompt does not
DRAIN_BYTES = 1 << 30                           # after a 413: unread body dropped at most, before the close
DRAIN_SECONDS = 10.0                            # ... and for at most this long


async def drain_body(receive) -> None:
    """Reads and drops what is left of a refused request's body (bounded; see the module docstring)."""
    import asyncio
    import time

    dropped, deadline = 0, time.monotonic() + DRAIN_SECONDS
    while dropped < DRAIN_BYTES:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            message = await asyncio.wait_for(receive(), left)
        except (asyncio.TimeoutError, OSError):
            return
        if message["type"] != "http.request":
            return                              # the client went away
        dropped += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


class BodyTooLarge(StarletteHTTPException):
    """The body grew past the cap while being read (an HTTPException: FastAPI's body parsing re-raises those)."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than the {limit}-byte limit (--max-body-bytes)")


class BodySizeLimitMiddleware:
    def __init__(self, app, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.app = app
        self.limit = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, receive, send, f"the request body is {declared} bytes; the limit is "
                                                     f"{self.limit} bytes (--max-body-bytes)")
            return
        received, started = 0, False

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        async def closing(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if received > self.limit:       # the 413 of BodyTooLarge: the unread rest ends the connection
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            elif received > self.limit and not message.get("more_body", False):
                await send({**message, "more_body": True})   # the 413 out, the response held open: drop
                await drain_body(receive)                    # the rest of the body, then complete it
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        try:
            await self.app(scope, counted, closing)
        except BodyTooLarge as e:               # raised where no handler was in reach
            if started:
                raise
            await self._refuse(scope, receive, send, str(e.detail))

    @staticmethod
    async def _refuse(scope, receive, send, message: str) -> None:
        await refuse_and_close(OpenAIError(413, message), scope, receive, send)


async def refuse_and_close(error: OpenAIError, scope, receive, send) -> None:
    """Answers `error` with `Connection: close` before the route runs, dropping the unread body
    (`drain_body`) before the response completes, so the client reads the answer instead of a reset."""
    response = error.response()
    response.headers["connection"] = "close"
    await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body, "more_body": True})
    await drain_body(receive)
    await send({"type": "http.response.body", "body": b"", "more_body": False})
