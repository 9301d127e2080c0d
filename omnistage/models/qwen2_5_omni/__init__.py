"""Qwen2.5-Omni (thinker -> talker -> token2wav): tiny checkpoints, weight maps, input processing,
and the model as an omnistage pipeline.

`tiny` builds a random checkpoint in the real layout; `weights` maps the thinker's text LM and the
talker onto plain Qwen2 decoders; `processor` turns chat messages with images/audio into the
thinker's input ids and merged input embeddings; `stages` registers the thinker and talker as AR
components; `adapters` holds the thinker -> talker and talker -> code2wav glue; `pipeline` builds
the three-stage `PipelineSpec` and the chat renderer. The code2wav stage lives in
`omnistage.codec.code2wav`; the design notes are docs/qwen2_5_omni_notes.md.
"""
