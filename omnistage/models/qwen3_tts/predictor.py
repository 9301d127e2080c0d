"""Qwen3-TTS' code predictor as our own small decoder: codebooks 1..G-1 of every sampled frame, all
rows of a talker step at once (the talker stage's process, on the talker's device).

In: the talker rows that sampled this step -- their last hidden state [S, H], their group-0 code
[S] -- and their `SamplingBatch`. Out: codes [S, G-1] and the row each frame adds to its next
talker position [S, H] (the sum of the G-1 codes' embeddings).

One call is one whole frame per row: the 2-row prefill (hidden state, code-0 embedding) and G-2
one-row steps of a Qwen3 decoder (q/k-norm, rope, GQA, SwiGLU) whose keys and values sit in a
buffer [layers, 2, S * G, kv heads, head dim] made for this call, so nothing is kept between
frames or shared between requests. Every shape is fixed by (S, G), and the random numbers of the
whole frame are drawn before it starts -- per row, from its request's generator, the G-1 draws in
order (on the CPU exactly the numbers G-1 `torch.multinomial` calls would use, so a seeded request
equals qwen-tts', which draws them right after the talker's token) -- so the loop has no host value
and no host sync: on CUDA it is captured as one graph per batch-size bucket (`layers/graph_cache.py`)
and replayed. The plain-PyTorch path (CPU, and CUDA with `OMNISTAGE_TTS_PREDICTOR_GRAPHS=0`)
runs the same function eagerly.

Few kernels per sub-step (the frame is 15 sub-steps x 5 layers at 1.7B: kernel launches, not
weight reads, set its time): q|k|v and gate|up are one GEMM each (`MergedLayer`, built at load),
RMSNorm with the residual add, q/k-norm + rope + the cache write, and SiLU-mul are
`layers/fused.py`'s kernels (their PyTorch references on the CPU), GQA repeats no K/V (a one-row
sub-step puts a kv head's query heads as its query rows; the 2-row prefill uses SDPA's
`enable_gqa`), and sampling is one Triton kernel per sub-step on CUDA (`layers/triton_sampling.py`:
top-k, top-p and the draw from a sort in registers); its reference `pick` looks only at each row's
top-k logits when every sampled row has a top-k of at most `TOP_K_MOST` (generation_config's
subtalker top-k is 50).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Optional

import torch
import torch.nn.functional as F

from omnistage.ar.sampler import SamplingBatch, filter_logits, filter_values, to_device
from omnistage.layers import fused, triton_sampling
from omnistage.layers.fused import rms_norm, rotary_and_cache, silu_and_mul
from omnistage.params import SamplingParams

GRAPHS = os.environ.get("OMNISTAGE_TTS_PREDICTOR_GRAPHS", "1") != "0"
BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)   # batch sizes captured (rows padded up)


TOP_K_MOST = 64                                 # every sampled row with top-k <= this: sample from those logits only
_PADDING = SamplingParams(temperature=0.0)      # the parameters of a graph bucket's padding rows


def _bucket(n: int) -> Optional[int]:
    return next((b for b in BUCKETS if b >= n), None)


@dataclass
class MergedLayer:
    """One decoder layer's weights as the frame function reads them: q|k|v and gate|up merged into
    one matrix each, built once at load; the layer's own q / k / v and gate / up parameters become
    views into them, so the weights are held once."""
    input_norm: torch.Tensor                    # [D] RMSNorm weight before attention
    post_norm: torch.Tensor                     # [D] RMSNorm weight before the MLP
    qkv: torch.Tensor                           # [(H + 2 KVH) * hd, D] rows: q heads, k heads, v heads
    qkv_bias: Optional[torch.Tensor]            # [(H + 2 KVH) * hd] or None
    q_norm: Any                                 # per-head RMSNorm before rope (`.weight` [hd], `.eps`)
    k_norm: Any                                 # the same for keys
    o_proj: torch.Tensor                        # [D, H * hd]
    o_bias: Optional[torch.Tensor]              # [D] or None
    gate_up: torch.Tensor                       # [2 I, D] rows: gate, then up
    gate_up_bias: Optional[torch.Tensor]        # [2 I] or None
    down: torch.Tensor                          # [D, I]
    down_bias: Optional[torch.Tensor]           # [D] or None


@torch.no_grad()
def _merged(modules: list) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The weights (and biases) of linear `modules` stacked by rows; each module's parameters are
    then views into them."""
    weight = torch.cat([m.weight for m in modules])
    has_bias = [m.bias is not None for m in modules]
    if any(has_bias) and not all(has_bias):
        raise ValueError("merged projections must all have a bias or none")
    bias = torch.cat([m.bias for m in modules]) if all(has_bias) else None
    row = 0
    for m in modules:
        n = m.weight.shape[0]
        m.weight.data = weight[row:row + n]
        if bias is not None:
            m.bias.data = bias[row:row + n]
        row += n
    return weight, bias


