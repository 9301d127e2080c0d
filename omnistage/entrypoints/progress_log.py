"""Per-request progress lines in the server log (engine thread of `AsyncOmni`, as an output hook).

In: every `RequestOutput` the orchestrator produces, with the time it arrived (`on_output(out, now)`,
the signature of `AsyncOmni.output_hooks`). Out: at most one INFO line per request every
`interval_s` while it runs -- "request ID: 40% of its steps after 8 s" for step-based stages
(diffusion), "N tokens" for text -- and one when a request that took longer than that finishes.
Failures and aborts are logged where they happen (the orchestrator, `AsyncOmni`), at WARNING.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

from omnistage.outputs import RequestOutput

logger = logging.getLogger("omnistage.requests")

PROGRESS_INTERVAL_S = 5.0                       # seconds between two progress lines of one request
_FORGET_AFTER_S = 600.0                         # a request not heard of for this long failed or was aborted


@dataclass
class _Seen:
    start: float                                # time of its first output (seconds, time.time())
    logged: float                               # time of its last progress line, or of its first output
    last: float                                 # time of its latest output


class ProgressLog:
    def __init__(self, interval_s: float = PROGRESS_INTERVAL_S):
        self.interval_s = interval_s
        self.seen: dict[str, _Seen] = {}        # request id -> when it was seen and logged

    def on_output(self, out: RequestOutput, now: Optional[float] = None) -> None:
        now = time.time() if now is None else now
        seen = self.seen.get(out.request_id)
        if seen is None:
            start = min(now, out.metrics.arrival_time) if out.metrics is not None else now
            seen = self.seen[out.request_id] = _Seen(start, start, now)
        seen.last = now
        if out.finished:
            del self.seen[out.request_id]
            if now - seen.start >= self.interval_s:
                logger.info("request %s finished in %.1f s", out.request_id, now - seen.start)
        elif now - seen.logged >= self.interval_s:
            seen.logged = now
            logger.info("request %s: %s after %.0f s", out.request_id, _done(out), now - seen.start)
        if len(self.seen) > 64:
            self.seen = {rid: s for rid, s in self.seen.items() if now - s.last < _FORGET_AFTER_S}


def _done(out: RequestOutput) -> str:
    """What a request has done so far, in its stage's unit."""
    if out.progress is not None:
        return f"{100 * out.progress:.0f}% of its steps"
    tokens = sum(len(c.token_ids) for c in out.outputs)
    audio = f", {len(out.audio.samples) / out.audio.sample_rate:.1f} s of audio" if out.audio is not None else ""
    return f"{tokens} tokens{audio}"
