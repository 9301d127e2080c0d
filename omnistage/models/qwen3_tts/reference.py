"""Qwen3-TTS Base (voice cloning): a reference voice -> its codec frames and speaker embedding
(the talker stage's process, on the talker's device; plain PyTorch).

In: the request's `ref_audio` (float32 mono samples, rate). Out: a `VoiceReference` --
  * `codes` [T, G]: the speech tokenizer's encoder (a Mimi encoder: SEANet convs, a transformer,
    a stride-2 downsample, split residual VQ; transformers' `MimiModel` on the weights of
    speech_tokenizer/model.safetensors `encoder.*`), cut to ceil(samples / 1920) frames, only for
    in-context cloning (`ref_text` given, not `x_vector_only_mode`);
  * `xvector` [H]: the checkpoint's `speaker_encoder.*` (ECAPA-TDNN: a TDNN, SE-Res2Net blocks,
    multi-layer aggregation, attentive statistics pooling, a 1x1 conv) over the log-mel
    spectrogram (1024-point STFT, hop 256, 128 Slaney mel bands up to 12 kHz) of the audio at 24 kHz.
Both follow qwen-tts' `create_voice_clone_prompt` (the math re-implemented here; the audio is
resampled to 24 kHz with soxr's HQ filter, which is what librosa's default uses).

`ReferenceEncoder.encode` keeps the last `CACHE_SIZE` references by content digest, so a voice
used again (an uploaded voice, a client resending its reference) is not encoded again. Results are
per request: nothing is kept on the modules.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

SAMPLE_RATE = 24000
FRAME_SAMPLES = 1920                            # samples per codec frame at 24 kHz (12.5 frames/s)
CACHE_SIZE = 64                                 # encoded references kept (by content digest)
MEL = dict(n_fft=1024, hop=256, win=1024, mels=128, fmin=0.0, fmax=12000.0)   # the speaker encoder's input
# transformers 5 names Mimi's encoder half under `encoder.`; the checkpoints name it flat (transformers 4.5x).
_MIMI_NAMES = (("encoder.", "encoder.encoder_seanet."), ("encoder_transformer.", "encoder.encoder_transformer."),
               ("downsample.", "encoder.downsample."))


@dataclass
class VoiceReference:
    """One reference voice, encoded."""

    codes: Optional[torch.Tensor]               # [T, G] long: codec frames of the reference (None: x-vector only)
    xvector: torch.Tensor                       # [H] speaker embedding (the talker's hidden size)


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz, logarithmic above (librosa's default, htk=False)."""
    f = np.asarray(f, dtype=np.float64)
    mel = f / (200.0 / 3)
    step = math.log(6.4) / 27.0
    return np.where(f >= 1000.0, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / step, mel)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    step = math.log(6.4) / 27.0
    return np.where(m >= 15.0, 1000.0 * np.exp(step * (m - 15.0)), m * (200.0 / 3))


def mel_filters(rate: int, n_fft: int, mels: int, fmin: float, fmax: float) -> np.ndarray:
    """[mels, n_fft // 2 + 1] triangular filters on the Slaney scale, area-normalised ("slaney")."""
    bins = np.linspace(0, rate / 2, n_fft // 2 + 1)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(fmin), _hz_to_mel(fmax), mels + 2))
    widths = np.diff(edges)
    ramps = edges[:, None] - bins[None, :]
    rising = -ramps[:-2] / widths[:-1, None]
    falling = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling))
    return (weights * (2.0 / (edges[2:] - edges[:-2]))[:, None]).astype(np.float32)


def log_mel(samples: torch.Tensor, filters: torch.Tensor) -> torch.Tensor:
    """samples [N] at 24 kHz -> [frames, mels]: |STFT| (reflect-padded, not centred) -> mel -> log."""
    pad = (MEL["n_fft"] - MEL["hop"]) // 2
    y = F.pad(samples[None, None], (pad, pad), mode="reflect")[0]
    spec = torch.stft(y, MEL["n_fft"], hop_length=MEL["hop"], win_length=MEL["win"],
                      window=torch.hann_window(MEL["win"], device=samples.device), center=False,
                      normalized=False, onesided=True, return_complex=True)
    mag = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    return torch.log((filters @ mag).clamp(min=1e-5))[0].T


