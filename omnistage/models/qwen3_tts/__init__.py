"""Qwen3-TTS (12 Hz; CustomVoice, VoiceDesign): talker + code predictor (`talker.py`, an AR stage),
prompt layout (`prompt.py`), the speech tokenizer's decoder (`decoder.py`, a codec stage), and the
pipeline and edge glue (`pipeline.py`)."""
