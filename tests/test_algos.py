"""Tests of algos.py: every function against values worked out by hand on small tensors (the hand
computation is in the comment above each assert), the global-denominator invariance (micro-batches and
two gloo DP processes give the full-batch loss and gradients), the REINFORCE gradient of the clipped
losses at ratio 1, finiteness at the edges (all-masked rows, groups of one, log-ratios of +-50) and the
bounds of the IS corrections. Runs in ~20 s on 2 CPU cores: `.venv/bin/pytest tests/test_algos.py -q`.
"""
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import algos
import config

LN2 = math.log(2.0)


def make_cfg(**overrides):
    """A real Config (the one source of defaults, as the trainer gets it) with overrides."""
    return config.Config(**overrides)


def denom_of(mask, max_len=None):
    return algos.global_denominators(mask.sum(-1).tolist(), mask.shape[1] if max_len is None else max_len)


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def close(a, b, tol=1e-5):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32),
                               atol=tol, rtol=tol)


# ------------------------------------------------------------------------------------------------ validate

def test_config_defaults_are_valid():
    algos.validate(make_cfg())


@pytest.mark.parametrize("field,valid", [
    ("advantage", algos.ADVANTAGES), ("adv_norm", algos.ADV_NORMS), ("policy_loss", algos.POLICY_LOSSES),
    ("loss_agg", algos.LOSS_AGGS), ("kl_type", algos.KL_TYPES), ("is_correction", algos.IS_LEVELS),
    ("is_mode", algos.IS_MODES), ("length_penalty", algos.LENGTH_PENALTIES),
    ("distill_type", algos.DISTILL_TYPES)])
def test_unknown_name_lists_every_valid_choice(field, valid):
    with pytest.raises(ValueError) as err:
        algos.validate(make_cfg(**{field: "nonsense"}))
    msg = str(err.value)
    assert f"algo.{field}='nonsense'" in msg
    for choice in valid:
        assert repr(choice) in msg
    for name in valid:  # and every listed name is accepted on its own (other fields at defaults)
        cfg = make_cfg(**{field: name})
        if name == "gspo":
            cfg.loss_agg = "seq_mean_token_mean"
        if field == "length_penalty" and name:
            cfg.length_penalty_coef = 0.1
        algos.validate(cfg)


def test_close_name_is_suggested():
    with pytest.raises(ValueError, match="Did you mean 'grpo'"):
        algos.validate(make_cfg(advantage="grpoo"))


