"""BigVGAN's anti-aliased SnakeBeta activation as one Triton kernel -- the fast path of
`token2wav.DeviceVocoder` (the code2wav stage's engine, in whatever process runs it; stage option
`fused_vocoder`, default on CUDA: H200, code2wav_bench.py --only vocoder, BigVGAN 1.9x faster).

In: a transformers `Qwen2_5OmniAntiAliasedActivation1d` (2x upsampling by a 12-tap kaiser-sinc
transposed conv, SnakeBeta, 2x downsampling by a 12-tap conv, both with replicate padding) and its
input x [batch, channels, T] (float32, or bf16 under the vocoder's autocast). Out: its output
[batch, channels, T] in x's dtype.

transformers runs it as ~12 kernels, 8 of them passes over the 2T-long upsampled tensor (pad,
depthwise conv_transpose, x ratio, slice, x * alpha, sin, pow, x 1 / beta, add, pad, depthwise conv);
BigVGAN calls it 109 times per forward (6 per AMP block, 3 blocks per upsampling stage, 6 stages, and
once at the end), so the vocoder is bound by that memory traffic, not by its dense convolutions.
Here one program computes a block of outputs of one (batch, channel) row: for each of the 12 down
taps the upsampled sample it reads (6 up taps over x, indices clamped: the replicate padding),
SnakeBeta of it, and the weighted sum -- x is read once from memory (the taps hit cache) and the
output written once; every step in float32 (the reference rounds to bf16 between its steps under
autocast). `alpha` / `beta` are stored as logs in the checkpoint; exp(alpha) and 1 / (exp(beta) + 1e-9)
are made once per module (`prepare`). Elsewhere (no CUDA / Triton) `activation` is the module itself;
tests/models/qwen2_5_omni/test_code2wav_kernels.py checks the kernel against it under Triton's interpreter.
"""

from __future__ import annotations

import torch

from omnistage.layers.fused import use_triton
from omnistage.layers.triton_fused import triton

