"""One AR engine step on the device: SchedulerOutput -> forward -> sampled ids (stage process).

The runner knows no model names: it needs a model with `attention_layers`, `forward(input_ids,
positions, meta)` and `compute_logits(hidden)`. It owns the KV-cache tensors, builds the step's
flattened inputs (decodes first, then prefill chunks), runs one forward over all of them,
computes logits only for rows that sample, and moves the sampled ids (plus logprobs when asked
for) to the host in one transfer. A model with a `frame_head` (multi-codebook talkers) has it
predict the rest of each sampled token's frame right after sampling (the codes go to the host
with the ids, in the same copy). A model with a `report_layer`
returns (last hidden states, that layer's hidden states) and the second is what sequences asking
for hidden states get (`split_outputs`); prompt rows with `layer_embeds` hand the model
`layer_adds`, rows added after its first decoder layers (deepstack).

A step is `launch`ed (queued on the device, nothing waits) and later `collect`ed (waits for its ids
only), so the engine can queue step N+1 before it reads step N's ids (async scheduling). Step
N+1's rows for tokens step N sampled hold `sequence.PLACEHOLDER` in `Sequence.token_ids`; the
runner takes their ids from step N's device tensor. Every host-to-device copy goes through pinned
memory without a wait, so queueing a step never waits for the one before it.

Under tensor parallelism (`ranks` set: ar/tensor_parallel.RankGroup) this is rank 0's runner: each
step's rows (`ar/step_inputs.StepInputs`) go to the other ranks before its forward, which every rank
runs on its shard; only rank 0 samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from omnistage.ar.decode_rows import DecodeRows
from omnistage.ar.sampler import SamplerOutput, SamplingBatch, greedy_ids, plain_greedy, sample, to_device
from omnistage.ar.scheduler import ScheduledSeq, SchedulerOutput
from omnistage.ar.sequence import PLACEHOLDER, Sequence
from omnistage.ar.step_inputs import StepInputs, step_inputs, step_order
from omnistage.ar.token_counts import TokenCounts
from omnistage.layers.attention import AttentionMetadata, PrefillChunk
from omnistage.layers.triton_sampling import row_keys
from omnistage.stage import HiddenStates


@dataclass
class RunnerOutput:
    sampled: dict[str, int]                     # seq_id -> new token id, for rows that sampled
    logprobs: dict[str, tuple[float, list[tuple[int, float]]]]  # seq_id -> (chosen, [(id, logprob)])
    # seq_id -> the rows computed this step, for sequences that asked for them (device tensors)
    hidden: dict[str, HiddenStates] = field(default_factory=dict)
    # seq_id -> the sampled token's frame codes (codebooks 1..G-1), for a model with a `frame_head`
    codes: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class Launched:
    """A step queued on the device; `ModelRunner.collect` waits for it and reads its sampled ids."""
    seqs: list[Sequence]                        # the sequences that sampled, in row order
    tokens: Optional[torch.Tensor] = None       # [S] long on the device: the sampled ids
    # [S] long (or [S, G] with `framed`: each row's id then its frame codes), pinned: their copy, valid
    # once `event` is done
    host: Optional[torch.Tensor] = None
    framed: bool = False                        # `host` holds frame codes after each id (a frame-head model)
    event: Any = None                           # CUDA event recorded after the copy (None on CPU)
    result: Optional[RunnerOutput] = None       # already on the host (steps with logprobs or no sampling)
    hidden: dict[str, HiddenStates] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rows = {q.seq_id: i for i, q in enumerate(self.seqs)}   # seq_id -> its row in `tokens`

    def row_of(self, seq_id: str) -> int:
        return self.rows[seq_id]


def logit_rows(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The rows of `hidden` whose logits a step computes (a slice when they lead, in order)."""
    if rows == list(range(len(rows))):
        return hidden[:len(rows)]
    return hidden[to_device(rows, hidden.device, torch.long)]


def profile_step(model, tokens: int, rows: int, device: torch.device) -> None:
    """The largest step the engine sizes memory for: one prefill of `tokens` rows, logits for `rows`
    (every tensor-parallel rank runs it together: its collectives pair up)."""
    with torch.inference_mode():
        ids = torch.zeros(tokens, dtype=torch.long, device=device)
        meta = AttentionMetadata(slot_mapping=torch.zeros(tokens, dtype=torch.long, device=device))
        meta.prefills.append(PrefillChunk(0, tokens, tokens, torch.zeros(1, dtype=torch.long, device=device)))
        hidden = split_outputs(model(ids, torch.arange(tokens, device=device) % 16, meta))[0]
        model.compute_logits(hidden[:rows])


