"""Image generation over HTTP: /v1/images/generations and /v1/images/edits (API-server event loop).

`register_image_routes(app, engine, served_model_name, metrics, limits)` adds:
  * `POST /v1/images/generations` (JSON): `prompt, n (1..limits.max_images), size "WxH" | "auto",
    response_format "b64_json", output_format png | jpeg | webp`, and the extensions
    `negative_prompt, num_inference_steps, guidance_scale, true_cfg_scale, seed`. The n images are one
    request with `num_outputs_per_prompt=n` (one seeded noise draw of n rows, as diffusers'
    `num_images_per_prompt`), so they differ from each other and the same seed repeats them.
    Out: `{created, data: [{b64_json}], output_format, size}`; with `stream: true` an SSE stream:
    `image_generation.progress` `{step, num_inference_steps, progress}` per denoising step, then one
    `image_generation.completed` `{index, b64_json, size, output_format, created_at}` per image (or
    one `error` event); every check is done, and the engine has accepted it, before the stream starts.
  * `POST /v1/images/edits` (multipart): `image` / `image[]` (one or more files), `prompt`, optional
    `mask`, and the fields above (streamed events are `image_edit.*`), for models that take an input
    image; others get a 400.

Also here, shared with `serving_videos`: `MediaLimits` (the server's caps), `DiffusionServing` (model
and engine checks, params from request fields, safe upload decoding, one engine request run to its
final output). A JSON body must be sent as JSON (or no Content-Type), a form as multipart /
urlencoded: anything else is a 400. Uploads over `max_upload_bytes` are 413s, undecodable ones
400s; prompts must be non-blank and at most `max_prompt_chars` long (checked before any upload is
decoded); every bad field is a 4xx naming it. Model forwards run in the engine thread; PNG/JPEG/WEBP
encoding in a worker thread.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional, Union

from fastapi import FastAPI, Request
from pydantic import BaseModel, Field, ValidationError
from starlette.datastructures import UploadFile
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from omnistage.entrypoints.openai.errors import OpenAIError, engine_field, json_body_error, validation_error
from omnistage.entrypoints.openai.protocol import RequestBody
from omnistage.entrypoints.openai.serving_engine import OpenAIServing, diffusion_stage
from omnistage.io.media import IMAGE_FORMATS, decode_image, encode_image
from omnistage.outputs import RequestOutput
from omnistage.params import DiffusionParams

logger = logging.getLogger(__name__)

_SIZE_RE = re.compile(r"^\s*(\d{1,6})\s*[xX]\s*(\d{1,6})\s*$")
_INT64 = 2**63
MAX_STEPS = 1000                                # most `num_inference_steps` one request may ask for
# DiffusionParams field -> the request field that sets it
_REQUEST_FIELDS = {"height": "size", "width": "size", "num_outputs_per_prompt": "n"}


@dataclass
class MediaLimits:
    """Caps of the image and video routes (set from `omnistage serve` flags)."""

    max_image_pixels: int = 2048 * 2048         # width * height of a requested output image / video frame
    max_images: int = 10                        # `n` of one images request
    max_upload_bytes: int = 20 * 1024 * 1024    # one uploaded image (larger: 413)
    max_upload_pixels: int = 4096 * 4096        # decoded size of one uploaded image
    max_upload_files: int = 4                   # images in one edits request
    max_video_frames: int = 241                 # `num_frames` of one video job
    max_video_jobs: int = 16                    # queued + running video jobs (more: 429)
    max_stored_videos: int = 64                 # finished videos kept for download (oldest dropped)
    max_prompt_chars: int = 32000               # `prompt` / `negative_prompt` characters (text encoders read far fewer)

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


class DiffusionFields(RequestBody):
    """Request fields shared by the image and video routes (None: the model's default)."""

    model: Optional[str] = None
    prompt: str
    size: Optional[str] = None                  # "WxH" in pixels, or "auto"
    negative_prompt: Optional[str] = None
    num_inference_steps: Optional[int] = Field(None, ge=1, le=MAX_STEPS)
    guidance_scale: Optional[float] = Field(None, ge=0, le=100)
    true_cfg_scale: Optional[float] = Field(None, ge=0, le=100)
    seed: Optional[int] = Field(None, ge=-_INT64, lt=_INT64)
    cache_config: Optional[dict[str, Any]] = None  # step-cache settings over the server's (e.g. rel_l1_thresh)


class ImageRequest(DiffusionFields):
    n: Optional[int] = None
    response_format: Optional[str] = None       # only "b64_json": nothing is stored to serve a URL from
    output_format: Optional[str] = None         # png (default) | jpeg | webp
    quality: Optional[str] = None               # accepted and ignored
    user: Optional[str] = None
    stream: bool = False                        # True: an SSE stream of per-step progress, then the images
    partial_images: Optional[int] = None        # OpenAI's partial previews: only 0 (progress events instead)


def parse_size(size: Optional[str], max_pixels: int) -> tuple[Optional[int], Optional[int]]:
    """"WxH" -> (width, height); None / "auto" -> (None, None), the model's default."""
    if size is None or size.strip().lower() in ("", "auto"):
        return None, None
    m = _SIZE_RE.match(size)
    if m is None:
        raise OpenAIError(400, f"size must be \"WIDTHxHEIGHT\" in pixels (e.g. \"1024x1024\") or \"auto\", "
                               f"got {size[:40]!r}", param="size")
    w, h = int(m.group(1)), int(m.group(2))
    if w < 1 or h < 1 or w * h > max_pixels:
        raise OpenAIError(400, f"size must have a positive width and height with width * height <= "
                               f"{max_pixels} pixels, got {size!r}", param="size")
    return w, h


def params_error(e: ValueError) -> OpenAIError:
    """A `ValueError` from `DiffusionParams` / the model -> 400 naming the request field (`height`
    and `width` are the request's `size`, `num_outputs_per_prompt` its `n`)."""
    message, field = str(e), engine_field(e)
    param = _REQUEST_FIELDS.get(field, field)
    if param != field:
        message = f"{param}: {message}"
    known = set(DiffusionParams.__dataclass_fields__) | {"size", "n", "image", "prompt"}
    return OpenAIError(400, message, param=param if (param or "").split(".")[0] in known else None)


async def read_form(raw: Request, limits: MediaLimits) -> tuple[dict[str, str], dict[str, list[UploadFile]]]:
    """A multipart / urlencoded body -> (text fields, files by field name, `image[]` folded into `image`)."""
    length = raw.headers.get("content-length")
    cap = limits.max_upload_bytes * limits.max_upload_files + (1 << 20)
    if length is not None and length.isdigit() and int(length) > cap:
        raise OpenAIError(413, f"the request body is {length} bytes; the limit is {cap} bytes")
    try:
        form = await raw.form(max_files=limits.max_upload_files + 1, max_fields=100)
    except StarletteHTTPException:              # the body grew past the server's cap: a 413
        raise
    except Exception as e:                      # malformed multipart, too many parts
        raise OpenAIError(400, f"the request body is not a valid form: {e}") from None
    fields: dict[str, str] = {}
    files: dict[str, list[UploadFile]] = {}
    for key, value in form.multi_items():
        name = key[:-2] if key.endswith("[]") else key
        if isinstance(value, UploadFile):
            files.setdefault(name, []).append(value)
        else:
            fields[name] = value
    return fields, files


async def read_body(raw: Request, limits: MediaLimits) -> tuple[dict[str, Any], dict[str, list[UploadFile]]]:
    """JSON or form body -> (fields, files)."""
    ctype = raw.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype in ("multipart/form-data", "application/x-www-form-urlencoded"):
        return await read_form(raw, limits)
    if ctype and ctype != "application/json" and not ctype.endswith("+json"):
        raise OpenAIError(400, f"the request body must be JSON (Content-Type: application/json) or a form "
                               f"(multipart/form-data), got Content-Type {ctype[:60]!r}")
    try:
        body = json.loads(await raw.body() or b"{}")
    except (ValueError, RecursionError) as e:
        raise json_body_error(e) from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    return body, {}


async def read_upload(upload: UploadFile, limits: MediaLimits, field: str):
    """An uploaded image file -> RGB PIL image; 413 when too large, 400 when not a readable image."""
    data = await upload.read(limits.max_upload_bytes + 1)
    if len(data) > limits.max_upload_bytes:
        raise OpenAIError(413, f"{field} is larger than the {limits.max_upload_bytes}-byte limit", param=field)
    return await asyncio.to_thread(_decode, data, limits, field)


def decode_data_url(url: Any, limits: MediaLimits, field: str):
    """A base64 `data:image/...;base64,` URL -> RGB PIL image (no URL is ever fetched)."""
    if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url:
        raise OpenAIError(400, f"{field} must be an uploaded file or a base64 data URL "
                               "(data:image/png;base64,...); remote URLs are not fetched", param=field)
    encoded = url.split(";base64,", 1)[1]
    if len(encoded) > limits.max_upload_bytes * 4 // 3 + 4:
        raise OpenAIError(413, f"{field} is larger than the {limits.max_upload_bytes}-byte limit", param=field)
    try:
        data = base64.b64decode(encoded, validate=True)
    except ValueError:
        raise OpenAIError(400, f"{field} is not valid base64", param=field) from None
    return _decode(data, limits, field)


def _decode(data: bytes, limits: MediaLimits, field: str):
    try:
        return decode_image(data, max_bytes=limits.max_upload_bytes, max_pixels=limits.max_upload_pixels,
                            field=field)
    except ValueError as e:
        raise OpenAIError(400, str(e), param=field) from None


class DiffusionServing(OpenAIServing):
    """What the image and video routes share: checks, params, and one request run to its end."""

    def __init__(self, engine: Any, served_model_name: str, metrics: Any, limits: MediaLimits):
        super().__init__(engine, served_model_name, metrics)
        self.limits = limits

    @property
    def stage(self) -> Any:
        """The diffusion stage engine (None for models that are not diffusion pipelines)."""
        return diffusion_stage(self.engine)

    def fields(self, model: type[DiffusionFields], fields: dict[str, Any]) -> Any:
        """Request fields -> `model`, its prompts checked: non-blank, at most `max_prompt_chars`."""
        req = parse_fields(model, fields)
        if not req.prompt.strip():
            raise OpenAIError(400, "prompt must not be empty", param="prompt")
        cap = self.limits.max_prompt_chars
        for name in ("prompt", "negative_prompt"):
            text = getattr(req, name)
            if text is not None and len(text) > cap:
                raise OpenAIError(400, f"{name} must be at most {cap} characters, got {len(text)}", param=name)
        return req

    def check_model(self, model: Optional[str], output_kind: str, with_image: bool = False) -> Any:
        """`check_request` for a route that makes `output_kind` ("image" | "video"), then what that
        route needs of the stage; returns the stage."""
        self.check_request(model, "media")
        stage = self.stage
        if not hasattr(stage, "output_kind"):   # a StageClient: the stage runs in its own process
            raise OpenAIError(501, "the image and video routes need the diffusion stage in the server's process; "
                                   "remove `runner: process` from its deploy config")
        if stage.output_kind != output_kind:
            route = "POST /v1/videos" if stage.output_kind == "video" else "POST /v1/images/generations"
            raise OpenAIError(400, f"`{self.served_model_name}` generates {stage.output_kind}s, not "
                                   f"{output_kind}s; use {route}", param="model")
        if with_image and not stage.takes_image:
            raise OpenAIError(400, f"`{self.served_model_name}` does not take an input image", param="image")
        return stage

    def params(self, req: DiffusionFields, **extra) -> DiffusionParams:
        """Request fields -> `DiffusionParams` resolved by the model (defaults filled, sizes checked)."""
        width, height = parse_size(req.size, self.limits.max_image_pixels)
        given = dict(height=height, width=width, num_inference_steps=req.num_inference_steps,
                     guidance_scale=req.guidance_scale, true_cfg_scale=req.true_cfg_scale,
                     negative_prompt=req.negative_prompt, seed=req.seed, cache_config=req.cache_config, **extra)
        try:
            params = DiffusionParams(**given)
            resolved = self.stage.check_params(params) or params
        except ValueError as e:
            raise params_error(e) from None
        if resolved.height * resolved.width > self.limits.max_image_pixels:
            raise OpenAIError(400, f"size: the model's default {resolved.width}x{resolved.height} is over the "
                                   f"{self.limits.max_image_pixels}-pixel limit; pass a smaller size", param="size")
        return resolved

    async def run(self, raw: Optional[Request], inputs: dict, params: DiffusionParams,
                  request_id: str) -> RequestOutput:
        """One engine request to its final output; the client leaving aborts it."""
        async def final() -> RequestOutput:
            last = None
            async for out in self.generate(inputs, params, request_id, default_param="prompt"):
                last = out
            if last is None or not last.finished:
                raise OpenAIError(500, "the engine ended the request without output")
            if last.error:
                raise OpenAIError(500, f"generation failed: {last.error}")
            return last

        return await (self.until_disconnected(raw, final()) if raw is not None else final())


def body_schema(model: type[BaseModel], form_files: tuple[str, ...] = ()) -> dict:
    """OpenAPI `requestBody` of a route that reads its body itself: JSON of `model`, or with
    `form_files` a multipart form of its fields plus those binary files."""
    schema = model.model_json_schema()
    if not form_files:
        return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
    props = {**schema["properties"], **{f: {"type": "string", "format": "binary"} for f in form_files}}
    form = {**schema, "properties": props, "required": [*schema.get("required", []), form_files[0]]}
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": form}}}}


def parse_fields(model: type[BaseModel], fields: dict[str, Any]) -> Any:
    try:
        return model.model_validate(fields)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


class ServingImages(DiffusionServing):
    def _image_params(self, req: ImageRequest) -> DiffusionParams:
        if req.partial_images:
            raise OpenAIError(400, f"partial_images must be 0, got {req.partial_images}: partial previews are not "
                                   "made; with stream=true the stream sends a progress event per denoising step",
                              param="partial_images")
        if req.response_format not in (None, "b64_json"):
            raise OpenAIError(400, f"response_format must be \"b64_json\", got {req.response_format!r}; this "
                                   "server stores no images to serve URLs from", param="response_format")
        if req.output_format is not None and req.output_format.lower() not in IMAGE_FORMATS:
            raise OpenAIError(400, f"output_format must be one of png, jpeg, webp; got {req.output_format!r}",
                              param="output_format")
        n = 1 if req.n is None else req.n
        if not 1 <= n <= self.limits.max_images:
            raise OpenAIError(400, f"n must be an integer in [1, {self.limits.max_images}], got {n}", param="n")
        return self.params(req, num_outputs_per_prompt=n)

    async def generations(self, raw: Request) -> Any:
        fields, _ = await read_body(raw, self.limits)
        req = self.fields(ImageRequest, fields)
        self.check_model(req.model, "image")
        params = self._image_params(req)
        return await self._respond(raw, req, {"prompt": req.prompt}, params, "image_generation")

    async def edits(self, raw: Request) -> Any:
        fields, files = await read_body(raw, self.limits)
        req = self.fields(ImageRequest, fields)
        self.check_model(req.model, "image", with_image=True)
        params = self._image_params(req)
        if parse_size(req.size, self.limits.max_image_pixels) == (None, None):
            params = params.clone(height=None, width=None)     # no size: the model sizes it from the image
        uploads = files.get("image", [])
        if not uploads:
            raise OpenAIError(400, "image is required: upload one or more image files", param="image")
        images = [await read_upload(u, self.limits, "image") for u in uploads]
        inputs: dict[str, Any] = {"prompt": req.prompt, "images": images}
        if files.get("mask"):
            mask = await read_upload(files["mask"][0], self.limits, "mask")
            if not getattr(self.stage, "takes_mask", False):
                raise OpenAIError(400, f"mask: `{self.served_model_name}` does not use masks", param="mask")
            inputs["mask"] = mask
        return await self._respond(raw, req, inputs, params, "image_edit")

    async def _respond(self, raw: Request, req: ImageRequest, inputs: dict, params: DiffusionParams,
                       kind: str) -> Any:
        rid = f"img-{uuid.uuid4().hex}"
        if req.stream:
            gen = self.generate(inputs, params, rid, default_param="prompt")
            # the first output before the status line: a request the engine refuses is still a 400
            firsts = await self.until_disconnected(raw, self.first_outputs([gen]))
            return EventSourceResponse(self._events(gen, firsts, req, params, kind), sep="\n")
        out = await self.run(raw, inputs, params, rid)
        fmt, encoded, size = await self._encode(req, out, params)
        return {"created": int(time.time()), "data": [{"b64_json": base64.b64encode(b).decode()} for b in encoded],
                "output_format": fmt, "size": size}

    @staticmethod
    async def _encode(req: ImageRequest, out: RequestOutput, params: DiffusionParams) -> tuple[str, list[bytes], str]:
        """(output format, encoded images, "WxH") of a finished request; encoding runs in a worker thread."""
        fmt = (req.output_format or "png").lower()
        encoded = await asyncio.to_thread(lambda: [encode_image(im, fmt) for im in out.images])
        # the images' own size: an edit model's default size follows the input image, unknown to `params`
        width, height = out.images[0].size if out.images else (params.width, params.height)
        return "jpeg" if fmt == "jpg" else fmt, encoded, f"{width}x{height}"

    async def _events(self, gen: Any, firsts: list[RequestOutput], req: ImageRequest, params: DiffusionParams,
                      kind: str) -> AsyncIterator[dict]:
        """SSE events of a streamed request: `{kind}.progress` per denoising step, then one
        `{kind}.completed` per image (OpenAI's completed event), or one `error` event."""
        steps = params.num_inference_steps
        async with aclosing(self.merge([gen], firsts)) as outs:
            try:
                async for _, out in outs:
                    progress = 1.0 if out.finished else float(out.progress or 0.0)
                    yield _event(f"{kind}.progress", step=round(progress * steps), num_inference_steps=steps,
                                 progress=progress)
                    if not out.finished:
                        continue
                    if out.error:
                        raise OpenAIError(500, f"generation failed: {out.error}")
                    fmt, encoded, size = await self._encode(req, out, params)
                    for i, data in enumerate(encoded):
                        yield _event(f"{kind}.completed", index=i, b64_json=base64.b64encode(data).decode(),
                                     created_at=int(time.time()), size=size, output_format=fmt,
                                     background="opaque", quality="auto")
            except OpenAIError as e:
                yield _event("error", **e.body())
            except Exception as e:
                logger.exception("image stream failed")
                yield _event("error", **OpenAIError(500, f"internal error: {e!r}").body())


def _event(kind: str, **fields) -> dict:
    """One SSE event named `kind` whose data is `{"type": kind, **fields}`."""
    return {"event": kind, "data": json.dumps({"type": kind, **fields})}


def register_image_routes(app: FastAPI, engine: Any, served_model_name: str, metrics: Any = None,
                          limits: Union[MediaLimits, None] = None) -> None:
    serving = ServingImages(engine, served_model_name, metrics, limits or MediaLimits())

    @app.post("/v1/images/generations", openapi_extra=body_schema(ImageRequest))
    async def create_image(raw: Request) -> Any:
        return await serving.generations(raw)

    @app.post("/v1/images/edits", openapi_extra=body_schema(ImageRequest, ("image", "mask")))
    async def edit_image(raw: Request) -> Any:
        return await serving.edits(raw)
