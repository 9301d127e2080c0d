"""Qwen3-TTS requests -> the talker's AR request (the talker stage's process, on its device).

In: the text to speak and a `TTSParams` (task_type, voice, instructions, language; `Qwen3TTSParams`
adds do_sample / seed / non_streaming_mode / min_new_tokens), the folder's `TTSConfig`, and the talker's text-side
modules (`TextSide`: text embedding + projection, codec embedding). Out: an `ARPrompt` -- the
prompt as embedding rows (`prompt_embeds`), the text rows its generated positions add
(`extra_rows`, then `extra_pad`), `frame_feedback` on -- and the `SamplingParams` the reference's
`generate` uses (generation_config.json: temperature / top-k / top-p / repetition penalty; eos
masked for `min_new_tokens` (2) tokens; the top 1024 codec ids but eos are masked by the talker's
`compute_logits`, not per request).

The layout is qwen-tts' (`Qwen3TTSForConditionalGeneration.generate`): [instruction rows] +
the role rows "<|im_start|>assistant\\n" + codec tag rows (think / language / speaker / pad / bos,
each a codec embedding plus tts-pad or tts-bos text rows) + the text. With `non_streaming_mode`
(the default of CustomVoice and VoiceDesign) all text rows are in the prompt and every generated
position adds tts-pad; without it the prompt holds the first text token and generated position j
adds text row j + 1 (then tts-eos, then tts-pad).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from omnistage.codec.speech import TTSParams
from omnistage.params import SamplingParams, check_param
from omnistage.stage import ARPrompt

TASK_TYPES = {"custom_voice": "CustomVoice", "voice_design": "VoiceDesign", "base": "Base"}
DEFAULT_VOICE = "vivian"                        # vLLM-Omni's default speaker


@dataclass
class Qwen3TTSParams(TTSParams):
    """`TTSParams` with Qwen3-TTS' generation switches (offline callers; the HTTP side sends TTSParams)."""

    do_sample: Optional[bool] = None            # False = greedy talker and code predictor; None = generation_config.json
    seed: Optional[int] = None                  # per-request generator seed for sampling
    non_streaming_mode: Optional[bool] = None   # all text in the prompt; None = the task's default (Base: False)
    # frames before which codec eos is never sampled (vLLM's `min_tokens`, HF generate's name beside
    # max_new_tokens); None = 2, the reference's; at most max_new_tokens - 1 (benchmarks: full-length answers)
    min_new_tokens: Optional[int] = None


@dataclass
class TTSConfig:
    """What the prompt builder reads of a folder's config.json and generation_config.json."""

    task: str                                   # "custom_voice" | "voice_design" | "base"
    speakers: dict[str, int]                    # preset speaker (lower case) -> codec id
    dialects: dict[str, object]                 # speaker -> dialect language name, or False
    languages: dict[str, int]                   # language (lower case) -> codec id
    codec: dict[str, int]                       # codec_pad_id, codec_bos_id, codec_eos_token_id, codec_think_id, ...
    text: dict[str, int]                        # tts_pad_token_id, tts_bos_token_id, tts_eos_token_id
    vocab_size: int                             # talker codec vocabulary (codebook + 1024 special rows)
    generation: dict                            # generation_config.json

    @classmethod
    def read(cls, model_dir: str) -> "TTSConfig":
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        gen_path = os.path.join(model_dir, "generation_config.json")
        gen = {}
        if os.path.exists(gen_path):
            with open(gen_path, encoding="utf-8") as f:
                gen = json.load(f)
        t = cfg["talker_config"]
        codec = {k: int(t[k]) for k in ("codec_pad_id", "codec_bos_id", "codec_eos_token_id", "codec_think_id",
                                        "codec_nothink_id", "codec_think_bos_id", "codec_think_eos_id")}
        text = {k: int(cfg[k]) for k in ("tts_pad_token_id", "tts_bos_token_id", "tts_eos_token_id")}
        return cls(cfg.get("tts_model_type", "custom_voice"), {k.lower(): int(v) for k, v in (t.get("spk_id") or {}).items()},
                   {k.lower(): v for k, v in (t.get("spk_is_dialect") or {}).items()},
                   {k.lower(): int(v) for k, v in (t.get("codec_language_id") or {}).items()}, codec, text,
                   int(t["vocab_size"]), gen)

    @property
    def eos(self) -> int:
        return self.codec["codec_eos_token_id"]

    def default_voice(self) -> Optional[str]:
        if not self.speakers:
            return None
        return DEFAULT_VOICE if DEFAULT_VOICE in self.speakers else next(iter(self.speakers))

    def check(self, params: Optional[TTSParams]) -> None:
        """ParamError naming the field for what this folder cannot serve."""
        params = params or TTSParams()
        own = TASK_TYPES[self.task]
        check_param(params.task_type is None or params.task_type == own, "task_type",
                    f"{own!r} for this model (its checkpoint is a {own} model; one of {sorted(TASK_TYPES.values())})",
                    params.task_type)
        lang = (params.language or "auto").lower()
        check_param(lang == "auto" or lang in self.languages, "language",
                    f"one of {['Auto'] + sorted(n.capitalize() for n in self.languages if 'dialect' not in n)}",
                    params.language)
        if self.task == "custom_voice":
            check_param(params.voice is None or params.voice.lower() in self.speakers, "voice",
                        f"one of {sorted(self.speakers)}", params.voice)
        if self.task == "voice_design":
            check_param(bool(params.instructions), "instructions", "a voice description for VoiceDesign",
                        params.instructions)
        if self.task == "base":
            check_param(params.ref_audio is not None, "ref_audio", "given for Base (the voice to clone)", None)
            check_param(bool(params.ref_text) or params.x_vector_only_mode, "ref_text",
                        "the reference audio's transcript for in-context cloning (or x_vector_only_mode true)",
                        params.ref_text)
            check_param(not params.instructions, "instructions", "empty for Base (the reference sets the voice)",
                        params.instructions)
        else:
            for name in ("ref_audio", "ref_text", "x_vector_only_mode"):
                check_param(getattr(params, name) in (None, False), name, f"only given for Base, not {own}", "given")


