#!/usr/bin/env python
"""Do the CPU recipes learn on any seed? Run each one on N seeds, each from an empty cache, and print the table.

    .venv/bin/python scripts/recipes.py [--recipes arith_cpu arith_lora_cpu calc_cpu blackbox_cpu think_cpu
                                                   rg_spell_cpu mopd_cpu]
                                        [--seeds 1 2 3]
                                        [--out runs/recipes]
                                        [--set key=value ...]

For every (recipe, seed) it runs `loongsage.py recipes/<recipe>.yaml seed=<s> tiny_model.seed=<s>` as a new user
would, in its own process, with LOONGSAGE_CACHE pointing at a new empty directory: the tiny model and tokenizer
are built and the warm start (SFT) is trained inside the timed run. The seed also draws the tiny model's initial
weights, so seeds differ in everything a seed can change. Runs go one after another (two trainings at once
would share the 2 cores and time each other).

Printed per run: eval accuracy before RL -> after, the rise, for calc the fraction of step-0 eval samples whose
first turn called the tool (`eval/multi_turn_frac`), wall minutes (warm start included) and the machine's
1-minute load average before and after it (a loaded machine inflates minutes, not accuracies), and the eval's
noise: the final weights evaluated once more, with another sampling seed (`seed` + 1000; the eval set is the
same), and the two final accuracies' difference set beside the run's margin over its bar. Per recipe: the
smallest rise, the spread (max - min) of the final accuracy, and whether every seed met both bars, accuracy and
time:

    arith_cpu     rise >= 0.3, <= 5 min        calc_cpu   rise >= 0.3, tool call at step 0 >= 0.9, <= 10 min
    blackbox_cpu  rise >= 0.2, <= 10 min       think_cpu  rise >= 0.2, <= 10 min
    arith_lora_cpu  rise >= 0.3, <= 6 min      rg_spell_cpu  rise >= 0.2, <= 10 min (reasoning-gym's scorer)
    mopd_cpu      rise >= 0.2, <= 10 min (both teachers built and the student warm-started inside the run)

The table is also written as Markdown to <out>/recipes.md (docs/RECIPES.md's tables come from it) and as JSON to
<out>/recipes.json. Exit status 0 when every recipe met both bars on every seed, 1 otherwise (the minutes of a
loaded machine are not the recipe's: the loads printed beside them say which runs to time again).
Left out: GPU recipes (no seeds-from-scratch story there: their models are downloaded checkpoints).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# recipe -> (minimum rise of eval accuracy from step 0 to the end, time budget in minutes, warm start included)
BARS = {"arith_cpu": (0.3, 5.0), "arith_lora_cpu": (0.3, 6.0), "calc_cpu": (0.3, 10.0), "blackbox_cpu": (0.2, 10.0),
        "think_cpu": (0.2, 10.0), "rg_spell_cpu": (0.2, 10.0), "mopd_cpu": (0.2, 10.0)}
CALC_TOOL_CALL_BAR = 0.9  # calc: fraction of step-0 eval samples whose first turn is a tool call


def run_one(recipe: str, seed: int, out: Path, extra: list[str]) -> dict:
    """One run from an empty cache in its own process; its eval accuracies read back from metrics.jsonl."""
    run_dir = out / recipe / f"seed{seed}"
    cache = Path(tempfile.mkdtemp(prefix=f"loongsage-cache-{recipe}-{seed}-"))
    cmd = [sys.executable, str(ROOT / "loongsage.py"), str(ROOT / "recipes" / f"{recipe}.yaml"), f"seed={seed}",
           f"tiny_model.seed={seed}", f"output_dir={run_dir}", *extra]
    env = {**os.environ, "LOONGSAGE_CACHE": str(cache)}
    run_dir.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    with open(run_dir / "stdout.log", "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    minutes = (time.perf_counter() - t0) / 60
    load1 = os.getloadavg()[0]
    if rc != 0:
        raise SystemExit(f"{recipe} seed {seed} failed (exit {rc}); its log: {run_dir / 'stdout.log'}")
    evals = evals_of(run_dir)
    if len(evals) < 2:
        raise SystemExit(f"{recipe} seed {seed}: fewer than two evals in {run_dir / 'metrics.jsonl'}; the recipe "
                         "needs eval_every > 0")
    # the eval's noise: the same final weights, no training, another sampling seed (not timed)
    again = run_dir / "eval_again"
    cmd = [*cmd[:3], *extra, f"seed={seed + 1000}", f"model_path={run_dir / 'final_hf'}", "warmstart_steps=0",
           "num_steps=0", f"output_dir={again}"]
    with open(run_dir / "eval_again.log", "w") as log:
        if subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
            raise SystemExit(f"{recipe} seed {seed}: the second eval failed; its log: {run_dir / 'eval_again.log'}")
    shutil.rmtree(cache, ignore_errors=True)  # the trained model is in <run_dir>/final_hf; the cache was scratch
    return {"recipe": recipe, "seed": seed, "start": evals[0]["eval/accuracy"], "end": evals[-1]["eval/accuracy"],
            "end_again": evals_of(again)[0]["eval/accuracy"], "tool_call_frac": evals[0].get("eval/multi_turn_frac"),
            "minutes": minutes, "load_before": load0, "load_after": load1}


def evals_of(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, open(run_dir / "metrics.jsonl")) if "eval/accuracy" in r]


def summarize(recipe: str, runs: list[dict]) -> dict:
    bar, budget = BARS.get(recipe, (0.0, float("inf")))
    rises = [r["end"] - r["start"] for r in runs]
    ok = all(x >= bar for x in rises) and all(r["minutes"] <= budget for r in runs)
    if recipe == "calc_cpu":
        ok = ok and all((r["tool_call_frac"] or 0.0) >= CALC_TOOL_CALL_BAR for r in runs)
    return {"recipe": recipe, "min_rise": min(rises), "mean_rise": statistics.mean(rises),
            "max_noise": max(abs(r["end"] - r["end_again"]) for r in runs),
            "end_spread": max(r["end"] for r in runs) - min(r["end"] for r in runs),
            "max_minutes": max(r["minutes"] for r in runs), "bar": bar, "budget_min": budget, "ok": ok}


def table(runs: list[dict], sums: list[dict]) -> str:
    lines = ["| recipe | seed | eval start -> end | rise | margin over the bar (noise) | tool call at step 0 "
             "| minutes | load (1 min) before / after |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        tc = "" if r["tool_call_frac"] is None or r["recipe"] != "calc_cpu" else f"{r['tool_call_frac']:.2f}"
        lines.append(f"| {r['recipe']} | {r['seed']} | {r['start']:.3f} -> {r['end']:.3f} "
                     f"| {r['end'] - r['start']:+.3f} | {r['end'] - r['start'] - BARS.get(r['recipe'], (0,))[0]:+.3f} "
                     f"({abs(r['end'] - r['end_again']):.3f}) | {tc} | {r['minutes']:.1f} "
                     f"| {r['load_before']:.1f} / {r['load_after']:.1f} |")
    lines += ["", "| recipe | smallest rise (bar) | mean rise | spread of final eval | largest eval noise "
              "| slowest run, min (budget) | bars met |",
              "|---|---|---|---|---|---|---|"]
    for s in sums:
        lines.append(f"| {s['recipe']} | {s['min_rise']:+.3f} ({s['bar']:+.1f}) | {s['mean_rise']:+.3f} | "
                     f"{s['end_spread']:.3f} | {s['max_noise']:.3f} | {s['max_minutes']:.1f} ({s['budget_min']:.0f}) | "
                     f"{'yes' if s['ok'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", nargs="+", default=list(BARS), help="recipe names under recipes/ (no .yaml)")
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--out", default="runs/recipes", help="run directories, recipes.md and recipes.json go here")
    p.add_argument("--set", nargs="*", default=[], dest="overrides", metavar="KEY=VALUE",
                   help="overrides passed to every run (e.g. --set num_steps=2 warmstart_steps=20 for a smoke run)")
    a = p.parse_args(argv)
    unknown = [r for r in a.recipes if not (ROOT / "recipes" / f"{r}.yaml").exists()]
    if unknown:
        p.error(f"no recipe {unknown} under recipes/; CPU recipes with a bar: {list(BARS)}")
    out = Path(a.out)
    runs, sums = [], []
    for recipe in a.recipes:
        mine = []
        for seed in a.seeds:
            r = run_one(recipe, seed, out, a.overrides)
            print(f"{recipe} seed {seed}: eval {r['start']:.3f} -> {r['end']:.3f} (again {r['end_again']:.3f}) in "
                  f"{r['minutes']:.1f} min (load {r['load_before']:.1f} / {r['load_after']:.1f})", flush=True)
            mine.append(r)
        runs += mine
        sums.append(summarize(recipe, mine))
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.system()}"
    text = (f"seeds {a.seeds}, each run from an empty cache (warm start included), on {machine}"
            f"{', overrides ' + ' '.join(a.overrides) if a.overrides else ''}\n\n{table(runs, sums)}\n")
    print("\n" + text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "recipes.md").write_text(text)
    (out / "recipes.json").write_text(json.dumps({"seeds": a.seeds, "machine": machine, "runs": runs,
                                                  "summary": sums}, indent=1))
    return 0 if all(s["ok"] for s in sums) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
