"""Qwen3-Omni's thinker -> talker glue (the orchestrator's process, on the thinker's output device).

`ThinkerToTalker` (adapter "qwen3_omni.thinker_to_talker", built per edge with
`options={"model_dir": ..., "default_voice": ...}`). In: the thinker's `StageOutput`s of one
request, each carrying `hidden` (`HiddenStates`: the rows computed that step -- their input rows
and hidden states -- and the first one's position). Out: a cumulative `TalkerInput`
(`qwen2_5_omni.adapters`, the same streamed-row contract): unit 0 the talker's prompt, every
further unit one streamed row. As transformers' `Qwen3OmniMoeForConditionalGeneration.generate`
builds them, with TP / HP = the talker's `text_projection` / `hidden_projection` (two-layer MLPs,
thinker width -> talker width), e(x) the thinker's input row of position x, h(x) its hidden row,
c(id) the talker's codec embedding, and S = the positions from the last `<|im_start|>assistant`
on (prompt, then the generated tokens g_0, g_1, ...):

  prompt rows   every position of a user turn (role = the token after its `<|im_start|>`):
                  HP(h(x)) on audio / image / video placeholders, TP(e(x)) elsewhere;
                TP(e(S_0..S_2));  TP(e(tts_pad)) + c(nothink | think_bos | think_eos | speaker);
                TP(e(tts_bos)) + c(codec_pad);  TP(e(S_3)) + c(codec_bos)
  streamed rows TP(e(S_4)), TP(e(S_5)), ..., then TP(e(tts_eos)) once the thinker finished
  pad row       TP(e(tts_pad)), for every position past the stream's end

Streamed row j is sent once the thinker has sampled more than j tokens, and once it finished, the
stream ends after e rows (e = tokens it generated, less its stop token) with TP(e(tts_eos)): as
transformers moves the marker to the row after the last real token. With the real tokenizer (a
three-token `<|im_start|>assistant\n`) row j is token j + 1 and this never cuts a row.

Read aloud (request field `read_aloud_from` = R, `models/read_aloud.py`): the thinker's prompt ends
with the text to speak, from R on, right after the assistant header; S_3 .. are then the text's ids
(R = a + 3 with the real tokenizer; a longer header's tail comes first, as after a thinker that wrote
the text), all computed by the prefill. The stream is every prompt row past S_3 and then
TP(e(tts_eos)) once the thinker finished (the one token it samples is not read).

When the thinker's prompt has an image or a video (its `ARPrompt.mrope_positions`, the request's
entry inputs), the talker's prompt gets the 3-D positions transformers' rope index gives the talker's
ids (`talker_positions`) and the delta its generated positions continue with; otherwise 1-D.

System turns and earlier assistant turns are not part of it. The talker adds to each generated
position its frame's codec rows (code 0 by its own embedding, codes 1..G-1 by its frame head),
which makes each decode input what transformers feeds. The last token the thinker sampled is never
computed, so its row never comes (as in transformers). The speaker is the request's `voice`
(lowercased; config.json `talker_config.speaker_id`).

h(x) must be the thinker's hidden state after layer `talker_config.accept_hidden_layer`: the rows
of `HiddenStates.hidden`. Text-only conversations use no h(x) at all.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F

from omnistage.adapters import EdgeContext
from omnistage.models.qwen2_5_omni.adapters import TalkerInput, _rows
from omnistage.models.qwen3_omni.thinker import omni_config
from omnistage.stage import ARPrompt, HiddenStates, StageOutput

DEFAULT_VOICE = "ethan"


@dataclass
class TalkerConstants:
    """The checkpoint's numbers the adapter needs (float32, on the CPU until `on(device)`)."""

    text_proj: list[torch.Tensor]               # text_projection fc1 weight, bias, fc2 weight, bias
    hidden_proj: list[torch.Tensor]             # hidden_projection fc1 weight, bias, fc2 weight, bias
    act: str                                    # the projections' activation (talker text config hidden_act)
    tts_rows: torch.Tensor                      # thinker embed(tts_bos, tts_eos, tts_pad) [3, thinker hidden]
    codec_rows: dict[str, torch.Tensor]         # codec embedding rows [talker hidden]: nothink, think_bos,
                                                # think_eos, pad, bos, and "voice:<name>" per speaker
    voices: list[str]                           # speaker names (lowercase)
    media_ids: frozenset[int]                   # audio / image / video placeholder ids of the thinker
    im_start_id: int                            # <|im_start|>
    user_id: int                                # the role token "user"
    assistant_id: int                           # the role token "assistant"
    codec_pad_id: int                           # the talker prompt's token ids (bookkeeping; never sampled)
    default_voice: str                          # used when a request names no voice
    _moved: dict = field(default_factory=dict, repr=False)   # device -> constants there
    _act: Any = field(default=None, repr=False)   # the activation module, made on first use

    def on(self, device: torch.device) -> dict[str, Any]:
        key = str(device)
        if key not in self._moved:
            moved = {"text": [t.to(device) for t in self.text_proj], "hidden": [t.to(device) for t in self.hidden_proj],
                     **{k: v.to(device) for k, v in self.codec_rows.items()}}
            bos, eos, pad = self._mlp(self.tts_rows.to(device), moved["text"]).unbind(0)
            moved.update(tts_bos=bos, tts_eos=eos, tts_pad=pad)
            self._moved[key] = moved
        return self._moved[key]

    def _mlp(self, x: torch.Tensor, w: list[torch.Tensor]) -> torch.Tensor:
        if self._act is None:                   # ACT2FN makes a new module per lookup: once, not per row
            from transformers.activations import ACT2FN

            self._act = ACT2FN[self.act]
        return F.linear(self._act(F.linear(x.float(), w[0], w[1])), w[2], w[3])

    def project(self, x: torch.Tensor, which: str = "text") -> torch.Tensor:
        """TP(x) ("text") or HP(x) ("hidden") of thinker-width rows [k, thinker hidden], float32."""
        return self._mlp(x, self.on(x.device)[which])


