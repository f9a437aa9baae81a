"""PPO with a critic (`advantage: gae`): the value model in trainer.py, its loss and targets in algos.py, its knobs
in loongsage.py. What each test proves:

* `algos.value_loss`: the clipped value loss, its clip fraction and its gradient, against numbers worked out by
  hand (the clipped branch wins on one token and its gradient there is 0), with global denominators;
* `algos.gae_returns`: the critic's target R = raw GAE + V by hand (gamma, lam), untouched by adv_norm, and
  equal to the return-to-go whatever V is when lam = 1; `algos.explained_variance` by hand;
* `--check` accepts `advantage: gae` and rejects its knobs' bad values and the combinations it cannot serve;
* the worker (real Megatron-Core over gloo in Ray actors): a fresh critic says V = 0, so the first value loss
  is 1/2 mean R^2 of the batch's rewards, exactly (also for a compacted trajectory's segments and per-turn
  rewards with gamma < 1); repeated steps on one batch lower it; V(s_t) does not see token t; a checkpoint
  restores the critic bit-exactly; TP=2 and DP=2 give TP=1's critic step; tied-embedding and MoE models work;
* end to end on the tiny task: `advantage: gae` trains policy and critic for a few steps with finite metrics
  and a value loss that falls.
Runs in ~4 min on 2 CPU cores: `.venv/bin/python -m pytest -q tests/test_critic.py`.
"""
import json
import math
from pathlib import Path

import pytest
import torch

import algos
import config
import loongsage
from test_trainer import Ranks, make_batch, make_cfg, step_numbers

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(900)


def t(x):
    return torch.tensor(x, dtype=torch.float32)


# ------------------------------------------------------------------------------------------------ the math


def test_value_loss_hand_values_with_clipping():
    # four positions, position 2 a tool token (masked: its nan must not leak); value_clip 0.1; 3 loss tokens
    #   t0: V 1.0, V_old 0.8, R 0: unclipped (1-0)^2 = 1;  V_clip = 0.8+0.1 = 0.9 -> 0.81;  max 1     -> L 0.5
    #   t1: V 0.9, V_old 0.0, R 1: unclipped 0.01;          V_clip = 0.0+0.1 = 0.1 -> 0.81;  max 0.81  -> L 0.405
    #       (the clipped branch wins: the critic moved 0.9 toward R in one go, more than the clip allows)
    #   t3: V 0.0, V_old 0.5, R 1: unclipped 1;             V_clip = 0.5-0.1 = 0.4 -> 0.36;  max 1     -> L 0.5
    #   loss = (0.5 + 0.405 + 0.5) / 3 = 0.468333;  clipfrac = 1/3
    #   dL/dV = (V - R)/3 where the unclipped branch wins, 0 where the clipped one does: [1/3, 0, 0, -1/3]
    values = t([[1.0, 0.9, math.nan, 0.0]]).requires_grad_()
    old, ret, mask = t([[0.8, 0.0, 7.0, 0.5]]), t([[0.0, 1.0, math.inf, 1.0]]), t([[1, 1, 0, 1]])
    loss, m = algos.value_loss(values, old, ret, mask, 0.1, {"tokens": 3.0})
    loss.backward()
    assert loss.item() == pytest.approx(1.405 / 3, abs=1e-6)
    assert m["clipfrac"].item() == pytest.approx(1 / 3, abs=1e-6) and m["value_loss"].item() == loss.item()
    torch.testing.assert_close(values.grad, t([[1 / 3, 0.0, 0.0, -1 / 3]]))
    # value_clip 0: plain squared error (0.5 + 0.005 + 0.5) / 3, nothing clipped; a global count of 6 tokens
    # (another micro-batch holds the other 3) halves it, so micro-batch losses add up
    loss0, m0 = algos.value_loss(values.detach(), old, ret, mask, 0.0, {"tokens": 3.0})
    assert loss0.item() == pytest.approx(1.005 / 3, abs=1e-6) and m0["clipfrac"].item() == 0.0
    loss6, _ = algos.value_loss(values.detach(), old, ret, mask, 0.1, {"tokens": 6.0})
    assert loss6.item() == pytest.approx(1.405 / 6, abs=1e-6)


