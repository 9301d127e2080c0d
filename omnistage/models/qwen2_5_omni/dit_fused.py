"""`FusedDiT`: one evaluation of Qwen2.5-Omni's code2wav DiT with fewer, larger kernels -- the fast
path of `code2wav_ode.Code2WavODE` (the code2wav stage's engine, in whatever process runs it; the
default on CUDA, stage option `fused_dit`).

In: the ODE's input rows (x and the static conditioning already projected: `h` [rows, frames,
hidden] float32), this evaluation's AdaLN modulation rows (from `Code2WavODE._time_tables`), the
rotary table, and per batch the key masks `masks(valid)` built once from each row's valid frames
[rows, frames] bool. Out: the velocity [rows, frames, mel] float32.

What differs from transformers' `DiTDecoderLayer` (same arithmetic, other kernels):
  * q | k | v is one GEMM: the three weights are concatenated once and the modules' own weights
    become views of the merged one (no second copy; the reference path reads the same numbers).
  * Attention is block-local: a layer with look-back `lb` and look-ahead `la` DiT blocks (24 frames)
    lets a query block see only the keys of blocks [j - lb, j + la], so the frames are cut into
    blocks and each query block attends to its (lb + 1 + la) x 24 keys -- a batch of small dense
    problems for SDPA's fused kernels (efficient / cuDNN on CUDA) instead of the full frames x frames
    score matrix under a boolean mask, which SDPA serves with its slow path. Keys outside a row's
    valid frames are masked as in the reference (`code2wav_ode.block_diff`), and a padded query
    keeps only itself, so every valid frame gets the reference's softmax over the same keys.
  * Each gated residual and the LayerNorm + modulation after it are one `layers/ada_norm.py` step
    (one Triton kernel per step on CUDA; its PyTorch reference on a CPU).
  * Fewer kernels per layer (at 1 row a chunk is launch-bound: 36 evaluations x 22 layers x ~17
    kernels before, 8 now on CUDA), each a flag on the instance so code2wav_bench.py can time it off:
      `complex_rope`: the first head's rotary as a complex multiply in float32 (`rope_table`: the
        rotation e^(i f) per frame, made once per batch), written back in the checkpoint's interleaved
        layout -- one Triton kernel on CUDA (`rope_first_head`), 3 PyTorch kernels elsewhere, instead
        of 7. transformers de-interleaves q and k before a half-split rotation; both layouts hold the
        same pairs, and q . k is the same sum in either (SDPA sums over the head dim), so the
        attention is unchanged (q and k are rounded once, not three times).
      `gelu_gemm` (CUDA): the MLP's first linear with its tanh GELU as the GEMM's epilogue
        (`torch._addmm_activation`; one kernel, no [tokens, 2 x hidden] round trip through memory).
        On a CPU that op computes the erf GELU, so the CPU keeps linear + tanh GELU.
      `aligned_masks`: the key masks' rows stored at a multiple of 16 elements, so SDPA's
        memory-efficient kernel takes them as they are instead of padding a copy in every layer.
      `block_attention` (CUDA): the block-local attention as one Triton kernel reading q, k and v
        straight from the q|k|v GEMM's output, masks from each row's length (`dit_kernels.py`: SDPA's
        flash kernels pad these 24-query problems to 64 x 128 tiles; they were a third of the GPU time).
      `split_input_proj`: the input projection of [x | speaker | codes | cond] split in two: the
        static part's (speaker, codes, cond: the same in all 36 evaluations) once per batch
        (`static_input`), and per evaluation only x's 80 columns, for the conditional rows once (the
        CFG rows share x), added to both halves -- no [rows, frames, 912] concatenation per evaluation.
On a CPU the same code runs with PyTorch's kernels; tests/models/qwen2_5_omni/test_code2wav.py
checks it against the reference path within float32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omnistage.layers.ada_norm import ada_norm
from omnistage.layers.fused import use_triton
from omnistage.models.qwen2_5_omni import dit_kernels


def rope_first_head(qkv: torch.Tensor, rot: torch.Tensor) -> None:
    """Rotates the interleaved pairs of q's and k's first head in place: qkv [rows, frames, 3, heads, d]
    (contiguous), rot [rows, frames, 1, d / 2] complex64 (`FusedDiT.rope_table`). One Triton kernel on
    CUDA (`dit_kernels.py`); elsewhere the complex multiply it computes."""
    if use_triton(qkv) and dit_kernels.served(qkv.shape[-1]):
        dit_kernels.rope_first_head(qkv, rot)
        return
    d = qkv.shape[-1]
    pairs = torch.view_as_complex(qkv[:, :, :2, 0].float().unflatten(-1, (d // 2, 2)))
    qkv[:, :, :2, 0] = torch.view_as_real(pairs * rot).flatten(-2)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _neighbours(x: torch.Tensor, back: int, ahead: int, fill) -> torch.Tensor:
    """x [rows, blocks, B, ...] -> [rows, blocks, (back + 1 + ahead) * B, ...]: per block, the blocks
    j - back .. j + ahead side by side along dim 2 (`fill` past either end)."""
    if back == ahead == 0:
        return x
    pad = x.new_full((x.shape[0], 1, *x.shape[2:]), fill)
    padded = torch.cat([pad] * back + [x] + [pad] * ahead, dim=1)
    blocks = x.shape[1]
    return torch.cat([padded[:, o: o + blocks] for o in range(back + 1 + ahead)], dim=2)


class FusedDiT:
    def __init__(self, dit, dtype: torch.dtype):
        cfg = dit.config
        self.dit = dit                          # Qwen2_5OmniToken2WavDiTModel; attn / ff already in `dtype`
        self.dtype = dtype                      # the attention / MLP linears' dtype
        self.heads, self.head_dim, self.block = cfg.num_attention_heads, cfg.head_dim, cfg.block_size
        self.eps = dit.transformer_blocks[0].ff_norm.eps   # every DiT LayerNorm has transformers' 1e-6
        self.windows = [(int(b.look_backward_block), int(b.look_ahead_block)) for b in dit.transformer_blocks]
        self.qkv = [_merge_qkv(b.attn) for b in dit.transformer_blocks]   # per layer (weight, bias)
        self.complex_rope = True                # first head's rotary as one complex multiply (docstring)
        self.gelu_gemm = True                   # CUDA: GELU as the MLP GEMM's epilogue
        self.aligned_masks = True               # key-mask rows padded to 16 elements in memory
        self.split_input_proj = True            # static input columns projected once per batch
        self.block_attention = True             # CUDA: the block-local attention as one Triton kernel
        self.mel_dim = cfg.mel_dim

    def static_input(self, static: torch.Tensor):
        """What `input` reads each evaluation, from the static conditioning [rows, frames, 832] (CFG
        rows included): its projection with the bias [rows, frames, hidden] (`split_input_proj`),
        else `static` itself."""
        if not self.split_input_proj:
            return static
        proj = self.dit.input_embed.proj
        return F.linear(static, proj.weight[:, self.mel_dim:], proj.bias)

    def input(self, x: torch.Tensor, static, cfg: bool) -> torch.Tensor:
        """The DiT's input projection [rows (x 2 with CFG), frames, hidden] of ODE state x [n, frames, mel]."""
        proj = self.dit.input_embed.proj
        if not self.split_input_proj:
            return proj(torch.cat([torch.cat([x, x]) if cfg else x, static], -1))
        h = F.linear(x, proj.weight[:, : self.mel_dim])
        if not cfg:
            return static + h
        return (static.unflatten(0, (2, -1)) + h).flatten(0, 1)

    def rope_table(self, cos: torch.Tensor, sin: torch.Tensor):
        """The rotary table `velocity` reads, from the DiT's cos / sin [rows, frames, head_dim] float32
        (halves repeated): e^(i f) [rows, frames, 1, head_dim / 2] complex64 (`complex_rope`), else
        (cos, sin) in the linears' dtype as the reference uses them."""
        if self.complex_rope:
            half = cos.shape[-1] // 2
            return torch.complex(cos[..., :half], sin[..., :half])[:, :, None]
        return cos.to(self.dtype), sin.to(self.dtype)

    def masks(self, valid: torch.Tensor) -> dict[tuple[int, int], torch.Tensor]:
        """Per distinct (look-back, look-ahead): the additive key mask [rows * blocks, 1, B, keys] of the
        block-local attention, from each row's valid frames `valid` [rows, frames] (once per batch);
        for `dit_kernels.block_attention` (`block_attention`, CUDA) only "lengths": each row's valid
        frames as int32 [rows]."""
        if self.block_attention and use_triton(valid) and dit_kernels.served(self.head_dim):
            return {"lengths": valid.sum(1, dtype=torch.int32)}
        rows, frames = valid.shape
        nb = -(-frames // self.block)
        valid = F.pad(valid, (0, nb * self.block - frames)).view(rows, nb, self.block)
        out = {}
        for back, ahead in set(self.windows):
            keys = _neighbours(valid, back, ahead, False)                  # [rows, nb, K]
            eye = torch.zeros(self.block, keys.shape[-1], dtype=torch.bool, device=valid.device)
            eye[:, back * self.block: (back + 1) * self.block] = torch.eye(self.block, dtype=torch.bool,
                                                                           device=valid.device)
            keep = torch.where(valid[..., None], keys[:, :, None, :], eye)  # padded query: only itself
            width = keys.shape[-1]
            stored = -(-width // 16) * 16 if self.aligned_masks else width
            bias = torch.zeros(*keep.shape[:-1], stored, dtype=self.dtype, device=valid.device)
            bias = bias[..., :width].masked_fill_(~keep, float("-inf"))
            out[(back, ahead)] = bias.view(rows * nb, 1, self.block, width)
        return out

    def velocity(self, h: torch.Tensor, e: int, layer_mods: list[torch.Tensor], final_mod: torch.Tensor,
                 rope: tuple[torch.Tensor, torch.Tensor], masks: dict) -> torch.Tensor:
        """The DiT after its input projection `h`, at evaluation `e` of the time tables."""
        blocks = self.dit.transformer_blocks
        shift, scale = layer_mods[0][e].chunk(6)[:2]
        _, y = ada_norm(h, shift, scale, self.eps, out_dtype=self.dtype)
        for i, block in enumerate(blocks):
            _, _, gate_msa, shift_mlp, scale_mlp, gate_mlp = layer_mods[i][e].chunk(6)
            attn = self._attention(i, block, y, rope, masks)
            h, y = ada_norm(attn, shift_mlp, scale_mlp, self.eps, residual=h, gate=gate_msa, out_dtype=self.dtype)
            ff = block.ff.ff
            f = ff[3](self._gelu_linear(ff[0], y))
            if i + 1 < len(blocks):
                shift, scale = layer_mods[i + 1][e].chunk(6)[:2]
                h, y = ada_norm(f, shift, scale, self.eps, residual=h, gate=gate_mlp, out_dtype=self.dtype)
            else:
                scale, shift = final_mod[e].chunk(2)
                h, y = ada_norm(f, shift, scale, self.eps, residual=h, gate=gate_mlp, out_dtype=torch.float32)
        return self.dit.proj_out(y)

    def _gelu_linear(self, linear, y: torch.Tensor) -> torch.Tensor:
        """tanh-GELU(linear(y)): one GEMM with the GELU epilogue on CUDA (`gelu_gemm`)."""
        if self.gelu_gemm and y.is_cuda:
            out = torch._addmm_activation(linear.bias, y.reshape(-1, y.shape[-1]), linear.weight.t(), use_gelu=True)
            return out.view(*y.shape[:-1], -1)
        return F.gelu(linear(y), approximate="tanh")

    def _attention(self, i: int, block, y: torch.Tensor, rope, masks: dict) -> torch.Tensor:
        rows, frames, _ = y.shape
        heads, d, size = self.heads, self.head_dim, self.block
        qkv = F.linear(y, *self.qkv[i]).view(rows, frames, 3, heads, d)
        # only q's and k's first head is rotated (as the checkpoint was trained), in place in the GEMM's output
        if self.complex_rope:                   # the interleaved pairs rotated where they are (docstring)
            rope_first_head(qkv, rope)
        else:                                   # the de-interleaved layout, as transformers
            cos, sin = rope
            qkv[:, :, :2, 0] = _rotate(_deinterleave(qkv[:, :, :2, 0]), cos[:, :, None], sin[:, :, None])
        back, ahead = self.windows[i]
        if "lengths" in masks:                  # one Triton kernel, straight from the GEMM's output
            return block.attn.to_out[0](dit_kernels.block_attention(qkv, masks["lengths"], back, ahead, size))
        q, k, v = qkv.unbind(2)
        nb = -(-frames // size)
        pad = nb * size - frames
        if pad:
            q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        q = q.reshape(rows * nb, size, heads, d).transpose(1, 2)
        k, v = (_neighbours(t.reshape(rows, nb, size, heads, d), back, ahead, 0.0)
                .reshape(rows * nb, -1, heads, d).transpose(1, 2) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=masks[(back, ahead)])
        out = out.transpose(1, 2).reshape(rows, nb * size, heads * d)[:, :frames]
        return block.attn.to_out[0](out)


def _merge_qkv(attn) -> tuple[torch.Tensor, torch.Tensor]:
    """One [3 x inner, hidden] weight (and bias) for q | k | v; the modules' parameters become views of it."""
    weight = torch.cat([attn.to_q.weight, attn.to_k.weight, attn.to_v.weight]).detach()
    bias = torch.cat([attn.to_q.bias, attn.to_k.bias, attn.to_v.bias]).detach()
    inner = attn.to_q.weight.shape[0]
    for j, lin in enumerate((attn.to_q, attn.to_k, attn.to_v)):
        lin.weight = torch.nn.Parameter(weight[j * inner: (j + 1) * inner], requires_grad=False)
        lin.bias = torch.nn.Parameter(bias[j * inner: (j + 1) * inner], requires_grad=False)
    return weight, bias
