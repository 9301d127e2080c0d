"""Pipelines as data: which stages a model runs and how their outputs flow (any process).

A `PipelineSpec` is built once from the model folder (`pipeline.build.detect_pipeline` picks it
from the checkpoint's config), optionally overridden by a deploy YAML (`pipeline.deploy_config`),
and handed to the orchestrator. A plain LLM is an AR stage; a chat LM gains a TTS stage behind it
(a cascade) when a TTS back end is installed; omni and diffusion models add stages and edges
without changing the entry points.

Routing is data too: a request enters at one stage (the first, unless it names another), asks for
output modalities, and runs only the stages that lie on a path from its entry stage to a stage
whose `final_output` it asked for (`PipelineSpec.route`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omnistage.config import STAGE_KINDS, EngineConfig

MODALITIES = ("text", "audio", "image", "video")
RUNNERS = ("inline", "shared", "process")       # where a stage's engine runs (`StageSpec.runner`)
# Keys of `StageSpec.memory`, the hints only the GPU memory planner reads (pipeline/memory.py):
#   weights_prefix: str or list of tensor-name prefixes the stage loads (absent: every tensor)
#   weights_dtype: "float32" | "bfloat16" | "float16", the dtype a codec runs its weights in (absent: as stored)
#   lm_shape: `lm_shape(config)` of an AR component's text config (absent: from model_dir/config.json)
#   workspace_bytes: a codec / diffusion stage's activation room (absent: WORKSPACE_BYTES)
MEMORY_HINTS = frozenset({"weights_prefix", "weights_dtype", "lm_shape", "workspace_bytes"})
# Keys of `StageSpec.ray`, where a stage's Ray actors go (distributed_executor_backend "ray"; pipeline/launch.py):
#   resources: {name: amount} of custom Ray resources each replica's actor holds (a node's label, say)
#   num_cpus / num_gpus: CPUs / GPUs each actor holds (default 1 CPU; num_gpus: 1 for a cuda device, else 0)
#   node_id: the hex id of the Ray node the actors must run on
RAY_KEYS = frozenset({"resources", "num_cpus", "num_gpus", "node_id"})


@dataclass
class StageSpec:
    name: str                                   # unique in the pipeline, e.g. "llm", "thinker", "dit", "tts"
    kind: str                                   # "ar" | "diffusion" | "codec"
    model_dir: str                              # folder (or sub-folder) the stage loads; "" when the back end brings its own
    engine: EngineConfig = field(default_factory=EngineConfig)
    final_output: Optional[str] = None          # modality this stage delivers to the user, if any
    backend: Optional[str] = None               # implementation of the kind, e.g. codec "piper"
    options: dict[str, Any] = field(default_factory=dict)  # back-end settings (voices, batch limits)
    params: dict[str, Any] = field(default_factory=dict)   # default request params of this stage (field -> value)
    # "inline": in the orchestrator's process; "shared": there too, on a CUDA stream of its own (pipeline/shared.py);
    # "process": its own process (stage_client)
    runner: str = "inline"
    priority: int = 0                           # runner shared: > 0 puts its GPU work first (a high-priority stream)
    memory: dict[str, Any] = field(default_factory=dict)   # hints for the GPU memory plan (MEMORY_HINTS); engines ignore them
    replica_devices: list[str] = field(default_factory=list)  # one EngineConfig device per replica
    # (engine.num_replicas of them, e.g. ["cuda:0", "cuda:1"]); empty = every replica on engine.device
    ray: dict[str, Any] = field(default_factory=dict)      # Ray placement of the stage's actors (RAY_KEYS)

    def __post_init__(self) -> None:
        if self.kind not in STAGE_KINDS:
            raise ValueError(f"stage {self.name!r}: kind must be one of {', '.join(STAGE_KINDS)}; got {self.kind!r}")
        if self.runner not in RUNNERS:
            raise ValueError(f"stage {self.name!r}: runner must be one of {', '.join(RUNNERS)}; got {self.runner!r}")
        if not isinstance(self.priority, int) or self.priority < 0:
            raise ValueError(f"stage {self.name!r}: priority must be an integer >= 0; got {self.priority!r}")
        if self.engine.num_replicas > 1 or self.engine.distributed_executor_backend == "ray":
            self.runner = "process"             # replicas and Ray actors are stage processes by nature
        if self.replica_devices and len(self.replica_devices) != self.engine.num_replicas:
            raise ValueError(f"stage {self.name!r}: replica_devices must name one device per replica "
                             f"(num_replicas={self.engine.num_replicas}); got {self.replica_devices!r}")
        unknown = set(self.ray) - RAY_KEYS
        if unknown:
            raise ValueError(f"stage {self.name!r}: ray keys must be among {sorted(RAY_KEYS)}; got {sorted(unknown)}")
        unknown = set(self.memory) - MEMORY_HINTS
        if unknown:
            raise ValueError(f"stage {self.name!r}: memory keys must be among {sorted(MEMORY_HINTS)}; got {sorted(unknown)}")
        if self.final_output is not None and self.final_output not in MODALITIES:
            raise ValueError(f"stage {self.name!r}: final_output must be one of {', '.join(MODALITIES)}; "
                             f"got {self.final_output!r}")


@dataclass
class EdgeSpec:
    src: str                                    # upstream stage name
    dst: str                                    # downstream stage name
    adapter: str                                # registered adapter turning src output into dst input
    chunk_size: Optional[int] = None            # stream every N units (sentences, tokens); None = whole output once
    first_chunk_size: Optional[int] = None      # units in the first piece (smaller = earlier start); None = chunk_size
    options: dict[str, Any] = field(default_factory=dict)  # settings of an edge adapter (e.g. its checkpoint)

    def __post_init__(self) -> None:
        for name in ("chunk_size", "first_chunk_size"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"edge {self.src}->{self.dst}: {name} must be a positive integer or null, got {v!r}")
        if self.first_chunk_size is not None and self.chunk_size is None:
            raise ValueError(f"edge {self.src}->{self.dst}: first_chunk_size needs chunk_size (a streaming edge)")

    @property
    def streaming(self) -> bool:
        return self.chunk_size is not None

    def piece_size(self, units_sent: int) -> int:
        """Units the next piece must hold before it is sent."""
        assert self.chunk_size is not None
        return (self.first_chunk_size or self.chunk_size) if units_sent == 0 else self.chunk_size


@dataclass
class PipelineSpec:
    stages: list[StageSpec]                     # in dependency order: every edge goes forward in this list
    edges: list[EdgeSpec] = field(default_factory=list)
    model: Optional[str] = None                 # the model registry entry it serves (models/registry.py): its
    # `chat_renderer` turns chat messages into the main stage's inputs; None = the tokenizer's chat template
    renderer_weights: tuple[str, ...] = ()      # tensor-name prefixes in the main stage's folder that the chat
    # renderer loads on the main stage's device, in the entry point's process (GPU memory plan: pipeline/memory.py)

    def __post_init__(self) -> None:
        names = [s.name for s in self.stages]
        if not names:
            raise ValueError("a pipeline needs at least one stage")
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must be unique, got {names}")
        for e in self.edges:
            if e.src not in names or e.dst not in names:
                raise ValueError(f"edge {e.src}->{e.dst} names an unknown stage; stages: {names}")
            if names.index(e.src) >= names.index(e.dst):
                raise ValueError(f"edge {e.src}->{e.dst} goes backwards; list stages upstream first")

    @property
    def main_stage(self) -> StageSpec:
        return self.stages[0]

    def stage(self, name: str) -> StageSpec:
        for s in self.stages:
            if s.name == name:
                return s
        raise ValueError(f"stage must be one of {[s.name for s in self.stages]}, got {name!r}")

    def edges_from(self, name: str) -> list[EdgeSpec]:
        return [e for e in self.edges if e.src == name]

    def _reachable(self, start: str) -> set[str]:
        seen, todo = {start}, [start]
        while todo:
            for e in self.edges_from(todo.pop()):
                if e.dst not in seen:
                    seen.add(e.dst)
                    todo.append(e.dst)
        return seen

    def output_modalities(self, entry: Optional[str] = None) -> list[str]:
        """Modalities a request entering at `entry` (default: the main stage) can ask for."""
        reach = self._reachable(entry or self.main_stage.name)
        return [s.final_output for s in self.stages if s.name in reach and s.final_output]

    def final_stage(self, modality: str) -> Optional[StageSpec]:
        return next((s for s in self.stages if s.final_output == modality), None)

    def route(self, entry: str, modalities: Optional[list[str]]) -> list[str]:
        """Stages (in pipeline order) a request entering at `entry` runs to produce `modalities`.

        None means the entry stage's own output (or, for a stage with none, everything reachable).
        """
        self.stage(entry)
        reach = self._reachable(entry)
        allowed = self.output_modalities(entry)
        if modalities is None:
            own = self.stage(entry).final_output
            modalities = [own] if own else allowed
        bad = [m for m in modalities if m not in allowed]
        if bad or not modalities:
            raise ValueError(f"modalities must be a non-empty subset of {allowed}, got {list(modalities)}")
        targets = {s.name for s in self.stages if s.name in reach and s.final_output in modalities}
        return [s.name for s in self.stages
                if s.name in reach and (s.name == entry or self._reachable(s.name) & targets)]
