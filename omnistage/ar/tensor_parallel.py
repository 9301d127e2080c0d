"""Tensor parallelism for the AR engine: rank 0's handle on the other ranks, and their loop.

Process layout (`tensor_parallel_size` = N > 1): the AR engine's own process is rank 0: it holds the
scheduler, the sampler, the detokenizer and its shard of the model. Ranks 1..N-1 are `spawn`ed
processes (`parallel/group.spawn_ranks`) that run `run_rank`: load their shard (same loader, inside
`parallel.tensor.sharding`), then follow rank 0's commands until `Stop`:

  Allocate(num_blocks)   make the KV cache (sized per rank: this rank's KV heads only)
  Profile(tokens, rows)  run the CUDA memory profile's largest step with rank 0 (its collectives)
  StepInputs             one step's rows (ar/step_inputs.py): rebuild the tensors, receive the
                         placeholder ids / conditioned embeddings rank 0 broadcasts, run the forward,
                         join the logits gather (only rank 0 samples)
  Stop                   leave the group and exit

Commands are small picklable dataclasses sent over `parallel/group.StepChannel`; tensors (ids filled
from the previous step's samples, embedding rows) go by `torch.distributed.broadcast`. A rank that
dies makes rank 0's next command or collective raise `RankFailure` naming it: the step fails, the
stage's requests fail with that message, and every later step fails at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from omnistage.ar.runner import ModelRunner, logit_rows, profile_step
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


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or its group broke; the engine cannot step any more."""


class RankGroup:
    """Rank 0's side: the other ranks' processes, and the channel their commands go over."""

    def __init__(self, init: group.ParallelInit, workers: group.RankWorkers):
        self.init = init                        # how the group was formed
        self.workers = workers                  # ranks 1..N-1
        self.channel = group.StepChannel()
        self.failure: Optional[str] = None      # why the group broke (then every call raises it)

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
        for p in self.workers.procs:
            p.join(timeout / max(len(self.workers.procs), 1))

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
            self.channel.send(inputs)
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
        self.workers.close(timeout)
        group.destroy()


def run_rank(init: group.ParallelInit, rank: int, model_dir: str, loader: Callable, config: EngineConfig) -> None:
    """A rank >= 1: join the group, load this rank's shard, follow rank 0's commands until Stop."""
    if init.device_type == "cpu":
        torch.set_num_threads(config.cpu_threads or 1)
    group.init_rank(init, rank)
    device, dtype = init.device(rank), config.torch_dtype()
    with sharding(init.world_size, rank):
        model = loader(model_dir, device, dtype, config.max_model_len)[0]
    runner = ModelRunner(model, device, dtype, config.block_size, config.seed)
    channel = group.StepChannel()
    try:
        with torch.inference_mode():
            while True:
                cmd = channel.recv()
                if isinstance(cmd, Stop):
                    break
                if isinstance(cmd, Allocate):
                    runner.allocate_kv_cache(cmd.num_blocks)
                elif isinstance(cmd, Profile):
                    runner.allocate_kv_cache(1)
                    profile_step(model, cmd.tokens, cmd.rows, device)
                    runner.free_kv_cache()
                else:
                    _step(model, cmd, device)
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
    hidden = model(ids, pos, meta, inputs_embeds=x)
    if inputs.logit_rows:
        model.compute_logits(logit_rows(hidden, list(inputs.logit_rows)))
