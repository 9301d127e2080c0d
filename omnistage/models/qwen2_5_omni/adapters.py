"""Qwen2.5-Omni stage-to-stage glue: thinker -> talker and talker -> code2wav (orchestrator's process).

thinker -> talker (`qwen2_5_omni.thinker_to_talker`, `ThinkerToTalker`: an adapter class built per edge with
`options={"model_dir": ...}`). In: the thinker's `StageOutput`s of one request, each carrying
`hidden` (`HiddenStates`: hidden states and input rows of the rows computed that step, and the
position of the first); the voice from the request's fields; 3-D rope
positions from the request's thinker `ARPrompt` when it had an image or video. Out: a cumulative
`TalkerInput` whose first unit is the talker's prompt and every further unit one streamed row.
With T(x) = input_embed(x) + last_hidden(x) (the input embedding zeroed on audio / image / video
placeholder rows of the prompt), W, b = `thinker_to_talker_proj`, for a prompt of P tokens and
thinker output g_0 .. g_{n-1} (as transformers' `Qwen2_5OmniForConditionalGeneration.generate`):
  prompt rows (P + 2)  W T(prompt_i) + b;  W (embed(voice bos) + codec_embed(pad)) + b;
                       W (T(g_0) + codec_embed(bos)) + b      (ids: codec mask x P, pad, bos)
  streamed rows        W T(g_1) + b, ..., W T(g_{n-2}) + b, then W embed(tts_eos) + b
  pad row              W embed(tts_pad) + b, used for every position past the stream's end
The talker stage adds its folded codec table (`embed[c] = codec_embed[c] W^T`, `stages.py`) to the
streamed rows, which makes each decode input `W (codec_embed(c) + T(g_j)) + b` as in transformers.
The thinker's rows of one step arrive per output; the prompt rows wait in the request's edge
memory until T(g_0) exists (the thinker step after its prefill). Each step's streamed rows are
projected in one call and kept as one block (`TalkerInput.ends`), which the orchestrator hands the
talker as it is: the adapter's host work per thinker step is a few torch ops, whatever the length.
Read aloud (request field `read_aloud_from` = R, `models/read_aloud.py`): the thinker's prompt ends with the
text to speak, so P = R and g_0 .. g_{n-1} are the prompt's positions R .. end - 1 (all computed by
the prefill); rows past the prompt (the one token it samples) are not read, and the stream ends with
the thinker (then the tts_eos row).

talker -> code2wav (`qwen2_5_omni.talker_to_code2wav`, a pure function): the talker's codes so far,
without the stop code that ended it, as a streamed `CodecInput`.
"""

from __future__ import annotations

import bisect
import functools
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from omnistage.models.qwen2_5_omni.code2wav import CodecInput
from omnistage.adapters import EdgeContext
from omnistage.stage import ARPrompt, ExtraRows, HiddenStates, StageOutput

DEFAULT_VOICE = "Chelsie"


@dataclass
class TalkerConditioning:
    """The checkpoint's constants that the adapter needs (all float32, on the CPU until `on`)."""

    weight: torch.Tensor                        # thinker_to_talker_proj.weight [talker hidden, thinker hidden]
    bias: torch.Tensor                          # thinker_to_talker_proj.bias [talker hidden]
    codec_pad: torch.Tensor                     # codec_embed[pad] [thinker hidden]
    codec_bos: torch.Tensor                     # codec_embed[bos] [thinker hidden]
    tts_eos: torch.Tensor                       # thinker embed(tts_eos) [thinker hidden]
    tts_pad: torch.Tensor                       # thinker embed(tts_pad) [thinker hidden]
    voices: dict[str, torch.Tensor]             # voice -> thinker embed(its bos token) [thinker hidden]
    media_ids: frozenset[int]                   # audio / image / video placeholder ids (embedding zeroed)
    codec_mask_id: int
    codec_pad_id: int
    codec_bos_id: int
    default_voice: str
    _moved: dict = field(default_factory=dict, repr=False)   # device -> the constants there (projected rows)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """W x + b for thinker-width rows x [k, thinker hidden] (in float32, returned in x's dtype)."""
        on = self._on(x.device)
        if x.dtype == torch.float32:            # one op per call: this runs per request and thinker step
            return torch.addmm(on["b"], x, on["wt"])
        return torch.addmm(on["b"], x.float(), on["wt"]).to(x.dtype)

    def _on(self, device: torch.device) -> dict[str, Any]:
        moved = self._moved.get(device)
        if moved is None:
            w, b = self.weight.to(device), self.bias.to(device)

            def proj(v: torch.Tensor) -> torch.Tensor:
                return torch.addmm(b, v.to(device)[None], w.T)[0]

            moved = self._moved[device] = {
                "w": w, "wt": w.T, "b": b, "codec_bos": self.codec_bos.to(device),
                "eos_row": proj(self.tts_eos), "pad_row": proj(self.tts_pad),
                "voice_rows": {v: proj(e + self.codec_pad) for v, e in self.voices.items()}}
        return moved

    def voice_row(self, voice: str, device: torch.device) -> torch.Tensor:
        rows = self._on(device)["voice_rows"]
        if voice not in rows:
            raise ValueError(f"voice must be one of {sorted(rows)}, got {voice!r}")
        return rows[voice]


