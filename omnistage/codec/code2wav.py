"""`Code2WavEngine`: Qwen2.5-Omni's token2wav (DiT + BigVGAN) as a batched, streaming codec stage
(a `StageEngine`; runs in the code2wav stage's process).

In: `add_request(request_id, inputs, params)` where inputs is a `CodecInput` (talker codec ids,
`finished=False` while the talker streams more through `add_input`) or a plain list of ids, and
params a `Code2WavParams` (voice from the checkpoint's `spk_dict.pt`, noise seed, ODE settings).
Out: each `step()` returns one `StageOutput` per request that changed: `output.audio` is the
cumulative `AudioOutput` (float32 mono in [-1, 1] at 24000 Hz), `audio_chunk` the samples
added this step; the last one has `finished=True`.

How a request is decoded (the modules are transformers' own: `Qwen2_5OmniToken2WavDiTModel`'s
embeddings, blocks and output head, `Qwen2_5OmniToken2WavBigVGANModel`; the ODE loop is its
`RungeKutta4ODESolver`'s arithmetic without host syncs, `_ode`):
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
  * Batching: one step runs the ODE for the ready chunks of up to `max_batch_requests` requests
    (same ODE settings) in one forward per evaluation: windows are right-padded to the longest
    and padded keys are masked out of the DiT's block mask, so a batched request decodes as if
    alone. BigVGAN runs once per group of equal-length inputs (padding would change a
    convolution's tail).
  * CUDA graphs (on a GPU, chunked mode, `cuda_graphs`): the ODE of a chunk (36 DiT evaluations,
    launch-bound) replays as one graph when the window has a steady length (`_steady_windows`);
    the batch is padded to a captured size (1, 2, 4, 8, ... up to `max_batch_requests`) with
    empty rows. Graphs are captured at start-up for the default ODE settings (`layers/graph_cache.py`).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

import numpy as np
import torch

from omnistage.codec.speech import check_voice
from omnistage.outputs import AudioOutput, RequestMetrics, RequestOutput
from omnistage.stage import StageOutput

SAMPLE_RATE = 24000


@dataclass
class Code2WavParams:
    voice: Optional[str] = None                 # a key of spk_dict.pt; None = the stage's default voice
    seed: Optional[int] = None                  # initial-noise seed; None = a fresh random seed
    num_steps: int = 10                         # ODE time points (transformers' default: 10 -> 9 RK4 steps)
    guidance_scale: float = 0.5                 # classifier-free guidance weight; < 1e-5 turns CFG off
    sway_coefficient: Optional[float] = -1.0    # sway sampling of the time points; None = uniform

    def __post_init__(self) -> None:
        if not isinstance(self.num_steps, int) or not 2 <= self.num_steps <= 100:
            raise ValueError(f"num_steps must be an integer in [2, 100], got {self.num_steps!r}")
        if not isinstance(self.guidance_scale, (int, float)) or self.guidance_scale < 0:
            raise ValueError(f"guidance_scale must be a number >= 0, got {self.guidance_scale!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer or None, got {self.seed!r}")

    def ode_key(self) -> tuple:
        """Requests with the same key can share one ODE forward."""
        return (self.num_steps, float(self.guidance_scale), self.sway_coefficient)


@dataclass
class CodecInput:
    codes: list[int] = field(default_factory=list)  # talker codec ids (no bos/eos), in order
    finished: bool = True                       # no codes follow the last one given so far

    def __len__(self) -> int:
        return len(self.codes)

    def slice(self, start: int, end: int, finished: bool) -> "CodecInput":
        return CodecInput(list(self.codes[start:end]), finished)


def load_token2wav(model_dir: str, device: str = "cpu"):
    """(token2wav module in float32 eval mode, speakers dict) from a Qwen2.5-Omni folder.

    Reads only the `token2wav.*` tensors of the (single or sharded) safetensors checkpoint.
    """
    from safetensors import safe_open
    from transformers import AutoConfig
    from transformers.initialization import no_init_weights
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel

    config = AutoConfig.from_pretrained(model_dir)
    with no_init_weights():                     # every parameter is loaded below; buffers are built in __init__
        model = Qwen2_5OmniToken2WavModel._from_config(config.token2wav_config, attn_implementation="sdpa")
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = sorted({v for k, v in json.load(f)["weight_map"].items() if k.startswith("token2wav.")})
    else:
        files = ["model.safetensors"]
    state = {}
    for name in files:
        with safe_open(os.path.join(model_dir, name), "pt") as f:
            for key in f.keys():
                if key.startswith("token2wav."):
                    state[key[len("token2wav."):]] = f.get_tensor(key)
    missing, _ = model.load_state_dict(state, strict=False)  # unexpected: filter buffers some exports save
    if missing:
        raise ValueError(f"{model_dir}: token2wav weights missing from the checkpoint: {missing[:5]}")
    speakers = torch.load(os.path.join(model_dir, "spk_dict.pt"), weights_only=True)
    return model.float().eval().to(device), speakers


def vocoder_context(bigvgan_config) -> int:
    """Mel frames each side of a frame that can change its BigVGAN samples (rounded up, +1 margin).

    Sums, stage by stage, the radius of the transposed conv, the widest AMP residual block (its
    dilated and plain convs plus two anti-aliased activations per pair, ~6 samples each) divided
    by the samples per frame at that stage. Real Qwen2.5-Omni: 40 frames; tests check the bound.
    """
    frames, rate = 3.0, 1                       # conv_pre: kernel 7
    for stride, kernel in zip(bigvgan_config.upsample_rates, bigvgan_config.upsample_kernel_sizes):
        frames += math.ceil(kernel / stride) / rate
        rate *= stride
        amp = max(sum((k - 1) / 2 * d + (k - 1) / 2 + 12 for d in dil)
                  for k, dil in zip(bigvgan_config.resblock_kernel_sizes, bigvgan_config.resblock_dilation_sizes))
        frames += amp / rate
    frames += (6 + 3) / rate                    # activation_post + conv_post (kernel 7)
    return math.ceil(frames) + 1


class _Request:
    def __init__(self, request_id: str, params: Code2WavParams, mel_dim: int, arrival: float):
        self.request_id = request_id
        self.params = params
        self.codes: list[int] = []
        self.input_done = False
        seed = params.seed if params.seed is not None else secrets.randbits(62)
        self.generator = torch.Generator().manual_seed(seed)
        self.noise = torch.zeros(0, mel_dim)    # initial ODE state per mel frame, drawn as needed
        self.mel = torch.zeros(0, mel_dim)      # final mel frames [0, done)
        self.lookahead = torch.zeros(0, mel_dim)  # provisional mel after `done` from the last window
        self.chunks: list[np.ndarray] = []      # audio per decoded chunk
        self.metrics = RequestMetrics(arrival_time=arrival)

    @property
    def done(self) -> int:
        return self.mel.shape[0]

    def draw_noise(self, frames: int) -> torch.Tensor:
        missing = frames - self.noise.shape[0]
        if missing > 0:
            extra = torch.randn(1, missing, self.noise.shape[1], generator=self.generator)[0]
            self.noise = torch.cat([self.noise, extra])
        return self.noise[:frames]


class Code2WavEngine:
    params_type = Code2WavParams

    def __init__(self, model_dir: str, device: str = "cpu", default_voice: Optional[str] = None,
                 chunk_codes: Optional[int] = None, first_chunk_codes: Optional[int] = None,
                 past_blocks: int = 2, future_blocks: int = 1, vocoder_context_frames: Optional[int] = None,
                 max_batch_requests: int = 8, cuda_graphs: bool = True, tf32: bool = True):
        for name, value in (("chunk_codes", chunk_codes), ("first_chunk_codes", first_chunk_codes)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if first_chunk_codes is not None and chunk_codes is None:
            raise ValueError("first_chunk_codes needs chunk_codes (chunked mode)")
        for name, value in (("past_blocks", past_blocks), ("future_blocks", future_blocks)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if max_batch_requests < 1:
            raise ValueError(f"max_batch_requests must be >= 1, got {max_batch_requests}")
        self.device = torch.device(device)
        self.model, self.speakers = load_token2wav(model_dir, device)
        self.dit = self.model.code2wav_dit_model
        self.vocoder = self.model.code2wav_bigvgan_model
        self.default_voice = default_voice or next(iter(self.speakers))
        if self.default_voice not in self.speakers:
            raise ValueError(f"default_voice must be one of {sorted(self.speakers)}, got {default_voice!r}")
        cfg = self.dit.config
        self.repeats, self.block, self.mel_dim = cfg.repeats, cfg.block_size, cfg.mel_dim
        self.max_code = cfg.num_embeds          # the codec table has num_embeds + 1 rows
        self.hop = math.prod(self.vocoder.config.upsample_rates)
        self.chunk_frames = None if chunk_codes is None else chunk_codes * self.repeats
        self.first_chunk_frames = (first_chunk_codes or chunk_codes or 0) * self.repeats
        self.past, self.future = past_blocks * self.block, future_blocks * self.block
        self.voc_ctx = vocoder_context_frames if vocoder_context_frames is not None \
            else vocoder_context(self.vocoder.config)
        self.max_batch_requests = max_batch_requests
        # token2wav runs in float32 (as transformers runs it); on a GPU its DiT matmuls may use TF32
        # tensor cores (inputs rounded to 10-bit mantissas): measured on an H200 (7B shape), the CUDA-graph
        # ODE of 8 steady chunks takes 546 ms with TF32 and 1514 ms in plain fp32
        # (benchmarks/profile_talker.py); the waveform moves by 2e-3 of its peak (benchmarks/check_cuda.py).
        # `tf32: false` turns it off.
        self.tf32 = tf32 and self.device.type == "cuda"
        # The ODE of a chunk replays as a CUDA graph when its window has one of the steady sizes (the
        # first chunk's, a later chunk's); other windows (a request's tail, whole mode) run eagerly.
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda" and self.chunk_frames is not None
        self._graph_frames: set[int] = set()
        self._batch_sizes = [b for b in (1, 2, 4, 8, 16, 32) if b < max_batch_requests] + [max_batch_requests]
        if self.cuda_graphs:
            from omnistage.layers.graph_cache import GraphCache

            self._graph_frames = self._steady_windows()
            self._graphs = GraphCache(max_graphs=4 * len(self._batch_sizes) * len(self._graph_frames))
        self._voice_cache: dict[str, tuple[torch.Tensor, ...]] = {}
        self.requests: dict[str, _Request] = {}
        self._totals = {"audio_seconds_total": 0.0, "dit_seconds_total": 0.0, "vocoder_seconds_total": 0.0,
                        "dit_batches_total": 0, "dit_rows_total": 0}
        if self.cuda_graphs:
            self._capture_graphs()

    @classmethod
    def from_stage_spec(cls, spec) -> "Code2WavEngine":
        device = spec.engine.device if spec.engine.device != "auto" else (
            "cuda" if torch.cuda.is_available() else "cpu")
        return cls(spec.model_dir, device=device, **{"cuda_graphs": spec.engine.cuda_graphs, **dict(spec.options)})

    # ---- voices ---------------------------------------------------------------------------------
    def voices(self) -> list[dict[str, Any]]:
        return [{"id": v, "name": v, "sample_rate": SAMPLE_RATE, "backend": "qwen2_5_omni"} for v in self.speakers]

    def _voice(self, voice: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cond [enc_emb_dim], spk-encoder(ref_mel) [enc_dim], spk-encoder(zeros) [enc_dim]) for a voice.

        The DiT's speaker encoder depends only on the voice, so it runs once per voice instead of
        once per ODE evaluation as in transformers (same values).
        """
        if voice not in self._voice_cache:
            spk = self.speakers[voice]
            ref = spk["ref_mel"].to(self.device, torch.float32).reshape(1, -1, self.mel_dim)
            with torch.no_grad():
                enc = self.dit.input_embed.spk_encoder(torch.cat([ref, torch.zeros_like(ref)]))
            cond = spk["cond"].to(self.device, torch.float32).reshape(-1)
            self._voice_cache[voice] = (cond, enc[0], enc[1])
        return self._voice_cache[voice]

    # ---- StageEngine ----------------------------------------------------------------------------
    def check_params(self, params: Optional[Code2WavParams]) -> None:
        check_voice(params, self.speakers)

    def add_request(self, request_id: str, inputs: Any, params: Optional[Code2WavParams] = None,
                    arrival_time: Optional[float] = None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params if params is not None else Code2WavParams()
        self.check_params(params)
        if params.voice is None:
            params = replace(params, voice=self.default_voice)
        req = _Request(request_id, params, self.mel_dim, arrival_time or time.time())
        self._take(req, inputs)
        self.requests[request_id] = req

    def add_input(self, request_id: str, inputs: Any) -> None:
        """More codes for a streamed request (the last piece has `finished=True`)."""
        req = self.requests.get(request_id)
        if req is not None:                     # an aborted request's late input is dropped
            self._take(req, inputs)

    def _take(self, req: _Request, inputs: Any) -> None:
        if not isinstance(inputs, CodecInput):
            codes = inputs.tolist() if isinstance(inputs, torch.Tensor) else inputs
            inputs = CodecInput([int(c) for c in codes], True)
        if req.input_done:
            raise ValueError(f"request {req.request_id!r} already received its last codes")
        bad = [c for c in inputs.codes if not 0 <= c <= self.max_code]
        if bad:
            raise ValueError(f"codec ids must be in [0, {self.max_code}], got {bad[:5]}")
        req.codes.extend(inputs.codes)
        req.input_done = inputs.finished

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> dict[str, float]:
        ready = sum(1 for r in self.requests.values() if self._next_chunk(r) is not None)
        return {"num_running": ready, "num_waiting": len(self.requests) - ready, **self._totals}

    def step(self) -> list[StageOutput]:
        ready = [(r, w) for r in self.requests.values() if (w := self._next_chunk(r)) is not None]
        if ready:                               # one ODE batch: the oldest ready request's settings
            key = ready[0][0].params.ode_key()
            ready = [(r, w) for r, w in ready if r.params.ode_key() == key][: self.max_batch_requests]
            start = time.perf_counter()
            windows = self._decode_mel([r for r, _ in ready], [w for _, w in ready])
            self._totals["dit_seconds_total"] += time.perf_counter() - start
            self._totals["dit_batches_total"] += 1
            self._totals["dit_rows_total"] += len(ready)
            start = time.perf_counter()
            self._vocode(ready, windows)
            self._totals["vocoder_seconds_total"] += time.perf_counter() - start
            for r, _ in ready:                  # round-robin: served requests go to the back
                r.metrics.first_scheduled_time = r.metrics.first_scheduled_time or time.time()
                self.requests[r.request_id] = self.requests.pop(r.request_id)
        served = {r.request_id for r, _ in ready}
        outputs = []
        for req in list(self.requests.values()):
            finished = req.input_done and req.done == len(req.codes) * self.repeats
            if not finished and req.request_id not in served:
                continue
            if finished:
                req.metrics.finished_time = time.time()
                del self.requests[req.request_id]
            chunk = req.chunks[-1] if req.request_id in served else np.zeros(0, np.float32)
            samples = np.concatenate(req.chunks) if req.chunks else np.zeros(0, np.float32)
            out = RequestOutput(request_id=req.request_id, prompt_token_ids=list(req.codes), finished=finished,
                                audio=AudioOutput(samples=samples, sample_rate=SAMPLE_RATE), metrics=req.metrics)
            outputs.append(StageOutput(req.request_id, out, finished, audio_chunk=chunk))
        return outputs

    # ---- scheduling ------------------------------------------------------------------------------
    def _next_chunk(self, req: _Request) -> Optional[tuple[int, int, int, int]]:
        """(s, e, window start, window end) in mel frames of the request's next chunk, or None."""
        total, s = len(req.codes) * self.repeats, req.done
        if s >= total:
            return None
        if self.chunk_frames is None:           # whole mode: one window once everything is there
            return (0, total, 0, total) if req.input_done else None
        e = s + (self.first_chunk_frames if s == 0 else self.chunk_frames)
        if e + self.future > total and not req.input_done:
            return None
        e = min(e, total)
        return s, e, max(0, (s - self.past) // self.block * self.block), min(total, e + self.future)

    # ---- DiT: codes -> mel ------------------------------------------------------------------------
    @torch.no_grad()
    def _decode_mel(self, reqs: list[_Request], windows: list[tuple[int, int, int, int]]) -> list[torch.Tensor]:
        """Runs the ODE for every request's window in one batch; returns each window's mel [frames, 80]."""
        n = len(reqs)
        lengths = [we - ws for _, _, ws, we in windows]
        frames = max(lengths)
        graphed = self.cuda_graphs and frames in self._graph_frames
        # a graphed batch is padded to a captured size with empty rows (every key masked but their own)
        size = next(b for b in self._batch_sizes if b >= n) if graphed else n
        noise = torch.zeros(size, frames, self.mel_dim)
        codes = torch.zeros(size, frames // self.repeats + 1, dtype=torch.long)
        for i, (req, (_, _, ws, we)) in enumerate(zip(reqs, windows)):
            noise[i, : we - ws] = req.draw_noise(we)[ws:]
            window_codes = req.codes[ws // self.repeats: math.ceil(we / self.repeats)]
            codes[i, : len(window_codes)] = torch.tensor(window_codes, dtype=torch.long)
        voices = [r.params.voice for r in reqs] + [reqs[0].params.voice] * (size - n)
        mel = self._run_ode(noise, codes, voices, lengths + [0] * (size - n), reqs[0].params, graphed)
        return [mel[i, :length].float().cpu() for i, length in enumerate(lengths)]

    def _run_ode(self, noise: torch.Tensor, codes: torch.Tensor, voice_names: list[str], lengths: list[int],
                 params: Code2WavParams, graphed: bool) -> torch.Tensor:
        """The DiT's conditioning for a batch, then its ODE (from a CUDA graph when `graphed`)."""
        dev, frames = self.device, noise.shape[1]
        voices = [self._voice(v) for v in voice_names]
        cond = torch.stack([v[0] for v in voices])
        spk = torch.stack([v[1] for v in voices])
        spk_null = torch.stack([v[2] for v in voices])
        cfg = params.guidance_scale >= 1e-5     # as transformers: below that, a plain conditional forward
        code_emb = self.dit.text_embed(codes.to(dev))[:, :frames]
        if cfg:
            code_emb = torch.cat([code_emb, self.dit.text_embed(torch.zeros_like(codes).to(dev))[:, :frames]])
            cond, spk = torch.cat([cond, torch.zeros_like(cond)]), torch.cat([spk, spk_null])
        static = torch.cat([spk[:, None].expand(-1, frames, -1), code_emb, cond[:, None].expand(-1, frames, -1)], -1)
        block_diff = self._block_diff(lengths * (2 if cfg else 1), frames).to(dev)
        t = torch.linspace(0, 1, params.num_steps, device=dev, dtype=torch.float32)
        if params.sway_coefficient is not None:
            t = t + params.sway_coefficient * (torch.cos(torch.pi / 2 * t) - 1 + t)
        inputs = (noise.to(dev), static, block_diff, t)
        guidance = params.guidance_scale if cfg else None
        saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = self.tf32   # this stage's setting, captured into its graphs
        try:
            if not graphed:
                return self._ode(*inputs, guidance)
            return self._graphs.run((noise.shape[0], frames, guidance, params.num_steps), inputs,
                                    lambda x, st, bd, tt: self._ode(x, st, bd, tt, guidance))
        finally:
            torch.backends.cuda.matmul.allow_tf32 = saved

    @torch.no_grad()
    def _capture_graphs(self) -> None:
        """Captures the ODE for every padded batch size and steady window at start-up (default ODE
        settings), so that no request waits for a capture."""
        params = Code2WavParams(voice=self.default_voice)
        for size in self._batch_sizes:
            for frames in sorted(self._graph_frames):
                noise = torch.zeros(size, frames, self.mel_dim)
                codes = torch.zeros(size, frames // self.repeats + 1, dtype=torch.long)
                self._run_ode(noise, codes, [self.default_voice] * size, [frames] * size, params, True)
        torch.cuda.synchronize(self.device)

    def _steady_windows(self, most: int = 4) -> set[int]:
        """Window lengths (mel frames) that chunks other than a request's last have: the first
        chunk's, and the `most` - 1 commonest of the next 63 (one when chunks are whole DiT blocks)."""
        counts: dict[int, int] = {}
        s = 0
        for _ in range(64):
            e = s + (self.first_chunk_frames if s == 0 else self.chunk_frames)
            length = e + self.future - max(0, (s - self.past) // self.block * self.block)
            counts[length] = counts.get(length, 0) + 1
            s = e
        first = self.first_chunk_frames + self.future
        common = sorted((n for n in counts if n != first), key=lambda n: -counts[n])
        return {first, *common[: most - 1]}

    def _ode(self, x: torch.Tensor, static: torch.Tensor, block_diff: torch.Tensor, t: torch.Tensor,
             guidance: Optional[float]) -> torch.Tensor:
        """The DiT's flow ODE from noise `x` [n, frames, mel] over time points `t`: transformers'
        `RungeKutta4ODESolver` (3/8-rule RK4) written without host syncs, so that it can be captured
        in a CUDA graph; the same tensor operations in the same order, so the same numbers."""
        rows, frames = static.shape[:2]
        positions = torch.arange(frames, device=x.device)[None].expand(rows, -1)

        def velocity(tv: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            x_rows = torch.cat([x, x]) if guidance is not None else x
            t_emb = self.dit.time_embed(tv.reshape(1).expand(rows))
            h = self.dit.input_embed.proj(torch.cat([x_rows, static], -1))
            rope = self.dit.rotary_embed(h, positions)
            for block in self.dit.transformer_blocks:
                h = block(h, t_emb, position_embeddings=rope, block_diff=block_diff)
            v = self.dit.proj_out(self.dit.norm_out(h, t_emb))
            if guidance is None:
                return v
            v_cond, v_null = v.chunk(2)
            return v_cond + (v_cond - v_null) * guidance

        third, two_thirds = 1 / 3, 2 / 3
        for i in range(t.shape[0] - 1):
            t0, t1 = t[i], t[i + 1]
            dt = t1 - t0
            k1 = velocity(t0, x)
            k2 = velocity(t0 + dt * third, x + dt * k1 * third)
            k3 = velocity(t0 + dt * two_thirds, x + dt * (k2 - k1 * third))
            k4 = velocity(t1, x + dt * (k1 - k2 + k3))
            x = x + (k1 + 3 * (k2 + k3) + k4) * dt / 8
        return x

    def _block_diff(self, lengths: Sequence[int], frames: int) -> torch.Tensor:
        """Per-row DiT block offsets [rows, 1, frames, frames]; padded keys get a huge offset (masked).

        Every DiT layer keeps keys whose block offset lies in [-look_back, look_ahead]. A padded
        query row keeps only itself, so no row is fully masked (that would give NaN values).
        """
        block = torch.arange(frames) // self.block
        diff = (block[None, :] - block[:, None]).expand(len(lengths), frames, frames).clone()
        valid = torch.arange(frames)[None, :] < torch.tensor(lengths)[:, None]
        diff.masked_fill_(~valid[:, None, :], 10**6)
        eye = torch.eye(frames, dtype=torch.bool)[None] & ~valid[:, :, None]
        diff.masked_fill_(eye, 0)
        return diff[:, None]

    # ---- BigVGAN: mel -> audio --------------------------------------------------------------------
    @torch.no_grad()
    def _vocode(self, ready: list[tuple[_Request, tuple]], windows: list[torch.Tensor]) -> None:
        """Keeps each chunk's mel, vocodes [s, e) with context, appends the samples of [s, e) only."""
        jobs = []
        for (req, (s, e, ws, _)), mel in zip(ready, windows):
            req.mel = torch.cat([req.mel[:s], mel[s - ws: e - ws]])
            req.lookahead = mel[e - ws:]
            left = max(0, s - self.voc_ctx)
            context = torch.cat([req.mel[left:e], req.lookahead[: self.voc_ctx]])
            jobs.append((req, context, s - left, e - s))
        by_length: dict[int, list] = {}
        for job in jobs:
            by_length.setdefault(job[1].shape[0], []).append(job)
        for group in by_length.values():
            mel = torch.stack([j[1] for j in group]).transpose(1, 2).to(self.device)
            audio = self.vocoder(mel).reshape(len(group), -1).float().cpu().numpy()
            for (req, _, offset, count), wav in zip(group, audio):
                chunk = np.ascontiguousarray(wav[offset * self.hop: (offset + count) * self.hop], dtype=np.float32)
                req.chunks.append(chunk)
                req.metrics.first_token_time = req.metrics.first_token_time or time.time()
                self._totals["audio_seconds_total"] += len(chunk) / SAMPLE_RATE
