"""Qwen3-TTS (12 Hz; CustomVoice, VoiceDesign, Base): talker + code predictor (`talker.py`, an AR
stage), prompt layout (`prompt.py`), Base's reference encoding (`reference.py`: codes + x-vector of
the voice to clone), the speech tokenizer's decoder (`decoder.py`, a codec stage), and the pipeline
and edge glue (`pipeline.py`)."""
