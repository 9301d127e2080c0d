"""Where a stage process runs: on this host (`LocalLauncher`) or under a Ray actor on a node of a Ray
cluster (`RayLauncher`) (the orchestrator's process; `_StageHost`'s methods run in the Ray worker).

In: a `StageSpec` (its `engine.distributed_executor_backend`, `engine.ray_address` and `ray` placement)
and the stage process's arguments (`-m omnistage.pipeline.stage_client CMD OUT CHK [inline]`). Out: a
process handle with the Popen verbs `StageClient` uses (`pid`, `poll`, `wait`, `kill`, `returncode`),
the endpoints the client binds its sockets to (`ipc://` files on this host; `tcp://` on this node's
address for a Ray actor, which may be on another host) and `remote`: whether the process runs on
another Ray node, where `pipeline.wire` must carry arrays inline in the messages (no shared memory or
CUDA IPC across hosts). A Ray actor placed on the orchestrator's own node keeps shared memory / CUDA IPC.

The Ray actor holds what the deploy config asks for (`ray: {resources, num_cpus, num_gpus, node_id}`;
a cuda stage holds one GPU by default) and runs the stage process as its child, so the process is
the same program whichever backend started it; a stage process exits when its actor goes, and an
actor goes with the orchestrator's Ray driver. Every node needs omnistage installed (the same
version) and the model folders at the same paths.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from typing import Any, Optional

from omnistage.parallel.ray_ranks import actor_options, connect_ray

# environment the driver hands to a Ray stage process (the node's own environment is the base)
_PASSED_ENV = re.compile(r"^(PYTHONPATH|HF_.*|OMNISTAGE_.*|OMP_NUM_THREADS|TRANSFORMERS_.*)$")


class LocalLauncher:
    """Stage processes as children of this process; sockets are ipc files in the client's folder."""

    remote = False                              # same host: shared memory and CUDA IPC carry arrays

    def prepare(self, timeout_s: float) -> None:
        """Nothing to place on this host."""

    def endpoint(self, base: str, name: str) -> str:
        return f"ipc://{base}.{name}"

    def stage_spec(self, spec: Any) -> Any:
        return spec

    def start(self, args: list[str]) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, *args])

    def close(self) -> None:
        """Nothing to release."""


def launcher_for(spec: Any) -> Any:
    """The launcher of a stage spec's `engine.distributed_executor_backend`."""
    if spec.engine.distributed_executor_backend == "ray":
        return RayLauncher(spec)
    return LocalLauncher()


class _StageHost:
    """A Ray actor that runs one stage process on its node and reports on it (Ray worker process)."""

    def __init__(self):
        self.proc: Optional[subprocess.Popen] = None

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def start(self, args: list[str], env: dict[str, str]) -> int:
        self.proc = subprocess.Popen([sys.executable, *args], env={**os.environ, **env})
        return self.proc.pid

    def wait(self) -> int:
        """Blocks (in one of the actor's threads) until the stage process exits: its exit code."""
        return self.proc.wait()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class RayProcess:
    """Popen's verbs for a stage process that a `_StageHost` actor runs; `poll` never blocks (it looks
    at the actor's pending `wait` call). An actor lost with its node reads as exit code -1."""

    def __init__(self, ray: Any, actor: Any, pid: int):
        self._ray, self._actor = ray, actor
        self.pid = pid                          # on the actor's host
        self.returncode: Optional[int] = None
        self.actor_lost = False                 # True when the actor itself died (its node went away)
        self._exit = actor.wait.remote()

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            done, _ = self._ray.wait([self._exit], timeout=0)
            if done:
                self._read(done[0])
        return self.returncode

    def _read(self, ref: Any) -> None:
        try:
            self.returncode = self._ray.get(ref)
        except Exception:                       # RayActorError: the actor (or its node) is gone
            self.returncode, self.actor_lost = -1, True

    def wait(self, timeout: Optional[float] = None) -> int:
        done, _ = self._ray.wait([self._exit], timeout=timeout)
        if not done:
            raise subprocess.TimeoutExpired("stage process", timeout)
        self._read(done[0])
        return self.returncode

    def kill(self) -> None:
        try:
            self._ray.get(self._actor.kill.remote(), timeout=30)
        except Exception:                       # the actor is gone already: so is its process
            self.actor_lost = True


class RayLauncher:
    """Stage processes under a `_StageHost` actor placed by the stage's `ray` settings; one actor
    per client, kept across restarts of its process (a new one only when the actor itself died)."""

    def __init__(self, spec: Any):
        self.ray = connect_ray(spec.engine.ray_address)
        self.name = spec.name
        self.ip = self.ray.util.get_node_ip_address()
        self.options = ray_options(spec, self.ray)
        self.gpus = self.options["num_gpus"] > 0
        self.actor: Any = None
        self.node_id: Optional[str] = None      # the Ray node the actor runs on
        self.remote = False                     # the actor's node is not the orchestrator's
        self._proc: Optional[RayProcess] = None

    def prepare(self, timeout_s: float) -> None:
        """Places the actor (blocks until Ray has found it a node, at most `timeout_s`)."""
        if self.actor is not None and not (self._proc is not None and self._proc.actor_lost):
            return
        self.close()
        cls = self.ray.remote(max_concurrency=4)(_StageHost)
        self.actor = cls.options(**self.options).remote()
        try:
            self.node_id = self.ray.get(self.actor.node_id.remote(), timeout=timeout_s)
        except Exception as e:
            raise RuntimeError(f"stage {self.name!r}: Ray placed no actor in {timeout_s:.0f} s with "
                               f"{self.options} ({type(e).__name__}); check the stage's `ray:` settings against "
                               "`ray status`") from e
        self.remote = self.node_id != self.ray.get_runtime_context().get_node_id()

    def endpoint(self, base: str, name: str) -> str:
        return f"tcp://{self.ip}:*"             # the bound port is read back (zmq LAST_ENDPOINT)

    def stage_spec(self, spec: Any) -> Any:
        """The spec the actor's process builds: an actor holding GPUs sees them as cuda:0.. (Ray sets
        CUDA_VISIBLE_DEVICES), so a cuda:N device becomes cuda:0. The stage's `ray:` settings go with
        the engine's config: its parallel ranks 1..N-1 (Ray actors too) ask for the same."""
        engine = dataclasses.replace(spec.engine, ray_placement=dict(spec.ray))
        if self.gpus and spec.engine.device.startswith("cuda"):
            engine = dataclasses.replace(engine, device="cuda:0")
        return dataclasses.replace(spec, engine=engine)

    def start(self, args: list[str]) -> RayProcess:
        env = {k: v for k, v in os.environ.items() if _PASSED_ENV.match(k)}
        pid = self.ray.get(self.actor.start.remote(args, env), timeout=60)
        self._proc = RayProcess(self.ray, self.actor, pid)
        return self._proc

    def close(self) -> None:
        if self.actor is not None:
            try:
                self.ray.kill(self.actor)
            except Exception:                   # already gone
                pass
            self.actor = None


def ray_options(spec: Any, ray: Any) -> dict[str, Any]:
    """`actor.options(...)` of a stage's `ray` settings: resources, CPUs, GPUs, a node."""
    return actor_options(spec.ray, spec.engine.device, f"stage {spec.name!r}")
