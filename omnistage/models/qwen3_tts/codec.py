"""`Qwen3TTSDecoderStage`: the speech-tokenizer decoder as the codec model of a `CodecEngine` stage
(registry back end "qwen3_tts_decoder"; the decoder stage's process).

In: `FramesInput` pieces (every codebook of each talker frame, streamed from the talker by the
`qwen3_tts.talker_to_decoder` adapter; `finished` with the last one). A chunk is the next
frames of the request's chunk schedule (below), or what is left once the input is done; it is decoded with up to `left_context_frames` frames before it, whose samples are cut
off again. The chunk sizes grow (`chunk_frames_next`): the first is the request's own
`initial_codec_chunk_frames` (TTSParams) or the stage's `first_chunk_frames`, then each is as long as
the audio decoded so far, up to `chunk_frames` (first 2: 2, 2, 4, 8, 16, 24, 24, ...): a small first
chunk for an early first packet, and the audio a listener holds doubles with each chunk, so the larger
ones never leave it dry while the talker runs faster than real time. A piece's `context` (Base in-context cloning: the reference voice's codes, which the
reference decodes in front of the generated frames and cuts off) is taken with the request's first
piece as frames before the first chunk: left context only, never output. One step decodes the chunks of up to `max_batch` requests in one forward: their frame
windows are padded on the right (the decoder is causal, so padding never reaches the real
samples). A decoder that looks ahead (`SpeechDecoder.look_ahead`: Qwen3-Omni's code2wav, whose stage
subclasses this stage) also needs that many frames after the chunk, decoded and cut off too, until
the input is done; the last chunk then ends where the whole decode ends (`tail_loss`).
On CUDA each batch is padded to its (batch bucket, window length), the window lengths those of the
schedule (`windows`: the longest window of each of its places, with the stage's first chunk), and
every such shape is met at start-up: with `cuda_graphs` (the engine's setting) captured, and each
batch replays its graph (the decoder is hundreds of small convolutions and norms, launch-bound at a
first chunk's few frames), else decoded once, so no request waits for a first-use shape. Out (through the engine): float32 mono at 24 kHz, chunk by chunk; `prompt_token_ids`
are the group-0 codes decoded so far.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from omnistage.codec.engine import CodecEngine
from omnistage.codec.speech import TTSParams
from omnistage.layers.graph_cache import GraphCache
from omnistage.models.qwen3_tts.decoder import SpeechDecoder, load_decoder

logger = logging.getLogger(__name__)

SAMPLE_RATE = 24000
# the `decoder_dtype` option -> what the decoder's convolutions and matmuls compute in (`SpeechDecoder.to_dtype`)
DECODER_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class FramesInput:
    frames: list[list[int]] = field(default_factory=list)  # per frame: its code in every codebook (group 0 first)
    finished: bool = True                       # no frames follow the last one given so far
    context: Any = None                         # [T, G] frames the audio continues (left context, not output); read with the first piece

    def __len__(self) -> int:
        return len(self.frames)

    def slice(self, start: int, end: int, finished: bool) -> "FramesInput":
        return FramesInput([list(f) for f in self.frames[start:end]], finished, self.context if start == 0 else None)


@dataclass
class TalkerFrames:
    """A talker's frames so far, as the talker -> decoder adapter returns them: the output's own
    lists, turned into a `FramesInput` only for the frames `slice` sends (the orchestrator sends
    each frame once; building every frame so far at every step cost O(frames) per row per step)."""
    ids: list[int]                              # group-0 code per generated token
    codes: list[list[int]]                      # per generated token: codebooks 1..G-1
    count: int                                  # frames given (the eos frame left out once the talker stopped)
    finished: bool = True                       # no frames follow
    context: Any = None                         # as `FramesInput.context`

    def __len__(self) -> int:
        return self.count

    def slice(self, start: int, end: int, finished: bool) -> FramesInput:
        end = min(end, self.count)
        frames = [[t] + list(c) for t, c in zip(self.ids[start:end], self.codes[start:end])]
        return FramesInput(frames, finished, self.context if start == 0 else None)

    @property
    def frames(self) -> list[list[int]]:
        return self.slice(0, self.count, self.finished).frames


class DecoderState:
    """One request's frames: those received and how many are decoded."""

    def __init__(self):
        self.frames: list[list[int]] = []       # the context frames, then every frame received, in order
        self.start: Optional[int] = None        # how many of `frames` are context (set by the first piece)
        self.done = 0                           # frames decoded so far (context frames count as decoded)
        self.first: Optional[int] = None        # frames of its first chunk (None: the stage's `first_chunk_frames`)


