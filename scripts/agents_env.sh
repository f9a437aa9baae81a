#!/usr/bin/env bash
# Install the agent programs of the compatibility tier (tests/test_real_agents.py) at their pinned versions, into
# $LOONGSAGE_AGENTS_DIR (default ~/.cache/loongsage/agents), outside the checkout; the main .venv is not touched.
#   scripts/agents_env.sh && LOONGSAGE_AGENTS_REQUIRED=1 .venv/bin/pytest -q -s tests/test_real_agents.py
# Idempotent (a stamp, as conformance_env.sh): a second run is a no-op. Needs node and npm (Claude Code's package
# carries its own runtime; Codex's is a static binary).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${LOONGSAGE_AGENTS_DIR:-$HOME/.cache/loongsage/agents}
PINS=$(python3 -c 'import sys; sys.path.insert(0, "recipes"); import agents; print(" ".join(agents.PINNED.values()))')
stamp=$DIR/.agents-installed
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$PINS" ]; then exit 0; fi
t0=$(date +%s)
mkdir -p "$DIR"
npm install --prefix "$DIR" --no-audit --no-fund --no-save --loglevel=error $PINS
for p in codex claude; do "$DIR/node_modules/.bin/$p" --version; done
echo "$PINS" > "$stamp"
echo "agents_env: $PINS in $DIR ready in $(( $(date +%s) - t0 )) s"
