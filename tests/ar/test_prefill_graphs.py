"""Prefill CUDA graphs' padded static-buffer forward (`ar/prefill_graphs.py`), run eagerly on the CPU: the
function a graph captures, over the same buffers, equals the unpadded eager prefill step.

Each engine step the runner would serve from a prefill graph runs first the eager way (graphs off) and
then through `PrefillGraphs` (capture=False: `_step` over the padded buffers), before the engine's own
launch of it (graphs on): the sampled rows' logits and greedy ids, the real rows' last hidden states
and reported rows must agree. The mixes: one chunk, three chunks, a prefix-cache hit (cached context),
the second part of a chunked prefill, a step exactly one bucket long; for the tiny Llama / Qwen2 / Qwen3,
the Qwen3-Omni thinker (MoE, interleaved M-RoPE, a reported layer) and the Qwen2.5-Omni thinker
(M-RoPE prompts with [3, P] positions and prompt embeddings, hidden states reported). The engines'
greedy ids with the graphs equal transformers' (llm) or the same engine's without them (thinkers).
"""

import numpy as np
import pytest
import torch

from omnistage.ar.engine import AREngine
from omnistage.ar.prefill_graphs import token_buckets
from omnistage.ar.runner import logit_rows, split_outputs
from omnistage.ar.sampler import greedy_ids
from omnistage.config import EngineConfig
from omnistage.layers import triton_prefill
from omnistage.params import SamplingParams
from omnistage.stage import ARPrompt

MAX_TOKENS = 32                                 # the largest bucket: buckets 16, 32


pytestmark = pytest.mark.usefixtures("single_thread")


class Checked:
    """Wraps `runner.launch`: a step the prefill graphs take runs eager and padded first and is compared."""

    def __init__(self, engine: AREngine):
        self.runner = engine.runner
        self.runner.prefill_graphs = self.runner.make_prefill_graphs(MAX_TOKENS, engine.config.max_num_seqs,
                                                                     engine.max_model_len, capture=False)
        self.launch = self.runner.launch
        self.runner.launch = self
        self.kinds: list[tuple[int, bool, bool]] = []   # per graphed step: (chunks, any cached context, padded)

    def __call__(self, sched, eos_ids, prev=None):
        graphs = self.runner.prefill_graphs
        self.runner.prefill_graphs = None
        try:
            eager = self._run(sched, prev)
        finally:
            self.runner.prefill_graphs = graphs
        got = self._run(sched, prev)
        if got["bucket"]:
            assert eager["bucket"] == 0
            for key in ("hidden", "reported", "logits"):   # fp32 to rounding: matmuls of other row counts
                assert got[key].shape == eager[key].shape, key
                if eager[key].numel():                      # no logits in a chunked prefill's first part
                    err, peak = (got[key] - eager[key]).abs().max().item(), eager[key].abs().max().item()
                    assert err <= 1e-5 * peak, (key, err, peak)
            assert torch.equal(got["greedy"], eager["greedy"])
            inputs = got["inputs"]
            self.kinds.append((len(inputs.prefills), any(ctx > q for _, q, ctx in inputs.prefills),
                               got["bucket"] > len(inputs.ids)))
        return self.launch(sched, eos_ids, prev)

    @torch.inference_mode()
    def _run(self, sched, prev):
        """The step's forward as `launch` runs it, without sampling: its outputs."""
        r = self.runner
        order, inputs, ids, pos, meta = r.prepare(sched, prev)
        x = None
        if meta.graph_batch or meta.graph_tokens or inputs.embeds:
            x = r.model.embed_tokens(ids)
            r._condition(x, order)
        out, graph = r.forward(ids, pos, meta, x, r._layer_adds(order, x))
        hidden, reported = split_outputs(out)
        rows, n = list(inputs.logit_rows), len(inputs.ids)
        if graph is None:
            logits = r.model.compute_logits(logit_rows(hidden, rows))
            greedy = greedy_ids(logits)
        else:
            assert graph.picked
            logits, greedy = graph.logits[:len(rows)], graph.greedy[:len(rows)]
        return dict(bucket=meta.graph_tokens, inputs=inputs, hidden=hidden[:n].clone(),
                    reported=reported[:n].clone(), logits=logits.clone(), greedy=greedy.clone())


