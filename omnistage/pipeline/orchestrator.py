"""The orchestrator: drives every stage engine of a pipeline and routes outputs (engine thread).

In: requests (`add_request`) with params for their entry stage (or one per stage), an optional
entry stage, and the output `modalities` / `voice` carried in a dict prompt. Out (`step`):
cumulative `RequestOutput`s, one per request that changed, in each request's order.

Per step, every stage with work runs one engine step, upstream first. Each output is routed along
the edges of its stage to the downstream stages the request uses: a streaming edge forwards new
units (sentences, tokens) as soon as a piece of the edge's chunk size is complete, so a downstream
stage starts before its upstream finishes; a whole-output edge forwards once at the end. The pieces
for requests a downstream stage already holds are handed over together once the upstream step's
outputs are routed (`add_inputs` where the stage has it), before that stage steps. Each
edge has one adapter, built at start-up (`pipeline.build.edge_adapter`); it is called with an
`EdgeContext` held per request and edge (the request's fields and entry inputs, the adapter's
memory). An adapter or downstream stage that raises fails only that request (`pop_errors`, with a
typed error: a dead stage, refused input, or that request's own run-time failure), and a stage
whose step raises fails only the requests it holds (the other stages step on). The
request's outputs of its final stages are merged into one `RequestOutput`: the entry stage's
prompt, token ids and metrics (plus the audio's timing, `AudioTiming`, at the pipeline's output and
at each audio stage); text from the stage that produces text, audio / images / video from
the stages that produce them. Completion finish reasons are held back until every stage of the
request is done, so the last output a caller sees is the one with `finished=True`. An abort reaches
every stage that holds the request. Stages run in-process here (`runner: shared` ones each on a CUDA
stream of its own, `pipeline/shared.py`); `stage_client` puts one in its own process behind the same
`StageEngine` interface (as a Ray actor's child with `distributed_executor_backend: ray`), and
`replicas.ReplicaSet` runs `num_replicas` of them as one stage (least-loaded routing; a request sticks
to its replica). A stage whose process died fails the requests it
held (`StageDeadError`) and restarts in the background while the other stages keep stepping; until
it is back, a new request whose route needs it is refused with `StageDeadError` naming it
(`stage_states` says which stages are down).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from omnistage.outputs import AudioTiming, RequestMetrics, RequestOutput
from omnistage.adapters import EdgeContext
from omnistage.pipeline.build import build_engine, edge_adapter, params_type
from omnistage.spec import EdgeSpec, PipelineSpec, StageSpec
from omnistage.stage import (SCALARS, ARPrompt, RequestFailedError, StageDeadError, StageError, StageOutput,
                             Streamable, add_each, add_inputs_each, message_fields)

logger = logging.getLogger(__name__)

# Request-level fields of a dict prompt that the orchestrator reads (and no stage sees); those of
# PARAMS_FIELDS are also set on the params of every stage of the request whose params have that field.
# `read_aloud_from`: the prompt position where the text to speak begins (read-aloud on an omni model:
# the thinker's edge adapter reads the rows from there on as its answer).
REQUEST_FIELDS = ("modalities", "voice", "initial_codec_chunk_frames", "read_aloud_from")
PARAMS_FIELDS = ("voice", "initial_codec_chunk_frames")
# What a failed request's error may be (`pop_errors`): a dead stage, refused input, a run-time failure.
FAILURE_TYPES = (StageDeadError, ValueError, RequestFailedError)


def payload_bytes(obj: Any) -> int:
    """Bytes of the arrays (tensors, numpy) an edge piece carries; control fields count as nothing."""
    if isinstance(obj, SCALARS):
        return 0
    if hasattr(obj, "element_size") and hasattr(obj, "numel"):
        return obj.element_size() * obj.numel()
    if hasattr(obj, "nbytes") and not isinstance(obj, (bytes, bytearray)):
        return int(obj.nbytes)
    if isinstance(obj, (bytes, bytearray)):
        return len(obj)
    if isinstance(obj, dict):
        return sum(payload_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_bytes(v) for v in obj if not isinstance(v, SCALARS))
    return sum(payload_bytes(getattr(obj, name)) for name in message_fields(obj))


_STREAMABLE: dict[type, bool] = {}              # type -> isinstance(x, Streamable), decided once per type


def _streamable(x: Any) -> bool:
    """`isinstance(x, Streamable)`, with the protocol's member walk (~20 us a call, per piece) done once per type."""
    known = _STREAMABLE.get(type(x))
    if known is None:
        known = _STREAMABLE[type(x)] = isinstance(x, Streamable)
    return known