def test_gae_returns_hand_values_and_lambda_one_is_the_return_to_go():
    # mask [1,1,0,1] (position 2 a tool token with reward 3), rewards [0,1,3,2], values [1,2,9 (ignored),1]:
    # gamma 0.5, lam 0.5 -> GAE A = [0.6875, 2.75, 0, 1] (worked out in test_algos.test_gae_hand_values), so
    #   R = A + V = [1.6875, 4.75, 0, 2.0]  whatever adv_norm says (the target is never normalised)
    mask, tok_r, v = t([[1, 1, 0, 1]]), t([[0., 1., 3., 2.]]), t([[1., 2., 9., 1.]])
    for norm in ("group", "batch", "none"):
        cfg = config.Config(advantage="gae", adv_norm=norm, gamma=0.5, lam=0.5)
        ret = algos.gae_returns(cfg, t([0.]), torch.tensor([0]), mask, v, token_rewards=tok_r)
        torch.testing.assert_close(ret, t([[1.6875, 4.75, 0.0, 2.0]]))
    # lam 1: the lambda-return is the discounted return-to-go G = [0 + 0.5*5, 1 + 3 + 0.5*2, 0, 2] = [2.5, 5, 0, 2],
    # the same for any V (the V terms telescope away)
    cfg.lam = 1.0
    for values in (v, torch.zeros(1, 4), t([[-3., 4., 0., 0.5]])):
        ret = algos.gae_returns(cfg, t([0.]), torch.tensor([0]), mask, values, token_rewards=tok_r)
        torch.testing.assert_close(ret, t([[2.5, 5.0, 0.0, 2.0]]))


def test_explained_variance_hand_values():
    # R = [1, 0, 1, 0] (Var 0.25), a masked nan at the end
    ret, mask = t([[1., 0., 1., 0., math.nan]]), t([[1, 1, 1, 1, 0]])
    assert algos.explained_variance(t([[0.5] * 4 + [math.nan]]), ret, mask) == pytest.approx(0.0)  # only the mean
    assert algos.explained_variance(ret, ret, mask) == pytest.approx(1.0)  # V = R
    # V = [1, 0, 0, 0]: R - V = [0, 0, 1, 0], Var = 0.25 - 0.0625 = 0.1875 -> 1 - 0.1875/0.25 = 0.25
    assert algos.explained_variance(t([[1., 0., 0., 0., 0.]]), ret, mask) == pytest.approx(0.25)
    assert algos.explained_variance(t([[0.3] * 5]), t([[1.] * 5]), mask) == 0.0  # constant R: defined as 0


# ------------------------------------------------------------------------------------------------ --check


def test_check_accepts_gae_and_rejects_what_the_critic_cannot_serve(capsys):
    recipe = str(ROOT / "recipes/arith_cpu.yaml")
    cfg = config.load_config(recipe, ["advantage=gae", "critic_lr=3e-4", "value_clip=0.5", "critic_warmup_steps=2"])
    assert (cfg.advantage, cfg.critic_lr, cfg.value_clip, cfg.critic_warmup_steps) == ("gae", 3e-4, 0.5, 2)
    assert config.describe(cfg).endswith("critic (value model) in every trainer rank")
    for overrides, message in [
        (["critic_lr=0"], "critic_lr=0.0 must be > 0"),
        (["value_clip=-0.1"], "value_clip=-0.1 must be >= 0"),
        (["critic_warmup_steps=45"], "critic_warmup_steps=45 must be >= 0 and below num_steps=45"),
        (["gkd_ratio=1", 'teachers={"t": "tiny"}'], "pure distillation has no RL loss"),
    ]:
        with pytest.raises(ValueError) as e:
            config.load_config(recipe, ["advantage=gae", *overrides])
        assert message in str(e.value), (overrides, str(e.value))
    with pytest.raises(ValueError, match="critic_warmup_steps=1 applies to advantage='gae'"):
        config.load_config(recipe, ["critic_warmup_steps=1"])  # a knob that would do nothing with grpo
    capsys.readouterr()
    assert loongsage.main([recipe, "advantage=gae", "--check"]) == 0  # the command line's --check
    out, err = capsys.readouterr()
    assert "config OK" in out, err


# ------------------------------------------------------------------------------------------------ end to end


@pytest.mark.slow
def test_end_to_end_gae_run_trains_the_critic(tmp_path, run_cache, ray_session):
    """A few steps of the tiny arithmetic recipe with `advantage: gae`: the real pipeline (Ray, Megatron-Core, the
    CPU engine over HTTP, TransferMesh). The reward (tests.rewards.text_hash, in [0, 1)) differs between any two
    responses, so each step has something to regress on; the critic starts at V = 0, so its first loss is
    1/2 E[R^2] and it falls as the values find the rewards' level."""
    tiny = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=128, norm_std=0.2)
    cfg = config.load_config(str(ROOT / "recipes/arith_cpu.yaml"), [
        f"output_dir={tmp_path}/run", "num_steps=4", "prompts_per_step=4", "samples_per_prompt=4",
        "global_batch_size=8", "micro_batch_size=4", "max_new_tokens=6", "eval_every=0", "warmstart_steps=2",
        "warmstart_batch_size=8", "lr=1e-3", "print_every=0", "reward=tests.rewards.text_hash",
        f"tiny_model={json.dumps(tiny)}", "advantage=gae", "adv_norm=batch", "critic_lr=3e-3", "critic_warmup_steps=1"])
    history = loongsage.train(cfg)
    steps = [h for h in history if "critic/value_loss" in h]
    assert len(steps) == 4
    for h in steps:
        assert all(math.isfinite(v) for k, v in h.items() if k.startswith(("critic/", "train/"))), h
    assert "train/loss" not in steps[0] and all("train/loss" in h for h in steps[1:])  # warm-up: the critic alone
    assert steps[0]["critic/values_mean"] == 0.0  # the zero head
    losses = [h["critic/value_loss"] for h in steps]
    assert losses[-1] < 0.6 * losses[0], losses


