"""GET /v1/capabilities: what the served pipeline can do, for the playground and other clients
(API-server event loop; reads only what the engine and its stages state at start-up).

In: the `AsyncOmni` engine (its pipeline spec, main stage kind, speech stage, voices, media types,
and a diffusion stage's `DiffusionLimits`) and the server's `MediaLimits`. Out: one JSON object:

    {"object": "capabilities", "model": served id,
     "tasks": subset of TASKS, in that order,
     "chat":   {"max_model_len", "input_media": ["image", "audio", "video"], "output_modalities"} | null,
     "audio":  {"voices": [{id, name, sample_rate, ...}], "formats"} | null,   # chat audio and speech
     "speech": {"formats", "stream_formats", "speed": {"min", "max"}, "max_input_chars"} | null,
     "images": {"generation", "edit", "stream", "max_n", "output_formats", "max_upload_bytes",
                "max_upload_files", + SIZE_FIELDS} | null,
     "video":  {"input_reference": "required" | "none", "max_jobs", + SIZE_FIELDS, "default_num_frames",
                "max_num_frames", "frame_step", "default_fps", "max_fps"} | null}

SIZE_FIELDS: `default_width, default_height` (pixels of a request without `size`), `size_multiple
{width, height}`, `max_width, max_height` (the model's), `max_pixels` (the server's cap on width *
height), `steps {default, max}`, `default_guidance_scale`. Everything comes from the registry-built
stages and the server's caps; nothing here names a model.
"""

from __future__ import annotations

from typing import Any, Optional

from fastapi import FastAPI

from omnistage.codec.speech import SPEED_RANGE
from omnistage.entrypoints.openai.errors import OpenAIError
from omnistage.entrypoints.openai.serving_engine import diffusion_stage
from omnistage.entrypoints.openai.serving_images import MAX_STEPS, MediaLimits
from omnistage.entrypoints.openai.serving_speech import MAX_INPUT_CHARS
from omnistage.entrypoints.openai.serving_videos import MAX_FPS
from omnistage.io.audio import AUDIO_FORMATS
from omnistage.io.media import IMAGE_FORMATS

# every task a pipeline may offer: chat text, audio in chat answers, /v1/audio/speech, image
# generation, image edits, video jobs
TASKS = ("chat", "chat_audio", "speech", "image_generation", "image_edit", "video")
SPEECH_STREAM_FORMATS = ("audio", "sse")        # `stream_format` values POST /v1/audio/speech takes


def _sizes(lim: Any, limits: MediaLimits) -> dict[str, Any]:
    mh, mw = lim.size_multiple
    return {"default_width": lim.default_width, "default_height": lim.default_height,
            "size_multiple": {"width": mw, "height": mh}, "max_width": lim.max_width, "max_height": lim.max_height,
            "max_pixels": limits.max_image_pixels, "steps": {"default": lim.default_steps, "max": MAX_STEPS},
            "default_guidance_scale": lim.default_guidance_scale}


def _images(lim: Any, stage: Any, limits: MediaLimits) -> dict[str, Any]:
    return {"generation": not lim.takes_image, "edit": lim.takes_image,
            "mask": bool(getattr(stage, "takes_mask", False)), "stream": True, "max_n": limits.max_images, "output_formats": [f for f in IMAGE_FORMATS if f != "jpg"],
            "max_upload_bytes": limits.max_upload_bytes, "max_upload_files": limits.max_upload_files,
            **_sizes(lim, limits)}


def _video(lim: Any, limits: MediaLimits) -> dict[str, Any]:
    return {"input_reference": "required" if lim.takes_image else "none", "max_jobs": limits.max_video_jobs,
            **_sizes(lim, limits), "default_num_frames": lim.default_num_frames,
            "max_num_frames": min(lim.max_num_frames or limits.max_video_frames, limits.max_video_frames),
            "frame_step": lim.frame_step, "default_fps": lim.default_fps, "max_fps": MAX_FPS}


def capabilities(engine: Any, served_model_name: str, limits: MediaLimits) -> dict[str, Any]:
    """The capabilities object of the module docstring for `engine` served as `served_model_name`
    (503 once the engine is down: what it could do no longer holds)."""
    if not engine.is_running:
        raise OpenAIError(503, "the engine is not running; restart the server", code="engine_dead")
    tasks: set[str] = set()
    out: dict[str, Any] = {"object": "capabilities", "model": served_model_name}
    chat = audio = speech = images = video = None
    modalities = list(engine.output_modalities)
    if engine.main_stage_kind == "ar":
        tasks.add("chat")
        chat = {"max_model_len": engine.max_model_len, "input_media": list(engine.media_types),
                "output_modalities": modalities}
        if "audio" in modalities:
            tasks.add("chat_audio")
    if engine.speaks:                           # a TTS stage, or a model that reads aloud (omni)
        tasks.add("speech")
        speech = {"formats": list(AUDIO_FORMATS), "stream_formats": list(SPEECH_STREAM_FORMATS),
                  "speed": {"min": SPEED_RANGE[0], "max": SPEED_RANGE[1]}, "max_input_chars": MAX_INPUT_CHARS}
    if tasks & {"chat_audio", "speech"}:
        # the model's preset voices, as `GET /v1/audio/voices` lists them (which adds the uploaded ones)
        audio = {"voices": [{**v, "uploaded": False} for v in engine.voices()], "formats": list(AUDIO_FORMATS)}
    stage = diffusion_stage(engine)
    lim: Optional[Any] = getattr(stage, "limits", None)
    if lim is not None and lim.output_kind == "image":
        images = _images(lim, stage, limits)
        tasks.add("image_edit" if lim.takes_image else "image_generation")
    elif lim is not None and lim.output_kind == "video":
        video = _video(lim, limits)
        tasks.add("video")
    out["tasks"] = [t for t in TASKS if t in tasks]
    out.update(chat=chat, audio=audio, speech=speech, images=images, video=video)
    return out


def register_capabilities_route(app: FastAPI, engine: Any, served_model_name: str,
                                limits: Optional[MediaLimits] = None) -> None:
    limits = limits or MediaLimits()

    @app.get("/v1/capabilities")
    async def get_capabilities() -> dict:
        """What the served model can do (tasks, voices, formats, size / step / frame limits)."""
        return capabilities(engine, served_model_name, limits)
