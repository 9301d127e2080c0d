"""Qwen3-Omni-30B-A3B (MoE thinker -> MoE talker + code predictor -> code2wav) as an omnistage model
(its registry entry: "qwen3_omni" in models/registry.py).

`thinker` is the thinker's Qwen3-MoE text decoder as an AR component (MoE layers through
`layers.moe`); `processor` turns chat messages with images / audio / video into the thinker's
prompt (ids, merged embeddings, deepstack rows, 3-D rope positions) with transformers' encoders;
`talker` is the MoE talker over codebook 0 with the MTP code predictor as its frame head, fed by
`adapters` (the thinker -> talker rows); `code2wav` is the ConvNet vocoder as a codec stage;
`pipeline` builds the `PipelineSpec` and the chat renderer. The tiny checkpoint builder is
`omnistage.testing.qwen3_omni`.
"""
