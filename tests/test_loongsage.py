"""The controller: config loading and validation, and short end-to-end runs of the real pipeline
(Ray actors, Megatron-Core over gloo, the CPU engine over HTTP, TransferMesh, AgentFlow)."""
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import config
import cpu
import fleet
import loongsage
import tests.rewards

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, norm_std=0.2)  # random norm weights: a norm lost in the sync would show


def test_unknown_key_names_the_closest():
    with pytest.raises(ValueError, match="unknown config key 'lrr'; did you mean 'lr'"):
        config.load_config(None, ["lrr=1e-3"])
    with pytest.raises(ValueError, match="did you mean 'samples_per_prompt'"):
        config.load_config(None, ["sample_per_prompt=4"])


def test_overrides_are_typed_and_pass_through():
    cfg = config.load_config(str(ROOT / "recipes/arith_cpu.yaml"),
                             ["lr=1", "sglang.mem_fraction_static=0.8", "num_steps=3", "mode=async"])
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float) and cfg.num_steps == 3 and cfg.mode == "async"
    assert cfg.sglang == {"mem_fraction_static": 0.8} and cfg.device == "cpu" and cfg.engine == "cpu"
    with pytest.raises(ValueError, match="'num_steps' should be a int, got 'many'"):
        config.load_config(None, ["num_steps=many"])


