"""Shared fixtures: the tiny model every test runs against (built once, cached on disk), and the one local Ray of the
whole test session.

One Ray for the session: starting a local Ray costs ~4 s and stopping it ~1.3 s, and about thirty tests and fixtures
need one (every loongsage.train() run among them). train() runs on the Ray it finds and stops what it started when
it ends, however it ends (fleet.stop_on_exit), so runs share it; after every test its placement groups are removed,
and after every module nothing holds a CPU. A test that needs a Ray of another shape (simulated GPUs,
tests/test_placement.py) shuts this one down, and the next test that asks for it starts it again."""
import os
import sys
import time
from pathlib import Path

import pytest
import ray

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tests start their own local Ray: a cluster someone left running on the machine (`ray start`, found through
# /tmp/ray/ray_current_cluster) must not capture them (ray.init(num_cpus=...) then refuses to start).
os.environ.setdefault("RAY_ADDRESS", "local")
# Ray's workers inherit this environment: they import the repo's modules and tests.* (rewards, agents) from any
# directory pytest is started in. Set here rather than in ray.init's runtime_env, which would make every actor wait
# for a worker process started for that runtime_env instead of taking one of the idle workers Ray prestarts.
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])

import data  # noqa: E402

# Logical CPUs of the session's Ray: every actor asks for 1 and sets its own torch threads, so this bounds how many
# actors run at once, not how fast. 6 holds the largest layout a test starts (2 trainer ranks + 2 engines, or a
# module's rank beside a test's world of two).
RAY_CPUS = 6


@pytest.fixture(scope="session")
def tiny_model_dir() -> str:
    """A random-init tiny Qwen3 (HF format, with the chat-template tokenizer), cached across runs. Every
    parameter is random, norm weights included (norm_std): with norms of exactly 1 a parity test could not
    see an RMSNorm, q_norm or k_norm that is dropped or swapped."""
    settings = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    intermediate_size=128, norm_std=0.2)
    # named by its settings: checkouts with other settings sharing the cache never rebuild it under each other
    return data.build_tiny_model(data.default_cache_dir() / f"tiny-test-{data.settings_hash(settings)}", **settings)


@pytest.fixture(scope="session")
def _session_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("loongsage-cache")


@pytest.fixture
def run_cache(_session_cache, monkeypatch) -> Path:
    """LOONGSAGE_CACHE for a test's train() runs: one directory for the whole session, so a tiny model or a warm start
    with the same settings is built once and found by the runs after it (as a user's runs share ~/.cache/loongsage),
    and never read from a cache another checkout or an earlier session wrote."""
    monkeypatch.setenv("LOONGSAGE_CACHE", str(_session_cache))
    return _session_cache


def shared_ray() -> None:
    """Start the session's Ray unless it is up with its RAY_CPUS (a test that needed another shape, or bench.py,
    shut it down or started a smaller one)."""
    if ray.is_initialized():
        if ray.cluster_resources().get("CPU") == RAY_CPUS:
            return
        ray.shutdown()
    ray.init(address="local", num_cpus=RAY_CPUS, include_dashboard=False, log_to_driver=False)


def _held() -> tuple[float, int]:
    """(CPUs in use, placement groups not removed) of the running Ray."""
    pgs = sum(p["state"] != "REMOVED" for p in ray.util.placement_group_table().values())
    return ray.cluster_resources().get("CPU", 0) - ray.available_resources().get("CPU", 0), pgs


def _check_freed(cpus: float, pgs: int, what: str) -> None:
    """Wait until Ray holds at most `cpus` CPUs and `pgs` placement groups: a killed actor frees its CPU and a removed
    placement group its bundles within moments (60 s of grace for a loaded machine). A leftover would make a later
    run wait for its bundles, so it fails here, naming what was left, and the next test gets a fresh Ray."""
    deadline = time.monotonic() + 60
    while ((now := _held())[0] > cpus or now[1] > pgs) and time.monotonic() < deadline:
        time.sleep(0.2)
    over = [f"{now[0]:g} CPUs (expected at most {cpus:g})"] if now[0] > cpus else []
    over += [f"{now[1]} placement groups (expected at most {pgs})"] if now[1] > pgs else []
    if over:
        ray.shutdown()
        pytest.fail(f"{what} left Ray resources held: {' and '.join(over)} in use; stop what it started (fleet.stop, "
                    "ray.kill)", pytrace=False)


@pytest.fixture(scope="module")
def ray_session():
    """The session's one local Ray, for a test module's actors (a module's fixtures may hold actors across its
    tests). At the end of the module every CPU and placement group is free again; Ray stays up for the next one."""
    shared_ray()
    yield
    if ray.is_initialized():
        _check_freed(0, 0, "the module")


@pytest.fixture(autouse=True)
def _removes_its_placement_groups():
    """After each test that ran while the session's Ray was up, the placement groups it reserved are removed (every
    train() run's among them). CPUs are counted at the end of the module: an actor a module's fixture creates holds
    its CPU only once Ray has scheduled it, moments after the test that first asked for the fixture began."""
    before = _held()[1] if ray.is_initialized() else None
    yield
    if before is not None and ray.is_initialized():
        _check_freed(float("inf"), before, "the test")


def pytest_sessionfinish(session, exitstatus):
    if ray.is_initialized():
        ray.shutdown()
