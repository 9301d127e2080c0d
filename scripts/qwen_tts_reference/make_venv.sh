#!/usr/bin/env bash
# Creates the reference environment for the Qwen3-TTS fixtures: qwen-tts 0.1.1 with its own pins
# (transformers 4.57.3, accelerate 1.12.0), beside torch 2.9.1 + torchaudio 2.9.* (torchaudio needs
# that torch; its wheel lies on this disk). gradio (the package's web demo) is left out: the
# fixtures use only the modeling code. Usage: make_venv.sh [VENV_DIR] (default /tmp/qwen_tts_ref).
set -euo pipefail
VENV=${1:-/tmp/qwen_tts_ref}
python3.11 -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q torch==2.9.1
"$PIP" install -q torch==2.9.1 'torchaudio==2.9.*'
"$PIP" install -q transformers==4.57.3 accelerate==1.12.0 librosa soundfile sox onnxruntime einops safetensors numpy
"$PIP" install -q --no-deps qwen-tts==0.1.1
"$VENV/bin/python" -c "import qwen_tts, transformers, torch; print('qwen-tts ready:', transformers.__version__, torch.__version__)"