def _rows(model_dir: str, name: str, ids: list[int]) -> torch.Tensor:
    """Rows `ids` of one checkpoint matrix, read without loading the rest of it (drawn, of a
    `load_format="dummy"` folder)."""
    from safetensors import safe_open

    from omnistage.models import dummy
    from omnistage.models.loader import safetensors_files

    if dummy.is_dummy(model_dir):
        shapes = dummy.checkpoint_shapes(model_dir)
        if name in shapes:
            t = dummy.draw(name, shapes[name][0])
            return t[ids] if ids else t
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            if name in f.keys():
                sl = f.get_slice(name)
                return torch.cat([sl[i:i + 1] for i in ids]).float() if ids else sl[:].float()
    raise ValueError(f"{model_dir}: the checkpoint has no tensor {name!r}")


@functools.lru_cache(maxsize=8)
def load_conditioning(model_dir: str, default_voice: Optional[str] = None) -> TalkerConditioning:
    from omnistage.models.qwen2_5_omni.stages import omni_config

    config = omni_config(model_dir)
    talker, thinker = config.talker_config, config.thinker_config
    speakers = torch.load(os.path.join(model_dir, "spk_dict.pt"), weights_only=True)
    names = list(speakers)
    default = default_voice or (DEFAULT_VOICE if DEFAULT_VOICE in speakers else names[0])
    if default not in speakers:
        raise ValueError(f"default_voice must be one of {sorted(names)}, got {default!r}")
    codec = _rows(model_dir, "talker.model.embed_tokens.weight",
                  [talker.tts_codec_pad_token_id, talker.tts_codec_start_token_id])
    text = _rows(model_dir, "thinker.model.embed_tokens.weight",
                 [talker.tts_text_end_token_id, talker.tts_text_pad_token_id]
                 + [int(speakers[v]["bos_token"]) for v in names])
    return TalkerConditioning(
        weight=_rows(model_dir, "talker.thinker_to_talker_proj.weight", []),
        bias=_rows(model_dir, "talker.thinker_to_talker_proj.bias", []),
        codec_pad=codec[0], codec_bos=codec[1], tts_eos=text[0], tts_pad=text[1],
        voices={v: text[2 + i] for i, v in enumerate(names)},
        media_ids=frozenset({thinker.audio_token_index, thinker.image_token_index, thinker.video_token_index}),
        codec_mask_id=talker.tts_codec_mask_token_id, codec_pad_id=talker.tts_codec_pad_token_id,
        codec_bos_id=talker.tts_codec_start_token_id, default_voice=default)


