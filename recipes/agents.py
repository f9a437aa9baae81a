#!/usr/bin/env python
"""Launchers for the coding-agent programs people train, run unmodified as black-box agents through the router.

Each launcher writes the program's own configuration into a private home directory (never the user's), pointing it
at one session of the router, with telemetry, auto-update and the program's own sandbox and permission prompts off
(LoongSage's sandbox contains it), and returns the command line and environment to run it with, in the task's
working copy. Programs (installed at pinned versions by scripts/agents_env.sh):

  codex     @openai/codex       `codex exec`, a model provider with wire_api "responses" (the Responses API)
  claude    @anthropic-ai/claude-code   `claude -p`, ANTHROPIC_BASE_URL (the Messages API)
  opencode  opencode-ai         `opencode run`, an @ai-sdk/openai-compatible provider (Chat Completions)
  mini      mini-swe-agent      `mini` (pip, its own venv), litellm's openai/ provider (Chat Completions)

`shrink=True` cuts each program's prompt through its own documented settings (a short system prompt, the shell tool
only), so a small model's context holds it; the full-length requests are in tests/agent_requests/.

As a recipe's agent command (the router's session variables come from AgentFlow's black-box path):
  agent_command: python $LOONGSAGE_ROOT/recipes/agents.py codex
Test: tests/test_real_agents.py (after scripts/agents_env.sh). Left out: running as another user (no launcher needs
it: Codex's sandbox is bypassed, Claude Code is given its tools by --allowedTools instead of
--dangerously-skip-permissions, which it refuses as root, opencode's and mini's permissions are set to allow).
"""
import json
import os
import pwd
import sys
import tempfile
from pathlib import Path

PINNED = {"codex": "@openai/codex@0.171.0", "claude": "@anthropic-ai/claude-code@2.1.332",
          "opencode": "opencode-ai@1.18.33", "mini": "mini-swe-agent==2.4.6"}  # mini: pip, the rest npm
# the user's own home, not $HOME: a sandbox sets HOME to its directory
AGENTS_DIR = Path(os.environ.get("LOONGSAGE_AGENTS_DIR") or
                  Path(pwd.getpwuid(os.getuid()).pw_dir) / ".cache" / "loongsage" / "agents")
def executable(program: str) -> Path:
    """Where scripts/agents_env.sh installs `program`."""
    return AGENTS_DIR / ("mini-swe-agent/bin/mini" if program == "mini" else f"node_modules/.bin/{program}")


# the name the programs' small/fast model is given: the router labels requests naming it "side" (agentflow.SIDE_MODEL)
SIDE_MODEL = "loongsage-side"
SYSTEM = "You are a coding agent. Run shell commands with {tool}."


def codex(task: str, base_url: str, api_key: str, home: str, shrink: bool) -> tuple[list[str], dict]:
    """Codex CLI: config.toml in CODEX_HOME; the key in an env var its provider names. shrink: model_instructions_file
    replaces the base instructions, and the tools other than the shell's are turned off (features)."""
    Path(home, "instructions.md").write_text(SYSTEM.format(tool="exec_command"))
    top = (f'model_instructions_file = "{home}/instructions.md"\ninclude_permissions_instructions = false\n'
           'include_apps_instructions = false\ninclude_environment_context = false\nweb_search = "disabled"\n')
    features = "".join(f"{f} = false\n" for f in ("multi_agent", "goals", "apps", "view_image", "image_generation",
                                                   "sleep_tool", "tool_suggest", "skill_search"))
    Path(home, "config.toml").write_text(
        (top if shrink else "") + 'model = "loongsage"\nmodel_provider = "loongsage"\n'
        'check_for_update_on_startup = false\n' + (f"[features]\n{features}" if shrink else "") +
        f'[analytics]\nenabled = false\n[model_providers.loongsage]\nname = "LoongSage"\nbase_url = "{base_url}"\n'
        'env_key = "LOONGSAGE_API_KEY"\nwire_api = "responses"\n')
    argv = [str(executable("codex")), "exec", "--skip-git-repo-check",
            "--dangerously-bypass-approvals-and-sandbox", task]
    return argv, {"CODEX_HOME": home, "LOONGSAGE_API_KEY": api_key}


def claude(task: str, base_url: str, api_key: str, home: str, shrink: bool) -> tuple[list[str], dict]:
    """Claude Code: ANTHROPIC_BASE_URL (without /v1: the SDK adds it), its small/fast model named SIDE_MODEL; the Bash
    tool allowed by --allowedTools, so no permission prompt and no --dangerously-skip-permissions (refused as root).
    shrink: --system-prompt, --tools Bash, --bare (no hooks, plugins, CLAUDE.md discovery or background prefetches)."""
    argv = [str(executable("claude")), "-p", task, "--model", "loongsage", "--allowedTools", "Bash",
            "--output-format", "json"]
    if shrink:
        argv += ["--tools", "Bash", "--bare", "--disable-slash-commands", "--system-prompt", SYSTEM.format(tool="Bash")]
    return argv, {"ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"), "ANTHROPIC_API_KEY": api_key,
                  "ANTHROPIC_SMALL_FAST_MODEL": SIDE_MODEL, "ANTHROPIC_DEFAULT_HAIKU_MODEL": SIDE_MODEL,
                  "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
                  "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}


