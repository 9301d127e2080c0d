"""The orchestrator: drives every stage engine of a pipeline and routes outputs (engine thread).

In: requests with per-stage params. Out: `RequestOutput`s of the final-output stages. Each call of
`step` advances every stage that has work by one engine step. Stage engines are built in-process
here; the stage-client layer that puts a stage in its own process plugs in behind the same
`StageEngine` interface.
"""

from __future__ import annotations

from typing import Any, Optional

from omnistage.outputs import RequestOutput
from omnistage.pipeline.spec import PipelineSpec, StageSpec


def build_stage(spec: StageSpec):
    if spec.kind == "ar":
        from omnistage.ar.engine import AREngine

        return AREngine(spec.model_dir, spec.engine)
    if spec.kind == "diffusion":
        from omnistage.diffusion.engine import DiffusionEngine

        return DiffusionEngine.from_stage_spec(spec)
    raise ValueError(f"stage kind must be ar, diffusion or codec; got {spec.kind!r}")


class Orchestrator:
    def __init__(self, spec: PipelineSpec):
        self.spec = spec
        self.stages = {s.name: build_stage(s) for s in spec.stages}
        self.main = self.stages[spec.main_stage.name]

    def add_request(self, request_id: str, inputs: Any, params: Any = None,
                    stage_params: Optional[list[Any]] = None, arrival_time: Optional[float] = None) -> None:
        """`params` applies to the main stage; `stage_params` gives one object per stage."""
        if stage_params is not None:
            if len(stage_params) != len(self.spec.stages):
                raise ValueError(f"sampling_params_list must have {len(self.spec.stages)} entries "
                                 f"(one per stage), got {len(stage_params)}")
            params = stage_params[0]
        self.main.add_request(request_id, inputs, params, arrival_time)

    def abort(self, request_id: str) -> None:
        for stage in self.stages.values():
            stage.abort(request_id)

    def has_unfinished(self) -> bool:
        return any(s.has_unfinished() for s in self.stages.values())

    def step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for spec in self.spec.stages:
            stage = self.stages[spec.name]
            if not stage.has_unfinished():
                continue
            for out in stage.step():
                if spec.final_output is not None:
                    outputs.append(out.output)
        return outputs

    def stats(self) -> dict[str, float]:
        return self.main.stats()

    @property
    def tokenizer(self):
        return getattr(self.main, "tokenizer", None)

    @property
    def max_model_len(self) -> Optional[int]:
        return getattr(self.main, "max_model_len", None)
