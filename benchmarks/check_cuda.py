"""GPU correctness checks of the CUDA fast paths (run on the GPU machine before benchmarks).

- Triton paged-decode attention equals the SDPA reference path (fp32 and bf16, GQA, ragged contexts).
- Greedy ids with CUDA graphs on equal those with graphs off and those on the CPU (tiny fp32 model).
- code2wav's chunked decode replayed from CUDA graphs equals the eager decode (tiny Qwen2.5-Omni,
  fp32, 3 batched requests of different lengths, padded to a captured batch size).
- `pipeline.wire` between two processes: CUDA tensors (IPC for large ones, staged through host memory
  for small ones, bfloat16 included) arrive equal, on their device, both ways.
"""

import multiprocessing as mp
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
    from omnistage.testing.llm import make_tiny_lm

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


def check_code2wav_graphs() -> float:
    from omnistage.codec.engine import CodecEngine
    from omnistage.models.qwen2_5_omni.code2wav import Code2Wav, Code2WavParams
    from omnistage.testing.qwen2_5_omni import VOICES, make_tiny_qwen2_5_omni

    path = make_tiny_qwen2_5_omni(os.path.join(tempfile.mkdtemp(), "omni"))
    audio = {}
    torch.backends.cuda.matmul.allow_tf32 = False           # plain fp32: graphs and eager runs alike
    for graphs in (False, True):
        engine = CodecEngine(Code2Wav(path, device="cuda", chunk_codes=24, first_chunk_codes=12, cuda_graphs=graphs))
        for i, n in enumerate((150, 97, 200)):
            codes = torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(i)).tolist()
            engine.add_request(f"r{i}", codes, Code2WavParams(voice=VOICES[i % len(VOICES)], seed=i))
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o.output.audio.samples for o in engine.step() if o.finished})
        audio[graphs] = done
        if graphs:
            graph_cache = engine.model.ode.graphs
            print(f"code2wav graphs: {graph_cache.captures} captured, {graph_cache.replays} replays")
    return max(float(abs(audio[True][k] - audio[False][k]).max()) for k in audio[False])


def check_code2wav_tf32(path: str) -> float:
    """Waveform change from TF32 DiT matmuls (the GPU default) vs plain fp32, 7B-shape token2wav:
    max abs difference relative to the fp32 waveform's peak, for 3 requests (random codes, seeded)."""
    from omnistage.codec.engine import CodecEngine
    from omnistage.models.qwen2_5_omni.code2wav import Code2Wav, Code2WavParams
    from omnistage.models.qwen2_5_omni.pipeline import CODE2WAV_OPTIONS

    audio = {}
    for tf32 in (False, True):
        torch.backends.cuda.matmul.allow_tf32 = tf32        # the process's setting, before the graphs are captured
        engine = CodecEngine(Code2Wav(path, device="cuda", **CODE2WAV_OPTIONS))
        for i in range(3):
            codes = torch.randint(0, 8000, (300,), generator=torch.Generator().manual_seed(i)).tolist()
            engine.add_request(f"r{i}", codes, Code2WavParams(seed=i))
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o.output.audio.samples for o in engine.step() if o.finished})
        audio[tf32] = done
        del engine
    return max(float(abs(audio[True][k] - audio[False][k]).max() / abs(audio[False][k]).max()) for k in audio[False])


def _wire_tensors(seed: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {"big": torch.randn(1024, 3584, device="cuda", generator=g).to(torch.bfloat16),   # 7 MB: IPC
            "rows": [torch.randn(2, 3584, device="cuda", generator=g).to(torch.bfloat16) for _ in range(4)],
            "ids": torch.arange(10, device="cuda"), "host": torch.ones(3)}


def _wire_child(conn) -> None:
    from omnistage.pipeline import wire

    conn.send_bytes(wire.encode(_wire_tensors(1)))          # child -> parent
    got = wire.decode(conn.recv_bytes())                    # parent -> child, checked here
    conn.send(all(torch.equal(a, b) for a, b in zip(_flat(got), _flat(_wire_tensors(2)))))
    conn.recv()                                             # the parent is done with our memory


def _flat(d: dict) -> list:
    return [d["big"], *d["rows"], d["ids"], d["host"]]


def check_wire() -> bool:
    from omnistage.pipeline import wire

    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_wire_child, args=(child,))
    proc.start()
    got = wire.decode(parent.recv_bytes())
    want = _wire_tensors(1)
    ok = all(torch.equal(a, b) and a.device == b.device and a.dtype == b.dtype for a, b in zip(_flat(got), _flat(want)))
    parent.send_bytes(wire.encode(_wire_tensors(2)))
    ok &= parent.recv()
    parent.send(True)
    proc.join(30)
    print(f"wire: CUDA tensors (IPC and staged, bf16) equal both ways between processes: {ok}")
    return ok


if __name__ == "__main__":
    err = check_triton()
    print(f"triton paged decode vs SDPA reference: max abs diff {err:.2e}")
    if len(sys.argv) > 1:                    # a 7B-shape omni folder (omni_bench.py): the TF32 change
        print(f"code2wav TF32 vs fp32 (7B-shape token2wav, 6 s): max abs diff / peak {check_code2wav_tf32(sys.argv[1]):.2e}")
    c2w = check_code2wav_graphs()
    print(f"code2wav: CUDA-graph chunked decode vs eager: max abs diff {c2w:.2e}")
    ok = check_wire() and check_greedy() and err < 2e-2 and c2w < 1e-3
    sys.exit(0 if ok else 1)
