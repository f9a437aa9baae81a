"""scripts/scaling.py (the numbers of docs/SCALING.md).

What it proves: the script runs and prints its tables; its parameter counts, recomputed here by hand from the
config.json numbers, are the published sizes (Qwen3-30B-A3B 30.5B total / 3.3B active, Qwen3-235B-A22B 235B / 22B,
each within 2%); a sync moves every parameter once in bf16; the layouts are ones LoongSage's rules accept, and a
layout they refuse (an expert_parallel that does not divide the 128 experts) fails there.
"""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _scaling():
    spec = importlib.util.spec_from_file_location("scaling", ROOT / "scripts/scaling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_prints_the_tables_and_counts_the_published_sizes():
    out = subprocess.run([sys.executable, "scripts/scaling.py"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("| Qwen3-30B-A3B |") == 4 and out.stdout.count("| Qwen3-235B-A22B |") == 4
    rows = json.loads(subprocess.run([sys.executable, "scripts/scaling.py", "--json"], cwd=ROOT, capture_output=True,
                                     text=True, timeout=300, check=True).stdout)
    by_model = {r["model"]: r for r in rows}

    # Qwen3-30B-A3B by hand: per layer q (2048x4096), k and v (2048x512 each), o (4096x2048), q/k norms (128 each),
    # two RMSNorms (2048 each), the router (128x2048), 128 experts of gate/up/down (3x2048x768); 48 layers; untied
    # embedding and LM head (151936x2048 each) and the final norm
    attention = 2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048 + 2 * 128
    layer = attention + 2 * 2048 + 128 * 2048 + 128 * 3 * 2048 * 768
    total = 48 * layer + 2 * 151936 * 2048 + 2048
    active = total - 48 * (128 - 8) * 3 * 2048 * 768
    r = by_model["Qwen3-30B-A3B"]
    assert r["params_total"] == total == 30_532_122_624
    assert r["params_active"] == active
    assert abs(total / 30.5e9 - 1) < 0.01 and abs(active / 3.3e9 - 1) < 0.02
    assert r["sync_gb"] == pytest.approx(2 * total / 1e9)  # bf16, every parameter once
    big = by_model["Qwen3-235B-A22B"]
    assert abs(big["params_total"] / 235e9 - 1) < 0.01 and abs(big["params_active"] / 22e9 - 1) < 0.02


def test_layouts_go_through_the_config_rules():
    scaling = _scaling()
    assert [scaling.check_layout(lay).data_parallel for lay in scaling.LAYOUTS] == [32, 128, 16, 64]
    with pytest.raises(ValueError, match="does not divide the model's 128 experts"):
        scaling.check_layout({**scaling.LAYOUTS[0], "ep": 48, "trainer_gpus": 96})
