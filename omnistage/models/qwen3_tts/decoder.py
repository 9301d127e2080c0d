"""Qwen3-TTS' 12 Hz speech-tokenizer decoder: codes [B, G, T] -> 24 kHz waveform [B, T * 1920]
(plain PyTorch on the weights of speech_tokenizer/model.safetensors; the decoder stage's process).

Phases, as the checkpoint's `decoder.*` tensors lay them out:
  1. `quantizer`: split residual VQ -- codebook 0 and codebooks 1..G-1 each summed from their
     tables (`embedding_sum / cluster_usage`) and projected back (1x1 convs), then added;
  2. `pre_conv` (causal, k=3) and `pre_transformer`: a pre-norm transformer with layer scales and
     causal sliding-window attention (`sliding_window` frames), between input / output projections;
  3. `upsample`: per ratio a transposed conv and a ConvNeXt block (x4 in all);
  4. `decoder`: a causal conv, per rate a SnakeBeta + transposed conv + three dilated residual
     units (x480), SnakeBeta, a causal conv to one channel; clamped to [-1, 1].

Everything is causal (convs pad on the left, transposed convs drop their right overhang, attention
looks back only), so the samples of frame t depend only on frames <= t: a batch may be padded on
the right, and a chunk decoded with enough frames of left context before it gives the samples the
whole decode gives (up to float rounding once the context covers the receptive field).
"""

from __future__ import annotations

import json
import math
import os

import torch
import torch.nn.functional as F



def load_decoder(model_dir: str, device: torch.device) -> "SpeechDecoder":
    """The decoder of `model_dir`/speech_tokenizer (float32: the reference decodes in float32 too)."""
    from safetensors import safe_open

    folder = os.path.join(model_dir, "speech_tokenizer")
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)["decoder_config"]
    weights = {}
    with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            if name.startswith("decoder."):
                weights[name[len("decoder."):]] = f.get_tensor(name).to(device, torch.float32)
    return SpeechDecoder(config, weights)


def _causal_conv(x: torch.Tensor, w: dict, name: str, dilation: int = 1, groups: int = 1) -> torch.Tensor:
    weight = w[f"{name}.weight"]
    pad = (weight.shape[-1] - 1) * dilation
    return F.conv1d(F.pad(x, (pad, 0)), weight, w.get(f"{name}.bias"), dilation=dilation, groups=groups)


def _trans_conv(x: torch.Tensor, w: dict, name: str, stride: int, both_sides: bool = False) -> torch.Tensor:
    """A transposed conv that drops its right overhang (kernel - stride samples), and with
    `both_sides` as many on the left too (Qwen3-Omni's code2wav: one input step of look-ahead)."""
    weight = w[f"{name}.weight"]
    y = F.conv_transpose1d(x, weight, w.get(f"{name}.bias"), stride=stride)
    overhang = weight.shape[-1] - stride
    if overhang <= 0:
        return y
    return y[..., overhang if both_sides else 0: y.shape[-1] - overhang]