@functools.lru_cache(maxsize=8)
def load_constants(model_dir: str, default_voice: Optional[str] = None) -> TalkerConstants:
    config = omni_config(model_dir)
    talker, thinker = config.talker_config, config.thinker_config
    speakers = {name.lower(): int(i) for name, i in (talker.speaker_id or {}).items()}
    if not speakers:
        raise ValueError(f"{model_dir}: config.json talker_config.speaker_id names no speakers")
    default = (default_voice or (DEFAULT_VOICE if DEFAULT_VOICE in speakers else sorted(speakers)[0])).lower()
    if default not in speakers:
        raise ValueError(f"default_voice must be one of {sorted(speakers)}, got {default_voice!r}")
    special = {"nothink": talker.codec_nothink_id, "think_bos": talker.codec_think_bos_id,
               "think_eos": talker.codec_think_eos_id, "pad": talker.codec_pad_id, "bos": talker.codec_bos_id}
    special.update({f"voice:{name}": i for name, i in speakers.items()})
    codec = _rows(model_dir, "talker.model.codec_embedding.weight", list(special.values()))

    def proj(name: str) -> list[torch.Tensor]:
        return [_rows(model_dir, f"talker.{name}.linear_fc{i}.{p}", []) for i in (1, 2) for p in ("weight", "bias")]

    return TalkerConstants(
        text_proj=proj("text_projection"), hidden_proj=proj("hidden_projection"), act=talker.text_config.hidden_act,
        tts_rows=_rows(model_dir, "thinker.model.embed_tokens.weight",
                       [config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id]),
        codec_rows=dict(zip(special, codec.unbind(0))), voices=sorted(speakers),
        media_ids=frozenset({thinker.audio_token_id, thinker.image_token_id, thinker.video_token_id}),
        im_start_id=config.im_start_token_id, user_id=config.user_token_id, assistant_id=config.assistant_token_id,
        codec_pad_id=talker.codec_pad_id, default_voice=default)


def user_positions(ids: list[int], im_start: int, user: int) -> list[int]:
    """Positions of the user turns: those whose latest `<|im_start|>` (position 0 before any) is
    followed by `user`, as transformers selects them."""
    out, last = [], 0
    for i, t in enumerate(ids):
        if t == im_start:
            last = i
        if ids[min(last + 1, len(ids) - 1)] == user:
            out.append(i)
    return out


def talker_positions(thinker: torch.Tensor, users: list[int], tail: int) -> tuple[torch.Tensor, int]:
    """The talker prompt's multimodal-rope positions [3, len(users) + tail] and the delta its generated
    positions continue with, from the thinker prompt's positions `thinker` [3, T]: what transformers'
    `get_rope_index` gives the talker's ids (the user turns' tokens, then `tail` text rows). The rope
    index builds positions chunk by chunk, each starting one past the previous chunk's largest, and
    a user turn starts with a text token (`<|im_start|>`), so each contiguous run of user positions
    keeps the thinker's positions, shifted to start one past the largest position before it."""
    parts, top = [], -1
    cuts = [k for k in range(1, len(users)) if users[k] != users[k - 1] + 1]
    for a, b in zip([0] + cuts, cuts + [len(users)]) if users else ():
        run = thinker[:, users[a]:users[b - 1] + 1].long()
        parts.append(run - run[0, 0] + top + 1)
        top = int(parts[-1].max())
    parts.append(torch.arange(top + 1, top + 1 + tail).expand(3, -1))
    out = torch.cat(parts, dim=1)
    return out, int(out.max()) + 1 - out.shape[1]


def assistant_start(ids: list[int], im_start: int, assistant: int) -> int:
    starts = [i for i in range(len(ids) - 1) if ids[i] == im_start and ids[i + 1] == assistant]
    if not starts:
        raise ValueError("the talker needs a chat prompt that ends with an assistant turn (<|im_start|>assistant)")
    return starts[-1]


