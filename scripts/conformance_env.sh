#!/usr/bin/env bash
# Build .venv-sglang: LoongSage's own dependencies plus SGLang 0.5.23's pure-Python parts on a CPU torch, so the
# conformance tier (tests/test_sglang_conformance.py) can check what LoongSage sends against SGLang's own code:
# its request structs, its FastAPI app, its weight-update chain and its tool-call and reasoning parsers.
#   scripts/conformance_env.sh && .venv-sglang/bin/python -m pytest -q tests/test_sglang_conformance.py
# Idempotent (a stamp, as bootstrap.sh): a second run is a no-op. The main .venv is not touched.
#
# Why not `pip install sglang`: its wheel requires CUDA torch, CUDA kernels and ~70 packages. Installed with
# --no-deps beside the ~30 pure-Python packages its HTTP server, request structs and parsers import, it imports and
# runs on CPU: everything but the scheduler process and the model (which need its CUDA kernels).
# Every install runs under a torch==2.13.0 constraint (the CPU build): an unconstrained dependency that names torch
# would swap it for a multi-GB CUDA build. torchvision (CUDA builds only in the registry) is replaced by a stub
# package: sglang imports it only for image models. triton is the real package: `sglang.srt.utils` imports it, and
# on CPU it is never launched.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
V=.venv-sglang
stamp=$V/.conformance-installed
want=$(cat pyproject.toml scripts/conformance_env.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
t0=$(date +%s)
[ -x $V/bin/python ] || "$PY" -m venv $V
pip() { $V/bin/python -m pip install -q -c $V/constraints.txt "$@"; }
# torch: the CPU build; the rest: the versions SGLang 0.5.23's wheel pins, so its code runs against what it expects
printf '%s\n' torch==2.13.0 transformers==5.19.0 tokenizers==0.23.2 openai==2.8.0 'python-dateutil<3' \
  xgrammar==0.2.7 compressed-tensors==0.18.0 sentencepiece==0.2.1 soundfile==0.13.1 triton==3.8.0 > $V/constraints.txt
$V/bin/python -m pip install -q --upgrade pip
pip ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch==2.13.0
# LoongSage itself (its transfermesh, rollout, fleet and agentflow code is what the tier records and checks)
pip -e ".[dev]"
pip --no-deps sglang==0.5.23
# what SGLang's http_server, io_struct, weight_sync, function_call and parser modules import, at the versions its
# wheel names where it pins one
pip ipython xgrammar msgspec orjson pybase64 pyzmq setproctitle uvloop aiohttp requests partial_json_parser regex einops \
    python-multipart prometheus-client interegular triton pillow psutil packaging dill sentencepiece \
    compressed-tensors gguf soundfile
site=$($V/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# The stub: every module SGLang or transformers imports from torchvision at import time; any name in it is a
# placeholder that raises ImportError when called, so a code path that really needs torchvision fails loudly.
for m in "" io transforms transforms/functional transforms/v2 transforms/v2/functional; do
  mkdir -p "$site/torchvision/$m"
  cat > "$site/torchvision/$m/__init__.py" <<'EOF2'
"""Stub of torchvision (scripts/conformance_env.sh): the registry's builds all need CUDA torch."""
__version__ = "0.0.0+stub"


class _Missing:
    def __init__(self, name):
        self.name = name

    def __getattr__(self, attr):
        return _Missing(f"{self.name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise ImportError(f"{self.name}: torchvision is a stub in .venv-sglang (scripts/conformance_env.sh)")


def __getattr__(name):
    return _Missing(f"{__name__}.{name}")
EOF2
done
$V/bin/python -c 'import torch; assert torch.__version__.startswith("2.13.0"), torch.__version__
import sglang.srt.entrypoints.http_server, sglang.srt.function_call.function_call_parser, sglang.srt.utils.weight_checker'
echo "$want" > "$stamp"
echo "conformance_env: $V ready in $(( $(date +%s) - t0 )) s ($($V/bin/python -c 'import torch, sglang; print("torch", torch.__version__, "sglang", sglang.__version__)'))"
