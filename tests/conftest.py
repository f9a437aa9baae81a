"""Shared fixtures: the tiny model every test runs against (built once, cached on disk)."""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import data  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir() -> str:
    """A random-init tiny Qwen3 (HF format, with the chat-template tokenizer), cached across runs. Every
    parameter is random, norm weights included (norm_std): with norms of exactly 1 a parity test could not
    see an RMSNorm, q_norm or k_norm that is dropped or swapped."""
    return data.build_tiny_model(data.default_cache_dir() / "tiny-test", hidden_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                                 norm_std=0.2)
