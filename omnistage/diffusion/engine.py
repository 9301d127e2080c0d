"""`DiffusionEngine`: the image / video generation stage (a `StageEngine`; runs in the stage's process).

In: `add_request(request_id, inputs, params)` where inputs is a prompt string or a dict with
`prompt`, optional `negative_prompt`, and `image` / `images` (PIL) for edit and image-to-video
models; params is a `DiffusionParams`. Each `step()` runs one schedule -> run -> update round:
admitted requests get their prompts encoded (batched) and their seeded latents; one group of
compatible requests shares one denoiser forward; requests that finished denoising are decoded
(those finishing in the same step with the same output shape in one VAE call).
Out: a list of `StageOutput`s — a progress update (`output.progress` in 0..1) for every request that
advanced, and a final one (`finished=True`) carrying `images` (PIL) or `video` (VideoOutput, uint8
frames [T, H, W, 3]), `videos`, `timings` (seconds per phase) and `finish_reason`; on failure its
`error`, a run-time failure of that request alone (a batched encode or a shared forward that raises
is run again request by request, so the others go on). `check_params` refuses params over the
model's limits up front (`ParamError` naming the field). The `RequestOutput` itself carries the phase times so far in `metrics.phase_times` and, on
failure, `error`. Built by the orchestrator through `from_stage_spec` from the stage's resolved
`EngineConfig` (device, dtype, batch limits, speed options, and `cache_backend` / `cache_config` /
`vae_use_tiling`: the step cache, `step_cache.py`, whose per-request state this engine adds and drops
with its requests; skipped steps in `metrics.cached_steps` and `stats()["num_cached_steps"]`). Each
phase (encode, prepare, the runner's denoise, decode) runs inside `Accelerator.phase`
(diffusion/speed.py: attention backend, offload moves; FP8 and regional compile are applied to the
modules once, at start, before the step cache wraps the blocks' compiled forwards). With a
`parallel_config` of world size > 1 this process is rank 0 of a parallel DiT (`diffusion/ranks.py`:
the other ranks are child processes that run only the denoiser, on their piece of each forward);
`close()` stops them.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Optional

import torch

from omnistage.config import EngineConfig
from omnistage.diffusion.pipelines.base import DiffusionFamily, load_components, read_model_index
from omnistage.diffusion.ranks import DiTRanks, load_family
from omnistage.diffusion.runner import DiffusionRunner
from omnistage.diffusion.scheduler import DiffusionRunnerOutput, DiffusionScheduler, SchedEntry
from omnistage.diffusion.step_cache import StepCache
from omnistage.diffusion.speed import Accelerator, DiffusionSpeed
from omnistage.diffusion.task import DiffusionTask
from omnistage.outputs import RequestMetrics, RequestOutput, VideoOutput
from omnistage.params import DiffusionParams, ParamError
from omnistage.stage import StageError, StageOutput

# Batch limits of a diffusion stage whose EngineConfig leaves them at the (AR-oriented) defaults:
# a denoising forward holds few requests, each with thousands of latent tokens.
DEFAULT_MAX_NUM_SEQS = 8
DEFAULT_MAX_NUM_BATCHED_TOKENS = 1 << 20


def batch_limits(config: EngineConfig) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) of a diffusion stage: the config's, or this engine's
    defaults where the config leaves them at EngineConfig's."""
    base = EngineConfig()
    seqs = config.max_num_seqs if config.max_num_seqs != base.max_num_seqs else DEFAULT_MAX_NUM_SEQS
    tokens = (config.max_num_batched_tokens if config.max_num_batched_tokens != base.max_num_batched_tokens
              else DEFAULT_MAX_NUM_BATCHED_TOKENS)
    return seqs, tokens


