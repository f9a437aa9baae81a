"""Recipes: every YAML validates here (GPU ones included), and the code-repair tool runs real tests
in a real sandbox."""
import asyncio
from pathlib import Path

import pytest

import loongsage

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("recipe", sorted(p.name for p in (ROOT / "recipes").glob("*.yaml")))
def test_every_recipe_passes_validation(recipe):
    cfg = loongsage.load_config(str(ROOT / "recipes" / recipe))
    assert cfg.prompts_per_step * cfg.samples_per_prompt % cfg.global_batch_size == 0
    assert loongsage.describe(cfg)


def test_code_repair_tool_runs_the_tests_in_a_sandbox():
    from recipes import code_repair
    sample = {"tests": "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n", "timeout": 10}
    good = asyncio.run(code_repair.run_tests("def add(a, b):\n    return a + b\n", sample))
    bad = asyncio.run(code_repair.run_tests("def add(a, b):\n    return a - b\n", sample))
    assert good.startswith("PASSED")
    assert bad.startswith("FAILED") and "AssertionError" in bad
