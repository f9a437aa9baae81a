"""The README and docs/ stay true to the code: the README's code examples run as the README says they do (the agent
through the real router and CPU engine, the reward and the advantage estimator through the core's own dispatch, the
teacher keys through config.load_config); every `module.name` the docs quote exists; every file, link and anchor
they point to exists; every metric the code names is in docs/METRICS.md, once; every module has a row in the
README's file table and docs/READING.md's; the README stays a short guide (at most 250 lines), shows CI's two
commands exactly and names the quick tier, which reaches every module.
`.venv/bin/python -m pytest tests/test_readme.py -q` (about 20 s: one CPU engine on the tiny model).
"""
import ast
import importlib
import inspect
import re
import sys
import tomllib
from pathlib import Path

import pytest
import torch
import yaml

import agentflow
import algos
import config
import cpu_engine
import data
from test_agentflow import SAMPLING, make_cfg, run

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "ALGORITHMS.md"]
MODULES = {p.stem: p for p in ROOT.glob("*.py")}


def python_snippets() -> dict[str, str]:
    """The README's ```python blocks by the file name on their first line (`# my_agent.py`)."""
    out = {}
    for block in re.findall(r"```python\n(.*?)```", README, re.S):
        first = block.splitlines()[0]
        m = re.fullmatch(r"# (\w+)\.py", first.strip())
        assert m, f"a README python block must start with '# NAME.py' (the file a user writes), got {first!r}"
        out[m.group(1)] = block
    return out


@pytest.fixture(scope="module")
def readme_modules(tmp_path_factory):
    """Each README snippet written as the user's module outside the repo and imported (names prefixed, so they
    cannot shadow anything)."""
    where = tmp_path_factory.mktemp("readme_user")
    names = {}
    for name, source in python_snippets().items():
        (where / f"readme_{name}.py").write_text(source)
        names[name] = f"readme_{name}"
    sys.path.insert(0, str(where))
    yield {name: importlib.import_module(mod) for name, mod in names.items()}
    sys.path.remove(str(where))


def test_readme_is_a_short_guide_with_the_ci_commands():
    lines = README.count("\n")
    assert lines <= 250, f"README.md is {lines} lines; measurements and deep notes go to docs/"
    ci = (ROOT / ".ci" / "run").read_text()
    assert '"./bootstrap.sh && .venv/bin/python -m pytest -q tests"' in ci, "CI runs the README's test command"
    for command in ("./bootstrap.sh && .venv/bin/python loongsage.py recipes/arith_cpu.yaml",
                    "./bootstrap.sh && .venv/bin/python -m pytest -q tests"):
        assert command in README, command


QUICK = '.venv/bin/python -m pytest -q -m "not slow" tests'


def test_the_quick_tier_is_named_and_reaches_every_module():
    """The README names the quick tier beside CI's command; pyproject.toml registers its marker (with
    --strict-markers, so a misspelt one fails collection); and every module of the package is used, as
    `module.name`, by at least one test outside the tier's `slow` marker, so that no module goes untested while
    editing."""
    assert QUICK in README
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
    pytest_ini, packaged = pyproject["pytest"]["ini_options"], pyproject["setuptools"]["py-modules"]
    assert "--strict-markers" in pytest_ini["addopts"] and any(m.startswith("slow:") for m in pytest_ini["markers"])
    used = set()
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for fn in ast.parse(path.read_text()).body:
            if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_") and \
                    not any(ast.unparse(d) == "pytest.mark.slow" for d in fn.decorator_list):
                used |= {n.value.id for n in ast.walk(fn)
                         if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
    assert set(packaged) == set(MODULES), "every module at the root is in pyproject.toml's py-modules"
    # vllm_plugin imports vLLM: it runs only inside vLLM's workers, in .venv-vllm (tests/test_vllm.py, its own tier)
    assert not set(packaged) - used - {"vllm_plugin"}, f"modules no quick test uses: {sorted(set(packaged) - used)}"


def test_every_module_is_in_the_readme_file_table_and_the_reading_path():
    """Each module pyproject.toml packages (py-modules, so a new or split module is counted the day it is added) has
    a row of its own in the README's file table and in docs/READING.md's, and neither names a module that is gone."""
    packaged = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["py-modules"]
    for doc in (ROOT / "README.md", ROOT / "docs" / "READING.md"):
        rows = set(re.findall(r"^\| `(\w+)\.py` \|", doc.read_text(), re.M))
        assert rows == set(packaged), f"{doc.name}: no row for {sorted(set(packaged) - rows)}, " \
                                      f"rows for no module: {sorted(rows - set(packaged))}"


def test_readme_snippets_name_only_what_exists():
    """Every snippet compiles, and every `module.name` it uses on a repository module exists there."""
    snippets = python_snippets()
    assert {"my_agent", "my_reward", "my_algos"} <= set(snippets)
    for name, source in snippets.items():
        tree = ast.parse(source, f"README {name}.py")
        imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in imported & set(MODULES):
                assert hasattr(importlib.import_module(n.value.id), n.attr), f"README {name}.py: {n.value.id}.{n.attr}"


def test_readme_agent_runs_through_the_router(readme_modules, tiny_model_dir):
    """The README's agent, loaded by dotted path as a recipe names it, makes its two calls through a real router
    session on a real CPU engine: one trajectory per sample, two model turns, no failure."""
    agent = readme_modules["my_agent"].agent
    assert inspect.iscoroutinefunction(agent) and list(inspect.signature(agent).parameters) == ["client", "sample"]
    url, handle = cpu_engine.serve(tiny_model_dir, max_batch=8, max_len=512, seed=0)

    async def body():
        flow = agentflow.AgentFlow(make_cfg(agent=f"{agent.__module__}.agent"), [url], tiny_model_dir)
        out = await flow.generate(data.arith_samples(1, seed=3), 2, SAMPLING, step=0)
        await flow.close()
        return out
    try:
        out = run(body())
    finally:
        handle.shutdown()
    assert [t["status"] for t in out] == ["ok", "ok"], [t["metadata"].get("error") for t in out]
    assert [t["metadata"]["turns"] for t in out] == [2, 2]


def test_readme_reward_has_exact_match_signature_and_scores(readme_modules):
    reward = readme_modules["my_reward"].contains_answer
    assert list(inspect.signature(reward).parameters) == list(inspect.signature(data.exact_match).parameters)
    assert reward("the sum is 12.", {"answer": "12"}) == 1.0
    assert reward("the sum is 13.", {"answer": "12"}) == 0.0


def test_readme_advantage_runs_in_the_core_dispatch(readme_modules):
    """Named by dotted path, the README's estimator passes algos.validate and gives, through
    algos.compute_advantages, the group-mean-centred reward clamped at 0, on the loss mask only."""
    name = f"{readme_modules['my_algos'].__name__}.positive_only"
    cfg = config.Config(advantage=name)
    algos.validate(cfg)
    rewards, groups = torch.tensor([1.0, 0.0, 0.0, 0.5]), torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1]])
    got = algos.compute_advantages(cfg, rewards, groups, mask)
    # group 0: mean 0.5 -> +0.5, -0.5 -> clamp 0.5, 0; group 1: mean 0.25 -> -0.25, +0.25 -> 0, 0.25
    want = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.25, 0.25]])
    torch.testing.assert_close(got, want)