@pytest.mark.parametrize("overrides, message", [
    (["prompts_per_step=3", "samples_per_prompt=8", "global_batch_size=16"], "must be a multiple of global_batch_size=16"),
    (["samples_per_prompt=8", "global_batch_size=12"], "multiple of samples_per_prompt=8"),
    (["trainer_workers=3", "tensor_parallel=2"], "not a multiple of tensor_parallel"),
    (["trainer_workers=2", "prompts_per_step=4", "samples_per_prompt=8", "global_batch_size=8", "micro_batch_size=8"],
     "must split evenly over data_parallel=2"),
    (["global_batch_size=64", "micro_batch_size=48", "prompts_per_step=8", "samples_per_prompt=8"], "multiple of micro_batch_size=48"),
    (["engine=sglang"], "CUDA only"),
    (["pipeline_parallel=3", "trainer_workers=3"], "pipeline_parallel=3 does not divide the model's 4 layers"),
    (["mode=fast"], "choose 'sync' or 'async'"),
    (["reward=data.nope"], "cannot load 'data.nope'"),
    (["advantage=ppo2"], "ppo2"),
])
def test_batch_algebra_and_names_say_what_to_change(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config.load_config(None, overrides)


def test_missing_model_path_says_what_to_do():
    cfg = config.load_config(None, ["model_path=/nowhere/model"])
    with pytest.raises(FileNotFoundError, match="model_path='/nowhere/model' is not a directory"):
        config.check_runtime(cfg)


def test_gpu_recipe_passes_validation_here():
    cfg = config.load_config(str(ROOT / "recipes/qwen3_4b_gsm8k.yaml"))
    assert cfg.device == "cuda" and cfg.engine == "sglang" and cfg.data_parallel == 4
    assert cfg.reward == "data.math_verify" and cfg.sglang["mem_fraction_static"] == 0.6


@pytest.mark.slow
def test_cli_check_and_bad_key_exit_codes():
    """The command line's exit codes: 0 and "config OK" for --check of a good recipe, 2 and the closest key for a
    misspelled one. Both processes start at once (each start-up, mostly imports, is one core's work)."""
    procs = [subprocess.Popen([sys.executable, "loongsage.py", "recipes/arith_cpu.yaml", arg], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for arg in ("--check", "temprature=0.5")]
    try:
        (ok_out, _), (_, bad_err) = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()  # a no-op for one that ended
    assert procs[0].returncode == 0 and "config OK" in ok_out
    assert procs[1].returncode == 2 and "did you mean 'temperature'" in bad_err


def _short_args(tmp_path, *extra) -> list[str]:
    return [f"output_dir={tmp_path}/run", "num_steps=3", "prompts_per_step=4", "samples_per_prompt=4",
            "global_batch_size=8", "micro_batch_size=4", "max_new_tokens=6", "eval_every=2",
            "eval_dataset=synthetic:arith:8:2:20", "eval_samples=1", "warmstart_steps=2", "warmstart_batch_size=8",
            "lr=1e-3", "print_every=1",
            "reward=tests.rewards.text_hash",  # differs between distinct samples: nonzero advantages at every step
            f"tiny_model={json.dumps(TINY)}", *extra]


def _short_run(tmp_path, *extra):
    return config.load_config(str(ROOT / "recipes/arith_cpu.yaml"), _short_args(tmp_path, *extra))


def _warm_start(cfg) -> str:
    """The checkpoint a run of cfg started from (weight version 0): its warm start, which the run cached."""
    return str(fleet.warm_start_dir(cfg, fleet.base_model(cfg)))


def _hf_weights(path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(Path(path) / "model.safetensors"))


# one torch thread per actor (they fix fp32 summation order, so an async run can equal it bit for bit), no core
# borrowing (async would compute on two threads then), one mini-batch per step (step 0 at ratio 1 throughout)
SYNC = ("trainer_threads=1", "engine_threads=1", "borrow_engine_cores=false", "global_batch_size=16")


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory, _session_cache, ray_session) -> SimpleNamespace:
    """ONE short sync run of the default recipe (grpo, token_mean: 3 steps, eval before step 0, after step 1 and
    at the end, rollouts dumped), asserted on by three tests: sync mode's versions, gaps and export, the default
    algorithm's step-0 gradient (test_each_algorithm_runs_end_to_end[grpo]), and async without staleness."""
    tmp = tmp_path_factory.mktemp("sync_run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOONGSAGE_CACHE", str(_session_cache))
        cfg = _short_run(tmp, *SYNC, f"dump_rollouts={tmp}/dump")
        given = dataclasses.asdict(cfg)  # a deep copy
        history = loongsage.train(cfg)
        warm = _warm_start(cfg)
    return SimpleNamespace(cfg=cfg, given=given, history=history, run=tmp / "run", dump=tmp / "dump", warm=warm)


@pytest.mark.slow
def test_end_to_end_sync_run(sync_run):
    """3 RL steps of the default recipe, shrunk. Sync mode: step k trains on rollouts of weight version k,
    the weights the trainer holds, so the train-inference gap is ~0 at EVERY step (fp32 on both sides); a
    sync that shipped stale or wrong weights shows as a gap from step 1 on. The policy really changed: every
    tensor of the final export differs from the warm-started start. train() leaves its config as given: what the
    run derives (the warm start, the engines) lives elsewhere."""
    cfg, history, run = sync_run.cfg, sync_run.history, sync_run.run
    assert dataclasses.asdict(cfg) == sync_run.given
    steps = [h for h in history if "train/loss" in h]
    assert len(steps) == 3
    assert all(math.isfinite(h["train/loss"]) and h["train/grad_norm"] > 0 for h in steps)
    for i, h in enumerate(steps):  # one AdamW update moves this gap to ~0.1-0.3 (max) and ~1e-3 (k3)
        assert h["train/gap_k3"] < 1e-6 and h["train/gap_max"] < 1e-4 and h["train/gap_abs"] < 1e-5, (i, h)
    # sync mode: the batch of step k was generated by weight version k, pushed by step k-1's sync
    assert [h["rollout/weight_version_max"] for h in steps] == [0, 1, 2]
    assert [h["rollout/weight_version_min"] for h in steps] == [0, 1, 2]
    assert [h["weights/version"] for h in steps] == [1, 2, 3]
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "eval/accuracy" in line] == [0, 1, 2]  # before step 0, then every 2 and last
    ticks = [line["time/wall"] for line in lines]  # each row's write, from train()'s start: a step's interval holds it
    assert all(b - a >= r["timing/step"] for a, b, r in zip(ticks, ticks[1:], lines[1:]) if "timing/step" in r)
    assert (run / "reward_curve.png").stat().st_size > 1000
    start, final = _hf_weights(sync_run.warm), _hf_weights(run / "final_hf")
    assert start.keys() == final.keys()
    unchanged = [k for k in start if torch.equal(start[k], final[k])]
    assert unchanged == [], unchanged  # 3 optimizer steps moved every tensor
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(run / "final_hf")  # the final export loads in transformers