def _has_content(out: RequestOutput) -> bool:
    """The output carries generated tokens or audio samples (not just a prompt's echo or progress)."""
    if out.audio is not None and len(out.audio.samples):
        return True
    return any(len(c.token_ids) for c in out.outputs)


def _build_stage(spec: StageSpec, pipeline: PipelineSpec) -> Any:
    """The stage's engine, its shared-runner wrapper, a replica set, or a stage process's client (that
    last one spawned, not yet ready: the caller waits with `wait_started`)."""
    if spec.engine.num_replicas > 1:
        from omnistage.pipeline.replicas import ReplicaSet

        return ReplicaSet(spec)
    if spec.runner == "process":
        from omnistage.pipeline.stage_client import StageClient

        return StageClient(spec, wait=False)
    engine = build_engine(spec)
    if spec.runner == "shared":
        from omnistage.pipeline.build import resolve_stage
        from omnistage.pipeline.shared import shared_stage

        device = resolve_stage(spec).engine.torch_device()
        return shared_stage(engine, device, spec.priority, bool(pipeline.edges_from(spec.name)))
    return engine


def _enter(stage: Any, items: list[tuple]) -> list[Optional[Exception]]:
    """Hands new requests, (request_id, inputs, params, arrival_time) each, to their entry stage; per
    request None, or why the stage refused it. A stage with `add_requests` (a stage process, a
    replica set) takes them in one message; an in-process engine one by one (all before its next step)."""
    if hasattr(stage, "add_requests"):
        try:
            return stage.add_requests(items)
        except Exception as e:                  # a failure of the batch as a whole
            return [e] * len(items)
    return add_each(stage, items)


@dataclass
class _Route:
    """What the orchestrator tracks for one request."""

    entry: str                                  # the stage the request entered at
    stages: list[str]                           # stages it runs, in pipeline order
    params: dict[str, Any]                      # stage name -> params for that stage
    arrival: float                              # time.time() the request arrived
    started: set[str] = field(default_factory=set)   # stages that have the request
    done: set[str] = field(default_factory=set)      # stages that finished it
    latest: dict[str, RequestOutput] = field(default_factory=dict)  # stage -> its latest cumulative output
    sent: dict[tuple[str, str], int] = field(default_factory=dict)  # (src, dst) -> units forwarded
    closed: set[tuple[str, str]] = field(default_factory=set)       # edges whose last piece was sent
    fields: dict[str, Any] = field(default_factory=dict)             # request-level prompt fields (voice, ...)
    inputs: Any = None                                               # what the request entered with
    request_id: str = ""                                             # the request's id
    memory: dict[tuple[str, str], dict] = field(default_factory=dict)  # (src, dst) -> edge adapter's state
    audio: AudioTiming = field(default_factory=AudioTiming)          # its audio as it leaves the pipeline
    audio_samples: int = 0                                           # audio samples merged so far
    first_output: dict[str, float] = field(default_factory=dict)    # stage -> time.time() of its first output
                                                                     # with tokens or audio
    first_input: dict[str, float] = field(default_factory=dict)     # "src->dst" -> time.time() of the edge's
                                                                     # first piece handed over


