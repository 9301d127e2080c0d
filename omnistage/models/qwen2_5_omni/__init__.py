"""Qwen2.5-Omni (thinker -> talker -> token2wav) as an omnistage model (its registry entry:
"qwen2_5_omni" in models/registry.py).

`weights` maps the thinker's text LM and the talker onto plain Qwen2 decoders; `stages` loads them
as AR components; `processor` turns chat messages with images / audio / video into the thinker's
input ids and merged input embeddings; `adapters` holds the thinker -> talker and talker ->
code2wav glue; `code2wav` (+ `code2wav_ode`) is token2wav as a codec model served by the generic
`codec.engine.CodecEngine`; `pipeline` builds the three-stage `PipelineSpec` and the chat renderer.
The tiny checkpoint builder is `omnistage.testing.qwen2_5_omni`; the design notes are
docs/qwen2_5_omni_notes.md.
"""