def _merge(layer, eps: float) -> MergedLayer:
    a, mlp = layer.self_attn, layer.mlp
    qkv, qkv_bias = _merged([a.q_proj, a.k_proj, a.v_proj])
    gate_up, gate_up_bias = _merged([mlp.gate_proj, mlp.up_proj])
    return MergedLayer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, qkv, qkv_bias,
                       SimpleNamespace(weight=a.q_norm.weight, eps=eps),
                       SimpleNamespace(weight=a.k_norm.weight, eps=eps),
                       a.o_proj.weight, a.o_proj.bias, gate_up, gate_up_bias, mlp.down_proj.weight, mlp.down_proj.bias)


def pick(logits: torch.Tensor, temp: torch.Tensor, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor],
         noise: torch.Tensor, k_most: int = 0) -> torch.Tensor:
    """Sampled ids [S] of float32 logits [S, V]: temperature, top-k (-1: all), top-p, then the
    largest probability / Exp(1) noise [S, V] (the Gumbel-max form of a multinomial draw).
    `k_most` > 0 (every row's top-k in 1..k_most): only the rows' `k_most` largest logits are
    sorted and filtered, with the noise at those ids -- the same tokens survive, with the same
    probabilities, as in the whole-vocabulary sort (`filter_logits`), at a fraction of its work.
    On CUDA (the fused kernels on) rows that filter are one Triton program each
    (`layers/triton_sampling.py`, whose reference is `pick_ref`): no topk / sort launches."""
    if top_k is not None and fused.use_triton(logits) and triton_sampling.fits(logits):
        return triton_sampling.pick_top_k_top_p(logits, temp, top_k, top_p, noise)
    return pick_ref(logits, temp, top_k, top_p, noise, k_most)


