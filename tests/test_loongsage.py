"""The controller: config loading and validation, and short end-to-end runs of the real pipeline
(Ray actors, Megatron-Core over gloo, the CPU engine over HTTP, TransferMesh, AgentFlow)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import loongsage

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128)


def test_unknown_key_names_the_closest():
    with pytest.raises(ValueError, match="unknown config key 'lrr'; did you mean 'lr'"):
        loongsage.load_config(None, ["lrr=1e-3"])
    with pytest.raises(ValueError, match="did you mean 'samples_per_prompt'"):
        loongsage.load_config(None, ["sample_per_prompt=4"])


def test_overrides_are_typed_and_pass_through():
    cfg = loongsage.load_config(str(ROOT / "recipes/arith_cpu.yaml"),
                                ["lr=1", "sglang.mem_fraction_static=0.8", "num_steps=3", "mode=async"])
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float) and cfg.num_steps == 3 and cfg.mode == "async"
    assert cfg.sglang == {"mem_fraction_static": 0.8} and cfg.device == "cpu" and cfg.engine == "cpu"
    with pytest.raises(ValueError, match="'num_steps' should be a int, got 'many'"):
        loongsage.load_config(None, ["num_steps=many"])


@pytest.mark.parametrize("overrides, message", [
    (["prompts_per_step=3", "samples_per_prompt=8", "global_batch_size=16"], "must be a multiple of global_batch_size=16"),
    (["samples_per_prompt=8", "global_batch_size=12"], "multiple of samples_per_prompt=8"),
    (["trainer_workers=3", "tensor_parallel=2"], "not a multiple of tensor_parallel"),
    (["trainer_workers=2", "prompts_per_step=4", "samples_per_prompt=8", "global_batch_size=8", "micro_batch_size=8"],
     "must split evenly over data_parallel=2"),
    (["global_batch_size=64", "micro_batch_size=48", "prompts_per_step=8", "samples_per_prompt=8"], "multiple of micro_batch_size=48"),
    (["engine=sglang"], "CUDA only"),
    (["pipeline_parallel=2", "trainer_workers=2"], "set pipeline_parallel=1"),
    (["mode=fast"], "choose 'sync' or 'async'"),
    (["reward=data.nope"], "cannot load 'data.nope'"),
    (["advantage=ppo2"], "ppo2"),
])
def test_batch_algebra_and_names_say_what_to_change(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        loongsage.load_config(None, overrides)


def test_missing_model_path_says_what_to_do():
    cfg = loongsage.load_config(None, ["model_path=/nowhere/model"])
    with pytest.raises(FileNotFoundError, match="model_path='/nowhere/model' is not a directory"):
        loongsage.check_runtime(cfg)


def test_gpu_recipe_passes_validation_here():
    cfg = loongsage.load_config(str(ROOT / "recipes/qwen3_4b_gsm8k.yaml"))
    assert cfg.device == "cuda" and cfg.engine == "sglang" and cfg.data_parallel == 4
    assert cfg.reward == "data.math_verify" and cfg.sglang["mem_fraction_static"] == 0.6


def test_cli_check_and_bad_key_exit_codes():
    ok = subprocess.run([sys.executable, "loongsage.py", "recipes/arith_cpu.yaml", "--check"], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "config OK" in ok.stdout
    bad = subprocess.run([sys.executable, "loongsage.py", "recipes/arith_cpu.yaml", "temprature=0.5"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "did you mean 'temperature'" in bad.stderr


@pytest.fixture
def ray_session():
    import ray
    yield
    if ray.is_initialized():
        ray.shutdown()


def _short_run(tmp_path, *extra):
    return loongsage.load_config(str(ROOT / "recipes/arith_cpu.yaml"), [
        f"output_dir={tmp_path}/run", "num_steps=3", "prompts_per_step=4", "samples_per_prompt=4",
        "global_batch_size=8", "micro_batch_size=4", "max_new_tokens=6", "eval_every=2", "eval_dataset=synthetic:arith:8:2:20",
        "eval_samples=1", "warmstart_steps=2", "warmstart_batch_size=8", "lr=1e-3", "print_every=1",
        "reward=tests.rewards.digit_fraction",  # dense: an untrained model gets varied rewards, nonzero advantages
        f"tiny_model={json.dumps(TINY)}", *extra])


def test_end_to_end_sync_run(tmp_path, monkeypatch, ray_session):
    """3 RL steps of the default recipe, shrunk: the loss moves, engines serve the new weight
    version, and the train-inference gap is ~0 at step 0 (same fp32 weights on both sides)."""
    monkeypatch.setenv("LOONGSAGE_CACHE", str(tmp_path / "cache"))
    history = loongsage.train(_short_run(tmp_path))
    steps = [h for h in history if "train/loss" in h]
    assert len(steps) == 3
    assert all(math.isfinite(h["train/loss"]) for h in steps)
    assert len({round(h["train/loss"], 8) for h in steps}) == 3 and all(h["train/grad_norm"] > 0 for h in steps)
    assert steps[0]["train/gap_k3"] < 1e-5 and steps[0]["train/gap_max"] < 1e-4
    # sync mode: the batch of step k was generated by weight version k, pushed by step k-1's sync
    assert [h["rollout/weight_version_max"] for h in steps] == [0, 1, 2]
    assert [h["weights/version"] for h in steps] == [1, 2, 3]
    run = tmp_path / "run"
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/accuracy" in line for line in lines)
    assert (run / "reward_curve.png").stat().st_size > 1000
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(run / "final_hf")  # the final export loads in transformers


def test_end_to_end_async_run_records_versions(tmp_path, monkeypatch, ray_session):
    monkeypatch.setenv("LOONGSAGE_CACHE", str(tmp_path / "cache"))
    history = loongsage.train(_short_run(tmp_path, "mode=async", "stale_steps=1", "max_version_lag=1",
                                         "eval_samples=2", "eval_greedy=true", 'eval_sets={"b": "synthetic:arith:8:3:20"}'))
    steps = [h for h in history if "train/loss" in h]
    evals = [h for h in history if "eval/accuracy" in h]
    for key in ("eval/pass@1", "eval/pass@2", "eval/greedy_accuracy", "eval/b/accuracy", "eval/b/pass@2"):
        assert all(0 <= h[key] <= 1 for h in evals) and len(evals) == 3, key  # before, step 1, last
    assert len(steps) == 3 and all(math.isfinite(h["train/loss"]) for h in steps)
    # a step runs ahead of training; the lag bound keeps every trained token at most one version behind
    for i, h in enumerate(steps):
        assert i - 1 <= h["rollout/weight_version_min"] <= h["rollout/weight_version_max"] <= i
        assert h["rollout/lag_max"] <= 1 and h["rollout/running_groups"] + h["rollout/buffer_groups"] <= 8
    assert steps[1]["rollout/lag_max"] == 1  # step 1 trained groups sampled by version 0: it was async


@pytest.mark.parametrize("algo", [
    ["advantage=grpo"],
    ["advantage=drgrpo", "loss_agg=seq_mean_token_sum"],
    ["advantage=rloo", "kl_coef=0.01", "kl_type=k3"],
    ["advantage=reinforce_pp", "kl_coef=0.01", "kl_in_reward=true"],
    ["advantage=grpo", "policy_loss=gspo", "loss_agg=seq_mean_token_mean", "clip_low=0.0003", "clip_high=0.0004",
     "dynamic_sampling=true"],
], ids=["grpo", "drgrpo", "rloo", "reinforce_pp", "gspo+dynamic_sampling"])
def test_each_algorithm_runs_end_to_end(algo, tmp_path, monkeypatch, ray_session):
    """A recipe switch changes the algorithm end to end: two steps with finite metrics each."""
    monkeypatch.setenv("LOONGSAGE_CACHE", str(tmp_path / "cache"))
    history = loongsage.train(_short_run(tmp_path, "num_steps=2", "eval_every=0", *algo))
    steps = [h for h in history if "train/loss" in h]
    assert len(steps) == 2
    for h in steps:
        assert all(math.isfinite(v) for k, v in h.items() if k.startswith(("train/", "rollout/")))
        assert h["train/grad_norm"] > 0
    if "kl_type=k3" in algo:  # KL as a loss term: the policy has drifted from the reference by step 1
        assert steps[0]["train/kl"] < 1e-6 < steps[1]["train/kl"]


def test_failing_actor_surfaces_traceback_and_exits_nonzero(tmp_path):
    env = {**os.environ, "LOONGSAGE_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "loongsage.py", "recipes/arith_cpu.yaml", f"output_dir={tmp_path}/run",
                        "warmstart_steps=0", f"tiny_model={json.dumps(TINY)}", "megatron.not_a_megatron_field=1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "run failed" in r.stderr and "not_a_megatron_field" in r.stderr and "Traceback" in r.stderr
