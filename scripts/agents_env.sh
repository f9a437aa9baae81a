#!/usr/bin/env bash
# Install the agent programs of the compatibility tier (tests/test_real_agents.py) at their pinned versions, into
# $LOONGSAGE_AGENTS_DIR (default ~/.cache/loongsage/agents), outside the checkout; the main .venv is not touched:
# Codex CLI, Claude Code and opencode with npm, mini-swe-agent (and the litellm it imports) in a venv of its own there.
#   scripts/agents_env.sh && LOONGSAGE_AGENTS_REQUIRED=1 .venv/bin/pytest -q -s tests/test_real_agents.py
# Idempotent (a stamp, as conformance_env.sh): a second run is a no-op. Needs node and npm (Claude Code's package
# carries its own runtime; Codex's and opencode's are static binaries) and python3 with venv.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${LOONGSAGE_AGENTS_DIR:-$HOME/.cache/loongsage/agents}
PINS=$(python3 -c 'import sys; sys.path.insert(0, "recipes"); import agents; print(" ".join(agents.PINNED.values()))')
stamp=$DIR/.agents-installed
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$PINS" ]; then exit 0; fi
t0=$(date +%s)
mkdir -p "$DIR"
NPM_PINS=$(tr ' ' '\n' <<< "$PINS" | grep '@' | tr '\n' ' ')
npm install --prefix "$DIR" --no-audit --no-fund --no-save --loglevel=error $NPM_PINS
[ -x "$DIR/mini-swe-agent/bin/python" ] || python3 -m venv "$DIR/mini-swe-agent"
MINI_PIN=$(tr ' ' '\n' <<< "$PINS" | grep '==')
"$DIR/mini-swe-agent/bin/python" -m pip install -q --disable-pip-version-check "$MINI_PIN" \
  2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
for p in codex claude opencode; do echo "$p $("$DIR/node_modules/.bin/$p" --version)"; done
MSWEA_SILENT_STARTUP=1 "$DIR/mini-swe-agent/bin/python" -c 'import minisweagent as m; print("mini", m.__version__)'
echo "$PINS" > "$stamp"
echo "agents_env: $PINS in $DIR ready in $(( $(date +%s) - t0 )) s"
