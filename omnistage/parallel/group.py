"""Rank launch and the process group: how N ranks of one engine start, find each other and talk.

In: a `ParallelInit` (world size, backend, rendezvous address, device type) built once by the
owner of the engine (`ParallelInit.for_engine`). Out: ranks 1..N-1 as `spawn`ed processes
(`spawn_ranks` -> `RankWorkers`), or, when the stage's `distributed_executor_backend` is "ray", as
Ray actors placed with the stage's `ray:` settings (`parallel/ray_ranks.py` -> `RayRankWorkers`, the
same verbs), each running `target(init, rank, *args)`; rank 0 stays in the calling process (the
stage process: scheduler, sampler) and joins with `init_rank(init, 0)`.

Which process runs what: rank 0 is the caller; ranks >= 1 are child processes (or Ray actors' worker
processes, maybe on other nodes) that only run the forward on their shard. Each step rank 0 sends one small command (`StepChannel.send`: a dataclass of
ints and lists, pickled, broadcast over a gloo group even when the tensors use NCCL, so that the
command never waits on the device); the others receive it (`StepChannel.recv`). Tensors go by
`torch.distributed` collectives, never through the channel.

A rank that dies is seen two ways: its process is no longer `alive()`, and a collective with it
raises on the others (gloo: the peer's socket closes). The owner then fails its requests, closes the
workers and may start them again.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from omnistage.config import EngineConfig
from omnistage.parallel import ray_ranks

BACKENDS = ("gloo", "nccl")
DEVICE_TYPES = ("cpu", "cuda")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the rendezvous address of a group)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ParallelInit:
    """Everything a rank needs to join the group; small and picklable (it crosses to child processes)."""

    world_size: int                 # number of ranks (processes), >= 1
    backend: str                    # torch.distributed backend for tensors: "gloo" (CPU) or "nccl" (CUDA)
    init_method: str                # rendezvous address, "tcp://HOST:PORT" (127.0.0.1; rank 0's node IP under Ray)
    device_type: str                # "cpu" or "cuda": where each rank's shard lives
    first_device: int = 0           # CUDA index of rank 0; rank r uses first_device + r (spawned ranks)
    timeout_s: float = 600.0        # collective / rendezvous timeout, seconds (a hung peer fails after it)
    ray_address: Optional[str] = None   # set: ranks 1..N-1 are Ray actors of the cluster there; None: spawned
    ray_place: dict = field(default_factory=dict)   # the stage's `ray:` settings each rank's actor asks for
    local_device: Optional[int] = None  # CUDA index this process computes on when not first_device + rank
    # (a Ray actor sees only the GPUs Ray gave it, from cuda:0)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.device_type not in DEVICE_TYPES:
            raise ValueError(f"device_type must be one of {DEVICE_TYPES}, got {self.device_type!r}")
        if self.backend == "nccl" and self.device_type != "cuda":
            raise ValueError("backend 'nccl' needs device_type 'cuda'; use 'gloo' on CPU")

    @classmethod
    def for_device(cls, device: "str | torch.device", world_size: int, option: str = "tensor_parallel_size",
                   ray_address: Optional[str] = None, ray_place: Optional[dict] = None) -> "ParallelInit":
        """gloo on CPU, nccl on CUDA; a fresh loopback port, and a check that the world fits the visible
        devices. With `ray_address` the other ranks will be Ray actors: the rendezvous is on this node's
        IP, and only rank 0's device must be visible here (Ray finds the others' GPUs)."""
        dev = torch.device(device)
        if dev.type not in DEVICE_TYPES:
            raise ValueError(f"{option} > 1 runs on 'cpu' (gloo) or 'cuda' (nccl), not {dev.type!r}")
        first = (dev.index or 0) if dev.type == "cuda" else 0
        if dev.type == "cuda":
            check_world_fits_devices(world_size if ray_address is None else 1, first, option)
        method = ray_ranks.rendezvous_address(ray_address) if ray_address else f"tcp://127.0.0.1:{free_port()}"
        return cls(world_size, "nccl" if dev.type == "cuda" else "gloo", method, dev.type, first_device=first,
                   ray_address=ray_address, ray_place=dict(ray_place or {}))

    @classmethod
    def for_engine(cls, config: EngineConfig, world_size: int,
                   option: str = "tensor_parallel_size") -> "ParallelInit":
        """`for_device` of an engine's config: its device, and Ray actors for the other ranks when its
        `distributed_executor_backend` is "ray" (each asking for `config.ray_placement`)."""
        ray = config.distributed_executor_backend == "ray"
        return cls.for_device(config.torch_device(), world_size, option,
                              ray_address=config.ray_address if ray else None, ray_place=config.ray_placement)

    def device(self, rank: int) -> torch.device:
        """The device rank `rank` computes on (in its own process)."""
        if self.device_type == "cuda":
            return torch.device("cuda", self.local_device if self.local_device is not None else self.first_device + rank)
        return torch.device("cpu")


def check_world_fits_devices(world_size: int, first_device: int = 0,
                             option: str = "tensor_parallel_size") -> None:
    """ValueError naming `option` when ranks first_device..first_device+world_size-1 are not all visible."""
    visible = torch.cuda.device_count()
    if first_device + world_size > visible:
        fits = max(visible - first_device, 0)
        raise ValueError(
            f"{option}={world_size} needs {world_size} CUDA devices from cuda:{first_device}, but "
            f"{visible} are visible; use {option} <= {fits} or make more devices visible "
            f"(CUDA_VISIBLE_DEVICES)")


def divisors_up_to(n: int, limit: int) -> list[int]:
    """The sizes 1..limit that divide n (what a parallel size may be for a count of n)."""
    return [d for d in range(1, max(limit, 1) + 1) if n % d == 0]


def check_divides(option: str, size: int, **counts: int) -> None:
    """ValueError naming `option` unless `size` divides every count (e.g. num_heads=12, vocab_size=...)."""
    if size < 1:
        raise ValueError(f"{option} must be >= 1, got {size}")
    for name, n in counts.items():
        if n % size:
            ok = [d for d in divisors_up_to(n, max(size * 2, 8)) if all(c % d == 0 for c in counts.values())]
            raise ValueError(f"{option}={size} does not divide {name}={n}; sizes that would work: {ok}")


_STATE: dict[str, Any] = {"init": None, "control": None}


def init_rank(init: ParallelInit, rank: int) -> None:
    """Join the default process group as `rank` (CUDA: set the device first_device + rank)."""
    if init.device_type == "cuda":
        torch.cuda.set_device(init.device(rank))
    timeout = timedelta(seconds=init.timeout_s)
    dist.init_process_group(init.backend, init_method=init.init_method, world_size=init.world_size,
                            rank=rank, timeout=timeout)
    # the step channel always goes over gloo (host memory), so sending a command never syncs a device
    control = dist.new_group(backend="gloo", timeout=timeout) if init.backend != "gloo" else None
    _STATE["init"], _STATE["control"] = init, control


def world_size() -> int:
    """Ranks in the default group (1 when no group was initialised)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank (0 when no group was initialised)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_parallel() -> bool:
    """True when this process is one of several ranks."""
    return world_size() > 1