def run(engine: AREngine, prompts, max_tokens: int = 4) -> list[list[int]]:
    """Adds `prompts` together, steps until they finish; their greedy ids."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{len(engine.requests)}-{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.output.outputs[0].token_ids
    return [done[k] for k in sorted(done, key=lambda k: int(k.split("-")[1]))]


def mixes(vocab: int, seed: int = 0) -> list[list]:
    """Rounds of prompts (token ids) that give the runner each kind of prefill step."""
    rng = np.random.RandomState(seed)
    ids = lambda n: rng.randint(3, vocab, n).tolist()   # noqa: E731
    a = ids(20)
    return [[ids(11)],                          # one chunk, bucket 16
            [ids(5), ids(7), ids(9)],           # three chunks, bucket 32
            [a],                                # one chunk, 2 full blocks of 8 cached afterwards
            [a[:16] + ids(6)],                  # a prefix hit: 6 new rows after 16 cached
            [ids(45)]]                          # chunked: 32 rows (no padding), then 13 after 32 cached


def check_kinds(kinds) -> None:
    assert (1, False, True) in kinds and (3, False, True) in kinds   # one and three chunks, padded
    assert (1, True, True) in kinds             # cached context (prefix hit, chunked prefill's second part)
    assert (1, False, False) in kinds           # exactly a bucket long: no padding chunk


def llm_engine(path: str, **kw) -> AREngine:
    from omnistage.models.loader import load_causal_lm

    kw = dict(device="cpu", dtype="float32", block_size=8, max_num_seqs=4, max_num_batched_tokens=MAX_TOKENS) | kw
    return AREngine(path, EngineConfig(**kw), loader=load_causal_lm)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_llm_padded_prefill_equals_eager_and_transformers(arch, tiny_models):
    from transformers import AutoModelForCausalLM

    eng = llm_engine(tiny_models[arch])
    checked = Checked(eng)
    hf = AutoModelForCausalLM.from_pretrained(tiny_models[arch], dtype=torch.float32).eval()
    for prompts in mixes(eng.hf_config.vocab_size):
        outs = run(eng, prompts)
        for p, got in zip(prompts, outs):
            want = hf.generate(torch.tensor([p]), max_new_tokens=4, do_sample=False)[0, len(p):].tolist()
            assert got == want
    check_kinds(checked.kinds)


def test_qwen3_omni_thinker_moe_padded_prefill_equals_eager(tmp_path):
    from omnistage.models.qwen3_omni.thinker import load_thinker
    from omnistage.testing.qwen3_omni import make_tiny_qwen3_omni

    path = make_tiny_qwen3_omni(str(tmp_path / "q3"))
    cfg = dict(device="cpu", dtype="float32", block_size=8, max_num_seqs=4, max_num_batched_tokens=MAX_TOKENS)
    eng = AREngine(path, EngineConfig(**cfg), loader=load_thinker)
    checked = Checked(eng)
    rounds = mixes(eng.hf_config.vocab_size, seed=1)
    # hidden states reported (the talker's layer): rows of a graphed step's reported layer
    rounds.append([ARPrompt(prompt_token_ids=rounds[0][0], return_hidden_states=True)])
    got = [run(eng, prompts) for prompts in rounds]
    check_kinds(checked.kinds)
    # deepstack rows are added inside the forward: such a prompt's steps run eager
    graphed = len(checked.kinds)
    hidden = eng.hf_config.hidden_size
    deep = ARPrompt(prompt_token_ids=rounds[0][0], layer_embeds=0.02 * torch.randn(2, len(rounds[0][0]), hidden))
    rounds.append([deep])
    got.append(run(eng, [deep]))
    assert len(checked.kinds) == graphed
    plain = AREngine(path, EngineConfig(**cfg), loader=load_thinker)
    assert got == [run(plain, prompts) for prompts in rounds]


def test_fits_takes_prefill_only_steps_within_the_buckets(tiny_models):
    from omnistage.ar.prefill_graphs import serves
    from omnistage.ar.step_inputs import StepInputs

    eng = llm_engine(tiny_models["llama"], max_num_seqs=8)
    assert not serves(eng.model, eng.device)               # the PyTorch path (CPU) is never captured
    graphs = eng.runner.make_prefill_graphs(MAX_TOKENS, 3, eng.max_model_len, capture=False)

    def step(chunks: list[int], decodes: int = 0, mrope: bool = False) -> StepInputs:
        n = decodes + sum(chunks)
        rows, at = [], decodes
        for q in chunks:
            rows.append((at, q, q))
            at += q
        pos = [list(range(n))] * 3 if mrope else list(range(n))
        return StepInputs([1] * n, pos, [0] * n, decodes, ["s"] * (decodes + len(chunks)),
                          [[0, 1, 2, 3]] * (decodes + len(chunks)), [1] * decodes, rows, 8, [])

    assert graphs.max_chunks == 3 and graphs.fits(step([5])) and graphs.fits(step([10, 10, 12]))
    assert not graphs.fits(step([5], decodes=1))            # decode rows: eager (or a decode graph)
    assert not graphs.fits(step([33]))                      # past the largest bucket
    assert not graphs.fits(step([2, 2, 2, 2]))              # more chunks than captured
    assert not graphs.fits(step([5], mrope=True))           # [3, T] positions need a multimodal-rope model


def test_qwen2_5_omni_thinker_mrope_padded_prefill_equals_eager(tmp_path):
    from omnistage.models.qwen2_5_omni.stages import load_thinker
    from omnistage.testing.qwen2_5_omni import make_tiny_qwen2_5_omni

    path = make_tiny_qwen2_5_omni(str(tmp_path / "q25"))
    cfg = dict(device="cpu", dtype="float32", block_size=8, max_num_seqs=4, max_num_batched_tokens=MAX_TOKENS)
    eng = AREngine(path, EngineConfig(**cfg), loader=load_thinker)
    checked = Checked(eng)
    assert checked.runner.prefill_graphs.rope_rows == 3
    hidden = eng.hf_config.hidden_size
    rounds = mixes(eng.hf_config.vocab_size, seed=2)
    g = torch.Generator().manual_seed(0)

    def mrope(n: int) -> ARPrompt:             # three distinct position rows and embedding rows fed in
        t = torch.arange(n)
        return ARPrompt(prompt_token_ids=[5] * n, prompt_embeds=0.02 * torch.randn(n, hidden, generator=g),
                        mrope_positions=torch.stack([t, t // 2, t % 3]), mrope_delta=-2,
                        return_hidden_states=True)

    rounds += [[mrope(9)], [mrope(6), mrope(13)], [mrope(40)]]
    got = [run(eng, prompts) for prompts in rounds]
    check_kinds(checked.kinds)
    assert (2, False, True) in checked.kinds    # the two M-RoPE prompts in one step
    plain = AREngine(path, EngineConfig(**cfg), loader=load_thinker)
    assert got == [run(plain, prompts) for prompts in rounds]


def test_static_plan_layout():
    """`fill_static`: chunk slots past the real ones empty, padding tiles past every chunk's rows, the
    tables one after another (what the kernel reads; the kernel itself: layers/kernel_check.py)."""
    bm, slots, tiles = 16, 4, triton_prefill.max_tiles(64, 4, 16)
    buf = np.full(triton_prefill.static_size(slots, tiles, 10), -1, dtype=np.int32)
    used = triton_prefill.fill_static(buf, slots, tiles, bm, [(0, 20, 8), (20, 3, 0), (23, 41, 0)],
                                      [[7, 9], [4], []])
    assert used == 4 * slots + 2 * tiles + 3
    info = buf[:4 * slots + 2 * tiles]
    assert info[:slots].tolist() == [0, 20, 23, 0] and info[slots:2 * slots].tolist() == [20, 3, 41, 0]
    assert info[2 * slots:3 * slots].tolist() == [8, 0, 0, 0] and info[3 * slots:3 * slots + 3].tolist() == [0, 2, 3]
    real = 2 + 1 + 3
    assert info[4 * slots:4 * slots + real].tolist() == [0, 0, 1, 2, 2, 2]
    assert info[4 * slots + tiles:4 * slots + tiles + real].tolist() == [0, 16, 0, 0, 16, 32]
    assert (info[4 * slots + tiles + real:] == triton_prefill.PAD_ROW).all()
    assert buf[4 * slots + 2 * tiles:used].tolist() == [7, 9, 4]
    with pytest.raises(ValueError, match="do not fit"):
        triton_prefill.fill_static(buf, slots, 2, bm, [(0, 40, 0)], [[]])


def test_token_buckets_and_config():
    assert token_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert token_buckets(100) == [16, 32, 64, 100] and token_buckets(8) == [8]
    assert EngineConfig(max_num_batched_tokens=256).prefill_graph_tokens() == 256
    assert EngineConfig(prefill_cuda_graphs=False).prefill_graph_tokens() == 0
    assert EngineConfig(cuda_graphs=False).prefill_graph_tokens() == 0
    with pytest.raises(ValueError, match="max_prefill_graph_tokens must be an integer >= 1"):
        EngineConfig(max_prefill_graph_tokens=0)
    with pytest.raises(ValueError, match="prefill_cuda_graphs must be true or false"):
        EngineConfig(prefill_cuda_graphs="yes")
