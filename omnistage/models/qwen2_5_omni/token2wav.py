"""token2wav's parts that code2wav (`code2wav.py`) builds on: loading its weights from a Qwen2.5-Omni
folder, BigVGAN's receptive field in mel frames, device timing of queued work, and BigVGAN's forward without
host syncs, from CUDA graphs (the code2wav stage's engine, in whatever process runs it).

In: a checkpoint folder (`load_token2wav`), a BigVGAN config (`vocoder_context`), a device
(`DeviceTimer`). Out: the float32 token2wav module and the speakers of `spk_dict.pt`; a frame count;
seconds per phase.
"""

from __future__ import annotations

import math
import os
import time

import torch

from omnistage.models.qwen2_5_omni.bigvgan_fused import activation, prepare

def load_token2wav(model_dir: str, device: str = "cpu"):
    """(token2wav module in float32 eval mode, speakers dict) from a Qwen2.5-Omni folder.

    Reads only the `token2wav.*` tensors of the (single or sharded) safetensors checkpoint (drawn, of a
    `load_format="dummy"` folder).
    """
    from transformers import AutoConfig
    from transformers.initialization import no_init_weights
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel

    from omnistage.models.loader import read_tensors

    config = AutoConfig.from_pretrained(model_dir)
    with no_init_weights():                     # every parameter is loaded below; buffers are built in __init__
        model = Qwen2_5OmniToken2WavModel._from_config(config.token2wav_config, attn_implementation="sdpa")
    state = {key[len("token2wav."):]: t for key, t in read_tensors(model_dir, lambda k: k.startswith("token2wav."))}
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


class DeviceTimer:
    """Device time of phases of queued work: CUDA events on the current stream, wall clock on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks = [self._now()]

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self) -> None:
        self.marks.append(self._now())

    def done(self) -> bool:
        return not self.cuda or self.marks[-1].query()

    def seconds(self) -> list[float]:
        """Seconds between consecutive marks (waits for the last one)."""
        if not self.cuda:
            return [b - a for a, b in zip(self.marks, self.marks[1:])]
        self.marks[-1].synchronize()
        return [a.elapsed_time(b) / 1000 for a, b in zip(self.marks, self.marks[1:])]


class DeviceVocoder:
    """transformers' `Qwen2_5OmniToken2WavBigVGANModel.forward` with the same operations in the same
    order, less its two host syncs (the clamp floor made on the device in every call, the copy of the
    waveform to the CPU), so a launch can queue it behind the ODE: mel [n, 80, frames] -> waveform
    [n, 1, samples] in [-1, 1] on the device.

    After `capture(batch_sizes, frames)` (CUDA) an input of a captured length replays a CUDA graph, its
    rows padded with zero mel to the next captured batch size (rows are independent); others run
    eagerly. Why graphs: eagerly BigVGAN is ~1500 small kernels per call, which fill the stream's launch
    queue behind a queued ODE graph, so the host thread -- the one that steps every stage of the shared
    layout -- would block in a launch until the ODE is done, and the talker's steps with it. A graph's
    result is a view of its buffer: copy it out (stream-ordered) before the next call.

    `fused` (CUDA with Triton): each anti-aliased SnakeBeta activation (109 per forward, the bulk of
    BigVGAN's memory traffic) is one kernel (`bigvgan_fused.py`) instead of transformers' ~12; the AMP
    blocks' loop is transformers' `Qwen2_5OmniAMPBlock.forward` with that activation."""

    def __init__(self, bigvgan, dtype: torch.dtype = torch.float32, fused: bool = False):
        self.model = bigvgan
        self.dtype = dtype                      # bfloat16: the convolutions under autocast (the rest float32)
        # per activation module: the fused kernel's tables (`bigvgan_fused.prepare`); empty when not fused
        self.tables = {id(a): prepare(a) for a in bigvgan.modules() if hasattr(a, "upsample")} if fused else {}
        device = next(bigvgan.parameters()).device
        # `amplitude_to_db`'s floor, made once as transformers makes it (float32 exp of float32 input)
        self.min_level = torch.exp(torch.tensor(-115 / 20.0 * math.log(10), device=device, dtype=torch.float32))
        self.graphs = None                      # GraphCache after `capture`
        self.sizes: list[int] = []              # captured batch sizes, ascending
        self.frames: list[int] = []             # captured input lengths in mel frames

    def capture(self, batch_sizes: list[int], frames: list[int], mel_dim: int) -> None:
        from omnistage.layers.graph_cache import GraphCache

        device = self.min_level.device
        self.graphs = GraphCache(max_graphs=len(batch_sizes) * len(frames))
        self.sizes, self.frames = sorted(batch_sizes), sorted(frames)
        for size in self.sizes:
            for length in self.frames:
                self(torch.zeros(size, mel_dim, length, device=device))
        torch.cuda.synchronize(device)

    @torch.no_grad()
    def __call__(self, mel: torch.Tensor) -> torch.Tensor:
        n, _, frames = mel.shape
        if self.graphs is None or frames not in self.frames or n > self.sizes[-1]:
            return self.forward(mel)
        size = next(b for b in self.sizes if b >= n)
        if size > n:
            mel = torch.cat([mel, mel.new_zeros(size - n, *mel.shape[1:])])
        return self.graphs.run((size, frames), (mel,), self.forward)[:n]

    @torch.no_grad()
    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        if self.dtype == torch.float32:
            return self._forward(mel)
        with torch.autocast(mel.device.type, dtype=self.dtype, cache_enabled=False):   # graph-capturable
            return self._forward(mel).float()

    def _forward(self, mel: torch.Tensor) -> torch.Tensor:
        m = self.model
        decibels = 20 * torch.log10(torch.clamp(torch.exp(mel), min=self.min_level)) - 20
        hidden = m.conv_pre(m.normalize_spectrogram(decibels, 1, -115))
        for layer in range(m.num_upsample_layers):
            hidden = m.ups[layer][0](hidden)
            residual = sum(self._amp_block(m.resblocks[layer * m.num_residual_blocks + block], hidden)
                           for block in range(m.num_residual_blocks))
            hidden = residual / m.num_residual_blocks
        return torch.clamp(m.conv_post(self._act(m.activation_post, hidden)), min=-1.0, max=1.0)

    def _act(self, act, x: torch.Tensor) -> torch.Tensor:
        return activation(act, self.tables.get(id(act)), x)

    def _amp_block(self, block, hidden: torch.Tensor) -> torch.Tensor:
        """`Qwen2_5OmniAMPBlock.forward` with `_act` for its activations."""
        if not self.tables:
            return block(hidden)
        acts1, acts2 = block.activations[::2], block.activations[1::2]
        for conv1, conv2, act1, act2 in zip(block.convs1, block.convs2, acts1, acts2):
            hidden = hidden + conv2(self._act(act2, conv1(self._act(act1, hidden))))
        return hidden
