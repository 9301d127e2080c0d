"""Tensor parallelism for the AR engine: rank 0's handle on the other ranks, and their loop.

Process layout (`tensor_parallel_size` = N > 1): the AR engine's own process is rank 0: it holds the
scheduler, the sampler, the detokenizer and its shard of the model. Ranks 1..N-1 are `spawn`ed
processes, or Ray actors under `distributed_executor_backend: ray` (`parallel/group.spawn_ranks`), that run `run_rank`: load their shard (same loader, inside
`parallel.tensor.sharding`), then follow rank 0's commands until `Stop`:

  Allocate(num_blocks)   make the KV cache (sized per rank: this rank's KV heads only)
  Profile(tokens, rows)  run the CUDA memory profile's largest step with rank 0 (its collectives),
                         then free the one-block cache it ran on
  Step                   one step's rows (ar/step_inputs.py; block tables as diffs against the
                         rank's copy, `BlockTables`): rebuild the tensors, receive the
                         placeholder ids / conditioned embeddings rank 0 broadcasts, run the forward,
                         join the logits gather (only rank 0 samples)
  Stop                   leave the group and exit

Commands are small picklable dataclasses sent over `parallel/group.StepChannel`; tensors (ids filled
from the previous step's samples, embedding rows) go by `torch.distributed.broadcast`. A rank that
dies makes rank 0's next command or collective raise `RankFailure` naming it: the step fails, the
stage's requests fail with that message, and every later step fails at once.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from omnistage.ar.runner import ModelRunner, logit_rows, profile_step, split_outputs
from omnistage.ar.step_inputs import StepInputs
from omnistage.config import EngineConfig
from omnistage.parallel import group
from omnistage.parallel.tensor import sharding

logger = logging.getLogger(__name__)


@dataclass
class Allocate:
    num_blocks: int                             # KV blocks of the pool (the runner adds one scratch block)


@dataclass
class Profile:
    tokens: int                                 # rows of the profiled prefill step
    rows: int                                   # of them, rows whose logits are computed


@dataclass
class Stop:
    pass


@dataclass
class Step:
    """One step as it crosses: the rows, with block tables replaced by what changed since the last step."""

    inputs: StepInputs                          # the step's rows; `block_tables` empty
    tables: dict[str, tuple[int, list[int]]]    # seq_id -> (blocks kept of the rank's copy, blocks appended)
    dropped: list[str]                          # seq ids whose tables the ranks forget (finished or aborted)


class BlockTables:
    """The block tables the other ranks hold, per sequence: rank 0 keeps their copy to send diffs (a
    decode step of a long sequence sends nothing, or the one block it just got); ranks apply them."""

    def __init__(self) -> None:
        self.held: dict[str, list[int]] = {}    # seq_id -> its table as the ranks have it
        self.dropped: list[str] = []            # forgotten since the last step (sent with the next)

    def diff(self, inputs: StepInputs) -> Step:
        """Rank 0: the step to send, and the copy updated to match."""
        changes = {}
        for sid, table in zip(inputs.seq_ids, inputs.block_tables):
            held = self.held.get(sid)
            n = 0 if held is None else len(held)
            if held is not None and n <= len(table) and table[:n] == held:
                if len(table) > n:              # grew: send the new blocks
                    changes[sid] = (n, table[n:])
                    held.extend(table[n:])
            else:                               # new, or re-allocated (preempted): send it whole
                changes[sid] = (0, list(table))
                self.held[sid] = list(table)
        dropped, self.dropped = self.dropped, []
        return Step(dataclasses.replace(inputs, block_tables=[]), changes, dropped)

    def drop(self, seq_id: str) -> None:
        if self.held.pop(seq_id, None) is not None:
            self.dropped.append(seq_id)

    def apply(self, step: Step) -> StepInputs:
        """Ranks >= 1: the step's rows with full block tables from this rank's copy."""
        for sid in step.dropped:
            self.held.pop(sid, None)
        for sid, (keep, new) in step.tables.items():
            self.held[sid] = self.held.get(sid, [])[:keep] + new
        return dataclasses.replace(step.inputs, block_tables=[self.held[sid] for sid in step.inputs.seq_ids])


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or its group broke; the engine cannot step any more."""


