"""The reading path stays as STYLE and docs/READING.md describe it: loongsage.py opens with train() (at most 150 lines, and
it never writes the config it was given), config.py and cpu.py stand below the controller (no import back up),
agentflow.py's comment ratio, Config as the only source of defaults, imports at the top of the modules
converted so far (a late import says why), no two modules that import each other, and no class over 500 lines
or function over 200. Pure source reading, no model: `.venv/bin/pytest tests/test_reading_path.py -q` (about a
second).
"""
import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(ROOT.glob("*.py"))
# Modules whose imports sit at the top, late ones commented with why (optional dependency, import cycle, heavy
# and not needed by `--check`, after a setup step). A new module joins this list.
TOP_IMPORTS = ("agentflow.py", "wire.py", "data.py", "algos.py", "teacher.py", "viewer.py", "loongsage.py",
               "rollout.py", "cpu_engine.py", "cpu_model.py", "transfermesh.py", "trainer.py", "bench.py", "convert.py",
               "cpu.py", "config.py", "fleet.py", "chat.py", "lora.py")


def comment_ratio(source: str) -> float:
    """(comment lines + docstring lines) / code lines, where
      docstring lines: every line of a module, class or function docstring (first statement, a string);
      comment lines:   lines outside docstrings holding a `#` comment, alone or after code (tokenize's COMMENT);
      code lines:      non-blank lines that are neither docstring lines nor comment-only lines.
    A line of code with a trailing comment counts on both sides. (algos.py, the model to copy, measures 0.74.)"""
    doc = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
                    isinstance(first.value.value, str):
                doc.update(range(first.lineno, first.end_lineno + 1))
    commented = {t.start[0] for t in tokenize.generate_tokens(io.StringIO(source).readline)
                 if t.type == tokenize.COMMENT} - doc
    code = {i for i, line in enumerate(source.splitlines(), 1)
            if line.strip() and not line.strip().startswith("#") and i not in doc}
    return (len(commented) + len(doc)) / max(len(code), 1)


def test_comment_ratio_counts_as_defined():
    source = ('"""Module doc,\ntwo lines."""\n'       # 2 docstring lines
              "import os  # why\n"                      # code + comment
              "\n"
              "# a comment alone\n"                     # comment
              "def f():\n"                              # code
              "    '''one line'''\n"                    # docstring
              "    return os.sep\n")                    # code
    assert comment_ratio(source) == (2 + 2 + 1) / 3


def test_agentflow_comment_ratio_is_at_least_0_3():
    ratio = comment_ratio((ROOT / "agentflow.py").read_text())
    assert ratio >= 0.3, f"agentflow.py comment ratio {ratio:.3f} < 0.3: say why where the code does not"


def test_config_is_the_only_source_of_defaults():
    """No second default beside Config's: no defaults table in algos, no getattr(cfg, name, default) anywhere."""
    fallback = re.compile(r"getattr\(\s*(self\.)?cfg\s*,\s*[\"'][A-Za-z_]+[\"']\s*,")
    found = [f"{p.name}:{i}" for p in MODULES for i, line in enumerate(p.read_text().splitlines(), 1)
             if fallback.search(line)]
    assert found == [], f"getattr fallbacks on a config (Config holds the default): {found}"
    assert "ALGO_DEFAULTS" not in (ROOT / "algos.py").read_text()


@pytest.mark.parametrize("name", TOP_IMPORTS)
def test_late_imports_say_why(name):
    source = (ROOT / name).read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    top = {id(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))}

    def says_why(i: int) -> bool:  # a comment on the import's line, or just above it (alone, or on the `if ...:`)
        above = lines[i - 2].strip()
        opener_with_comment = "#" in above and above.split("#")[0].rstrip().endswith(":")
        return "#" in lines[i - 1] or above.startswith("#") or opener_with_comment
    silent = [n.lineno for n in ast.walk(tree)
              if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in top and not says_why(n.lineno)]
    assert silent == [], f"{name}: imports inside functions with no comment saying why, lines {silent}"


