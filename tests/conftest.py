"""Shared fixtures: the tiny model every test runs against (built once, cached on disk), and a Ray per test module."""
import os
import sys
from pathlib import Path

import pytest
import ray

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tests start their own local Ray: a cluster someone left running on the machine (`ray start`, found through
# /tmp/ray/ray_current_cluster) must not capture them (ray.init(num_cpus=...) then refuses to start).
os.environ.setdefault("RAY_ADDRESS", "local")

import data  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir() -> str:
    """A random-init tiny Qwen3 (HF format, with the chat-template tokenizer), cached across runs. Every
    parameter is random, norm weights included (norm_std): with norms of exactly 1 a parity test could not
    see an RMSNorm, q_norm or k_norm that is dropped or swapped."""
    settings = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    intermediate_size=128, norm_std=0.2)
    # named by its settings: checkouts with other settings sharing the cache never rebuild it under each other
    return data.build_tiny_model(data.default_cache_dir() / f"tiny-test-{data.settings_hash(settings)}", **settings)


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray for one test module's actors, shut down after the module (tests that start a Ray of their own,
    e.g. through loongsage.train, run before or without it). 4 logical CPUs: every actor asks for 1 and sets its own
    torch threads, so this bounds how many run at once, not how fast. Workers import the repo's modules."""
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}})
    yield
    ray.shutdown()