TAPS = 12                                       # the up and down filters' length (transformers' default)
BLOCK = 256                                     # outputs per program
# which kernel: False = per output, 72 x loads and 12 SnakeBetas from cache; True = tiled, x read once
# into a [128, 16] tile of shifts and the 12 upsampled samples as one small GEMM (code2wav_bench times both)
TILED = False

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _snake_aa_kernel(x_ptr, out_ptr, alpha_ptr, inv_beta_ptr, up_ptr, down_ptr, T, C,
                         BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)     # batch * channels + channel
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        keep = t < T
        alpha = tl.load(alpha_ptr + row % C)
        inv_beta = tl.load(inv_beta_ptr + row % C)
        x_row = x_ptr + row * T
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in tl.static_range(12):
            # down tap k reads upsampled sample n = 2t + k - 5 (replicate padding: clamped to [0, 2T))
            n = tl.minimum(tl.maximum(2 * t + k - 5, 0), 2 * T - 1)
            full = n + 15                       # its index in conv_transpose's output before the slice
            odd = (full % 2) == 1               # k's parity, but where the clamp moved n
            u = tl.zeros([BLOCK], dtype=tl.float32)
            for i in tl.static_range(6):
                # the up taps that land on `full`: 2i + parity (scalar loads, a select per sample)
                weight = tl.where(odd, tl.load(up_ptr + 2 * i + 1), tl.load(up_ptr + 2 * i))
                src = tl.minimum(tl.maximum((full - odd.to(tl.int32)) // 2 - i - 5, 0), T - 1)   # replicate-padded x
                u += weight * tl.load(x_row + src, mask=keep, other=0.0).to(tl.float32)
            u = 2.0 * u                         # the upsampler's ratio
            s = tl.sin(u * alpha)
            acc += tl.load(down_ptr + k) * (u + inv_beta * (s * s))
        tl.store(out_ptr + row * T + t, acc.to(out_ptr.dtype.element_ty), mask=keep)

    @triton.jit
    def _snake_aa_tiled_kernel(x_ptr, out_ptr, alpha_ptr, inv_beta_ptr, w_ptr, down_ptr, T, C,
                               BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        keep = t < T
        c = tl.arange(0, 16)
        alpha = tl.load(alpha_ptr + row % C)
        inv_beta = tl.load(inv_beta_ptr + row % C)
        # x[t - 5 .. t + 10] (replicate padding: clamped), read once; column c - 5 is the shift
        src = tl.minimum(tl.maximum(t[:, None] + c[None, :] - 5, 0), T - 1)
        xs = tl.load(x_ptr + row * T + src, mask=keep[:, None], other=0.0).to(tl.float32)
        # u at n = 2t + k - 5 for the 12 down taps k: one small GEMM with the up filter's polyphase matrix
        u = tl.dot(xs, tl.load(w_ptr + c[:, None] + c[None, :] * 16), input_precision="tf32x3")
        s = tl.sin(u * alpha)
        s = u + inv_beta * (s * s)
        # replicate padding of the upsampled signal: n < 0 reads n = 0 (tap 5 - 2t of the same t),
        # n >= 2T reads n = 2T - 1 (tap 2T + 4 - 2t)
        n = 2 * t[:, None] + c[None, :] - 5
        first = tl.sum(tl.where(c[None, :] == (5 - 2 * t)[:, None], s, 0.0), axis=1)
        last = tl.sum(tl.where(c[None, :] == (2 * T + 4 - 2 * t)[:, None], s, 0.0), axis=1)
        s = tl.where(n < 0, first[:, None], tl.where(n > 2 * T - 1, last[:, None], s))
        acc = tl.sum(s * tl.load(down_ptr + c)[None, :], axis=1)
        tl.store(out_ptr + row * T + t, acc.to(out_ptr.dtype.element_ty), mask=keep)


def prepare(act) -> tuple[torch.Tensor, ...] | None:
    """(exp(alpha), 1 / (exp(beta) + eps), up filter, down filter), float32 on the module's device, for a
    module of the shape the kernel serves (2x up / down, 12 taps, SnakeBeta); None for any other."""
    up, down, snake = act.upsample, act.downsample, act.act
    if (up.ratio, up.kernel_size, down.stride, down.kernel_size) != (2, TAPS, 2, TAPS) \
            or not hasattr(snake, "beta"):
        return None
    up_taps, down_taps = up.filter.detach().float().reshape(-1), down.filter.detach().float().reshape(-1)
    # the tiled kernel's tables: poly[k, c] weighs x[t + c - 5] in the upsampled sample n = 2t + k - 5
    # (up tap k % 2 + 2i lands on it from x[t + k // 2 - i]; the ratio 2 folded in), down taps padded to 16
    poly = torch.zeros(16, 16, device=up_taps.device)
    for k in range(TAPS):
        for i in range(TAPS // 2):
            poly[k, k // 2 - i + 5] = 2 * up_taps[k % 2 + 2 * i]
    return (snake.alpha.detach().float().exp(), 1.0 / (snake.beta.detach().float().exp() + snake.no_div_by_zero),
            up_taps.contiguous(), down_taps.contiguous(), poly, torch.nn.functional.pad(down_taps, (0, 16 - TAPS)))


def activation(act, tables, x: torch.Tensor) -> torch.Tensor:
    """`act(x)`: one Triton kernel on CUDA when `tables` (from `prepare`), else the module itself."""
    if tables is None or not use_triton(x):
        return act(x)
    return snake_aa(x, *tables)


def snake_aa(x: torch.Tensor, alpha: torch.Tensor, inv_beta: torch.Tensor, up: torch.Tensor,
             down: torch.Tensor, poly: torch.Tensor, down16: torch.Tensor) -> torch.Tensor:
    """The kernel on x [batch, channels, T] with `prepare`'s tables (`TILED`: the tiled one)."""
    x = x.contiguous()
    batch, channels, length = x.shape
    out = torch.empty_like(x)
    if TILED:
        grid = (batch * channels, triton.cdiv(length, 128))
        _snake_aa_tiled_kernel[grid](x, out, alpha, inv_beta, poly, down16, length, channels, BLOCK=128)
    else:
        grid = (batch * channels, triton.cdiv(length, BLOCK))
        _snake_aa_kernel[grid](x, out, alpha, inv_beta, up, down, length, channels, BLOCK=BLOCK)
    return out
