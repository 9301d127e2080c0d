"""Non-autoregressive generation stages: TTS back ends and code2wav vocoders (stage process).

Back ends are declared in the model registry (`models/registry.py`, `codecs`) and built by
`pipeline/build.py` through their `from_stage_spec(spec)`; they import their heavy dependencies
only when built.
"""