@pytest.mark.slow
def test_end_to_end_async_run_records_versions(tmp_path, run_cache, ray_session):
    """Async: rollouts of version v may be trained on by a trainer at version v+1, never later. Tokens of
    the trainer's own version give a ~0 gap (so the sync shipped the right weights); tokens one update
    behind give the gap of that one update: visible, and far from the gap of a different model."""
    history = loongsage.train(_short_run(tmp_path, "mode=async", "stale_steps=1", "max_version_lag=1",
                                         "eval_samples=2", "eval_greedy=true", 'eval_sets={"b": "synthetic:arith:8:3:20"}'))
    steps = [h for h in history if "train/loss" in h]
    evals = [h for h in history if "eval/accuracy" in h]
    for key in ("eval/pass@1", "eval/pass@2", "eval/greedy_accuracy", "eval/b/accuracy", "eval/b/pass@2"):
        assert all(0 <= h[key] <= 1 for h in evals) and len(evals) == 3, key  # before, step 1, last
    assert len(steps) == 3 and all(math.isfinite(h["train/loss"]) for h in steps)
    stale_steps = measured = 0
    for i, h in enumerate(steps):
        assert i - 1 <= h["rollout/weight_version_min"] <= h["rollout/weight_version_max"] <= i
        assert h["rollout/lag_max"] <= 1 and h["rollout/running_groups"] + h["rollout/buffer_groups"] <= 8
        assert h["weights/version"] - 1 == i  # the trainer's weights (old logprobs) were version i
        # the gap is measured on rows version i sampled from their first token: numerics only (a row that spanned an
        # update went on over a KV cache of the older weights, in place, and measured 4e-4 here when it was counted)
        if "train/gap_k3" in h:
            measured += 1
            assert h["rollout/on_policy_frac"] > 0 and h["train/gap_k3"] < 1e-6 and h["train/gap_max"] < 1e-4, (i, h)
        if h["rollout/lag_max"] > 0:  # tokens one version behind: the policy's drift shows off-policy
            stale_steps += 1  # measured here: ~1e-3 after one update; a stale or random sync gives more
            assert 1e-6 < h["train/offpolicy_k3"] < 0.02, (i, h)
    assert steps[1]["rollout/lag_max"] == 1 and stale_steps >= 1  # generation overlapped training
    assert measured >= 1  # step 0 at least: every row sampled by the initial weights
    if len(cpu.usable_cores()) >= 2:  # a 2-core Linux node: trainer and engine pinned, the engine's core lent
        assert all(0 <= h["perf/trainer_borrowed_frac"] <= 1 for h in steps)


def _loss_weights(trajs: list[dict], advantage: str, loss_agg: str, max_new_tokens: int) -> list[float]:
    """w_i such that, at ratio 1 (step 0, one mini-batch: the policy is the behaviour policy, nothing clipped,
    KL and its gradient 0), the policy-gradient loss is  -sum_i w_i * sum_t logp_it  in gradient and
    -sum_i w_i * n_i  in value. Each estimator's advantage and each aggregation written out here, from the
    equations, independently of algos.py."""
    r = [t["reward"] for t in trajs]
    n = [sum(t["loss_mask"]) for t in trajs]  # model tokens per sample
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(trajs):
        groups.setdefault(t["group_id"], []).append(i)
    adv = [0.0] * len(trajs)  # one advantage per sample, the same on each of its tokens
    for idx in groups.values():
        m = sum(r[i] for i in idx) / len(idx)
        std = math.sqrt(sum((r[i] - m) ** 2 for i in idx) / (len(idx) - 1)) if len(idx) > 1 else 0.0
        for i in idx:
            if advantage == "grpo":  # group z-score, unbiased std, eps 1e-6
                adv[i] = (r[i] - m) / (std + 1e-6)
            elif advantage == "drgrpo":  # minus the group mean
                adv[i] = r[i] - m
            elif advantage == "rloo":  # minus the mean of the others
                adv[i] = r[i] - (sum(r[j] for j in idx) - r[i]) / (len(idx) - 1)
    if advantage == "reinforce_pp":  # return-to-go of an outcome reward (gamma 1) = r on every token; batch z-score
        toks = [r[i] for i in range(len(r)) for _ in range(n[i])]
        m = sum(toks) / len(toks)
        std = math.sqrt(sum((x - m) ** 2 for x in toks) / (len(toks) - 1))
        adv = [(x - m) / (std + 1e-6) for x in r]
    seqs = sum(k > 0 for k in n)
    if loss_agg == "token_mean":
        return [a / sum(n) for a in adv]
    if loss_agg == "seq_mean_token_mean":
        return [a / (k * seqs) if k else 0.0 for a, k in zip(adv, n)]
    return [a / (max_new_tokens * seqs) for a in adv]  # seq_mean_token_sum