def opencode(task: str, base_url: str, api_key: str, home: str, shrink: bool) -> tuple[list[str], dict]:
    """opencode: a config file (OPENCODE_CONFIG) with a provider of the bundled @ai-sdk/openai-compatible package and
    every permission allowed; the models.dev fetch, auto-update, sharing, LSP downloads and default plugins off.
    shrink: a custom primary agent whose prompt is the short system prompt, every tool but bash disabled."""
    config = {"model": "loongsage/loongsage", "small_model": f"loongsage/{SIDE_MODEL}", "autoupdate": False,
              "share": "disabled", "permission": {"*": "allow"},
              "provider": {"loongsage": {"npm": "@ai-sdk/openai-compatible", "name": "LoongSage",
                                         "options": {"baseURL": base_url, "apiKey": api_key},
                                         "models": {m: {"name": m} for m in ("loongsage", SIDE_MODEL)}}}}
    if shrink:
        config["agent"] = {"loongsage": {"mode": "primary", "prompt": SYSTEM.format(tool="bash"),
                                         "tools": {"*": False, "bash": True}}}
    Path(home, "opencode.json").write_text(json.dumps(config))
    argv = [str(executable("opencode")), "run", *(["--agent", "loongsage"] if shrink else []), task]
    return argv, {"OPENCODE_CONFIG": f"{home}/opencode.json", "OPENCODE_DISABLE_MODELS_FETCH": "1",
                  "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_SHARE": "1",
                  "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
                  "OPENCODE_DISABLE_CLAUDE_CODE": "1"}


def mini(task: str, base_url: str, api_key: str, home: str, shrink: bool) -> tuple[list[str], dict]:
    """mini-swe-agent: its own config file over the built-in mini.yaml (litellm's `openai/` provider at the session,
    cost tracking off), yolo mode, exit without confirming; litellm's cost-map download off. shrink: a short system
    prompt and the task alone as the first user message."""
    config = {"model": {"model_name": "openai/loongsage", "cost_tracking": "ignore_errors",
                        "model_kwargs": {"api_base": base_url, "api_key": api_key, "drop_params": True}}}
    if shrink:
        config["agent"] = {"system_template": SYSTEM.format(tool="bash"), "instance_template": "{{task}}"}
    Path(home, "loongsage.yaml").write_text(json.dumps(config))  # YAML is a superset of JSON
    argv = [str(executable("mini")), "-c", "mini.yaml", "-c", f"{home}/loongsage.yaml",
            "-y", "--exit-immediately", "-l", "0", "-o", f"{home}/trajectory.json", "-t", task]
    return argv, {"MSWEA_CONFIGURED": "true", "MSWEA_SILENT_STARTUP": "1", "MSWEA_GLOBAL_CONFIG_DIR": home,
                  "LITELLM_LOCAL_MODEL_COST_MAP": "True"}


LAUNCHERS = {"codex": codex, "claude": claude, "opencode": opencode, "mini": mini}


def launch(program: str, task: str, base_url: str, api_key: str, shrink: bool = True) -> tuple[list[str], dict]:
    """(argv, env) that run `program` on `task` against the session at `base_url` (.../s/<session>/v1), in a fresh
    private home; run it in the task's working copy."""
    if program not in PINNED:
        raise ValueError(f"unknown agent program {program!r}; one of {sorted(PINNED)}")
    home = tempfile.mkdtemp(prefix=f"loongsage-{program}-")
    argv, env = LAUNCHERS[program](task, base_url, api_key, home, shrink)
    if not Path(argv[0]).exists():
        raise FileNotFoundError(f"{argv[0]} is missing: install the pinned programs with scripts/agents_env.sh "
                                f"(LOONGSAGE_AGENTS_DIR={AGENTS_DIR})")
    base = {k: os.environ[k] for k in ("PATH", "LANG", "TMPDIR") if k in os.environ}
    return argv, {**base, "HOME": home, "TERM": "dumb", "NO_COLOR": "1", **env}


def main() -> int:
    """agent_command entry: the session from OPENAI_BASE_URL / OPENAI_API_KEY, the task from $LOONGSAGE_TASK or
    stdin, the task's working copy from the sample's `files` ({path: text}, written into the working directory);
    the program's output on stdout, its exit status returned. AGENT_SHRINK=0 keeps the full prompts."""
    if len(sys.argv) != 2:
        print(f"usage: agents.py PROGRAM ({'|'.join(PINNED)})", file=sys.stderr)
        return 2
    task = os.environ.get("LOONGSAGE_TASK") or sys.stdin.read().strip()
    sample_file = os.environ.get("LOONGSAGE_SAMPLE_FILE")
    for name, text in (json.loads(Path(sample_file).read_text()) if sample_file else {}).get("files", {}).items():
        Path(name).parent.mkdir(parents=True, exist_ok=True)
        Path(name).write_text(text)
    argv, env = launch(sys.argv[1], task, os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"],
                       shrink=os.environ.get("AGENT_SHRINK", "1") != "0")
    os.execve(argv[0], argv, env)


if __name__ == "__main__":
    sys.exit(main())
