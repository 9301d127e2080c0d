"""POST /v1/completions (event-loop thread of the API server).

In: a `CompletionRequest` whose `prompt` is a string, a list of strings, token ids, or a list of
token-id lists; text prompts are bounded in characters, then tokenized in a worker thread. Each
prompt is one engine request with `n` completions; choice `i * n + j` is
completion j of prompt i, as in OpenAI's API. `response_format`, `structured_outputs` and
`logit_bias` constrain the text as on chat (`protocol.py`; the AR engine enforces the grammar). Out: a `CompletionResponse` with usage, or an SSE
stream of `text_completion` chunks (per-choice deltas, `finish_reason` on each choice's last
chunk, a usage chunk when `stream_options.include_usage`, usage so far in every chunk as well with
`continuous_usage_stats`, then `[DONE]`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from omnistage.entrypoints.openai.errors import OpenAIError, bad_request
from omnistage.entrypoints.openai.protocol import (CompletionChoice, CompletionLogProbs, CompletionRequest,
                                                   CompletionResponse)
from omnistage.entrypoints.openai.serving_engine import (DeltaTracker, OpenAIServing, clamp_logprob, usage_of)
from omnistage.outputs import RequestOutput, TokenLogprobs


def completion_logprobs(entries: list[TokenLogprobs], offset: int = 0) -> CompletionLogProbs:
    """The legacy completions shape; `top_logprobs` maps token text -> logprob and includes the chosen one."""
    out = CompletionLogProbs()
    for entry in entries:
        chosen = entry.chosen
        top = {alt.decoded: clamp_logprob(alt.logprob) for alt in entry.top}
        top.setdefault(chosen.decoded, clamp_logprob(chosen.logprob))
        out.tokens.append(chosen.decoded)
        out.token_logprobs.append(clamp_logprob(chosen.logprob))
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(chosen.decoded)
    return out


def _engine_prompts(prompt: Any) -> list[Any]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError(400, "prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [{"prompt_token_ids": prompt}]
    if isinstance(prompt[0], str):
        return list(prompt)
    return [{"prompt_token_ids": ids} for ids in prompt]


class ServingCompletion(OpenAIServing):
    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_request(req.model)
        if req.echo:
            raise OpenAIError(400, "echo is not supported", param="echo")
        if req.suffix:
            raise OpenAIError(400, "suffix is not supported", param="suffix")
        prompts = _engine_prompts(req.prompt)
        try:
            params = req.to_sampling_params(getattr(self.engine, "sampling_defaults", None))
        except ValueError as e:
            raise bad_request(e, req.field_names()) from e
        for p in prompts:
            if isinstance(p, str):
                self.check_prompt_chars(len(p), "prompt")
        prompts = await asyncio.to_thread(lambda: [self.with_token_ids(p) for p in prompts])
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        gens = [self.generate(p, params, f"{rid}-{i}", req.field_names(), default_param="prompt")
                for i, p in enumerate(prompts)]
        if req.stream:
            firsts = await self.until_disconnected(raw, self.first_outputs(gens))
            return self.sse_response(self._chunks(rid, created, req, params.n, gens, firsts))
        finals = await self.until_disconnected(raw, self.collect(gens))
        return JSONResponse(self._response(rid, created, req, params.n, finals).model_dump())

    def _response(self, rid: str, created: int, req: CompletionRequest, n: int,
                  finals: list[RequestOutput]) -> CompletionResponse:
        choices = []
        for i, final in enumerate(finals):
            for comp in final.outputs:
                logprobs = completion_logprobs(comp.logprobs) if req.logprobs is not None else None
                choices.append(CompletionChoice(index=i * n + comp.index, text=comp.text, logprobs=logprobs,
                                                finish_reason=comp.finish_reason, stop_reason=comp.stop_reason))
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(id=rid, created=created, model=self.served_model_name, choices=choices,
                                  usage=usage_of(finals))

    async def _chunks(self, rid: str, created: int, req: CompletionRequest, n: int, gens: list,
                      firsts: list[RequestOutput]) -> AsyncIterator[CompletionResponse]:
        tracker = DeltaTracker(n)
        last: list[Optional[RequestOutput]] = list(firsts)
        async with aclosing(self.merge(gens, firsts)) as merged:
            async for i, out in merged:
                last[i] = out
                choices = [CompletionChoice(
                    index=d.index, text=d.text, finish_reason=d.finish_reason, stop_reason=d.stop_reason,
                    logprobs=completion_logprobs(d.logprobs, d.text_offset) if req.logprobs is not None else None)
                    for d in tracker.update(i, out)]
                if choices:
                    yield CompletionResponse(id=rid, created=created, model=self.served_model_name,
                                             choices=choices, usage=usage_of(last) if req.continuous_usage else None)
        if req.include_usage:
            yield CompletionResponse(id=rid, created=created, model=self.served_model_name, choices=[],
                                     usage=usage_of(last))
