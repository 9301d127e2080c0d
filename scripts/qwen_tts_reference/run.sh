#!/usr/bin/env bash
# Rebuilds tests/models/qwen3_tts/fixtures/ from scratch: the tiny folders (our venv, omnistage's
# builder), then qwen-tts' outputs on them (the reference venv, make_venv.sh). Usage, from the repo
# root: scripts/qwen_tts_reference/run.sh [OMNISTAGE_PYTHON] [REFERENCE_VENV] [CASE...] (cases: only
# those, the other fixtures kept)
set -euo pipefail
PY=${1:-.venv/bin/python}
REF=${2:-/tmp/qwen_tts_ref}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
[ -x "$REF/bin/python" ] || "$HERE/make_venv.sh" "$REF"
TMP=$(mktemp -d)
for v in custom_voice voice_design base; do
  PYTHONPATH="$ROOT" "$PY" -c "from omnistage.testing.qwen3_tts import make_tiny_qwen3_tts as m; m('$TMP/$v', '$v')"
done
"$REF/bin/python" "$HERE/make_fixtures.py" --custom-voice "$TMP/custom_voice" --voice-design "$TMP/voice_design" \
  --base "$TMP/base" --out "$ROOT/tests/models/qwen3_tts/fixtures" ${3:+--only "${@:3}"}
rm -rf "$TMP"