@pytest.mark.parametrize("overrides,fragment", [
    (dict(is_correction="token", use_rollout_logprobs=True), "identity"),
    (dict(clip_low=-0.1), "clip_low=-0.1 must be >= 0"),
    (dict(policy_loss="gspo", loss_agg="token_mean"), "loss_agg='seq_mean_token_mean'"),
    (dict(policy_loss="gspo", loss_agg="seq_mean_token_sum"), "sequence-level"),
    (dict(dual_clip_c=0.5), "dual_clip_c=0.5 must be 0"),
    (dict(dual_clip_c=3.0, policy_loss="cispo"), "ppo_clip"),
    (dict(is_low=2.0, is_high=2.0), "is_low=2.0 must be < algo.is_high=2.0"),
    (dict(advantage="reinforce_pp", kl_coef=0.1), "kl_in_reward=True"),
    (dict(kl_in_reward=True), "penalises nothing"),
    (dict(gamma=1.5), "gamma=1.5"),
    (dict(lam=-0.1), "lam=-0.1"),
    (dict(jsd_beta=1.0), "jsd_beta=1.0"),
    (dict(m2po_threshold=-1.0), "m2po_threshold"),
    (dict(length_penalty="kimi"), "length_penalty_coef > 0"),
    (dict(dynamic_sampling=True, samples_per_prompt=1), "samples_per_prompt >= 2"),
    (dict(advantage="rloo", samples_per_prompt=1), "every advantage is 0"),
])
def test_invalid_combinations_are_rejected(overrides, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        algos.validate(make_cfg(**overrides))


def test_batch_grpo_with_one_sample_per_prompt_is_allowed():
    algos.validate(make_cfg(adv_norm="batch", samples_per_prompt=1))


# ------------------------------------------------------------------------------------------------ aggregation

AGG_X = t([[1., 2., 3.], [4., float("nan"), float("inf")]])
AGG_M = t([[1, 1, 1], [1, 0, 0]])


@pytest.mark.parametrize("agg,expected", [
    ("token_mean", 2.5),                   # (1+2+3+4) / 4 tokens
    ("seq_mean_token_mean", 3.0),          # (6/3 + 4/1) / 2 seqs
    ("seq_mean_token_sum", 10 / 6),        # (6 + 4) / (max_len 3 * 2 seqs)
])
def test_aggregate_hand_values_and_masked_nan_does_not_leak(agg, expected):
    denom = {"tokens": 4.0, "seqs": 2.0, "max_len": 3.0}
    close(algos.aggregate(AGG_X, AGG_M, agg, denom), expected)


def test_aggregate_with_global_denominator_scales_micro_batch():
    # the same 4 tokens divided by a mini-batch total of 8 tokens: 10 / 8
    close(algos.aggregate(AGG_X, AGG_M, "token_mean", {"tokens": 8.0, "seqs": 4.0, "max_len": 3.0}), 1.25)


def test_global_denominators_skip_empty_rows():
    mask = t([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    # tokens 3; seqs: rows 0 and 2 have tokens, row 1 none -> 2; max_len passed through
    assert algos.global_denominators(mask.sum(-1).tolist(), 16) == {"tokens": 3.0, "seqs": 2.0, "max_len": 16.0}


# ------------------------------------------------------------------------------------------------ KL

def test_kl_estimators_hand_values():
    logp, ref, old = t([math.log(0.5)]), t([math.log(0.25)]), t([math.log(0.4)])
    # d = log(0.25/0.5) = -ln2
    close(algos.kl_estimate("k1", logp, ref), [LN2])                        # -d
    close(algos.kl_estimate("k2", logp, ref), [0.5 * LN2 ** 2])             # d^2/2 = 0.240227
    close(algos.kl_estimate("k3", logp, ref), [0.5 - 1 + LN2])              # e^d - 1 - d = 0.193147
    close(algos.kl_estimate("low_var_k3", logp, ref), [0.5 - 1 + LN2])      # below the clamp
    close(algos.kl_estimate("k3_unbiased", logp, ref, old), [1.25 * (LN2 - 0.5)])  # (0.5/0.4) * k3 = 0.241434
    # d = +30: k3 = e^30 - 31 = 1.0686e13; low_var_k3 clamps it to 10
    close(algos.kl_estimate("low_var_k3", t([0.0]), t([30.0])), [10.0])
    with pytest.raises(ValueError, match="old_logp"):
        algos.kl_estimate("k3_unbiased", logp, ref)


def test_kl_estimators_finite_at_log_ratio_50():
    logp = t([0.0, 0.0]).requires_grad_()
    ref = t([50.0, -50.0])
    for kind in algos.KL_TYPES:
        val = algos.kl_estimate(kind, logp, ref, logp.detach() - 50.0)
        val.sum().backward()
        assert torch.isfinite(val).all() and torch.isfinite(logp.grad).all(), kind
        logp.grad = None


# ------------------------------------------------------------------------------------------------ advantages

GIDS = torch.tensor([7, 7, 7, 3, 9, 9])          # non-contiguous ids; group 3 has one sample
REWARDS = t([1., 0., 1., 5., 2., 2.])            # group 9 has zero variance
MASK6 = torch.ones(6, 2)


def test_grpo_group_zscore_hand_values():
    # group 7: [1,0,1], mean 2/3, unbiased var ((1/3)^2*2 + (2/3)^2)/2 = 1/3, std 0.57735
    #   -> (1/3)/0.57735 = 0.57735, -(2/3)/0.57735 = -1.154701
    # group 3 (one sample) -> 0; group 9 (equal rewards) -> 0, no NaN
    adv = algos.compute_advantages(make_cfg(), REWARDS, GIDS, MASK6)
    s = 1 / math.sqrt(3)
    close(adv[:, 0], [s, -2 * s, s, 0, 0, 0], tol=1e-4)
    close(adv[:, 1], adv[:, 0])


def test_grpo_group_mean_and_drgrpo_hand_values():
    # x - group mean: group 7 -> [1/3, -2/3, 1/3]; group 3 -> 0; group 9 -> 0
    expected = [1 / 3, -2 / 3, 1 / 3, 0, 0, 0]
    close(algos.compute_advantages(make_cfg(adv_norm="group_mean"), REWARDS, GIDS, MASK6)[:, 0], expected)
    # Dr. GRPO ignores adv_norm (it is defined without the std)
    close(algos.compute_advantages(make_cfg(advantage="drgrpo", adv_norm="batch"), REWARDS, GIDS, MASK6)[:, 0],
          expected)


def test_grpo_batch_and_none_hand_values():
    r, g, m = t([1., 2., 3., 4.]), torch.tensor([0, 0, 1, 1]), torch.ones(4, 1)
    # mean 2.5, unbiased var (2.25+0.25+0.25+2.25)/3 = 5/3, std 1.290994 -> [-1.161895, -0.387298, ...]
    close(algos.compute_advantages(make_cfg(adv_norm="batch"), r, g, m)[:, 0],
          [-1.161895, -0.387298, 0.387298, 1.161895], tol=1e-4)
    close(algos.compute_advantages(make_cfg(adv_norm="none"), r, g, m)[:, 0], [1., 2., 3., 4.])


def test_rloo_hand_values():
    # group 7: 1 - mean(0,1) = 0.5; 0 - mean(1,1) = -1; 1 - mean(1,0) = 0.5; groups 3 (one) and 9 (equal) -> 0
    adv = algos.compute_advantages(make_cfg(advantage="rloo"), REWARDS, GIDS, MASK6)
    close(adv[:, 0], [0.5, -1.0, 0.5, 0, 0, 0])


def test_sequence_advantages_are_zero_off_the_mask():
    mask = t([[1, 0, 1], [0, 0, 0]])
    adv = algos.compute_advantages(make_cfg(adv_norm="group_mean"), t([1., 0.]), torch.tensor([0, 0]), mask)
    # mean 0.5: row 0 -> +0.5 on its two tokens, row 1 (all masked) -> 0 everywhere
    close(adv, [[0.5, 0, 0.5], [0, 0, 0]])


def test_kl_in_reward_for_sequence_estimators():
    # seq 0: k1 = old - ref = ln2 on each of 2 tokens -> r' = 1 - 0.5 * 2 ln2 = 0.306853; seq 1: kl 0 -> r' = 1
    # group mean 0.653426 -> adv [-0.346574, +0.346574]
    old = t([[math.log(0.5)] * 2, [-1.0, -1.0]])
    ref = t([[math.log(0.25)] * 2, [-1.0, -1.0]])
    cfg = make_cfg(adv_norm="group_mean", kl_coef=0.5, kl_in_reward=True, kl_type="k1")
    adv = algos.compute_advantages(cfg, t([1., 1.]), torch.tensor([0, 0]), torch.ones(2, 2), old_logp=old,
                                   ref_logp=ref)
    close(adv[:, 0], [-LN2 / 2, LN2 / 2])
    with pytest.raises(ValueError, match="old_logp and ref_logp"):
        algos.compute_advantages(cfg, t([1., 1.]), torch.tensor([0, 0]), torch.ones(2, 2))


def test_returns_discount_over_model_tokens_and_credit_tool_rewards():
    # mask [1,1,0,1] (position 2 is a tool token carrying reward 3), rewards [0,1,3,2], gamma 0.5:
    #   G_3 = 2;  G_1 = 1 + 3 (tool reward, undiscounted) + 0.5*2 = 5;  G_0 = 0 + 0.5*5 = 2.5
    cfg = make_cfg(advantage="returns", adv_norm="none", gamma=0.5)
    adv = algos.compute_advantages(cfg, t([0.]), torch.tensor([0]), t([[1, 1, 0, 1]]),
                                   token_rewards=t([[0., 1., 3., 2.]]))
    close(adv, [[2.5, 5.0, 0.0, 2.0]])


def test_gae_hand_values():
    # values [1,2,9(tool, ignored),1], gamma 0.5, lam 0.5, same rewards:
    #   t=3: delta = 2 - 1 = 1, A = 1
    #   t=1: delta = 1 + 3 + 0.5*1 - 2 = 2.5, A = 2.5 + 0.25*1 = 2.75
    #   t=0: delta = 0 + 0.5*2 - 1 = 0,      A = 0 + 0.25*2.75 = 0.6875
    cfg = make_cfg(advantage="gae", adv_norm="none", gamma=0.5, lam=0.5)
    adv = algos.compute_advantages(cfg, t([0.]), torch.tensor([0]), t([[1, 1, 0, 1]]),
                                   token_rewards=t([[0., 1., 3., 2.]]), values=t([[1., 2., 9., 1.]]))
    close(adv, [[0.6875, 2.75, 0.0, 1.0]])
    with pytest.raises(ValueError, match="needs values"):
        algos.compute_advantages(cfg, t([0.]), torch.tensor([0]), t([[1, 1]]))


def test_returns_with_group_norm_over_tokens():
    # outcome rewards on the last token, gamma 1: row 0 returns [1,1], row 1 [0,0] (same group)
    # token-level group z-score over 4 values [1,1,0,0]: mean .5, unbiased std sqrt(1/3) -> +-0.866025
    adv = algos.compute_advantages(make_cfg(advantage="returns"), t([1., 0.]), torch.tensor([4, 4]),
                                   torch.ones(2, 2))
    close(adv, [[0.866025, 0.866025], [-0.866025, -0.866025]], tol=1e-4)


def test_reinforce_pp_hand_values():
    # kl_coef 0.1, k1 = old - ref: seq 0 tokens [ln2, 0], seq 1 [0, 0]
    # token rewards: seq 0 [-0.1 ln2, 1] -> returns (gamma 1) [0.930685, 1];  seq 1 [0, 0]
    # batch z-score of [0.930685, 1, 0, 0]: mean 0.482671, unbiased var 0.934289/3 = 0.311430, std 0.558059
    #   -> [0.802806, 0.927013, -0.864910, -0.864910]
    old = t([[math.log(0.5), -1.0], [-1.0, -1.0]])
    ref = t([[math.log(0.25), -1.0], [-1.0, -1.0]])
    cfg = make_cfg(advantage="reinforce_pp", adv_norm="group", kl_coef=0.1, kl_in_reward=True, kl_type="k1")
    adv = algos.compute_advantages(cfg, t([1., 0.]), torch.tensor([0, 1]), torch.ones(2, 2), old_logp=old,
                                   ref_logp=ref)
    close(adv, [[0.802806, 0.927013], [-0.864910, -0.864910]], tol=2e-6)


def test_token_rewards_rejected_by_sequence_estimators():
    with pytest.raises(ValueError, match="advantage='returns'"):
        algos.compute_advantages(make_cfg(), t([1.]), torch.tensor([0]), t([[1.]]), token_rewards=t([[1.]]))


def test_outcome_and_turn_rewards_to_tokens():
    # reward on the last model token; an all-masked row gets nothing
    mask = t([[1, 1, 0], [1, 0, 1], [0, 0, 0]])
    close(algos.outcome_to_tokens(t([3., 4., 5.]), mask), [[0, 3, 0], [0, 0, 4], [0, 0, 0]])
    # turns are runs of 1s: [0,1] and [4,5]; rewards go on positions 1 and 5
    m = t([[1, 1, 0, 0, 1, 1, 0]])
    close(algos.turn_rewards_to_tokens([[0.5, 2.0]], m), [[0, 0.5, 0, 0, 0, 2.0, 0]])
    with pytest.raises(ValueError, match="3 turn rewards but only 2 model turns"):
        algos.turn_rewards_to_tokens([[1., 2., 3.]], m)


@pytest.mark.parametrize("name", algos.ADVANTAGES)
def test_advantages_finite_on_groups_of_one_all_masked_rows_and_empty_batch(name):
    cfg = make_cfg(advantage=name)
    mask = t([[1, 1], [0, 0], [1, 0]])
    adv = algos.compute_advantages(cfg, t([1., 1., 0.]), torch.tensor([0, 1, 2]), mask, values=torch.zeros(3, 2))
    assert torch.isfinite(adv).all()
    assert (adv[mask == 0] == 0).all()
    empty = algos.compute_advantages(cfg, t([]), torch.tensor([], dtype=torch.long), torch.zeros(0, 4),
                                     values=torch.zeros(0, 4))
    assert empty.shape == (0, 4)
    # a DP rank without samples still takes part (no ref_logp needed even when the KL is in the reward)
    cfg.kl_coef, cfg.kl_in_reward = 0.1, True
    assert algos.compute_advantages(cfg, t([]), torch.tensor([], dtype=torch.long), torch.zeros(0, 1),
                                    values=torch.zeros(0, 1)).shape == (0, 1)


# ------------------------------------------------------------------------------------------------ policy losses

def test_ppo_clip_hand_values_with_clip_higher_and_dual_clip():
    ratio = t([0.5, 1.0, 1.5, 4.0])
    # clip range [0.8, 1.28]
    # A=+1: max(-r, -clip(r)) = [max(-.5,-.8), -1, max(-1.5,-1.28), max(-4,-1.28)] = [-0.5, -1, -1.28, -1.28]
    loss, clipped, _ = algos.ppo_clip_loss(ratio, torch.ones(4), 0.2, 0.28)
    close(loss, [-0.5, -1.0, -1.28, -1.28])
    assert clipped.tolist() == [False, False, True, True]
    # A=-1: [max(.5,.8), 1, max(1.5,1.28), max(4,1.28)] = [0.8, 1, 1.5, 4]; dual clip c=3: min(4, 3) = 3
    loss, clipped, dual = algos.ppo_clip_loss(ratio, -torch.ones(4), 0.2, 0.28, dual_clip_c=3.0)
    close(loss, [0.8, 1.0, 1.5, 3.0])
    assert clipped.tolist() == [True, False, False, False]
    assert dual.tolist() == [False, False, False, True]


def test_ppo_clip_policy_loss_and_metrics():
    # one row, log-ratios ln(0.5), 0, ln(1.5), ln(4); A = -1; token mean over 4 tokens: (0.8+1+1.5+3)/4 = 1.575
    logp = t([[math.log(0.5), 0.0, math.log(1.5), math.log(4.0)]])
    cfg = make_cfg(clip_high=0.28, dual_clip_c=3.0)
    loss, m = algos.policy_loss(cfg, logp, torch.zeros(1, 4), -torch.ones(1, 4), torch.ones(1, 4),
                                denom=denom_of(torch.ones(1, 4)))
    close(loss, 1.575)
    close(m["pg_loss"], 1.575)
    close(m["clip_frac"], 0.25)       # only r=0.5 picked the clipped branch
    close(m["dual_clip_frac"], 0.25)  # r=4
    close(m["mask_frac"], 0.0)


def test_gspo_hand_values_and_gradient():
    # seq 0 log-ratios [0.2, 0.4] -> s = e^0.3 = 1.349859 > 1.2 -> clipped: -1.2 per token, no gradient
    # seq 1 log-ratios [0.0, 0.1] -> s = e^0.05 = 1.051271 -> -1.051271 per token
    # seq mean: (-1.2 - 1.051271)/2 = -1.125636; grad on seq 1 tokens: -s/|y|/N_seqs = -1.051271/4 = -0.262818
    old = torch.zeros(2, 2)
    logp = t([[0.2, 0.4], [0.0, 0.1]]).requires_grad_()
    cfg = make_cfg(policy_loss="gspo", loss_agg="seq_mean_token_mean")
    loss, m = algos.policy_loss(cfg, logp, old, torch.ones(2, 2), torch.ones(2, 2), denom=denom_of(torch.ones(2, 2)))
    close(loss, -1.125636)
    loss.backward()
    close(logp.grad, [[0.0, 0.0], [-0.262818, -0.262818]])
    close(m["clip_frac"], 0.5)


def test_cispo_hand_values_and_gradient():
    # ratios [0.5, 2.0] -> weights clip to [0.8, 1.28], detached; A = 1
    # loss = -w * A * logp = [-0.8*ln0.5, -1.28*ln0.4] = [0.554518, 1.172853]; grad wrt logp = -w
    logp = t([math.log(0.5), math.log(0.4)]).requires_grad_()
    ratio = t([0.5, 2.0])
    loss, clipped = algos.cispo_loss(ratio, torch.ones(2), logp, 0.2, 0.28)
    close(loss, [0.554518, 1.172853])
    loss.sum().backward()
    close(logp.grad, [-0.8, -1.28])
    assert clipped.tolist() == [True, True]


def test_reinforce_and_sft_hand_values():
    # REINFORCE: -A logp = -2 * -0.5 = 1.0, grad -A = -2
    logp = t([-0.5]).requires_grad_()
    loss = algos.reinforce_loss(t([2.0]), logp)
    loss.backward()
    close(loss, [1.0])
    close(logp.grad, [-2.0])
    # SFT: (1 + 2 + 3) / 3 tokens = 2.0; with a mini-batch total of 6 tokens: 1.0; nan off the mask ignored
    lp, mask = t([[-1., -2.], [-3., float("nan")]]), t([[1, 1], [1, 0]])
    close(algos.sft_loss(lp, mask, denom_of(mask)), 2.0)
    close(algos.sft_loss(lp, mask, {"tokens": 6.0, "seqs": 4.0, "max_len": 2.0}), 1.0)
    # the sft policy loss is the same token NLL
    cfg = make_cfg(policy_loss="sft")
    close(algos.policy_loss(cfg, lp, lp, torch.zeros(2, 2), mask, denom=denom_of(mask))[0], 2.0)


def test_kl_loss_and_entropy_bonus():
    # 2 tokens; A = 0 so the pg term is 0. k1 = logp - ref = ln0.5 - ln0.25 = ln2; entropy 1.5
    # loss = 0.1 * ln2 - 0.01 * 1.5 = 0.0543147; with kl_in_reward the KL leaves the loss: -0.015
    logp, ref = torch.full((1, 2), math.log(0.5)), torch.full((1, 2), math.log(0.25))
    ent, mask = torch.full((1, 2), 1.5), torch.ones(1, 2)
    cfg = make_cfg(policy_loss="reinforce", kl_coef=0.1, kl_type="k1", entropy_coef=0.01)
    loss, m = algos.policy_loss(cfg, logp, logp, torch.zeros(1, 2), mask, ref_logp=ref, entropy=ent,
                                denom=denom_of(mask))
    close(loss, 0.1 * LN2 - 0.015)
    close(m["kl"], LN2)
    close(m["entropy"], 1.5)
    cfg.kl_in_reward = True
    close(algos.policy_loss(cfg, logp, logp, torch.zeros(1, 2), mask, ref_logp=ref, entropy=ent,
                            denom=denom_of(mask))[0], -0.015)
    cfg.kl_in_reward = False
    with pytest.raises(ValueError, match="needs ref_logp"):
        algos.policy_loss(cfg, logp, logp, torch.zeros(1, 2), mask, entropy=ent, denom=denom_of(mask))


LOSSES_WITH_AGG = [(p, a) for p in ("ppo_clip", "cispo", "reinforce") for a in algos.LOSS_AGGS] + [
    ("gspo", "seq_mean_token_mean")]


@pytest.mark.parametrize("name,agg", LOSSES_WITH_AGG)
def test_at_ratio_one_clipped_losses_have_the_reinforce_gradient(name, agg):
    # at logp == old_logp every ratio is 1: d/dlogp of the loss is exactly that of agg(-A * logp)
    torch.manual_seed(0)
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    adv = torch.randn(3, 4) * mask
    logp0 = -torch.rand(3, 4) - 0.1
    denom = denom_of(mask)
    logp = logp0.clone().requires_grad_()
    algos.policy_loss(make_cfg(policy_loss=name, loss_agg=agg), logp, logp0, adv, mask, denom=denom)[0].backward()
    ref = logp0.clone().requires_grad_()
    algos.aggregate(-adv * ref, mask, agg, denom).backward()
    close(logp.grad, ref.grad)


# ------------------------------------------------------------------------------------------------ corrections

def test_is_weight_levels_and_modes_hand_values():
    # old - rollout log-ratios row 0: [ln1.5, ln2, (masked)];  bounds [0.5, 1.8]
    old = t([[math.log(1.5), LN2, 5.0]])
    roll = torch.zeros(1, 3)
    mask = t([[1, 1, 0]]) > 0
    w = lambda level, mode: algos.is_weight(level, old, roll, mask, 0.5, 1.8, mode)  # noqa: E731
    # token: [1.5, 2.0] -> truncate [1.5, 1.8]; mask [1.5, 0 (dropped)]
    close(w("token", "truncate")[0][0, :2], [1.5, 1.8])
    weight, dropped = w("token", "mask")
    close(weight[0, :2], [1.5, 0.0])
    assert dropped[0].tolist() == [False, True, False]
    # seq: 1.5 * 2 = 3.0 -> truncate 1.8 on both; mask drops the whole sequence
    close(w("seq", "truncate")[0][0, :2], [1.8, 1.8])
    assert w("seq", "mask")[1][0].tolist() == [True, True, False]
    # geo: sqrt(3) = 1.732051 inside the bounds on both modes
    close(w("geo", "truncate")[0][0, :2], [1.732051, 1.732051])
    close(w("geo", "mask")[0][0, :2], [1.732051, 1.732051])


@pytest.mark.parametrize("level", ["token", "seq", "geo"])
def test_bounded_corrections_never_leave_their_bounds(level):
    torch.manual_seed(1)
    old = torch.randn(16, 8) * 20
    old[0, :] = 50.0
    old[1, :] = -50.0
    roll = torch.zeros(16, 8)
    mask = torch.rand(16, 8) > 0.3
    w, _ = algos.is_weight(level, old, roll, mask, 0.2, 3.0, "truncate")
    assert ((w >= 0.2) & (w <= 3.0)).all()
    w, dropped = algos.is_weight(level, old, roll, mask, 0.2, 3.0, "mask")
    inside = (w >= 0.2) & (w <= 3.0)
    assert (inside | (w == 0)).all() and ((w == 0) == dropped)[mask].all()


def test_is_correction_in_policy_loss():
    # REINFORCE A=1, logp=-1 on 2 tokens; old - rollout = [ln1.5, ln4], token truncate to [0, 2] -> [1.5, 2]
    # loss = (1.5*1 + 2*1) / 2 = 1.75; is_weight_mean 1.75
    # rollout gap: k3 of KL(rollout||old) = mean(e^d - 1 - d) with d = [ln1.5, ln4]
    #   = (0.5 - 0.405465 + 3 - 1.386294)/2 = 0.854120;  abs diff (0.405465 + 1.386294)/2 = 0.895880
    logp = torch.full((1, 2), -1.0)
    old = torch.zeros(1, 2)
    roll = t([[-math.log(1.5), -math.log(4.0)]])
    cfg = make_cfg(policy_loss="reinforce", is_correction="token", is_high=2.0)
    loss, m = algos.policy_loss(cfg, logp, old, torch.ones(1, 2), torch.ones(1, 2), rollout_logp=roll,
                                denom=denom_of(torch.ones(1, 2)))
    close(loss, 1.75)
    close(m["is_weight_mean"], 1.75)
    close(m["rollout_k3"], 0.854120)
    close(m["rollout_abs_diff"], 0.895880)
    with pytest.raises(ValueError, match="needs rollout_logp"):
        algos.policy_loss(cfg, logp, old, torch.ones(1, 2), torch.ones(1, 2), denom=denom_of(torch.ones(1, 2)))


def test_m2po_drops_largest_squared_log_ratios_until_under_threshold():
    # squares [0.01, 0.25, 0.09, 0.0025]: M2 = 0.3525/4 = 0.088 > 0.02
    #   drop 0.25 -> 0.1025/3 = 0.034167 > 0.02;  drop 0.09 -> 0.0125/2 = 0.00625 <= 0.02: drop tokens 1, 2
    lr = t([[0.1, -0.5, 0.3, 0.05, 9.0]])
    mask = t([[1, 1, 1, 1, 0]]) > 0
    assert algos.m2po_drop(lr, mask, 0.02)[0].tolist() == [False, True, True, False, False]
    assert not algos.m2po_drop(lr, mask, 0.1).any()          # 0.088 <= 0.1 already
    assert algos.m2po_drop(lr, mask, 0.0).sum() == 4          # no token has log-ratio 0: only dropping all
    # via policy_loss: REINFORCE A=1 logp=lr (old 0, no rollout -> behaviour = old); 2 of 4 tokens dropped
    cfg = make_cfg(policy_loss="reinforce", m2po_threshold=0.02)
    loss, m = algos.policy_loss(cfg, lr, torch.zeros(1, 5), torch.ones(1, 5), mask.float(),
                                denom=denom_of(mask.float()))
    close(loss, -(0.1 + 0.05) / 4)    # -A*logp on the kept tokens 0 and 3, over 4 tokens
    close(m["m2po_frac"], 0.5)
    close(m["mask_frac"], 0.5)


def test_opsm_drops_only_negative_far_off_policy_sequences():
    # behaviour - current per token: seq 0 [0.2, 0.4] (mean 0.3 > 0.25, A<0) -> dropped
    # seq 1 same KL but A>0 -> kept; seq 2 mean 0.1 <= 0.25 -> kept
    logp = torch.zeros(3, 2)
    behav = t([[0.2, 0.4], [0.2, 0.4], [0.1, 0.1]])
    adv = t([[-1, -1], [1, 1], [-1, -1]])
    mask = torch.ones(3, 2) > 0
    assert algos.opsm_drop(logp, behav, adv, mask, 0.25).tolist() == [[True, True], [False, False], [False, False]]
    cfg = make_cfg(policy_loss="reinforce", opsm_delta=0.25)
    _, m = algos.policy_loss(cfg, logp, logp, adv, mask.float(), rollout_logp=behav, denom=denom_of(mask.float()))
    close(m["opsm_frac"], 2 / 6)


def test_stale_tokens_are_dropped_but_still_counted():
    # REINFORCE A=1 logp=-1 on 4 tokens, one stale: (1+1+1)/4 = 0.75; stale_frac 0.25
    mask = torch.ones(1, 4)
    stale = t([[0, 1, 0, 0]])
    cfg = make_cfg(policy_loss="reinforce", mask_stale_tokens=True)
    loss, m = algos.policy_loss(cfg, -mask, -mask, mask, mask, stale_mask=stale, denom=denom_of(mask))
    close(loss, 0.75)
    close(m["stale_frac"], 0.25)
    close(m["mask_frac"], 0.25)
    cfg.mask_stale_tokens = False
    close(algos.policy_loss(cfg, -mask, -mask, mask, mask, stale_mask=stale, denom=denom_of(mask))[0], 1.0)


def test_gap_metrics_hand_values():
    # train - rollout = [0.5, 0, (masked)]: abs mean 0.25, max 0.5; k3 mean((e^.5 - 1.5) + 0)/2 = 0.0743606
    g = algos.gap_metrics(t([[-1., -2., 7.]]), t([[-1.5, -2., -9.]]), t([[1, 1, 0]]))
    assert g.keys() == {"k3", "abs_diff", "max_abs_diff"}
    assert all(isinstance(v, float) for v in g.values())
    close([g["k3"], g["abs_diff"], g["max_abs_diff"]], [0.0743606, 0.25, 0.5])
    assert algos.gap_metrics(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2)) == {
        "k3": 0.0, "abs_diff": 0.0, "max_abs_diff": 0.0}


@pytest.mark.parametrize("name", algos.POLICY_LOSSES)
def test_losses_finite_at_extreme_log_ratios_and_garbage_off_the_mask(name):
    # log-ratios of +-50 against old, rollout and ref, every correction on, nan/inf on masked positions
    logp = t([[-50., 0., -1., float("nan")], [0., -50., float("-inf"), float("nan")], [1, 1, 1, 1]])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])     # row 2 all masked
    logp.requires_grad_()
    old = t([[0., -50., -1., 3.], [-50., 0., 0., 0.], [0, 0, 0, 0]])
    roll = t([[50., -50., -1., float("inf")], [0., 0., 0., 0.], [0, 0, 0, 0]])
    ref = t([[0., 50., -50., 0.], [50., -50., 0., 0.], [0, 0, 0, 0]])
    adv = t([[1., -1., 1., float("nan")], [-1., -1., 0., 0.], [0, 0, 0, 0]])
    agg = "seq_mean_token_mean" if name == "gspo" else "token_mean"
    for is_level in ("token", "seq", "geo"):
        for mode in algos.IS_MODES:
            cfg = make_cfg(policy_loss=name, loss_agg=agg, kl_coef=0.1, entropy_coef=0.01, is_correction=is_level,
                           is_mode=mode, m2po_threshold=0.04, opsm_delta=0.5, mask_stale_tokens=True,
                           dual_clip_c=3.0 if name == "ppo_clip" else 0.0)
            loss, metrics = algos.policy_loss(cfg, logp, old, adv, mask, rollout_logp=roll, ref_logp=ref,
                                              entropy=torch.ones(3, 4), stale_mask=torch.zeros(3, 4),
                                              denom=denom_of(mask))
            loss.backward()
            assert torch.isfinite(loss), (is_level, mode)
            assert torch.isfinite(logp.grad).all(), (is_level, mode)
            assert (logp.grad[mask == 0] == 0).all()
            assert all(torch.isfinite(v) for v in metrics.values()), metrics
            logp.grad = None


