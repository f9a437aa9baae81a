"""Recipe `repair`: an unmodified mini-swe-agent fixes bugs in small generated packages; reward = the package's tests.

Tasks (`tasks(split, n, seed)`, a dataset source `recipes.repair.tasks:<split>:<n>:<seed>`): one of TEMPLATES (a
module and its test file) with one bug of one KIND injected (an operator, an off-by-one, a wrong constant, swapped
arguments, a missing return), its functions shuffled (line numbers vary) and their parameters renamed. The task
text is a bug report naming the file, the line and the line's wrong and right code. EVAL_PAIRS (one per kind, each
package at least once) are held out: split "train" never holds them, split "eval" holds only them. Deterministic by
seed.

The agent (`agent_command: python $LOONGSAGE_ROOT/recipes/repair.py`): writes the sample's files into the sandbox and
runs mini-swe-agent's own command-line app in this process, its text-based model class (one ```bash block per reply)
and its local environment, with a short config of its own (CONFIG: its documented knobs, so a tiny model's context
holds the prompt). With `agent_preload: [recipes.repair_preload]` each run forks from an interpreter that has
imported mini-swe-agent and litellm from their own venv (scripts/agents_env.sh). It prints the package's source files
as JSON: `reward` runs the pristine tests against them in a fresh sandbox without network, so an episode that edits
the tests gains nothing.

`sft_trajectory`: the ideal episode in mini-swe-agent's format (one ```bash block: a `sed -i` that rewrites the
reported line as the report says, then the submit command), token for token what the router records, to warm-start
the tiny model.
Test: tests/test_repair.py.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import tempfile
from pathlib import Path

KINDS = ("operator", "off_by_one", "constant", "swapped_args", "missing_return")
# each template: functions (source lines, {a} {b} the parameters, named per task), tests (asserts), bug sites
# {kind: [(function, right, wrong)]}
TEMPLATES = {
    "geometry": dict(
        functions={"area": ["def area({a}, {b}):", "    return {a} * {b}"],
                   "perimeter": ["def perimeter({a}, {b}):", "    return 2 * ({a} + {b})"],
                   "circle": ["def circle({a}):", "    return 3.14 * {a} * {a}"],
                   "last": ["def last({a}):", "    return {a}[len({a}) - 1]"],
                   "ratio": ["def ratio({a}, {b}):", "    return {a} // {b}"],
                   "half": ["def half({a}):", "    return ratio({a}, 2)"]},
        tests=["assert area(2, 3) == 6", "assert perimeter(2, 3) == 10", "assert circle(10) == 314.0",
               "assert last([4, 5, 6]) == 6", "assert ratio(9, 2) == 4", "assert half(8) == 4"],
        sites={"operator": [("area", "{a} * {b}", "{a} + {b}"), ("perimeter", "{a} + {b}", "{a} - {b}")],
               "off_by_one": [("last", "len({a}) - 1", "len({a}) - 2")],
               "constant": [("circle", "3.14", "3.41"), ("perimeter", "2 * (", "3 * (")],
               "swapped_args": [("half", "ratio({a}, 2)", "ratio(2, {a})")],
               "missing_return": [("area", "return {a} * {b}", "{a} * {b}"),
                                  ("ratio", "return {a} // {b}", "{a} // {b}")]}),
    "money": dict(
        functions={"total": ["def total({a}, {b}):", "    return {a} * {b}"],
                   "tax": ["def tax({a}):", "    return {a} * 20 // 100"],
                   "change": ["def change({a}, {b}):", "    return {a} - {b}"],
                   "pay": ["def pay({a}):", "    return change(100, {a})"],
                   "months": ["def months({a}):", "    return list(range(1, {a} + 1))"]},
        tests=["assert total(3, 4) == 12", "assert tax(50) == 10", "assert change(10, 3) == 7",
               "assert pay(30) == 70", "assert months(3) == [1, 2, 3]"],
        sites={"operator": [("change", "{a} - {b}", "{a} + {b}"), ("total", "{a} * {b}", "{a} + {b}")],
               "off_by_one": [("months", "range(1, {a} + 1)", "range(1, {a})")],
               "constant": [("tax", "20 //", "25 //")],
               "swapped_args": [("pay", "change(100, {a})", "change({a}, 100)")],
               "missing_return": [("change", "return {a} - {b}", "{a} - {b}")]}),
    "text": dict(
        functions={"shout": ["def shout({a}):", "    return {a}.upper() * 2"],
                   "count": ["def count({a}, {b}):", "    return {a}.count({b})"],
                   "has": ["def has({a}, {b}):", "    return count({a}, {b}) > 0"],
                   "first": ["def first({a}, {b}):", "    return {a}[:{b}]"],
                   "pad": ["def pad({a}, {b}):", "    return {a} + ' ' * ({b} - len({a}))"]},
        tests=["assert shout('hi') == 'HIHI'", "assert count('banana', 'a') == 3", "assert has('box', 'x')",
               "assert not has('boo', 'x')", "assert first('hello', 2) == 'he'", "assert pad('ab', 4) == 'ab  '"],
        sites={"operator": [("pad", "{b} - len({a})", "{b} + len({a})")],
               "off_by_one": [("first", "{a}[:{b}]", "{a}[:{b} - 1]")],
               "constant": [("has", "> 0", "> 1"), ("shout", "* 2", "* 3")],
               "swapped_args": [("has", "count({a}, {b})", "count({b}, {a})")],
               "missing_return": [("count", "return {a}.count({b})", "{a}.count({b})")]}),
}
NAMES = "abcdefghkmnpqrstuvwxyz"  # parameter names, drawn per function: the fix must be read, not remembered
# held out of warm start and RL: one pair per kind, every package at least once
EVAL_PAIRS = (("geometry", "operator"), ("money", "off_by_one"), ("text", "constant"), ("geometry", "swapped_args"),
              ("money", "missing_return"))
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"  # mini-swe-agent's own submit command
SYSTEM = "Fix the bug with one ```bash block, then submit."
OBSERVATION = "<returncode>{{output.returncode}}</returncode>\n<output>\n{{output.output}}</output>"
# mini-swe-agent's own settings (-c FILE over its built-in mini_textbased.yaml), the session's URL and key added
CONFIG = {"agent": {"system_template": SYSTEM, "instance_template": "{{task}}", "step_limit": 2, "cost_limit": 0,
                    "max_consecutive_format_errors": 2},
          "model": {"model_class": "litellm_textbased", "model_name": "openai/loongsage",
                    "cost_tracking": "ignore_errors", "action_regex": r"```bash\s*\n(.*?)\n```",
                    "observation_template": OBSERVATION, "format_error_template": "Reply with one ```bash block."},
          "environment": {"environment_class": "local", "timeout": 10}}


def pairs(split: str) -> list[tuple[str, str]]:
    """The (package, bug kind) pairs of a split: "eval" the held-out EVAL_PAIRS, "train" all the others."""
    if split not in ("train", "eval"):
        raise ValueError(f"split {split!r}: choose 'train' or 'eval'")
    every = [(t, k) for t in TEMPLATES for k in KINDS]
    return [p for p in every if (p in EVAL_PAIRS) == (split == "eval")]


def make_task(package: str, kind: str, rng: random.Random) -> dict:
    """One sample: the package (functions in a random order) with one bug of `kind` at one of its sites."""
    t = TEMPLATES[package]
    fn, fix, bug = rng.choice(t["sites"][kind])  # the site's right and wrong code, {a} {b} not yet named
    functions = list(t["functions"])
    rng.shuffle(functions)
    lines = []
    for name in functions:
        params = dict(zip("ab", rng.sample(NAMES, 2)))
        body = [line.format(**params) for line in t["functions"][name]]
        if name == fn:
            fix, bug = fix.format(**params), bug.format(**params)
            [i] = [i for i, line in enumerate(body) if fix in line]
            right, wrong = body[i], body[i].replace(fix, bug, 1)  # the whole line, as the report names it
            if set(right) & set('|&\\"$`'):  # fix_command's sed would read them
                raise ValueError(f"{package}.{fn}: the fixed line {right!r} holds one of | & \\ \" $ `")
            body[i], line_no = wrong, len(lines) + i + 1
        lines += body + [""]
    module, test = f"{package}.py", f"test_{package}.py"
    tests = f"from {package} import *\n\n" + "".join(f"{a}\n" for a in t["tests"]) + "print('ok')\n"
    report = f"{module} line {line_no}: `{wrong.strip()}` should be `{right.strip()}`."
    return {"messages": [{"role": "user", "content": report}], "files": {module: "\n".join(lines), test: tests},
            "module": module, "test": test, "line": line_no, "wrong": wrong, "right": right,
            "package": package, "kind": kind}


def tasks(split: str, n, seed) -> list[dict]:
    """`n` tasks of `split` ("train" | "eval"), the pairs taken in turn, the rest drawn from `seed`."""
    rng, chosen = random.Random(int(seed)), pairs(split)
    return [make_task(*chosen[i % len(chosen)], rng) for i in range(int(n))]


def fix_command(sample: dict, rng: random.Random | None = None, label_noise: float = 0.0) -> str:
    """The `sed -i` that rewrites the reported line as the report's right code, indented as the function's body (with
    probability `label_noise`, the line above instead: the function's `def`, so the module no longer parses; the
    line below, a blank one, would turn a missing return into a fix), then mini-swe-agent's submit command: its
    output's first line submits (sed prints nothing). `|` delimits and double quotes hold the script, so the code is
    copied as it is (no template line holds `|`, `&`, a backslash, `"`, `$` or a backtick)."""
    line = sample["line"]
    if label_noise and rng is not None and rng.random() < label_noise:
        line -= 1
    return f'sed -i "{line}s|.*|{sample["right"]}|" {sample["module"]} && {SUBMIT}'


def sft_trajectory(tok, sample: dict, rng=None, label_noise: float = 0.0) -> dict:
    """The ideal episode as the router records it: mini-swe-agent's system and task messages (the prompt), then one
    reply, a ```bash block that applies the fix and submits (`fix_command`), through the end of turn."""
    import data  # late: data imports torch; the warm agent interpreter imports this module without it
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": data.task_text(sample)}]
    reply = {"role": "assistant", "content": f"```bash\n{fix_command(sample, rng, label_noise)}\n```"}
    prompt_ids, response_ids = data.reply_ids(tok, history, reply)
    return {"prompt_ids": prompt_ids, "response_ids": response_ids, "loss_mask": [1] * len(response_ids),
            "rollout_logprobs": [0.0] * len(response_ids), "weight_versions": [-1] * len(response_ids),
            "reward": 0.0, "status": "ok", "group_id": 0, "sample_index": 0}


def edited(response: str) -> dict:
    """The package files an episode left ({} when its output holds none)."""
    for line in reversed(response.strip().splitlines()):
        with contextlib.suppress(json.JSONDecodeError):
            out = json.loads(line)
            if isinstance(out, dict) and isinstance(out.get("files"), dict):
                return out["files"]
    return {}


async def run_tests(files: dict, sample: dict) -> bool:
    """The package's own tests (pristine, from the sample) against `files`, in a fresh sandbox without network."""
    import sandbox
    box = await sandbox.make_sandbox("local", cpu_s=10, network=False).create()
    try:
        for name, text in {**files, sample["test"]: sample["files"][sample["test"]]}.items():
            box.write(name, text)
        r = await box.execute(f"python {sample['test']}", timeout_s=10.0)
        return r.exit_code == 0 and not r.timed_out
    finally:
        await box.delete()


async def reward(response: str, sample: dict) -> float:
    """1.0 when the package's tests pass on the module the agent left, else 0.0."""
    module = edited(response).get(sample["module"])
    return float(module is not None and await run_tests({sample["module"]: module}, sample))


def main() -> int:
    """agent_command: the sample's files into the working directory, mini-swe-agent on the task (its output to
    stderr), then the package's files as one JSON line on stdout. Needs mini-swe-agent importable: forked from the
    warm interpreter (agent_preload), or run by its venv's Python (`.../mini-swe-agent/bin/python .../repair.py`)."""
    sample = json.loads(Path(os.environ["LOONGSAGE_SAMPLE_FILE"]).read_text())
    for name, text in sample["files"].items():
        Path(name).write_text(text)
    home = tempfile.mkdtemp(prefix=".mini-", dir=os.environ.get("TMPDIR"))  # not the warm interpreter's /tmp
    config = json.loads(json.dumps(CONFIG))
    config["model"]["model_kwargs"] = {"api_base": os.environ["OPENAI_BASE_URL"],
                                       "api_key": os.environ["OPENAI_API_KEY"], "drop_params": True}
    Path(home, "repair.yaml").write_text(json.dumps(config))  # YAML is a superset of JSON
    os.environ.update(MSWEA_CONFIGURED="true", MSWEA_SILENT_STARTUP="1", LITELLM_LOCAL_MODEL_COST_MAP="True")
    from minisweagent.run.mini import app  # imported by the warm interpreter already (recipes/repair_preload.py)
    status = 0
    with contextlib.redirect_stdout(sys.stderr):
        try:
            app(["-c", "mini_textbased.yaml", "-c", f"{home}/repair.yaml", "-y", "--exit-immediately",
                 "--agent-class", "default", "-o", f"{home}/trajectory.json", "-t", os.environ.get("LOONGSAGE_TASK") or
                 sample["messages"][-1]["content"]],
                standalone_mode=False)
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else 1
    exit_status = json.loads(Path(home, "trajectory.json").read_text())["info"]["exit_status"] \
        if Path(home, "trajectory.json").exists() else ""
    print(json.dumps({"exit_status": exit_status, "files": {sample["module"]: Path(sample["module"]).read_text()}}))
    return status


if __name__ == "__main__":
    sys.exit(main())