# ------------------------------------------------------------------------------------------------ the worker


# gamma 0.5, lam 1: the critic's target is the discounted return-to-go whatever V is. One mini-batch (up to 8
# samples): the critic's first forward of a step is V_old itself. kl_coef 0: no reference model. critic_lr large
# enough that a few steps on one batch move the values visibly.
GAE = dict(advantage="gae", adv_norm="batch", gamma=0.5, lam=1.0, kl_coef=0.0, critic_lr=1e-2, value_clip=0.2,
           global_batch_size=8)


@pytest.fixture(scope="module")
def one(ray_session):
    """One rank (TP=1, DP=1) with GAE, reused by the worker tests: each starts with a fresh load_hf."""
    ranks = Ranks(make_cfg(**GAE), 1)
    yield ranks
    ranks.close()


@pytest.mark.slow
def test_critic_starts_at_zero_learns_and_resumes_from_a_checkpoint(one, tiny_model_dir, tmp_path):
    batch = make_batch()  # 8 samples in 4 groups, rewards 0/1, tool tokens inside some responses
    [info] = one.call("load_hf", tiny_model_dir)
    assert info["critic"] and not info["reference"]
    [v0] = one.call("compute_values", batch)
    assert all(torch.equal(v, torch.zeros(len(s["response_ids"]))) for v, s in zip(v0, batch))  # zero head
    # V = 0: the outcome r sits on the last model token, so the j-th model token from the end has R = r * 0.5^j
    # (tool tokens are not steps); the loss is 1/2 sum R^2 / N over the batch's model tokens
    n = [sum(s["loss_mask"]) for s in batch]
    expect = 0.5 * sum(sum((s["reward"] * 0.5 ** j) ** 2 for j in range(k)) for k, s in zip(n, batch)) / sum(n)
    steps = [one.call("train_step", batch, i)[0] for i in range(5)]
    first = steps[0]
    assert first["critic/value_loss"] == pytest.approx(expect, abs=1e-6)
    assert first["critic/values_mean"] == 0.0 and first["critic/vf_explained_var"] == pytest.approx(0.0)
    assert first["critic/clipfrac"] == 0.0 and first["critic/grad_norm"] > 0 and first["critic/lr"] == 1e-2
    assert first["train/optim_steps"] == 1 and math.isfinite(first["train/loss"])  # the policy trained too
    losses = [m["critic/value_loss"] for m in steps]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < 0.7 * losses[0], losses
    assert steps[-1]["critic/vf_explained_var"] > 0.2, [m["critic/vf_explained_var"] for m in steps]
    # V(s_t) is the value of the context BEFORE response token t: changing token 3 leaves V_0..V_3 as they
    # were and changes what follows (a head read one position late would see token t in V(s_t))
    s = max(batch, key=lambda x: len(x["response_ids"]))
    edited = {**s, "response_ids": s["response_ids"][:3] + [(s["response_ids"][3] + 1) % 300 + 10]
              + s["response_ids"][4:]}
    [(va, vb)] = [one.call("compute_values", [s, edited])[0]]
    assert torch.equal(va[:4], vb[:4]) and not torch.equal(va[4:], vb[4:]), (va, vb)

    [sums] = one.call("save_checkpoint", str(tmp_path / "ckpt"))
    [saved] = one.call("compute_values", batch)
    [m5] = one.call("train_step", batch, 5)  # moves the critic on
    [moved] = one.call("compute_values", batch)
    assert any(not torch.equal(a, b) for a, b in zip(saved, moved))
    one.call("load_hf", tiny_model_dir)  # a fresh model, as after a restart: the critic is back at V = 0
    one.call("load_checkpoint", str(tmp_path / "ckpt"), sums)
    [restored] = one.call("compute_values", batch)
    assert all(torch.equal(a, b) for a, b in zip(saved, restored))
    [again] = one.call("train_step", batch, 5)  # the critic's optimizer state came back too: the same step again
    [moved_again] = one.call("compute_values", batch)
    assert all(torch.equal(a, b) for a, b in zip(moved, moved_again)) and step_numbers(again) == step_numbers(m5)