def _snake(x: torch.Tensor, w: dict, name: str) -> torch.Tensor:
    alpha = w[f"{name}.alpha"].exp()[None, :, None]
    beta = w[f"{name}.beta"].exp()[None, :, None]
    return x + torch.sin(x * alpha).pow(2) / (beta + 1e-9)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class SpeechDecoder:
    """The decoder on its weights. Subclasses for decoders of the same family change `_latent`
    (codes -> latent frames) and `both_sided_trim` (see `_trans_conv`)."""

    both_sided_trim = False

    def __init__(self, config: dict, weights: dict[str, torch.Tensor]):
        self.config = config
        self.w = weights
        self.groups = int(config["num_quantizers"])
        self.heads = int(config["num_attention_heads"])
        self.kv_heads = int(config["num_key_value_heads"])
        self.head_dim = int(config.get("head_dim") or config["hidden_size"] // self.heads)
        self.window = int(config["sliding_window"])
        self.eps = float(config.get("rms_norm_eps", 1e-5))
        dev = next(iter(weights.values())).device
        half = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=dev) / self.head_dim
        theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000)
        self.inv_freq = 1.0 / (float(theta) ** half)
        self.upsample = math.prod(config["upsample_rates"] + config["upsampling_ratios"])   # samples per frame
        self.layers = int(config["num_hidden_layers"])
        self.compute_dtype = torch.float32      # `to_dtype`

    @property
    def device(self) -> torch.device:
        return self.inv_freq.device

    def to_dtype(self, dtype: torch.dtype) -> "SpeechDecoder":
        """The decoder computing its convolutions and matmuls in `dtype` (the decoder stage's
        `decoder_dtype`): bfloat16 runs them under autocast; weights, residual streams and norms stay
        float32. Measured on the tiny random model: ~9% rms off the float32 decode (the vocoder's
        deep conv chain amplifies bf16 rounding), so float32 stays the default."""
        self.compute_dtype = dtype
        return self

    @property
    def look_ahead(self) -> int:
        """Frames after a frame that its samples depend on: 0 for a causal decoder, 1 when the
        transposed convs trim both sides (each looks one input step ahead, < 1 frame in all)."""
        return 1 if self.both_sided_trim else 0

    @property
    def tail_loss(self) -> int:
        """Samples a decode of T frames lacks at its end against T * upsample: what each two-sided
        transposed conv trims on its left (kernel - stride), times the upsampling after it."""
        if not self.both_sided_trim:
            return 0
        strides = list(self.config["upsampling_ratios"]) + list(self.config["upsample_rates"])
        names = [f"upsample.{k}.0.conv" for k in range(len(self.config["upsampling_ratios"]))]
        names += [f"decoder.{i + 1}.block.1.conv" for i in range(len(self.config["upsample_rates"]))]
        lost = 0
        for i, (name, stride) in enumerate(zip(names, strides)):
            lost += (self.w[f"{name}.weight"].shape[-1] - stride) * math.prod(strides[i + 1:])
        return lost

    # ---- 1. codes -> latent frames --------------------------------------------------------------
    def _quantized(self, codes: torch.Tensor) -> torch.Tensor:
        w, out = self.w, 0
        for part, groups in (("rvq_first", range(0, 1)), ("rvq_rest", range(1, self.groups))):
            total = 0
            for i, g in enumerate(groups):
                book = f"quantizer.{part}.vq.layers.{i}._codebook."
                table = w[book + "embedding_sum"] / w[book + "cluster_usage"].clamp(min=1e-5)[:, None]
                total = total + F.embedding(codes[:, g], table)              # [B, T, dim]
            out = out + F.conv1d(total.transpose(1, 2), w[f"quantizer.{part}.output_proj.weight"])
        return out                                                           # [B, codebook_dim, T]

    def _latent(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, G, T] -> latent frames [B, hidden, T] (the transformer's input)."""
        return _causal_conv(self._quantized(codes), self.w, "pre_conv.conv")

    # ---- 2. transformer -------------------------------------------------------------------------
    def _attention(self, x: torch.Tensor, p: str, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        w, (b, t, _) = self.w, x.shape
        q = F.linear(x, w[p + "q_proj.weight"]).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = F.linear(x, w[p + "k_proj.weight"]).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = F.linear(x, w[p + "v_proj.weight"]).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)

        def rotate(y):
            y1, y2 = y.chunk(2, dim=-1)
            return y * cos + torch.cat([-y2, y1], dim=-1) * sin

        q, k = rotate(q), rotate(k)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        i = torch.arange(t, device=x.device)
        allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < self.window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return F.linear(out.transpose(1, 2).reshape(b, t, -1), w[p + "o_proj.weight"])

    def _transformer(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        h = x
        if "pre_transformer.input_proj.weight" in w:
            h = F.linear(x, w["pre_transformer.input_proj.weight"], w["pre_transformer.input_proj.bias"])
        freqs = torch.arange(h.shape[1], device=h.device, dtype=torch.float32)[:, None] * self.inv_freq[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        for n in range(self.layers):
            p = f"pre_transformer.layers.{n}."
            a = self._attention(_rms(h, w[p + "input_layernorm.weight"], self.eps), p + "self_attn.", cos, sin)
            h = h + w[p + "self_attn_layer_scale.scale"] * a
            m = _rms(h, w[p + "post_attention_layernorm.weight"], self.eps)
            m = F.linear(F.silu(F.linear(m, w[p + "mlp.gate_proj.weight"])) * F.linear(m, w[p + "mlp.up_proj.weight"]),
                         w[p + "mlp.down_proj.weight"])
            h = h + w[p + "mlp_layer_scale.scale"] * m
        h = _rms(h, w["pre_transformer.norm.weight"], self.eps)
        if "pre_transformer.output_proj.weight" not in w:
            return h
        return F.linear(h, w["pre_transformer.output_proj.weight"], w["pre_transformer.output_proj.bias"])

    # ---- 3. + 4. upsampling to samples ----------------------------------------------------------
    def _convnext(self, x: torch.Tensor, p: str) -> torch.Tensor:
        w = self.w
        h = _causal_conv(x, w, p + "dwconv.conv", groups=x.shape[1]).transpose(1, 2)
        h = F.layer_norm(h, (h.shape[-1],), w[p + "norm.weight"], w[p + "norm.bias"], eps=1e-6)
        h = F.linear(F.gelu(F.linear(h, w[p + "pwconv1.weight"], w[p + "pwconv1.bias"])),
                     w[p + "pwconv2.weight"], w[p + "pwconv2.bias"])
        return x + (w[p + "gamma"] * h).transpose(1, 2)

    def _vocoder(self, h: torch.Tensor) -> torch.Tensor:
        w = self.w
        h = _causal_conv(h, w, "decoder.0.conv")
        rates = self.config["upsample_rates"]
        for i, rate in enumerate(rates):
            b = f"decoder.{i + 1}.block."
            h = _trans_conv(_snake(h, w, b + "0"), w, b + "1.conv", rate, self.both_sided_trim)
            for j, dilation in enumerate((1, 3, 9)):
                r = f"{b}{j + 2}."
                y = _causal_conv(_snake(h, w, r + "act1"), w, r + "conv1.conv", dilation=dilation)
                h = h + _causal_conv(_snake(y, w, r + "act2"), w, r + "conv2.conv")
        n = len(rates) + 1
        return _causal_conv(_snake(h, w, f"decoder.{n}"), w, f"decoder.{n + 1}.conv")

    @torch.inference_mode()
    def __call__(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, G, T] (long) -> samples [B, T * 1920] in [-1, 1]."""
        if codes.shape[1] != self.groups:
            raise ValueError(f"codes must have {self.groups} codebooks, got {codes.shape[1]}")
        with torch.autocast(self.device.type, dtype=self.compute_dtype,
                            enabled=self.compute_dtype != torch.float32):
            h = self._latent(codes.to(self.device))
            h = self._transformer(h.transpose(1, 2)).transpose(1, 2)
            for k, factor in enumerate(self.config["upsampling_ratios"]):
                h = self._convnext(_trans_conv(h, self.w, f"upsample.{k}.0.conv", factor, self.both_sided_trim),
                                   f"upsample.{k}.1.")
            wav = self._vocoder(h).float().clamp(-1, 1)[:, 0]
        return wav[:, :codes.shape[-1] * self.upsample]
