"""Parallel ranks 1..N-1 of one engine as Ray actors (`distributed_executor_backend: ray`), and the Ray
helpers the stage launcher shares (joining a cluster, an actor's options from a stage's `ray:` settings).

In: a `ParallelInit` whose `ray_address` is set (`ParallelInit.for_engine` does it for a stage under
Ray), the rank's `target(init, rank, *args)` (module-level, picklable) and its arguments. Out:
`RayRankWorkers`, the same verbs as `group.RankWorkers` (`alive`, `dead_ranks`, `exit_codes`,
`wait`, `close`), so the engines owning the ranks do not know which launcher started them.

Which process runs what: `start_ray_ranks` runs in rank 0's process (the stage process), joined to
the cluster as a Ray driver; it places one `_RankHost` actor per rank with the stage's `ray:`
resources (one GPU each on CUDA, unless `num_gpus` says otherwise), waits until Ray has put each on
a node, then calls `run` on it. `_RankHost.run` runs in the actor's Ray worker process, which may be
on another node: it calls `target` there, which joins rank 0's group at `init.init_method` (rank 0's
node IP as Ray reports it, so other nodes reach it). An actor holding a GPU sees it as cuda:0 (Ray
sets CUDA_VISIBLE_DEVICES), so the rank computes on cuda:0 of its own process (`local_device`).
A rank is alive while its `run` call is pending: it ends when the target returns (exit code 0),
raises (1) or its actor or node dies (-1). Every node needs omnistage installed at the same path.
"""

from __future__ import annotations

import dataclasses
import socket
from typing import Any, Callable, Optional

RAY_EXTRA = "pip install 'omnistage[ray]' (ray==2.60.0)"
PLACE_TIMEOUT_S = 300.0                 # how long Ray may take to place a rank's actor (worker start-up included)


def import_ray():
    """The `ray` module; RuntimeError naming the `omnistage[ray]` extra when it is not installed."""
    try:
        import ray
    except ImportError as e:
        raise RuntimeError(f"distributed_executor_backend='ray' needs Ray, which is not installed: {RAY_EXTRA}") from e
    return ray


def connect_ray(address: str):
    """The `ray` module, this process joined to the cluster at `address` (once per process); a
    ValueError naming `ray_address` when there is no cluster there."""
    ray = import_ray()
    if not ray.is_initialized():
        try:
            ray.init(address=address, ignore_reinit_error=True)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ValueError(f"distributed_executor_backend='ray': cannot join the Ray cluster at ray_address="
                             f"{address!r} ({e}); start one with `ray start --head` or pass --ray-address "
                             "HOST:PORT of a running cluster") from e
    return ray


def actor_options(place: dict, device: str, who: str) -> dict[str, Any]:
    """`actor.options(...)` of `ray:` settings (resources, num_cpus, num_gpus, node_id) for an actor
    computing on `device`; ValueError naming `ray.KEY` and `who` (the stage) when a setting is bad."""
    cuda = device.startswith("cuda")
    options: dict[str, Any] = {"num_cpus": place.get("num_cpus", 1), "num_gpus": place.get("num_gpus", 1 if cuda else 0),
                               "resources": dict(place.get("resources") or {})}
    for key in ("num_cpus", "num_gpus"):
        if not isinstance(options[key], (int, float)) or options[key] < 0:
            raise ValueError(f"{who}: ray.{key} must be a number >= 0, got {options[key]!r}")
    if cuda and options["num_gpus"] == 0:
        raise ValueError(f"{who}: device {device} needs ray.num_gpus > 0 (the actor's GPUs)")
    if place.get("node_id"):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(place["node_id"], soft=False)
    return options


def rendezvous_address(ray_address: str) -> str:
    """`tcp://IP:PORT` for rank 0's group: this node's IP as Ray reports it (reachable from the other
    nodes, unlike 127.0.0.1) and a port free on it a moment ago."""
    ip = connect_ray(ray_address).util.get_node_ip_address()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
        return f"tcp://{ip}:{s.getsockname()[1]}"


