"""Read aloud on Qwen2.5-Omni: a text to speak -> the thinker's request, so that the talker speaks
exactly that text (entry point's process; `OmniChatRenderer.read_aloud` calls it for
`/v1/audio/speech` and `Omni.speak`).

In: the text (`input`), its `TTSParams` (voice: a key of spk_dict.pt; `initial_codec_chunk_frames`).
Out: (prompt dict, thinker `SamplingParams`). The prompt is the chat template's rendering of one user
turn holding the text, then the text's own token ids as the start of the assistant's answer
(`prompt_token_ids` = template ids + text ids), with the request fields `modalities` ["text",
"audio"], `voice`, `initial_codec_chunk_frames` and `read_aloud_from` (the position where the text
ids begin). The thinker prefills the whole prompt and samples one token that nobody uses
(`max_tokens=1`); `ThinkerToTalker` reads positions [read_aloud_from, end) as the thinker's answer
g_0 .. g_{n-1} (input embedding + last hidden state of each, as for generated tokens), so the talker
gets the same conditioning as after a thinker that wrote the text itself and then ended its turn.

What the model honours (`CAPABILITIES`): preset voices only (no cloning, no VoiceDesign), language
Auto, `initial_codec_chunk_frames`; `speed` must be 1.0 (the talker has no rate control); other
fields are a `ParamError` naming them.
"""

from __future__ import annotations

from typing import Any

from omnistage.codec.speech import SpeechCapabilities, TTSParams, check_speech_params
from omnistage.params import ParamError, SamplingParams

CAPABILITIES = SpeechCapabilities(task_types=("CustomVoice",), languages=("Auto",),
                                  fields=frozenset({"initial_codec_chunk_frames"}))


def check_read_aloud(params: TTSParams, voices) -> None:
    """Raises `ParamError` naming the first field of `params` that read-aloud cannot honour."""
    check_speech_params(params, CAPABILITIES, voices)
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