def module_imports(source: str, modules: set[str]) -> set[str]:
    """The top-level modules among `modules` that `source` imports anywhere: at the top, inside functions, under
    `if TYPE_CHECKING:` (an annotation-only import still ties the two files together for a reader)."""
    found = set()
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Import):
            found |= {a.name.split(".")[0] for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
            found.add(n.module.split(".")[0])
    return found & modules


def test_module_imports_counts_late_and_type_checking_imports():
    source = ("import a, b.c\nfrom d import x\nimport zz\n"
              "def f():\n    import e\n"
              "if TYPE_CHECKING:\n    from g import T\n")
    assert module_imports(source, {"a", "b", "d", "e", "g", "h"}) == {"a", "b", "d", "e", "g"}


def test_no_module_imports_one_that_imports_it():
    """No import cycle among the top-level modules, directly or through others: each module can be read, imported
    and tested without the modules that use it."""
    names = {p.stem for p in MODULES}
    deps = {p.stem: module_imports(p.read_text(), names) - {p.stem} for p in MODULES}

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for d in deps[todo.pop()] - seen:
                seen.add(d)
                todo.append(d)
        return seen
    reach = {m: reachable(m) for m in deps}
    cycles = sorted({tuple(sorted((a, b))) for a in deps for b in reach[a] if b != a and a in reach[b]})
    assert cycles == [], f"modules that import each other, directly or through others: {cycles}"


def _functions(name: str) -> list[ast.FunctionDef | ast.ClassDef]:
    tree = ast.parse((ROOT / name).read_text())
    return [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]


def _imported(name: str) -> set[str]:
    """Every module `name` imports, at the top or inside a function."""
    found = set()
    for n in ast.walk(ast.parse((ROOT / name).read_text())):
        if isinstance(n, ast.Import):
            found |= {a.name.split(".")[0] for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module:
            found.add(n.module.split(".")[0])
    return found


def test_train_is_the_first_function_of_the_controller_and_fits_150_lines():
    """A reader opening loongsage.py meets train() right after the docstring and imports, then the producer,
    eval and main; train() is at most 150 lines, def line to last line."""
    defs = _functions("loongsage.py")
    assert defs[0].name == "train", [d.name for d in defs[:3]]
    assert defs[-1].name == "main"
    names = [d.name for d in defs]
    assert names.index("Producer") < names.index("evaluate") < names.index("main")
    lines = defs[0].end_lineno - defs[0].lineno + 1
    assert lines <= 150, f"train() is {lines} lines; move a detail into a function it calls"


def test_the_controller_never_writes_the_config():
    """No attribute assignment to `cfg` (cfg.x = ..., cfg.x += ..., setattr(cfg, ...)) in train() or anything the
    controller calls (loongsage.py, fleet.py): what a run derives lives in locals and the Fleet, and actors get
    their values explicitly. (config.finalize derives fields once, at load: that is where they are written.)"""
    found = []
    for name in ("loongsage.py", "fleet.py"):
        for n in ast.walk(ast.parse((ROOT / name).read_text())):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(
                n, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                for e in ast.walk(t):
                    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "cfg":
                        found.append(f"{name}:{n.lineno}")
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "setattr" and n.args and \
                    isinstance(n.args[0], ast.Name) and n.args[0].id == "cfg":
                found.append(f"{name}:{n.lineno}")
    assert found == [], f"the config is written at {found}"


def test_no_import_goes_back_up_the_reading_path():
    """loongsage -> config, fleet; fleet -> config; config imports neither the controller nor the fleet, and cpu.py
    (what exists because there is no GPU) imports none of them nor the trainer: no import circles."""
    assert not _imported("config.py") & {"loongsage", "fleet"}
    assert not _imported("fleet.py") & {"loongsage"}
    assert not _imported("cpu.py") & {"loongsage", "fleet", "config", "trainer"}
    assert {"config", "fleet"} <= _imported("loongsage.py")


# The house's sizes: a class a reader can hold (its rooms split out, as trainer.py's Model, Optim, Critic, HandOff,
# Export), a function a student reads in one sitting. Measured def line to last line, nested ones included.
MAX_CLASS_LINES, MAX_FUNCTION_LINES = 500, 200
SIZED = MODULES + sorted(ROOT.glob("recipes/*.py")) + sorted(ROOT.glob("scripts/*.py"))


def oversized(source: str, name: str) -> list[str]:
    """'name: class C, N lines' for every class over MAX_CLASS_LINES and every function (method, nested function)
    over MAX_FUNCTION_LINES in `source`."""
    found = []
    for n in ast.walk(ast.parse(source)):
        lines = getattr(n, "end_lineno", 0) - getattr(n, "lineno", 0) + 1
        if isinstance(n, ast.ClassDef) and lines > MAX_CLASS_LINES:
            found.append(f"{name}: class {n.name}, {lines} lines")
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and lines > MAX_FUNCTION_LINES:
            found.append(f"{name}: def {n.name}, {lines} lines")
    return found


def test_oversized_measures_classes_and_nested_functions():
    """A class one line over the limit is named, one at the limit is not; a nested function is measured on its own
    and inside its outer one, def line to last line."""
    body = "    x = 1\n"
    source = ("class Big:\n" + body * MAX_CLASS_LINES                       # MAX + 1 lines
              + "class Fits:\n" + body * (MAX_CLASS_LINES - 1)            # MAX lines
              + "def outer():\n    def inner():\n" + ("    " + body) * MAX_FUNCTION_LINES + "    return inner\n")
    assert oversized(source, "m.py") == [f"m.py: class Big, {MAX_CLASS_LINES + 1} lines",
                                         f"m.py: def outer, {MAX_FUNCTION_LINES + 3} lines",
                                         f"m.py: def inner, {MAX_FUNCTION_LINES + 1} lines"]


def test_no_class_over_500_lines_and_no_function_over_200():
    """Every module, recipe and script: no class over MAX_CLASS_LINES and no function over MAX_FUNCTION_LINES; a
    failure names each one with its length."""
    found = [o for p in SIZED for o in oversized(p.read_text(), str(p.relative_to(ROOT)))]
    assert found == [], (f"over {MAX_CLASS_LINES} lines per class / {MAX_FUNCTION_LINES} per function (split a "
                         f"room or a step out): {found}")
