"""OpenAI-shaped errors for the HTTP server (event-loop thread of the API server).

Every error leaves the server as `{"error": {"message", "type", "param", "code"}}` with the status
of API.md: 400 bad field or malformed JSON, 401 bad key, 404 unknown model or route, 503 engine
down, 500 anything unexpected. `OpenAIError` is what the serving code raises; `install_error_handlers`
maps it, FastAPI's validation errors and Starlette's HTTP errors onto that shape. A rejected
parameter (`ParamError` of omnistage.params, from the params classes or an engine) becomes a 400
whose `param` is the field it carries, as the user spelt it (`bad_request`).
"""

from __future__ import annotations

import logging
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
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

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


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    errors = exc.errors()
    if not errors:
        return OpenAIError(400, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return OpenAIError(400, f"the request body is not valid JSON: {detail}".rstrip(": "))
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    message = first.get("msg", "invalid value")
    # param is the top-level field ("messages"); the message keeps the full path ("messages.0.role")
    return OpenAIError(400, f"{'.'.join(loc)}: {message}" if loc else message, param=loc[0] if loc else None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return OpenAIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)                    # nobody reads it; nginx's "client closed"

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        return OpenAIError(500, f"internal error: {exc!r}").response()
