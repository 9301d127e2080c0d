"""GPU correctness checks of the CUDA fast paths (run on the GPU machine before benchmarks).

- Triton paged-decode attention equals the SDPA reference path (fp32 and bf16, GQA, ragged contexts).
- Every kernel of layers.fused / triton_prefill / triton_attention (the decode entry with the q/k norms,
  rotary and KV write folded in too) equals its PyTorch reference (`layers.kernel_check`, fp32 and bf16,
  7B-sized shapes too): max abs error beside the reference's largest value.
- Greedy bf16 ids of a 7B-shaped random Qwen2 (4 prompts, 128 new tokens): the served path (fused
  kernels, CUDA graphs) and the unfused path with graphs, each against the eager PyTorch reference
  path (no Triton at all); first divergence per prompt.
- Greedy ids with CUDA graphs on equal those with graphs off and those on the CPU (tiny fp32 model).
- Greedy ids with prefill CUDA graphs equal those without and the CPU's (tiny Llama, Qwen3, Qwen3-Omni thinker).
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

from omnistage.layers import fused, kernel_check, triton_attention
from omnistage.layers.attention import AttentionMetadata, paged_attention

QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, max_position_embeddings=4096, tie_word_embeddings=False,
                 rms_norm_eps=1e-6)


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


def check_kernels() -> bool:
    ok = True
    for name, (err, peak) in kernel_check.kernel_errors("cuda", big=True).items():
        good = err <= kernel_check.limit(name) * peak
        print(f"kernel {name}: max abs err {err:.2e} (reference peak {peak:.2f}){'' if good else '  FAIL'}")
        ok &= good
    return ok


def random_native_lm(shape: dict, max_positions: int):
    """omnistage's Qwen2 with random bf16 weights (`models/dummy.init_dummy_`: N(0, 0.02), biases 0, norms 1)
    built on the GPU, no checkpoint."""
    from transformers import Qwen2Config

    from omnistage.models.dummy import init_dummy_
    from omnistage.models.llama import Qwen2ForCausalLM

    cfg = Qwen2Config(**shape)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg, max_positions).to(torch.bfloat16)
    model = model.to_empty(device="cuda")
    init_dummy_(model)
    model.rotary.build(torch.device("cuda"))
    return model.eval(), cfg


def _greedy(model, cfg, prompts: list[list[int]], new: int, graphs: bool) -> list[list[int]]:
    from omnistage.ar.engine import AREngine
    from omnistage.config import EngineConfig
    from omnistage.params import SamplingParams
    from omnistage.testing.llm import make_tokenizer

    tok = make_tokenizer()
    eng = AREngine(tempfile.mkdtemp(), EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=8, num_kv_blocks=256,
                                                    max_model_len=1024, cuda_graphs=graphs),
                   loader=lambda *a: (model, cfg, tok, frozenset()))
    sp = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), {"prompt_token_ids": p}, sp)
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o.output.outputs[0].token_ids for o in eng.step() if o.finished})
    del eng
    torch.cuda.empty_cache()
    return [done[str(i)] for i in range(len(prompts))]


def check_7b_greedy() -> dict:
    """First divergence (index of the first differing new token, None: none in 128) per prompt."""
    model, cfg = random_native_lm(QWEN25_7B, 1024)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, cfg.vocab_size - 100, (n,), generator=g).tolist() for n in (17, 64, 128, 300)]
    saved = triton_attention.triton
    fused.ENABLED, triton_attention.triton = False, None
    try:
        ref = _greedy(model, cfg, prompts, 128, graphs=False)             # the PyTorch reference path
    finally:
        triton_attention.triton = saved
    unfused = _greedy(model, cfg, prompts, 128, graphs=True)             # the path before the fused kernels
    fused.ENABLED = True
    served = _greedy(model, cfg, prompts, 128, graphs=True)

    def first_diff(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)

    res = {"fused+graphs": [first_diff(a, b) for a, b in zip(served, ref)],
           "unfused+graphs": [first_diff(a, b) for a, b in zip(unfused, ref)],
           "distinct ids in reference": [len(set(r)) for r in ref]}
    del model
    torch.cuda.empty_cache()
    return res


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
        # Async scheduling on the device: seeded sampling and stop strings equal the synchronous loop.
        sampled = [SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=i, stop=["e"] if i % 3 else None)
                   for i in range(len(texts))]
        runs = []
        for async_on in (True, False):
            with Omni(path, device="cuda", dtype="float32", async_scheduling=async_on, max_num_seqs=16) as omni:
                runs.append([o.outputs[0].token_ids for o in omni.generate(texts, sampled, use_tqdm=False)])
        print(f"{arch}: seeded sampling, async scheduling == synchronous (cuda graphs): {runs[0] == runs[1]}")
        ok &= runs[0] == runs[1]
    return ok


def check_prefill_graphs() -> bool:
    """Greedy ids with prefill CUDA graphs (ar/prefill_graphs.py) equal those without and the CPU's (tiny fp32
    Llama / Qwen3 and the tiny Qwen3-Omni thinker: Triton MoE inside the graphs): prompts of 3..200 tokens one
    by one (one chunk, buckets 16..256), three together (three chunks), a long one chunked (cached context)."""
    from omnistage.ar.engine import AREngine
    from omnistage.config import EngineConfig
    from omnistage.models.loader import load_causal_lm
    from omnistage.models.qwen3_omni.thinker import load_thinker
    from omnistage.params import SamplingParams
    from omnistage.testing.llm import make_tiny_lm
    from omnistage.testing.qwen3_omni import make_tiny_qwen3_omni

    ok = True
    g = torch.Generator().manual_seed(3)
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    models = {arch: (make_tiny_lm(os.path.join(tempfile.mkdtemp(), arch), arch), load_causal_lm)
              for arch in ("llama", "qwen3")}
    models["qwen3_omni thinker"] = (make_tiny_qwen3_omni(os.path.join(tempfile.mkdtemp(), "q3")), load_thinker)
    for name, (path, loader) in models.items():
        groups = [[torch.randint(3, 200, (n,), generator=g).tolist()] for n in (3, 16, 17, 100, 200)]
        groups.append([torch.randint(3, 200, (n,), generator=g).tolist() for n in (5, 40, 70)])
        groups.append([torch.randint(3, 200, (300,), generator=g).tolist()])   # 256 rows, then 44 after them
        res, replays = [], 0
        for device, prefill in (("cpu", False), ("cuda", False), ("cuda", True)):
            eng = AREngine(path, EngineConfig(device=device, dtype="float32", prefill_cuda_graphs=prefill,
                                              max_num_seqs=16, max_num_batched_tokens=256), loader=loader)
            got = []
            for ps in groups:
                for i, p in enumerate(ps):
                    eng.add_request(f"{len(got)}-{i}", {"prompt_token_ids": p}, sp)
                done = {}
                while eng.has_unfinished():
                    done.update({o.request_id: o.output.outputs[0].token_ids for o in eng.step() if o.finished})
                got.append([done[f"{len(got)}-{i}"] for i in range(len(ps))])
            res.append(got)
            if prefill:
                replays = eng.runner.prefill_graphs.replays
            del eng
            torch.cuda.empty_cache()
        same = res[0] == res[1] == res[2] and replays >= len(groups)
        print(f"{name}: greedy with prefill graphs ({replays} replays) == without == cpu: {same}")
        ok &= same
    return ok


def check_code2wav_graphs() -> float:
    from omnistage.codec.engine import CodecEngine
    from omnistage.models.qwen2_5_omni.code2wav import Code2Wav, Code2WavParams
    from omnistage.testing.qwen2_5_omni import VOICES, make_tiny_qwen2_5_omni

    path = make_tiny_qwen2_5_omni(os.path.join(tempfile.mkdtemp(), "omni"))
    audio = {}
    for graphs in (False, True):                            # plain fp32 (tf32=False): graphs and eager runs alike
        engine = CodecEngine(Code2Wav(path, device="cuda", chunk_codes=24, first_chunk_codes=12, cuda_graphs=graphs,
                                      tf32=False))
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
        engine = CodecEngine(Code2Wav(path, device="cuda", **{**CODE2WAV_OPTIONS, "tf32": tf32}))
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
    ar_only = "--ar-only" in sys.argv                 # the AR checks alone (kernels, greedy ids)
    args = [a for a in sys.argv[1:] if a not in ("--ar-only", "--code2wav-only")]
    if "--code2wav-only" in sys.argv:                 # code2wav's checks alone (graphs vs eager, TF32 change)
        if args:
            print(f"code2wav TF32 vs fp32 (7B-shape token2wav): max abs diff / peak {check_code2wav_tf32(args[0]):.2e}")
        c2w = check_code2wav_graphs()
        print(f"code2wav: CUDA-graph chunked decode vs eager: max abs diff {c2w:.2e}")
        sys.exit(0 if c2w < 1e-3 else 1)
    kernels_ok = check_kernels()
    err = check_triton()
    print(f"triton paged decode vs SDPA reference: max abs diff {err:.2e}")
    print(f"7B-shape bf16 greedy, 4 prompts x 128 new tokens, first divergence from the eager reference: "
          f"{check_7b_greedy()}")
    if ar_only:
        sys.exit(0 if check_greedy() and check_prefill_graphs() and kernels_ok and err < 2e-2 else 1)
    if args:                                 # a 7B-shape omni folder (omni_bench.py): the TF32 change
        print(f"code2wav TF32 vs fp32 (7B-shape token2wav, 6 s): max abs diff / peak {check_code2wav_tf32(args[0]):.2e}")
    c2w = check_code2wav_graphs()
    print(f"code2wav: CUDA-graph chunked decode vs eager: max abs diff {c2w:.2e}")
    ok = check_wire() and check_greedy() and check_prefill_graphs() and kernels_ok and err < 2e-2 and c2w < 1e-3
    sys.exit(0 if ok else 1)