def kv_block_bytes(model, block_size: int, dtype: torch.dtype) -> int:
    attn = model.attention_layers[0]
    elem = torch.empty((), dtype=dtype).element_size()
    return len(model.attention_layers) * 2 * block_size * attn.num_kv_heads * attn.head_dim * elem


class ModelRunner:
    def __init__(self, model, device: torch.device, dtype: torch.dtype, block_size: int, seed: int = 0):
        self.model = model
        self.grammars = None                    # ar/structured.Grammars, set by the engine on first use
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.kv_caches: list[torch.Tensor] = []
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.seq_generators: dict[str, torch.Generator] = {}   # seq_id -> a seeded sequence's generator
        self.key_rng = np.random.default_rng(seed)             # unseeded rows' sampling noise keys
        self.graphs = None                                     # CudaGraphs once captured
        self.prefill_graphs = None                             # PrefillGraphs once captured
        self.ranks = None                       # ar/tensor_parallel.RankGroup: the other TP ranks (None: one rank)
        self.counts: Optional[TokenCounts] = None   # penalized sequences' token counts, made on first use
        self.decode_rows: Optional[DecodeRows] = None   # conditioned decode rows' table, made on first use
        # pinned host buffers that launched steps' results are copied into, used in turn: the engine
        # collects a step before it launches the one after next, so a buffer is free when its turn comes
        self.host_buffers: list[Optional[torch.Tensor]] = [None, None, None]
        self.host_turn = 0

    def capture_cuda_graphs(self, max_batch: int, max_model_len: int, prefill_tokens: int = 0) -> None:
        """Decode graphs for batches up to `max_batch`; with `prefill_tokens`, prefill graphs first (up to
        that many rows, ar/prefill_graphs.py; where the Triton prefill path serves the model: `serves`),
        whose pool the decode graphs then share."""
        from omnistage.ar.cuda_graphs import CudaGraphs

        from omnistage.ar import prefill_graphs

        max_blocks = -(-max_model_len // self.block_size)
        pool = None
        if prefill_tokens and prefill_graphs.serves(self.model, self.device):
            self.prefill_graphs = self.make_prefill_graphs(prefill_tokens, max_batch, max_model_len)
            pool = self.prefill_graphs.pool
        self.graphs = CudaGraphs(self.model, self.device, self.block_size, self.scratch_slot,
                                 max_batch, max_blocks, pool=pool)

    def make_prefill_graphs(self, max_tokens: int, max_seqs: int, max_model_len: int, capture=None):
        """`PrefillGraphs` over this runner's model and KV cache (`capture` False: replayed eagerly, CPU tests)."""
        from omnistage.ar.prefill_graphs import MAX_CHUNKS, PrefillGraphs

        return PrefillGraphs(self.model, self.device, self.block_size, self.scratch_slot, max_tokens,
                             min(MAX_CHUNKS, max_seqs), -(-max_model_len // self.block_size), capture=capture)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One extra block past `num_blocks` is scratch: padded rows of graph replays write there.
        Under tensor parallelism every rank makes its own (its KV heads only)."""
        if self.ranks is not None:
            self.ranks.allocate(num_blocks)
        self.kv_caches = []
        self.scratch_slot = num_blocks * self.block_size
        for attn in self.model.attention_layers:
            cache = torch.zeros(2, num_blocks + 1, self.block_size, attn.num_kv_heads, attn.head_dim,
                                dtype=self.dtype, device=self.device)
            attn.kv_cache = cache
            self.kv_caches.append(cache)

    def free_kv_cache(self) -> None:
        for attn in self.model.attention_layers:
            attn.kv_cache = None
        self.kv_caches = []

    def _to_device(self, data, dtype=torch.long) -> torch.Tensor:
        return to_device(data, self.device, dtype)

    def prepare(self, sched: SchedulerOutput, prev: Optional[Launched] = None
                ) -> tuple[list[ScheduledSeq], StepInputs, torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's rows (`StepInputs`) and inputs on the device. `prev`: the queued step whose ids
        fill this step's placeholders."""
        decodes, prefills = step_order(sched)
        inputs = step_inputs(decodes, prefills, self.block_size, None if prev is None else prev.rows)
        order = decodes + prefills
        if not prefills and self.graphs is not None and self.graphs.fits(len(decodes)):
            ids_dev, pos_dev, meta = self.graphs.load(inputs.ids, inputs.positions, inputs.slots,
                                                      inputs.block_tables, inputs.decode_ctx_lens)
        elif (self.prefill_graphs is not None and self.ranks is None and self.prefill_graphs.fits(inputs)
              and not _layered(order)):         # deepstack rows are added inside the forward: eager
            ids_dev, pos_dev, meta = self.prefill_graphs.load(inputs)
        else:
            ids_dev, pos_dev, meta = inputs.tensors(self.device)
        self._fill(ids_dev, inputs.fill, prev)
        return order, inputs, ids_dev, pos_dev, meta

    def _fill(self, ids: torch.Tensor, fill: list[tuple[int, int]], prev: Optional[Launched]) -> None:
        """Placeholder rows take the ids the queued step sampled, device to device."""
        if not fill:
            return
        dst, src = zip(*fill)
        if list(dst) == list(src) == list(range(len(fill))):          # the same batch as before, in order
            ids[:len(fill)].copy_(prev.tokens[:len(fill)])
        else:
            ids[self._to_device(dst)] = prev.tokens[self._to_device(src)]

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata,
                x: Optional[torch.Tensor], layer_adds: Optional[torch.Tensor] = None) -> tuple[Any, Any]:
        """(the model's output, the replayed graph's `GraphOutput` or None when the step ran eager). The
        output: last hidden states, or (them, the reported rows) for a model with a `report_layer`.
        `layer_adds` [L, T, H]: rows added after decoder layers 0..L-1 (prefills only)."""
        if self.graphs is not None and meta.graph_batch:
            graph = self.graphs.replay(meta, x)
            return graph.model, graph
        if meta.graph_tokens:
            graph = self.prefill_graphs.replay(meta, x)
            return graph.model, graph
        if layer_adds is not None:
            return self.model(ids, pos, meta, inputs_embeds=x, layer_adds=layer_adds), None
        return self.model(ids, pos, meta, inputs_embeds=x), None

    def _condition(self, x: torch.Tensor, order: list[ScheduledSeq]) -> None:
        """Prompt embeddings, given / streamed rows and frame rows into the step's input rows
        (ar/conditioning.py): decode rows that `DecodeRows` takes in one gather, other one-row decodes
        of generated positions in one add per kind of row (streamed, then frame: the order and
        rounding of `Conditioning.fill`), the rest row by row."""
        gathered, row = [], 0
        adds: tuple[list, list] = ([], [])      # per kind of row: (row of x, the [H] row added there)
        for s in order:
            cond = s.seq.cond
            if cond is not None:
                if DecodeRows.takes(cond, s.start, s.num_new_tokens):
                    gathered.append((row, s))
                elif s.num_new_tokens == 1 and s.start >= cond.prompt_len:
                    for kind, added in zip(adds, cond.generated_rows(s.start)):
                        if added is not None:
                            kind.append((row, added))
                else:
                    cond.fill(x[row:row + s.num_new_tokens], s.start)
            row += s.num_new_tokens
        for kind in adds:
            if kind:
                dst, rows = zip(*kind)
                x.index_add_(0, self._to_device(list(dst)), torch.stack([r.to(x.dtype) for r in rows]))
        if gathered:
            if self.decode_rows is None:
                self.decode_rows = DecodeRows(x.shape[1], self.device, x.dtype)
            self.decode_rows.fill(x, gathered)

    @staticmethod
    def _layer_adds(order: list[ScheduledSeq], x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """[L, T, H] per-layer rows of this step's prompt rows that have `layer_embeds`, else None."""
        layered = _layered(order)
        if not layered:
            return None
        depth = max(len(s.seq.cond.layer_embeds) for s in layered)
        adds = x.new_zeros(depth, *x.shape)
        wanted = {id(s) for s in layered}
        row = 0
        for s in order:
            if id(s) in wanted:
                s.seq.cond.fill_layers(adds[:, row:row + s.num_new_tokens], s.start)
            row += s.num_new_tokens
        return adds

    def _noise_keys(self, seqs: list[Sequence]) -> np.ndarray:
        """int64 [S] sampling noise keys (`triton_sampling.row_keys`): a seeded sequence's from its seed and
        its tokens sampled so far (the same draw whatever the batch, queued or not); an unseeded one's
        from the runner's own generator."""
        seeds = [q.seed for q in seqs]
        if all(x is None for x in seeds):
            return self.key_rng.integers(0, 2 ** 32, len(seqs), dtype=np.int64)
        keys = row_keys([0 if x is None else x & (2 ** 64 - 1) for x in seeds], [q.num_output_tokens for q in seqs])
        unseeded = np.array([x is None for x in seeds])
        keys[unseeded] = self.key_rng.integers(0, 2 ** 32, int(unseeded.sum()), dtype=np.int64)
        return keys

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
        if self.counts is not None:
            self.counts.release(seq_id)
        if self.decode_rows is not None:
            self.decode_rows.release(seq_id)
        if self.ranks is not None:
            self.ranks.tables.drop(seq_id)

    def execute(self, sched: SchedulerOutput, eos_ids: frozenset[int]) -> RunnerOutput:
        """One step, waited for."""
        return self.collect(self.launch(sched, eos_ids))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, eos_ids: frozenset[int], prev: Optional[Launched] = None) -> Launched:
        """Queue one step on the device. `prev`: the step before, still queued, whose sampled ids
        this step's placeholder tokens are."""
        order, inputs, ids, pos, meta = self.prepare(sched, prev)
        if self.ranks is not None:              # the other ranks get the step's rows and run its forward too
            if any(s.seq.cond is not None and s.seq.cond.layer_embeds is not None for s in order):
                raise ValueError("tensor_parallel_size > 1 does not take prompts with layer_embeds "
                                 "(deepstack rows) yet")
            self.ranks.send_step(inputs, ids)
        x = None
        if meta.graph_batch or meta.graph_tokens or inputs.embeds:
            x = self.model.embed_tokens(ids)
            self._condition(x, order)
            if self.ranks is not None:
                self.ranks.send_embeds(x)
        sampling = [s.seq for s in order if s.samples]
        params = [q.params for q in sampling]
        banned = [_banned(q, eos_ids) for q in sampling]
        flags = [p.needs_penalties for p in params]
        penalized = any(flags)                  # only penalties read earlier ids: counted on the device
        # read before the forward: `prev.tokens` may be a graph's buffer, which a replay rewrites; needed
        # only for ids the device counts lack (a sequence's first step)
        pending = None
        if penalized and (self.counts is None or self.counts.lacks(sampling, flags)):
            pending = self._pending_ids(sampling, prev)
        output, graph = self.forward(ids, pos, meta, x, self._layer_adds(order, x))
        hidden, reported = split_outputs(output)
        # Grammar masks are filled on the host while the device runs the forward (kernels are queued).
        bitmask = None
        if self.grammars is not None:
            bitmask = self.grammars.bitmask(sampling)
        rows = list(inputs.logit_rows)
        reports: dict[str, HiddenStates] = {}
        row = 0
        for s in order:
            if s.seq.cond is not None and s.seq.cond.return_hidden:
                reports[s.seq.seq_id] = HiddenStates(s.start, reported[row:row + s.num_new_tokens].clone(),
                                                     x[row:row + s.num_new_tokens].clone())
            row += s.num_new_tokens
        if not sampling:
            return Launched([], result=RunnerOutput({}, {}), hidden=reports)
        framed = getattr(self.model, "frame_head", None) is not None
        # the sampled rows' last hidden states (the eager lm_head's input, a frame head's)
        picked = logit_rows(hidden, rows) if graph is None or framed else None
        # the sampled rows' places in the graph's logits and ids
        graph_rows = list(range(len(rows))) if graph is not None and graph.picked else rows
        codes, num_logprobs = None, -1
        if bitmask is None and not framed and all(map(plain_greedy, params, banned)):
            # every row takes the argmax of its raw logits: the graph's own (nothing more runs), or one
            # over the eager logits
            out = SamplerOutput(logit_rows(graph.greedy, graph_rows) if graph is not None
                                else greedy_ids(self.model.compute_logits(picked)))
        else:
            logits = self.model.compute_logits(picked) if graph is None else logit_rows(graph.logits, graph_rows)
            slots = None
            if penalized:
                if self.counts is None:
                    self.counts = TokenCounts(logits.shape[-1], self.device)
                slots = self.counts.prepare(sampling, flags, pending)
            batch = SamplingBatch(
                params=params,
                generators=([self._generator_for(q) for q in sampling] if framed or self.device.type != "cuda"
                            else []),
                # on CUDA the main draw's noise is counter-based (one launch for seeded rows too)
                keys=(self._noise_keys(sampling) if self.device.type == "cuda" and not all(p.greedy for p in params)
                      else None),
                banned=banned,
                token_bitmask=None if bitmask is None else bitmask.to(self.device, non_blocking=True),
                token_counts=None if slots is None else self.counts.view(slots))
            num_logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=-1)
            out = sample(logits, batch, self.generator, num_logprobs)
            if slots is not None:
                self.counts.add_sampled(sampling, slots, flags, out.token_ids)
            codes = self._frames(sampling, picked, out.token_ids, batch)
        done = Launched(sampling, tokens=out.token_ids, hidden=reports, framed=codes is not None)
        if num_logprobs >= 0:
            done.result = self._to_host(sampling, out, num_logprobs)
            if codes is not None:
                done.result.codes = dict(zip((q.seq_id for q in sampling), codes.tolist()))
        else:                                   # ids (and frame codes) in one copy, read at `collect`
            self._copy_to_host(done, out.token_ids if codes is None else torch.cat([out.token_ids[:, None], codes], 1))
        return done

    def _copy_to_host(self, done: Launched, values: torch.Tensor) -> None:
        """Queue the copy of a step's results into the next pinned host buffer (`done.host`, valid once
        `done.event` is done); on the CPU `done.host` is `values` itself."""
        if not values.is_cuda:
            done.host = values
            return
        turn = self.host_turn
        self.host_turn = (turn + 1) % len(self.host_buffers)
        buf = self.host_buffers[turn]
        if buf is None or buf.numel() < values.numel():
            buf = self.host_buffers[turn] = torch.empty(max(values.numel(), 1024), dtype=torch.long, pin_memory=True)
        done.host = buf[:values.numel()].view(values.shape)
        done.host.copy_(values, non_blocking=True)
        done.event = torch.cuda.Event()
        done.event.record()

    def _pending_ids(self, seqs: list[Sequence], prev: Optional[Launched]) -> Optional[torch.Tensor]:
        """[S] on the device: for each row whose last token is a placeholder, the id `prev` sampled for
        it (penalties count it without waiting for it to reach the host); 0 for the other rows."""
        rows = [prev.row_of(q.seq_id) if q.token_ids[-1] == PLACEHOLDER else -1 for q in seqs]
        if all(r < 0 for r in rows):
            return None
        picked = prev.tokens[self._to_device([max(r, 0) for r in rows])]
        return torch.where(self._to_device([r >= 0 for r in rows], torch.bool), picked, 0)

    def collect(self, step: Launched) -> RunnerOutput:
        """Wait for a launched step's ids (only its own work, not steps queued after it)."""
        if step.result is None:
            if step.event is not None:
                step.event.synchronize()
            rows = step.host.tolist()
            ids = [q.seq_id for q in step.seqs]
            if step.framed:
                step.result = RunnerOutput({i: r[0] for i, r in zip(ids, rows)}, {},
                                           codes={i: r[1:] for i, r in zip(ids, rows)})
            else:
                step.result = RunnerOutput(dict(zip(ids, rows)), {})
        step.result.hidden = step.hidden
        return step.result

    def _frames(self, seqs: list[Sequence], last: torch.Tensor, token_ids: torch.Tensor,
                batch: SamplingBatch) -> Optional[torch.Tensor]:
        """A multi-codebook model's frame head (Qwen3-TTS' code predictor): from each sampled row's
        last hidden state and its sampled code, the frame's other codes [S, G-1] (on the device; they
        go to the host with the ids) and the row its next position adds (kept by the sequence,
        `Conditioning.add_frame`, and in `DecodeRows`' table: the next step reads it on the device, so
        it may be queued before this one's codes are read). None for models without one. The head
        keeps no state between calls: each frame is its own."""
        head = getattr(self.model, "frame_head", None)
        if head is None:
            return None
        codes, rows = head(last, token_ids, batch)
        for q, row in zip(seqs, rows):
            if q.cond is None or not q.cond.frame_feedback:
                raise ValueError(f"sequence {q.seq_id} of a frame-head model was added without frame_feedback")
            q.cond.add_frame(row)
        if self.decode_rows is not None:
            self.decode_rows.put_frames(seqs, rows)
        return codes

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


def _layered(order: list[ScheduledSeq]) -> list[ScheduledSeq]:
    """The step's rows with deepstack `layer_embeds` still in their prompt."""
    return [s for s in order if s.seq.cond is not None and s.seq.cond.layer_embeds is not None
            and s.start < s.seq.cond.prompt_len]


def split_outputs(out) -> tuple[torch.Tensor, torch.Tensor]:
    """(last hidden states, rows reported as `HiddenStates.hidden`) of a forward's output."""
    return out if isinstance(out, tuple) else (out, out)


def _banned(seq: Sequence, eos_ids: frozenset[int]) -> list[int]:
    """Ids that may not be sampled now: bad_token_ids always, stop ids until min_tokens (not for a
    sequence with a grammar: its grammar decides when the answer ends)."""
    p = seq.params
    if seq.num_output_tokens >= p.min_tokens or seq.grammar is not None:
        return p.bad_token_ids
    return sorted((set() if p.ignore_eos else set(eos_ids)) | set(p.stop_token_ids) | set(p.bad_token_ids))
