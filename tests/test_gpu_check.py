"""scripts/gpu_check.py's dry run in the CPU suite: every part passes on a machine holding only what the lent GPU
machine holds (torch, transformers, peft and their requirements) plus what scripts/gpu_wheels.sh carries there, and
each part's control (`--break PART`) makes that part FAIL at its check. The sglang part and its control run in the
conformance tier (tests/test_sglang_conformance.py), where SGLang's source is at hand; here it passes only where
.gpu_wheels/sglang exists and is skipped otherwise."""
import concurrent.futures
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
# loaded from its file, never by putting scripts/ on sys.path: scripts/recipes.py would then shadow the recipes
# package (recipes.calc, recipes.code_repair) for every test module collected after this one
_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)

pytestmark = pytest.mark.slow


def lent_machine_site(out: Path) -> Path:
    """A site directory holding symlinks to this venv's torch, transformers and peft with their requirements' closure,
    and the distributions gpu_check.CARRIED names (standing in for the carried wheels): nothing else imports."""
    seen = set()

    def walk(name):
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            return
        seen.add(key)
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            return  # an optional requirement, or a carried one this venv lacks (the dry run then says which)
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] != ".." and not f.name.endswith(".pth")}:
            src, dst = Path(dist.locate_file(top)), out / top
            if src.exists() and not dst.exists():
                dst.symlink_to(src)
        for r in map(Requirement, dist.requires or []):
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                walk(r.name)
    out.mkdir()
    for name in ("torch", "transformers", "peft", *gpu_check.CARRIED):
        walk(name)
    return out


def dry_run(*args, python=(sys.executable,), env=None) -> tuple[int, dict[str, str]]:
    r = subprocess.run([*python, str(SCRIPT), "--dry-run", *args], capture_output=True, text=True, timeout=900,
                       env=env)
    lines = {m.group(2): m.group(1) + " " + m.group(3) for m in re.finditer(
        r"^(PASS|FAIL|SKIP) \(dry run\) (\w+) \(\d+ s\) (.*)$", r.stdout, re.M)}
    return r.returncode, lines | {"output": r.stdout[-3000:] + r.stderr[-3000:]}


def test_the_dry_run_passes_every_part_with_only_the_lent_machines_packages(tmp_path, run_cache, controls):
    """All five parts, in `python -S` with only torch + transformers + peft's closure and the carried distributions on
    the path (spawned engine processes included): each passes (sglang: skipped without its carried source), and the
    weight pushes report every tensor bit for bit."""
    site = lent_machine_site(tmp_path / "site")
    for absent in ("ray", "fastapi", "uvicorn", "pyarrow", "openai", "sglang"):  # what that machine lacks
        assert not (site / absent).exists(), f"{absent} is in the lent machine's closure: the test proves nothing"
    env = {**os.environ, "PYTHONPATH": str(site)}
    rc, lines = dry_run(python=(sys.executable, "-S"), env=env)
    sglang = "PASS" if (ROOT / ".gpu_wheels" / "sglang").is_dir() else "SKIP"
    assert rc == 0 and [lines.get(p, "")[:4] for p in gpu_check.PARTS] == [
        "PASS", "PASS", sglang, "PASS", "PASS"], lines
    assert re.search(r"\d+ tensors bit for bit", lines["ipc"]) and "torch's rebuild" in lines["ipc"], lines["ipc"]


# each control's part, and what its own assertion's message says (so a FAIL caused by another part's control would
# not pass for this one's)
CONTROLS = {"logprobs": "|trainer - HF fp32|", "ipc": "arrived with other bytes than pushed",
            "offload": "held MiB (weights/optimizer/grads)", "distopt": "sum |plain - distributed|"}


@pytest.fixture(scope="module")
def controls(tmp_path_factory) -> concurrent.futures.Future:
    """One dry run of the four parts, each with its control on: a part reports and the next one runs whatever the
    last one did (gpu_check.main), and every break is the part's own (a copy of the reference model, a copy of the
    pushed tensors, the worker's offload, the learning rate of distopt's reloads), so one process tells what four
    did, without three more start-ups of torch, transformers and a trainer. It starts with the module (the first
    test asks for it) and runs beside the full dry run, each process mostly one core's work; its own cache
    directory, as build_tiny_model is not safe for two processes building one directory at once. The future
    answers (exit code, lines)."""
    env = {**os.environ, "LOONGSAGE_CACHE": str(tmp_path_factory.mktemp("gpu-check-controls-cache"))}
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(dry_run, *[a for p in CONTROLS for a in ("--part", p, "--break", p)], env=env)
    pool.shutdown(wait=False)
    yield future
    future.result()  # never leave the process behind the module


@pytest.mark.parametrize("part", list(CONTROLS))
def test_each_control_makes_its_part_fail(part, controls):
    """`--break PART`: the logprobs against a model with another final norm, a push with one bit flipped, an offload
    that frees nothing, the distributed optimizer at another learning rate: the part FAILs at its own assertion."""
    rc, lines = controls.result()
    assert rc == 1 and lines.get(part, "").startswith("FAIL AssertionError: "), lines
    assert CONTROLS[part] in lines[part], lines[part]
