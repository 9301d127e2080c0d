"""OpenAI-shaped errors for the HTTP server (event-loop thread of the API server).

Every error leaves the server as `{"error": {"message", "type", "param", "code"}}` with the status
of API.md: 400 bad field or malformed JSON, 401 bad key, 404 unknown model or route, 413 body too
large, 503 engine down, 500 anything unexpected. `OpenAIError` is what the serving code raises;
`install_error_handlers` maps it, FastAPI's validation errors and Starlette's HTTP errors onto that
shape, and wraps the app in `InternalErrorMiddleware`, which answers an unexpected exception with a
500 and keeps the connection usable. A rejected parameter (`ParamError` of omnistage.params, from
the params classes or an engine) becomes a 400 whose `param` is the field it carries, as the user
spelt it (`bad_request`). Messages may quote what the user sent: text UTF-8 cannot encode is
escaped, so an error about a lone surrogate is still a well-formed response.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from omnistage.params import ParamError

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_server_error",
          503: "service_unavailable_error"}


def _encodable(text: Optional[str]) -> Optional[str]:
    """`text` with what UTF-8 cannot encode (lone surrogates) escaped as `\\udXXX`."""
    return text if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


class OpenAIError(Exception):
    """An error answered to the client; `param` names the offending request field, if any."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Any = None,
                 type: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": _encodable(self.message), "type": self.type, "param": _encodable(self.param),
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


class ClientDisconnected(Exception):
    """The client went away before the answer was ready; its engine requests are already aborted."""


def engine_field(error: ValueError) -> Optional[str]:
    """The engine field a rejected parameter names: `ParamError.field`; None when it names none."""
    return error.field if isinstance(error, ParamError) else None


def bad_request(error: ValueError, rename: Optional[dict[str, str]] = None,
                default_param: Optional[str] = None) -> OpenAIError:
    """A `ValueError` from the params or the engine -> 400 naming the field as the user spelt it:
    `rename` maps engine fields to request fields (`max_tokens` -> `max_completion_tokens`), also in
    the message's leading field name; an error naming no field gets `default_param`."""
    message, field = str(error), engine_field(error)
    if field is None:
        return OpenAIError(400, message, param=default_param)
    param = (rename or {}).get(field, field)
    if param != field and message.startswith(field):
        message = param + message[len(field):]
    return OpenAIError(400, message, param=param)


def json_body_error(exc: BaseException) -> OpenAIError:
    """A request body that JSON parsing refused -> 400 saying why (nesting too deep, an integer of
    thousands of digits, invalid UTF-8, a syntax error)."""
    if isinstance(exc, RecursionError):
        return OpenAIError(400, "the request body is not valid JSON: its arrays / objects nest too deeply")
    if "integer string conversion" in str(exc):     # Python's own message names a sys function
        return OpenAIError(400, f"the request body holds an integer of more than {sys.get_int_max_str_digits()} "
                                "digits")
    return OpenAIError(400, f"the request body is not valid JSON: {exc}")


def validation_error(errors: list[dict]) -> OpenAIError:
    """Pydantic's errors (of FastAPI's body parsing or a `model_validate`) -> 400 for the first one:
    `param` is the top-level field ("messages"), the message keeps the full path ("messages.0.role")."""
    if not errors:
        return OpenAIError(400, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return OpenAIError(400, f"the request body is not valid JSON: {detail}".rstrip(": "))
    loc = [str(p) for p in first.get("loc", ())]
    if loc and loc[0] in ("body", "query", "path", "header"):  # where FastAPI found it, not a field
        loc = loc[1:]
    message = first.get("msg", "invalid value").removeprefix("Value error, ")
    return OpenAIError(400, f"{'.'.join(loc)}: {message}" if loc else message, param=loc[0] if loc else None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.__cause__ is not None:   # FastAPI could not parse the JSON body
            return json_body_error(exc.__cause__).response()
        return OpenAIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)                    # nobody reads it; nginx's "client closed"

    app.add_middleware(InternalErrorMiddleware)


class InternalErrorMiddleware:
    """Pure ASGI, the innermost of the app's middlewares: an exception no handler turned into a
    response becomes a logged OpenAI-shaped 500, and goes no further. (Starlette's outermost
    middleware would answer it too, but then re-raise it, and uvicorn drops the keep-alive
    connection under the client's next request.) Once a response has started nothing well-formed
    can follow: the exception propagates and uvicorn closes the connection of the cut-off body."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if started:
                raise
            logger.exception("unhandled error while serving %s %s", scope.get("method"), scope.get("path"))
            await OpenAIError(500, f"internal error: {exc!r}").response()(scope, receive, send)