def _sample_grads(model_dir: str, trajs: list[dict]) -> torch.Tensor:
    """(B, P) gradient of sum_t logp_it (the model's tokens) for each sample, with transformers on CPU."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for t in trajs:
        ids = torch.tensor([t["prompt_ids"] + t["response_ids"]])  # (1, T)
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]  # (T-1,)
        resp = logp[len(t["prompt_ids"]) - 1:]  # (R,) response tokens
        total = (resp * torch.tensor(t["loss_mask"], dtype=torch.float32)).sum()
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(total, params)]))
    return torch.stack(rows).double()  # (B, P)



@pytest.mark.parametrize("algo", [
    ["advantage=grpo"],
    ["advantage=drgrpo", "loss_agg=seq_mean_token_sum"],
    ["advantage=rloo", "kl_coef=0.01", "kl_type=k3"],
    ["advantage=reinforce_pp", "kl_coef=0.01", "kl_in_reward=true"],
    ["advantage=grpo", "policy_loss=gspo", "loss_agg=seq_mean_token_mean", "clip_low=0.0003", "clip_high=0.0004",
     "dynamic_sampling=true", "reward=tests.rewards.digit_fraction"],  # mostly 0 here: many equal groups to drop
], ids=["grpo", "drgrpo", "rloo", "reinforce_pp", "gspo+dynamic_sampling"])
@pytest.mark.slow
def test_each_algorithm_runs_end_to_end(algo, tmp_path, run_cache, ray_session, request):
    """A recipe switch changes the algorithm end to end. Step 0 trains on the dumped trajectories in one
    mini-batch at ratio 1, so its gradient is -sum_i w_i grad(sum_t logp_it), w_i from the configured
    estimator and aggregation: the trainer's grad norm equals that, computed here with transformers' autograd,
    and differs from the default's (grpo, token_mean) for another estimator. (The loss VALUE cannot tell
    them apart: with equal response lengths every group-centred estimator gives 0.) The default's run is the
    module's sync run (3 steps); every other estimator runs 2 steps of its own."""
    if algo == ["advantage=grpo"]:
        sync_run = request.getfixturevalue("sync_run")
        cfg, history, dump = sync_run.cfg, sync_run.history, sync_run.dump
    else:
        dump = tmp_path / "dump"
        cfg = _short_run(tmp_path, "num_steps=2", "eval_every=0", "global_batch_size=16", f"dump_rollouts={dump}",
                         *algo)
        history = loongsage.train(cfg)
    steps = [h for h in history if "train/loss" in h]
    assert len(steps) == cfg.num_steps
    for h in steps:
        assert all(math.isfinite(v) for k, v in h.items() if k.startswith(("train/", "rollout/")))
        assert h["train/grad_norm"] > 0 and h["train/num_minibatches"] == 1
        assert h["train/gap_max"] < 1e-4  # sync mode: the engines hold the trainer's weights
    trajs = [json.loads(line) for line in (dump / "step_00000.jsonl").read_text().splitlines()]
    assert len(trajs) == steps[0]["train/samples"]
    grads = _sample_grads(_warm_start(cfg), trajs)  # the warm start: step 0's weights

    def expected(advantage, loss_agg):
        w = _loss_weights(trajs, advantage, loss_agg, cfg.max_new_tokens)
        value = -sum(wi * sum(t["loss_mask"]) for wi, t in zip(w, trajs))
        return value, float((torch.tensor(w, dtype=torch.float64) @ grads).norm())

    value, norm = expected(cfg.advantage, cfg.loss_agg)
    assert steps[0]["train/pg_loss"] == pytest.approx(value, abs=1e-6)
    assert steps[0]["train/grad_norm"] == pytest.approx(norm, rel=1e-4)
    if cfg.advantage != "grpo":  # another estimator: another gradient. (GSPO's sequence ratio is 1 at step 0 like
        # PPO's token ratio, so gspo+grpo differs from the default only off-policy: tests/test_algos.py.)
        assert abs(norm - expected("grpo", "token_mean")[1]) > 0.01 * norm
    if "kl_type=k3" in algo:
        # KL as a loss term. Step 0 has one mini-batch: the policy IS the reference (same weights, same
        # forward), so the KL is 0 to float precision; after step 0's update it is not. (With two mini-batches
        # per step the second one runs after an AdamW update, and step 0's KL is then 0 only if the first
        # mini-batch happened to have all-zero advantages, which is what a former `kl < 1e-6` assert relied on.)
        assert steps[0]["train/kl"] < 1e-9 < 1e-6 < steps[1]["train/kl"]
    if "dynamic_sampling=true" in algo:
        # groups with equal rewards are dropped and the producer dispatches more prompts in their place until 4
        # informative groups are kept (or it gives up after 4*B dropped); exactly the kept groups are trained on
        for h, name in zip(steps, ("step_00000", "step_00001")):
            kept = [json.loads(line) for line in (dump / f"{name}.jsonl").read_text().splitlines()]
            by_group: dict[int, list[float]] = {}
            for t in kept:
                by_group.setdefault(t["group_id"], []).append(t["reward"])
            assert len(by_group) == h["rollout/groups_kept"] and h["train/samples"] == 4 * len(by_group)
            assert all(len(rs) == 4 and len(set(rs)) > 1 for rs in by_group.values())  # informative groups only
            dropped = h["rollout/groups_sampled"] - h["rollout/groups_kept"]
            assert h["rollout/groups_kept"] == 4 or dropped >= 16 and dropped >= 0
        assert sum(h["rollout/groups_sampled"] - h["rollout/groups_kept"] for h in steps) >= 1  # it had to refill