class ThinkerToTalker:
    """The thinker -> talker edge adapter of one pipeline (see the module docstring)."""

    upstream_inputs = {"return_hidden_states": True}   # what the thinker must report for this edge

    def __init__(self, options: dict[str, Any]):
        if "model_dir" not in options:
            raise ValueError("the qwen3_omni.thinker_to_talker edge needs options.model_dir")
        self.const = load_constants(options["model_dir"], options.get("default_voice"))

    def voice(self, fields: dict[str, Any]) -> str:
        voice = (fields.get("voice") or self.const.default_voice).lower()
        if voice not in self.const.voices:
            raise ValueError(f"voice must be one of {self.const.voices}, got {fields.get('voice')!r}")
        return voice

    def __call__(self, out: StageOutput, ctx: EdgeContext) -> Optional[TalkerInput]:
        mem, const = ctx.memory, self.const
        ids = out.output.prompt_token_ids
        read_from = ctx.fields.get("read_aloud_from")
        if "a" not in mem:
            mem["a"] = assistant_start(ids, const.im_start_id, const.assistant_id)
            mem["voice"] = self.voice(ctx.fields)
            if read_from is not None and (not isinstance(read_from, int) or not mem["a"] + 3 <= read_from < len(ids)):
                raise ValueError(f"read_aloud_from must be in [{mem['a'] + 3}, {len(ids) - 1}] (after the "
                                 f"assistant header), got {read_from!r}")
        if out.hidden is not None:
            self._take(out, mem, out.hidden)
        elif "inputs" not in mem and "prompt" not in mem:
            raise ValueError("the talker needs the thinker's hidden states: send a chat prompt "
                             "(Omni.chat, /v1/chat/completions) or set return_hidden_states")
        if "prompt" not in mem and (mem.get("seen", 0) > mem["a"] + 3 or out.finished):
            self._start(mem, ids, ctx.entry_inputs)
        if "prompt" not in mem:
            return None
        comps = out.output.outputs
        n = len(comps[0].token_ids) if comps else 0
        if read_from is not None:
            n = len(ids) - mem["a"] - 4         # the rows after S_3: the rest of the prompt
        elif out.finished and comps and comps[0].finish_reason == "stop":
            n -= 1                              # the stop token: its row is tts_eos
        rows = mem["trail"][:n]
        if out.finished:
            rows.append(mem["tts_eos"])
        return TalkerInput(mem["prompt"], rows, out.finished, mem["tts_pad"])

    def _take(self, out: StageOutput, mem: dict, report: HiddenStates) -> None:
        """Keep the rows of positions not seen before: input rows (and the hidden rows of media
        placeholders) until the prompt is built, projected text rows after it."""
        start, seen = int(report.start), mem.get("seen", 0)
        if start > seen:
            raise RuntimeError(f"request {out.request_id}: thinker rows {seen}..{start - 1} never arrived")
        skip = seen - start                     # rows recomputed after a preemption: already taken
        inputs, hidden = report.inputs[skip:], report.hidden[skip:]
        mem["seen"] = seen + inputs.shape[0]
        if "prompt" in mem:
            dtype = mem["tts_pad"].dtype
            mem["trail"].extend(self.const.project(inputs).to(dtype).unbind(0))
            return
        ids = out.output.prompt_token_ids
        mem.setdefault("inputs", []).append(inputs)
        media = {seen + i: hidden[i] for i in range(inputs.shape[0])
                 if seen + i < len(ids) and ids[seen + i] in self.const.media_ids}
        mem.setdefault("media", {}).update(media)

    def _start(self, mem: dict, ids: list[int], entry: Any) -> None:
        const, a = self.const, mem["a"]
        e = torch.cat(mem.pop("inputs"))
        dev, dtype = e.device, e.dtype
        c = const.on(dev)
        media = mem.pop("media", {})
        users = user_positions(ids, const.im_start_id, const.user_id)
        parts = []
        if users:
            rows = const.project(e[users])
            hp = [k for k, x in enumerate(users) if x in media]
            if hp:
                rows[hp] = const.project(torch.stack([media[users[k]] for k in hp]), "hidden")
            parts.append(rows)
        s = const.project(e[a:])                # S_0, S_1, ... so far
        first = s[3] if s.shape[0] > 3 else c["tts_eos"]   # the thinker said nothing after the prompt
        pad = c["tts_pad"]
        parts += [s[:3], torch.stack([pad + c["nothink"], pad + c["think_bos"], pad + c["think_eos"],
                                      pad + c[f"voice:{mem['voice']}"], c["tts_bos"] + c["pad"], first + c["bos"]])]
        embeds = torch.cat(parts).to(dtype)
        mem["prompt"] = ARPrompt(prompt_token_ids=[const.codec_pad_id] * embeds.shape[0], prompt_embeds=embeds,
                                 stream_extra=True, frame_feedback=True)
        thinker = getattr(entry, "mrope_positions", None)   # an image or a video in the thinker's prompt
        if thinker is not None:
            pos = torch.as_tensor(thinker).reshape(3, -1).cpu()
            mem["prompt"].mrope_positions, mem["prompt"].mrope_delta = talker_positions(
                pos, users, embeds.shape[0] - len(users))
        mem["trail"] = list(s[4:].to(dtype).unbind(0))
        mem["tts_eos"], mem["tts_pad"] = c["tts_eos"].to(dtype), pad.to(dtype)
