"""OpenAI's video-jobs API: /v1/videos (API-server event loop; model forwards run in the engine thread).

`register_video_routes(app, engine, served_model_name, metrics, limits)` adds:
  * `POST /v1/videos` (multipart, as the openai client sends it, or JSON): `prompt`, `model`,
    `size` "WxH", `seconds`, `input_reference` (an image file or `{"image_url": data URL}`, for
    image-to-video models, which require it), and the extensions `num_frames, fps,
    num_inference_steps, guidance_scale, seed, negative_prompt`. Validates everything, then answers
    at once with a queued job `{id, object: "video", status: "queued", progress: 0, created_at,
    model, size, seconds, prompt}`; more than `limits.max_video_jobs` unfinished jobs is a 429.
  * `GET /v1/videos/{id}`: the job; `status` goes queued -> in_progress -> completed | failed,
    `progress` 0..100 follows the denoising steps (100 once the MP4 is ready). Its `prompt` is the
    first `PROMPT_ECHO_CHARS` characters of the prompt (a job and a page of jobs stay small). A job
    that fails at run time has `error: {"code": "generation_failed", "message": its own error}`; `engine_dead`
    only when the engine or its stage went down.
  * `GET /v1/videos/{id}/content[?variant=video|thumbnail]`: the MP4 (video/mp4), or the first
    frame as WEBP; a 400 until the job completed.
  * `GET /v1/videos[?after=&limit=&order=]`: a cursor page `{object: "list", data, has_more,
    first_id, last_id}`, newest first by default.
  * `DELETE /v1/videos/{id}`: forgets the job; a running one is aborted at the engine's next step
    boundary, so the engine is free for the next job one step later.
`seconds` without `num_frames` asks for `seconds * fps + 1` frames, which the model rounds to a
count it accepts; a frame count refused then is reported as a bad `seconds`. Jobs and finished
videos live in memory; the oldest finished ones are dropped past `limits.max_stored_videos`. A
gauge `omnistage:video_jobs{status}` reports the queue.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client.core import GaugeMetricFamily
from pydantic import Field

from omnistage.entrypoints.openai.errors import OpenAIError
from omnistage.entrypoints.openai.serving_images import (DiffusionFields, DiffusionServing, MediaLimits,
                                                         body_schema, decode_data_url, read_body, read_upload)
from omnistage.io.media import encode_image, encode_mp4
from omnistage.metrics import PREFIX
from omnistage.params import DiffusionParams
from omnistage.stage import RequestFailedError

STATUSES = ("queued", "in_progress", "completed", "failed")
PROMPT_ECHO_CHARS = 1000                        # characters of a job's prompt kept and echoed
MAX_FPS = 120                                   # largest `fps` a job may ask for


class VideoRequest(DiffusionFields):
    seconds: Optional[Union[str, float]] = None  # clip length; OpenAI sends "4" | "8" | "12"
    num_frames: Optional[int] = Field(None, ge=1)
    fps: Optional[int] = Field(None, ge=1, le=MAX_FPS)
    input_reference: Optional[Any] = None       # JSON: {"image_url": data URL}; multipart: a file
    user: Optional[str] = None


@dataclass
class VideoJob:
    id: str
    prompt: str                                 # its first PROMPT_ECHO_CHARS characters, for display
    model: str
    params: DiffusionParams                     # resolved: size, frames and fps are all set
    created_at: int                             # unix seconds
    status: str = "queued"                      # one of STATUSES
    progress: int = 0                           # 0..100
    completed_at: Optional[int] = None
    error: Optional[dict] = None                # {"code", "message"} when failed
    content: Optional[bytes] = None             # the MP4 once completed
    first_frame: Any = None                     # uint8 [H, W, 3], for the thumbnail variant
    task: Optional[asyncio.Task] = field(default=None, repr=False)

    @property
    def finished(self) -> bool:
        return self.status in ("completed", "failed")

    def to_dict(self) -> dict:
        p = self.params
        return {"id": self.id, "object": "video", "status": self.status, "progress": self.progress,
                "created_at": self.created_at, "completed_at": self.completed_at, "expires_at": None,
                "model": self.model, "prompt": self.prompt, "size": f"{p.width}x{p.height}",
                "seconds": f"{p.num_frames / p.fps:g}", "num_frames": p.num_frames, "fps": p.fps,
                "error": self.error, "remixed_from_video_id": None}


class _JobsCollector:
    """`omnistage:video_jobs{status}` read from the job store at scrape time."""

    def __init__(self, jobs: "OrderedDict[str, VideoJob]", model_name: str):
        self.jobs, self.model_name = jobs, model_name

    def collect(self):
        g = GaugeMetricFamily(PREFIX + "video_jobs", "Video jobs held by the server, by status.",
                              labels=["model_name", "status"])
        counts = {s: 0 for s in STATUSES}
        for job in list(self.jobs.values()):
            counts[job.status] += 1
        for status, n in counts.items():
            g.add_metric([self.model_name, status], float(n))
        yield g


def _fps(req: VideoRequest, stage: Any) -> int:
    """The request's fps, or the model's default."""
    return req.fps or stage.default_fps


class ServingVideos(DiffusionServing):
    def __init__(self, engine: Any, served_model_name: str, metrics: Any, limits: MediaLimits):
        super().__init__(engine, served_model_name, metrics, limits)
        self.jobs: OrderedDict[str, VideoJob] = OrderedDict()   # creation order
        if metrics is not None:
            metrics.registry.register(_JobsCollector(self.jobs, served_model_name))

    # ---- create -------------------------------------------------------------------------------
    async def create(self, raw: Request) -> dict:
        fields, files = await read_body(raw, self.limits)
        reference = fields.pop("input_reference[image_url]", None)
        req: VideoRequest = self.fields(VideoRequest, fields)
        stage = self.check_model(req.model, "video")
        self._check_room()
        image = await self._reference(req, files, reference)
        if stage.takes_image and image is None:
            raise OpenAIError(400, f"input_reference is required: `{self.served_model_name}` makes a video from "
                                   "an image", param="input_reference")
        if not stage.takes_image and image is not None:
            raise OpenAIError(400, f"`{self.served_model_name}` does not take an input image",
                              param="input_reference")
        params = self._video_params(req, stage)
        self._check_room()                      # again: other creates may have been queued while we decoded
        job = VideoJob(id=f"video_{uuid.uuid4().hex}", prompt=req.prompt[:PROMPT_ECHO_CHARS],
                       model=self.served_model_name, params=params, created_at=int(time.time()))
        inputs: dict[str, Any] = {"prompt": req.prompt}       # the negative prompt travels in params
        if image is not None:
            inputs["image"] = image
        self.jobs[job.id] = job
        self._evict()
        job.task = asyncio.ensure_future(self._run(job, inputs))
        return job.to_dict()

    def _check_room(self) -> None:
        if sum(not j.finished for j in self.jobs.values()) >= self.limits.max_video_jobs:
            raise OpenAIError(429, f"{self.limits.max_video_jobs} video jobs are queued or running; retry later",
                              code="queue_full")

    async def _reference(self, req: VideoRequest, files: dict, reference: Optional[str]):
        if files.get("input_reference"):
            return await read_upload(files["input_reference"][0], self.limits, "input_reference")
        ref = req.input_reference
        if isinstance(ref, dict):
            if ref.get("file_id"):
                raise OpenAIError(400, "input_reference.file_id is not supported (no file store); upload the "
                                       "image or send {\"image_url\": data URL}", param="input_reference")
            reference = ref.get("image_url")
        elif ref is not None:
            reference = ref
        return None if reference is None else decode_data_url(reference, self.limits, "input_reference")

    def _video_params(self, req: VideoRequest, stage: Any) -> DiffusionParams:
        """The job's resolved params; a refused frame count that came from `seconds` is a bad `seconds`."""
        frames = self._frames(req, stage)
        try:
            params = self.params(req, num_frames=frames, fps=req.fps)
            if params.num_frames > self.limits.max_video_frames:
                raise OpenAIError(400, f"num_frames must be at most {self.limits.max_video_frames}, got "
                                       f"{params.num_frames}", param="num_frames")
        except OpenAIError as e:
            if req.num_frames is not None or frames is None or e.param != "num_frames":
                raise
            raise OpenAIError(400, f"seconds: {float(req.seconds):g} s at {_fps(req, stage)} fps is {frames} frames; "
                                   f"{e.message}", param="seconds") from None
        return params

    def _frames(self, req: VideoRequest, stage: Any) -> Optional[int]:
        """Frames asked for: `num_frames`, else `seconds * fps + 1`, else None (the model's default)."""
        if req.num_frames is not None or req.seconds is None:
            return req.num_frames
        try:
            seconds = float(req.seconds)
        except ValueError:
            seconds = -1.0
        if not 0 < seconds <= 600:
            raise OpenAIError(400, f"seconds must be a number in (0, 600], got {str(req.seconds)[:20]!r}",
                              param="seconds")
        return int(round(seconds * _fps(req, stage))) + 1

    def _evict(self) -> None:
        done = [j.id for j in self.jobs.values() if j.finished]
        for job_id in done[: max(0, len(done) - self.limits.max_stored_videos)]:
            del self.jobs[job_id]

    async def _run(self, job: VideoJob, inputs: dict) -> None:
        try:
            final = None
            async for out in self.generate(inputs, job.params, job.id, default_param="prompt"):
                job.status = "in_progress"
                job.progress = min(99, int(100 * (out.progress or 0.0)))
                final = out
            if final is None or final.error or final.video is None:
                raise OpenAIError(500, f"generation failed: {final.error if final else 'no output'}")
            frames = final.video.frames
            job.content = await asyncio.to_thread(encode_mp4, frames, final.video.fps)
            job.first_frame = frames[0]
            job.status, job.progress, job.completed_at = "completed", 100, int(time.time())
        except asyncio.CancelledError:                          # deleted: the engine request is aborted
            raise
        except OpenAIError as e:                               # a run-time failure of this job: its own error
            code = "generation_failed" if isinstance(e.__cause__, RequestFailedError) else e.code or e.type
            self._fail(job, code, e.message)
        except Exception as e:                                  # an encoder error must not go unreported
            self._fail(job, "internal_error", f"{type(e).__name__}: {e}")
        finally:
            self._evict()

    @staticmethod
    def _fail(job: VideoJob, code: str, message: str) -> None:
        job.status, job.error, job.completed_at = "failed", {"code": str(code), "message": message}, int(time.time())

    # ---- read, list, delete -------------------------------------------------------------------
    def get(self, video_id: str) -> VideoJob:
        job = self.jobs.get(video_id)
        if job is None:
            raise OpenAIError(404, f"No video found with id {video_id!r}", param="video_id", code="not_found")
        return job

    def content(self, video_id: str, variant: str) -> Response:
        job = self.get(video_id)
        if variant not in ("video", "thumbnail"):
            raise OpenAIError(400, f"variant must be \"video\" or \"thumbnail\", got {variant!r}", param="variant")
        if job.status != "completed":
            raise OpenAIError(400, f"video {video_id} is {job.status}; its content is ready once the status is "
                                   "completed", param="video_id", code="video_not_ready")
        if variant == "thumbnail":
            from PIL import Image

            return Response(encode_image(Image.fromarray(job.first_frame), "webp"), media_type="image/webp")
        return Response(job.content, media_type="video/mp4",
                        headers={"Content-Disposition": f'attachment; filename="{video_id}.mp4"'})

    def list(self, after: Optional[str], limit: int, order: str) -> dict:
        if order not in ("asc", "desc"):
            raise OpenAIError(400, f"order must be \"asc\" or \"desc\", got {order!r}", param="order")
        if not 1 <= limit <= 100:
            raise OpenAIError(400, f"limit must be in [1, 100], got {limit}", param="limit")
        jobs = list(self.jobs.values())
        if order == "desc":
            jobs.reverse()
        if after is not None:
            ids = [j.id for j in jobs]
            if after not in ids:
                raise OpenAIError(400, f"after must be the id of a listed video, got {after!r}", param="after")
            jobs = jobs[ids.index(after) + 1:]
        page = [j.to_dict() for j in jobs[:limit]]
        return {"object": "list", "data": page, "has_more": len(jobs) > limit,
                "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None}

    def delete(self, video_id: str) -> dict:
        job = self.get(video_id)
        del self.jobs[video_id]
        if job.task is not None and not job.task.done():
            job.task.cancel()
        return {"id": video_id, "object": "video.deleted", "deleted": True}


def register_video_routes(app: FastAPI, engine: Any, served_model_name: str, metrics: Any = None,
                          limits: Optional[MediaLimits] = None) -> ServingVideos:
    serving = ServingVideos(engine, served_model_name, metrics, limits or MediaLimits())

    @app.post("/v1/videos", openapi_extra=body_schema(VideoRequest))
    async def create_video(raw: Request) -> dict:
        return await serving.create(raw)

    @app.get("/v1/videos")
    async def list_videos(after: Optional[str] = None, limit: int = 20, order: str = "desc") -> dict:
        return serving.list(after, limit, order)

    @app.get("/v1/videos/{video_id}")
    async def retrieve_video(video_id: str) -> dict:
        return serving.get(video_id).to_dict()

    @app.get("/v1/videos/{video_id}/content")
    async def video_content(video_id: str, variant: str = "video") -> Response:
        return serving.content(video_id, variant)

    @app.delete("/v1/videos/{video_id}")
    async def delete_video(video_id: str) -> dict:
        return serving.delete(video_id)

    return serving
