"""One AR engine step on the device: SchedulerOutput -> forward -> sampled ids (stage process).

The runner knows no model names: it needs a model with `attention_layers`, `forward(input_ids,
positions, meta)` and `compute_logits(hidden)`. It owns the KV-cache tensors and what it keeps per
live sequence across steps: a row of block table and sampling parameters (`SeqRows`), penalty token
counts (`TokenCounts`) and a seeded sequence's generator. Every step it builds the flattened inputs
(decodes first, then prefill chunks) with numpy from those rows, uploads them in one copy
(`Staging`), runs one forward over all of them, computes logits only for rows that sample, samples
on the device and moves the sampled ids (plus logprobs when asked for) to the host in one transfer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from omnistage.ar.penalties import TokenCounts
from omnistage.ar.sampler import TOPK_FAST_MAX, SamplerOutput, SamplingInputs, sample
from omnistage.ar.scheduler import ScheduledSeq, SchedulerOutput
from omnistage.ar.sequence import Sequence
from omnistage.ar.step_inputs import (F_FREQ, F_GREEDY, F_MIN_P, F_PRES, F_REP, F_TOP_P, I_BANS, I_LOGPROBS,
                                      I_PENALTY, I_SEEDED, I_TOP_K, SeqRows, Staging)
from omnistage.layers.attention import AttentionMetadata, PrefillChunk
from omnistage.stage import HiddenStates

NO_TOP_K = 1 << 62                              # the full-sort filter's k for rows without top-k


@dataclass
class RunnerOutput:
    sampled: dict[str, int]                     # seq_id -> new token id, for rows that sampled
    logprobs: dict[str, tuple[float, list[tuple[int, float]]]]  # seq_id -> (chosen, [(id, logprob)])
    # seq_id -> the rows computed this step, for sequences that asked for them (device tensors)
    hidden: dict[str, HiddenStates] = field(default_factory=dict)


@dataclass
class _Step:
    """One step's inputs, as `prepare` built them."""
    order: list[ScheduledSeq]                   # batch order: decodes, then prefill chunks
    ids: torch.Tensor                           # [T] long
    pos: torch.Tensor                           # [T] long, or [3, T] with multimodal-rope rows
    meta: AttentionMetadata
    offsets: np.ndarray                         # [len(order)]: first row of each sequence
    conds: list[int]                            # indices into order of sequences with conditioning
    sampling: list[Sequence]                    # sequences that sample, in row order
    hidden_rows: Optional[torch.Tensor] = None  # [S] rows of the hidden states that sample; None: the first S
    sampling_inputs: Optional[SamplingInputs] = None
    penalized: Optional[np.ndarray] = None      # [S] bool, when a sampling row has penalties
    num_logprobs: int = -1
    views: dict = field(default_factory=dict)   # the uploaded device tensors by name


def kv_block_bytes(model, block_size: int, dtype: torch.dtype) -> int:
    attn = model.attention_layers[0]
    elem = torch.empty((), dtype=dtype).element_size()
    return len(model.attention_layers) * 2 * block_size * attn.num_kv_heads * attn.head_dim * elem


