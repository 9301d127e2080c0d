"""Helpers of the Qwen3-TTS tests: reference fixtures, a tiny talker engine, request plumbing."""

from __future__ import annotations

import os

import numpy as np
import torch

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def reference(name: str) -> dict[str, np.ndarray]:
    with np.load(os.path.join(FIXTURES, f"{name}.npz")) as data:
        return dict(data)


def talker_engine(folder: str):
    from omnistage.ar.engine import AREngine
    from omnistage.config import EngineConfig
    from omnistage.models.qwen3_tts.talker import load_talker

    return AREngine(folder, EngineConfig(device="cpu", dtype="float32", max_model_len=512, num_kv_blocks=96,
                                         max_num_seqs=8), loader=load_talker)


def params_of(case: dict, **changes):
    """The case's inputs as Qwen3TTSParams (greedy unless changed; Base: its reference voice)."""
    from omnistage.models.qwen3_tts.prompt import Qwen3TTSParams

    fields = dict(voice=case.get("speaker"), language=case["language"], instructions=case.get("instruct"),
                  do_sample=False, max_new_tokens=case["max_new_tokens"],
                  non_streaming_mode=case.get("non_streaming_mode"))
    if case["variant"] == "base":
        ref = reference(case["name"])
        fields.update(ref_audio=(ref["ref_audio"], case.get("ref_rate", 24000)), ref_text=case.get("ref_text"),
                      x_vector_only_mode=case["x_vector_only_mode"])
    fields.update(changes)
    return Qwen3TTSParams(**fields)


def seeded_params_of(case: dict, **changes):
    """The case's params with its sampling (`gen`: do_sample, seed) as the reference ran it."""
    return params_of(case, do_sample=case["gen"]["do_sample"], seed=case["gen"].get("seed"), **changes)


def frames_of(out) -> np.ndarray:
    """A finished talker output -> [frames, groups] without the eos frame (as the decoder edge cuts it)."""
    from omnistage.models.qwen3_tts.pipeline import talker_to_decoder

    return np.array(talker_to_decoder(out).frames, dtype=np.int64).reshape(-1, 4)


def run_all(engine, requests: dict, stagger: int = 0) -> dict:
    """Adds requests (id -> (text, params)) -- all at once, or one more every `stagger` steps --
    and steps until all finish; returns id -> last StageOutput."""
    pending, last, step = list(requests.items()), {}, 0
    while pending or engine.has_unfinished():
        if pending and (stagger == 0 or step % stagger == 0):
            batch = pending if stagger == 0 else pending[:1]
            for rid, (text, params) in batch:
                engine.add_request(rid, text, params)
            pending = [] if stagger == 0 else pending[1:]
        with torch.inference_mode():
            for out in engine.step():
                last[out.request_id] = out
        step += 1
    return last


def decode_all(stage, items: dict[str, np.ndarray], params=None) -> dict[str, np.ndarray]:
    """Frames [T, G] per request, all added at once with every frame, through a `CodecEngine` of the
    decoder stage `stage` (`params`: every request's, None: the stage's defaults) -> each one's audio."""
    from omnistage.codec.engine import CodecEngine
    from omnistage.models.qwen3_tts.codec import FramesInput

    engine = CodecEngine(stage)
    for rid, frames in items.items():
        engine.add_request(rid, FramesInput(np.asarray(frames).tolist(), finished=True), params)
    audio = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                audio[out.request_id] = out.output.audio.samples
    return audio
