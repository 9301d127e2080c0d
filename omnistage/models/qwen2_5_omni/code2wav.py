"""`Code2Wav`: Qwen2.5-Omni's token2wav (DiT + BigVGAN) as the codec model of a batched, streaming
`CodecEngine` stage (registry back end "qwen2_5_omni_code2wav"; runs in the code2wav stage's process).

In: a request's input is a `CodecInput` (talker codec ids, `finished=False` while the talker streams
more) or a plain list of ids, and its params a `Code2WavParams` (voice from the checkpoint's
`spk_dict.pt`, noise seed, ODE settings). Out (through the engine): the cumulative `AudioOutput`
(float32 mono in [-1, 1] at 24000 Hz), the codes read as `prompt_token_ids`.

How a request is decoded (the DiT's ODE is `code2wav_ode.py`; the vocoder is transformers'
`Qwen2_5OmniToken2WavBigVGANModel`):
  * Noise: a per-request `torch.Generator` seeded with `params.seed` draws the initial mel noise
    frame by frame as codes arrive; the draws concatenate to exactly `torch.randn([1, frames, 80])`
    after `torch.manual_seed(seed)`, which is what transformers' `token2wav` uses, so whole-sequence
    decoding reproduces it, and chunked decoding uses the same noise for every frame.
  * Whole mode (`chunk_codes=None`): once the input is finished, one window over all codes: the ODE
    of `Qwen2_5OmniToken2WavDiTModel.sample`, then BigVGAN over the whole mel.
  * Chunked mode: mel frames [s, e) are decoded by running the ODE over the window
    [s - past, e + future) (past/future in DiT blocks of 24 frames, window start aligned to a block
    so the DiT's block-local attention sees the same blocks as in a whole decode); the frames
    [s, e) are kept, the window's frames after e are kept as a provisional look-ahead. A chunk
    waits until the codes for e + future exist (or the input is finished). BigVGAN then vocodes
    [s, e) from the kept mel before s (its receptive field, `vocoder_context` frames) plus the
    provisional look-ahead after e; only the samples of [s, e) are emitted (no overlap-add). Errors
    vs a whole decode come from the ODE state outside the window (each of the 36 DiT evaluations
    widens the dependency by the look-back/ahead blocks) and from BigVGAN's provisional right
    context; both shrink as `past_blocks` / `future_blocks` grow (measured in tests/models/qwen2_5_omni).
  * First chunk: a request's `Code2WavParams.initial_codec_chunk_frames` (talker codes; HTTP chat
    and speech field of that name), else a size chosen from the stage's load when the request
    arrives (`first_chunk_for_load`: `first_chunk_codes` while at most 4 requests are in the stage,
    doubling per 4x more, at most `chunk_codes`; `dynamic_first_chunk: false` keeps
    `first_chunk_codes`); every later chunk has `chunk_codes`. The window rule above holds for any
    first size, so the streamed waveform stays within the tolerance of tests/models/test_omni_streaming.py
    of the whole decode (same noise, same left context / look-ahead).
  * Batching: the engine hands one `decode` the ready chunks of up to `max_batch_requests` requests
    (the omni pipeline: 32) with the same ODE settings (`Code2WavParams.ode_key`, the batch key),
    first chunks (a request's first audio) before later ones and in batches of their own
    (`first_chunks_alone`: a first chunk's short window decodes in a small, fast batch instead of
    padded to a full batch of later chunks; `codec/scheduler.py`); the ODE runs them in one forward
    per evaluation. BigVGAN runs once per group of equal-length inputs (padding
    would change a convolution's tail).
  * CUDA graphs (on a GPU, chunked mode, `cuda_graphs`): the ODE of a batch (36 DiT evaluations,
    launch-bound when small) replays as one graph. Graphs are captured at start-up, for the default
    ODE settings, for every batch size of `GRAPH_BATCH_SIZES` (1, 2, 4, 8, 12, 16, 24, ...) up to
    `max_batch_requests` and every steady window length (`_steady_windows`: each first-chunk size
    the load rule can pick -- 12 / 24 / 48 / 96 codes by default -- and the commonest later
    windows); a batch is padded to the next captured
    size with empty rows and its rows to the next captured window with masked frames, so only a
    window longer than every captured one (a request's own large first chunk) runs eagerly. BigVGAN
    replays from graphs too (`DeviceVocoder.capture`, token2wav.py), for the same batch sizes and the
    input lengths of a request's first chunks and steady ones (`_vocoder_lengths`). The capture
    time is logged (`capture_seconds`; ~6 windows x 8 sizes of ODE graphs for the omni pipeline).
  * Precision: token2wav runs in float32 (as transformers runs it). On a GPU its float32 matmuls use
    TF32 tensor cores (inputs rounded to 10-bit mantissas; stage option `tf32`, default true; false:
    plain fp32): measured on an H200 (7B shape), the CUDA-graph ODE of 8 steady chunks takes 546 ms
    with TF32 and 1514 ms in plain fp32 (benchmarks/profile_talker.py); the waveform moves by 2e-3 of
    its peak (benchmarks/check_cuda.py). The setting is scoped to this stage's own work
    (`code2wav_ode.tf32_matmuls`: set around each ODE run and graph capture, restored after), so in
    the shared layout, where every stage runs in one process, no other stage's float32 matmul
    changes; that is safe because the process steps its engines from one thread, one at a time
    (`pipeline/shared.py`). Stage option `vocoder_dtype: bfloat16` runs BigVGAN's convolutions under
    bf16 autocast (float32 default). Stage option `fused_vocoder` (default null: on CUDA only; H200, `code2wav_bench.py --only
    vocoder`: 22.1 -> 12.7 ms at 1 row, 146 -> 77 at 8, 563 -> 298 at 32) runs each of BigVGAN's anti-aliased SnakeBeta
    activations as one Triton kernel on CUDA (`bigvgan_fused.py`; float32 inside, within 1e-5 of
    transformers' module under Triton's interpreter). Stage option `fused_dit` (default null: on CUDA only)
    runs each DiT evaluation through `dit_fused.py` (one q|k|v GEMM, block-local attention, fused AdaLN
    steps, one-kernel rotary, GELU in the MLP GEMM's epilogue, the static input projected once per
    batch; float32 rounding off the reference path on a CPU). Stage option `dit_dtype` (default null: bfloat16 on
    CUDA, float32 elsewhere) `bfloat16` runs the DiT's attention and MLP linears in bf16 (residual stream,
    norms, modulation and ODE state stay float32). At the 7B shape on an H200 (code2wav_bench) the
    fused bf16 steady chunk is 35.8 / 128 / 526 ms at 1 / 8 / 32 rows and a first chunk 28.3 ms at 1 row
    (session 7's kernels: 62.3 / 207 / 1049 and 48.4; fused TF32 then 87.4 / 328), 1.3e-3 of the mel's std
    off the plain fp32 reference (session 7: 1.2e-3; TF32 9.3e-4); on the tiny
    checkpoint the whole decode moves by 3e-4 of the waveform's peak (mel 5.6e-3 of std 2.1; tested
    < 2e-3); benchmarks/code2wav_bench.py measures its speed and error at the 7B shape.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import numpy as np
import torch

from omnistage.codec.engine import CodecEngine
from omnistage.codec.speech import MAX_CHUNK_FRAMES, check_voice
from omnistage.models.qwen2_5_omni.code2wav_ode import DIT_DTYPES, Code2WavODE, tf32_matmuls
from omnistage.models.qwen2_5_omni.token2wav import DeviceTimer, DeviceVocoder, load_token2wav, vocoder_context
from omnistage.params import check_param

logger = logging.getLogger(__name__)

SAMPLE_RATE = 24000
MAX_BATCH_REQUESTS = 64                         # `max_batch_requests` bound: one graph per size up to it
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48)   # ODE / BigVGAN graph rows below `max_batch_requests`


@dataclass
class Code2WavParams:
    voice: Optional[str] = None                 # a key of spk_dict.pt; None = the stage's default voice
    seed: Optional[int] = None                  # initial-noise seed; None = a fresh random seed
    num_steps: int = 10                         # ODE time points (transformers' default: 10 -> 9 RK4 steps)
    guidance_scale: float = 0.5                 # classifier-free guidance weight; < 1e-5 turns CFG off
    sway_coefficient: Optional[float] = -1.0    # sway sampling of the time points; None = uniform
    initial_codec_chunk_frames: Optional[int] = None  # talker codes in the first streamed chunk; None = chosen
    # by the stage from its load (`first_chunk_for_load`); ignored in whole mode

    def __post_init__(self) -> None:
        check_param(self.initial_codec_chunk_frames is None or (
            isinstance(self.initial_codec_chunk_frames, int) and not isinstance(self.initial_codec_chunk_frames, bool)
            and 1 <= self.initial_codec_chunk_frames <= MAX_CHUNK_FRAMES), "initial_codec_chunk_frames",
            f"an integer in [1, {MAX_CHUNK_FRAMES}]", self.initial_codec_chunk_frames)
        check_param(isinstance(self.num_steps, int) and 2 <= self.num_steps <= 100, "num_steps",
                    "an integer in [2, 100]", self.num_steps)
        check_param(isinstance(self.guidance_scale, (int, float)) and self.guidance_scale >= 0, "guidance_scale",
                    "a number >= 0", self.guidance_scale)
        check_param(self.seed is None or (isinstance(self.seed, int) and self.seed >= 0), "seed",
                    "a non-negative integer or None", self.seed)

    def ode_key(self) -> tuple:
        """Requests with the same key can share one ODE forward: (num_steps, guidance_scale, sway_coefficient)."""
        return (self.num_steps, float(self.guidance_scale), self.sway_coefficient)


@dataclass
class CodecInput:
    codes: list[int] = field(default_factory=list)  # talker codec ids (no bos/eos), in order
    finished: bool = True                       # no codes follow the last one given so far

    def __len__(self) -> int:
        return len(self.codes)

    def slice(self, start: int, end: int, finished: bool) -> "CodecInput":
        codes = self.codes[start:end]           # a list's slice is a copy already
        return CodecInput(codes if isinstance(codes, list) else list(codes), finished)


def first_chunk_for_load(active: int, first: int, chunk: int) -> int:
    """Codes in a new request's first chunk when `active` requests are in the stage already: `first`
    while at most 4 are (the earliest first audio), twice that up to 16, four times up to 64, and so
    on, never more than `chunk` (many streams: fewer, fuller ODE batches, each stream's lead grows)."""
    size, limit = first, 4
    while active > limit and size < chunk:
        size, limit = size * 2, limit * 4
    return min(size, chunk)


class Code2WavState:
    """One request's decoding state; a chunk of it is (s, e, window start, window end) in mel frames."""

    def __init__(self, params: Code2WavParams, mel_dim: int, first_frames: int = 0, device: Any = "cpu"):
        self.params = params                    # the voice filled in
        self.first_frames = first_frames        # mel frames of the first chunk (chunked mode)
        self.codes: list[int] = []              # every code received so far
        seed = params.seed if params.seed is not None else secrets.randbits(62)
        self.generator = torch.Generator().manual_seed(seed)
        self.noise = torch.zeros(0, mel_dim)    # initial ODE state per mel frame, drawn as needed
        self.mel = torch.zeros(0, mel_dim, device=device)  # final mel frames [0, done), on the stage's device
        self.lookahead = torch.zeros(0, mel_dim, device=device)  # provisional mel after `done` (last window)

    @property
    def done(self) -> int:
        return self.mel.shape[0]

    def draw_noise(self, frames: int) -> torch.Tensor:
        missing = frames - self.noise.shape[0]
        if missing > 0:
            extra = torch.randn(1, missing, self.noise.shape[1], generator=self.generator)[0]
            self.noise = torch.cat([self.noise, extra])
        return self.noise[:frames]


class Code2Wav:
    """The codec model (`codec/engine.py: CodecModel`) of the code2wav stage."""

    params_type = Code2WavParams

    def __init__(self, model_dir: str, device: Any = "cpu", default_voice: Optional[str] = None,
                 chunk_codes: Optional[int] = None, first_chunk_codes: Optional[int] = None,
                 past_blocks: int = 2, future_blocks: int = 1, vocoder_context_frames: Optional[int] = None,
                 max_batch_requests: int = 8, cuda_graphs: bool = True, dynamic_first_chunk: bool = True,
                 dit_dtype: Optional[str] = None, tf32: bool = True, fused_dit: Optional[bool] = None,
                 vocoder_dtype: str = "float32", fused_vocoder: Optional[bool] = None):
        for name, value in (("chunk_codes", chunk_codes), ("first_chunk_codes", first_chunk_codes)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if first_chunk_codes is not None and chunk_codes is None:
            raise ValueError("first_chunk_codes needs chunk_codes (chunked mode)")
        for name, value in (("past_blocks", past_blocks), ("future_blocks", future_blocks)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if not isinstance(max_batch_requests, int) or not 1 <= max_batch_requests <= MAX_BATCH_REQUESTS:
            raise ValueError(f"max_batch_requests must be an integer in [1, {MAX_BATCH_REQUESTS}], "
                             f"got {max_batch_requests!r}")
        if dit_dtype is None:                   # bf16 on a GPU (measured: same error as TF32, 1.2-1.6x faster)
            dit_dtype = "bfloat16" if torch.device(device).type == "cuda" else "float32"
        for name, value in (("dit_dtype", dit_dtype), ("vocoder_dtype", vocoder_dtype)):
            if value not in DIT_DTYPES:
                raise ValueError(f"{name} must be one of {sorted(DIT_DTYPES)}, got {value!r}")
        if not isinstance(tf32, bool):
            raise ValueError(f"tf32 must be true or false, got {tf32!r}")
        for name, value in (("fused_dit", fused_dit), ("fused_vocoder", fused_vocoder)):
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be true, false or null (on CUDA only), got {value!r}")
        if fused_vocoder is None:               # on a GPU (measured: BigVGAN 1.9x faster, 6.7e-5 of fp32)
            fused_vocoder = torch.device(device).type == "cuda"
        self.device = torch.device(device)
        self.model, self.speakers = load_token2wav(model_dir, self.device)
        self.dit = self.model.code2wav_dit_model
        self.vocoder = self.model.code2wav_bigvgan_model
        # its forward without host syncs; `fused_vocoder`: one kernel per anti-aliased activation
        self.vocode = DeviceVocoder(self.vocoder, DIT_DTYPES[vocoder_dtype], fused=fused_vocoder)
        self.default_voice = default_voice or next(iter(self.speakers))
        if self.default_voice not in self.speakers:
            raise ValueError(f"default_voice must be one of {sorted(self.speakers)}, got {default_voice!r}")
        cfg = self.dit.config
        self.repeats, self.block, self.mel_dim = cfg.repeats, cfg.block_size, cfg.mel_dim
        self.max_code = cfg.num_embeds          # the codec table has num_embeds + 1 rows
        self.hop = math.prod(self.vocoder.config.upsample_rates)
        self.chunk_frames = None if chunk_codes is None else chunk_codes * self.repeats
        self.first_chunk_frames = (first_chunk_codes or chunk_codes or 0) * self.repeats
        self.dynamic_first_chunk = dynamic_first_chunk   # a request without its own first chunk: by load
        self.active = 0                         # requests in the stage when the last one arrived (`on_load`)
        self.past, self.future = past_blocks * self.block, future_blocks * self.block
        self.voc_ctx = vocoder_context_frames if vocoder_context_frames is not None \
            else vocoder_context(self.vocoder.config)
        self.max_batch = max_batch_requests
        # on a GPU the engine keeps one batch in flight (`launch` / `collect`); on a CPU it calls `decode`
        self.asynchronous = self.device.type == "cuda"
        # first chunks in batches of their own (short windows: fast), not padded into a batch of later chunks
        self.first_chunks_alone = True
        # The ODE of a chunk replays as a CUDA graph when its window has one of the steady sizes (the
        # first chunk's, a later chunk's); other windows (a request's tail, whole mode) run eagerly.
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda" and self.chunk_frames is not None
        self.graph_frames: list[int] = sorted(self._steady_windows()) if self.cuda_graphs else []
        # captured batch sizes: a batch pads to the next one, so 12 and 24 cap the padded rows at a third
        self.batch_sizes = [b for b in GRAPH_BATCH_SIZES if b < max_batch_requests] + [max_batch_requests]
        self.ode = Code2WavODE(self.dit, self.speakers, self.device, dit_dtype=dit_dtype, tf32=tf32,
                               fused=fused_dit, max_graphs=4 * len(self.batch_sizes) * len(self.graph_frames))
        self._totals = {"dit_seconds_total": 0.0, "vocoder_seconds_total": 0.0,
                        "dit_batches_total": 0, "dit_rows_total": 0, "dit_graphed_batches_total": 0,
                        # row-frames the ODE ran, and of those the padding to a captured size (rows, window)
                        "dit_frames_total": 0, "dit_padding_frames_total": 0}
        self.capture_seconds = 0.0              # start-up time spent capturing the ODE's graphs
        if self.device.type == "cuda":          # each voice's speaker encoding now: at run time its copy of
            with tf32_matmuls(self.ode.tf32):   # the voice's reference mel would wait for the queued ODE
                for voice in self.speakers:
                    self.ode.voice(voice)
        if self.cuda_graphs:
            start = time.perf_counter()
            logger.info("code2wav: capturing %d ODE graphs (batch sizes %s x windows %s mel frames)",
                        len(self.batch_sizes) * len(self.graph_frames), self.batch_sizes, self.graph_frames)
            self.ode.capture(self.batch_sizes, self.graph_frames, Code2WavParams().ode_key(), self.default_voice)
            self.vocode.capture(self.batch_sizes, sorted(self._vocoder_lengths()), self.mel_dim)
            self.capture_seconds = time.perf_counter() - start
            logger.info("code2wav: captured %d ODE graphs and %d BigVGAN graphs (inputs of %s mel frames) in %.1f s",
                        self.ode.graphs.captures, self.vocode.graphs.captures, self.vocode.frames,
                        self.capture_seconds)

    @classmethod
    def from_stage_spec(cls, spec) -> CodecEngine:
        """The code2wav stage's engine; its options are this class's keyword arguments (module docstring)."""
        options = {"cuda_graphs": spec.engine.cuda_graphs, **spec.options}
        return CodecEngine(cls(spec.model_dir, device=spec.engine.torch_device(), **options))

    # ---- CodecModel: requests ---------------------------------------------------------------------
    def voices(self) -> list[dict[str, Any]]:
        return [{"id": v, "name": v, "sample_rate": SAMPLE_RATE, "backend": "qwen2_5_omni"} for v in self.speakers]

    def check_params(self, params: Optional[Code2WavParams]) -> None:
        check_voice(params, self.speakers)

    def on_load(self, active: int) -> None:
        self.active = active

    def first_frames(self, params: Code2WavParams) -> int:
        """Mel frames of a new request's first chunk: its own `initial_codec_chunk_frames`, else the
        stage's first chunk sized by the load (`dynamic_first_chunk`) or as configured."""
        if self.chunk_frames is None:
            return 0
        if params.initial_codec_chunk_frames is not None:
            return params.initial_codec_chunk_frames * self.repeats
        if not self.dynamic_first_chunk:
            return self.first_chunk_frames
        first, chunk = self.first_chunk_frames // self.repeats, self.chunk_frames // self.repeats
        return first_chunk_for_load(self.active, first, chunk) * self.repeats

    def new_state(self, params: Code2WavParams) -> Code2WavState:
        if params.voice is None:
            params = replace(params, voice=self.default_voice)
        return Code2WavState(params, self.mel_dim, self.first_frames(params), self.device)

    def batch_key(self, state: Code2WavState) -> tuple:
        return state.params.ode_key()

    def take(self, state: Code2WavState, piece: Any) -> bool:
        if not isinstance(piece, CodecInput):
            codes = piece.tolist() if isinstance(piece, torch.Tensor) else piece
            piece = CodecInput([int(c) for c in codes], True)
        bad = [c for c in piece.codes if not 0 <= c <= self.max_code]
        if bad:
            raise ValueError(f"codec ids must be in [0, {self.max_code}], got {bad[:5]}")
        state.codes.extend(piece.codes)
        return piece.finished

    def ready(self, state: Code2WavState, input_done: bool) -> Optional[tuple[int, int, int, int]]:
        """(s, e, window start, window end) in mel frames of the request's next chunk, or None."""
        total, s = len(state.codes) * self.repeats, state.done
        if s >= total:
            return None
        if self.chunk_frames is None:           # whole mode: one window once everything is there
            return (0, total, 0, total) if input_done else None
        e = s + (state.first_frames if s == 0 else self.chunk_frames)
        if e + self.future > total and not input_done:
            return None
        e = min(e, total)
        return s, e, max(0, (s - self.past) // self.block * self.block), min(total, e + self.future)

    def sample_rate(self, state: Code2WavState) -> int:
        return SAMPLE_RATE

    def prompt(self, state: Code2WavState) -> tuple[Optional[str], list[int]]:
        return None, state.codes

    def stats(self) -> dict[str, float]:
        return dict(self._totals)

    def decode(self, states: list[Code2WavState], chunks: list[tuple[int, int, int, int]]) -> list[np.ndarray]:
        """One ODE batch over the chunks' windows, then BigVGAN; each chunk's samples, in order."""
        return self.collect(self.launch(states, chunks), wait=True)

    @torch.no_grad()
    def launch(self, states: list[Code2WavState], chunks: list[tuple[int, int, int, int]]) -> "_Pending":
        """Queues `decode`'s device work (the ODE, BigVGAN, the samples' copy to pinned host memory)
        without waiting for it; `collect` returns the audio. The states move on in `collect`."""
        timer = DeviceTimer(self.device)
        windows = self._decode_mel(states, chunks)
        timer.mark()
        pending = self._vocode(states, chunks, windows)
        timer.mark()
        pending.timer = timer
        self._totals["dit_batches_total"] += 1
        self._totals["dit_rows_total"] += len(states)
        return pending

    def collect(self, pending: "_Pending", wait: bool) -> Optional[list[np.ndarray]]:
        """The audio of a launched batch (and its states moved past its chunks); None while the device
        still works on it and `wait` is false."""
        if not wait and not pending.timer.done():
            return None
        dit, vocoder = pending.timer.seconds()
        self._totals["dit_seconds_total"] += dit
        self._totals["vocoder_seconds_total"] += vocoder
        for state, mel, lookahead in pending.moves:
            state.mel, state.lookahead = mel, lookahead
        return [wav.numpy() for wav in pending.audio]

    # ---- DiT: codes -> mel ------------------------------------------------------------------------
    @torch.no_grad()
    def _decode_mel(self, states: list[Code2WavState], chunks: list[tuple[int, int, int, int]]) -> list[torch.Tensor]:
        """Runs the ODE for every request's window in one batch; returns each window's mel [frames, 80]."""
        n = len(states)
        lengths = [we - ws for _, _, ws, we in chunks]
        # A batch replays a graph when its longest window fits a captured one: rows are padded to that
        # window's frames (padded keys are masked, so the frames before them decode as without) and
        # the batch to a captured size with empty rows (every key masked but their own).
        frames = max(lengths)
        captured = [f for f in self.graph_frames if f >= frames]
        graphed = bool(captured)
        frames = captured[0] if graphed else frames
        size = next(b for b in self.batch_sizes if b >= n) if graphed else n
        self._totals["dit_graphed_batches_total"] += graphed
        self._totals["dit_frames_total"] += size * frames
        self._totals["dit_padding_frames_total"] += size * frames - sum(lengths)
        noise = torch.zeros(size, frames, self.mel_dim)
        codes = torch.zeros(size, frames // self.repeats + 1, dtype=torch.long)
        for i, (state, (_, _, ws, we)) in enumerate(zip(states, chunks)):
            noise[i, : we - ws] = state.draw_noise(we)[ws:]
            window_codes = state.codes[ws // self.repeats: math.ceil(we / self.repeats)]
            codes[i, : len(window_codes)] = torch.tensor(window_codes, dtype=torch.long)
        voices = [s.params.voice for s in states] + [states[0].params.voice] * (size - n)
        if self.device.type == "cuda":          # no wait for the device: copies from pinned memory
            noise, codes = noise.pin_memory(), codes.pin_memory()
        mel = self.ode.run(noise, codes, voices, lengths + [0] * (size - n), states[0].params.ode_key(), graphed)
        return [mel[i, :length] for i, length in enumerate(lengths)]   # views of a graph's buffer: read now

    def _steady_windows(self, most: int = 4) -> set[int]:
        """Window lengths (mel frames) that chunks other than a request's last have: the first
        chunk's (each size the load may choose), and the `most` - 1 commonest of the next 63 after
        the configured first chunk (one when chunks are whole DiT blocks)."""
        counts: dict[int, int] = {}
        s = 0
        for _ in range(64):
            e = s + (self.first_chunk_frames if s == 0 else self.chunk_frames)
            length = e + self.future - max(0, (s - self.past) // self.block * self.block)
            counts[length] = counts.get(length, 0) + 1
            s = e
        firsts = {self.first_chunk_frames + self.future}
        if self.dynamic_first_chunk:
            first, chunk = self.first_chunk_frames // self.repeats, self.chunk_frames // self.repeats
            firsts |= {first_chunk_for_load(4 ** k + 1, first, chunk) * self.repeats + self.future for k in range(8)}
        common = sorted((n for n in counts if n not in firsts), key=lambda n: -counts[n])
        return {*firsts, *common[: most - 1]}

    # ---- BigVGAN: mel -> audio --------------------------------------------------------------------
    def _vocode(self, states: list[Code2WavState], chunks: list[tuple[int, int, int, int]],
                windows: list[torch.Tensor]) -> "_Pending":
        """Each chunk's kept mel, and BigVGAN over [s, e) with context, queued; the samples of [s, e)
        only, copied to (pinned) host memory as the device gets there."""
        moves, jobs = [], []
        for i, (state, (s, e, ws, _), mel) in enumerate(zip(states, chunks, windows)):
            kept = torch.cat([state.mel[:s], mel[s - ws: e - ws]])
            lookahead = mel[e - ws:].clone()
            moves.append((state, kept, lookahead))
            left = max(0, s - self.voc_ctx)
            context = torch.cat([kept[left:e], lookahead[: self.voc_ctx]])
            jobs.append((i, context, s - left, e - s))
        by_length: dict[int, list] = {}
        for job in jobs:
            by_length.setdefault(job[1].shape[0], []).append(job)
        audio: list[Optional[torch.Tensor]] = [None] * len(jobs)
        pinned = self.device.type == "cuda"
        for group in by_length.values():
            wavs = self.vocode(torch.stack([j[1] for j in group]).transpose(1, 2)).reshape(len(group), -1)
            for (i, _, offset, count), wav in zip(group, wavs):
                out = torch.empty(count * self.hop, dtype=torch.float32, pin_memory=pinned)
                audio[i] = out.copy_(wav[offset * self.hop: (offset + count) * self.hop], non_blocking=pinned)
        return _Pending(moves, audio)

    def _vocoder_lengths(self, chunks: int = 8) -> set[int]:
        """Mel frames of the vocoder inputs of a request's first `chunks` chunks and its steady ones
        (context before s, [s, e), the look-ahead), for each first-chunk size the stage may pick."""
        first, chunk = self.first_chunk_frames // self.repeats, self.chunk_frames // self.repeats
        firsts = {self.first_chunk_frames}
        if self.dynamic_first_chunk:
            firsts |= {first_chunk_for_load(4 ** k + 1, first, chunk) * self.repeats for k in range(8)}
        lengths = set()
        for size in firsts:
            s = 0
            for _ in range(chunks):
                e = s + (size if s == 0 else self.chunk_frames)
                lengths.add(e - max(0, s - self.voc_ctx) + min(self.future, self.voc_ctx))
                s = e
        return lengths


@dataclass
class _Pending:
    """A launched decode batch (`Code2Wav.launch`), waiting for the device."""

    moves: list                                 # per chunk: (state, its mel [0, e), its look-ahead) to keep
    audio: list                                 # per chunk: its samples in host memory once the device is done
    timer: Optional["DeviceTimer"] = None            # ODE and BigVGAN device time
