"""`Code2WavODE`: the DiT half of Qwen2.5-Omni's token2wav -- codes, a voice and initial noise ->
mel frames -- as one batched flow ODE, replayed from CUDA graphs where the shapes repeat (the
code2wav stage's engine, in whatever process runs it; `code2wav.py` drives it).

In: `run(noise, codes, voices, lengths, settings, graphed)`: per row, the initial mel noise of a
window [n, frames, mel], its codes [n, frames / repeats + 1] (right-padded with 0), its voice (a key
of spk_dict.pt) and its true length in frames; `settings` the ODE settings all rows share
(`Code2WavParams.ode_key()`: time points, guidance scale, sway coefficient).
Out: the mel the ODE ends at, [n, frames, mel] float32 on the stage's device (a graphed run returns
a view of the graph's output buffer: read it before the next run).

The modules are transformers' own (`Qwen2_5OmniToken2WavDiTModel`'s embeddings, attention, MLPs,
norms and output head); the ODE loop (`ode`) is its `RungeKutta4ODESolver`'s arithmetic without host
syncs, so that a chunk's 36 DiT evaluations can replay as one graph (`layers/graph_cache.py`). Rows
are right-padded to the longest window and padded keys are masked out of the DiT's block mask
(`block_diff`), so a batched row decodes as if alone. Work that transformers repeats in every DiT
evaluation but that does not depend on the ODE state is done once:
  * per voice: the speaker encoder (`voice`; code2wav encodes every voice at start-up on a GPU);
  * per ODE settings (`_time_tables`): the time embedding and every layer's AdaLN modulation (shift,
    scale, gate: a [6 x hidden] linear of the time embedding per layer, ~40% of the DiT's weights)
    at each of the ODE's time points -- they depend on t alone;
  * per batch (`run`): the codes' embedding, the rotary table and each layer's attention mask.
`dit_dtype` bfloat16 runs the attention and MLP linears in bf16 (the residual stream, norms, the
modulation, the input / output projections and the ODE state stay float32); float32 (the default)
follows transformers. `tf32` (CUDA) lets float32 matmuls use TF32 tensor cores during this engine's
runs and captures only (`tf32_matmuls`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Optional, Sequence

import torch

from omnistage.models.qwen2_5_omni.dit_fused import FusedDiT

logger = logging.getLogger(__name__)

DIT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@contextlib.contextmanager
def tf32_matmuls(on: Optional[bool]):
    """Sets `torch.backends.cuda.matmul.allow_tf32` to `on` for the block and restores it after (None:
    leaves it). The flag is process-wide, not per thread: safe because every engine of a process is
    stepped from one thread, one after another (the orchestrator's step loop, `pipeline/shared.py`),
    so no other stage's float32 matmul is issued while the block runs. A CUDA graph keeps the
    setting it was captured with; eager runs read the flag when each matmul is launched. (The chat
    renderer's media encoders run in worker threads, in the thinker's dtype: bf16 on a GPU, which
    the flag does not concern; a float32 thinker on a GPU would see TF32 in its encoders while a
    code2wav batch is being launched.)"""
    if on is None:
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def valid_frames(lengths: Sequence[int], frames: int, device=None) -> torch.Tensor:
    """[rows, frames] bool on `device`: True for each row's first `lengths[row]` frames."""
    sizes = torch.tensor(lengths)
    if torch.device(device or "cpu").type == "cuda":   # from pinned memory: no wait for the device's queued work
        sizes = sizes.pin_memory().to(device, non_blocking=True)
    return torch.arange(frames, device=device)[None, :] < sizes[:, None]


def block_diff(lengths: Sequence[int], frames: int, block: int, device=None) -> torch.Tensor:
    """Per-row DiT block offsets [rows, 1, frames, frames] on `device`; padded keys get a huge offset
    (masked). Every DiT layer keeps keys whose block offset lies in [-look_back, look_ahead]. A padded
    query row keeps only itself, so no row is fully masked (that would give NaN values).
    """
    blocks = torch.arange(frames, device=device) // block
    diff = (blocks[None, :] - blocks[:, None]).expand(len(lengths), frames, frames).clone()
    valid = valid_frames(lengths, frames, device)
    diff.masked_fill_(~valid[:, None, :], 10**6)
    eye = torch.eye(frames, dtype=torch.bool, device=device)[None] & ~valid[:, :, None]
    diff.masked_fill_(eye, 0)
    return diff[:, None]


def ode_times(num_steps: int, sway_coefficient: Optional[float], device=None) -> torch.Tensor:
    """The ODE's time points, as transformers' `sample` makes them (sway sampling when given)."""
    t = torch.linspace(0, 1, num_steps, device=device, dtype=torch.float32)
    if sway_coefficient is not None:
        t = t + sway_coefficient * (torch.cos(torch.pi / 2 * t) - 1 + t)
    return t


def eval_times(t: torch.Tensor) -> list[torch.Tensor]:
    """The time of each DiT evaluation of the 3/8-rule RK4 over time points `t`, in order (4 per
    step), computed with the same operations as `Code2WavODE.ode`, so the same values."""
    out = []
    for i in range(t.shape[0] - 1):
        t0, t1 = t[i], t[i + 1]
        dt = t1 - t0
        out += [t0, t0 + dt * (1 / 3), t0 + dt * (2 / 3), t1]
    return out


class Code2WavODE:
    def __init__(self, dit, speakers: dict, device: torch.device, max_graphs: int = 0,
                 dit_dtype: str = "float32", tf32: Optional[bool] = None, fused: Optional[bool] = None):
        if dit_dtype not in DIT_DTYPES:
            raise ValueError(f"dit_dtype must be one of {sorted(DIT_DTYPES)}, got {dit_dtype!r}")
        self.dit = dit                          # Qwen2_5OmniToken2WavDiTModel (float32, eval)
        self.speakers = speakers                # spk_dict.pt: voice -> {"cond", "ref_mel", ...}
        self.device = device
        self.dtype = DIT_DTYPES[dit_dtype]      # the attention / MLP linears' dtype
        self.tf32 = tf32 if device.type == "cuda" else None   # float32 matmuls on TF32 cores (None: as the process)
        self.mel_dim, self.block = dit.config.mel_dim, dit.config.block_size
        if self.dtype != torch.float32:
            for block in dit.transformer_blocks:
                block.attn.to(self.dtype)
                block.ff.to(self.dtype)
        # the fused evaluation (`dit_fused.py`): on CUDA unless `fused` says otherwise
        self.fused = FusedDiT(dit, self.dtype) if (device.type == "cuda" if fused is None else fused) else None
        # each layer's (look-back, look-ahead) in blocks: at most a few distinct masks per batch
        self.windows = [(float(b.look_backward_block), float(b.look_ahead_block)) for b in dit.transformer_blocks]
        self._voice_cache: dict[str, tuple[torch.Tensor, ...]] = {}
        self._tables: dict[tuple, tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]] = {}
        self.graphs = None                      # GraphCache when `max_graphs` (CUDA only)
        if max_graphs and device.type == "cuda":
            from omnistage.layers.graph_cache import GraphCache

            self.graphs = GraphCache(max_graphs=max_graphs)

    def voice(self, voice: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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

    @torch.no_grad()
    def _time_tables(self, num_steps: int, sway_coefficient: Optional[float]):
        """(time points [num_steps], per layer its AdaLN modulation at every evaluation [evals, 6 x
        hidden], the output norm's [evals, 2 x hidden]) for these settings; kept (a graph reads them)
        for the first 8 settings seen, made anew for others."""
        key = (num_steps, sway_coefficient)
        if key in self._tables:
            return self._tables[key]
        t = ode_times(num_steps, sway_coefficient, self.device)
        t_emb = self.dit.time_embed(torch.stack(eval_times(t)))          # [evals, hidden]
        layers = [b.attn_norm.linear(b.attn_norm.silu(t_emb)) for b in self.dit.transformer_blocks]
        final = self.dit.norm_out.linear(self.dit.norm_out.silu(t_emb))
        tables = (t, layers, final)
        if len(self._tables) < 8:
            self._tables[key] = tables
        return tables

    @torch.no_grad()
    def run(self, noise: torch.Tensor, codes: torch.Tensor, voice_names: list[str], lengths: list[int],
            settings: tuple, graphed: bool) -> torch.Tensor:
        """The DiT's conditioning for a batch, then its ODE (from a CUDA graph when `graphed`)."""
        with tf32_matmuls(self.tf32):
            return self._run(noise, codes, voice_names, lengths, settings, graphed)

    def _run(self, noise, codes, voice_names, lengths, settings, graphed) -> torch.Tensor:
        num_steps, guidance_scale, sway_coefficient = settings
        dev, frames = self.device, noise.shape[1]
        voices = [self.voice(v) for v in voice_names]
        cond = torch.stack([v[0] for v in voices])
        spk = torch.stack([v[1] for v in voices])
        spk_null = torch.stack([v[2] for v in voices])
        cfg = guidance_scale >= 1e-5            # as transformers: below that, a plain conditional forward
        codes = codes.to(dev, non_blocking=True)   # pinned by the caller on a GPU: no wait for the device
        code_emb = self.dit.text_embed(codes)[:, :frames]
        if cfg:
            code_emb = torch.cat([code_emb, self.dit.text_embed(torch.zeros_like(codes))[:, :frames]])
            cond, spk = torch.cat([cond, torch.zeros_like(cond)]), torch.cat([spk, spk_null])
        static = torch.cat([spk[:, None].expand(-1, frames, -1), code_emb, cond[:, None].expand(-1, frames, -1)], -1)
        rows = lengths * (2 if cfg else 1)
        # the key masks' source: each row's valid frames (fused) or the block offsets (reference)
        diff = valid_frames(rows, frames, dev) if self.fused is not None else block_diff(rows, frames, self.block, dev)
        t, layer_mods, final_mod = self._time_tables(num_steps, sway_coefficient)
        # a graph reads the tables it was captured with: only kept ones (`_time_tables`)
        graphed = graphed and self.graphs is not None and (num_steps, sway_coefficient) in self._tables
        inputs = (noise.to(dev, non_blocking=True), static, diff)
        guidance = guidance_scale if cfg else None

        def fn(x, st, bd):
            return self.ode(x, st, bd, t, layer_mods, final_mod, guidance)

        if not graphed:
            return fn(*inputs)
        return self.graphs.run((noise.shape[0], frames, guidance, num_steps, sway_coefficient), inputs, fn)

    @torch.no_grad()
    def capture(self, batch_sizes: Sequence[int], windows: Sequence[int], settings: tuple, voice: str) -> None:
        """Captures the ODE for every batch size and window length (mel frames) under `settings`, at
        start-up, so that no request waits for a capture."""
        repeats = self.dit.config.repeats
        start = time.perf_counter()
        for size in batch_sizes:
            for frames in sorted(windows):
                noise = torch.zeros(size, frames, self.mel_dim)
                codes = torch.zeros(size, frames // repeats + 1, dtype=torch.long)
                self.run(noise, codes, [voice] * size, [frames] * size, settings, True)
            torch.cuda.synchronize(self.device)
            # a line per size: in a stage process it is also the start-up step its client reports on a timeout
            logger.info("code2wav: ODE graphs for %d rows captured (%d graphs, %.1f s so far)", size,
                        self.graphs.captures, time.perf_counter() - start)

    def _layer(self, block, h: torch.Tensor, mod: torch.Tensor, rope, mask: torch.Tensor) -> torch.Tensor:
        """`DiTDecoderLayer.forward` with its AdaLN modulation given (`mod`: [6 x hidden], from the
        time table) and its attention mask made once per batch: the same operations, in order."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mod.chunk(6)
        norm = block.attn_norm.norm(h) * (1 + scale_msa) + shift_msa
        attn = block.attn(hidden_states=norm.to(self.dtype), position_embeddings=rope, attention_mask=mask)
        h = h + gate_msa * attn
        norm = block.ff_norm(h) * (1 + scale_mlp) + shift_mlp
        return h + gate_mlp * block.ff(norm.to(self.dtype))

    def ode(self, x: torch.Tensor, static: torch.Tensor, block_diff: torch.Tensor, t: torch.Tensor,
            layer_mods: list[torch.Tensor], final_mod: torch.Tensor, guidance: Optional[float]) -> torch.Tensor:
        """The DiT's flow ODE from noise `x` [n, frames, mel] over time points `t`: transformers'
        `RungeKutta4ODESolver` (3/8-rule RK4) written without host syncs, so that it can be captured
        in a CUDA graph; the same tensor operations in the same order, so the same numbers."""
        rows, frames = static.shape[:2]
        positions = torch.arange(frames, device=x.device)[None].expand(rows, -1)
        cos, sin = self.dit.rotary_embed(static, positions)
        if self.fused is not None:              # `block_diff` holds each row's valid frames here
            rope = self.fused.rope_table(cos, sin)
            masks = self.fused.masks(block_diff)
            static = self.fused.static_input(static)
        else:
            rope = (cos.to(self.dtype), sin.to(self.dtype)) if self.dtype != torch.float32 else (cos, sin)
            masks = {w: (block_diff >= -w[0]) & (block_diff <= w[1]) for w in set(self.windows)}
        step = iter(range(len(final_mod)))

        def velocity(x: torch.Tensor) -> torch.Tensor:
            e = next(step)                      # this evaluation's row of the time tables
            if self.fused is not None:
                h = self.fused.input(x, static, guidance is not None)
                v = self.fused.velocity(h, e, layer_mods, final_mod, rope, masks)
            else:
                x_rows = torch.cat([x, x]) if guidance is not None else x
                h = self.dit.input_embed.proj(torch.cat([x_rows, static], -1))
                v = self._reference(h, e, layer_mods, final_mod, rope, masks)
            if guidance is None:
                return v
            v_cond, v_null = v.chunk(2)
            return v_cond + (v_cond - v_null) * guidance

        third, two_thirds = 1 / 3, 2 / 3
        for i in range(t.shape[0] - 1):
            dt = t[i + 1] - t[i]
            k1 = velocity(x)
            k2 = velocity(x + dt * k1 * third)
            k3 = velocity(x + dt * (k2 - k1 * third))
            k4 = velocity(x + dt * (k1 - k2 + k3))
            x = x + (k1 + 3 * (k2 + k3) + k4) * dt / 8
        return x

    def _reference(self, h, e, layer_mods, final_mod, rope, masks) -> torch.Tensor:
        """The DiT after its input projection, transformers' layers op by op (the reference path)."""
        for block, mods, w in zip(self.dit.transformer_blocks, layer_mods, self.windows):
            h = self._layer(block, h, mods[e], rope, masks[w])
        scale, shift = final_mod[e].chunk(2)
        return self.dit.proj_out(self.dit.norm_out.norm(h) * (1 + scale) + shift)
