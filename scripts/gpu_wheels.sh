#!/usr/bin/env bash
# Fetch the wheels scripts/gpu_check.py carries to an air-gapped GPU machine (Python 3.12, manylinux x86_64) into
# .gpu_wheels/ (gitignored) and check they fit the 64 MiB that travels with the working tree. Run it where the
# registries are reachable, then on the GPU machine: `python scripts/gpu_check.py` (it installs them from there).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
rm -rf .gpu_wheels && mkdir -p .gpu_wheels
# --no-deps: torch, numpy and the rest are on the GPU machine already; these are what it lacks (the trainer's
# Megatron-Core and what cpu_engine.py / agentflow.py import for their HTTP servers)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d .gpu_wheels "megatron-core>=0.16,<0.17" fastapi starlette uvicorn click pydantic pydantic-core annotated-types \
  typing-inspection annotated-doc
total=$(du -cb .gpu_wheels/*.whl | tail -1 | cut -f1)
ls -l .gpu_wheels
echo "gpu_wheels: $(ls .gpu_wheels/*.whl | wc -l) wheels, $((total / 1024)) KiB of the 65536 KiB budget"
[ "$total" -le $((64 * 1024 * 1024)) ] || { echo "gpu_wheels: over the 64 MiB budget" >&2; exit 1; }
