#!/usr/bin/env bash
# Fetch what scripts/gpu_check.py carries to the lent air-gapped GPU machine (Python 3.12, manylinux x86_64, torch +
# transformers + peft there) into .gpu_wheels/ (gitignored), and check it fits the 64 MiB that travels with the working
# tree. Run it where the registries are reachable; on the GPU machine `python3 scripts/gpu_check.py` unpacks the
# wheels of the modules that machine lacks onto its path (nothing is installed).
#   .gpu_wheels/*.whl      Megatron-Core (the trainer), xxhash (transfermesh's checksums), httpx and what it needs
#                          (transfermesh imports it; transformers' hub client no longer brings it)
#   .gpu_wheels/sglang/    the two files of SGLang 0.5.23's weight receiver gpu_check.py runs (sglang/srt/utils/
#                          common.py, patch_torch.py), not its wheel (39 MiB; its package imports orjson, pybase64,
#                          triton and more, which that machine lacks)
# PY_VERSION=3.11 fetches for another Python (a pre-flight on this machine).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
V=${PY_VERSION:-3.12}
rm -rf .gpu_wheels && mkdir -p .gpu_wheels
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$V" --implementation cp \
  --abi "cp${V/./}" --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d .gpu_wheels "megatron-core>=0.16,<0.17" xxhash httpx httpcore certifi h11 anyio idna sniffio
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$V" --implementation cp \
  --platform manylinux_2_34_x86_64 -d .gpu_wheels/tmp sglang==0.5.23
"$PY" - <<'EOF'
import glob, zipfile
with zipfile.ZipFile(glob.glob(".gpu_wheels/tmp/sglang-0.5.23-*.whl")[0]) as z:
    for f in ("sglang/srt/utils/common.py", "sglang/srt/utils/patch_torch.py"):
        z.extract(f, ".gpu_wheels/sglang")
EOF
rm -rf .gpu_wheels/tmp
total=$(du -cb .gpu_wheels | tail -1 | cut -f1)
ls -l .gpu_wheels
echo "gpu_wheels: $(ls .gpu_wheels/*.whl | wc -l) wheels + SGLang's receiver," \
  "$((total / 1024)) KiB of the 65536 KiB budget"
[ "$total" -le $((64 * 1024 * 1024)) ] || { echo "gpu_wheels: over the 64 MiB budget" >&2; exit 1; }
