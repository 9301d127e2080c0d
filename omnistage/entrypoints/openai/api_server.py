"""The OpenAI-compatible HTTP server: routes, API-key check, start-up (API-server process).

`build_app(engine, served_model_name, api_key)` wires an `AsyncOmni` into a FastAPI app:
`GET /health`, `GET /v1/models`, `GET` / `HEAD /metrics`, `POST /reset_prefix_cache` (vLLM's: drops
every AR stage's prefix cache), `POST /v1/completions`,
`POST /v1/chat/completions`, the speech routes (`POST /v1/audio/speech` of `serving_speech`,
`/v1/audio/voices` of `serving_voices`, `WS /v1/audio/speech/stream` of `serving_speech_ws`,
`POST /v1/audio/speech/batch` of `serving_speech_batch`, options `SpeechOptions`), the image routes of
`serving_images` (`POST /v1/images/generations`,
`POST /v1/images/edits`) and the video-jobs routes of `serving_videos` (`/v1/videos`), capped by
`MediaLimits`, `GET /v1/capabilities` (`capabilities`: what the served pipeline can do) and the web
playground at `/` and `/static/` (`playground`). A body over `max_body_bytes` is a 413 before a
route reads it (`body_limit`). With an API key, every `/v1` route and the cache reset need
`Authorization: Bearer KEY` (checked before the body is read; the playground's page and files do not,
the page asks for the key); the key comes from `--api-key-file`, `--api-key` or `$OMNISTAGE_API_KEY`
(`resolve_api_key`).
`GET /health` is 503 with every stage's state while one is down (its process restarting).
`run_server(args)` checks that the port is free (`check_port_free`, before the model loads), builds
the engine from the CLI arguments, prints how to talk to it (a request the model answers: chat, an
image, a video job or speech, `banner_kind`; never the key: the snippets read `$OMNISTAGE_API_KEY`), and runs uvicorn in this process until SIGTERM /
SIGINT, which drain the requests in flight first (`drain.py`); the engine's model forwards run in
its own thread, so the event loop stays free for I/O. Served without `--served-model-name`, a
model folder is called by its folder name (`default_served_name`), so its path shows in no answer
and no /metrics label.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import shlex
import signal
import socket
from contextlib import asynccontextmanager
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers

from omnistage import __version__
from omnistage.entrypoints.async_omni import EngineDeadError
from omnistage.entrypoints.openai.body_limit import DEFAULT_MAX_BODY_BYTES, BodySizeLimitMiddleware
from omnistage.entrypoints.openai.capabilities import register_capabilities_route
from omnistage.entrypoints.openai.errors import OpenAIError, install_error_handlers
from omnistage.entrypoints.openai.playground import register_playground
from omnistage.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from omnistage.entrypoints.openai.serving_chat import ServingChat
from omnistage.entrypoints.openai.serving_completion import ServingCompletion
from omnistage.entrypoints.openai.serving_images import MediaLimits, register_image_routes
from omnistage.entrypoints.openai.serving_speech import SpeechOptions, register_speech_routes
from omnistage.entrypoints.openai.serving_speech_batch import register_batch_route
from omnistage.entrypoints.openai.serving_speech_ws import register_stream_route
from omnistage.entrypoints.openai.serving_voices import register_voice_routes
from omnistage.entrypoints.openai.serving_videos import register_video_routes
from omnistage.metrics import CONTENT_TYPE, EngineMetrics

logger = logging.getLogger(__name__)

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"   # what `omnistage serve` with no model calls the embedded default
API_KEY_ENV = "OMNISTAGE_API_KEY"               # where `omnistage serve` and the banner's snippets read the key


def default_served_name(model: Optional[str]) -> str:
    """The model id served without --served-model-name: a local folder's name (its path is nobody's
    business: it would show in /v1/models and every /metrics label), else the id as given (a hub id)."""
    if model is None:
        return DEFAULT_SERVED_NAME
    if os.path.isdir(model):
        return os.path.basename(os.path.normpath(os.path.abspath(model)))
    return model


DEFAULT_DRAIN_TIMEOUT_S = 30.0                  # `--drain-timeout`: how long SIGTERM waits for requests in flight


PROTECTED_PATHS = ("/v1", "/reset_prefix_cache")  # what needs the API key when one is set


class ApiKeyMiddleware:
    """Pure ASGI: a `/v1` (or cache reset) request without the right bearer key gets a 401 before
    anything else runs; a `/v1` WebSocket handshake without it is refused (close 1008, which uvicorn
    answers with 403)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        ws = scope["type"] == "websocket"
        path = scope.get("path", "")
        if (ws or scope["type"] == "http") and path.startswith(PROTECTED_PATHS) and scope.get("method") != "OPTIONS":
            given = Headers(scope=scope).get("authorization", "").encode()
            if not hmac.compare_digest(given, self.expected) and ws:    # refused handshake: HTTP 403
                await send({"type": "websocket.close", "code": 1008, "reason": "invalid API key"})
                return
            if not hmac.compare_digest(given, self.expected):
                response = OpenAIError(401, "Incorrect API key provided; send `Authorization: Bearer <key>`.",
                                       code="invalid_api_key").response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: Any, served_model_name: str, api_key: Optional[str] = None,
              media_limits: Optional[MediaLimits] = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              speech_options: Optional[SpeechOptions] = None) -> FastAPI:
    if not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be a positive integer, got {max_body_bytes!r}")
    metrics = EngineMetrics(engine, served_model_name)
    engine.output_hooks.append(metrics.on_output)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        try:
            yield
        finally:
            if metrics.on_output in engine.output_hooks:
                engine.output_hooks.remove(metrics.on_output)

    app = FastAPI(title="omnistage", version=__version__, lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics
    install_error_handlers(app)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=max_body_bytes)   # outermost: before any read
    completions = ServingCompletion(engine, served_model_name, metrics)
    chat = ServingChat(engine, served_model_name, metrics)

    @app.get("/health")
    async def health() -> Response:
        """200 `{"status": "ok", "stages": {name: "ready"}}`; 503 when the engine is down, or when a
        stage is (its process "restarting" or "failed"): an error naming it, plus every stage's state.
        A stage with replicas is ready while any replica is; `replicas` lists each one's state."""
        if not engine.is_running:
            return OpenAIError(503, "the engine is not running", code="engine_dead").response()
        states = engine.stage_states()
        replicas = engine.replica_states() if hasattr(engine, "replica_states") else {}
        extra = {"replicas": replicas} if replicas else {}
        down = {name: state for name, state in states.items() if state != "ready"}
        if not down:
            return JSONResponse({"status": "ok", "stages": states, **extra})
        message = "degraded: " + ", ".join(f"stage {name!r} is {state}" for name, state in down.items())
        return JSONResponse({**OpenAIError(503, message, code="stage_unavailable").body(), "status": "degraded",
                             "stages": states, **extra}, status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    app.head("/metrics", include_in_schema=False)(prometheus_metrics)   # probes (AIPerf) send HEAD

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        """vLLM's route: drops every AR stage's prefix cache (requests in flight go on); 200, no body."""
        try:
            dropped = await engine.reset_prefix_cache()
        except EngineDeadError as e:
            raise OpenAIError(503, str(e), code="engine_dead") from e
        logger.info("prefix cache reset: %s", dropped)
        return Response(status_code=200)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=served_model_name, max_model_len=engine.max_model_len)])

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        return await completions.create(body, raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create(body, raw)

    speech = register_speech_routes(app, engine, served_model_name, metrics, speech_options)
    register_batch_route(app, speech)
    register_stream_route(app, speech)
    register_voice_routes(app, speech)
    register_image_routes(app, engine, served_model_name, metrics, media_limits)
    register_video_routes(app, engine, served_model_name, metrics, media_limits)
    register_capabilities_route(app, engine, served_model_name, media_limits)
    register_playground(app)

    return app


# what the start banner shows per kind of model: (route, JSON body without "model", openai-client call)
_BANNER_EXAMPLES = {
    "text": ("chat/completions",
             {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32},
             "reply = client.chat.completions.create(model={name!r}, messages=[{{'role': 'user', "
             "'content': 'What is the capital of France?'}}], max_tokens=32)\nprint(reply.choices[0].message.content)"),
    "image": ("images/generations", {"prompt": "a red cube on a table"},
              "import base64\nimage = client.images.generate(model={name!r}, prompt='a red cube on a table')\n"
              "open('cube.png', 'wb').write(base64.b64decode(image.data[0].b64_json))"),
    "video": ("videos", {"prompt": "a boat on a lake"},
              "job = client.videos.create_and_poll(model={name!r}, prompt='a boat on a lake')\n"
              "client.videos.download_content(job.id).write_to_file('boat.mp4')"),
    "speech": ("audio/speech", {"input": "Hello from omnistage.", "response_format": "wav"},
               "client.audio.speech.create(model={name!r}, voice={voice!r}, input='Hello from omnistage.', "
               "response_format='wav').write_to_file('hello.wav')"),
}


def banner_kind(engine: Any) -> str:
    """Which example the banner shows: "text" (an LM), "image" / "video" (a diffusion model), "speech"."""
    kind = engine.main_stage_kind
    if kind == "ar":
        return "text"
    if kind == "diffusion":
        return getattr(engine.orchestrator.main, "output_kind", "image")
    return "speech"


def usage_banner(host: str, port: int, name: str, needs_key: bool, kind: str = "text", voice: str = "joe") -> str:
    """How to talk to the server: a curl line and an openai-client snippet for what the model makes
    (`kind`, see `banner_kind`; speech in `voice`). With a key they read it from `$OMNISTAGE_API_KEY`: a banner ends up
    in logs, the key must not."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    base = f"http://{shown}:{port}/v1"
    route, body, call = _BANNER_EXAMPLES[kind]
    body = json.dumps({"model": name, **body, **({"voice": voice} if kind == "speech" else {})})
    auth = f' -H "Authorization: Bearer ${API_KEY_ENV}"' if needs_key else ""
    key = f"os.environ[{API_KEY_ENV!r}]" if needs_key else "'EMPTY'"
    client = (f"import os\nfrom openai import OpenAI\n"
              f"client = OpenAI(base_url={base!r}, api_key={key})\n" + call.format(name=name, voice=voice))
    note = f"  (the API key is not shown: export {API_KEY_ENV}=<your key> first)\n\n" if needs_key else ""
    out = " -o hello.wav" if kind == "speech" else ""
    return (f"\nomnistage is serving {name!r} at {base}\n  playground: http://{shown}:{port}/\n\n{note}"
            f"  curl {base}/{route} -H 'Content-Type: application/json'{auth} -d {shlex.quote(body)}{out}\n\n"
            f"  python - <<'EOF'\n{client}\nEOF\n")


def resolve_api_key(args, environ=os.environ) -> Optional[str]:
    """The serve key: `--api-key-file`'s first line, else `--api-key`, else `$OMNISTAGE_API_KEY`, else None."""
    key_file = getattr(args, "api_key_file", None)
    if key_file and args.api_key:
        raise SystemExit("omnistage: give the API key once: --api-key or --api-key-file")
    if key_file:
        try:
            with open(key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except OSError as e:
            raise SystemExit(f"omnistage: cannot read --api-key-file: {e}") from e
        if not key:
            raise SystemExit(f"omnistage: --api-key-file {key_file} is empty")
        return key
    return args.api_key or environ.get(API_KEY_ENV) or None


def speech_options_from_args(args) -> SpeechOptions:
    """`--speaker-samples-dir`, `--speaker-max-uploaded`, `--allowed-media-domains` -> SpeechOptions."""
    options = SpeechOptions(allowed_media_domains=tuple(getattr(args, "allowed_media_domains", None) or ()))
    if getattr(args, "speaker_samples_dir", None):
        options.speaker_samples_dir = args.speaker_samples_dir
    if getattr(args, "speaker_max_uploaded", None) is not None:
        if args.speaker_max_uploaded < 0:
            raise SystemExit(f"omnistage: --speaker-max-uploaded must be >= 0, got {args.speaker_max_uploaded}")
        options.speaker_max_uploaded = args.speaker_max_uploaded
    return options


def check_port_free(host: str, port: int) -> None:
    """Exit with one line naming --port / --host when the address cannot be bound (taken, or not
    this machine's), before the model spends minutes loading. Binds as uvicorn will (SO_REUSEADDR)
    and lets go at once."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise SystemExit(f"omnistage: --host {host!r} does not resolve: {e}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as e:
            raise SystemExit(f"omnistage: cannot listen on {host}:{port} ({e.strerror}); pick another --port "
                             f"or stop what holds it") from None


def _exit_on_sigterm(sig, frame) -> None:
    raise SystemExit(128 + sig)


def run_server(args) -> None:
    """`omnistage serve`: build the engine from the parsed CLI arguments and serve until interrupted."""
    from uvicorn.config import STARTUP_FAILURE

    from omnistage.entrypoints.async_omni import AsyncOmni
    from omnistage.entrypoints.common import engine_kwargs_from_args
    from omnistage.entrypoints.openai.drain import draining_server

    api_key = resolve_api_key(args)
    check_port_free(args.host, args.port)
    # outside the server's own drain (while the model loads): SIGTERM unwinds like Ctrl-C, so stage
    # processes and their folders are cleaned up
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    engine = None
    try:
        engine = AsyncOmni(model=args.model, device=args.device, dtype=args.dtype, **engine_kwargs_from_args(args))
        name = args.served_model_name or default_served_name(args.model)
        limits = MediaLimits(**{k: getattr(args, k) for k in ("max_image_pixels", "max_video_jobs")
                                if getattr(args, k, None) is not None})
        app = build_app(engine, name, api_key, limits,
                        max_body_bytes=getattr(args, "max_body_bytes", None) or DEFAULT_MAX_BODY_BYTES,
                        speech_options=speech_options_from_args(args))
        drain_timeout = getattr(args, "drain_timeout", None)
        server = draining_server(app, engine, DEFAULT_DRAIN_TIMEOUT_S if drain_timeout is None else drain_timeout,
                                 host=args.host, port=args.port, log_level=args.log_level.lower())
        kind = banner_kind(engine)
        voices = engine.voices() if kind == "speech" else []
        print(usage_banner(args.host, args.port, name, api_key is not None, kind,
                           *([voices[0]["id"]] if voices else [])), flush=True)
        server.run()                            # until SIGTERM / SIGINT and the drain (entrypoints/openai/drain.py)
        if not server.started:
            raise SystemExit(STARTUP_FAILURE)   # e.g. the port is taken: uvicorn logged why
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # another SIGTERM must not cut the clean-up short
        try:
            if engine is not None:
                engine.close()
        finally:
            signal.signal(signal.SIGTERM, previous)