class Orchestrator:
    def __init__(self, spec: PipelineSpec, stages: Optional[dict[str, Any]] = None):
        """`stages`: engines already built (or stage clients), by stage name; the rest are built here."""
        self.spec = spec
        # one adapter per edge, built now: a misspelled adapter or bad options fail at start-up
        self.adapters = {(e.src, e.dst): edge_adapter(e) for e in spec.edges}
        # (src, dst) -> [seconds spent adapting + handing over, payload bytes, pieces], for metrics
        self.edge_totals = {key: [0.0, 0, 0] for key in self.adapters}
        given = stages or {}
        if any(s.runner == "shared" for s in spec.stages):
            from omnistage.pipeline.shared import keep_kernels_apart

            keep_kernels_apart(spec)            # launch settings before any stage captures a graph
        self.stages = {}
        try:
            # stage processes load at the same time: each is spawned here, waited for below
            for s in spec.stages:
                self.stages[s.name] = given[s.name] if s.name in given else _build_stage(s, spec)
            for name, stage in self.stages.items():
                if name not in given and hasattr(stage, "wait_started"):
                    stage.wait_started()
        except BaseException:                   # e.g. one stage failed to start: stop the processes started
            for name, stage in self.stages.items():
                if name not in given and hasattr(stage, "close"):
                    stage.close()
            raise
        for e in spec.edges:
            if e.streaming and not hasattr(self.stages[e.dst], "add_input"):
                raise ValueError(f"edge {e.src}->{e.dst} streams, but stage {e.dst!r} takes no streamed input; "
                                 "set chunk_size: null")
        self.main = self.stages[spec.main_stage.name]
        self._clients = [self.stages[s.name] for s in spec.stages if s.runner == "process"]
        self.routes: dict[str, _Route] = {}
        self._errors: list[tuple[str, Exception]] = []     # requests failed since the last pop_errors
        # (src, dst) -> (request id, piece) routed from the outputs of src's step to requests dst has
        # already: handed over together once src's outputs are routed (`_hand_over`)
        self._handed: dict[tuple[str, str], list[tuple[str, Any]]] = {}

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, inputs: Any, params: Any = None,
                    stage_params: Optional[list[Any]] = None, arrival_time: Optional[float] = None,
                    entry_stage: Optional[str] = None) -> None:
        """`params` applies to the entry stage (default: the main stage); `stage_params` gives one
        object per stage (None entries take the stage's defaults). Raises why it was refused."""
        [error] = self.add_requests([dict(request_id=request_id, inputs=inputs, params=params,
                                          stage_params=stage_params, arrival_time=arrival_time,
                                          entry_stage=entry_stage)])
        if error is not None:
            raise error

    def add_requests(self, requests: list[dict[str, Any]]) -> list[Optional[Exception]]:
        """`add_request(**kwargs)` for each of `requests`; per request None (taken), or why it was
        refused (each request alone). The requests entering one stage reach it together (a stage
        process or replica set: `add_requests`, one message), so that the stage takes all of them
        between the same two steps and prefills them in one step."""
        errors: list[Optional[Exception]] = [None] * len(requests)
        by_entry: dict[str, list[tuple[int, _Route]]] = {}   # entry stage -> (place in `requests`, route)
        taken: set[str] = set()                 # ids in this batch so far
        for i, kwargs in enumerate(requests):
            try:
                if kwargs["request_id"] in taken:
                    raise ValueError(f"request id {kwargs['request_id']!r} is already in use")
                route = self._new_route(**kwargs)
            except Exception as e:              # bad request (or a stage it needs is down): only it is refused
                errors[i] = e
                continue
            taken.add(route.request_id)
            by_entry.setdefault(route.entry, []).append((i, route))
        for name, entering in by_entry.items():
            items = [(r.request_id, r.inputs, r.params[name], r.arrival) for _, r in entering]
            for (i, route), error in zip(entering, _enter(self.stages[name], items)):
                errors[i] = error
                if error is None:
                    route.started.add(name)
                    self.routes[route.request_id] = route
        return errors

    def _new_route(self, request_id: str, inputs: Any, params: Any = None, stage_params: Optional[list[Any]] = None,
                   arrival_time: Optional[float] = None, entry_stage: Optional[str] = None) -> "_Route":
        """The request's route, its params per stage checked; raises for a request to refuse."""
        if request_id in self.routes:
            raise ValueError(f"request id {request_id!r} is already in use")
        fields: dict[str, Any] = {}
        if isinstance(inputs, dict) and any(k in inputs for k in REQUEST_FIELDS):
            inputs = dict(inputs)
            fields = {k: inputs.pop(k) for k in REQUEST_FIELDS if k in inputs}
        entry = entry_stage or self.spec.main_stage.name
        modalities = fields.get("modalities")
        if isinstance(modalities, str):
            modalities = [modalities]
        names = self.spec.route(entry, list(modalities) if modalities is not None else None)
        if stage_params is not None and len(stage_params) != len(self.spec.stages):
            raise ValueError(f"sampling_params_list must have {len(self.spec.stages)} entries "
                             f"(one per stage: {[s.name for s in self.spec.stages]}), got {len(stage_params)}")
        for name in names:                      # a stage process that is restarting takes nothing new
            down = getattr(self.stages[name], "unavailable", None)
            if down is not None:
                raise StageDeadError(down)
        chosen = {}
        for i, s in enumerate(self.spec.stages):
            if s.name not in names:
                continue
            p = stage_params[i] if stage_params is not None else None
            if p is None and s.name == entry:
                p = params
            if p is None and (s.params or s.name != entry):
                p = params_type(s.kind, self.stages[s.name])(**s.params)
            given = {k: fields[k] for k in PARAMS_FIELDS if fields.get(k) is not None and hasattr(p, k)}
            if given:
                p = dataclasses.replace(p, **given)
            chosen[s.name] = p
        for name in names:                      # refuse before any stage spends work
            check = getattr(self.stages[name], "check_params", None)
            if check is not None and name != entry:
                check(chosen[name])
        inputs = self._with_upstream_inputs(entry, names, inputs)
        return _Route(entry, names, chosen, arrival_time or time.time(), fields=fields, inputs=inputs,
                      request_id=request_id)

    def _with_upstream_inputs(self, entry: str, names: list[str], inputs: Any) -> Any:
        """The entry stage's inputs plus what the adapters of the request's edges from it ask for."""
        extra: dict[str, Any] = {}
        for e in self.spec.edges_from(entry):
            if e.dst in names:
                extra.update(getattr(self.adapters[(e.src, e.dst)], "upstream_inputs", None) or {})
        if not extra:
            return inputs
        # adapters ask an AR entry stage for fields of its prompt (`{"return_hidden_states": True}`)
        return dataclasses.replace(ARPrompt.of(inputs), **extra)

    def abort(self, request_id: str) -> None:
        route = self.routes.pop(request_id, None)
        names = route.started if route is not None else self.stages.keys()
        for name in names:
            self.stages[name].abort(request_id)

    def has_unfinished(self) -> bool:
        return any(s.has_unfinished() for s in self.stages.values())

    # ---- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        busy = [s for s in self.stages.values() if s.has_unfinished()]
        if busy and all(s in self._clients for s in busy):   # all work is in stage processes: wait for one
            from omnistage.pipeline.stage_client import wait_any

            wait_any(busy)
        changed: dict[str, None] = {}           # request ids with new output, in first-change order
        single: dict[str, RequestOutput] = {}
        for spec in self.spec.stages:
            stage = self.stages[spec.name]
            if not stage.has_unfinished():
                continue
            for out in self._step_stage(spec.name, stage):
                route = self.routes.get(out.request_id)
                if route is None or spec.name not in route.started:
                    continue                    # aborted, or a stage that does not serve this request
                if out.error is not None:      # the stage died, refused input handed on, or failed the request
                    self._fail(out.request_id, out.error.exception())
                    changed.pop(out.request_id, None)
                    continue
                if len(route.stages) == 1:      # one-stage request: pass through untouched
                    m = out.output.metrics      # (its audio timing is the stage's own)
                    if m is not None and m.audio is not None:
                        m.stage_audio = {spec.name: m.audio}
                    single[out.request_id] = out.output
                    if out.finished:
                        del self.routes[out.request_id]
                    changed[out.request_id] = None
                    continue
                route.latest[spec.name] = out.output
                if spec.name not in route.first_output and out.output is not None and _has_content(out.output):
                    route.first_output[spec.name] = time.time()
                if out.finished:
                    route.done.add(spec.name)
                for edge in self.spec.edges_from(spec.name):
                    if edge.dst in route.stages and not self._forward(edge, route, out):
                        break                   # the request failed on this edge
                if out.request_id not in self.routes:
                    continue
                if spec.final_output is not None or out.finished:
                    changed[out.request_id] = None
            self._hand_over()                   # before the next stage steps
        outputs = []
        for rid in changed:
            if rid in single:
                outputs.append(single[rid])
                continue
            route = self.routes.get(rid)
            if route is None:
                continue
            finished = len(route.done) == len(route.stages)
            outputs.append(self._merge(rid, route, finished))
            if finished:
                del self.routes[rid]
        return outputs

    def _step_stage(self, name: str, stage: Any) -> list[StageOutput]:
        """One step of one stage. A step that raises fails the requests the stage holds, each as its
        own run-time failure (the stage is not dead, and the other stages step on)."""
        try:
            return stage.step()
        except Exception as e:
            held = [rid for rid, route in self.routes.items() if name in route.started and name not in route.done]
            logger.exception("stage %s: step failed; failing the %d requests it holds", name, len(held))
            why = StageError(f"stage {name!r} failed this step: {type(e).__name__}: {e}")
            return [StageOutput.failed(rid, why) for rid in held]

    def _fail(self, request_id: str, error: Exception) -> None:
        """Drops a request from every stage and reports it (to `pop_errors`) instead of an output.
        Errors keep their type when it says what happened (`FAILURE_TYPES`); anything else (an
        adapter's bug, say) is that request's run-time failure, a `RequestFailedError`."""
        if not isinstance(error, FAILURE_TYPES):
            error = RequestFailedError(f"{type(error).__name__}: {error}")
        logger.warning("request %s failed (%s): %s", request_id, type(error).__name__, error)
        self.abort(request_id)
        self._errors.append((request_id, error))

    def pop_errors(self) -> list[tuple[str, Exception]]:
        """(request id, error) of requests that failed without a final output since the last call;
        the error is one of `FAILURE_TYPES`: `StageDeadError` (a stage holding it went down),
        `ValueError` / `ParamError` (its input was refused) or `RequestFailedError` (it failed at run
        time, alone)."""
        errors, self._errors = self._errors, []
        return errors

    def _forward(self, edge: EdgeSpec, route: _Route, out: StageOutput) -> bool:
        """Routes one output along one edge; False when that failed the request (see `pop_errors`)."""
        try:
            self._forward_unchecked(edge, route, out)
        except Exception as e:                  # a bad request or a stage refusing its input: only it fails
            self._fail(out.request_id, e)
            return False
        return True

    def _forward_unchecked(self, edge: EdgeSpec, route: _Route, out: StageOutput) -> None:
        key = (edge.src, edge.dst)
        if key in route.closed:
            return
        if not edge.streaming and not out.finished:
            return
        ctx = EdgeContext(route.fields, route.inputs, route.memory.setdefault(key, {}))
        started = time.perf_counter()
        x = self.adapters[key](out, ctx)
        timing = {"src": edge.src, "started": started}
        if x is None:
            return
        if not _streamable(x):                  # a whole input: sent once, at the end
            self._send(edge.dst, route, out.request_id, x, last=True, **timing)
            route.closed.add(key)
            return
        sent, n = route.sent.get(key, 0), len(x)
        if edge.streaming and not x.finished:
            size = edge.piece_size(sent)
            if n - sent < size:
                return
            end = sent + size + (n - sent - size) // edge.chunk_size * edge.chunk_size
        else:
            end = n
        last = x.finished and end == n
        route.sent[key] = end
        head = getattr(x, "head_units", None)   # units a downstream request may start with, at most
        if head is not None and edge.dst not in route.started and sent + head < end:
            self._send(edge.dst, route, out.request_id, x.slice(sent, sent + head, False), False, **timing)
            sent += head
            timing["started"] = time.perf_counter()
        self._send(edge.dst, route, out.request_id, x.slice(sent, end, last), last, **timing)
        if last:
            route.closed.add(key)

    def _send(self, dst: str, route: _Route, request_id: str, piece: Any, last: bool,
              src: Optional[str] = None, started: Optional[float] = None) -> None:
        stage = self.stages[dst]
        if dst not in route.started:            # a stage process takes it without a round trip
            getattr(stage, "submit", stage.add_request)(request_id, piece, route.params.get(dst), route.arrival)
            route.started.add(dst)
        else:                                   # with the step's other pieces for dst, after the step's outputs
            self._handed.setdefault((src, dst), []).append((request_id, piece))
        route.first_input.setdefault(f"{src}->{dst}", time.time())
        totals = self.edge_totals.get((src, dst))
        if totals is not None:
            totals[0] += time.perf_counter() - started
            totals[1] += payload_bytes(piece)
            totals[2] += 1

    def _hand_over(self) -> None:
        """Hands the pieces of `_handed` to their stages, all of one edge's in one call (`add_inputs`
        where the stage has it: a shared stage then waits for the adapters' device work once per
        step, not once per piece). A piece its stage refuses fails only its request."""
        for (src, dst), items in self._handed.items():
            started = time.perf_counter()
            stage = self.stages[dst]
            adds = getattr(stage, "add_inputs", None)
            try:
                errors = adds(items) if adds is not None else add_inputs_each(stage, items)
            except Exception as e:              # a failure of the batch as a whole
                errors = [e] * len(items)
            totals = self.edge_totals.get((src, dst))
            if totals is not None:
                totals[0] += time.perf_counter() - started
            for (request_id, _), error in zip(items, errors):
                if error is not None and request_id in self.routes:
                    self._fail(request_id, error)
        self._handed.clear()

    def _merge(self, request_id: str, route: _Route, finished: bool) -> RequestOutput:
        entry = route.latest.get(route.entry) or RequestOutput(request_id=request_id)
        merged = dataclasses.replace(entry, finished=finished)
        stage_audio: dict[str, AudioTiming] = {}            # audio stage -> when its audio came out
        for name in route.stages:
            spec, out = self.spec.stage(name), route.latest.get(name)
            if out is None or spec.final_output is None:
                continue
            if spec.final_output == "text":
                merged.outputs = out.outputs
            elif spec.final_output == "audio":
                merged.audio = out.audio
                if out.metrics is not None and out.metrics.audio is not None:
                    stage_audio[name] = dataclasses.replace(out.metrics.audio)
            elif spec.final_output == "image":
                merged.images, merged.video = out.images, out.video or merged.video
            elif spec.final_output == "video":
                merged.video = out.video
        if not finished:                        # finish reasons show only on the request's last output
            merged.outputs = [dataclasses.replace(c, finish_reason=None, stop_reason=None)
                              if c.finish_reason is not None else c for c in merged.outputs]
        n = len(merged.audio.samples) if merged.audio is not None else 0
        if n > route.audio_samples:             # the audio's arrival at the pipeline's output
            route.audio.add(time.time(), (n - route.audio_samples) / merged.audio.sample_rate)
            route.audio_samples = n
        # a copy: the entry's metrics stay its own
        extra = dict(stage_first_output=dict(route.first_output), edge_first_input=dict(route.first_input))
        if route.audio.first_audio_time is not None or stage_audio:
            extra.update(audio=dataclasses.replace(route.audio), stage_audio=stage_audio)
        merged.metrics = dataclasses.replace(merged.metrics or RequestMetrics(arrival_time=route.arrival), **extra)
        return merged

    def reset_prefix_cache(self) -> dict[str, int]:
        """Drops the prefix cache of every stage that has one (the AR stages): stage name -> cached
        blocks forgotten. Requests in flight are untouched."""
        return {name: stage.reset_prefix_cache() for name, stage in self.stages.items()
                if hasattr(stage, "reset_prefix_cache")}

    def close(self) -> None:
        """Stops stage processes (in-process stages need nothing)."""
        for stage in self.stages.values():
            if hasattr(stage, "close"):
                stage.close()

    # ---- what entry points read -----------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        stats = dict(self.main.stats())
        for name, stage in self.stages.items():
            if stage is not self.main:
                stats.update({f"{name}:{k}": v for k, v in stage.stats().items()})
        for name, stage in self.stages.items():   # "replica:<stage>:<i>:<what>" (metrics' `replica` label)
            for i, rs in enumerate(stage.replica_stats() if hasattr(stage, "replica_stats") else ()):
                stats.update({f"replica:{name}:{i}:{k}": v for k, v in rs.items()})
        for (src, dst), (seconds, nbytes, pieces) in self.edge_totals.items():
            stats[f"edge:{src}->{dst}:seconds"] = seconds
            stats[f"edge:{src}->{dst}:bytes"] = nbytes
            stats[f"edge:{src}->{dst}:pieces"] = pieces
        return stats

    def stage_states(self) -> dict[str, str]:
        """Stage name -> "ready", "restarting" or "failed" (`StageClient.state`; in-process stages are
        always ready). Safe to read from any thread."""
        return {name: getattr(stage, "state", "ready") for name, stage in self.stages.items()}

    def replica_states(self) -> dict[str, list[str]]:
        """Stage name -> each replica's state, for the stages that run several (`num_replicas` > 1);
        such a stage is "ready" in `stage_states` while any replica is."""
        return {name: stage.replica_states() for name, stage in self.stages.items() if hasattr(stage, "replica_states")}

    def stage_for(self, modality: str) -> Optional[tuple[str, Any]]:
        """(name, engine) of the stage that delivers `modality`, or None."""
        spec = self.spec.final_stage(modality)
        return (spec.name, self.stages[spec.name]) if spec is not None else None

    @property
    def tokenizer(self):
        return getattr(self.main, "tokenizer", None)

    @property
    def max_model_len(self) -> Optional[int]:
        return getattr(self.main, "max_model_len", None)

