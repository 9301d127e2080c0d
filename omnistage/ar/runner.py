"""One AR engine step on the device: SchedulerOutput -> forward -> sampled ids (stage process).

The runner knows no model names: it needs a model with `attention_layers`, `forward(input_ids,
positions, meta)` and `compute_logits(hidden)`. It owns the KV-cache tensors, builds the step's
flattened inputs (decodes first, then prefill chunks), runs one forward over all of them,
computes logits only for rows that sample, and moves the sampled ids (plus logprobs when asked
for) to the host in one transfer. A model with a `frame_head` (multi-codebook talkers) has it
predict the rest of each sampled token's frame right after sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from omnistage.ar.sampler import SamplerOutput, SamplingBatch, sample
from omnistage.ar.scheduler import ScheduledSeq, SchedulerOutput
from omnistage.ar.sequence import Sequence
from omnistage.layers.attention import AttentionMetadata, PrefillChunk
from omnistage.stage import HiddenStates


@dataclass
class RunnerOutput:
    sampled: dict[str, int]                     # seq_id -> new token id, for rows that sampled
    logprobs: dict[str, tuple[float, list[tuple[int, float]]]]  # seq_id -> (chosen, [(id, logprob)])
    # seq_id -> the rows computed this step, for sequences that asked for them (device tensors)
    hidden: dict[str, HiddenStates] = field(default_factory=dict)
    # seq_id -> the sampled token's frame codes (codebooks 1..G-1), for a model with a `frame_head`
    codes: dict[str, list[int]] = field(default_factory=dict)


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

    def capture_cuda_graphs(self, max_batch: int, max_model_len: int) -> None:
        from omnistage.ar.cuda_graphs import CudaGraphs

        self.graphs = CudaGraphs(self.model, self.device, self.block_size, self.scratch_slot,
                                 max_batch, -(-max_model_len // self.block_size))

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One extra block past `num_blocks` is scratch: padded rows of graph replays write there."""
        self.kv_caches = []
        self.scratch_slot = num_blocks * self.block_size
        for attn in self.model.attention_layers:
            cache = torch.zeros(2, num_blocks + 1, self.block_size, attn.num_kv_heads, attn.head_dim,
                                dtype=self.dtype, device=self.device)
            attn.kv_cache = cache
            self.kv_caches.append(cache)

    def _to_device(self, data, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype).to(self.device, non_blocking=True)

    def prepare(self, sched: SchedulerOutput) -> tuple[list[ScheduledSeq], torch.Tensor, torch.Tensor, AttentionMetadata]:
        decodes = [s for s in sched.scheduled if s.num_new_tokens == 1 and s.start > 0]
        prefills = [s for s in sched.scheduled if not (s.num_new_tokens == 1 and s.start > 0)]
        order = decodes + prefills
        bs = self.block_size
        ids, slots = [], []
        for s in order:
            seq = s.seq
            for p in range(s.start, s.start + s.num_new_tokens):
                ids.append(seq.token_ids[p])
                slots.append(seq.block_table[p // bs] * bs + p % bs)
        pos, mrope_rows = _positions(order)
        if not prefills and self.graphs is not None and self.graphs.fits(len(decodes)):
            return order, *self.graphs.load(ids, pos, slots, [s.seq.block_table for s in decodes])
        meta = AttentionMetadata(slot_mapping=self._to_device(slots), num_decodes=len(decodes))
        if decodes:
            width = max(len(s.seq.block_table) for s in decodes)
            tables = [s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in decodes]
            meta.decode_block_tables = self._to_device(tables)
            meta.decode_ctx_lens = self._to_device([s.start + 1 for s in decodes])
        row = len(decodes)
        for s in prefills:
            ctx = s.start + s.num_new_tokens
            table = s.seq.block_table[: -(-ctx // bs)]
            meta.prefills.append(PrefillChunk(row, s.num_new_tokens, ctx, self._to_device(table)))
            row += s.num_new_tokens
        return order, self._to_device(ids), self._to_device(mrope_rows if mrope_rows else pos), meta

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata,
                x: Optional[torch.Tensor]) -> torch.Tensor:
        if self.graphs is not None and meta.graph_batch:
            return self.graphs.replay(meta, x)
        return self.model(ids, pos, meta, inputs_embeds=x)

    def _generator_for(self, seq: Sequence) -> Optional[torch.Generator]:
        if seq.seed is None:
            return None
        g = self.seq_generators.get(seq.seq_id)
        if g is None:
            g = torch.Generator(device=self.device).manual_seed(seq.seed)
            self.seq_generators[seq.seq_id] = g
        return g

    def release(self, seq_id: str) -> None:
        self.seq_generators.pop(seq_id, None)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, eos_ids: frozenset[int]) -> RunnerOutput:
        order, ids, pos, meta = self.prepare(sched)
        x = None
        if meta.graph_batch or any(s.seq.cond is not None and s.seq.cond.needs_embeds for s in order):
            x = self.model.embed_tokens(ids)
            row = 0
            for s in order:                     # prompt embeddings and streamed rows (ar/conditioning.py)
                if s.seq.cond is not None:
                    s.seq.cond.fill(x[row:row + s.num_new_tokens], s.start)
                row += s.num_new_tokens
        hidden = self.forward(ids, pos, meta, x)
        rows, sampling = [], []
        reports: dict[str, HiddenStates] = {}
        row = 0
        for s in order:
            if s.seq.cond is not None and s.seq.cond.return_hidden:
                reports[s.seq.seq_id] = HiddenStates(s.start, hidden[row:row + s.num_new_tokens].clone(),
                                                     x[row:row + s.num_new_tokens].clone())
            row += s.num_new_tokens
            if s.samples:
                rows.append(row - 1)
                sampling.append(s.seq)
        if not sampling:
            return RunnerOutput({}, {}, reports)
        last = hidden[self._to_device(rows)]
        logits = self.model.compute_logits(last)
        batch = SamplingBatch(
            params=[q.params for q in sampling],
            generators=[self._generator_for(q) for q in sampling],
            prompt_ids=[q.token_ids[:q.prompt_len] for q in sampling],
            output_ids=[q.output_token_ids for q in sampling],
            banned=[_banned(q, eos_ids) for q in sampling])
        num_logprobs = max((q.params.logprobs for q in sampling if q.params.logprobs is not None), default=-1)
        out = sample(logits, batch, self.generator, num_logprobs)
        codes = self._frames(sampling, last, out.token_ids, batch)
        res = self._to_host(sampling, out, num_logprobs)
        res.hidden = reports
        if codes is not None:
            res.codes = dict(zip((q.seq_id for q in sampling), codes.tolist()))
        return res

    def _frames(self, seqs: list[Sequence], last: torch.Tensor, token_ids: torch.Tensor,
                batch: SamplingBatch) -> Optional[torch.Tensor]:
        """A multi-codebook model's frame head (Qwen3-TTS' code predictor): from each sampled row's
        last hidden state and its sampled code, the frame's other codes [S, G-1] (to the host) and
        the row its next position adds (kept by the sequence, `Conditioning.add_frame`). None for
        models without one. The head keeps no state between calls: each frame is its own."""
        head = getattr(self.model, "frame_head", None)
        if head is None:
            return None
        codes, rows = head(last, token_ids, batch)
        for q, row in zip(seqs, rows):
            if q.cond is None or not q.cond.frame_feedback:
                raise ValueError(f"sequence {q.seq_id} of a frame-head model was added without frame_feedback")
            q.cond.add_frame(row)
        return codes.cpu()

    def _to_host(self, seqs: list[Sequence], out: SamplerOutput, num_logprobs: int) -> RunnerOutput:
        if num_logprobs < 0:
            return RunnerOutput(dict(zip((q.seq_id for q in seqs), out.token_ids.tolist())), {})
        parts = [out.token_ids.float()[:, None], out.chosen_logprobs[:, None]]
        if num_logprobs > 0:
            parts += [out.top_ids.float(), out.top_logprobs]
        host = torch.cat(parts, dim=1).cpu()
        res = RunnerOutput({}, {})
        for i, q in enumerate(seqs):
            res.sampled[q.seq_id] = int(host[i, 0])
            if q.params.logprobs is not None:
                k = q.params.logprobs
                top = [(int(host[i, 2 + j]), float(host[i, 2 + num_logprobs + j])) for j in range(k)]
                res.logprobs[q.seq_id] = (float(host[i, 1]), top)
        return res


def _positions(order: list[ScheduledSeq]) -> tuple[list[int], Optional[list[list[int]]]]:
    """1-D positions of every row and, when a multimodal-rope prompt is being prefilled, 3-D rows."""
    flat: list[int] = []
    parts = []                                  # per sequence: (1-D positions, 3 rows or None)
    for s in order:
        a, b = s.start, s.start + s.num_new_tokens
        one, three = (list(range(a, b)), None) if s.seq.cond is None else s.seq.cond.positions(a, b)
        flat += one
        parts.append((one, three))
    if all(three is None for _, three in parts):
        return flat, None
    rows: list[list[int]] = [[], [], []]
    for one, three in parts:
        for r in range(3):
            rows[r] += three[r] if three is not None else one
    return flat, rows


def _banned(seq: Sequence, eos_ids: frozenset[int]) -> list[int]:
    """Ids that may not be sampled now: bad_token_ids always, stop ids until min_tokens."""
    p = seq.params
    if seq.num_output_tokens >= p.min_tokens:
        return p.bad_token_ids
    return sorted((set() if p.ignore_eos else set(eos_ids)) | set(p.stop_token_ids) | set(p.bad_token_ids))
