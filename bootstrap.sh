#!/usr/bin/env bash
# Set up .venv with everything LoongSage needs. Idempotent: re-running it is a quick no-op.
# A CPU build of torch is installed where no NVIDIA GPU is visible (no multi-GB CUDA wheels);
# set TORCH_SPEC / TORCH_INDEX_URL to choose another build.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
stamp=.venv/.loongsage-installed
want=$(cat pyproject.toml bootstrap.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  # the torch sglang==0.5.23 (the gpu extra) requires; another one would be replaced by it, or refuse it
  .venv/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.14.1}"
  extras="dev,gpu"
else
  # torch 2.13.0 is a CPU build on the LoongSage CI machines; elsewhere point TORCH_INDEX_URL at a CPU index.
  .venv/bin/python -m pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "${TORCH_SPEC:-torch==2.13.0}"
  extras="dev"
fi
.venv/bin/python -m pip install -q -e ".[$extras]"
echo "$want" > "$stamp"
echo "bootstrap: .venv ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
