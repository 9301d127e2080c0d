"""What one benchmark request measured, and the summary of a run (the `omnistage bench` process).

In: `RequestResult`s, one per request, filled by a sender (`client.py` over HTTP, `offline.py` in
process), and the run's wall time. Out: `summarize` -> a flat dict named as vLLM's `bench serve`
names its JSON keys (`completed`, `request_throughput`, `output_throughput`, `mean_ttft_ms`,
`median_ttft_ms`, `p90_ttft_ms`, `p99_ttft_ms`, ... for ttft / tpot / itl / e2el, plus ttfp and rtf
for speech, queue / generation time for videos), and `format_table` -> the text table printed on
stdout. Times are seconds inside, milliseconds in the summary.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional

PERCENTILES = (50, 90, 99)
# summary key stem -> (title in the table, unit suffix of the key, scale from seconds)
_SERIES = {
    "ttft": ("Time to first token", "_ms", 1000.0),
    "tpot": ("Time per output token (excl. 1st)", "_ms", 1000.0),
    "itl": ("Inter-token latency", "_ms", 1000.0),
    "e2el": ("End-to-end latency", "_ms", 1000.0),
    "ttfp": ("Time to first audio packet", "_ms", 1000.0),
    "rtf": ("Real-time factor (latency / audio s)", "", 1.0),
    "queue": ("Queue time (until in progress)", "_ms", 1000.0),
    "step": ("Time per progress step", "_ms", 1000.0),
}


@dataclass
class RequestResult:
    """One request of a run; times in seconds from the request's start unless said otherwise."""

    ok: bool = False                            # the request completed with a result
    error: str = ""                             # why not, when not ok
    start: float = 0.0                          # perf_counter() when it was sent
    latency: float = 0.0                        # end to end: sent -> last byte / last output
    prompt_tokens: int = 0                      # as the server / engine counted them (0: not reported)
    output_tokens: int = 0                      # generated tokens (usage, else streamed pieces)
    ttft: Optional[float] = None                # first generated text arrived
    itl: list[float] = field(default_factory=list)  # gaps between successive text pieces
    ttfp: Optional[float] = None                # speech: first audio bytes arrived
    audio_seconds: Optional[float] = None       # speech: length of the returned audio (decoded)
    queue_time: Optional[float] = None          # videos: until the job left "queued"
    progress: list[tuple[float, float]] = field(default_factory=list)  # (time, 0..100) as the server reported it
    output_bytes: int = 0                       # size of the returned media (images, video, audio)

    @property
    def tpot(self) -> Optional[float]:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def rtf(self) -> Optional[float]:
        return self.latency / self.audio_seconds if self.audio_seconds else None

    @property
    def step_times(self) -> list[float]:
        """Seconds per percent of progress between successive changes the server reported."""
        out = []
        for (t0, p0), (t1, p1) in zip(self.progress, self.progress[1:]):
            if p1 > p0 and p1 < 100:            # 100 also covers the encode: not a step
                out.append((t1 - t0) / (p1 - p0))
        return out


def _series(results: list[RequestResult]) -> dict[str, list[float]]:
    ok = [r for r in results if r.ok]
    return {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
        "ttfp": [r.ttfp for r in ok if r.ttfp is not None],
        "rtf": [r.rtf for r in ok if r.rtf is not None],
        "queue": [r.queue_time for r in ok if r.queue_time is not None],
        "step": [s for r in ok for s in r.step_times],
    }


def summarize(results: list[RequestResult], duration: float, config: dict, detailed: bool = False) -> dict:
    """The run's numbers; `detailed` adds every request's own record under "requests"."""
    import numpy as np

    ok = [r for r in results if r.ok]
    inputs, outputs = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    out: dict = {"config": config, "completed": len(ok), "failed": len(results) - len(ok),
                 "duration": duration, "total_input_tokens": inputs, "total_output_tokens": outputs,
                 "request_throughput": len(ok) / duration if duration > 0 else 0.0,
                 "output_throughput": outputs / duration if duration > 0 else 0.0,
                 "total_token_throughput": (inputs + outputs) / duration if duration > 0 else 0.0}
    audio = sum(r.audio_seconds or 0.0 for r in ok)
    if audio:
        out["total_audio_seconds"] = audio
    for stem, values in _series(results).items():
        if not values:
            continue
        _, unit, scale = _SERIES[stem]
        x = np.asarray(values, dtype=np.float64) * scale
        out[f"mean_{stem}{unit}"] = float(x.mean())
        out[f"median_{stem}{unit}"] = float(np.percentile(x, 50))
        for p in PERCENTILES[1:]:
            out[f"p{p}_{stem}{unit}"] = float(np.percentile(x, p))
    out["errors"] = sorted({r.error for r in results if not r.ok})[:10]
    if detailed:
        out["requests"] = [{**asdict(r), "tpot": r.tpot, "rtf": r.rtf} for r in results]
    return out


def _fmt(value: float) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.2f}"


def format_table(summary: dict, title: str) -> str:
    """The summary as the text table `omnistage bench` prints."""
    width = 60
    lines = [f" {title} ".center(width, "="),
             f"{'Successful requests:':<40}{summary['completed']:>20}",
             f"{'Failed requests:':<40}{summary['failed']:>20}",
             f"{'Benchmark duration (s):':<40}{summary['duration']:>20.2f}",
             f"{'Request throughput (req/s):':<40}{summary['request_throughput']:>20.2f}"]
    if summary["total_output_tokens"]:
        lines += [f"{'Total input tokens:':<40}{summary['total_input_tokens']:>20}",
                  f"{'Total generated tokens:':<40}{summary['total_output_tokens']:>20}",
                  f"{'Output token throughput (tok/s):':<40}{summary['output_throughput']:>20.2f}",
                  f"{'Total token throughput (tok/s):':<40}{summary['total_token_throughput']:>20.2f}"]
    if summary.get("total_audio_seconds"):
        lines.append(f"{'Audio generated (s):':<40}{summary['total_audio_seconds']:>20.2f}")
    rows = [(stem, title_, unit) for stem, (title_, unit, _) in _SERIES.items() if f"mean_{stem}{unit}" in summary]
    if rows:
        lines.append("-" * width)
        lines.append(f"{'metric (ms; rtf: ratio)':<24}{'mean':>9}{'p50':>9}{'p90':>9}{'p99':>9}")
        for stem, title_, unit in rows:
            values = [summary[f"{k}_{stem}{unit}"] for k in ("mean", "median", "p90", "p99")]
            lines.append(f"{stem.upper():<24}" + "".join(f"{_fmt(v):>9}" for v in values))
        lines.append("  " + "; ".join(f"{stem.upper()}: {title_}" for stem, title_, _ in rows))
    for error in summary["errors"]:
        lines.append(f"error: {error}")
    lines.append("=" * width)
    return "\n".join(lines)