@pytest.mark.slow
def test_critic_targets_of_segments_and_turn_rewards_by_hand(one, tiny_model_dir):
    """A compacted trajectory (two segments) with per-turn rewards, gamma 0.5, lam 1, a fresh critic (V = 0): the
    first value loss is 1/2 sum R^2 / N over every trained row, R the discounted return-to-go of the rewards."""
    from test_segments import compacted, seg
    batch = [{**compacted(0, 1.0, 0), "turn_rewards": [0.5, 1.0]}, {**compacted(0, 0.0, 1), "segments": []},
             {**seg([5, 6], [7, 8, 9], [1, 1, 1]), "reward": 1.0, "group_id": 1, "sample_index": 0, "segments": []},
             {**seg([5, 6], [7, 9, 9], [1, 1, 1]), "reward": 0.0, "group_id": 1, "sample_index": 1, "segments": []}]
    # trajectory 0, last segment, mask [1,1,0,0,1,1]: turn rewards 0.5 on token 1, 1.0 on token 5 (tool tokens are
    #   not steps): G5 = 1, G4 = 0.5, G1 = 0.5 + 0.5*0.5 = 0.75, G0 = 0.375; its early segment (3 tokens) regresses
    #   on G0 = 0.375 (the return where the last segment starts), as it shares the advantage there
    # trajectory 1: reward 0 -> 0 on its 4 tokens; trajectory 2: outcome 1 on token 2 -> [0.25, 0.5, 1]; 3: zeros
    squares = (0.375 ** 2 + 0.75 ** 2 + 0.5 ** 2 + 1) + 3 * 0.375 ** 2 + (0.25 ** 2 + 0.5 ** 2 + 1)  # 3.6875
    one.call("load_hf", tiny_model_dir)
    [m] = one.call("train_step", batch, 0)
    assert m["train/rows"] == 5 and m["train/num_minibatches"] == 1
    assert m["critic/value_loss"] == pytest.approx(0.5 * squares / 17, abs=1e-6)  # 17 model tokens in 5 rows
    assert math.isfinite(m["train/loss"]) and m["critic/values_mean"] == 0.0


@pytest.mark.slow
def test_critic_on_tied_embeddings_and_moe(one, tmp_path):
    """The value head replaces a tied LM head (Llama, tie_word_embeddings) and sits on an MoE trunk (Qwen3-MoE,
    padding kept out of routing) alike: both start at V = 0 and learn."""
    from test_trainer import _tiny_family
    batch = make_batch(2, 2, seed=1, vocab=128)
    for kind in ("llama_tied", "qwen3_moe"):
        [info] = one.call("load_hf", _tiny_family(kind, tmp_path))
        assert info["critic"], kind
        ms = [one.call("train_step", batch, i)[0] for i in range(3)]
        [v] = one.call("compute_values", batch)
        assert ms[0]["critic/values_mean"] == 0.0 and ms[0]["critic/grad_norm"] > 0, kind
        assert all(math.isfinite(m["critic/value_loss"]) for m in ms), kind
        assert all(bool(torch.isfinite(x).all()) for x in v) and any(bool((x != 0).any()) for x in v), kind


@pytest.mark.parametrize("layout", [dict(tensor_parallel=2, trainer_workers=2), dict(trainer_workers=2)],
                         ids=["tp2", "dp2"])
@pytest.mark.slow
def test_critic_step_with_tp2_and_dp2_matches_one_rank(one, tiny_model_dir, layout):
    # one mini-batch of four groups; DP=2 deals two groups to every rank, so a DP average instead of a sum would
    # halve the critic's grad norm
    batch = make_batch()
    one.call("load_hf", tiny_model_dir)
    one.call("train_step", batch, 0)  # a first step moves V off 0, so the second one has clipping and GAE work
    [m1] = one.call("train_step", batch, 1)
    [v1] = one.call("compute_values", batch)
    two = Ranks(make_cfg(**GAE, **layout), 2)
    try:
        two.call("load_hf", tiny_model_dir)
        two.call("train_step", batch, 0)
        m2a, m2b = two.call("train_step", batch, 1)
        v2, v2b = two.call("compute_values", batch)
    finally:
        two.close()
    assert m2a == m2b
    for key in ("critic/value_loss", "critic/grad_norm", "critic/clipfrac", "critic/vf_explained_var",
                "critic/values_mean", "train/loss"):
        assert m2a[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
    assert max(float((a - b).abs().max()) for a, b in zip(v1, v2)) < 1e-4
    assert all(torch.equal(a, b) for a, b in zip(v2, v2b))
