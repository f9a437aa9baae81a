"""Warm start of any HF model directory: SFT through the same Megatron trainer, cached by the base checkpoint's
fingerprint and the SFT settings (a changed checkpoint or setting warms up again; the same ones reuse the cache)."""
import json
import shutil
from pathlib import Path

import pytest
import torch

import config
import fleet

ROOT = Path(__file__).resolve().parents[1]
# what the SFT rank is built with (prepare_model passes the model directory and warmstart_lr on each call)
RANK = ["micro_batch_size=8", "global_batch_size=8", "prompts_per_step=1", "samples_per_prompt=8"]


@pytest.fixture(scope="module")
def sft_rank(ray_session):
    """One trainer rank for both tests: every prepare_model starts with a fresh load_hf of its base checkpoint."""
    from test_trainer import Ranks
    ranks = Ranks(config.load_config(None, RANK), 1)
    yield ranks
    ranks.close()


@pytest.mark.slow
def test_warm_start_an_hf_directory_and_cache_it(tiny_model_dir, tmp_path, monkeypatch, sft_rank):
    from safetensors.torch import load_file

    monkeypatch.setenv("LOONGSAGE_CACHE", str(tmp_path / "cache"))
    base = tmp_path / "my-model"
    shutil.copytree(tiny_model_dir, base)
    overrides = [f"model_path={base}", "warmstart_steps=3", "warmstart_batch_size=8", "warmstart_lr=1e-2", *RANK]
    cfg = config.load_config(None, overrides)
    out = fleet.prepare_model(cfg, sft_rank.workers)
    assert Path(out).parent == tmp_path / "cache" and Path(out).name.startswith("my-model-sft-")
    before, after = load_file(str(base / "model.safetensors")), load_file(str(Path(out) / "model.safetensors"))
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # SFT moved the weights
    assert json.loads((Path(out) / "config.json").read_text()) == json.loads((base / "config.json").read_text())
    stamp = (Path(out) / "model.safetensors").stat().st_mtime_ns
    assert fleet.prepare_model(cfg, sft_rank.workers) == out  # cached: same settings, same checkpoint
    assert (Path(out) / "model.safetensors").stat().st_mtime_ns == stamp
    other = config.load_config(None, overrides + ["warmstart_steps=2"])
    assert fleet.checkpoint_fingerprint(base) == fleet.checkpoint_fingerprint(base)
    with open(base / "config.json", "a") as f:  # a changed checkpoint gets its own warm start
        f.write("\n")
    assert fleet.prepare_model(other, sft_rank.workers) != out


@pytest.mark.slow
def test_warm_start_stops_on_its_loss_and_warns_when_the_cap_comes_first(tiny_model_dir, tmp_path, monkeypatch, capsys,
                                                                        sft_rank):
    """`warmstart_stop_loss`: SFT stops once the mean loss of the last 20 steps is below it (warmstart_steps is then
    a cap), and says so; a run that reaches the cap above it finishes with a warning. The stop is part of the cache
    key, so the two runs below are two warm starts."""
    monkeypatch.setenv("LOONGSAGE_CACHE", str(tmp_path / "cache"))
    overrides = [f"model_path={tiny_model_dir}", "warmstart_steps=30", "warmstart_batch_size=4", "warmstart_lr=1e-3",
                 *RANK]
    with pytest.raises(ValueError, match="warmstart_stop_loss=-1"):
        config.load_config(None, overrides + ["warmstart_stop_loss=-1"])
    # any loss is below 1e3: the stop comes as soon as there are 20 steps to average
    early = fleet.prepare_model(config.load_config(None, overrides + ["warmstart_stop_loss=1e3"]),
                                sft_rank.workers)
    out = capsys.readouterr().out
    assert "< warmstart_stop_loss 1000.0 after 20 steps" in out and "WARNING" not in out
    # no loss of this model is below 1e-6: all 30 steps run, then the warning
    capped = fleet.prepare_model(config.load_config(None, overrides + ["warmstart_stop_loss=1e-6"]),
                                 sft_rank.workers)
    out = capsys.readouterr().out
    assert "WARNING" in out and "after all 30 warmstart_steps" in out and "< warmstart_stop_loss" not in out
    assert early != capped
