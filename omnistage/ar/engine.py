"""The AR stage engine: schedule -> run -> update, one step at a time (stage process).

In: requests (an `ARPrompt`, or a prompt string, token ids, or a dict of `ARPrompt` fields, converted
once at `add_request`) with `SamplingParams`, and streamed `ExtraRows` for requests added with
`stream_extra` (`add_input`). Out: `StageOutput`s carrying cumulative `RequestOutput`s for the
requests that changed this step (and `HiddenStates` for those that asked for them). The engine
owns tokenizer-side work (prompt encoding, incremental detokenization, stop strings, the
structured-output grammars of `ar/structured.py`: a constrained request waits outside the
scheduler until its grammar is compiled, then each of its sequences advances its own matcher
with every sampled token and finishes when the grammar terminates); the
scheduler decides what runs; the runner computes. The per-request host work of a step
(detokenizing, stop checks, building outputs) is isolated: a request it raises for fails alone, as
a finished `StageOutput` whose `error` says why; only the batched forward is the engine's own.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, Callable, Optional

import numpy as np
import torch

from omnistage.ar import warmup
from omnistage.ar.conditioning import Conditioning
from omnistage.ar.cuda_graphs import capture_sizes
from omnistage.ar.detokenizer import IncrementalDetokenizer
from omnistage.ar.kv_cache import BlockManager
from omnistage.ar.prefill_graphs import MAX_CHUNKS as PREFILL_CHUNKS
from omnistage.ar.prefill_graphs import estimate_bytes
from omnistage.ar.runner import Launched, ModelRunner, RunnerOutput, kv_block_bytes, profile_step
from omnistage.ar.scheduler import Scheduler, SchedulerOutput
from omnistage.ar.sequence import PLACEHOLDER, SeqStatus, Sequence
from omnistage.ar.tensor_parallel import RankFailure, RankGroup
from omnistage.config import CUDA_CONTEXT_BYTES, EngineConfig, checkpoint_dtype
from omnistage.layers.fp8_linear import quantize_decoder
from omnistage.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, TokenLogprobs
from omnistage.parallel.group import ParallelInit
from omnistage.parallel.tensor import sharding
from omnistage.params import ParamError, SamplingParams
from omnistage.stage import ARPrompt, ExtraRows, StageError, StageOutput

logger = logging.getLogger(__name__)

# (model_dir, device, dtype, max_positions or None) -> (native decoder, its text config, tokenizer or None,
# eos ids): a plain LLM's (`models.loader.load_causal_lm`) or a registered component's (models/registry.py)
ModelLoader = Callable[[str, torch.device, torch.dtype, Optional[int]], tuple]

FREE_MARGIN_BYTES = 256 * 2**20                 # left free on the device when the KV cache is capped by what is free


class _Request:
    def __init__(self, request_id: str, prompt: Optional[str], prompt_ids: list[int], params: SamplingParams,
                 seqs: list[Sequence], arrival_time: float, context_frames=None, has_text: bool = True):
        self.request_id = request_id
        self.context_frames = context_frames    # the prompt's `context_frames`, reported with every output
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        self.seqs = seqs
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        # Only the finished output is wanted (`output_kind`), and no step needs hidden states reported:
        # no output is built before the end.
        self.final_only = params.output_kind == "final_only" and not any(
            s.cond is not None and s.cond.return_hidden for s in seqs)
        # its text is decoded once at the end (nothing reads it before, and no stop string needs it), or
        # there is none (a talker's codec ids: no tokenizer)
        self.lazy_text = (self.final_only and not params.stop) or not has_text


class AREngine:
    def __init__(self, model_dir: str, config: Optional[EngineConfig] = None, *, loader: ModelLoader):
        """`loader` builds the model (from the model registry: `pipeline/build.py` picks it). `config`:
        the stage's, resolved for an AR stage (`EngineConfig.resolved`; one that is not yet is
        resolved here the same way, with the checkpoint's dtype)."""
        self.config = config = (config or EngineConfig()).resolved("ar", checkpoint_dtype(model_dir))
        self.model_dir = model_dir
        self.device = config.torch_device()
        tp = config.tensor_parallel_size
        init = ParallelInit.for_engine(config, tp) if tp > 1 else None   # checks the devices exist
        # what this process held on the device before this engine (another inline stage, the renderer)
        self._mem_base = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        self.dtype = config.torch_dtype()
        with sharding(tp, 0):                   # rank 0's shard; a size the model cannot split fails here
            self.model, self.hf_config, self.tokenizer, self.eos_ids = loader(
                model_dir, self.device, self.dtype, config.max_model_len)
        if config.quantization is not None:     # FP8 decoder linears, before memory is planned and graphs captured
            quantize_decoder(self.model, tuple(config.ignored_layers))
        if tp > 1 and hasattr(self.model, "frame_head"):
            raise ValueError(f"tensor_parallel_size must be 1 for {type(self.model).__name__} (a frame-head "
                             f"talker); got {tp}")
        # A model may take its own request type: `make_request(inputs, params) -> (ARPrompt, SamplingParams)`
        # turns it into the AR request (e.g. Qwen3-TTS: text + `TTSParams` -> prompt rows); `params_type`
        # is then what the stage's requests carry.
        self.make_request = getattr(self.model, "make_request", None)
        self.params_type = getattr(self.model, "params_type", None)
        for verb in ("voices", "check_params"):  # such a model's own voices and request checks, when it has them
            if hasattr(self.model, verb):
                setattr(self, verb, getattr(self.model, verb))
        max_len = self._max_len()
        self.runner = ModelRunner(self.model, self.device, self.dtype, config.block_size, config.seed)
        if init is not None:                    # ranks 1..N-1 load their shards and follow this process
            self.runner.ranks = RankGroup.start(init, model_dir, loader, config)
        try:
            num_blocks = self._num_kv_blocks(max_len)
            self.runner.allocate_kv_cache(num_blocks)
        except BaseException:
            self.close()                        # the ranks started above stop with it
            raise
        self.max_model_len = min(max_len, num_blocks * config.block_size)
        self._eos = np.array(sorted(self.eos_ids), dtype=np.int64)    # for one `np.isin` per step
        if self.device.type == "cuda" and config.cuda_graphs and tp == 1:   # TP steps run eager
            self.runner.capture_cuda_graphs(config.max_num_seqs, self.max_model_len, config.prefill_graph_tokens())
        if self.device.type == "cuda" and warmup.ENABLED:   # first-use kernel compiles and graphs, now
            self._warm_up()
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   max(config.max_num_batched_tokens, 1))
        self.requests: dict[str, _Request] = {}
        self._compiling: dict[str, Future] = {}  # request id -> its grammar being compiled (not yet scheduled)
        self._steps, self._step_seconds = 0, 0.0   # model steps run, and their time (schedule excluded)
        self._prefill_steps = 0                 # model steps that computed prompt tokens (a prefill)
        # The step queued on the device whose ids the host has not read yet (async scheduling): its
        # schedule, its launch, and the sequences whose last token is its placeholder (those still running)
        self._pending: Optional[tuple[SchedulerOutput, Launched, set[str]]] = None
        logger.info("AR engine: %s on %s/%s, %d KV blocks of %d tokens, max_model_len %d",
                    type(self.model).__name__, self.device, self.dtype, num_blocks, config.block_size,
                    self.max_model_len)

    def _warm_up(self) -> None:
        cfg = self.config
        graphs = self.runner.graphs
        sizes = graphs.sizes if graphs is not None else capture_sizes(cfg.max_num_seqs)
        try:
            done = warmup.warm_up(self.runner, min(cfg.max_num_batched_tokens, 8192), cfg.max_num_seqs, sizes,
                                  -(-self.max_model_len // cfg.block_size))
        except torch.cuda.OutOfMemoryError:     # e.g. a frame head at max_num_seqs rows: the stage still serves
            torch.cuda.empty_cache()
            logger.warning("AR engine warm-up of %s ran out of memory; first requests at new shapes pay their "
                           "kernel compiles and graph captures", type(self.model).__name__, exc_info=True)
            return
        logger.info("AR engine warm-up: %s, %d prefill lengths (1..%d tokens), %d eager decodes, frame head at %d "
                    "batch sizes, %.2f s", type(self.model).__name__, len(done.prefill_lengths),
                    max(done.prefill_lengths), len(done.decodes), len(done.frame_sizes), done.seconds)

    # ---- sizing --------------------------------------------------------------------------------
    def _max_len(self) -> int:
        return self.config.max_len(getattr(self.hf_config, "max_position_embeddings", None) or 4096)

    def _num_kv_blocks(self, max_len: int) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_block = kv_block_bytes(self.model, cfg.block_size, self.dtype)
        if self.device.type == "cuda":
            budget = self._profile_cuda_budget()
            blocks = min(cfg.kv_blocks_wanted(max_len), budget // per_block)
        else:                                   # sized from what the model needs (EngineConfig.cpu_kv_blocks)
            budget = int(cfg.cpu_kv_cache_gb * 2**30)
            blocks = cfg.cpu_kv_blocks(max_len, per_block)
        if blocks < 2:
            raise RuntimeError(f"not enough memory for the KV cache ({budget / 2**30:.2f} GiB free); "
                               "lower max_num_batched_tokens or raise gpu_memory_utilization")
        return int(blocks)

    def _profile_cuda_budget(self) -> int:
        """Bytes for KV: this stage's own share of the GPU (`gpu_memory_utilization`; stages sharing a
        GPU get planned shares, pipeline/memory.py) minus what it holds at the peak of a largest step
        (weights + activations, measured), its CUDA context (estimated), the decode graphs' logits
        buffers (computed) and the prefill graphs' outputs and pool (`prefill_graphs.estimate_bytes`); at
        most what the device has free once the step's activations are released, less their room again,
        those buffers and a margin."""
        cfg = self.config
        torch.cuda.empty_cache()
        # the peak restarts at what is allocated now: `_mem_base` + this engine's weights
        torch.cuda.reset_peak_memory_stats(self.device)
        self.runner.allocate_kv_cache(1)
        n = min(cfg.max_num_batched_tokens, 8192)
        if self.runner.ranks is not None:       # the other ranks run the same step (its collectives)
            self.runner.ranks.profile(n, min(n, cfg.max_num_seqs))
        profile_step(self.model, n, min(n, cfg.max_num_seqs), self.device)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self.runner.free_kv_cache()
        torch.cuda.empty_cache()
        activations = peak - torch.cuda.memory_allocated(self.device)   # room a largest step needs again
        free, total = torch.cuda.mem_get_info(self.device)
        # the decode graphs' pool keeps the lm_head's logits of the largest batch (bf16 / fp16 and float32)
        elem = torch.empty((), dtype=self.dtype).element_size()
        graphs = (cfg.max_num_seqs * self.hf_config.vocab_size * (4 + elem)
                  if cfg.cuda_graphs and cfg.tensor_parallel_size == 1 else 0)
        prefill = cfg.prefill_graph_tokens()
        if prefill:                             # the prefill graphs' outputs and their pool's activations
            graphs += estimate_bytes(prefill, min(PREFILL_CHUNKS, cfg.max_num_seqs),
                                     self.model.embed_tokens.weight.shape[1], self.hf_config.vocab_size, elem,
                                     activations / n)
        budget = int(total * cfg.gpu_memory_utilization - (peak - self._mem_base) - CUDA_CONTEXT_BYTES - graphs)
        free_for_kv = free - activations - graphs - FREE_MARGIN_BYTES
        if budget > free_for_kv:
            logger.warning("KV cache capped at the %.2f GiB free on %s; gpu_memory_utilization %.3f would give "
                           "%.2f GiB: the device holds more than the memory plan estimated (other stages or "
                           "processes)", free_for_kv / 2**30, self.device, cfg.gpu_memory_utilization, budget / 2**30)
            budget = free_for_kv
        return int(budget)

    # ---- requests ------------------------------------------------------------------------------
    def encode(self, prompt: ARPrompt) -> tuple[Optional[str], list[int]]:
        """The prompt's text (when it has one) and its token ids."""
        if prompt.prompt_token_ids is not None:
            ids = [int(t) for t in prompt.prompt_token_ids]
            vocab = self.hf_config.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ParamError("prompt_token_ids", f"prompt_token_ids must be in [0, {vocab}), got {bad[:4]}")
            return prompt.prompt, ids
        return prompt.prompt, self.tokenizer.encode(prompt.prompt, add_special_tokens=prompt.add_special_tokens)

    def add_request(self, request_id: str, inputs: Any, params: Optional[SamplingParams] = None,
                    arrival_time: Optional[float] = None) -> None:
        """`inputs`: an `ARPrompt`, or what a user passes (a string, token ids, a dict of `ARPrompt` fields)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.make_request is not None:       # a model that takes requests in its own terms (TTS text + voice)
            inputs, params = self.make_request(inputs, params)
        params = params or SamplingParams()
        vocab = self.hf_config.vocab_size
        for name in ("stop_token_ids", "bad_token_ids", "logit_bias"):   # ids index the logits
            bad = [t for t in getattr(params, name) or () if t >= vocab]
            if bad:
                raise ParamError(name, f"{name} token ids must be in [0, {vocab}), got {bad[:4]}")
        prompt = ARPrompt.of(inputs)
        text, ids = self.encode(prompt)
        if not ids:
            raise ValueError("the prompt must contain at least one token")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ValueError(f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}")
        if params.max_tokens is None:           # the stage's default answer cap, clipped to the room left
            params = params.clone(max_tokens=min(room, self.config.default_max_tokens or room))
        elif params.max_tokens > room:
            raise ParamError("max_tokens", f"max_tokens must be <= {room} (max_model_len {self.max_model_len} "
                             f"minus {len(ids)} prompt tokens), got {params.max_tokens}")
        cond = Conditioning.of(prompt, len(ids), self.model.embed_tokens.weight.shape[1],
                               self.model.rotary.section_rows is not None, self.device, self.dtype)
        if cond is not None and (cond.return_hidden or cond.stream_extra or cond.frame_feedback) and params.n != 1:
            raise ParamError("n", "n must be 1 for requests with return_hidden_states, stream_extra, extra_rows "
                                  "or frame_feedback")
        grammar = None if params.structured_outputs is None else self._grammars().prepare(params.structured_outputs)
        now = arrival_time or time.time()
        seqs = []
        for i in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            seed = None if params.seed is None else params.seed + i
            seq = Sequence(seq_id, request_id, i, ids, params, now, seed)
            seq.detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
            seq.cond = None if cond is None else dataclasses.replace(cond)   # its own streamed-row state
            seqs.append(seq)
        # an array, not lists: it goes out with every output of the request (cheap to pickle)
        context = None if prompt.context_frames is None else np.asarray(prompt.context_frames, dtype=np.int32)
        self.requests[request_id] = _Request(request_id, text, ids, params, seqs, now, context,
                                             has_text=self.tokenizer is not None)
        if grammar is not None:
            self._compiling[request_id] = grammar
            return
        for seq in seqs:
            self.scheduler.add(seq)

    def _grammars(self):
        if self.runner.grammars is None:
            from omnistage.ar.structured import Grammars

            self.runner.grammars = Grammars(self.tokenizer, self.hf_config.vocab_size, self.eos_ids)
        return self.runner.grammars

    def _admit_compiled(self) -> list[StageOutput]:
        """Requests whose grammar is ready join the scheduler (each sequence with its own matcher);
        one whose grammar failed to compile fails alone. Waits a little only when nothing else runs."""
        if not self.scheduler.has_unfinished():
            wait(list(self._compiling.values()), timeout=0.01, return_when=FIRST_COMPLETED)
        failed = []
        for rid, future in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[rid]
            req = self.requests[rid]
            try:
                compiled = future.result()
            except Exception as e:
                del self.requests[rid]
                failed.append(StageOutput.failed(rid, StageError(
                    f"structured_outputs could not be compiled: {e}", refused=True, field="structured_outputs")))
                continue
            for seq in req.seqs:
                seq.grammar = self.runner.grammars.matcher(compiled)
                self.scheduler.add(seq)
        return failed

    def add_input(self, request_id: str, piece: ExtraRows) -> None:
        """Streamed inputs of a running request added with `stream_extra`: rows for its generated positions."""
        req = self.requests.get(request_id)
        if req is None:
            return
        for seq in req.seqs:
            if seq.cond is None or not seq.cond.stream_extra:
                raise ValueError(f"request {request_id!r} was added without stream_extra: it takes no streamed rows")
            seq.cond.add(piece, self.device, self.dtype)

    def abort(self, request_id: str) -> None:
        self._compiling.pop(request_id, None)
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            self.scheduler.abort(seq)
            self.runner.release(seq.seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def reset_prefix_cache(self) -> int:
        """Drops the prefix cache (`BlockManager.reset_prefix_cache`); returns the blocks forgotten."""
        return self.block_manager.reset_prefix_cache()

    def stats(self) -> dict[str, float]:
        bm = self.block_manager
        return {"num_running": len({s.request_id for s in self.scheduler.running}),
                "num_waiting": len({s.request_id for s in self.scheduler.waiting} | set(self._compiling)),
                "kv_cache_usage": bm.usage,
                "num_preemptions": self.scheduler.num_preemptions,
                "prefix_cache_queries": bm.prefix_queries,
                "prefix_cache_hits": bm.prefix_hits,
                "steps_total": self._steps, "prefill_steps_total": self._prefill_steps,
                "step_seconds_total": self._step_seconds}

    def close(self) -> None:
        """Stops the tensor-parallel ranks (nothing to do with one rank)."""
        if self.runner.ranks is not None:
            self.runner.ranks.close()
            self.runner.ranks = None

    # ---- the loop ------------------------------------------------------------------------------
    def step(self) -> list[StageOutput]:
        """Schedule and run one step; returns the outputs of the requests it changed. With async
        scheduling a step whose sequences allow it (`_overlappable`) is queued on the device and
        the step before it is read while it runs, so its outputs come with the next call. Under
        tensor parallelism a dead rank makes the step raise `RankFailure` naming it."""
        ranks = self.runner.ranks
        if ranks is None:
            return self._step()
        ranks.check()
        try:
            return self._step()
        except RankFailure:
            raise
        except Exception as e:                  # a collective with a rank that died: say so
            ranks.wait_dead(timeout=5.0)
            ranks.check()
            raise

    def _step(self) -> list[StageOutput]:
        refused = self._admit_compiled() if self._compiling else []
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return refused + self._collect_pending()
        now = time.time()
        for s in sched.scheduled:
            m = self.requests[s.seq.request_id].metrics
            m.first_scheduled_time = m.first_scheduled_time or now
        started = time.perf_counter()
        if self.config.async_scheduling and all(_overlappable(s.seq) for s in sched.scheduled):
            launched = self.runner.launch(sched, self.eos_ids, self._pending[1] if self._pending else None)
            outputs = self._collect_pending()       # step N-1's ids, read while step N runs
            self.scheduler.update(sched, {q.seq_id: PLACEHOLDER for q in launched.seqs})
            waiting = {q.seq_id for q in launched.seqs if q.status == SeqStatus.RUNNING}
            self._pending = (sched, launched, waiting)
        else:
            outputs = self._collect_pending()
            live = [s for s in sched.scheduled if not s.seq.is_finished]   # finished by the step just read
            sched = dataclasses.replace(sched, scheduled=live)
            if not live:
                return refused + outputs
            result = self.runner.execute(sched, self.eos_ids)
            self.scheduler.update(sched, result.sampled)
            outputs += self._step_outputs(sched, result)
        self._steps += 1
        self._prefill_steps += any(s.start < s.seq.prompt_len for s in sched.scheduled)
        self._step_seconds += time.perf_counter() - started
        return refused + outputs

    def _collect_pending(self) -> list[StageOutput]:
        """Read the queued step's ids into its sequences' placeholders and build its outputs."""
        if self._pending is None:
            return []
        sched, launched, waiting = self._pending
        self._pending = None
        result = self.runner.collect(launched)
        # A sequence finished or aborted before its placeholder was appended has none: its id is dropped.
        # The placeholder is still its last token: the next one is appended only after this.
        sampled = {}
        for q in launched.seqs:
            if q.seq_id in waiting:
                q.token_ids[-1] = sampled[q.seq_id] = result.sampled[q.seq_id]
        return self._step_outputs(sched, dataclasses.replace(result, sampled=sampled))

    def _step_outputs(self, sched: SchedulerOutput, result: RunnerOutput) -> list[StageOutput]:
        """Stop checks and outputs for a step whose sampled ids are in `result` (and in the sequences)."""
        now = time.time()
        # Requests that report hidden states emit an output every step they compute, sampled or not.
        # A request finished or aborted while its step was queued (async scheduling) has none.
        changed: dict[str, _Request] = {s.seq.request_id: self.requests[s.seq.request_id]
                                        for s in sched.scheduled
                                        if s.seq.seq_id in result.hidden and s.seq.request_id in self.requests}
        by_id = {s.seq.seq_id: s.seq for s in sched.scheduled}
        failed: dict[str, Exception] = {}       # request id -> what its host work raised
        sampled = result.sampled
        # one vectorized EOS check over the step's ids (a dict keeps its rows in insertion order)
        eos = np.isin(np.fromiter(sampled.values(), dtype=np.int64, count=len(sampled)), self._eos).tolist()
        for (seq_id, token), is_eos in zip(sampled.items(), eos):
            seq = by_id[seq_id]
            req = self.requests.get(seq.request_id)
            if req is None or req.request_id in failed:     # aborted while its step was queued
                continue
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            if seq_id in result.codes:
                seq.codes.append(result.codes[seq_id])
            try:
                if seq_id in result.logprobs:
                    seq.logprobs.append(self._logprobs(token, *result.logprobs[seq_id]))
                self._check_stop(seq, token, is_eos, req.lazy_text)
            except Exception as e:
                failed[req.request_id] = e
                continue
            if not req.final_only or seq.is_finished:
                changed[req.request_id] = req
        outputs = []
        for req in changed.values():
            if req.request_id in failed:
                continue
            finished = all(s.is_finished for s in req.seqs)
            if req.final_only and not finished:        # a caller reads it only once it is done
                continue
            try:
                out = StageOutput(req.request_id, self._make_output(req, finished), finished,
                                  hidden=result.hidden.get(req.seqs[0].seq_id))
            except Exception as e:
                failed[req.request_id] = e
                continue
            if finished:
                req.metrics.finished_time = now
                del self.requests[req.request_id]
            outputs.append(out)
        for rid, error in failed.items():
            logger.warning("AR request %s failed in its host work", rid, exc_info=error)
            self.abort(rid)
            if isinstance(error, ParamError):   # the request's own params ruled it out (a dead grammar): a 400
                outputs.append(StageOutput.failed(rid, StageError(str(error), refused=True, field=error.field)))
                continue
            why = f"building its output failed: {type(error).__name__}: {error}"
            outputs.append(StageOutput.failed(rid, StageError(why)))
        return outputs

    def _logprobs(self, token: int, chosen: float, top: list[tuple[int, float]]) -> TokenLogprobs:
        tok = self.tokenizer
        dec = (lambda ids: tok.decode(ids)) if tok is not None else (lambda ids: "")
        return TokenLogprobs(Logprob(token, chosen, dec([token])), [Logprob(t, lp, dec([t])) for t, lp in top])

    def _check_stop(self, seq: Sequence, token: int, is_eos: bool, lazy_text: bool = False) -> None:
        """Finish `seq` if `token` (its last, `is_eos`: one of the model's EOS ids) ends it. Its text
        advances with it, unless `lazy_text`: then it is decoded once when the sequence finishes."""
        p = seq.params
        num_out = len(seq.token_ids) - seq.prompt_len
        reason, stop_reason = None, None
        if num_out >= p.min_tokens:
            if is_eos and not p.ignore_eos:
                reason = "stop"
            elif p.stop_token_ids and token in p.stop_token_ids:
                reason, stop_reason = "stop", token
        if seq.grammar is not None:
            seq.grammar.accept(token)
            if reason is None and seq.grammar.terminated:
                reason = "stop"
        at_length = num_out >= p.max_tokens or len(seq.token_ids) >= self.max_model_len
        if reason is None and lazy_text and not at_length:   # the common case: nothing to decode or copy
            return
        out_ids = seq.output_token_ids
        text_ids = out_ids[:-1] if reason else out_ids        # the stopping token is not text
        delta = "" if lazy_text else seq.detok.update(text_ids)
        if reason is None and p.stop and delta:
            text = seq.detok.text
            start = max(0, len(text) - len(delta) - p.stop_hold)
            hits = [(text.find(s, start), s) for s in p.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                seq.detok.text = text[:i]
                reason, stop_reason = "stop", s
        if reason is None and at_length:
            reason = "length"
        if reason is not None:
            if stop_reason is None or isinstance(stop_reason, int):
                seq.detok.finalize(text_ids)
            self.scheduler.finish(seq, reason, stop_reason)
            self.runner.release(seq.seq_id)

    def _make_output(self, req: _Request, finished: bool) -> RequestOutput:
        outs = []
        for seq in req.seqs:
            text = seq.detok.text
            if not seq.is_finished and seq.params.stop:   # never stream a partial stop string
                text = text[:max(0, len(text) - seq.params.stop_hold)]
            outs.append(CompletionOutput(
                index=seq.index, text=text, token_ids=seq.output_token_ids,   # a fresh list (a slice)
                logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                codes=list(seq.codes) if seq.codes else None))     # frames are never changed once added
        return RequestOutput(request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_ids,
                             outputs=outs, finished=finished, metrics=req.metrics,
                             num_cached_tokens=req.seqs[0].num_cached_tokens, context_frames=req.context_frames)


def _overlappable(seq: Sequence) -> bool:
    """A sequence whose next step may be queued before its last sampled id is on the host. Its input
    rows may carry conditioning (prompt embeddings, multimodal rope, streamed rows: all on the device
    or known on the host before the step) and report hidden states (device tensors, read after the
    step); penalties take the queued id from the device (`TokenCounts.prepare`'s `pending`); a frame head's
    codes go to the host with the ids and its frame row stays on the device for the next step's input.
    Not: a grammar (its mask needs the last token on the host) and logprobs (read on the host in the
    step itself)."""
    return seq.grammar is None and seq.params.logprobs is None
