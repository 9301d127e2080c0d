"""`Code2WavODE`: the DiT half of Qwen2.5-Omni's token2wav -- codes, a voice and initial noise ->
mel frames -- as one batched flow ODE, replayed from CUDA graphs where the shapes repeat (the
code2wav stage's process; `code2wav.py` drives it).

In: `run(noise, codes, voices, lengths, settings, graphed)`: per row, the initial mel noise of a
window [n, frames, mel], its codes [n, frames / repeats + 1] (right-padded with 0), its voice (a key
of spk_dict.pt) and its true length in frames; `settings` the ODE settings all rows share
(`Code2WavParams.ode_key()`: time points, guidance scale, sway coefficient).
Out: the mel the ODE ends at, [n, frames, mel] float32 on the stage's device (a graphed run returns
a view of the graph's output buffer: read it before the next run).

The modules are transformers' own (`Qwen2_5OmniToken2WavDiTModel`'s embeddings, blocks and output
head); the ODE loop (`ode`) is its `RungeKutta4ODESolver`'s arithmetic without host syncs, so that
a chunk's 36 DiT evaluations can replay as one graph (`layers/graph_cache.py`). Rows are
right-padded to the longest window and padded keys are masked out of the DiT's block mask
(`block_diff`), so a batched row decodes as if alone. Float32 matmuls follow the process's TF32
setting (see `code2wav.py`), which a graph keeps from its capture.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def block_diff(lengths: Sequence[int], frames: int, block: int) -> torch.Tensor:
    """Per-row DiT block offsets [rows, 1, frames, frames]; padded keys get a huge offset (masked).

    Every DiT layer keeps keys whose block offset lies in [-look_back, look_ahead]. A padded
    query row keeps only itself, so no row is fully masked (that would give NaN values).
    """
    blocks = torch.arange(frames) // block
    diff = (blocks[None, :] - blocks[:, None]).expand(len(lengths), frames, frames).clone()
    valid = torch.arange(frames)[None, :] < torch.tensor(lengths)[:, None]
    diff.masked_fill_(~valid[:, None, :], 10**6)
    eye = torch.eye(frames, dtype=torch.bool)[None] & ~valid[:, :, None]
    diff.masked_fill_(eye, 0)
    return diff[:, None]


class Code2WavODE:
    def __init__(self, dit, speakers: dict, device: torch.device, max_graphs: int = 0):
        self.dit = dit                          # Qwen2_5OmniToken2WavDiTModel (float32, eval)
        self.speakers = speakers                # spk_dict.pt: voice -> {"cond", "ref_mel", ...}
        self.device = device
        self.mel_dim, self.block = dit.config.mel_dim, dit.config.block_size
        self._voice_cache: dict[str, tuple[torch.Tensor, ...]] = {}
        self.graphs = None                      # GraphCache when `max_graphs` (CUDA only)
        if max_graphs:
            from omnistage.layers.graph_cache import GraphCache

            self.graphs = GraphCache(max_graphs=max_graphs)

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

    @torch.no_grad()
    def run(self, noise: torch.Tensor, codes: torch.Tensor, voice_names: list[str], lengths: list[int],
            settings: tuple, graphed: bool) -> torch.Tensor:
        """The DiT's conditioning for a batch, then its ODE (from a CUDA graph when `graphed`)."""
        num_steps, guidance_scale, sway_coefficient = settings
        dev, frames = self.device, noise.shape[1]
        voices = [self._voice(v) for v in voice_names]
        cond = torch.stack([v[0] for v in voices])
        spk = torch.stack([v[1] for v in voices])
        spk_null = torch.stack([v[2] for v in voices])
        cfg = guidance_scale >= 1e-5            # as transformers: below that, a plain conditional forward
        code_emb = self.dit.text_embed(codes.to(dev))[:, :frames]
        if cfg:
            code_emb = torch.cat([code_emb, self.dit.text_embed(torch.zeros_like(codes).to(dev))[:, :frames]])
            cond, spk = torch.cat([cond, torch.zeros_like(cond)]), torch.cat([spk, spk_null])
        static = torch.cat([spk[:, None].expand(-1, frames, -1), code_emb, cond[:, None].expand(-1, frames, -1)], -1)
        diff = block_diff(lengths * (2 if cfg else 1), frames, self.block).to(dev)
        t = torch.linspace(0, 1, num_steps, device=dev, dtype=torch.float32)
        if sway_coefficient is not None:
            t = t + sway_coefficient * (torch.cos(torch.pi / 2 * t) - 1 + t)
        inputs = (noise.to(dev), static, diff, t)
        guidance = guidance_scale if cfg else None
        if not graphed:
            return self.ode(*inputs, guidance)
        return self.graphs.run((noise.shape[0], frames, guidance, num_steps), inputs,
                               lambda x, st, bd, tt: self.ode(x, st, bd, tt, guidance))

    @torch.no_grad()
    def capture(self, batch_sizes: Sequence[int], windows: Sequence[int], settings: tuple, voice: str) -> None:
        """Captures the ODE for every batch size and window length (mel frames) under `settings`, at
        start-up, so that no request waits for a capture."""
        repeats = self.dit.config.repeats
        for size in batch_sizes:
            for frames in sorted(windows):
                noise = torch.zeros(size, frames, self.mel_dim)
                codes = torch.zeros(size, frames // repeats + 1, dtype=torch.long)
                self.run(noise, codes, [voice] * size, [frames] * size, settings, True)
        torch.cuda.synchronize(self.device)

    def ode(self, x: torch.Tensor, static: torch.Tensor, block_diff: torch.Tensor, t: torch.Tensor,
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
