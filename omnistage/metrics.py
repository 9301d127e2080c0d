"""Prometheus metrics of one served engine (families named `omnistage:*`, like vLLM's `vllm:*`).

In: the cumulative `RequestOutput`s the engine thread hands to `AsyncOmni.output_hooks`
(`EngineMetrics.on_output`, called in the engine thread), request ends the server sees without a
final output (`on_abort`, event-loop thread), and `engine.stats()` read at scrape time. Out: the
text exposition of a per-app `CollectorRegistry` (`render()`), so two apps in one process never
share counters.

Families: gauges num_requests_running / num_requests_waiting / kv_cache_usage_perc; counters
request_success_total{finished_reason}, prompt_tokens_total, generation_tokens_total,
num_preemptions_total, prefix_cache_queries_total / prefix_cache_hits_total (tokens); histograms
e2e_request_latency_seconds, time_to_first_token_seconds, inter_token_latency_seconds; for speech
time_to_first_audio_seconds, audio_real_time_factor (histograms) and audio_seconds_total, and per
`stage` (each stage that makes audio, by its name, and "pipeline" for the audio as it leaves the
pipeline; from `RequestMetrics.audio` / `stage_audio`, vLLM-Omni's names): counters
audio_underruns_total / audio_underrun_seconds_total (a listener's playback, started at the first
audio and run in real time, ran dry: `outputs.AudioTiming`; counted as they happen), histograms
audio_ttfp_s (arrival to first audio), audio_rtf (arrival to last audio / seconds of audio) and
audio_underrun_s (seconds a finished request's playback stood dry); for
diffusion (outputs with `progress`) diffusion_step_seconds (the shared denoising forward + solver
update, observed per request per step) and diffusion_request_phase_seconds{phase} (encode / denoise
/ decode seconds of each finished request), diffusion_cached_steps_total (steps the step cache
skipped, from `stats()`); the diffusion queue depth is num_requests_waiting /
num_requests_running, read from the diffusion stage. Stages with replicas add replica_requests_in_flight,
replica_requests_total, replica_up, replica_restarts_total and replica_num_requests_running, labelled
`stage` and `replica`.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from omnistage.outputs import AudioTiming, RequestOutput

logger = logging.getLogger(__name__)

PREFIX = "omnistage:"
CONTENT_TYPE = CONTENT_TYPE_LATEST
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                10.0, 20.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0)
_RTF_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
_UNDERRUN_BUCKETS = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
PIPELINE = "pipeline"                           # `stage` label of the audio as it leaves the pipeline
_STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0)
_PHASE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0)
_STALE_S = 600.0                                # forget per-request state not updated for this long
_ABORTED_KEPT = 4096                            # recently aborted ids whose late outputs are ignored


@dataclass
class _RequestState:
    arrival: float                              # time.time() the request arrived
    last: float                                 # time.time() of its latest output with new tokens
    tokens: int = 0                             # generated tokens seen so far (all n completions)
    audio_samples: int = 0                      # audio samples seen so far (speech stages)
    denoise_s: float = 0.0                      # diffusion: denoising seconds seen so far
    progress: float = 0.0                       # diffusion: fraction of denoising steps seen so far
    underruns: dict = field(default_factory=dict)  # stage label -> (underruns, seconds) counted so far


class _EngineStatsCollector:
    """Gauges and engine-side counters, read from `engine.stats()` when Prometheus scrapes."""

    def __init__(self, engine: Any, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        stats = self.engine.stats()
        label = [self.model_name]
        families = (
            (GaugeMetricFamily, "num_requests_running", "Requests in the running batch.", "num_running"),
            (GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
            (GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
             "kv_cache_usage"),
            (CounterMetricFamily, "num_preemptions", "Sequences preempted (their KV recomputed later).",
             "num_preemptions"),
            (CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             "prefix_cache_queries"),
            (CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"))
        for family, name, doc, key in families:
            m = family(PREFIX + name, doc, labels=["model_name"])
            m.add_metric(label, float(stats.get(key, 0)))
            yield m
        if "num_cached_steps" in stats:           # a diffusion main stage (its step cache may be off: 0)
            c = CounterMetricFamily(PREFIX + "diffusion_cached_steps",
                                    "Denoising steps that reused a cached residual (step cache).", labels=["model_name"])
            c.add_metric(label, float(stats["num_cached_steps"]))
            yield c
        yield from _replica_families(stats, label)
        # Stage-to-stage edges of multi-stage pipelines: stats keys "edge:<src>-><dst>:<what>".
        edges = {k: v for k, v in stats.items() if k.startswith("edge:")}
        if edges:
            docs = {"seconds": "Seconds spent adapting and handing stage outputs to the next stage.",
                    "bytes": "Array bytes handed from one stage to the next.",
                    "pieces": "Pieces (chunks) handed from one stage to the next."}
            for what, doc in docs.items():
                c = CounterMetricFamily(PREFIX + f"edge_transfer_{what}", doc, labels=["model_name", "edge"])
                for key, value in edges.items():
                    edge, _, kind = key[len("edge:"):].rpartition(":")
                    if kind == what:
                        c.add_metric(label + [edge], float(value))
                yield c


# Stage replicas (`num_replicas` > 1): stats keys "replica:<stage>:<i>:<what>" -> families labelled
# stage and replica.
_REPLICA_FAMILIES = (
    (GaugeMetricFamily, "replica_requests_in_flight", "Requests a stage replica holds.", "in_flight"),
    (CounterMetricFamily, "replica_requests", "Requests routed to a stage replica.", "requests"),
    (GaugeMetricFamily, "replica_up", "1 while a stage replica serves, 0 while it restarts or failed.", "up"),
    (CounterMetricFamily, "replica_restarts", "Times a stage replica's process was replaced.", "restarts"),
    (GaugeMetricFamily, "replica_num_requests_running", "Requests in a stage replica's running batch.",
     "num_running"))


def _replica_families(stats: dict, label: list[str]):
    rows = [(k.split(":"), v) for k, v in stats.items() if k.startswith("replica:") and k.count(":") == 3]
    if not rows:
        return
    for family, name, doc, key in _REPLICA_FAMILIES:
        m = family(PREFIX + name, doc, labels=["model_name", "stage", "replica"])
        for (_, stage, replica, what), value in rows:
            if what == key:
                m.add_metric(label + [stage, replica], float(value))
        yield m


class EngineMetrics:
    """One registry per served app. Attach with `engine.output_hooks.append(metrics.on_output)`."""

    def __init__(self, engine: Any, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(engine, model_name))
        reg, labels = self.registry, ["model_name"]
        self.success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                               labels + ["finished_reason"], registry=reg)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed.", labels,
                                     registry=reg).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", labels,
                                         registry=reg).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to last token.", labels,
                             buckets=_E2E_BUCKETS, registry=reg).labels(model_name)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to first token.", labels,
                              buckets=_TTFT_BUCKETS, registry=reg).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between a request's token steps.",
                             labels, buckets=_ITL_BUCKETS, registry=reg).labels(model_name)
        self.ttfa = Histogram(PREFIX + "time_to_first_audio_seconds", "Arrival to the first audio packet.",
                              labels, buckets=_TTFT_BUCKETS, registry=reg).labels(model_name)
        self.audio_seconds = Counter(PREFIX + "audio_seconds", "Seconds of audio produced.", labels,
                                     registry=reg).labels(model_name)
        self.rtf = Histogram(PREFIX + "audio_real_time_factor", "Request time / seconds of audio it produced.",
                             labels, buckets=_RTF_BUCKETS, registry=reg).labels(model_name)
        stage = labels + ["stage"]
        self.underruns = Counter(PREFIX + "audio_underruns", "Times a listener's playback ran dry after the "
                                 "first audio.", stage, registry=reg)
        self.underrun_seconds = Counter(PREFIX + "audio_underrun_seconds", "Seconds listeners' playback stood dry.",
                                        stage, registry=reg)
        self.underrun_s = Histogram(PREFIX + "audio_underrun_s", "Seconds a finished request's playback stood dry "
                                    "(its worst lateness).", stage, buckets=_UNDERRUN_BUCKETS, registry=reg)
        self.ttfp = Histogram(PREFIX + "audio_ttfp_s", "Arrival to the first audio packet.", stage,
                              buckets=_TTFT_BUCKETS, registry=reg)
        self.stage_rtf = Histogram(PREFIX + "audio_rtf", "Arrival to the last audio / seconds of audio.", stage,
                                   buckets=_RTF_BUCKETS, registry=reg)
        self.diffusion_step = Histogram(PREFIX + "diffusion_step_seconds",
                                        "Denoising step (shared forward + solver) per request step.", labels,
                                        buckets=_STEP_BUCKETS, registry=reg).labels(model_name)
        self.diffusion_phase = Histogram(PREFIX + "diffusion_request_phase_seconds",
                                         "Seconds a finished diffusion request spent per phase.",
                                         labels + ["phase"], buckets=_PHASE_BUCKETS, registry=reg)
        self._state: dict[str, _RequestState] = {}
        # The engine may finish a step for a request after the server gave up on it (the abort is
        # applied between steps); outputs of these ids are ignored instead of re-creating state.
        self._aborted: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()           # on_output runs in the engine thread, on_abort in the loop

    # ---- feeding ------------------------------------------------------------------------------
    def on_output(self, out: RequestOutput, now: float) -> None:
        """Engine-thread hook; never raises (an exception here would stop the engine loop)."""
        try:
            self._observe(out, now)
        except Exception:
            logger.exception("metrics hook failed for request %s", out.request_id)

    def _observe(self, out: RequestOutput, now: float) -> None:
        with self._lock:
            if out.request_id in self._aborted:
                return
            st = self._state.get(out.request_id)
            if st is None:
                arrival = out.metrics.arrival_time if out.metrics is not None else now
                st = self._state[out.request_id] = _RequestState(arrival=arrival, last=arrival)
                self.prompt_tokens.inc(len(out.prompt_token_ids))
            tokens = out.num_generated_tokens
            if tokens > st.tokens:
                self.generation_tokens.inc(tokens - st.tokens)
                (self.ttft if st.tokens == 0 else self.itl).observe(max(0.0, now - st.last))
                st.tokens, st.last = tokens, now
            if out.audio is not None and len(out.audio.samples) > st.audio_samples:
                if st.audio_samples == 0:
                    self.ttfa.observe(max(0.0, now - st.arrival))
                self.audio_seconds.inc((len(out.audio.samples) - st.audio_samples) / out.audio.sample_rate)
                st.audio_samples = len(out.audio.samples)
            if out.progress is not None:
                self._observe_diffusion(st, out, now)
            if out.metrics is not None:
                self._observe_audio(st, out)
            if out.finished:
                del self._state[out.request_id]
                self.e2e.observe(max(0.0, now - st.arrival))
                if st.audio_samples:
                    self.rtf.observe(max(0.0, now - st.arrival) * out.audio.sample_rate / st.audio_samples)
                reason = out.outputs[0].finish_reason if out.outputs else ("error" if out.error else None)
                self.success.labels(self.model_name, reason or "stop").inc()
                self._forget_stale(now)

    def _observe_diffusion(self, st: _RequestState, out: RequestOutput, now: float) -> None:
        phases = out.metrics.phase_times if out.metrics is not None else {}
        denoise = phases.get("denoise", 0.0)
        if out.progress > st.progress and denoise > st.denoise_s:
            self.diffusion_step.observe(denoise - st.denoise_s)
            st.progress, st.denoise_s, st.last = out.progress, denoise, now
        if out.finished and not out.error:
            for phase, seconds in phases.items():
                self.diffusion_phase.labels(self.model_name, phase).observe(seconds)

    def _observe_audio(self, st: _RequestState, out: RequestOutput) -> None:
        m = out.metrics
        timings: dict[str, AudioTiming] = dict(m.stage_audio)
        if m.audio is not None:
            timings[PIPELINE] = m.audio
        for stage, t in timings.items():
            count, seconds = st.underruns.get(stage, (0, 0.0))
            if t.underruns > count:
                self.underruns.labels(self.model_name, stage).inc(t.underruns - count)
            if t.underrun_s > seconds:
                self.underrun_seconds.labels(self.model_name, stage).inc(t.underrun_s - seconds)
            st.underruns[stage] = (t.underruns, t.underrun_s)
            if out.finished and t.first_audio_time is not None:
                self.underrun_s.labels(self.model_name, stage).observe(t.underrun_s)
                self.ttfp.labels(self.model_name, stage).observe(max(0.0, t.first_audio_time - st.arrival))
                self.stage_rtf.labels(self.model_name, stage).observe(
                    max(0.0, t.last_audio_time - st.arrival) / max(t.seconds, 1e-9))

    def on_abort(self, request_id: str, reason: str = "abort") -> None:
        """The server ended an accepted request before its final output (client gone, engine error)."""
        with self._lock:
            self._state.pop(request_id, None)
            self._aborted[request_id] = None
            if len(self._aborted) > _ABORTED_KEPT:
                self._aborted.popitem(last=False)
            self.success.labels(self.model_name, reason).inc()

    def _forget_stale(self, now: float) -> None:
        # Safety net for requests abandoned by callers that never report it (e.g. direct engine users).
        stale = [rid for rid, st in self._state.items() if now - st.last > _STALE_S]
        for rid in stale:
            del self._state[rid]

    # ---- reading ------------------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)

    @property
    def num_tracked(self) -> int:
        return len(self._state)
