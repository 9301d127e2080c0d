"""Qwen3-TTS' code predictor as our own small decoder: codebooks 1..G-1 of every sampled frame, all
rows of a talker step at once (the talker stage's process, on the talker's device).

In: the talker rows that sampled this step -- their last hidden state [S, H], their group-0 code
[S] -- and their `SamplingBatch`. Out: codes [S, G-1] and the row each frame adds to its next
talker position [S, H] (the sum of the G-1 codes' embeddings).

One call is one whole frame per row: the 2-row prefill (hidden state, code-0 embedding) and G-2
one-row steps of a Qwen3 decoder (q/k-norm, rope, GQA, SwiGLU) whose keys and values sit in a
buffer [layers, S, kv heads, G, head dim] made for this call, so nothing is kept between frames or
shared between requests. Every shape is fixed by (S, G), and the random numbers of the whole frame
are drawn before it starts -- per row, from its request's generator, the G-1 draws in order (on
the CPU exactly the numbers G-1 `torch.multinomial` calls would use, so a seeded request equals
qwen-tts', which draws them right after the talker's token) -- so the loop has no host value and
no host sync: on CUDA it is captured as one graph per batch-size bucket (`layers/graph_cache.py`)
and replayed. The plain-PyTorch path (CPU, and CUDA with `OMNISTAGE_TTS_PREDICTOR_GRAPHS=0`)
runs the same function eagerly.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F

from omnistage.ar.sampler import SamplingBatch, filter_logits, filter_values, to_device
from omnistage.layers.fused import rms_norm_ref

GRAPHS = os.environ.get("OMNISTAGE_TTS_PREDICTOR_GRAPHS", "1") != "0"
BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)   # batch sizes captured (rows padded up)


def _bucket(n: int) -> Optional[int]:
    return next((b for b in BUCKETS if b >= n), None)


class FramePredictor:
    """The decoder of a `talker.CodePredictor` (its weights, not a copy), run frame by frame."""

    def __init__(self, predictor, talker_embed: torch.nn.Embedding):
        cfg = predictor.model.config
        self.layers = predictor.model.layers
        self.norm = predictor.model.norm
        self.project = predictor.project
        self.embeds, self.heads = predictor.embeds, predictor.heads
        self.code0 = talker_embed
        self.sampling = predictor.sampling
        self.heads_q, self.heads_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.groups = len(self.heads) + 1
        theta = float(cfg.rope_parameters["rope_theta"])
        dev = self.code0.weight.device
        half = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=dev) / self.head_dim
        freqs = torch.arange(self.groups, dtype=torch.float32, device=dev)[:, None] * (1.0 / theta ** half)[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        dtype = self.code0.weight.dtype
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)         # [G, head_dim] per position
        self.graphs = None
        if dev.type == "cuda" and GRAPHS:
            from omnistage.layers.graph_cache import GraphCache

            self.graphs = GraphCache(max_graphs=len(BUCKETS))

    # ---- the decoder ----------------------------------------------------------------------------
    def _rotate(self, x: torch.Tensor, start: int, n: int) -> torch.Tensor:
        cos, sin = self.cos[start:start + n][None, None], self.sin[start:start + n][None, None]
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    def _forward(self, x: torch.Tensor, start: int, cache: torch.Tensor) -> torch.Tensor:
        """x [S, n, D] at positions start.. -> the last row's final hidden state [S, D]; writes the
        rows' keys / values into cache [L, 2, S, kvh, G, hd]."""
        s, n, _ = x.shape
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            h = rms_norm_ref(x, layer.input_layernorm.weight, self.eps)
            q = rms_norm_ref(a.q_proj(h).view(s, n, -1, self.head_dim), a.q_norm.weight, self.eps).transpose(1, 2)
            k = rms_norm_ref(a.k_proj(h).view(s, n, -1, self.head_dim), a.k_norm.weight, self.eps).transpose(1, 2)
            v = a.v_proj(h).view(s, n, -1, self.head_dim).transpose(1, 2)
            q, k = self._rotate(q, start, n), self._rotate(k, start, n)
            cache[i, 0, :, :, start:start + n] = k
            cache[i, 1, :, :, start:start + n] = v
            keys, values = cache[i, 0, :, :, :start + n], cache[i, 1, :, :, :start + n]
            if self.heads_kv != self.heads_q:
                keys = keys.repeat_interleave(self.heads_q // self.heads_kv, dim=1)
                values = values.repeat_interleave(self.heads_q // self.heads_kv, dim=1)
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=n > 1)
            x = x + a.o_proj(out.transpose(1, 2).reshape(s, n, -1))
            h = rms_norm_ref(x, layer.post_attention_layernorm.weight, self.eps)
            m = layer.mlp
            x = x + m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))
        return rms_norm_ref(x[:, -1], self.norm.weight, self.eps)

    def _frame(self, hidden: torch.Tensor, code0: torch.Tensor, temp: torch.Tensor, top_k: Optional[torch.Tensor],
               top_p: Optional[torch.Tensor], greedy: torch.Tensor, noise: Optional[torch.Tensor]):
        """The whole frame from device tensors only: (codes [S, G-1], frame rows [S, H])."""
        s = hidden.shape[0]
        dtype = hidden.dtype
        cache = torch.zeros(len(self.layers), 2, s, self.heads_kv, self.groups, self.head_dim,
                            dtype=dtype, device=hidden.device)
        x = self.project(torch.stack([hidden, self.code0(code0).to(dtype)], dim=1))
        h = self._forward(x, 0, cache)
        codes, rows = [], None
        for g, head in enumerate(self.heads):
            logits = head(h).float()
            code = logits.argmax(-1)
            if noise is not None:
                probs = filter_logits(logits, temp, top_k, top_p).softmax(-1)
                code = torch.where(greedy, code, (probs / noise[g]).argmax(-1))
            codes.append(code)
            row = self.embeds[g](code)
            rows = row if rows is None else rows + row
            if g + 1 < len(self.heads):
                h = self._forward(self.project(row[:, None].to(dtype)), g + 2, cache)
        return torch.stack(codes, dim=1), rows

    # ---- per step -------------------------------------------------------------------------------
    def _noise(self, batch: SamplingBatch, vocab: int, device: torch.device) -> torch.Tensor:
        """[G-1, S, V] Exp(1) draws; a seeded row's from its generator, G-1 draws of V in order."""
        noise = torch.empty(self.groups - 1, len(batch.params), vocab, device=device)
        unseeded = [i for i, g in enumerate(batch.generators) if g is None]
        if unseeded:
            draws = torch.empty(self.groups - 1, len(unseeded), vocab, device=device).exponential_()
            noise[:, to_device(unseeded, device)] = draws
        for i, g in enumerate(batch.generators):
            if g is not None:
                noise[:, i] = torch.empty(self.groups - 1, vocab, device=device).exponential_(generator=g)
        return noise

    @torch.inference_mode()
    def __call__(self, hidden: torch.Tensor, code0: torch.Tensor, batch: SamplingBatch):
        """hidden [S, H], code0 [S] -> (codes [S, G-1], frame rows [S, H]). Greedy rows stay greedy;
        sampled ones take generation_config's subtalker temperature / top-k / top-p (the request's
        own where it has none), never penalties."""
        params = [p if p.greedy else p.clone(**self.sampling) for p in batch.params]
        dev = hidden.device
        sampled = not all(p.greedy for p in params)
        temp, top_k, top_p = filter_values(params, dev)
        greedy = to_device([p.greedy for p in params], dev)
        noise = self._noise(batch, self.heads[0].out_features, dev) if sampled else None
        s = hidden.shape[0]
        size = _bucket(s) if self.graphs is not None else None
        if size is None:
            return self._frame(hidden, code0, temp, top_k, top_p, greedy, noise)
        pad = size - s

        def padded(t: Optional[torch.Tensor], dim: int = 0, value=0):
            if t is None or pad == 0:
                return t
            shape = list(t.shape)
            shape[dim] = pad
            return torch.cat([t, t.new_full(shape, value)], dim=dim)

        inputs = [padded(hidden), padded(code0), padded(temp, value=1.0), padded(greedy, value=True)]
        filters = top_k is not None
        if filters:
            inputs += [padded(top_k, value=-1), padded(top_p, value=1.0)]
        if sampled:
            inputs.append(padded(noise, dim=1, value=1.0))

        def run(h, c, t, gr, *rest):
            k, p = (rest[0], rest[1]) if filters else (None, None)
            return self._frame(h, c, t, k, p, gr, rest[-1] if sampled else None)

        codes, rows = self.graphs.run((size, filters, sampled), inputs, run)
        return codes[:s].clone(), rows[:s].clone()