class ModelRunner:
    def __init__(self, model, device: torch.device, dtype: torch.dtype, block_size: int, seed: int = 0):
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.kv_caches: list[torch.Tensor] = []
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.seq_generators: dict[str, torch.Generator] = {}   # seq_id -> generator of a seeded sequence
        self.graphs = None                                     # CudaGraphs once captured
        self.rows = SeqRows(device, on_full=self._release_all)
        self.counts = TokenCounts(device)
        self.staging = Staging(device)

    def capture_cuda_graphs(self, max_batch: int, max_model_len: int) -> None:
        from omnistage.ar.cuda_graphs import CudaGraphs

        self.graphs = CudaGraphs(self.model, self.device, self.block_size, self.scratch_slot,
                                 max_batch, -(-max_model_len // self.block_size))
        self.rows.set_width(self.graphs.max_blocks)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One extra block past `num_blocks` is scratch: padded rows of graph replays write there."""
        self.kv_caches = []
        self.scratch_slot = num_blocks * self.block_size
        for attn in self.model.attention_layers:
            cache = torch.zeros(2, num_blocks + 1, self.block_size, attn.num_kv_heads, attn.head_dim,
                                dtype=self.dtype, device=self.device)
            attn.kv_cache = cache
            self.kv_caches.append(cache)
        self.rows = SeqRows(self.device, on_full=self._release_all)      # block ids of a new pool

    def _generator_for(self, seq: Sequence) -> torch.Generator:
        g = self.seq_generators.get(seq.seq_id)
        if g is None:
            g = torch.Generator(device=self.device).manual_seed(seq.seed)
            self.seq_generators[seq.seq_id] = g
        return g

    def release(self, seq_id: str) -> None:
        """Drop what the runner keeps for a finished or aborted sequence."""
        self.seq_generators.pop(seq_id, None)
        self.rows.release(seq_id)
        self.counts.release(seq_id)

    def _release_all(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            self.release(seq_id)

    # ---- inputs --------------------------------------------------------------------------------
    def prepare(self, sched: SchedulerOutput, eos_ids: frozenset[int] = frozenset()) -> _Step:
        decodes = [s for s in sched.scheduled if s.num_new_tokens == 1 and s.start > 0]
        prefills = [s for s in sched.scheduled if not (s.num_new_tokens == 1 and s.start > 0)]
        order = decodes + prefills
        n, d, bs, rows = len(order), len(decodes), self.block_size, self.rows
        # One pass of plain Python per sequence, none per token: its row, start, ids, whether it samples.
        seq_rows, starts, samples, ids, sampling, conds = [], [], [], [], [], []
        of = rows.of
        for i, s in enumerate(order):
            seq = s.seq
            r, bt = of.get(seq.seq_id), seq.block_table
            seq_rows.append(r.row if r is not None and r.table is bt and r.n == len(bt) else rows.sync(seq))
            starts.append(s.start)
            samples.append(s.start + s.num_new_tokens == len(seq.token_ids))
            if samples[-1]:
                sampling.append(seq)
            if seq.cond is not None:
                conds.append(i)
            if s.num_new_tokens == 1:
                ids.append(seq.token_ids[s.start])
            else:
                ids += seq.token_ids[s.start:s.start + s.num_new_tokens]
        seq_rows, starts = np.array(seq_rows, np.int64), np.array(starts, np.int64)
        samples, ids = np.array(samples, bool), np.array(ids, np.int64)
        if prefills:
            lens = np.fromiter((s.num_new_tokens for s in order), np.int64, n)
            ends = np.cumsum(lens)
            offsets = ends - lens
            pos = np.arange(int(ends[-1]), dtype=np.int64) + np.repeat(starts - offsets, lens)
            tok_rows = np.repeat(seq_rows, lens)
        else:
            offsets = np.arange(n, dtype=np.int64)
            ends, pos, tok_rows = offsets + 1, starts, seq_rows
        slots = rows.host[tok_rows, pos // bs] * bs + pos % bs
        rope = _rope_positions(order, conds, offsets, pos)

        st = self.staging
        graph = not prefills and rope.ndim == 1 and self.graphs is not None and self.graphs.fits(d)
        if graph:
            from omnistage.ar.cuda_graphs import pack_inputs

            st.add("graph", pack_inputs(self.graphs.n, ids, rope, slots, starts + 1, self.scratch_slot))
            table_rows = np.zeros(self.graphs.size_for(d), np.int64)
            table_rows[:d] = seq_rows
            st.add("table_rows", table_rows)
        else:
            st.add("ids", ids)
            st.add("pos", rope)
            st.add("slots", slots)
            if d:
                st.add("ctx", starts[:d] + 1)
                st.add("table_rows", seq_rows[:d])
        diffs = rows.take_diffs()
        if diffs is not None:
            st.add("diff_idx", diffs[0])
            st.add("diff_val", diffs[1])
        if sampling and not (len(sampling) == n and ends[-1] == n):
            st.add("hidden_rows", (ends - 1)[samples])
        plan = self._plan_sampling(sampling, seq_rows[samples], eos_ids) if sampling else None
        v = st.send()
        if plan is not None:                    # the sampling rows' device tensors: views of the upload
            sp = plan[0]
            sp.params, sp.top_k, sp.unseeded = v["sp"], v.get("top_k"), v.get("unseeded")
            if "bans" in v:
                sp.banned = (v["bans"][0], v["bans"][1])

        if diffs is not None and rows.cuda:
            rows.apply_diffs(v["diff_idx"], v["diff_val"])
        if graph:
            ids_t, pos_t, meta = self.graphs.load(v["graph"], v["table_rows"], rows.dev)
        else:
            ids_t, pos_t = v["ids"], v["pos"]
            meta = AttentionMetadata(slot_mapping=v["slots"], num_decodes=d)
            if d:
                width = int(rows.used[seq_rows[:d]].max())
                meta.decode_block_tables = rows.dev.narrow(1, 0, width).index_select(0, v["table_rows"])
                meta.decode_ctx_lens = v["ctx"]
            for i in range(d, n):
                s = order[i]
                ctx = s.start + s.num_new_tokens
                table = rows.dev[seq_rows[i], :-(-ctx // bs)]
                meta.prefills.append(PrefillChunk(int(offsets[i]), s.num_new_tokens, ctx, table))
        step = _Step(order, ids_t, pos_t, meta, offsets, conds, sampling, v.get("hidden_rows"), views=v)
        if plan is not None:
            step.sampling_inputs, step.penalized, step.num_logprobs = plan
        return step

    def _plan_sampling(self, seqs: list[Sequence], seq_rows: np.ndarray, eos_ids: frozenset[int]):
        """Adds the sampling rows' parts to the upload; returns (their SamplingInputs, whose tensors are
        set once uploaded; which rows have penalties, or None; the largest logprobs asked for, or -1)."""
        fp, ip = self.rows.fparams[seq_rows], self.rows.iparams[seq_rows]
        st = self.staging
        st.add("sp", fp)
        greedy = fp[:, F_GREEDY] != 0
        s = SamplingInputs(params=None, all_greedy=bool(greedy.all()))
        penalized = ip[:, I_PENALTY] != 0
        if penalized.any():
            for name, a in self.counts.plan(seqs, penalized).items():
                st.add("pen_" + name, a)
            s.any_repetition = bool((fp[:, F_REP] != 1).any())
            s.any_presence_frequency = bool(((fp[:, F_FREQ] != 0) | (fp[:, F_PRES] != 0)).any())
        else:
            penalized = None
        bans = [(i, t) for i in np.flatnonzero(ip[:, I_BANS]).tolist() for t in _banned(seqs[i], eos_ids)]
        if bans:
            st.add("bans", np.array(bans, np.int64).T.copy())
        if not s.all_greedy:
            k = ip[:, I_TOP_K]
            if (k > 0).any() or (fp[:, F_TOP_P] < 1).any():      # over every row, greedy ones too, as ever
                sampled_k = k[~greedy]
                if ((sampled_k > 0) & (sampled_k <= TOPK_FAST_MAX)).all():
                    k = np.where(greedy, 1, k)
                    s.filter_k = int(k.max())
                else:
                    k = np.where(k > 0, k, NO_TOP_K)
                    s.filter_k = -1
                st.add("top_k", k)
            s.any_min_p = bool((fp[:, F_MIN_P] > 0).any())
            seeded = ip[:, I_SEEDED] != 0
            unseeded = np.flatnonzero(~seeded)
            s.num_unseeded = len(unseeded)
            if 0 < len(unseeded) < len(seqs):
                st.add("unseeded", unseeded)
            # A seeded greedy row draws nothing: its generator is never read.
            s.seeded = [(i, self._generator_for(seqs[i])) for i in np.flatnonzero(seeded & ~greedy).tolist()]
        return s, penalized, int(ip[:, I_LOGPROBS].max())

    # ---- the step ------------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata,
                x: Optional[torch.Tensor]) -> torch.Tensor:
        if self.graphs is not None and meta.graph_batch:
            return self.graphs.replay(meta, x)
        return self.model(ids, pos, meta, inputs_embeds=x)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, eos_ids: frozenset[int]) -> RunnerOutput:
        step = self.prepare(sched, eos_ids)
        order, conds = step.order, step.conds
        x = None
        if step.meta.graph_batch or any(order[i].seq.cond.needs_embeds for i in conds):
            x = self.model.embed_tokens(step.ids)
            for i in conds:                     # prompt embeddings and streamed rows (ar/conditioning.py)
                s, o = order[i], int(step.offsets[i])
                s.seq.cond.fill(x[o:o + s.num_new_tokens], s.start)
        hidden = self.forward(step.ids, step.pos, step.meta, x)
        reports: dict[str, HiddenStates] = {}
        for i in conds:
            s, o = order[i], int(step.offsets[i])
            if s.seq.cond.return_hidden:
                reports[s.seq.seq_id] = HiddenStates(s.start, hidden[o:o + s.num_new_tokens].clone(),
                                                     x[o:o + s.num_new_tokens].clone())
        sampling = step.sampling
        if not sampling:
            return RunnerOutput({}, {}, reports)
        rows = hidden[:len(sampling)] if step.hidden_rows is None else hidden.index_select(0, step.hidden_rows)
        logits = self.model.compute_logits(rows)
        s, v = step.sampling_inputs, step.views
        if step.penalized is not None:
            pen = {k[4:]: t for k, t in v.items() if k.startswith("pen_")}
            self.counts.apply(pen, logits.shape[1])
            s.counts, s.prompt_seen = self.counts.gather(pen, s.any_repetition)
        out = sample(logits, s, self.generator, step.num_logprobs)
        after = None
        if step.penalized is not None:
            def after():
                self.counts.add_sampled(pen, out.token_ids, sampling, step.penalized)
        res = self._to_host(sampling, out, step.num_logprobs, after)
        res.hidden = reports
        return res

    def _fetch(self, t: torch.Tensor, after) -> torch.Tensor:
        """t on the host; `after` (more device work) is queued behind the copy, before the wait."""
        if t.device.type != "cuda":
            if after is not None:
                after()
            return t
        host = t.to("cpu", non_blocking=True)                 # pinned
        done = torch.cuda.Event()
        done.record()
        if after is not None:
            after()
        done.synchronize()
        return host

    def _to_host(self, seqs: list[Sequence], out: SamplerOutput, num_logprobs: int, after=None) -> RunnerOutput:
        if num_logprobs < 0:
            ids = self._fetch(out.token_ids, after).tolist()
            return RunnerOutput(dict(zip((q.seq_id for q in seqs), ids)), {})
        parts = [out.token_ids.float()[:, None], out.chosen_logprobs[:, None]]
        if num_logprobs > 0:
            parts += [out.top_ids.float(), out.top_logprobs]
        host = self._fetch(torch.cat(parts, dim=1), after)
        res = RunnerOutput({}, {})
        for i, q in enumerate(seqs):
            res.sampled[q.seq_id] = int(host[i, 0])
            if q.params.logprobs is not None:
                k = q.params.logprobs
                top = [(int(host[i, 2 + j]), float(host[i, 2 + num_logprobs + j])) for j in range(k)]
                res.logprobs[q.seq_id] = (float(host[i, 1]), top)
        return res


def _rope_positions(order: list[ScheduledSeq], conds: list[int], offsets: np.ndarray,
                    pos: np.ndarray) -> np.ndarray:
    """Rope positions of every row: the cache positions, except where a sequence's conditioning says
    otherwise (a position delta; [3, T] rows while a multimodal-rope prompt is being prefilled)."""
    if not conds:
        return pos
    rope, threes = pos.copy(), []
    for i in conds:
        s, o = order[i], int(offsets[i])
        one, three = s.seq.cond.positions(s.start, s.start + s.num_new_tokens)
        rope[o:o + s.num_new_tokens] = one
        if three is not None:
            threes.append((o, three))
    if not threes:
        return rope
    rows = np.tile(rope, (3, 1))
    for o, three in threes:
        rows[:, o:o + len(three[0])] = three
    return rows


def _banned(seq: Sequence, eos_ids: frozenset[int]) -> list[int]:
    """Ids that may not be sampled now: bad_token_ids always, stop ids until min_tokens."""
    p = seq.params
    if seq.num_output_tokens >= p.min_tokens:
        return p.bad_token_ids
    return sorted((set() if p.ignore_eos else set(eos_ids)) | set(p.stop_token_ids) | set(p.bad_token_ids))