class PromptBuilder:
    """Builds talker requests from text + params with the talker's own text-side tables."""

    def __init__(self, config: TTSConfig, tokenizer, text_embedding: torch.nn.Embedding,
                 text_projection: torch.nn.Module, codec_embedding: torch.nn.Embedding,
                 group_embeddings: Sequence[torch.nn.Embedding] = (), references=None):
        self.config = config
        self.tokenizer = tokenizer
        self.text_embedding = text_embedding
        self.text_projection = text_projection
        self.codec_embedding = codec_embedding
        self.group_embeddings = list(group_embeddings)   # codebooks 1..G-1 (the code predictor's input tables)
        self.references = references            # Base: a `reference.ReferenceEncoder`; None otherwise

    def _device(self) -> torch.device:
        return self.codec_embedding.weight.device

    def _ids(self, text: str) -> torch.Tensor:
        return torch.tensor(self.tokenizer.encode(text, add_special_tokens=False), device=self._device())

    def text_rows(self, ids) -> torch.Tensor:
        ids = torch.as_tensor(ids, device=self._device())
        return self.text_projection(self.text_embedding(ids))

    def codec_rows(self, ids) -> torch.Tensor:
        return self.codec_embedding(torch.as_tensor(ids, device=self._device()))

    @torch.inference_mode()
    def build(self, text: str, params: Optional[TTSParams]) -> tuple[ARPrompt, SamplingParams]:
        cfg = self.config
        params = params or TTSParams()
        cfg.check(params)
        c, t = cfg.codec, cfg.text
        ids = self._ids(f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n")
        bos, eos, pad = self.text_rows([t["tts_bos_token_id"], t["tts_eos_token_id"], t["tts_pad_token_id"]])
        voice = None
        if cfg.task == "custom_voice":
            voice = (params.voice or cfg.default_voice()).lower()
        lang = (params.language or "auto").lower()
        lang_id = None if lang == "auto" else cfg.languages[lang]
        if voice is not None and lang in ("chinese", "auto") and cfg.dialects.get(voice):
            lang_id = cfg.languages[str(cfg.dialects[voice]).lower()]
        tags = ([c["codec_nothink_id"], c["codec_think_bos_id"], c["codec_think_eos_id"]] if lang_id is None else
                [c["codec_think_id"], c["codec_think_bos_id"], lang_id, c["codec_think_eos_id"]])
        tags += ([cfg.speakers[voice]] if voice is not None else []) + [c["codec_pad_id"], c["codec_bos_id"]]
        codec = self.codec_rows(tags)
        ref = None
        if cfg.task == "base":                  # the reference's x-vector sits where a preset speaker's row would
            samples, rate = params.ref_audio
            ref = self.references.encode(samples, rate, with_codes=not params.x_vector_only_mode)
            codec = torch.cat([codec[:-2], ref.xvector.to(codec)[None], codec[-2:]])
        n = codec.shape[0]
        rows = [self.text_rows(ids[:3]), torch.cat([pad.expand(n - 2, -1), bos[None]]) + codec[:-1]]
        non_streaming = getattr(params, "non_streaming_mode", None)
        non_streaming = (cfg.task != "base") if non_streaming is None else bool(non_streaming)
        if ref is not None and ref.codes is not None:
            ref_ids = self._ids(f"<|im_start|>assistant\n{params.ref_text}<|im_end|>\n")
            icl, trailing = self._in_context(ref_ids[3:-2], ids[3:-5], ref.codes, eos, pad, non_streaming)
            rows.append(icl)
        elif non_streaming:
            body = torch.cat([self.text_rows(ids[3:-5]), eos[None]])
            rows += [body + self.codec_rows([c["codec_pad_id"]]), pad[None] + self.codec_rows([c["codec_bos_id"]])]
            trailing = pad[None]
        else:
            rows.append(self.text_rows(ids[3:4]) + codec[-1:])
            trailing = torch.cat([self.text_rows(ids[4:-5]), eos[None]])
        if params.instructions:
            rows.insert(0, self.text_rows(self._ids(f"<|im_start|>user\n{params.instructions}<|im_end|>\n")))
        embeds = torch.cat(rows)
        context = None if ref is None or ref.codes is None else ref.codes.cpu().numpy()
        prompt = ARPrompt(prompt_token_ids=[c["codec_pad_id"]] * embeds.shape[0], prompt_embeds=embeds,
                          extra_rows=trailing, extra_pad=pad, frame_feedback=True, context_frames=context)
        return prompt, self.sampling(params)

    def _in_context(self, ref_ids: torch.Tensor, text_ids: torch.Tensor, ref_codes: torch.Tensor, eos: torch.Tensor,
                    pad: torch.Tensor, non_streaming: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """In-context cloning rows: the reference transcript + the text (+ tts-eos) beside codec-bos
        and the reference's frames (each the sum of its codebooks' embeddings); -> (prompt rows,
        the text rows later positions add)."""
        c = self.config.codec
        text = torch.cat([self.text_rows(torch.cat([ref_ids, text_ids])), eos[None]])
        ref_codes = ref_codes.to(self._device())
        frames = self.codec_rows(ref_codes[:, 0])
        for g, table in enumerate(self.group_embeddings):
            frames = frames + table(ref_codes[:, g + 1])
        codec = torch.cat([self.codec_rows([c["codec_bos_id"]]), frames.to(text)])
        if non_streaming:
            return torch.cat([text + self.codec_rows([c["codec_pad_id"]]), codec + pad]), pad[None]
        if text.shape[0] > codec.shape[0]:
            return text[:codec.shape[0]] + codec, text[codec.shape[0]:]
        return torch.cat([text, pad.expand(codec.shape[0] - text.shape[0], -1)]) + codec, pad[None]

    def sampling(self, params: TTSParams) -> SamplingParams:
        """The reference's talker `generate` settings: with N = max_new_tokens, at most N - 1 frames
        come out (qwen-tts never predicts the rest of its last sampled frame)."""
        gen, cfg = self.config.generation, self.config
        do_sample = getattr(params, "do_sample", None)
        do_sample = gen.get("do_sample", True) if do_sample is None else do_sample
        most = params.max_new_tokens or int(gen.get("max_new_tokens", 2048))
        check_param(most >= 3, "max_new_tokens", "an integer >= 3", most)
        least = getattr(params, "min_new_tokens", None)
        least = 2 if least is None else least
        check_param(isinstance(least, int) and 0 <= least <= most - 1, "min_new_tokens",
                    f"an integer in [0, max_new_tokens - 1 = {most - 1}]", least)
        return SamplingParams(temperature=float(gen.get("temperature", 0.9)) if do_sample else 0.0,
                              top_k=int(gen.get("top_k", 50)), top_p=float(gen.get("top_p", 1.0)),
                              repetition_penalty=float(gen.get("repetition_penalty", 1.05)),
                              max_tokens=most - 1, min_tokens=least, stop_token_ids=[cfg.eos],
                              seed=getattr(params, "seed", None))