def control_group() -> Optional[Any]:
    """The gloo group step commands go over (None: the default group, already gloo)."""
    return _STATE["control"]


def destroy() -> None:
    """Leave the process group (safe to call twice, or when none was made)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _STATE["init"], _STATE["control"] = None, None


class RankWorkers:
    """The child processes of ranks 1..N-1; rank 0 is the owner's own process."""

    def __init__(self, init: ParallelInit, procs: Sequence[mp.process.BaseProcess]):
        self.init = init
        self.procs = list(procs)         # procs[i] runs rank i + 1

    def alive(self) -> bool:
        """True while every child rank is running."""
        return all(p.is_alive() for p in self.procs)

    def dead_ranks(self) -> list[int]:
        """Ranks whose process has ended, with their exit codes folded into the message by the owner."""
        return [i + 1 for i, p in enumerate(self.procs) if not p.is_alive()]

    def exit_codes(self) -> dict[int, Optional[int]]:
        """rank -> exit code (None while running)."""
        return {i + 1: p.exitcode for i, p in enumerate(self.procs)}

    def wait(self, timeout: float) -> None:
        """Wait up to `timeout` seconds (in all) for the ranks to end."""
        for p in self.procs:
            p.join(timeout / max(len(self.procs), 1))

    def close(self, timeout: float = 10.0) -> None:
        """Wait up to `timeout` seconds for the ranks to end by themselves, then kill the rest."""
        for p in self.procs:
            p.join(timeout)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5.0)
        self.procs = []


def spawn_ranks(init: ParallelInit, target: Callable[..., Any], args: tuple = ()) -> Any:
    """Start ranks 1..N-1 running `target(init, rank, *args)` (module-level, picklable): `spawn`
    processes (`RankWorkers`), or Ray actors when `init.ray_address` is set (`ray_ranks.RayRankWorkers`).

    The caller then calls `init_rank(init, 0)` itself; the group forms when all N have joined.
    """
    if init.ray_address is not None:
        return ray_ranks.start_ray_ranks(init, target, args)
    ctx = mp.get_context("spawn")
    procs = []
    for r in range(1, init.world_size):
        p = ctx.Process(target=target, args=(init, r, *args), name=f"omnistage-rank{r}", daemon=True)
        p.start()
        procs.append(p)
    return RankWorkers(init, procs)


class StepChannel:
    """Rank 0 -> all ranks: one small picklable command per step (ints, lists, small dataclasses).

    `send` on rank 0 and `recv` on the others must pair up one to one, like any collective. The
    payload is pickled and broadcast as bytes: first its length, then the bytes.
    """

    def __init__(self, src: int = 0):
        self.src = src                    # the rank that sends (the scheduler's rank)
        self.group = control_group()      # gloo group (None: the default group)
        self._len = torch.zeros(1, dtype=torch.int64)

    def send(self, obj: Any) -> None:
        """Broadcast `obj` from this rank (must be `src`)."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self._len[0] = len(data)
        dist.broadcast(self._len, self.src, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), self.src, group=self.group)

    def recv(self) -> Any:
        """Receive the next command from `src`."""
        dist.broadcast(self._len, self.src, group=self.group)
        buf = torch.empty(int(self._len[0]), dtype=torch.uint8)
        dist.broadcast(buf, self.src, group=self.group)
        return pickle.loads(buf.numpy().tobytes())
