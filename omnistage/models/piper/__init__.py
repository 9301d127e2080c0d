"""Piper (VITS voices exported to ONNX) as a text-to-speech back end.

`voices` knows which voices exist (the bundled `joe`, presets and files named in the stage options)
without loading any; `tts` is the codec model of the "piper" stage (registry entry "piper"), which
loads voices on first use and synthesizes a sentence at a time behind `codec/engine.py`'s
`CodecEngine`.
"""