class _RankHost:
    """A Ray actor that runs one rank (its Ray worker process, on whichever node Ray chose)."""

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def run(self, init: Any, rank: int, target: Callable[..., Any], args: tuple) -> None:
        """`target(init, rank, *args)` here; returns when the rank has left the group."""
        if init.device_type == "cuda":          # the actor sees its GPU(s) only, from cuda:0
            init = dataclasses.replace(init, local_device=0)
        target(init, rank, *args)


class RayRankWorkers:
    """Ranks 1..N-1 as Ray actors; rank 0 is the owner's own process (see `group.RankWorkers`)."""

    def __init__(self, init: Any, ray: Any, actors: list, runs: list, node_ids: list[str]):
        self.init = init
        self._ray = ray
        self.actors = actors                    # actors[i] runs rank i + 1
        self.runs = runs                        # runs[i]: the pending `run` call of rank i + 1
        self.node_ids = node_ids                # node_ids[i]: the Ray node rank i + 1 runs on
        self._codes: dict[int, int] = {}        # rank -> exit code, once its run has ended

    def _poll(self, timeout: float = 0.0) -> None:
        pending = [ref for i, ref in enumerate(self.runs) if i + 1 not in self._codes]
        if not pending:
            return
        done, _ = self._ray.wait(pending, num_returns=len(pending), timeout=timeout)
        for ref in done:
            rank = self.runs.index(ref) + 1
            try:
                self._ray.get(ref)
                self._codes[rank] = 0
            except self._ray.exceptions.RayActorError:   # the actor (or its node) is gone
                self._codes[rank] = -1
            except Exception:                   # the rank raised (logged by Ray with its traceback)
                self._codes[rank] = 1

    def alive(self) -> bool:
        """True while every rank's `run` is going."""
        self._poll()
        return not self._codes

    def dead_ranks(self) -> list[int]:
        """Ranks whose run has ended."""
        self._poll()
        return sorted(self._codes)

    def exit_codes(self) -> dict[int, Optional[int]]:
        """rank -> exit code (0 returned, 1 raised, -1 actor lost; None while running)."""
        self._poll()
        return {i + 1: self._codes.get(i + 1) for i in range(len(self.runs))}

    def wait(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the ranks to end."""
        self._poll(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Wait up to `timeout` seconds for the ranks to end by themselves, then kill the actors."""
        if self.runs:
            self._poll(timeout)
        for actor in self.actors:
            try:
                self._ray.kill(actor)
            except Exception:                   # already gone
                pass
        self.actors, self.runs = [], []


def start_ray_ranks(init: Any, target: Callable[..., Any], args: tuple = ()) -> RayRankWorkers:
    """Place one actor per rank 1..N-1 with `init.ray_place`, then start `target(init, rank, *args)` on each.

    RuntimeError naming the settings when Ray places no actor within PLACE_TIMEOUT_S (e.g. no node has
    the resources asked for). The caller then joins the group as rank 0 (`group.init_rank(init, 0)`).
    """
    ray = connect_ray(init.ray_address)
    device = "cuda" if init.device_type == "cuda" else "cpu"
    options = actor_options(init.ray_place, device, "parallel ranks")
    cls = ray.remote(_RankHost)
    actors = [cls.options(**options).remote() for _ in range(1, init.world_size)]
    try:
        node_ids = ray.get([a.node_id.remote() for a in actors], timeout=PLACE_TIMEOUT_S)
    except Exception as e:
        for a in actors:
            ray.kill(a)
        raise RuntimeError(f"Ray placed no actor for parallel ranks 1..{init.world_size - 1} in {PLACE_TIMEOUT_S:.0f} s "
                           f"with {options} ({type(e).__name__}); each rank asks for the stage's `ray:` settings: "
                           "check them against `ray status`") from e
    runs = [a.run.remote(init, r, target, args) for r, a in enumerate(actors, start=1)]
    return RayRankWorkers(init, ray, actors, runs, node_ids)
