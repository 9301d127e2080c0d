"""Where a streamed request's first output waits: the time-to-first-audio breakdown that
`omni_bench.py` and `tts_bench.py` print (the benchmark's process, after each request).

In: a request's last `RequestMetrics` (the orchestrator's stamps `stage_first_output` and
`edge_first_input`, time.time()) and the wall time its first audio reached the caller. Out: seconds
from the request's arrival to each stage's first output (e.g. thinker: first token; talker: first
frame; decoder / code2wav: first audio chunk), to each edge's first piece handed over ("talker->decoder":
the first frames given to the decoder), and to the first audio at the caller, in time order; the mean
of those over a round's requests; and a markdown table of the means, one row per round.
"""

from __future__ import annotations

import statistics
from typing import Optional

CALLER = "first audio at caller"


def first_output_breakdown(metrics, first_audio_wall: Optional[float]) -> dict[str, float]:
    """Seconds from arrival to each stamped first output / first edge piece and the caller's first audio."""
    if metrics is None:
        return {}
    marks = {f"first {name}": t for name, t in metrics.stage_first_output.items()}
    marks.update({f"first {edge}": t for edge, t in metrics.edge_first_input.items()})
    if first_audio_wall is not None:
        marks[CALLER] = first_audio_wall
    return {k: t - metrics.arrival_time for k, t in sorted(marks.items(), key=lambda kv: kv[1])}


def mean_breakdown(breakdowns: list[dict[str, float]]) -> dict[str, float]:
    """The mean of each mark every request of a round has, in time order."""
    if not breakdowns:
        return {}
    keys = [k for k in breakdowns[0] if all(k in b for b in breakdowns)]
    means = {k: statistics.mean(b[k] for b in breakdowns) for k in keys}
    return dict(sorted(means.items(), key=lambda kv: kv[1]))


def breakdown_table(title: str, rows: list[tuple[str, dict[str, float]]]) -> str:
    """Markdown: one row per (label, mean breakdown), a column per mark (those of the first row)."""
    columns = list(rows[0][1]) if rows else []
    lines = [f"| mean s from arrival to the ... ({title}) | " + " | ".join(columns) + " |",
             "|---|" + "---|" * len(columns)]
    for label, marks in rows:
        lines.append(f"| {label} | " + " | ".join(f"{marks[c]:.3f}" if c in marks else "-" for c in columns) + " |")
    return "\n".join(lines)
