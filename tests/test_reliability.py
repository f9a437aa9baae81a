"""Nothing lost (issue 10, input / agent / sandbox / validation half): failed and empty trajectories
never crash a step, options without a working path are rejected at --check, the router answers what
the OpenAI / Anthropic APIs reject with a 4xx in their error shape and keeps serving, and the sandboxes
contain what they claim to (and say what they do not).

Real parts throughout: the CPU engine over HTTP behind the router, the official openai / anthropic
clients, real processes in the sandboxes, Ray + Megatron-Core in the controller run. The one part that
cannot run here is a Docker daemon: the exact `docker run` command is checked without one, the real
run is skipped unless a daemon answers.
"""
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import agentflow
import loongsage
import trainer

ROOT = Path(__file__).resolve().parents[1]


def run(coro, timeout=120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


# ----------------------------------------------------------------------------------------------
# failed and empty trajectories: collate, rewards, groups


def _traj(prompt, response, mask, reward=0.0, group_id=0, status="ok"):
    return dict(prompt_ids=prompt, response_ids=response, loss_mask=mask, rollout_logprobs=[-0.5] * len(response),
                weight_versions=[0] * len(response), reward=reward, group_id=group_id, status=status,
                metadata={})


def test_collate_keeps_a_trajectory_that_failed_before_its_first_model_call():
    empty = _traj([5, 6], [], [], status="failed")
    mb = trainer.collate([_traj([4], [3, 2], [1, 1], reward=1.0), empty])
    assert mb["tokens"].tolist() == [[4, 3, 2], [5, 6, 0]]
    assert mb["loss_mask"].tolist() == [[1, 1], [0, 0]]       # the failed row adds nothing to the loss
    assert mb["rewards"].tolist() == [1.0, 0.0] and mb["resp_len"].tolist() == [2, 0]
    # a micro-batch of only failed rows still has one position to gather from a (B, T-1) logp row
    only = trainer.collate([empty, _traj([7], [], [], status="failed")])
    assert only["tokens"].shape == (2, 2) and only["resp_pos"].shape == (2, 1)
    assert only["loss_mask"].sum() == 0 and only["weight_versions"].tolist() == [[-1], [-1]]
    logp = torch.randn(2, only["tokens"].shape[1] - 1)       # what _forward_logp gathers from
    assert logp.gather(1, only["resp_pos"]).shape == (2, 1)
    with pytest.raises(ValueError, match="no prompt token"):
        trainer.collate([_traj([], [3], [1])])


def test_groups_with_no_trainable_token_are_left_out_and_counted():
    ok, failed = _traj([1], [2], [1], reward=1.0, group_id=0), _traj([1], [], [], group_id=0, status="failed")
    dead = [dict(_traj([1], [], [], group_id=1, status="failed"), metadata={"error": "agent x raised boom"})] * 2
    kept, n_empty, error = loongsage.drop_empty_groups([ok, failed] + dead)
    assert kept == [ok, failed] and n_empty == 1 and error == "agent x raised boom"  # partial group stays whole
    assert loongsage.drop_empty_groups(dead)[:2] == ([], 1)
    m = loongsage.rollout_metrics([ok, failed] + dead)
    assert m["rollout/failed"] == 3 and m["rollout/failed_frac"] == 0.75


@pytest.mark.parametrize("value, reward, error", [
    (1, 1.0, None), (0.5, 0.5, None), (True, 1.0, None), (torch.tensor(0.25), 0.25, None),
    (float("nan"), None, "must be finite"), (float("inf"), None, "must be finite"),
    (None, None, "must return a number"), ("0.5", None, "must return a number"),
    ({"r": 1}, None, "must return a number"), ([1.0, 0.0], None, "per-turn rewards are not carried"),
])
def test_rewards_must_be_finite_numbers(value, reward, error):
    got, err = agentflow._scalar_reward(value, "reward r")
    assert got == reward
    assert (err is None) if error is None else (error in err and "reward r" in err)


# ----------------------------------------------------------------------------------------------
# validation: options without a working path are rejected at --check, saying what exists instead


@pytest.mark.parametrize("overrides, message", [
    (["advantage=gae"], "needs a value model"),
    (["transfer=carrier_pigeon"], "transfer='carrier_pigeon': choose one of"),
    (["transfer=cuda_ipc"], "transfer=cuda_ipc needs device=cuda"),
    (["sandbox=vm"], "sandbox='vm': choose 'local', 'docker' or 'auto'"),
    (["num_engines=0"], "num_engines=0 must be a positive integer"),
    (["samples_per_prompt=0"], "samples_per_prompt=0 must be a positive integer"),
    (["micro_batch_size=0"], "micro_batch_size=0 must be a positive integer"),
    (["max_turns=0"], "max_turns=0 must be a positive integer"),
    (["agent_timeout=0"], "agent_timeout=0.0 must be > 0"),
    (["agent_retries=-1"], "agent_retries=-1 must be >= 0"),
    (["top_k=0"], "top_k=0: use -1 (off)"),
    (["top_p=0"], "top_p=0.0 must be in (0, 1]"),
    (["temperature=-1"], "temperature=-1.0 must be >= 0"),
    (["train_only=true", "rollout_only=true", "load_rollouts=x"], "would neither generate nor train"),
    (["tiny_model.hiden_size=8"], "did you mean 'hidden_size'"),
])
def test_options_without_a_working_path_fail_check(overrides, message):
    with pytest.raises(ValueError) as e:
        loongsage.load_config(str(ROOT / "recipes/arith_cpu.yaml"), overrides)
    assert message in str(e.value)


def test_cli_check_rejects_gae_with_exit_code_2():
    r = subprocess.run([sys.executable, "loongsage.py", "recipes/arith_cpu.yaml", "advantage=gae", "--check"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "config error" in r.stderr and "advantage='returns'" in r.stderr