class DiffusionEngine:
    def __init__(self, model_dir: str, family_cls: type, config: EngineConfig, vae_tile_pixels: Optional[int] = None,
                 speed: Optional[DiffusionSpeed] = None):
        """`config`: the stage's EngineConfig, resolved for a diffusion stage (`EngineConfig.resolved`;
        one that is not yet, from a test or benchmark, is resolved here the same way): device, dtype,
        batch limits (`batch_limits`) and the speed options (`DiffusionSpeed.from_config`, unless
        `speed` is given). With offload on, the weights are loaded into host memory first, so a
        model larger than the GPU can start."""
        config = config.resolved("diffusion")
        device, dtype = config.torch_device(), config.torch_dtype()
        speed = speed if speed is not None else DiffusionSpeed.from_config(config)
        index = read_model_index(model_dir)
        load_device = torch.device("cpu") if speed.offload else device
        family = family_cls(model_dir, index, load_components(model_dir, index, dtype, load_device), device, dtype)
        if vae_tile_pixels is not None:
            family.tile_threshold = vae_tile_pixels
        self._start(family, *batch_limits(config), config, speed=speed,
                    rank_loader=functools.partial(load_family, model_dir, family_cls))

    @classmethod
    def from_family(cls, family: DiffusionFamily, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                    config: Optional[EngineConfig] = None, speed: Optional[DiffusionSpeed] = None,
                    rank_loader=None) -> "DiffusionEngine":
        """An engine around a family whose components were built in code (benchmarks, tests);
        `config` gives the step-cache, VAE and parallel options (its batch limits are not read); `speed`
        None: the default attention backend only, no compile, FP8 or offload. A parallel config needs
        `rank_loader(device, dtype) -> family` (picklable), which the other ranks build theirs with."""
        engine = cls.__new__(cls)
        engine._start(family, max_num_seqs, max_num_batched_tokens, config or EngineConfig(), speed=speed,
                      rank_loader=rank_loader)
        return engine

    def _start(self, family: DiffusionFamily, max_num_seqs: int, max_num_batched_tokens: int,
               config: EngineConfig, speed: Optional[DiffusionSpeed] = None,
               rank_loader=None) -> None:
        """`rank_loader(device, dtype) -> family`: how the other ranks of a parallel DiT build theirs."""
        self.family, self.device, self.dtype = family, family.device, family.dtype
        # First the speed features (FP8, regional compile, offload hooks), then the step cache, whose
        # wrapper around each block's forward is outside the compiled code; then the parallel plan.
        self.accel = Accelerator(family, speed or DiffusionSpeed(compile=False))   # phases run in its contexts
        self.ranks: Optional[DiTRanks] = None   # the parallel DiT's other ranks (None: one process)
        pc = config.parallel_config
        if pc is not None and pc.world_size > 1:
            if rank_loader is None:
                raise ValueError("parallel_config needs the engine built from a model folder "
                                 "(DiffusionEngine(model_dir, family_cls, config)) or a rank_loader: the other "
                                 "ranks build the same model")
            self.ranks = DiTRanks(family, rank_loader, config.resolved("diffusion"))
        if config.vae_use_tiling:
            family.tile_threshold = 0           # every decode tiles (diffusers' enable_tiling on the VAE)
        self.cache: Optional[StepCache] = None  # the step cache (config.cache_backend), state keyed by request
        if config.cache_backend is not None:
            if family.block_cache is None:
                raise ValueError(f"cache_backend {config.cache_backend!r}: {type(family).__name__} declares no "
                                 "repeated blocks (block_cache); leave cache_backend unset for this model")
            self.cache = StepCache(config.cache_backend, config.cache_config, family.block_cache)
            self.cache.install(family.denoisers())
            try:
                self.cache.check(None)
            except ParamError as e:
                raise ValueError(f"cache_config: {e}") from None
        self.output_kind = self.family.output_kind    # "image" or "video"
        self.takes_image = self.family.takes_image    # requests must bring an input image (edit, I2V)
        self.default_fps = getattr(self.family, "default_fps", None)   # video models: fps of an unset `fps`
        self.limits = self.family.limits()            # sizes, steps, frames a request may ask for; defaults
        self.speed_info = self.accel.info()           # what the speed features chose at load (attention probe, ...)
        self.scheduler = DiffusionScheduler(max_num_seqs, max_num_batched_tokens)
        graphs = self.accel.graphs if self.cache is None and self.ranks is None else None
        self.runner = DiffusionRunner(self.family, self.cache, self.accel.phase,
                                      denoise=self.ranks.denoise if self.ranks is not None else None,
                                      constants=self.accel.constants.use if self.accel.constants else None,
                                      graphs=graphs)
        self.tasks: dict[str, DiffusionTask] = {}
        self._metrics: dict[str, RequestMetrics] = {}
        self._pending: list[StageOutput] = []       # outputs produced between steps (aborts)
        self._finished_total = 0

    @classmethod
    def from_stage_spec(cls, spec, family_cls: type) -> "DiffusionEngine":
        """Build from a pipeline `StageSpec`: `spec.engine` is the config (see `__init__`);
        `spec.options` may set `vae_tile_pixels`."""
        unknown = set(spec.options) - {"vae_tile_pixels"}
        if unknown:
            raise ValueError(f"stage {spec.name!r}: diffusion options must be among ['vae_tile_pixels'], "
                             f"got {sorted(unknown)}")
        return cls(spec.model_dir, family_cls, spec.engine, vae_tile_pixels=spec.options.get("vae_tile_pixels"))

    # -- StageEngine -----------------------------------------------------------------------------
    params_type = DiffusionParams

    def check_params(self, params: DiffusionParams) -> DiffusionParams:
        """Raise ValueError (naming the field) for params this model cannot serve, before any work;
        else return them resolved (the model's defaults filled in). Safe to call from any thread."""
        params = params if params is not None else DiffusionParams()
        self._check_cache_config(params)
        resolved = self.family.resolve(params, {})
        if self.ranks is not None and not self.takes_image:
            self._check_sequence(self.family.new_task("check", {"prompt": ""}, resolved))
        return resolved

    def _check_sequence(self, task: DiffusionTask) -> None:
        """ParamError unless the task's latent tokens split evenly over a parallel DiT's sequence ranks."""
        n = self.ranks.parallel.sequence_multiple()
        if task.tokens_per_row % n:
            raise ParamError("height", f"height x width (x frames) gives {task.tokens_per_row} latent tokens, which "
                                       f"ulysses_degree x ring_degree = {n} must divide: choose a size whose token "
                                       f"count is a multiple of {n}")

    def _check_cache_config(self, params: DiffusionParams) -> None:
        """A request's `cache_config`: ParamError unless valid for this stage's cache backend."""
        if params.cache_config is None:
            return
        if self.cache is None:
            raise ParamError("cache_config", "cache_config needs a server started with a cache backend "
                                             "(--cache-backend tea_cache | cache_dit); this one has none")
        self.cache.check(params.cache_config)

    def add_request(self, request_id: str, inputs: Any, params: Optional[DiffusionParams] = None,
                    arrival_time: Optional[float] = None) -> None:
        if request_id in self.tasks:
            raise ValueError(f"request_id {request_id!r} is already running")
        if isinstance(inputs, str):
            inputs = {"prompt": inputs}
        if not isinstance(inputs, dict):
            raise ValueError(f"inputs must be a prompt string or a dict, got {type(inputs).__name__}")
        params = params if params is not None else DiffusionParams()
        self._check_cache_config(params)
        task = self.family.new_task(request_id, inputs, params)
        if self.ranks is not None:
            self._check_sequence(task)
        if self.cache is not None:
            self.cache.add(request_id, params.cache_config)
        task.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.tasks[request_id] = task
        self._metrics[request_id] = RequestMetrics(arrival_time=task.arrival_time)
        self.scheduler.add(SchedEntry(request_id=request_id, key=self.family.key(task), num_rows=task.num_rows,
                                      tokens_per_row=task.tokens_per_row, num_steps=task.num_steps))

    def step(self) -> list[StageOutput]:
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        if sched.admit:
            outputs += self._admit([self.tasks[r] for r in sched.admit])
        result = DiffusionRunnerOutput()
        group = [self.tasks[r] for r in sched.denoise if r in self.tasks and self.tasks[r].latents is not None]
        if group:
            try:
                result = self.runner.step(group)
            except Exception as e:  # the runner fails only the tasks whose own forward breaks; past that,
                result.failed = {t.request_id: f"denoising failed: {e}" for t in group}   # the group
        for rid, msg in result.failed.items():
            outputs.append(self._fail(rid, msg))
        finished = set(self.scheduler.update(result))
        for rid in result.stepped:
            if rid in finished or rid not in self.tasks:
                continue
            task = self.tasks[rid]
            outputs.append(StageOutput(rid, self._output(task), finished=False))
        outputs += self._finish_all([rid for rid in finished if rid in self.tasks])
        return outputs

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        task = self.tasks.pop(request_id, None)
        if task is not None:
            out = self._output(task)
            out.finished = True
            self._forget(request_id)
            self._pending.append(StageOutput(request_id, out, finished=True, finish_reason="abort"))
            self._metrics.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    def stats(self) -> dict[str, float]:
        r = self.runner
        return {"num_waiting": float(self.scheduler.num_waiting), "num_running": float(self.scheduler.num_running),
                "num_forwards": float(r.num_forwards), "last_batch_rows": float(r.last_batch_rows),
                "last_batch_tasks": float(r.last_batch_tasks), "max_batch_tasks": float(r.max_batch_tasks),
                "last_step_time_s": r.last_step_time, "num_finished": float(self._finished_total),
                "num_cached_steps": float(self.cache.total_cached_steps if self.cache is not None else 0)}

    # -- convenience -----------------------------------------------------------------------------
    def generate(self, requests: dict[str, tuple[Any, DiffusionParams]]) -> dict[str, RequestOutput]:
        """Add every (inputs, params) and step until all finish; returns request_id -> final output."""
        for rid, (inputs, params) in requests.items():
            self.add_request(rid, inputs, params)
        done: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out.output
        return done

    # -- internals -------------------------------------------------------------------------------
    @torch.no_grad()
    def _admit(self, tasks: list[DiffusionTask]) -> list[StageOutput]:
        now = time.time()
        for t in tasks:
            self._metrics[t.request_id].first_scheduled_time = now
        start = time.perf_counter()
        try:
            with self.accel.phase("encode"):
                self.family.encode(tasks)
        except Exception as e:
            if len(tasks) == 1:
                return [self._fail(tasks[0].request_id, f"prompt encoding failed: {e}")]
            # one request's prompt can break a batched encode: encode each alone, so only it fails
            return [out for t in tasks for out in self._admit([t])]
        per_task = (time.perf_counter() - start) / len(tasks)
        failed = []
        for t in tasks:
            t.add_time("encode", per_task)
            try:
                with self.accel.phase("prepare"):
                    self.family.prepare(t)
            except Exception as e:
                failed.append(self._fail(t.request_id, f"preparing latents failed: {e}"))
        return failed

    def _fail(self, request_id: str, message: str) -> StageOutput:
        self.scheduler.abort(request_id)
        task = self.tasks.pop(request_id, None)
        out = self._output(task) if task is not None else RequestOutput(request_id=request_id)
        out.finished = True
        out.error = message
        self._metrics.pop(request_id, None)
        self._forget(request_id)
        return StageOutput(request_id, out, finished=True, finish_reason="error", error=StageError(message))

    def _output(self, task: DiffusionTask) -> RequestOutput:
        metrics = self._metrics.get(task.request_id)
        if metrics is not None:                 # a snapshot: earlier outputs keep the times they had
            cached = self.cache.cached_steps(task.request_id) if self.cache is not None else 0
            metrics = dataclasses.replace(metrics, phase_times=dict(task.timings), cached_steps=cached)
            self._metrics[task.request_id] = metrics
        return RequestOutput(request_id=task.request_id, prompt=task.prompt, progress=task.progress,
                             metrics=metrics)

    def _forget(self, request_id: str) -> None:
        if self.cache is not None:
            self.cache.drop(request_id)
        if self.ranks is not None:
            self.ranks.forget(request_id)

    def close(self) -> None:
        """Stop a parallel DiT's other ranks (nothing to do for one process); safe to call twice."""
        if self.ranks is not None:
            ranks, self.ranks = self.ranks, None
            ranks.close()

    @torch.no_grad()
    def _finish_all(self, request_ids: list[str]) -> list[StageOutput]:
        """Decode the requests that finished denoising this step: those with equal decode keys in one
        VAE call; a batched decode that raises is run again request by request, so only its breaker fails."""
        groups: dict[Any, list[DiffusionTask]] = {}
        for rid in request_ids:
            task = self.tasks[rid]
            groups.setdefault(self.family.decode_key(task), []).append(task)
        outputs = []
        for tasks in groups.values():
            start = time.perf_counter()
            try:
                with self.accel.phase("decode"):
                    results = self.family.decode_batch(tasks)
            except Exception as e:
                if len(tasks) == 1:
                    outputs.append(self._fail(tasks[0].request_id, f"decoding failed: {e}"))
                else:
                    outputs += [out for t in tasks for out in self._finish_all([t.request_id])]
                continue
            per_task = (time.perf_counter() - start) / len(tasks)
            outputs += [self._finish(t, result, per_task) for t, result in zip(tasks, results)]
        return outputs

    def _finish(self, task: DiffusionTask, result: list, decode_s: float) -> StageOutput:
        request_id = task.request_id
        task.add_time("decode", decode_s)
        del self.tasks[request_id]
        out = self._output(task)
        out.finished = True
        final = StageOutput(request_id, out, finished=True, timings=dict(task.timings), finish_reason="stop")
        if self.output_kind == "video":
            fps = task.params.fps or self.family.default_fps
            out.video = VideoOutput(frames=result[0], fps=fps)
            final.videos = [VideoOutput(frames=v, fps=fps) for v in result]
        else:
            out.images = list(result)
        if out.metrics is not None:
            out.metrics.finished_time = time.time()
        self._metrics.pop(request_id, None)
        self._forget(request_id)
        self._finished_total += 1
        return final
