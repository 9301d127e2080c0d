"""Non-autoregressive generation stages: TTS voices and code-to-waveform vocoders (stage process).

`engine.CodecEngine` is the one codec stage engine, `scheduler.CodecScheduler` picks what each step
decodes, `speech` holds what a TTS stage takes (`TTSInput`, `TTSParams`) and the sentence rules.
The codec models themselves live in their model's folder (`models/qwen2_5_omni/code2wav.py`,
`models/piper/`), are declared in the model registry (`models/registry.py`, `codecs`) and built by
`pipeline/build.py` through their `from_stage_spec(spec)`, which returns a `CodecEngine`; they
import their heavy dependencies only when built.
"""