def test_readme_teacher_keys_load_as_a_recipe(tmp_path):
    """The README's teacher YAML, put into the default recipe in place of its data set, is a valid config with
    two teachers each data source names; every key of every README YAML block is a Config field."""
    fields = set(config.Config.__dataclass_fields__)
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", README, re.S)]
    assert blocks, "the README shows a teacher recipe in a ```yaml block"
    for b in blocks:
        assert set(b) <= fields, set(b) - fields
    teacher_block = next(b for b in blocks if "teachers" in b)
    recipe = yaml.safe_load((ROOT / "recipes" / "arith_cpu.yaml").read_text())
    del recipe["dataset"], recipe["eval_dataset"]
    (tmp_path / "r.yaml").write_text(yaml.safe_dump({**recipe, **teacher_block}))
    cfg = config.load_config(str(tmp_path / "r.yaml"))
    assert sorted(cfg.teachers) == sorted({s["teacher"] for s in cfg.data_sources})


def _module_names(path: Path) -> set[str]:
    """Top-level names of a module and `Class.method` of its classes, read from the source (nothing imported)."""
    names = set()
    for n in ast.parse(path.read_text()).body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
            if isinstance(n, ast.ClassDef):
                names |= {f"{n.name}.{m.name}" for m in n.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
        elif isinstance(n, ast.Assign):
            names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            names.add(n.target.id)
    return names


def test_docs_quote_only_names_that_exist():
    """`module.name` (or `module.Class.method`) in backticks in the README and docs/ names a real definition of that
    repository module, so a rename cannot leave the docs pointing at nothing."""
    defs = {m: _module_names(p) for m, p in MODULES.items()}
    ref = re.compile(r"\b(" + "|".join(sorted(MODULES)) + r")\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)")
    missing = []
    for doc in DOCS:
        for quoted in re.findall(r"`([^`\n]+)`", doc.read_text()):
            for module, name in ref.findall(quoted):
                if name.split(".")[0] in ("py", "yaml", "md", "json", "jsonl", "png", "html", "sh"):
                    continue  # a file name (`fleet.py`, `config.yaml`), not a definition
                if name not in defs[module] and name.split(".")[0] not in defs[module]:
                    missing.append(f"{doc.name}: {module}.{name}")
    assert missing == [], missing


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation other than - and _ dropped, spaces to -."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_docs_point_at_files_and_anchors_that_exist():
    bad = []
    for doc in DOCS:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                bad.append(f"{doc.name}: link {target}")
            elif anchor and anchor not in _anchors(dest.read_text()):
                bad.append(f"{doc.name}: anchor {target}")
        for path in re.findall(r"`((?:recipes|scripts|tests|docs)/[\w./-]+\.\w+)", text):
            if not (ROOT / path).exists():
                bad.append(f"{doc.name}: file {path}")
    assert bad == [], bad


def test_every_metric_the_code_names_is_in_the_metric_table_once():
    """docs/METRICS.md's table names each metric once, and names every metric a module writes as a literal key."""
    table = [line for line in (ROOT / "docs" / "METRICS.md").read_text().splitlines() if line.startswith("| `")]
    named = [m for line in table for m in re.findall(r"`([^`]+)`", line.split(" | ")[0])]
    assert len(named) == len(set(named)), sorted({m for m in named if named.count(m) > 1})
    prefixes = "rollout|train|timing|perf|eval|weights|teacher|critic|engines|memory"
    literal = re.compile(r"[\"']((?:" + prefixes + r")/[A-Za-z0-9_@/]*[A-Za-z0-9_@])[\"']")
    in_code = {m for p in MODULES.values() for m in literal.findall(p.read_text())}
    assert in_code, "no metric found in the code: the pattern is wrong"
    assert sorted(in_code - set(named)) == []
