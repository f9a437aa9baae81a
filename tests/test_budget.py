"""The house budget: every .py outside tests/ counted in a named bucket, each under its cap; no file over 2,000 lines
and no line over 120 columns anywhere outside tests/. When it fails it prints every bucket and every file, so the
fix (delete before you move, move before you add) starts from the whole picture. Pure source reading, about a
second: `.venv/bin/pytest tests/test_budget.py -q -s` prints the table.

The reading core is every top-level module a reader of the system reads; the stand-ins and tools (the CPU engine,
the CPU shims, the benchmarks, the viewer) exist because there is no GPU here or to measure and show; recipes/ and
scripts/ are their own buckets, so nothing escapes the count by moving into a folder.
"""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAND_INS_AND_TOOLS = ("cpu_engine.py", "cpu_model.py", "cpu.py", "bench.py", "viewer.py")
# The reading core's cap: the house budget's goal of 12,000 lines, plus the share each change was granted (its issue
# states it) and used, plus what the core still held over the goal when the budget landed: a debt to cut, never to
# spend. A change that needs more makes room first; a cut lowers the debt.
CORE_SHARES = {"the house budget's goal (issue 40)": 12_000,
               "GPU refusals (issue 41)": 3, "agent programs (issue 42)": 230,
               "reasoning-gym and verifiers (issue 45)": 61, "checkpoint faults (issue 49)": 114,
               "live fault drills (issue 50)": 56, "the device check (issue 51)": 33,
               "engine: vllm (issue 44)": 493,
               "every row's wall clock, step timeline (issue 47)": 44, "code repair on a CPU (issue 46)": 5}
# stand-ins and tools: + bench step's TRL side, its process tree's CPU and the recipe run from outside (issue 47),
# + bench agentic's three baselines, lr grid, time to a target accuracy (crossed and fitted) and its ceiling on the
# machine (issue 48)
CAPS = {"reading core": sum(CORE_SHARES.values()), "stand-ins and tools": 4_500 + 63 + 45, "recipes": 1_000,
        "scripts": 800}
FILE_CAPS = {"agentflow.py": 1_300}  # the router, sessions, TITO and the agent runners; the engine client and the
#                                     chat rendering live in rollout.py and chat.py
MAX_FILE_LINES, MAX_LINE_COLUMNS = 2_000, 120


def bucket_of(path: Path) -> str | None:
    rel = path.relative_to(ROOT)
    if len(rel.parts) == 1:
        return "stand-ins and tools" if rel.name in STAND_INS_AND_TOOLS else "reading core"
    return {"recipes": "recipes", "scripts": "scripts"}.get(rel.parts[0])


def counted() -> dict[str, dict[str, int]]:
    """{bucket: {file: lines}} for every tracked-looking .py outside tests/ and the virtual environments."""
    out: dict[str, dict[str, int]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "tests" or rel.parts[0].startswith(".") or "runs" == rel.parts[0]:
            continue
        out.setdefault(bucket_of(path) or f"outside every bucket ({rel.parts[0]}/)", {})[str(rel)] = \
            len(path.read_text().splitlines())
    return out


def table(buckets: dict[str, dict[str, int]]) -> str:
    rows = []
    for name, files in buckets.items():
        cap = CAPS.get(name)
        rows.append(f"{name}: {sum(files.values()):,} lines" + (f" (cap {cap:,})" if cap else " (no bucket: move it)"))
        if name == "reading core":
            rows += [f"    cap: {n:6,}  {why}" for why, n in CORE_SHARES.items()]
        rows += [f"    {n:5d}  {f}" for f, n in sorted(files.items(), key=lambda kv: -kv[1])]
    return "\n".join(rows)


def test_every_bucket_within_its_cap_and_every_file_within_2000_lines():
    buckets = counted()
    print(table(buckets))
    over = [f"{name}: {sum(files.values()):,} > {CAPS[name]:,}" for name, files in buckets.items()
            if name in CAPS and sum(files.values()) > CAPS[name]]
    over += [f"{name} is in no bucket" for name in buckets if name not in CAPS]
    over += [f"{f}: {n:,} lines > {MAX_FILE_LINES:,}" for files in buckets.values() for f, n in files.items()
             if n > MAX_FILE_LINES]
    over += [f"{f}: {n:,} lines > its cap {FILE_CAPS[f]:,}" for files in buckets.values() for f, n in files.items()
             if n > FILE_CAPS.get(f, n)]
    assert not over, "over budget:\n  " + "\n  ".join(over) + "\n" + table(buckets)


def test_no_line_over_120_columns():
    wide = [f"{f}:{i}: {len(line)} columns" for files in counted().values() for f in files
            for i, line in enumerate((ROOT / f).read_text().splitlines(), 1) if len(line) > MAX_LINE_COLUMNS]
    assert not wide, f"{len(wide)} lines over {MAX_LINE_COLUMNS} columns:\n  " + "\n  ".join(wide)


def test_the_buckets_count_what_they_say():
    """A top-level module is core unless named a stand-in or tool; recipes/ and scripts/ count apart; any other
    folder's Python is in no bucket (and fails the budget)."""
    assert bucket_of(ROOT / "trainer.py") == "reading core" and bucket_of(ROOT / "cpu_engine.py") == "stand-ins and tools"
    assert bucket_of(ROOT / "recipes" / "calc.py") == "recipes" and bucket_of(ROOT / "scripts" / "x.py") == "scripts"
    assert bucket_of(ROOT / "tools" / "x.py") is None
