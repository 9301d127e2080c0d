"""Pipelines as data: which stages a model runs and how their outputs flow.

A `PipelineSpec` is built once from the model folder (the registry picks it from the checkpoint's
config) and handed to the orchestrator. A plain LLM is a one-stage pipeline; omni and diffusion
models add stages and edges without changing the entry points.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Optional

from omnistage.config import EngineConfig


@dataclass
class StageSpec:
    name: str                                   # unique in the pipeline, e.g. "llm", "thinker", "dit"
    kind: str                                   # "ar" | "diffusion" | "codec"
    model_dir: str                              # folder (or sub-folder) the stage loads
    engine: EngineConfig = field(default_factory=EngineConfig)
    final_output: Optional[str] = None          # modality this stage delivers to the user, if any


@dataclass
class EdgeSpec:
    src: str                                    # upstream stage name
    dst: str                                    # downstream stage name
    adapter: str                                # registered adapter turning src output into dst input
    chunk_size: Optional[int] = None            # stream every N units; None = whole output once


@dataclass
class PipelineSpec:
    stages: list[StageSpec]
    edges: list[EdgeSpec] = field(default_factory=list)

    def __post_init__(self) -> None:
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must be unique, got {names}")
        for e in self.edges:
            if e.src not in names or e.dst not in names:
                raise ValueError(f"edge {e.src}->{e.dst} names an unknown stage; stages: {names}")

    @property
    def main_stage(self) -> StageSpec:
        return self.stages[0]


def detect_pipeline(model_dir: str, engine: EngineConfig) -> PipelineSpec:
    """Pick the pipeline for a local model folder from its config files."""
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model folder {model_dir!r} does not exist")
    if os.path.exists(os.path.join(model_dir, "model_index.json")):
        return PipelineSpec([StageSpec("dit", "diffusion", model_dir, engine, final_output="image")])
    cfg_path = os.path.join(model_dir, "config.json")
    if not os.path.exists(cfg_path):
        raise ValueError(f"{model_dir} has neither config.json (transformers) nor model_index.json (diffusers)")
    with open(cfg_path) as f:
        arch = (json.load(f).get("architectures") or ["?"])[0]
    from omnistage.models.registry import lookup

    lookup(arch)                                # raises a clear error for unsupported architectures
    return PipelineSpec([StageSpec("llm", "ar", model_dir, engine, final_output="text")])