@pytest.mark.slow
def test_async_without_staleness_equals_sync(sync_run, tmp_path, run_cache, ray_session):
    """mode=async with stale_steps=0 dispatches a step's groups only after the previous sync, exactly as sync
    does: on a fixed seed (and the same thread counts, which fix fp32 summation order) every step's reward,
    loss, grad norm and gap are bit-identical to the module's sync run, evals included. No core borrowing: an async
    trainer rank that computes on its idle engine's core runs with two threads where sync runs with one (step 0's
    loss differed in the 9th digit)."""
    sync = [h for h in sync_run.history if "train/loss" in h]
    asyn = [h for h in loongsage.train(_short_run(tmp_path, *SYNC, f"dump_rollouts={tmp_path}/dump", "mode=async",
                                                  "stale_steps=0")) if "train/loss" in h]
    assert len(sync) == len(asyn) == 3
    for a, b in zip(sync, asyn):
        for k in ("rollout/reward_mean", "rollout/generated_tokens", "train/loss", "train/grad_norm", "train/gap_k3"):
            assert a[k] == b[k], (k, a[k], b[k])
        assert b["rollout/lag_max"] == 0 and b["rollout/on_policy_frac"] == 1.0


@pytest.mark.slow
def test_two_engines_two_trainers_checkpoints_dump_then_train_only_replay(tmp_path, run_cache, ray_session):
    """The options users combine, in one run: 2 engines, 2 trainer ranks (DP=2), save_every=1, dump_rollouts.
    Both engines serve rollouts and both receive every sync (gap ~0 at every step, on tokens of both). Then
    train_only replays the dump on ONE rank: the same rollout metrics, the same losses (DP=2 == DP=1), and a
    gap still ~0 at step 1, so the replayed training followed the same weights as the original."""
    dump = tmp_path / "dump"
    first = loongsage.train(_short_run(tmp_path, "num_steps=2", "eval_every=0", "num_engines=2", "trainer_workers=2",
                                       "save_every=1", f"dump_rollouts={dump}"))
    first = [h for h in first if "train/loss" in h]
    assert len(first) == 2
    for step, h in enumerate(first):
        trajs = [json.loads(line) for line in (dump / f"step_{step:05d}.jsonl").read_text().splitlines()]
        assert len(trajs) == 16 == h["train/samples"]
        assert len({t["metadata"]["engine"] for t in trajs}) == 2  # both engines served this step
        assert {v for t in trajs for v, m in zip(t["weight_versions"], t["loss_mask"]) if m} == {step}
        assert h["rollout/reward_mean"] == pytest.approx(sum(t["reward"] for t in trajs) / 16)
        assert h["train/gap_max"] < 1e-4 and h["train/gap_k3"] < 1e-6, h  # both engines hold the synced weights
        ckpt = tmp_path / "run" / "checkpoints" / f"step_{step:05d}"
        assert sorted(p.name for p in ckpt.iterdir()) == ["config.yaml", "controller_state.json", "manifest.json",
                                                         "rank_00000_model.pt", "rank_00000_optim.pt",
                                                         "rank_00001_model.pt", "rank_00001_optim.pt"]
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_00001"
    assert [h["weights/version"] for h in first] == [1, 2]

    replay = loongsage.train(_short_run(tmp_path, "num_steps=2", "eval_every=0", "train_only=true",
                                        f"load_rollouts={dump}", f"output_dir={tmp_path}/replay"))
    replay = [h for h in replay if "train/loss" in h]
    assert len(replay) == 2
    for a, b in zip(first, replay):
        for key in ("rollout/reward_mean", "rollout/response_len", "rollout/generated_tokens",
                    "rollout/weight_version_min", "rollout/weight_version_max", "train/samples"):
            assert b[key] == a[key], key  # the dump, replayed as it was generated
        for key in ("train/loss", "train/grad_norm", "train/entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
        assert b["train/gap_max"] < 1e-4  # the replay's trainer holds the weights that generated the dump
    assert not (tmp_path / "replay" / "checkpoints").exists() and (tmp_path / "replay" / "final_hf").is_dir()


@pytest.mark.slow
def test_two_sources_keep_their_own_agent_and_reward(tmp_path, run_cache, ray_session):
    """data_sources end to end: two sources, each with its own agent and reward, mixed 1:1. Each agent and reward
    raises on the other source's samples (the trajectory would fail, reward 0), the `add` agent calls the model
    once and the `sub` agent twice, and the rewards sit in disjoint ranges, [1, 1.1) and (-1.1, -1]: a swapped or
    dropped agent or reward shows in the dumped rollouts and in the per-source metrics."""
    dump = tmp_path / "dump"
    sources = [{"name": "add", "dataset": "synthetic:add:64:1:9", "eval_dataset": "synthetic:add:4:2:9",
                "agent": "tests.agents.add_agent", "reward": "tests.rewards.add_reward"},
               {"name": "sub", "dataset": "synthetic:sub:64:3:9", "eval_dataset": "synthetic:sub:4:4:9",
                "agent": "tests.agents.sub_agent", "reward": "tests.rewards.sub_reward"}]
    history = loongsage.train(_short_run(tmp_path, "num_steps=2", f"dump_rollouts={dump}", "agent_retries=0",
                                         "data_sources=" + json.dumps(sources)))
    steps = [h for h in history if "train/loss" in h]
    assert len(steps) == 2 and all(math.isfinite(h["train/loss"]) and h["train/grad_norm"] > 0 for h in steps)
    for step, h in enumerate(steps):
        trajs = [json.loads(line) for line in (dump / f"step_{step:05d}.jsonl").read_text().splitlines()]
        by = {src: [t for t in trajs if t["metadata"]["source"] == src] for src in ("add", "sub")}
        assert len(by["add"]) == len(by["sub"]) == 8  # weights 1:1 -> 2 groups of 4 each per step
        assert all(t["status"] != "failed" for t in trajs), [t["metadata"].get("error") for t in trajs]
        assert {t["metadata"]["turns"] for t in by["add"]} == {1} and {t["metadata"]["turns"] for t in by["sub"]} == {2}
        assert all(1 <= t["reward"] < 1.1 for t in by["add"]) and all(-1.1 < t["reward"] <= -1 for t in by["sub"])
        for src, ts in by.items():  # the per-source metric is the mean of that source's rewards
            assert h[f"rollout/{src}/reward_mean"] == pytest.approx(sum(t["reward"] for t in ts) / 8)
    evals = [h for h in history if "eval/add/accuracy" in h]
    assert len(evals) == 2  # before step 0 and after the last
    assert all(1 <= h["eval/add/accuracy"] < 1.1 and -1.1 < h["eval/sub/accuracy"] <= -1 for h in evals)


@pytest.mark.slow
def test_judge_engine_is_started_and_scores_every_trajectory(tmp_path, run_cache, ray_session, tiny_model_dir):
    """reward: judge in a run: the controller starts the judge's own engine from judge.model_path (no url given) and
    AgentFlow reaches it: every dumped trajectory carries the judge's verdict and the parsed reward of it
    (tests/test_agentflow.py checks the verdicts themselves against transformers' greedy decoding)."""
    judge = {"model_path": tiny_model_dir, "prompt_template": "Q: {prompt}\nA: {response}\nScore:",
             "parse": "tests.rewards.verdict_hash", "max_new_tokens": 4}
    history = loongsage.train(_short_run(tmp_path, "num_steps=1", "eval_every=0", "rollout_only=true",
                                         f"dump_rollouts={tmp_path}/dump", "reward=judge", f"judge={json.dumps(judge)}"))
    trajs = [json.loads(line) for line in (tmp_path / "dump" / "step_00000.jsonl").read_text().splitlines()]
    assert len(trajs) == 16 and all(t["status"] != "failed" for t in trajs), [t["metadata"].get("error") for t in trajs]
    assert all(t["reward"] == tests.rewards.verdict_hash(t["metadata"]["judge_verdict"]) for t in trajs)
    step = next(h for h in history if "rollout/reward_mean" in h)
    assert step["rollout/reward_mean"] == pytest.approx(sum(t["reward"] for t in trajs) / 16)


@pytest.mark.slow
def test_rollout_only_calc_agent_calls_the_tool_on_the_real_engine(tmp_path, ray_session):
    """rollout_only with the calc recipe: the tiny model, warm-started through the project's own warm start
    (cached across runs in the LoongSage cache), writes real tool calls on the real engine; the calculator
    runs on them, its result comes back masked, and the model answers. Nothing is trained or exported."""
    import data
    from recipes.calc import calculator
    dump = tmp_path / "dump"
    cfg = config.load_config(str(ROOT / "recipes/calc_cpu.yaml"), [
        f"output_dir={tmp_path}/run", f"tiny_model={json.dumps(TINY)}", "warmstart_steps=80",
        "warmstart_batch_size=16", "warmstart_lr=5e-3", "warmstart_label_noise=0.0", "rollout_only=true",
        "num_steps=1", "eval_every=0", "prompts_per_step=2", "samples_per_prompt=2", "global_batch_size=4",
        "micro_batch_size=4", "temperature=0", f"dump_rollouts={dump}"])
    history = loongsage.train(cfg)
    assert len(history) == 1 and not any(k.startswith(("train/", "weights/")) for k in history[0])
    assert not (tmp_path / "run" / "final_hf").exists()
    tok = data.load_tokenizer(_warm_start(cfg))
    trajs = [json.loads(line) for line in (dump / "step_00000.jsonl").read_text().splitlines()]
    assert len(trajs) == 4
    for t in trajs:
        assert t["status"] == "ok" and t["metadata"]["turns"] == 2, t["metadata"]
        model_text = tok.decode([i for i, m in zip(t["response_ids"], t["loss_mask"]) if m], skip_special_tokens=False)
        tool_text = tok.decode([i for i, m in zip(t["response_ids"], t["loss_mask"]) if not m],
                               skip_special_tokens=False)
        call = json.loads(model_text.split("<tool_call>")[1].split("</tool_call>")[0])
        assert call["name"] == "calculator"
        result = calculator(call["arguments"]["expression"])  # what the tool must have answered
        assert f"<tool_response>\n{result}\n</tool_response>" in tool_text  # the tool ran; its tokens are masked
        answer = model_text.split("</tool_call><|im_end|>")[1].removesuffix("<|im_end|>")
        question = t["prompt_text"].split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        assert answer == t["metadata"]["agent_result"]  # the agent's final reply is the model's second turn
        assert t["reward"] == data.last_number_match(answer, {"answer": calculator(question)})
        assert set(t["weight_versions"][i] for i, m in enumerate(t["loss_mask"]) if m) == {0}


@pytest.mark.slow
def test_failing_actor_surfaces_traceback_exits_nonzero_and_leaves_nothing(tmp_path, run_cache, capsys,
                                                                          ray_session):
    """The trainer ranks fail building their model (an unknown Megatron field), the engines and AgentFlow already up:
    main() (the command line's exit code) prints the actor's traceback and returns 1, and on the Ray it found (here
    the session's, as in a notebook) train() has stopped everything it started: every placement group removed,
    every CPU free again."""
    import ray
    code = loongsage.main([str(ROOT / "recipes/arith_cpu.yaml"), f"output_dir={tmp_path}/run", "warmstart_steps=0",
                           f"tiny_model={json.dumps(TINY)}", "megatron.not_a_megatron_field=1"])
    out, err = capsys.readouterr()
    assert code == 1, out[-2000:] + err[-2000:]
    assert "run failed" in err and "not_a_megatron_field" in err and "Traceback" in err
    assert ray.is_initialized() and not fleet._live
    assert all(p["state"] == "REMOVED" for p in ray.util.placement_group_table().values())
    deadline = time.monotonic() + 60  # a killed actor's CPU comes back once its process is gone
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == ray.cluster_resources()["CPU"], ray.available_resources()


@pytest.mark.slow
def test_no_affinity_call_check_and_run_go_unpinned(tmp_path, monkeypatch, capsys, run_cache, ray_session):
    """Where `os.sched_getaffinity` does not exist (macOS), nothing is pinned and nothing fails: the async layout
    that pins trainer and engine to their own cores on a 2-core Linux node plans no cores there, `--check`
    validates it with a one-line note, and a 2-step async run trains unpinned (no trainer borrows an engine's
    cores: perf/trainer_borrowed_frac is never reported). Pinning is the controller's decision, and this
    controller has no os.sched_getaffinity for the whole run, as on macOS (nothing in cpu.py caches it earlier)."""
    recipe = str(ROOT / "recipes/arith_cpu.yaml")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # Linux, two cores: this layout pins
    cfg = config.load_config(recipe, ["mode=async"])
    assert cpu.actor_cores(cfg, "trainer", 0) == [0] and cpu.lent_cores(cfg, 0) == [(0, [1])]
    monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.setattr(cpu, "_NOTED", False)
    assert cpu.actor_cores(cfg, "trainer", 0) == [] and cpu.actor_cores(cfg, "engine", 0) == []
    assert cpu.lent_cores(cfg, 0) == [] and cpu.engine_busy_file(cfg) == ""
    capsys.readouterr()
    monkeypatch.setattr(cpu, "_NOTED", False)
    assert loongsage.main([recipe, "mode=async", "--check"]) == 0
    out, err = capsys.readouterr()
    assert "config OK" in out and "cores trainer 0" not in out
    assert err.count("no os.sched_getaffinity") == 1  # one line, however often the cores are asked for

    run = ["mode=async", "stale_steps=1", "num_steps=2", "eval_every=0", "print_every=0"]
    monkeypatch.setattr(cpu, "_NOTED", False)
    loongsage.train(config.load_config(recipe, _short_args(tmp_path, *run)))  # what main() runs after --check
    out, err = capsys.readouterr()
    assert "no os.sched_getaffinity" in err and "cores trainer 0" not in out
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [h for h in rows if "train/loss" in h]
    assert len(steps) == 2 and all(math.isfinite(h["train/loss"]) and h["train/grad_norm"] > 0 for h in steps)
    assert not any("perf/trainer_borrowed_frac" in h for h in rows)


def test_bf16_training_on_cpu_is_refused_at_check():
    """An option that validates must work: the trainer cannot train in bf16 without CUDA, so --check refuses
    dtype=bfloat16 on a CPU device with the reason and what to set instead."""
    with pytest.raises(ValueError, match=r"dtype='bfloat16' with device='cpu'.*use dtype=float32"):
        config.load_config(str(ROOT / "recipes" / "arith_cpu.yaml"), ["dtype=bfloat16", "device=cpu"])
    assert config.load_config(str(ROOT / "recipes" / "arith_cpu.yaml"), ["dtype=float32"]).dtype == "float32"


@pytest.mark.slow
def test_two_node_cluster_run_equals_the_one_node_run(sync_run, tmp_path, run_cache, capsys):
    """A run pointed at an existing two-node Ray cluster (`ray_address`; both nodes on this machine): a node with one
    CPU for the trainer rank's bundle, one for the engine's, a head with none, so the placement group cannot pack
    them together. The placement table names both nodes; the weight sync takes the cross-node transport, a
    broadcast over a gloo group (shared memory never crosses Ray nodes, fleet.off_node), at every step; and every
    step and eval is bit-identical to the module's one-node sync run (same seeds and thread counts, the same bytes
    of weights however they travel). Last in the module: it ends the session's Ray, the next module starts it."""
    import ray
    from ray.cluster_utils import Cluster
    ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [cluster.add_node(num_cpus=1).node_id for _ in range(2)]  # hex, as the placement table prints them
    try:
        cfg = _short_run(tmp_path, *SYNC, f"dump_rollouts={tmp_path}/dump", f"ray_address={cluster.address}")
        history = loongsage.train(cfg)
    finally:
        ray.shutdown()
        cluster.shutdown()
    out = capsys.readouterr().out
    table = out.split("placement:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    trainer, engine = (next(ln for ln in table if ln.startswith(k)) for k in ("trainer 0", "engine 0"))
    on = {kind: next(n for n in nodes if n[:12] in line) for kind, line in (("trainer", trainer), ("engine", engine))}
    assert on["trainer"] != on["engine"], table
    one, two = ([h for h in run if "train/loss" in h or "eval/accuracy" in h] for run in (sync_run.history, history))
    steps = [h for h in two if "train/loss" in h]
    assert len(steps) == 3 and len(one) == len(two)
    for h in steps:
        assert h["weights/engines_broadcast"] == 1 and "weights/engines_shm" not in h, h
    for a, b in zip(one, two):
        for k in ("rollout/reward_mean", "rollout/generated_tokens", "train/loss", "train/grad_norm", "train/gap_k3",
                  "eval/accuracy"):
            assert a.get(k) == b.get(k), (k, a.get(k), b.get(k))
    for h in (h for h in sync_run.history if "train/loss" in h):  # the one-node run: shared memory, same machine
        assert h["weights/engines_shm"] == 1 and "weights/engines_broadcast" not in h
