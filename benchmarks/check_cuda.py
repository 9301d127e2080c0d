"""GPU correctness checks of the CUDA fast paths (run on the GPU machine before benchmarks).

- Triton paged-decode attention equals the SDPA reference path (fp32 and bf16, GQA, ragged contexts).
- Greedy ids with CUDA graphs on equal those with graphs off and those on the CPU (tiny fp32 model).
"""

import os
import sys
import tempfile

import torch

from omnistage.layers import triton_attention
from omnistage.layers.attention import AttentionMetadata, paged_attention


def check_triton() -> float:
    torch.manual_seed(0)
    worst = 0.0
    for dtype, h, kvh, d, bs in [(torch.float32, 12, 2, 128, 16), (torch.bfloat16, 32, 8, 128, 16),
                                 (torch.float32, 4, 4, 64, 16), (torch.bfloat16, 16, 2, 64, 16)]:
        nb, b = 64, 5   # pool blocks, sequences
        cache = torch.randn(2, nb + 1, bs, kvh, d, device="cuda", dtype=dtype)
        ctx = torch.tensor([1, 7, 16, 33, 600], device="cuda")                # 600: several partitions
        width = -(-int(ctx.max()) // bs)                                  # blocks covering the longest context
        tables = torch.stack([torch.randperm(nb, device="cuda")[:width] for _ in range(b)])
        q = torch.randn(b, h, d, device="cuda", dtype=dtype)
        fast = triton_attention.paged_decode_attention(q, cache, tables, ctx, d ** -0.5)
        # The reference path, with the kernel disabled.
        saved, triton_attention.triton = triton_attention.triton, None
        try:
            kv = torch.zeros(b, kvh, d, device="cuda", dtype=dtype)
            slots = torch.full((b,), nb * bs, device="cuda")          # write to the scratch block
            meta = AttentionMetadata(slot_mapping=slots, num_decodes=b, decode_block_tables=tables, decode_ctx_lens=ctx)
            ref = paged_attention(q, kv, kv, cache, meta, d ** -0.5)
        finally:
            triton_attention.triton = saved
        worst = max(worst, (fast.float() - ref.float()).abs().max().item())
    return worst


def check_greedy() -> bool:
    from omnistage import Omni, SamplingParams
    from omnistage.models.tiny import make_tiny_lm

    ok = True
    for arch in ("llama", "qwen2", "qwen3"):
        path = make_tiny_lm(os.path.join(tempfile.mkdtemp(), arch), arch)
        sp = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        texts = ["Hello world", "The quick brown fox jumps over", "café 日本語"] + [f"prompt {i}" for i in range(9)]
        res = []
        for device, graphs in (("cpu", False), ("cuda", False), ("cuda", True)):
            with Omni(path, device=device, dtype="float32", cuda_graphs=graphs, max_num_seqs=16) as omni:
                res.append([o.outputs[0].token_ids for o in omni.generate(texts, sp, use_tqdm=False)])
        same = res[0] == res[1] == res[2]
        print(f"{arch}: greedy cpu == cuda eager == cuda graphs: {same}")
        ok &= same
    return ok


if __name__ == "__main__":
    err = check_triton()
    print(f"triton paged decode vs SDPA reference: max abs diff {err:.2e}")
    ok = check_greedy() and err < 2e-2
    sys.exit(0 if ok else 1)