def _same_conv(x: torch.Tensor, w: dict, name: str, dilation: int = 1) -> torch.Tensor:
    """A conv with "same" reflect padding (the speaker encoder's every conv)."""
    weight = w[name + ".weight"]
    total = dilation * (weight.shape[-1] - 1)
    if total:
        x = F.pad(x, (total // 2, total - total // 2), mode="reflect")
    return F.conv1d(x, weight, w[name + ".bias"], dilation=dilation)


class SpeakerEncoder:
    """ECAPA-TDNN over a log-mel spectrogram -> one speaker embedding (`speaker_encoder_config`)."""

    def __init__(self, config: dict, weights: dict[str, torch.Tensor]):
        self.w = weights
        self.channels = list(config["enc_channels"])
        self.kernels = list(config["enc_kernel_sizes"])
        self.dilations = list(config["enc_dilations"])
        self.scale = int(config["enc_res2net_scale"])
        self.filters = torch.from_numpy(mel_filters(SAMPLE_RATE, MEL["n_fft"], MEL["mels"], MEL["fmin"],
                                                    MEL["fmax"])).to(next(iter(weights.values())).device)

    def _tdnn(self, x: torch.Tensor, name: str, dilation: int = 1) -> torch.Tensor:
        return F.relu(_same_conv(x, self.w, name + ".conv", dilation))

    def _se_res2net(self, x: torch.Tensor, i: int) -> torch.Tensor:
        p = f"blocks.{i}."
        h = self._tdnn(x, p + "tdnn1")
        parts, prev = [], None
        for j, part in enumerate(torch.chunk(h, self.scale, dim=1)):
            if j > 0:
                part = self._tdnn(part if prev is None else part + prev, f"{p}res2net_block.blocks.{j - 1}",
                                  self.dilations[i])
                prev = part
            parts.append(part)
        h = self._tdnn(torch.cat(parts, dim=1), p + "tdnn2")
        s = F.relu(_same_conv(h.mean(dim=2, keepdim=True), self.w, p + "se_block.conv1"))
        h = h * torch.sigmoid(_same_conv(s, self.w, p + "se_block.conv2"))
        return h + x

    @staticmethod
    def _stats(x: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = (weights * x).sum(2)
        std = torch.sqrt((weights * (x - mean[..., None]).pow(2)).sum(2).clamp(1e-12))
        return mean, std

    def _pool(self, x: torch.Tensor) -> torch.Tensor:
        """Attentive statistics pooling: [B, C, T] -> [B, 2C, 1]."""
        t = x.shape[-1]
        mean, std = self._stats(x, torch.full_like(x[:, :1], 1.0 / t))
        a = torch.cat([x, mean[..., None].expand(-1, -1, t), std[..., None].expand(-1, -1, t)], dim=1)
        a = _same_conv(torch.tanh(self._tdnn(a, "asp.tdnn")), self.w, "asp.conv")
        mean, std = self._stats(x, torch.softmax(a, dim=2))
        return torch.cat([mean, std], dim=1)[..., None]

    @torch.inference_mode()
    def __call__(self, samples: torch.Tensor) -> torch.Tensor:
        """samples [N] (float32, 24 kHz) -> [enc_dim]."""
        h = log_mel(samples.float(), self.filters).T[None].to(self.w["fc.weight"].dtype)   # [1, mels, T]
        h = self._tdnn(h, "blocks.0", self.dilations[0])
        outs = []
        for i in range(1, len(self.channels) - 1):
            h = self._se_res2net(h, i)
            outs.append(h)
        h = self._tdnn(torch.cat(outs, dim=1), "mfa", self.dilations[-1])
        return _same_conv(self._pool(h), self.w, "fc")[0, :, 0]


def load_mimi_encoder(model_dir: str, device: torch.device):
    """The speech tokenizer's encoder as a transformers `MimiModel` (its decoder half unused) and
    how many quantizers the talker reads (`encoder_valid_num_quantizers`)."""
    from safetensors import safe_open
    from transformers import MimiConfig, MimiModel

    folder = os.path.join(model_dir, "speech_tokenizer")
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    state = {}
    with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            if not name.startswith("encoder."):
                continue
            key = name[len("encoder."):]
            for old, new in _MIMI_NAMES:
                if key.startswith(old):
                    key = new + key[len(old):]
                    break
            state[key] = f.get_tensor(name)
    model = MimiModel(MimiConfig(**config["encoder_config"]))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith(("upsample.", "decoder_transformer.", "decoder."))]
    if missing or unexpected:
        raise ValueError(f"speech tokenizer encoder weights: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.to(device=device, dtype=torch.float32).eval(), int(config["encoder_valid_num_quantizers"])


class ReferenceEncoder:
    """Reference audio -> `VoiceReference` (see the module docstring), cached by content."""

    def __init__(self, model_dir: str, device: torch.device, dtype: torch.dtype, speaker_weights: dict):
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)["speaker_encoder_config"]
        self.rate = int(config.get("sample_rate", SAMPLE_RATE))
        if self.rate != SAMPLE_RATE:
            raise ValueError(f"speaker_encoder_config.sample_rate must be {SAMPLE_RATE}, got {self.rate}")
        self.speaker = SpeakerEncoder(config, {k: v.to(device, dtype) for k, v in speaker_weights.items()})
        self.mimi, self.quantizers = load_mimi_encoder(model_dir, device)
        self.device, self.dtype = device, dtype
        self._cache: OrderedDict[tuple, VoiceReference] = OrderedDict()
        self.encoded = 0                        # references encoded so far (cache misses)

    def _resampled(self, samples: np.ndarray, rate: int) -> np.ndarray:
        samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        if rate == SAMPLE_RATE:
            return samples
        import soxr

        return soxr.resample(samples, rate, SAMPLE_RATE, quality="HQ").astype(np.float32)

    @torch.inference_mode()
    def codes(self, samples: torch.Tensor) -> torch.Tensor:
        """samples [N] at 24 kHz -> [ceil(N / 1920), G] codes."""
        out = self.mimi.encode(samples[None, None].float()).audio_codes[0, :self.quantizers]
        return out[:, :-(-samples.shape[0] // FRAME_SAMPLES)].T.contiguous()

    def encode(self, samples: np.ndarray, rate: int, with_codes: bool) -> VoiceReference:
        samples = self._resampled(samples, rate)
        key = (hashlib.sha256(samples.tobytes()).hexdigest(), with_codes)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        wav = torch.from_numpy(samples).to(self.device)
        ref = VoiceReference(self.codes(wav) if with_codes else None, self.speaker(wav).to(self.dtype))
        self.encoded += 1
        self._cache[key] = ref
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return ref