class Qwen3TTSDecoderStage:
    """The codec model (`codec/engine.py: CodecModel`) of the Qwen3-TTS decoder stage."""

    params_type = TTSParams

    def __init__(self, model_dir: str, device: Any = "cpu", first_chunk_frames: int = 2, chunk_frames: int = 24,
                 left_context_frames: int = 25, max_batch: int = 16, decoder_dtype: str = "float32",
                 cuda_graphs: bool = True):
        for name, value, low in (("first_chunk_frames", first_chunk_frames, 1), ("chunk_frames", chunk_frames, 1),
                                 ("left_context_frames", left_context_frames, 0), ("max_batch", max_batch, 1)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if decoder_dtype not in DECODER_DTYPES:
            raise ValueError(f"decoder_dtype must be one of {sorted(DECODER_DTYPES)}, got {decoder_dtype!r}")
        self.decoder = self.load_decoder(model_dir, torch.device(device)).to_dtype(DECODER_DTYPES[decoder_dtype])
        self.first_chunk, self.chunk, self.context = first_chunk_frames, chunk_frames, left_context_frames
        self.max_batch = max_batch
        self.windows = self.schedule_windows()  # the longest window of each place of the chunk schedule
        self.buckets = [b for b in (1, 2, 4, 8, 16, 32, 64) if b < max_batch] + [max_batch]  # batch sizes padded to
        # On CUDA every decode is padded to the smallest (bucket, window) that holds it (`padded_shape`: empty
        # rows below, frames on the right; causal, so the real samples do not change), and each of those shapes
        # is met here at start-up (`_warm_up`): captured as a CUDA graph with `cuda_graphs`, else decoded once
        # (a new conv shape costs a library plan / kernel selection on its first call), so no listener waits for
        # a first-use shape. A window past the longest (a request's own longer first chunk) runs eagerly at its
        # length. On the CPU decodes run unpadded.
        self.padded = self.decoder.device.type == "cuda"
        self.graphs: Optional[GraphCache] = None
        if self.padded and cuda_graphs:
            self.graphs = GraphCache(max_graphs=len(self.buckets) * len(self.windows))
        self._batches = 0
        self._graphed = 0
        self.capture_seconds = 0.0               # start-up seconds of `_warm_up` (graph captures or eager decodes)
        if self.padded:
            self._warm_up()

    def _warm_up(self) -> None:
        """One decode of zero codes at every (bucket, window); the eager activations' memory goes back to
        the device after (stages sharing the GPU plan on what is free)."""
        start = time.perf_counter()
        for rows in self.buckets:
            for frames in self.windows:
                self._run([[[0] * self.decoder.groups] * frames] * rows)
        torch.cuda.empty_cache()
        self.capture_seconds = time.perf_counter() - start
        logger.info("decoder: %s (batches %s x frames %s) in %.1f s",
                    "decoded each shape once" if self.graphs is None else f"captured {self.graphs.captures} graphs",
                    self.buckets, self.windows, self.capture_seconds)

    @staticmethod
    def load_decoder(model_dir: str, device: torch.device) -> SpeechDecoder:
        return load_decoder(model_dir, device)

    @classmethod
    def from_stage_spec(cls, spec) -> CodecEngine:
        """Options: `first_chunk_frames`, `chunk_frames`, `left_context_frames`, `max_batch`,
        `decoder_dtype` ("float32", the default, or "bfloat16"), `cuda_graphs` (the engine's setting)."""
        options = {"cuda_graphs": spec.engine.cuda_graphs, **spec.options}
        return CodecEngine(cls(spec.model_dir, device=spec.engine.torch_device(), **options))

    def voices(self) -> list[dict[str, Any]]:
        return []                               # the talker stage knows the voices

    def check_params(self, params: Any) -> None:
        return None

    def new_state(self, params: Any) -> DecoderState:
        state = DecoderState()
        state.first = getattr(params, "initial_codec_chunk_frames", None)
        return state

    def batch_key(self, state: DecoderState) -> None:
        return None

    def take(self, state: DecoderState, piece: Any) -> bool:
        if not isinstance(piece, FramesInput):
            raise ValueError("the Qwen3-TTS decoder takes FramesInput (talker frames)")
        width = self.decoder.groups
        bad = [f for f in piece.frames if len(f) != width]
        if bad:
            raise ValueError(f"every frame must have {width} codes, got {len(bad[0])}")
        if state.start is None:
            context = [] if piece.context is None else np.asarray(piece.context).tolist()
            bad = [f for f in context if len(f) != width]
            if bad:
                raise ValueError(f"every context frame must have {width} codes, got {len(bad[0])}")
            state.frames, state.start, state.done = context, len(context), len(context)
        state.frames.extend(piece.frames)
        return piece.finished

    def ready(self, state: DecoderState, input_done: bool) -> Optional[tuple[int, int]]:
        pending = len(state.frames) - state.done
        size = self.chunk_frames_next(state)
        if pending >= size + self.decoder.look_ahead or (input_done and pending > 0):
            return state.done, state.done + min(pending, size)
        return None

    def decode(self, states: list[DecoderState], chunks: list[tuple[int, int]]) -> list[np.ndarray]:
        windows, contexts, keep = [], [], []
        up, ahead = self.decoder.upsample, self.decoder.look_ahead
        for state, (start, end) in zip(states, chunks):
            ctx = min(self.context, start)
            windows.append(state.frames[start - ctx:end + ahead])
            contexts.append(ctx)
            tail = end + ahead > len(state.frames)  # the answer's last chunk: ends as the whole decode does
            keep.append((end - start) * up - (self.decoder.tail_loss if tail else 0))
        wav = self._run(windows).float().cpu().numpy()
        self._batches += 1
        audio = []
        for i in range(len(states)):
            audio.append(np.ascontiguousarray(wav[i, contexts[i] * up:contexts[i] * up + keep[i]]))
        for state, (_, end) in zip(states, chunks):    # only once every chunk is decoded (engine retries)
            state.done = end
        return audio

    def _run(self, windows: list[list[list[int]]]) -> torch.Tensor:
        """Frame windows (per row: its frames, each of G codes) -> samples [rows, longest * upsample] in
        one decode: the windows in one zero codes tensor (`padded_shape` when `padded`, else as long as
        the longest), replayed from that shape's CUDA graph when there is one, else the eager decoder."""
        rows, longest = len(windows), max(map(len, windows))
        shape = self.padded_shape(rows, longest) if self.padded else (rows, longest)
        codes = torch.zeros(shape[0], self.decoder.groups, shape[1], dtype=torch.long)
        for i, w in enumerate(windows):
            codes[i, :, :len(w)] = torch.tensor(w, dtype=torch.long).T
        codes = codes.to(self.decoder.device)
        if self.graphs is not None and shape[1] in self.windows:
            wav = self.graphs.run(shape, [codes], self.decoder)
            self._graphed += 1
        else:
            wav = self.decoder(codes)
        return wav[:rows, :longest * self.decoder.upsample]

    def padded_shape(self, rows: int, frames: int) -> tuple[int, int]:
        """(rows, frames) a decode of `rows` windows of up to `frames` frames is padded to on CUDA: the
        smallest of `buckets` and of `windows` that hold them (past the longest window: `frames`)."""
        return (next((b for b in self.buckets if b >= rows), rows),
                next((w for w in self.windows if w >= frames), frames))

    def chunk_frames_next(self, state: DecoderState) -> int:
        """Frames of the request's next chunk: its first chunk, then as many as it has decoded so far,
        up to `chunk_frames` (the module docstring's schedule)."""
        return self.chunk_after(state.done - (state.start or 0), state.first or self.first_chunk)

    def chunk_after(self, done: int, first: int) -> int:
        """The schedule: the chunk that follows `done` decoded frames of a request whose first is `first`."""
        return first if done == 0 else min(self.chunk, max(first, done))

    def schedule_windows(self) -> list[int]:
        """The longest window (context + chunk + look-ahead) of each place of the schedule with the
        stage's first chunk, until chunks are `chunk_frames` long with full left context."""
        ahead, done, windows = self.decoder.look_ahead, 0, set()
        while True:
            size = self.chunk_after(done, self.first_chunk)
            windows.add(min(self.context, done) + size + ahead)
            if size == self.chunk and done >= self.context:
                return sorted(windows)
            done += size

    def sample_rate(self, state: DecoderState) -> int:
        return SAMPLE_RATE

    def prompt(self, state: DecoderState) -> tuple[Optional[str], list[int]]:
        return None, [f[0] for f in state.frames[state.start or 0:state.done]]

    def stats(self) -> dict[str, float]:
        return {"decoder_batches_total": float(self._batches), "decoder_graphed_batches_total": float(self._graphed),
                "decoder_capture_seconds": self.capture_seconds}
