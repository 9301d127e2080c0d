"""What a request gives back: `RequestOutput` from the orchestrator to the entry points.

Outputs are cumulative: each partial `RequestOutput` streamed by `AsyncOmni` holds everything
produced so far (text, token ids, logprobs), with `finished` set on the last one. Media outputs
(images, video, audio) are filled in by the stages that produce them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class Logprob:
    token_id: int
    logprob: float                              # natural log of the model's probability
    decoded: str = ""                           # the token's text


@dataclass
class TokenLogprobs:
    chosen: Logprob                             # the generated token
    top: list[Logprob] = field(default_factory=list)  # most likely alternatives, best first


@dataclass
class CompletionOutput:
    index: int                                  # which of the n completions
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[TokenLogprobs]] = None  # one entry per token id when asked for
    finish_reason: Optional[str] = None         # "stop" | "length" | "abort" | None while running
    stop_reason: Optional[Any] = None           # the stop string or token id that ended it
    codes: Optional[list[list[int]]] = None     # multi-codebook talkers: per token id, the codes of its frame's other codebooks


@dataclass
class AudioOutput:
    samples: Any                                # float32 numpy array, mono, in [-1, 1]
    sample_rate: int                            # Hz


@dataclass
class VideoOutput:
    frames: Any                                 # uint8 numpy array [T, H, W, 3]
    fps: int


@dataclass
class AudioTiming:
    """How a listener hears a streamed answer: playback starts when the first audio arrives and runs
    in real time; when the next audio arrives after what came before has been played out, playback
    stood dry (an underrun) until it came, and goes on from there. `underrun_s` is also the worst
    lateness of any audio against a playback that never waits."""

    first_audio_time: Optional[float] = None    # time.time() the first audio samples arrived
    last_audio_time: Optional[float] = None     # time.time() the latest audio samples arrived
    seconds: float = 0.0                        # seconds of audio arrived so far
    underruns: int = 0                          # times playback ran dry (after the first audio)
    underrun_s: float = 0.0                     # seconds it stood dry in all

    def add(self, now: float, seconds: float) -> None:
        """`seconds` of audio arrived at `now` (time.time())."""
        if seconds <= 0:
            return
        if self.first_audio_time is None:
            self.first_audio_time = now
        else:
            dry_at = self.first_audio_time + self.underrun_s + self.seconds
            if now > dry_at:
                self.underruns += 1
                self.underrun_s += now - dry_at
        self.last_audio_time = now
        self.seconds += seconds


@dataclass
class RequestMetrics:
    arrival_time: float                         # time.time() when the request arrived
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    phase_times: dict[str, float] = field(default_factory=dict)  # step-based stages: phase -> seconds so far
                                                                 # (diffusion: encode, denoise, decode)
    cached_steps: int = 0                       # diffusion step cache: denoising steps that reused a cached residual
    audio: Optional[AudioTiming] = None         # speech: when its audio reached the pipeline's output (a stage's
    # own output, for a request that runs one stage)
    stage_audio: dict[str, AudioTiming] = field(default_factory=dict)  # stage name -> when that stage's audio came out
    # multi-stage requests, for a time-to-first-audio breakdown (time.time(), as `arrival_time`):
    stage_first_output: dict[str, float] = field(default_factory=dict)  # stage name -> its first output with
    # tokens or audio reached the orchestrator (thinker: first token; talker: first frame; code2wav: first chunk)
    edge_first_input: dict[str, float] = field(default_factory=dict)    # "src->dst" -> the edge's first piece
    # was handed to dst (e.g. the first thinker rows given to the talker)


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str] = None
    prompt_token_ids: list[int] = field(default_factory=list)
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    images: list[Any] = field(default_factory=list)  # PIL images
    video: Optional[VideoOutput] = None
    audio: Optional[AudioOutput] = None
    metrics: Optional[RequestMetrics] = None
    num_cached_tokens: int = 0                  # prompt tokens served from the prefix cache
    progress: Optional[float] = None            # 0..1 for step-based stages (diffusion)
    error: Optional[str] = None                 # why a request finished without a result (diffusion failures)
    context_frames: Any = None                  # AR frame-head talkers: the prompt's `context_frames`, int32 numpy [T, G] (a decoder's left context, not output)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
