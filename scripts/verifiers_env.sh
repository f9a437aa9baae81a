#!/usr/bin/env bash
# Build .venv-verifiers: the `verifiers` library (with its reasoning-gym extra) in a venv of its own, so the
# verifiers tier (tests/test_verifiers.py) can run its environments unmodified as black-box programs against
# LoongSage's router:
#   scripts/verifiers_env.sh && LOONGSAGE_VERIFIERS=1 .venv/bin/python -m pytest -q tests/test_verifiers.py
# Idempotent (a stamp, as conformance_env.sh): a second run is a no-op. The main .venv is not touched: verifiers
# pins what LoongSage's venv holds at other versions (openai, datasets, mcp), and it is only ever run as a program.
#
# Why 0.3.1 and not 0.4.0: 0.4.0 ships only its new `verifiers.v1` stack; ReasoningGymEnv, MultiTurnEnv and ToolEnv
# (the classic environments, which 0.3.1 still ships and exports as `vf.ReasoningGymEnv` ...) are gone from it.
# LoongSage itself is not installed here: the programs in tests/verifiers_agents.py import only verifiers.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
V=.venv-verifiers
stamp=$V/.verifiers-installed
want=$(sha256sum scripts/verifiers_env.sh | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
t0=$(date +%s)
[ -x $V/bin/python ] || "$PY" -m venv $V
$V/bin/python -m pip install -q --upgrade pip
$V/bin/python -m pip install -q "verifiers[rg]==0.3.1" reasoning-gym==0.1.25
$V/bin/python -c 'import verifiers as vf; vf.ReasoningGymEnv, vf.MultiTurnEnv, vf.ToolEnv'
echo "$want" > "$stamp"
echo "verifiers_env: $V ready in $(( $(date +%s) - t0 )) s ($($V/bin/python -c 'import verifiers, openai, datasets
print("verifiers", verifiers.__version__, "openai", openai.__version__, "datasets", datasets.__version__)'))"
