"""The runner's step inputs (ar/step_inputs.py, runner.prepare, cuda_graphs.pack_inputs) on CPU, against
the per-token construction they replace, through chunked prefill, prefix hits, preemption, finished
sequences' rows reused, multimodal-rope conditioning and the CUDA-graph path (its static buffers as
CPU tensors). The device copy of the block tables is simulated by a separate CPU tensor, so the
diff updates a CUDA run relies on are checked here too."""

import numpy as np
import torch

from omnistage.ar.conditioning import Conditioning
from omnistage.ar.cuda_graphs import CudaGraphs, capture_sizes
from omnistage.ar.engine import AREngine
from omnistage.ar.step_inputs import Staging
from omnistage.config import EngineConfig
from omnistage.models.loader import load_causal_lm
from omnistage.params import SamplingParams

BS, MAX_LEN = 4, 60                          # 15 blocks: the table rows are wider (16, aligned)


def reference(order):
    """Per token, as the runner built its inputs before: ids, slots, rope positions (1-D, or 3 rows)."""
    ids, slots, rope, threes = [], [], [], []
    for s in order:
        seq, a, b = s.seq, s.start, s.start + s.num_new_tokens
        for p in range(a, b):
            ids.append(seq.token_ids[p])
            slots.append(seq.block_table[p // BS] * BS + p % BS)
        one, three = (list(range(a, b)), None) if seq.cond is None else seq.cond.positions(a, b)
        rope += one
        threes.append((one, three))
    if any(t is not None for _, t in threes):
        rope = [sum(((t[r] if t is not None else one) for one, t in threes), []) for r in range(3)]
    return ids, slots, rope


def padded_tables(seqs, width):
    return [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]


def fake_graphs(runner, max_batch):
    """CudaGraphs' buffers without a capture (CPU tensors): prepare's graph path runs as on CUDA."""
    g = CudaGraphs.__new__(CudaGraphs)
    g.sizes, g.max_blocks, g.scratch_slot, g.block_size = capture_sizes(max_batch), -(-MAX_LEN // BS), runner.scratch_slot, BS
    g.n = g.sizes[-1]
    g.inputs = torch.zeros(4, g.n, dtype=torch.long)
    g.ids, g.pos, g.slots, g.ctx = g.inputs
    g.tables = torch.zeros(g.n, g.max_blocks, dtype=torch.long)
    return g


def test_prepare_matches_per_token_construction(tiny_models):
    eng = AREngine(tiny_models["qwen2"], EngineConfig(device="cpu", dtype="float32", block_size=BS, num_kv_blocks=18,
                                                      max_num_batched_tokens=12, max_num_seqs=6, max_model_len=MAX_LEN),
                   loader=load_causal_lm)
    runner, sched_ = eng.runner, eng.scheduler
    rows = runner.rows
    rows.set_width(-(-MAX_LEN // BS))
    rows.cuda, rows.dev = True, rows._to_dev(rows.host)        # a separate "device" copy, updated by diffs
    graphs = fake_graphs(runner, 8)
    shared = list(range(20, 32))
    for i in range(10):
        prompt = shared + list(range(40 + i, 43 + 2 * i))
        eng.add_request(str(i), {"prompt_token_ids": prompt}, SamplingParams(max_tokens=6 + i % 4, ignore_eos=True))
    seq3 = eng.requests["3"].seqs[0]
    p = seq3.prompt_len
    seq3.cond = Conditioning(p, mrope_positions=torch.stack([torch.arange(p), torch.arange(p) // 2, torch.arange(p) % 3]),
                             position_delta=-4)
    seen = {"graph": 0, "eager_decodes": 0, "prefill": 0, "preempted": 0, "mrope": 0}
    step = 0
    while sched_.has_unfinished():
        sched = sched_.schedule()
        seen["preempted"] += len(sched.preempted)
        runner.graphs = graphs if step % 2 else None
        st = runner.prepare(sched, eng.eos_ids)
        order = st.order
        ids, slots, rope = reference(order)
        decodes = [s.seq for s in order if s.num_new_tokens == 1 and s.start > 0]
        d = len(decodes)
        assert torch.equal(rows.dev, torch.from_numpy(rows.host))
        if st.meta.graph_batch:
            seen["graph"] += 1
            b = st.meta.graph_batch
            assert b == graphs.size_for(d) and st.ids.shape[0] == b
            expect = np.array([ids + [0] * (b - d), rope + [0] * (b - d), slots + [runner.scratch_slot] * (b - d),
                               [s.start + 1 for s in order] + [1] * (b - d)])
            assert np.array_equal(graphs.inputs[:, :b].numpy(), expect)       # context = cache positions + 1
            assert graphs.tables[:b].tolist() == padded_tables(decodes, graphs.max_blocks) + [[0] * graphs.max_blocks] * (b - d)
        else:
            assert st.ids.tolist() == ids and st.meta.slot_mapping.tolist() == slots and st.pos.tolist() == rope
            seen["mrope"] += st.pos.ndim == 2
            if d:
                seen["eager_decodes"] += 1
                width = max(len(q.block_table) for q in decodes)
                assert st.meta.decode_block_tables.tolist() == padded_tables(decodes, width)
                assert st.meta.decode_ctx_lens.tolist() == [s.start + 1 for s in order[:d]]
            for s, chunk in zip(order[d:], st.meta.prefills):
                seen["prefill"] += 1
                ctx = s.start + s.num_new_tokens
                assert (chunk.q_len, chunk.ctx_len) == (s.num_new_tokens, ctx)
                assert chunk.block_table.tolist() == s.seq.block_table[:-(-ctx // BS)]
        hidden_rows = list(range(len(st.sampling))) if st.hidden_rows is None else st.hidden_rows.tolist()
        rows_ref, row = [], 0
        for s in order:
            row += s.num_new_tokens
            if s.samples:
                rows_ref.append(row - 1)
        assert hidden_rows == rows_ref and [q.seq_id for q in st.sampling] == [s.seq.seq_id for s in order if s.samples]
        sched_.update(sched, {q.seq_id: 100 + step for q in st.sampling})
        for q in st.sampling:
            if q.num_output_tokens >= q.params.max_tokens:
                sched_.finish(q, "length")
                runner.release(q.seq_id)
        step += 1
    assert all(seen.values()), seen
    assert eng.block_manager.prefix_hits > 0


def test_staging_packs_parts_aligned_and_gives_views_back():
    st = Staging(torch.device("cpu"), capacity=8)
    a = np.arange(5, dtype=np.int64)
    f = np.array([[0.5, 1.5, -2.0], [3.25, 4.0, 1e-3]], np.float32)
    st.add("a", a)
    st.add("f", f)
    st.add("m", np.arange(6, dtype=np.int64).reshape(2, 3))
    v = st.send()                           # grows past its capacity
    assert v["a"].tolist() == a.tolist() and v["f"].dtype == torch.float32 and v["f"].numpy().tolist() == f.tolist()
    assert v["m"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert all(t.data_ptr() % 64 == v["a"].data_ptr() % 64 for t in v.values())