# ------------------------------------------------------------------------------------------------ invariance

def tiny_policy_batch(seed=0, B=8, T=6, D=4, V=5):
    """A tiny linear 'policy' logits = x @ W and a batch of 4 groups of 2 with rewards, masks, logps."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=g)
    actions = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    mask[3] = 0.0                                        # an all-masked row
    mask[0] = 1.0
    W0 = torch.randn(D, V, generator=g) * 0.5
    rewards = torch.randint(0, 2, (B,), generator=g).float()
    rewards[0], rewards[1] = 1.0, 0.0
    group_ids = torch.arange(B) // 2
    old = torch.log_softmax(x @ W0, -1).gather(-1, actions[..., None])[..., 0]         # (B, T)
    rollout = old + 0.3 * torch.randn(B, T, generator=g)
    ref = old + 0.2 * torch.randn(B, T, generator=g)
    stale = (torch.rand(B, T, generator=g) > 0.8).float()
    return dict(x=x, actions=actions, mask=mask, W0=W0, rewards=rewards, group_ids=group_ids, old=old,
                rollout=rollout, ref=ref, stale=stale)


def run_policy(cfg, b, rows, W, denom, adv, n_micro):
    """Loss, grad of W and metric sums over `rows` split into n_micro micro-batches (global denom)."""
    total, metric_sums = 0.0, {}
    for chunk in torch.tensor_split(rows, n_micro):
        logits = b["x"][chunk] @ W                                                      # (b, T, V)
        logp_all = torch.log_softmax(logits, -1)
        logp = logp_all.gather(-1, b["actions"][chunk][..., None])[..., 0]             # (b, T)
        entropy = -(logp_all.exp() * logp_all).sum(-1)                                  # (b, T)
        # a step away from old so ratios are not 1: the current policy is W, old is W0
        loss, metrics = algos.policy_loss(cfg, logp, b["old"][chunk], adv[chunk], b["mask"][chunk],
                                    rollout_logp=b["rollout"][chunk], ref_logp=b["ref"][chunk], entropy=entropy,
                                    stale_mask=b["stale"][chunk], denom=denom)
        loss.backward()
        total = total + loss.detach()
        for k, v in metrics.items():
            metric_sums[k] = metric_sums.get(k, 0.0) + v
    return total, metric_sums


INVARIANCE_CASES = [(p, a) for p in ("ppo_clip", "cispo", "reinforce") for a in algos.LOSS_AGGS] + [
    ("gspo", "seq_mean_token_mean")]


def invariance_cfg(name, agg, **kw):
    return make_cfg(policy_loss=name, loss_agg=agg, kl_coef=0.05, entropy_coef=0.01, is_correction="seq",
                    is_high=3.0, opsm_delta=0.05, mask_stale_tokens=True, clip_high=0.28,
                    dual_clip_c=3.0 if name == "ppo_clip" else 0.0, **kw)


@pytest.mark.parametrize("name,agg", INVARIANCE_CASES)
def test_micro_batch_invariance(name, agg):
    # one micro-batch of 8 vs four of 2 (each divided by the global denominators): same loss, same grad,
    # and the summed metrics equal the full-batch metrics
    b = tiny_policy_batch()
    cfg = invariance_cfg(name, agg)
    adv = algos.compute_advantages(cfg, b["rewards"], b["group_ids"], b["mask"])
    denom = algos.global_denominators(b["mask"].sum(-1).tolist(), 6)
    rows = torch.arange(8)
    W1 = (b["W0"] + 0.1).requires_grad_()
    l1, m1 = run_policy(cfg, b, rows, W1, denom, adv, 1)
    W4 = (b["W0"] + 0.1).requires_grad_()
    l4, m4 = run_policy(cfg, b, rows, W4, denom, adv, 4)
    close(l4, l1)
    close(W4.grad, W1.grad)
    assert W1.grad.abs().sum() > 0
    assert m1.keys() == m4.keys() >= {"pg_loss", "kl", "entropy", "is_weight_mean", "opsm_frac", "stale_frac",
                                      "mask_frac", "rollout_k3", "rollout_abs_diff"}
    for k in m1:
        close(m4[k], m1[k])
    assert m1["mask_frac"] > 0 and m1["opsm_frac"] > 0 and m1["stale_frac"] > 0   # the masks did bite


def _dp_worker(rank, world, init_file, out_dir):
    """One DP rank: its half of the groups, batch-normalised advantages over both ranks, global denominators,
    two micro-batches, gradients SUMMED over ranks (the trainer's contract with global denominators)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    b = tiny_policy_batch()
    rows = torch.arange(8)[rank * 4:(rank + 1) * 4]                 # groups {0,1} on rank 0, {2,3} on rank 1
    out = {}
    for name, agg in INVARIANCE_CASES:
        for advantage in ("grpo", "reinforce_pp"):
            cfg = invariance_cfg(name, agg, advantage=advantage, adv_norm="batch")
            if advantage == "reinforce_pp":
                cfg.kl_in_reward = True
            adv = algos.compute_advantages(cfg, b["rewards"][rows], b["group_ids"][rows], b["mask"][rows],
                                           old_logp=b["old"][rows], ref_logp=b["ref"][rows],
                                           dp_group=dist.group.WORLD)
            denom = algos.global_denominators(b["mask"].sum(-1).tolist(), 6)  # the whole batch, as each rank holds it
            full_adv = torch.zeros(8, 6)
            full_adv[rows] = adv
            W = (b["W0"] + 0.1).requires_grad_()
            loss = run_policy(cfg, b, torch.arange(8)[rows], W, denom, full_adv, 2)[0].reshape(1)
            dist.all_reduce(loss)
            dist.all_reduce(W.grad)
            out[(name, agg, advantage)] = (adv, loss, W.grad)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_dp_split_over_two_gloo_processes_matches_full_batch(tmp_path):
    mp.spawn(_dp_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    b = tiny_policy_batch()
    rows = torch.arange(8)
    for name, agg in INVARIANCE_CASES:
        for advantage in ("grpo", "reinforce_pp"):
            cfg = invariance_cfg(name, agg, advantage=advantage, adv_norm="batch")
            if advantage == "reinforce_pp":
                cfg.kl_in_reward = True
            adv = algos.compute_advantages(cfg, b["rewards"], b["group_ids"], b["mask"], old_logp=b["old"],
                                           ref_logp=b["ref"])
            W = (b["W0"] + 0.1).requires_grad_()
            loss = run_policy(cfg, b, rows, W, algos.global_denominators(b["mask"].sum(-1).tolist(), 6), adv, 1)[0]
            key = (name, agg, advantage)
            close(torch.cat([results[0][key][0], results[1][key][0]]), adv)      # batch z-score across ranks
            for r in range(2):
                close(results[r][key][1][0], loss)
                close(results[r][key][2], W.grad)


# ------------------------------------------------------------------------------------------------ shaping, filters

def test_overlong_penalty_hand_values():
    # L_max 10, L_cache 4 -> ramp from 6: [5 -> 0, 6 -> 0, 8 -> (6-8)/4 = -0.5, 10 -> -1, 11 -> -1]
    close(algos.overlong_penalty(t([5, 6, 8, 10, 11]), 10, 4, 1.0), [0, 0, -0.5, -1, -1])
    close(algos.overlong_penalty(t([8, 11]), 10, 4, 0.5), [-0.25, -0.5])
    close(algos.overlong_penalty(t([8, 11]), 10, 0, 1.0), [0, 0])  # buffer 0 = off


def test_shape_rewards_linear_and_kimi():
    # DAPO (L_max 8, L_cache 4, ramp from 4) + linear 0.5 * (-len/8): len 4 -> 1 + 0 - 0.25 = 0.75;
    # len 8 -> 1 - 1 - 0.5 = -0.5
    cfg = make_cfg(overlong_buffer=4, length_penalty="linear", length_penalty_coef=0.5)
    close(algos.shape_rewards(cfg, t([1., 1.]), t([4, 8]), torch.tensor([0, 0]), 8), [0.75, -0.5])
    # Kimi: group lengths [2,4,6] -> lambda = 0.5 - (l-2)/4 = [0.5, 0, -0.5]; rewards [1,0,1]:
    #   correct -> lambda, incorrect -> min(0, lambda): [0.5, 0, -0.5]; + rewards -> [1.5, 0, 0.5]
    # a second group with one length (3, 3) -> lambda 0 -> reward unchanged
    cfg = make_cfg(length_penalty="kimi", length_penalty_coef=1.0)
    close(algos.shape_rewards(cfg, t([1., 0., 1., 1., 0.]), t([2, 4, 6, 3, 3]), torch.tensor([0, 0, 0, 1, 1]), 8),
          [1.5, 0.0, 0.5, 1.0, 0.0])


# ------------------------------------------------------------------------------------------------ distillation

def test_sampled_reverse_kl_as_advantage_penalty():
    # kl = -1 - (-1.5) = 0.5; A' = 1 - 0.2 * 0.5 = 0.9 on the mask, 0 off it
    cfg = make_cfg(pg_ratio=0.2)
    adv = algos.distill_advantage(cfg, torch.ones(1, 2), torch.full((1, 2), -1.0), torch.full((1, 2), -1.5),
                                  t([[1, 0]]))
    close(adv, [[0.9, 0.0]])


def test_full_vocab_kl_both_directions_hand_values():
    # p = [.5, .5], q = [.25, .75]: KL(p||q) = .5 ln2 + .5 ln(2/3) = 0.143841
    #                               KL(q||p) = .25 ln(.5) + .75 ln(1.5) = 0.130812
    p_logits, q_logits = t([[[0., 0.]]]).log_softmax(-1), t([[[0.25, 0.75]]]).log()
    mask = torch.ones(1, 1)
    fwd, m = algos.distill_loss(make_cfg(distill_type="forward_kl"), q_logits, mask,
                                denom_of(mask), teacher_logits=p_logits)
    close(fwd, 0.143841)
    close(m["distill_forward_kl"], 0.143841)
    rev, _ = algos.distill_loss(make_cfg(distill_type="reverse_kl"), q_logits, mask,
                                denom_of(mask), teacher_logits=p_logits)
    close(rev, 0.130812)


def test_topk_kl_renormalised_on_teacher_support():
    # teacher top-2 probs [.3, .1] -> renormalised [.75, .25]; student [.4,.2,.2,.2] at ids [0,1] -> [2/3, 1/3]
    # KL = .75 ln(.75/(2/3)) + .25 ln(.25/(1/3)) = 0.088337 - 0.071921 = 0.016417
    student = t([[[0.4, 0.2, 0.2, 0.2]]]).log()
    kl = algos.topk_forward_kl(student, t([[[0.3, 0.1]]]).log(), torch.tensor([[[0, 1]]]))
    close(kl, [[0.016417]])
    cfg = make_cfg(distill_type="topk_kl")
    loss, _ = algos.distill_loss(cfg, student, torch.ones(1, 1), denom_of(torch.ones(1, 1)),
                                 teacher_topk_logp=t([[[0.3, 0.1]]]).log(), teacher_topk_ids=torch.tensor([[[0, 1]]]))
    close(loss, 0.016417)


def test_generalized_jsd_hand_values():
    # disjoint supports, beta 0.5: M = [.5,.5], KL(P||M) = KL(Q||M) = ln2 -> JSD = ln2 (its maximum)
    close(algos.generalized_jsd(t([[[0., -1e4]]]), t([[[-1e4, 0.]]]), 0.5), [[LN2]])
    # beta 0.25, P = [1,0] (teacher), Q = [.5,.5]: M = [.625, .375]
    #   .25 * ln(1/.625) + .75 * (.5 ln(.5/.625) + .5 ln(.5/.375)) = 0.117501 + 0.024202 = 0.141703
    close(algos.generalized_jsd(t([[[0., 0.]]]), t([[[0., -1e4]]]), 0.25), [[0.141703]], tol=2e-6)
    # identical distributions -> 0
    close(algos.generalized_jsd(t([[[0.3, 0.1]]]), t([[[0.3, 0.1]]]), 0.5), [[0.0]])


def test_distill_loss_errors():
    mask = torch.ones(1, 1)
    with pytest.raises(ValueError, match="distill_type='sampled_kl' is not valid"):
        algos.distill_loss(make_cfg(distill_type="sampled_kl"), torch.zeros(1, 1, 2), mask, denom_of(mask))
    with pytest.raises(ValueError, match="needs teacher_logits"):
        algos.distill_loss(make_cfg(distill_type="jsd"), torch.zeros(1, 1, 2), mask, denom_of(mask))


def test_mixture_logp_and_objective_hand_values():
    # teachers p1 = [.5, .5], p2 = [.9, .1], weights .25/.75 -> q = [.8, .2]; a weight of 0 drops a teacher
    logps = torch.stack([t([[.5, .5]]).log(), t([[.9, .1]]).log()])      # (J=2, 1, V=2)
    close(algos.mixture_logp(logps, t([[.25], [.75]])).exp(), [[0.8, 0.2]])
    close(algos.mixture_logp(logps, t([[0.], [1.]])).exp(), [[0.9, 0.1]])
    # L = (1 - g) * rl + g * gkd
    close(algos.opd_objective(make_cfg(gkd_ratio=0.25), torch.tensor(2.0), torch.tensor(6.0)), 3.0)


def test_opd_ratios_are_validated():
    with pytest.raises(ValueError, match="gkd_ratio=1.5"):
        algos.validate(make_cfg(gkd_ratio=1.5))
    with pytest.raises(ValueError, match="pure distillation"):
        algos.validate(make_cfg(gkd_ratio=1.0, pg_ratio=0.5))
    with pytest.raises(ValueError, match="pg_ratio=-1"):
        algos.validate(make_cfg(pg_ratio=-1.0))


def test_topk_overlap():
    student = t([[[3., 2., 1., 0.]]])                                     # student top-2 ids {0, 1}
    close(algos.topk_overlap(student, torch.tensor([[[1, 2]]])), [[0.5]])
    close(algos.topk_overlap(student, torch.tensor([[[1, 0]]])), [[1.0]])
