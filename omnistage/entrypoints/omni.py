"""`Omni`: the offline (synchronous) entry point; runs the pipeline in the caller's thread."""

from __future__ import annotations

import itertools
from typing import Any, Optional, Sequence

from tqdm import tqdm

from omnistage.entrypoints.common import ChatRenderer, Speech, build_orchestrator, default_params_for, per_prompt
from omnistage.outputs import RequestOutput
from omnistage.params import SamplingParams


class Omni:
    """Offline batched inference: `generate(prompts, params)` and `chat(messages, params)`.

    model: a local transformers or diffusers folder; None serves the embedded default (SmolLM2).
    Other keyword arguments are `EngineConfig` fields (max_num_seqs, num_kv_blocks, ...).
    """

    def __init__(self, model: Optional[str] = None, device: str = "auto", dtype: str = "auto", **engine_kwargs):
        self.orchestrator = build_orchestrator(model, device, dtype, **engine_kwargs)
        self.render_chat = ChatRenderer(self.orchestrator)
        self.speech = Speech(self.orchestrator, self.render_chat)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.orchestrator.tokenizer

    def generate(self, prompts: Any, params: Any = None, *, sampling_params_list: Optional[list] = None,
                 use_tqdm: bool = True, entry_stage: Optional[str] = None) -> list[RequestOutput]:
        """`entry_stage` starts the requests at another stage than the first, e.g. the TTS stage of
        a cascade to speak the prompts (`params` is then that stage's, a `TTSParams`)."""
        single = isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                        and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        params_list = per_prompt(params, len(prompts), default_params_for(self.orchestrator, entry_stage))
        if len(self.orchestrator.spec.stages) == 1:     # its outputs come straight here; only the last is read
            params_list = [p.clone(output_kind="final_only") if isinstance(p, SamplingParams) else p
                           for p in params_list]
        ids = [str(next(self._ids)) for _ in prompts]
        errors = self.orchestrator.add_requests([     # together: a stage process prefills them in one step
            dict(request_id=rid, inputs=prompt, params=p, stage_params=sampling_params_list, entry_stage=entry_stage)
            for rid, prompt, p in zip(ids, prompts, params_list)])
        refused = next((e for e in errors if e is not None), None)
        if refused is not None:                         # one bad prompt: none of them runs
            for rid, e in zip(ids, errors):
                if e is None:
                    self.orchestrator.abort(rid)
            raise refused
        spec = self.orchestrator.spec
        stepped = (spec.stage(entry_stage) if entry_stage else spec.main_stage).kind == "diffusion"
        return self._run(ids, use_tqdm and (len(ids) > 1 or stepped))

    def chat(self, messages: Sequence, params: Any = None, *, chat_template_kwargs: Optional[dict] = None,
             use_tqdm: bool = True, **prompt_fields) -> list[RequestOutput]:
        """One conversation (a list of message dicts) or a list of conversations.

        `prompt_fields` go into each prompt dict: `modalities=["text", "audio"]`, `voice="joe"`.
        Models with media input (omni) also read image, audio and video parts:
        `{"type": "image", "image": PIL image}`, `{"type": "audio", "audio": (samples, sample_rate)}`,
        `{"type": "video", "video": frames, "fps": 2.0}` (frames: PIL images or uint8 [T, H, W, 3]).
        """
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [dict(self.render_chat(c, chat_template_kwargs), **prompt_fields) for c in convs]
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    def speak(self, texts: Any, params: Any = None, *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Speaks each text (a string or a list) with `params` (a `TTSParams`, one or one per text;
        None = the defaults): through the pipeline's TTS stage, or read aloud by an omni model (its
        thinker is fed the text as its answer, its talker speaks it). `out.audio` holds the speech."""
        from omnistage.codec.speech import TTSParams

        texts = [texts] if isinstance(texts, str) else list(texts)
        requests = [self.speech.request(t, p) for t, p in zip(texts, per_prompt(params, len(texts), TTSParams))]
        entries = {entry for _, _, entry in requests}
        if len(entries) > 1:
            raise ValueError("texts of one speak() call must enter the same stage")
        return self.generate([r[0] for r in requests], [r[1] for r in requests], use_tqdm=use_tqdm,
                             entry_stage=entries.pop())

    def _run(self, ids: list[str], show_progress: bool) -> list[RequestOutput]:
        """Step until every request finished. The bar counts requests; step-based stages (diffusion)
        move it by each request's fraction of denoising steps done (`RequestOutput.progress`)."""
        done: dict[str, RequestOutput] = {}
        shown: dict[str, float] = {}            # request id -> its part of the bar so far, 0..1
        bar = tqdm(total=len(ids), desc="Generating", disable=not show_progress,
                   bar_format="{l_bar}{bar}| {n:.2f}/{total_fmt} [{elapsed}<{remaining}]")
        while len(done) < len(ids) and self.orchestrator.has_unfinished():
            for out in self.orchestrator.step():
                part = 1.0 if out.finished else (out.progress or 0.0)
                if part > shown.get(out.request_id, 0.0):
                    bar.update(part - shown.get(out.request_id, 0.0))
                    shown[out.request_id] = part
                if out.finished:
                    done[out.request_id] = out
            failed = [err for rid, err in self.orchestrator.pop_errors() if rid in ids]
            if failed:                          # a stage went down under one of these requests
                for rid in ids:
                    self.orchestrator.abort(rid)
                bar.close()
                raise failed[0]
        bar.close()
        return [done[i] for i in ids]

    def close(self) -> None:
        if self.orchestrator is not None:
            self.orchestrator.close()           # stops stage processes, if any
        self.orchestrator = None

    def __enter__(self) -> "Omni":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
