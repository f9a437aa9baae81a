"""`agent_preload: [recipes.repair_preload]`: the warm interpreter imports mini-swe-agent and litellm once.

They live in mini-swe-agent's own venv (scripts/agents_env.sh; the same Python version as LoongSage's), so its
site-packages go first on this interpreter's path; the settings both read at import time (no cost-map download, no
banner, a private config directory) are set first. Import this only in the warm interpreter (sandbox.WarmPython).
"""
import os
import sys
import sysconfig
import tempfile

from recipes import agents

VENV = agents.AGENTS_DIR / "mini-swe-agent"
SITE = VENV / sysconfig.get_path("purelib", vars={"base": "", "platbase": ""}).lstrip("/")
if not SITE.is_dir():
    raise ImportError(f"{SITE} is missing: install mini-swe-agent with scripts/agents_env.sh")
sys.path.insert(0, str(SITE))
for key, value in (("LITELLM_LOCAL_MODEL_COST_MAP", "True"), ("MSWEA_SILENT_STARTUP", "1"),
                   ("MSWEA_CONFIGURED", "true"), ("MSWEA_GLOBAL_CONFIG_DIR", tempfile.mkdtemp(prefix="mswea-"))):
    os.environ.setdefault(key, value)
import litellm  # noqa: E402,F401
import litellm.llms.openai.openai  # noqa: E402,F401  (litellm imports its OpenAI route at the first call)
import minisweagent.agents.default  # noqa: E402,F401
import minisweagent.environments.local  # noqa: E402,F401
import minisweagent.models.litellm_textbased_model  # noqa: E402,F401
import minisweagent.run.mini  # noqa: E402,F401