class RankGroup:
    """Rank 0's side: the other ranks' processes, and the channel their commands go over."""

    def __init__(self, init: group.ParallelInit, workers: group.RankWorkers):
        self.init = init                        # how the group was formed
        self.workers = workers                  # ranks 1..N-1
        self.channel = group.StepChannel()
        self.failure: Optional[str] = None      # why the group broke (then every call raises it)
        self.tables = BlockTables()             # the block tables the ranks hold

    @classmethod
    def start(cls, init: group.ParallelInit, model_dir: str, loader: Callable, config: EngineConfig) -> "RankGroup":
        """Start ranks 1..N-1 (each loads its shard) and join the group as rank 0."""
        workers = group.spawn_ranks(init, run_rank, (model_dir, loader, config))
        try:
            group.init_rank(init, 0)
        except Exception:
            workers.close(timeout=1.0)
            raise
        return cls(init, workers)

    def check(self) -> None:
        """RankFailure when a rank has died (or the group broke before)."""
        if self.failure is None and not self.workers.alive():
            codes = {r: c for r, c in self.workers.exit_codes().items() if c is not None}
            self.failure = (f"tensor-parallel rank(s) {sorted(codes)} died (exit codes {codes}); this AR stage "
                            f"(tensor_parallel_size={self.init.world_size}) cannot run until it is restarted")
        if self.failure is not None:
            raise RankFailure(self.failure)

    def wait_dead(self, timeout: float) -> None:
        """After a failed collective: give a rank that is dying `timeout` seconds to be seen dead."""
        self.workers.wait(timeout)

    def guarded(self, fn: Callable[[], Any]) -> Any:
        """Run a collective; a failure there becomes RankFailure naming the dead rank when one died."""
        self.check()
        try:
            return fn()
        except RankFailure:
            raise
        except Exception as e:
            self.wait_dead(timeout=5.0)
            self.check()                         # a dead rank explains it
            self.failure = f"tensor-parallel group broke: {type(e).__name__}: {e}"
            raise RankFailure(self.failure) from e

    def send(self, command: Any) -> None:
        self.guarded(lambda: self.channel.send(command))

    def allocate(self, num_blocks: int) -> None:
        self.send(Allocate(num_blocks))

    def profile(self, tokens: int, rows: int) -> None:
        self.send(Profile(tokens, rows))

    def send_step(self, inputs: StepInputs, ids: torch.Tensor) -> None:
        """The step's rows, then its ids when some came from the step before (device to device)."""
        def go():
            self.channel.send(self.tables.diff(inputs))
            if inputs.fill:
                dist.broadcast(ids, 0)
        self.guarded(go)

    def send_embeds(self, x: torch.Tensor) -> None:
        """The step's input rows after conditioning (only rank 0 holds a request's embeddings)."""
        self.guarded(lambda: dist.broadcast(x, 0))

    def close(self, timeout: float = 30.0) -> None:
        if self.failure is None and self.workers.alive():
            try:
                self.channel.send(Stop())
            except Exception:                   # a rank died while stopping: it is killed below
                logger.warning("tensor-parallel ranks did not take Stop; killing them")
        group.destroy()
        self.workers.close(timeout)


def run_rank(init: group.ParallelInit, rank: int, model_dir: str, loader: Callable, config: EngineConfig) -> None:
    """A rank >= 1: join the group, load this rank's shard, follow rank 0's commands until Stop."""
    if init.device_type == "cpu":
        torch.set_num_threads(config.cpu_threads or 1)
    group.init_rank(init, rank)
    device, dtype = init.device(rank), config.torch_dtype()
    with sharding(init.world_size, rank):
        model = loader(model_dir, device, dtype, config.max_model_len)[0]
    runner = ModelRunner(model, device, dtype, config.block_size, config.seed)
    channel, tables = group.StepChannel(), BlockTables()
    try:
        with torch.inference_mode():
            while True:
                cmd = channel.recv()
                if isinstance(cmd, Stop):
                    break
                if isinstance(cmd, Allocate):
                    runner.allocate_kv_cache(cmd.num_blocks)
                elif isinstance(cmd, Profile):         # after Allocate(1), as on rank 0
                    profile_step(model, cmd.tokens, cmd.rows, device)
                    runner.free_kv_cache()
                else:
                    _step(model, tables.apply(cmd), device)
    finally:
        group.destroy()


def _step(model, inputs: StepInputs, device: torch.device) -> None:
    """This rank's part of one step: the same collectives as rank 0's `ModelRunner.launch`, in order."""
    ids, pos, meta = inputs.tensors(device)
    if inputs.fill:
        dist.broadcast(ids, 0)
    x = None
    if inputs.embeds:
        x = model.embed_tokens(ids)
        dist.broadcast(x, 0)
    hidden = split_outputs(model(ids, pos, meta, inputs_embeds=x))[0]
    if inputs.logit_rows:
        model.compute_logits(logit_rows(hidden, list(inputs.logit_rows)))