def pick_ref(logits: torch.Tensor, temp: torch.Tensor, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor],
             noise: torch.Tensor, k_most: int = 0) -> torch.Tensor:
    """`pick` in plain PyTorch (the CPU path, and the sampling kernel's reference)."""
    if k_most <= 0 or top_k is None:
        probs = filter_logits(logits, temp, top_k, top_p).softmax(-1)
        return (probs / noise).argmax(-1)
    values, ids = logits.topk(k_most, dim=-1)                   # sorted, largest first
    values = values / temp[:, None]
    ranks = torch.arange(k_most, device=logits.device)[None, :]
    drop = ranks >= torch.where(top_k > 0, top_k, k_most)[:, None]
    probs = values.masked_fill(drop, float("-inf")).softmax(-1)
    drop |= probs.cumsum(-1) - probs >= top_p[:, None]         # probability above each token
    drop[:, 0] = False                                         # always keep the best token
    probs = values.masked_fill(drop, float("-inf")).softmax(-1)
    best = (probs / noise.gather(1, ids)).argmax(-1, keepdim=True)
    return ids.gather(1, best)[:, 0]


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
        self.merged = [_merge(layer, self.eps) for layer in self.layers]
        theta = float(cfg.rope_parameters["rope_theta"])
        dev = self.code0.weight.device
        half = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=dev) / self.head_dim
        freqs = torch.arange(self.groups, dtype=torch.float32, device=dev)[:, None] * (1.0 / theta ** half)[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()          # [G, head_dim] float32, per position
        self._subs: dict[tuple, SamplingParams] = {}     # (temperature, top_k, top_p) -> `_sub_params`
        self.graphs = None
        if dev.type == "cuda" and GRAPHS:
            from omnistage.layers.graph_cache import GraphCache

            self.graphs = GraphCache(max_graphs=2 * len(BUCKETS))

    # ---- the decoder ----------------------------------------------------------------------------
    def _forward(self, x: torch.Tensor, start: int, cache: torch.Tensor) -> torch.Tensor:
        """x [S, n, D] at positions start.. -> the last row's final hidden state [S, D]; writes the
        rows' keys / values into cache [L, 2, S * G, kvh, hd] (row s's position p at slot s * G + p)."""
        s, n, d = x.shape
        g, hd, hq, hkv = self.groups, self.head_dim, self.heads_q, self.heads_kv
        slots = (torch.arange(s, device=x.device)[:, None] * g
                 + torch.arange(start, start + n, device=x.device)[None]).flatten()
        cos, sin = self.cos[start:start + n].repeat(s, 1), self.sin[start:start + n].repeat(s, 1)
        x = x.reshape(s * n, d)
        residual, out = None, x
        for i, m in enumerate(self.merged):
            if residual is None:
                h, residual = rms_norm(out, m.input_norm, self.eps), out
            else:
                h, residual = rms_norm(out, m.input_norm, self.eps, residual)
            qkv = F.linear(h, m.qkv, m.qkv_bias)
            q, k, v = qkv.split([hq * hd, hkv * hd, hkv * hd], dim=-1)
            q, k = rotary_and_cache(q.view(-1, hq, hd), k.view(-1, hkv, hd), v.view(-1, hkv, hd), cos, sin,
                                    cache[i], slots, m.q_norm, m.k_norm)
            keys = cache[i, 0].view(s, g, hkv, hd)[:, :start + n].transpose(1, 2)
            values = cache[i, 1].view(s, g, hkv, hd)[:, :start + n].transpose(1, 2)
            if n == 1:                          # one query: its heads of a kv head as that head's query rows
                att = F.scaled_dot_product_attention(q.view(s, hkv, hq // hkv, hd), keys, values)
            else:
                att = F.scaled_dot_product_attention(q.view(s, n, hq, hd).transpose(1, 2), keys, values,
                                                     is_causal=True, enable_gqa=hq != hkv).transpose(1, 2)
            out = F.linear(att.reshape(s * n, hq * hd), m.o_proj, m.o_bias)
            h, residual = rms_norm(out, m.post_norm, self.eps, residual)
            out = F.linear(silu_and_mul(F.linear(h, m.gate_up, m.gate_up_bias)), m.down, m.down_bias)
        h, _ = rms_norm(out, self.norm.weight, self.eps, residual)
        return h.view(s, n, d)[:, -1]

    def _frame(self, hidden: torch.Tensor, code0: torch.Tensor, temp: torch.Tensor, top_k: Optional[torch.Tensor],
               top_p: Optional[torch.Tensor], greedy: torch.Tensor, noise: Optional[torch.Tensor], k_most: int = 0):
        """The whole frame from device tensors only: (codes [S, G-1], frame rows [S, H]). `k_most`:
        every sampled row's top-k is in 1..k_most (sampling looks at those logits only); 0: not so."""
        s = hidden.shape[0]
        dtype = hidden.dtype
        cache = torch.empty(len(self.layers), 2, s * self.groups, self.heads_kv, self.head_dim,
                            dtype=dtype, device=hidden.device)   # every slot attention reads is written first
        x = self.project(torch.stack([hidden, self.code0(code0).to(dtype)], dim=1))
        h = self._forward(x, 0, cache)
        codes, rows = [], None
        for g, head in enumerate(self.heads):
            logits = F.linear(h, head.weight).float()
            code = logits.argmax(-1)
            if noise is not None:
                code = torch.where(greedy, code, pick(logits, temp, top_k, top_p, noise[g], k_most))
            codes.append(code)
            row = self.embeds[g](code)
            rows = row if rows is None else rows + row
            if g + 1 < len(self.heads):
                h = self._forward(self.project(row[:, None].to(dtype)), g + 2, cache)
        return torch.stack(codes, dim=1), rows

    # ---- per step -------------------------------------------------------------------------------
    def _sub_params(self, p: SamplingParams) -> SamplingParams:
        """A sampled row's code-predictor sampling: the request's temperature / top-k / top-p under
        generation_config's subtalker ones; made once per distinct triple (a clone of the request's
        params, with its validation, per row and step cost more host time than the frame)."""
        key = (p.temperature, p.top_k, p.top_p)
        sub = self._subs.get(key)
        if sub is None:
            fields = dict(zip(("temperature", "top_k", "top_p"), key))
            fields.update(self.sampling)
            sub = self._subs[key] = SamplingParams(**fields)
        return sub

    def _noise(self, batch: SamplingBatch, vocab: int, device: torch.device, rows: int) -> torch.Tensor:
        """[G-1, rows, V] Exp(1) draws for the batch's S rows (rows >= S: the rest are a graph bucket's
        padding, 1.0 or unseeded draws); a seeded row's from its generator, G-1 draws of V in order."""
        unseeded = [i for i, g in enumerate(batch.generators) if g is None]
        if len(unseeded) == len(batch.params):
            return torch.empty(self.groups - 1, rows, vocab, device=device).exponential_()
        noise = torch.empty(self.groups - 1, rows, vocab, device=device)
        if rows > len(batch.params):
            noise[:, len(batch.params):] = 1.0
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
        params = [p if p.greedy else self._sub_params(p) for p in batch.params]
        dev = hidden.device
        sampled = not all(p.greedy for p in params)
        ks = [p.top_k for p in params if not p.greedy]
        k_most = max(ks) if ks and all(0 < k <= TOP_K_MOST for k in ks) else 0
        k_most = k_most if k_most < self.heads[0].out_features else 0
        s = hidden.shape[0]
        size = _bucket(s) if self.graphs is not None else None
        pad = 0 if size is None else size - s
        # a graph bucket's padding rows are greedy and filter nothing (temperature 1, top-k -1, top-p 1):
        # their per-row values go up padded, in the same copies
        rows = params + [_PADDING] * pad
        temp, top_k, top_p = filter_values(rows, dev)
        greedy = to_device([p.greedy for p in rows], dev)
        noise = self._noise(batch, self.heads[0].out_features, dev, len(rows)) if sampled else None
        if size is None:
            return self._frame(hidden, code0, temp, top_k, top_p, greedy, noise, k_most)

        def padded(t: torch.Tensor) -> torch.Tensor:
            return t if pad == 0 else torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])

        inputs = [padded(hidden), padded(code0), temp, greedy]
        filters = top_k is not None
        if filters:
            inputs += [top_k, top_p]
        if sampled:
            inputs.append(noise)

        def run(h, c, t, gr, *rest):
            k, p = (rest[0], rest[1]) if filters else (None, None)
            return self._frame(h, c, t, k, p, gr, rest[-1] if sampled else None, k_most)

        codes, frame_rows = self.graphs.run((size, filters, sampled, k_most), inputs, run)
        return codes[:s].clone(), frame_rows[:s].clone()