@dataclass
class TalkerInput:
    """Cumulative input of the talker for one request: unit 0 = the prompt, unit j >= 1 = streamed row j-1.

    `slice` returns what `AREngine` takes: the first piece (unit 0 alone, `head_units`) is the
    talker's `ARPrompt` (`prompt_token_ids`, `prompt_embeds`, optional `mrope_positions` /
    `mrope_delta`, `stream_extra`), later pieces `ExtraRows` for `add_input` with `rows` [k, talker
    hidden], the last one `finished` with the `pad` row. The rows come one per entry of `rows`, or
    (with `ends`) in blocks as the adapter projected them: a piece that is one block is handed over
    as it is, with no copy (a decode step's rows of one request are one block).
    """

    head_units = 1                              # the prompt starts the talker; rows follow via add_input

    prompt: ARPrompt                            # the talker's request inputs
    rows: list[torch.Tensor]                    # streamed rows so far, each [talker hidden]; with `ends`: [k, H] blocks
    finished: bool                              # the stream is complete (thinker done)
    pad: torch.Tensor                           # the row used past the end of a finished stream
    ends: Optional[list[int]] = None            # with blocks: per block, the rows up to its end (the adapter's list)
    count: Optional[int] = None                 # with blocks: streamed rows so far (ends[-1], 0 when none)

    def __len__(self) -> int:
        return 1 + (len(self.rows) if self.ends is None else self.count)

    def slice(self, start: int, end: int, finished: bool) -> ARPrompt | ExtraRows:
        if start == 0:
            if end > 1 or finished:
                raise ValueError("the talker's prompt piece must come alone (head_units = 1)")
            return self.prompt
        if self.ends is not None:
            rows = self._block_rows(start - 1, end - 1)
        else:
            picked = self.rows[start - 1: end - 1]
            rows = torch.stack(picked) if picked else None
        if rows is None:
            rows = self.pad.new_zeros(0, self.pad.shape[-1])
        return ExtraRows(rows, finished=finished, pad=self.pad if finished else None)

    def _block_rows(self, i: int, j: int) -> Optional[torch.Tensor]:
        """Streamed rows i..j-1 from the blocks: a block itself when they are one whole block."""
        if i >= j:
            return None
        c = bisect.bisect_right(self.ends, i)   # the block that holds row i
        begin, parts = (self.ends[c - 1] if c else 0), []
        while begin < j:
            block, stop = self.rows[c], self.ends[c]
            parts.append(block if i <= begin and stop <= j else block[max(i - begin, 0):min(j, stop) - begin])
            begin, c = stop, c + 1
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class ThinkerToTalker:
    """The thinker -> talker edge adapter of one pipeline (see the module docstring)."""

    upstream_inputs = {"return_hidden_states": True}   # what the thinker must report for this edge

    def __init__(self, options: dict[str, Any]):
        if "model_dir" not in options:
            raise ValueError("the qwen2_5_omni.thinker_to_talker edge needs options.model_dir")
        self.cond = load_conditioning(options["model_dir"], options.get("default_voice"))

    def __call__(self, out: StageOutput, ctx: EdgeContext) -> Optional[TalkerInput]:
        mem = ctx.memory
        n_prompt = len(out.output.prompt_token_ids)
        read_from = ctx.fields.get("read_aloud_from")
        if out.hidden is not None:
            text = self._text_rows(out, mem, out.hidden, n_prompt if read_from is not None else None)
            if "prompt" in mem:                 # rows of g_1, g_2, ...: streamed
                if text.shape[0]:
                    _add_block(mem, self.cond.project(text))
            elif text.shape[0]:                 # prompt rows (and T(g_0)): joined once, at the start
                mem.setdefault("text", []).append(text)
                mem["text_rows"] = mem.get("text_rows", 0) + text.shape[0]
        elif "text" not in mem and "prompt" not in mem:
            raise ValueError("the talker needs the thinker's hidden states: send a chat prompt "
                             "(Omni.chat, /v1/chat/completions) or set return_hidden_states")
        if read_from is not None:
            if not isinstance(read_from, int) or not 0 < read_from < n_prompt:
                raise ValueError(f"read_aloud_from must be in [1, {n_prompt - 1}], got {read_from!r}")
            n_prompt = read_from
        if "prompt" not in mem and "text" in mem and (mem["text_rows"] > n_prompt or out.finished):
            self._start(mem, ctx, n_prompt)     # T(g_0) is here (or the thinker said one token only)
        if "prompt" not in mem:
            return None
        if out.finished and not mem.get("closed"):
            _add_block(mem, mem["eos_row"][None])
            mem["closed"] = True
        ends = mem["ends"]
        return TalkerInput(mem["prompt"], mem["blocks"], bool(mem.get("closed")), mem["pad_row"],
                           ends=ends, count=ends[-1] if ends else 0)

    def _text_rows(self, out: StageOutput, mem: dict, report: HiddenStates,
                   limit: Optional[int] = None) -> torch.Tensor:
        """T rows of the positions not seen before (and below `limit`, when given): input embedding
        (zero on media rows) + hidden."""
        start, seen = int(report.start), mem.get("seen", 0)
        if start > seen:
            raise RuntimeError(f"request {out.request_id}: thinker rows {seen}..{start - 1} never arrived")
        skip = seen - start                     # rows recomputed after a preemption: already taken
        hidden, embeds = report.hidden, report.inputs
        n = hidden.shape[0]
        end = n if limit is None else max(skip, min(n, limit - start))
        if skip or end < n:                     # (a decode step's rows are taken whole: no views made)
            hidden, embeds = hidden[skip:end], embeds[skip:end]
        start += skip
        mem["seen"] = start + hidden.shape[0]
        ids = out.output.prompt_token_ids
        text = embeds + hidden
        media = [i - start for i in range(start, min(start + text.shape[0], len(ids)))
                 if ids[i] in self.cond.media_ids]
        if media:                               # as transformers: placeholders keep only the hidden state
            text[media] = hidden[media]
        return text

    def _start(self, mem: dict, ctx: EdgeContext, n_prompt: int) -> None:
        cond, parts = self.cond, mem.pop("text")
        text = parts[0] if len(parts) == 1 else torch.cat(parts)
        voice = ctx.fields.get("voice") or cond.default_voice
        dev, dtype = text.device, text.dtype
        const = cond._on(dev)
        first = text[n_prompt] if text.shape[0] > n_prompt else cond.tts_eos.to(dev)
        embeds = torch.cat([cond.project(text[:n_prompt]), cond.voice_row(voice, dev).to(dtype)[None],
                            cond.project((first.float() + const["codec_bos"])[None]).to(dtype)])
        prompt = ARPrompt(prompt_token_ids=[cond.codec_mask_id] * n_prompt + [cond.codec_pad_id, cond.codec_bos_id],
                          prompt_embeds=embeds, stream_extra=True)
        entry = ctx.entry_inputs
        if isinstance(entry, ARPrompt) and entry.mrope_positions is not None:
            # The talker's own rope index over (prompt, voice bos, g_0) = the thinker's prompt
            # positions followed by two text positions; decode continues with the same delta.
            pos = torch.as_tensor(entry.mrope_positions).long().reshape(3, -1)[:, :n_prompt].cpu()
            top = int(pos.max())
            prompt.mrope_positions = torch.cat([pos, torch.tensor([[top + 1, top + 2]] * 3)], dim=1)
            prompt.mrope_delta = top + 3 - (n_prompt + 2)
        mem["prompt"] = prompt
        mem["blocks"], mem["ends"] = [], []
        if text.shape[0] > n_prompt + 1:
            _add_block(mem, cond.project(text[n_prompt + 1:]))
        mem["eos_row"], mem["pad_row"] = const["eos_row"].to(dtype), const["pad_row"].to(dtype)


def _add_block(mem: dict, rows: torch.Tensor) -> None:
    """Streamed rows [k, talker hidden] (k >= 1) after those in the request's edge memory, as one block."""
    mem["blocks"].append(rows)
    mem["ends"].append((mem["ends"][-1] if mem["ends"] else 0) + rows.shape[0])


def talker_to_code2wav(out: StageOutput) -> CodecInput:
    """Codes so far; once the talker has finished on a stop code (codec pad / eos), without it. The
    output's own list, not a copy (the orchestrator slices the new codes out at once): a copy per
    talker step made each request's edge work grow with the square of its length."""
    comps = out.output.outputs
    if not comps:
        return CodecInput([], finished=out.finished)
    codes = comps[0].token_ids
    if out.finished and comps[0].finish_reason == "stop" and codes:
        codes = codes[:-1]
    return CodecInput(codes, finished=out.finished)
