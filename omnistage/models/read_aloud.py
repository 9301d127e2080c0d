"""Read aloud on an omni model (Qwen2.5-Omni, Qwen3-Omni): a text to speak -> the thinker's request,
so that the talker speaks exactly that text (entry point's process; the chat renderer's
`read_aloud` calls it for `/v1/audio/speech` and `Omni.speak`).

In: the text (`input`), its `TTSParams` (voice: a preset speaker of the checkpoint;
`initial_codec_chunk_frames`). Out: (prompt dict, thinker `SamplingParams`). The prompt is the chat
template's rendering of one user turn holding the text, then the text's own token ids as the start
of the assistant's answer (`prompt_token_ids` = template ids + text ids), with the request fields
`modalities` ["text", "audio"], `voice`, `initial_codec_chunk_frames` and `read_aloud_from` (the
position where the text ids begin). The thinker prefills the whole prompt and samples one token
that nobody uses (`max_tokens=1`); the model's thinker -> talker adapter reads positions
[read_aloud_from, end) as the thinker's answer g_0 .. g_{n-1}, so the talker gets the same
conditioning as after a thinker that wrote the text itself and then ended its turn.

`ReadAloud` is the chat renderers' side of it (`check_read_aloud`, `read_aloud`), for a renderer
with a transformers `processor` and the checkpoint's `voices`.

What the models honour (`CAPABILITIES`, a renderer's `read_aloud_capabilities`): preset voices
only (no cloning, no VoiceDesign), language Auto, `initial_codec_chunk_frames` where the code2wav
stage sizes its first chunk per request (Qwen2.5-Omni); `speed` must be 1.0 (the talkers have no
rate control); other fields are a `ParamError` naming them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omnistage.codec.speech import SpeechCapabilities, TTSParams, check_speech_params
from omnistage.params import ParamError, SamplingParams

CAPABILITIES = SpeechCapabilities(task_types=("CustomVoice",), languages=("Auto",),
                                  fields=frozenset({"initial_codec_chunk_frames"}))


def check_read_aloud(params: TTSParams, voices, caps: SpeechCapabilities = CAPABILITIES,
                     any_case: bool = False) -> None:
    """Raises `ParamError` naming the first field of `params` that read-aloud (on a model that
    honours `caps`) cannot honour; `any_case`: `voices` are lowercase and match in any case."""
    if any_case and params.voice is not None:
        params = dataclasses.replace(params, voice=params.voice.lower())
    check_speech_params(params, caps, voices)
    if params.speed != 1.0:
        raise ParamError("speed", f"speed must be 1.0 for this model (its talker has no rate control), "
                                  f"got {params.speed}")


def read_aloud_request(tokenizer, template_ids: list[int], text: str,
                       params: TTSParams) -> tuple[dict[str, Any], SamplingParams]:
    """The thinker's prompt dict and params for speaking `text` (see the module docstring);
    `template_ids`: the chat template's ids of one user turn with `text` and the assistant's header."""
    text_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not text_ids:
        raise ParamError("input", "input must contain speakable text")
    prompt: dict[str, Any] = {"prompt_token_ids": list(template_ids) + list(text_ids),
                              "modalities": ["text", "audio"], "voice": params.voice,
                              "read_aloud_from": len(template_ids)}
    if params.initial_codec_chunk_frames is not None:
        prompt["initial_codec_chunk_frames"] = params.initial_codec_chunk_frames
    return prompt, SamplingParams(max_tokens=1, temperature=0.0)


class ReadAloud:
    """The read-aloud hooks of an omni chat renderer, which sets `processor` (transformers') and
    `voices` (the preset speakers)."""

    voices_any_case = False                     # True: `voices` are lowercase and match in any case
    read_aloud_capabilities = CAPABILITIES      # the TTSParams the model's pipeline honours
    processor: Any
    voices: list[str]

    def check_read_aloud(self, params: TTSParams) -> None:
        """Raises `ParamError` for `TTSParams` read-aloud cannot honour (see the module docstring)."""
        check_read_aloud(params, self.voices, self.read_aloud_capabilities, self.voices_any_case)

    def read_aloud(self, text: str, params: TTSParams) -> tuple[dict[str, Any], SamplingParams]:
        """(thinker prompt dict, thinker `SamplingParams`) that speak `text` with `params`."""
        from omnistage.models.qwen2_5_omni.processor import build_thinker_inputs

        template = build_thinker_inputs(self.processor, [{"role": "user", "content": text}])
        return read_aloud_request(self.processor.tokenizer, template.input_ids[0].tolist(), text, params)
