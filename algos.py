"""algos.py — the math of LoongSage: advantages, policy losses, aggregation, KL estimators, off-policy
corrections (IS, M2PO, OPSM, stale tokens), reward shaping and group filters, distillation divergences.

Every equation lives in exactly one function whose docstring gives it in plain text, its source (arXiv id,
equation or section) and any departure. Variants are chosen by name with if/elif in one dispatch place per
family (`compute_advantages`, `_pg_token_loss`, `aggregate`, `kl_estimate`, `is_weight`, `distill_loss`,
`shape_rewards`); `validate(cfg)` rejects unknown names and invalid combinations at config time. `advantage`,
`policy_loss`, `kl_type` and `distill_type` also take a dotted path to a user's function (docs/EXTENDING.md).
The trainer calls the rest on the batch it trains (the critic's value model lives in trainer.py); every knob is a
field of `config.Config`, its one default there.

Conventions (stated once here, repeated where a loss consumes them):
  * B sequences, T response positions. `loss_mask` (B, T) is 1 on model-generated tokens only; tool and
    padding positions are 0 and any value there (logp, adv, ...) is ignored, even inf or nan.
  * logps are log-probabilities of the sampled tokens (B, T).
  * Losses are divided by GLOBAL denominators `denom = {"tokens", "seqs", "max_len"}` counted over the whole
    mini-batch on all DP ranks, so micro-batch losses (and DP-rank gradients) simply add up. The trainer
    must therefore SUM gradients across DP ranks (not average them). `global_denominators` counts them.
  * Log-ratios are clamped to +-20 before exp: the ratio e^20 ~ 4.9e8 is far outside every clip range, and
    the clamp keeps float32 finite for any input (beyond it the ratio is constant, so its gradient is 0).

Test: `.venv/bin/pytest tests/test_algos.py -q` (spawns 2 gloo procs).

Left out on purpose: PPO-KL adaptive coefficients, and M2PO's mask across micro-batches (it is computed per
`policy_loss` call, see `m2po_drop`).
"""
from __future__ import annotations

import difflib
import math

import torch
import torch.distributed as dist

import data

# --------------------------------------------------------------------------------------------------------
# Names (the defaults are config.Config's)
# --------------------------------------------------------------------------------------------------------

ADVANTAGES = ("grpo", "drgrpo", "rloo", "reinforce_pp", "returns", "gae")
ADV_NORMS = ("group", "group_mean", "batch", "none")
POLICY_LOSSES = ("ppo_clip", "gspo", "cispo", "reinforce", "sft")
LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
KL_TYPES = ("k1", "k2", "k3", "low_var_k3", "k3_unbiased")
IS_LEVELS = ("", "token", "seq", "geo")
IS_MODES = ("truncate", "mask")
LENGTH_PENALTIES = ("", "linear", "kimi")
DISTILL_TYPES = ("topk_kl", "forward_kl", "reverse_kl", "jsd")  # the GKD divergence of on-policy distillation
# Fields that also take a dotted path to a user's function (docs/EXTENDING.md; data.import_object loads it)
PLUGGABLE = ("advantage", "policy_loss", "kl_type", "distill_type")

EPS = 1e-6          # added to std in z-scores; zero-variance groups give 0 / (0 + EPS) = 0
LOG_RATIO_CLAMP = 20.0


def _choice_error(field: str, value, valid) -> ValueError:
    close = difflib.get_close_matches(str(value), [str(v) for v in valid], n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    shown = ", ".join(repr(v) for v in valid) + (", or a dotted path 'module.function'" if field in PLUGGABLE else "")
    return ValueError(f"algo.{field}={value!r} is not valid; choose one of: {shown}.{hint}")


def validate(cfg) -> None:
    """Reject unknown names and invalid combinations, naming the field, the value and the valid choices."""
    for field, valid in (("advantage", ADVANTAGES), ("adv_norm", ADV_NORMS), ("policy_loss", POLICY_LOSSES),
                         ("loss_agg", LOSS_AGGS), ("kl_type", KL_TYPES), ("is_correction", IS_LEVELS),
                         ("is_mode", IS_MODES), ("length_penalty", LENGTH_PENALTIES),
                         ("distill_type", DISTILL_TYPES)):
        value = getattr(cfg, field)
        if field in PLUGGABLE and data.is_dotted(value):
            data.import_object(value)  # a user's function: fail now, naming the path, if it does not load
        elif value not in valid:
            raise _choice_error(field, value, valid)

    def need(ok: bool, msg: str):
        if not ok:
            raise ValueError(msg)

    for field in ("clip_low", "clip_high", "kl_coef", "is_low", "m2po_threshold", "opsm_delta",
                  "overlong_buffer", "overlong_penalty", "length_penalty_coef", "pg_ratio"):
        need(getattr(cfg, field) >= 0, f"algo.{field}={getattr(cfg, field)!r} must be >= 0")
    need(cfg.dual_clip_c == 0 or cfg.dual_clip_c > 1,
         f"algo.dual_clip_c={cfg.dual_clip_c!r} must be 0 (off) or > 1 (the bound is -c * adv for adv < 0)")
    need(cfg.dual_clip_c == 0 or cfg.policy_loss == "ppo_clip",
         f"algo.dual_clip_c={cfg.dual_clip_c!r} applies to policy_loss='ppo_clip' only, "
         f"not {cfg.policy_loss!r}; set dual_clip_c=0")
    need(0 <= cfg.gamma <= 1, f"algo.gamma={cfg.gamma!r} must be in [0, 1]")
    need(0 <= cfg.lam <= 1, f"algo.lam={cfg.lam!r} must be in [0, 1]")
    need(cfg.is_low < cfg.is_high, f"algo.is_low={cfg.is_low!r} must be < algo.is_high={cfg.is_high!r}")
    need(0 < cfg.jsd_beta < 1, f"algo.jsd_beta={cfg.jsd_beta!r} must be in (0, 1) (the ends are forward_kl / "
         "reverse_kl: use distill_type for those)")
    need(0 <= cfg.gkd_ratio <= 1, f"algo.gkd_ratio={cfg.gkd_ratio!r} must be in [0, 1] "
         "(the weight of the GKD loss against the RL loss)")
    need(not (cfg.gkd_ratio == 1 and cfg.pg_ratio > 0),
         f"algo.gkd_ratio=1 is pure distillation: the RL loss (and with it pg_ratio={cfg.pg_ratio!r}) "
         "has weight 0; set pg_ratio=0 or gkd_ratio < 1")
    need(not (cfg.is_correction and cfg.use_rollout_logprobs),
         f"algo.is_correction={cfg.is_correction!r} with use_rollout_logprobs=True: old_logp is then the rollout "
         "logp and the correction is the identity; set is_correction='' or use_rollout_logprobs=False")
    need(cfg.policy_loss != "gspo" or cfg.loss_agg == "seq_mean_token_mean",
         f"algo.policy_loss='gspo' is a sequence-level objective (mean over sequences of a length-normalised "
         f"ratio); loss_agg={cfg.loss_agg!r} would re-weight sequences by length: set "
         "loss_agg='seq_mean_token_mean'")
    need(cfg.advantage != "reinforce_pp" or cfg.kl_coef == 0 or cfg.kl_in_reward,
         "algo.advantage='reinforce_pp' folds the KL into the reward; with kl_coef > 0 set kl_in_reward=True")
    need(not (cfg.kl_in_reward and cfg.kl_coef == 0),
         "algo.kl_in_reward=True with kl_coef=0 penalises nothing; set kl_coef > 0 or kl_in_reward=False")
    need(not (cfg.length_penalty and cfg.length_penalty_coef == 0),
         f"algo.length_penalty={cfg.length_penalty!r} needs length_penalty_coef > 0")
    n = cfg.samples_per_prompt
    if n < 2:
        need(not cfg.dynamic_sampling, f"algo.dynamic_sampling=True with samples_per_prompt={n}: every group "
             "of one has equal rewards and would be dropped; set samples_per_prompt >= 2")
        group_baseline = cfg.advantage in ("drgrpo", "rloo") or (
            cfg.advantage == "grpo" and cfg.adv_norm in ("group", "group_mean"))
        need(not group_baseline, f"algo.advantage={cfg.advantage!r} (adv_norm={cfg.adv_norm!r}) uses a group "
             f"baseline; with samples_per_prompt={n} every advantage is 0. Use samples_per_prompt >= 2 or "
             "advantage='grpo' with adv_norm='batch'")


# --------------------------------------------------------------------------------------------------------
# Aggregation (global denominators)
# --------------------------------------------------------------------------------------------------------

def global_denominators(tokens_per_seq, max_len: float) -> dict:
    """Counts of a whole mini-batch (all its micro-batches, all DP ranks), from the loss tokens of each of its
    sequences: tokens = loss tokens; seqs = sequences with at least one loss token (a row with none would shrink
    every other row's weight); max_len = the constant normaliser of seq_mean_token_sum (e.g. max_new_tokens)."""
    tokens = [float(n) for n in tokens_per_seq]
    return {"tokens": max(sum(tokens), 1.0), "seqs": max(float(sum(n > 0 for n in tokens)), 1.0),
            "max_len": float(max_len)}


def aggregate(x: torch.Tensor, loss_mask: torch.Tensor, agg: str, denom: dict) -> torch.Tensor:
    """Reduce a per-token quantity (B, T) to a scalar with global denominators.

      token_mean:          sum_{i,t} m_it x_it / N_tokens                       (DAPO token-level loss,
                                                                                arXiv 2503.14476 §3.3)
      seq_mean_token_mean: sum_i (sum_t m_it x_it / |o_i|) / N_seqs             (GRPO, arXiv 2402.03300 eq. 3)
      seq_mean_token_sum:  sum_i  sum_t m_it x_it / (L_max * N_seqs)            (Dr. GRPO, arXiv 2503.20783
                                                                                §3: a constant normaliser)
    N_tokens, N_seqs, L_max come from `denom` and count the whole mini-batch across micro-batches and DP
    ranks, so the sum of micro-batch results equals the full-batch result. |o_i| is local: a sequence is
    never split. Masked positions are replaced by 0 before the sum, so inf/nan there cannot leak."""
    mask = loss_mask > 0                                                  # (B, T) bool
    x = torch.where(mask, x, torch.zeros_like(x))                         # (B, T) 0 off the loss mask
    if agg == "token_mean":
        return x.sum() / denom["tokens"]
    elif agg == "seq_mean_token_mean":
        n_tok = mask.sum(-1).clamp(min=1)                                 # (B,) tokens per sequence
        return (x.sum(-1) / n_tok).sum() / denom["seqs"]
    elif agg == "seq_mean_token_sum":
        return x.sum() / (denom["max_len"] * denom["seqs"])
    raise _choice_error("loss_agg", agg, LOSS_AGGS)


# --------------------------------------------------------------------------------------------------------
# KL estimators
# --------------------------------------------------------------------------------------------------------

def kl_estimate(kind: str, logp: torch.Tensor, ref_logp: torch.Tensor, old_logp: torch.Tensor | None = None):
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi (Schulman, "Approximating KL
    Divergence", 2020; no arXiv). With d = log pi_ref(y) - log pi(y), all (B, T):
      k1 = -d                                   unbiased, high variance, can be negative
      k2 = d^2 / 2                              biased, low variance
      k3 = exp(d) - 1 - d                       unbiased, >= 0
      low_var_k3 = clamp(k3(clamp(d, -20, 20)), max=10)     k3 with its tail cut (a common stabiliser)
      k3_unbiased = (pi / pi_old) * k3          DeepSeek-V3.2 (arXiv 2512.02556, "unbiased KL estimate"):
                                                tokens come from pi_old, the ratio corrects for it.
    Gradients flow through logp (and the ratio for k3_unbiased). Use the same function with
    (logp=sampler, ref_logp=target) for KL(sampler || target), as `gap_metrics` does."""
    d = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)       # (B, T) log pi_ref/pi
    if kind == "k1":
        return -d
    elif kind == "k2":
        return 0.5 * d * d
    elif kind == "k3":
        return torch.exp(d) - 1 - d
    elif kind == "low_var_k3":
        return kl_estimate("k3", logp, ref_logp).clamp(max=10.0)
    elif kind == "k3_unbiased":
        if old_logp is None:
            raise ValueError("kl_type='k3_unbiased' needs old_logp (the sampling policy)")
        ratio = torch.exp((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # (B, T) pi/pi_old
        return ratio * kl_estimate("k3", logp, ref_logp)
    elif data.is_dotted(kind):  # EXT: a user's estimator fn(logp, ref_logp) -> (B, T)
        return data.import_object(kind)(logp, ref_logp)
    raise _choice_error("kl_type", kind, KL_TYPES)


# --------------------------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------------------------

def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary group ids (N,) to 0..G-1 (N,), plus G."""
    if group_ids.numel() == 0:
        return group_ids.long(), 0
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    return inv, uniq.numel()


def _group_sum(x: torch.Tensor, inv: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Sum of x (N,) over each element's group, broadcast back to (N,)."""
    return torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add_(0, inv, x)[inv]


def normalize(x: torch.Tensor, group_ids: torch.Tensor, mode: str, dp_group=None) -> torch.Tensor:
    """Baseline and scale for values x (N,) that each belong to a group (N,).

      group:      (x - mean_g) / (std_g + eps)    GRPO outcome supervision (arXiv 2402.03300 §4.1.2)
      group_mean:  x - mean_g                     Dr. GRPO (arXiv 2503.20783 §3, no std division)
      batch:      (x - mean) / (std + eps)        over the whole batch, all-reduced across dp_group
      none:        x
    std is the unbiased (n-1) estimate, defined as 0 for n == 1, so a group of one or of equal values
    gives exactly 0 and never NaN. For batch mode every DP rank must call this (even with N == 0): it
    takes part in two all-reduces."""
    if mode == "none":
        return x
    elif mode == "batch":
        distributed = dp_group is not None and dist.get_world_size(dp_group) > 1
        s = torch.stack([x.sum(), torch.tensor(float(x.numel()), dtype=x.dtype, device=x.device)])  # (2,)
        if distributed:
            dist.all_reduce(s, group=dp_group)
        mean = s[0] / s[1].clamp(min=1)
        sq = ((x - mean) ** 2).sum().reshape(1)                           # (1,) two-pass variance
        if distributed:
            dist.all_reduce(sq, group=dp_group)
        std = (sq[0] / (s[1] - 1).clamp(min=1)).sqrt()
        return (x - mean) / (std + EPS)
    elif mode in ("group", "group_mean"):
        inv, num_groups = _group_index(group_ids)
        if num_groups == 0:
            return x
        ones = torch.ones_like(x)
        count = _group_sum(ones, inv, num_groups)                        # (N,) size of my group
        centered = x - _group_sum(x, inv, num_groups) / count            # (N,) x - group mean
        if mode == "group_mean":
            return centered
        var = _group_sum(centered ** 2, inv, num_groups) / (count - 1).clamp(min=1)  # (N,)
        return centered / (var.sqrt() + EPS)
    raise _choice_error("adv_norm", mode, ADV_NORMS)


def rloo_advantage(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO: A_i = r_i - (1/(n-1)) sum_{j != i} r_j  over the n samples of i's group (Kool et al. 2019; Ahmadian et al.,
    arXiv 2402.14740, the RLOO estimator). A group of one has no baseline; its advantage is 0."""
    inv, num_groups = _group_index(group_ids)
    if num_groups == 0:
        return rewards
    count = _group_sum(torch.ones_like(rewards), inv, num_groups)        # (N,)
    baseline = (_group_sum(rewards, inv, num_groups) - rewards) / (count - 1).clamp(min=1)  # (N,)
    return torch.where(count > 1, rewards - baseline, torch.zeros_like(rewards))


def gae(token_rewards: torch.Tensor, values: torch.Tensor, loss_mask: torch.Tensor, gamma: float, lam: float):
    """Generalised advantage estimation over the model's tokens (Schulman et al., arXiv 1506.02438 eq. 16):
      delta_t = r_t + gamma * V_{t'} - V_t,    A_t = delta_t + gamma * lam * A_{t'}
    where t' is the NEXT model token (V and A are 0 after the last one). Departure: tool and padding
    tokens (loss_mask 0) are not steps; a reward sitting on one is credited to the model token before it,
    undiscounted. With values = 0 and lam = 1 this is the discounted return-to-go
      G_t = r_t + gamma * G_{t'},
    which `returns` and `reinforce_pp` use. Returns A (B, T), 0 off the mask; the critic target is A + V.
    A plain loop over T, kept for readability: it costs a few kernel launches per response position."""
    B, T = token_rewards.shape
    mask = loss_mask > 0                                                  # (B, T)
    r = token_rewards                                                     # (B, T) rewards, also on tool tokens
    v = torch.where(mask, values, torch.zeros_like(values))              # (B, T) 0 off the mask
    adv = torch.zeros_like(r)                                             # (B, T)
    next_value = r.new_zeros(B)                                           # (B,) V of the next model token
    next_adv = r.new_zeros(B)                                             # (B,) A of the next model token
    pending = r.new_zeros(B)                                              # (B,) rewards on later tool tokens
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = r[:, t] + pending + gamma * next_value - v[:, t]         # (B,)
        a = delta + gamma * lam * next_adv                                # (B,)
        adv[:, t] = torch.where(m, a, torch.zeros_like(a))
        next_adv = torch.where(m, a, next_adv)
        next_value = torch.where(m, v[:, t], next_value)
        pending = torch.where(m, torch.zeros_like(pending), pending + r[:, t])
    return adv


def outcome_to_tokens(rewards: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's scalar reward (B,) on its last model token -> (B, T); rows without one get 0."""
    mask = (loss_mask > 0).long()                                         # (B, T)
    T = mask.shape[1]
    last = (mask * torch.arange(1, T + 1, device=mask.device)).argmax(-1)  # (B,) index of the last 1
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    out[torch.arange(mask.shape[0], device=mask.device), last] = rewards.float().to(mask.device)
    return out * mask


def turn_rewards_to_tokens(turn_rewards: list[list[float]], loss_mask: torch.Tensor) -> torch.Tensor:
    """Per-turn rewards -> token rewards (B, T). A model turn is a maximal run of loss_mask == 1; the k-th
    reward of row i goes on the last token of row i's k-th turn. Fewer rewards than turns is fine (later
    turns get 0); more is an error."""
    mask = (loss_mask > 0)
    out = torch.zeros(mask.shape, dtype=torch.float32)
    for i, rewards in enumerate(turn_rewards):
        row = mask[i].tolist()
        ends = [t for t in range(len(row)) if row[t] and (t + 1 == len(row) or not row[t + 1])]
        if len(rewards) > len(ends):
            raise ValueError(f"row {i}: {len(rewards)} turn rewards but only {len(ends)} model turns")
        for t, rwd in zip(ends, rewards):
            out[i, t] = rwd
    return out.to(loss_mask.device)


def compute_advantages(cfg, rewards, group_ids, loss_mask, *, old_logp=None, ref_logp=None, values=None,
                       token_rewards=None, dp_group=None, raw: bool = False) -> torch.Tensor:
    """Advantages (B, T), 0 where loss_mask == 0. The one dispatch over `cfg.advantage`:
      grpo          scalar reward, normalised by cfg.adv_norm (group z-score by default)
      drgrpo        scalar reward minus the group mean (adv_norm is fixed to group_mean)
      rloo          scalar reward minus the leave-one-out group mean (no scaling)
      reinforce_pp  REINFORCE++ (arXiv 2501.03262): token reward = outcome on the last token minus
                    kl_coef * KL_t, discounted return-to-go, then batch z-score across DP (adv_norm fixed)
      returns       token rewards (per token or per turn, else the outcome on the last token), discounted
                    return-to-go with gamma, normalised by cfg.adv_norm over tokens
      gae           GAE(gamma, lam) from `values` (B, T) of a critic, normalised by cfg.adv_norm over tokens

    rewards (B,), group_ids (B,) long, loss_mask (B, T). With kl_in_reward, KL_t = kl_estimate(kl_type,
    old_logp, ref_logp) (the unbiased variant reduces to k3 here: the current policy is the old one): the
    sequence estimators subtract kl_coef * sum_t KL_t from the scalar reward, the token estimators
    kl_coef * KL_t from each token's reward. Token-level normalisation treats each model token as one
    value of its sequence's group. raw=True returns the token estimators' advantages before that normalisation
    (the critic's target `gae_returns` needs the raw GAE)."""
    mask = (loss_mask > 0)                                                # (B, T)
    maskf = mask.float()
    rewards = rewards.float().to(maskf.device)                            # (B,)
    group_ids = group_ids.to(maskf.device)                                # (B,)
    name = cfg.advantage
    if data.is_dotted(name):  # EXT: a user's estimator, same arguments as this function -> (B, T)
        adv = data.import_object(name)(cfg, rewards, group_ids, loss_mask, old_logp=old_logp, ref_logp=ref_logp,
                                       values=values, token_rewards=token_rewards, dp_group=dp_group)
        return adv.float() * maskf                                        # (B, T) 0 where loss_mask == 0
    kl = None                                                             # (B, T) per-token KL penalty
    if cfg.kl_in_reward and cfg.kl_coef > 0 and mask.numel() > 0:      # (a DP rank may hold no samples)
        if old_logp is None or ref_logp is None:
            raise ValueError("kl_in_reward=True needs old_logp and ref_logp in compute_advantages")
        kind = "k3" if cfg.kl_type == "k3_unbiased" else cfg.kl_type
        kl = torch.where(mask, kl_estimate(kind, old_logp.float(), ref_logp.float()), torch.zeros_like(maskf))

    if name in ("grpo", "drgrpo", "rloo"):
        if token_rewards is not None:
            raise ValueError(f"advantage={name!r} uses the scalar reward only; token_rewards were given. Use "
                             "advantage='returns' (or 'gae') for per-token or per-turn rewards")
        r = rewards if kl is None else rewards - cfg.kl_coef * kl.sum(-1)  # (B,)
        if name == "grpo":
            seq_adv = normalize(r, group_ids, cfg.adv_norm, dp_group)
        elif name == "drgrpo":
            seq_adv = normalize(r, group_ids, "group_mean")
        else:
            seq_adv = rloo_advantage(r, group_ids)
        return seq_adv[:, None] * maskf                                   # (B, T) broadcast over tokens

    tok_r = outcome_to_tokens(rewards, mask) if token_rewards is None else token_rewards.float()  # (B, T)
    if kl is not None:
        tok_r = tok_r - cfg.kl_coef * kl
    if name == "gae":
        if values is None:
            raise ValueError("advantage='gae' needs values (B, T) from a critic")
        adv, norm = gae(tok_r, values.float(), mask, cfg.gamma, cfg.lam), cfg.adv_norm
    elif name in ("returns", "reinforce_pp"):  # the discounted return-to-go: GAE with V = 0 and lam = 1
        adv = gae(tok_r, torch.zeros_like(tok_r), mask, cfg.gamma, 1.0)
        norm = cfg.adv_norm if name == "returns" else "batch"
    else:
        raise _choice_error("advantage", name, ADVANTAGES)
    if raw:
        return torch.where(mask, adv, torch.zeros_like(adv))              # (B, T) 0 off the mask
    tok_groups = group_ids[:, None].expand_as(mask)[mask]                 # (N_tok,) group of each token
    out = torch.zeros_like(adv)
    out[mask] = normalize(adv[mask], tok_groups, norm, dp_group)          # (B, T) 0 off the mask
    return out


def gae_returns(cfg, rewards, group_ids, loss_mask, values, *, old_logp=None, ref_logp=None, token_rewards=None):
    """The critic's regression target, the lambda-return (Schulman et al., arXiv 1506.02438 §5), per token (B, T):
      R_t = A_t + V_t        A_t = GAE(gamma, lam) from the same rewards as `compute_advantages` (shaping,
                             per-turn rewards, KL in the reward), before any adv_norm
    0 off the mask. With lam = 1 it is the discounted return-to-go G_t whatever V is; with lam < 1 it leans on V.
    values (B, T): V(s_t) of the critic that rolled out the GAE, i.e. V_old of `value_loss`."""
    adv = compute_advantages(cfg, rewards, group_ids, loss_mask, old_logp=old_logp, ref_logp=ref_logp,
                             values=values, token_rewards=token_rewards, raw=True)  # (B, T) raw GAE
    return torch.where(loss_mask > 0, adv + values.float(), torch.zeros_like(adv))  # (B, T)


def value_loss(values, old_values, returns, loss_mask, value_clip: float, denom):
    """PPO's clipped value loss ("value function clipping" of the PPO reference code, studied by Engstrom et al.,
    arXiv 2005.12729 §3), per token, then a token mean with the GLOBAL token count:
      V_clip = V_old + clip(V - V_old, -value_clip, value_clip)
      L_t    = 1/2 * max((V - R)^2, (V_clip - R)^2)
      loss   = sum_{i,t} m_it L_it / N_tokens
    values (B, T) the critic's V(s_t) now (with grad); old_values (B, T) V_old, the critic's values when the batch's
    advantages were computed; returns (B, T) R_t from `gae_returns`. value_clip = 0 turns the clip off (plain
    squared error). Masked positions (loss_mask 0: tool tokens, padding) are 0 before the sum.
    Returns (loss, {"value_loss", "clipfrac"}); clipfrac = token mean of "the clipped branch is larger",
    both already divided by the global denominators (the trainer sums micro-batches)."""
    mask = loss_mask > 0                                                  # (B, T) model tokens
    zero = torch.zeros((), device=values.device)
    v = torch.where(mask, values.float(), zero)                           # (B, T)
    v_old = torch.where(mask, old_values.float(), zero)                   # (B, T)
    ret = torch.where(mask, returns.float(), zero)                        # (B, T)
    unclipped = (v - ret) ** 2                                            # (B, T)
    if value_clip > 0:                                                    # ALGO: value clipping
        v_clip = v_old + (v - v_old).clamp(-value_clip, value_clip)       # (B, T)
        clipped = (v_clip - ret) ** 2                                     # (B, T)
    else:
        clipped = unclipped
    loss = aggregate(0.5 * torch.maximum(unclipped, clipped), mask, "token_mean", denom)
    clipfrac = aggregate((clipped > unclipped).float(), mask, "token_mean", denom)
    return loss, {"value_loss": loss.detach(), "clipfrac": clipfrac.detach()}


def explained_variance(values, returns, loss_mask, dp_group=None) -> float:
    """How much of the returns' variance the critic explains, over the loss tokens of every DP rank:
      ev = 1 - Var(R - V) / Var(R)        (population variances; 1 = perfect, 0 = no better than the mean,
                                           < 0 worse). Var(R) = 0 (all returns equal) gives 0.
    Every DP rank must call it (one all-reduce), even with no tokens."""
    mask = loss_mask > 0                                                  # (B, T)
    r = returns.double()[mask]                                            # (N,)
    d = r - values.double()[mask]                                         # (N,) residual R - V
    s = torch.stack([r.new_tensor(float(r.numel())), r.sum(), (r * r).sum(), d.sum(), (d * d).sum()])  # (5,)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(s, group=dp_group)
    n = max(float(s[0]), 1.0)
    var_r = float(s[2]) / n - (float(s[1]) / n) ** 2
    var_d = float(s[4]) / n - (float(s[3]) / n) ** 2
    return 1.0 - var_d / var_r if var_r > 1e-12 else 0.0


# --------------------------------------------------------------------------------------------------------
# Policy losses (per token, before aggregation)
# --------------------------------------------------------------------------------------------------------

def _log_ratio(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log(a/b) on the mask, clamped to +-20; 0 elsewhere (so garbage off the mask never reaches exp)."""
    return torch.where(mask, (a - b).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), torch.zeros_like(a))


def ppo_clip_loss(ratio, adv, clip_low: float, clip_high: float, dual_clip_c: float = 0.0):
    """PPO clipped surrogate as a loss (Schulman et al., arXiv 1707.06347 eq. 7), per token (B, T):
      L = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
    clip_low != clip_high is DAPO's clip-higher (arXiv 2503.14476 §3.1). Dual clip (Ye et al.,
    arXiv 1912.09729, "dual-clip PPO") bounds the loss of negative advantages: L = min(L, -c A) for A < 0.
    Returns (loss, clipped, dual_clipped); `clipped` marks tokens where the clipped branch won."""
    unclipped = -adv * ratio                                              # (B, T)
    clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)             # (B, T)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    dual = torch.zeros_like(was_clipped)
    if dual_clip_c > 0:
        bound = -adv * dual_clip_c                                        # (B, T) only meaningful for A < 0
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
    return loss, was_clipped, dual


def gspo_seq_ratio(logp, old_logp, mask):
    """GSPO sequence ratio in its token form (Zheng et al., arXiv 2507.18071: s_i(theta) and GSPO-token):
      s_i = exp( (1/|y_i|) sum_t log(pi(y_it) / pi_old(y_it)) )
      s_it = sg(s_i) * pi(y_it) / sg(pi(y_it))
    s_it equals s_i in value; its gradient is s_i * grad log pi(y_it), so the mean over a sequence's
    tokens of s_it * A_i has exactly the gradient of s_i * A_i. Returns s_it (B, T)."""
    n_tok = mask.sum(-1, keepdim=True).clamp(min=1)                       # (B, 1)
    seq_log = _log_ratio(logp, old_logp, mask).sum(-1, keepdim=True) / n_tok  # (B, 1) log s_i
    tok = torch.where(mask, logp - logp.detach(), torch.zeros_like(logp))  # (B, T) 0 in value, grad of logp
    return torch.exp(seq_log.detach() + tok)                              # (B, T)


def cispo_loss(ratio, adv, logp, clip_low: float, clip_high: float):
    """CISPO (MiniMax-M1, arXiv 2506.13585 eqs. 4-5), per token (B, T):
      L = -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * log pi(y_t)
    The IS weight is clipped and detached, so every token keeps a gradient (no token is zeroed as in PPO).
    The paper sets eps_low large (no lower bound): clip_low >= 1 does that here.
    Returns (loss, clipped) where clipped marks tokens whose weight hit a bound."""
    weight = ratio.clamp(1 - clip_low, 1 + clip_high).detach()           # (B, T)
    return -weight * adv * logp, (ratio < 1 - clip_low) | (ratio > 1 + clip_high)


def reinforce_loss(adv, logp):
    """REINFORCE (Williams 1992): L = -A * log pi(y_t), per token (B, T). No ratio: on-policy only."""
    return -adv * logp


def nll_loss(logp):
    """Cross-entropy of the target tokens: L = -log pi(y_t), per token (B, T)."""
    return -logp


def _pg_token_loss(cfg, logp, old_logp, adv, mask):
    """The one dispatch over `cfg.policy_loss`: per-token loss (B, T) and clip indicators."""
    name = cfg.policy_loss
    none = torch.zeros_like(mask)
    if name == "ppo_clip":
        ratio = torch.exp(_log_ratio(logp, old_logp, mask))               # (B, T) pi / pi_old
        return ppo_clip_loss(ratio, adv, cfg.clip_low, cfg.clip_high, cfg.dual_clip_c)
    elif name == "gspo":
        loss, clipped, _ = ppo_clip_loss(gspo_seq_ratio(logp, old_logp, mask), adv, cfg.clip_low, cfg.clip_high)
        return loss, clipped, none
    elif name == "cispo":
        ratio = torch.exp(_log_ratio(logp, old_logp, mask))               # (B, T)
        loss, clipped = cispo_loss(ratio, adv, logp, cfg.clip_low, cfg.clip_high)
        return loss, clipped, none
    elif name == "reinforce":
        return reinforce_loss(adv, logp), none, none
    elif name == "sft":
        return nll_loss(logp), none, none
    elif data.is_dotted(name):  # EXT: a user's loss fn(cfg, logp, old_logp, adv, mask) -> (B, T); no clip counts
        return data.import_object(name)(cfg, logp, old_logp, adv, mask), none, none
    raise _choice_error("policy_loss", name, POLICY_LOSSES)


# --------------------------------------------------------------------------------------------------------
# Off-policy and train-inference corrections: per-token weights and masks
# --------------------------------------------------------------------------------------------------------

def is_weight(level: str, old_logp, rollout_logp, mask, low: float, high: float, mode: str):
    """Importance weight correcting the gap between the trainer's old policy and the rollout engine:
      token: w_t = pi_old(y_t) / pi_rollout(y_t)
      seq:   w_i = prod_t pi_old(y_t) / pi_rollout(y_t)                 (same w_i on every token of i)
      geo:   w_i = (prod_t pi_old / pi_rollout)^(1/|y_i|)                (geometric mean of the token ratios)
    truncate: w <- clamp(w, low, high)     (truncated IS, "Your efficient RL framework secretly brings you
                                            off-policy RL training", Yao et al. 2025, no arXiv)
    mask:     w <- w if low <= w <= high else 0, and the token is dropped  (masked IS, same source)
    Departure: truncation clamps from below too (low = 0 disables it). Returns (weight (B, T) detached,
    dropped (B, T) bool)."""
    delta = _log_ratio(old_logp, rollout_logp, mask)                      # (B, T) log pi_old/pi_rollout
    if level == "token":
        log_w = delta
    elif level == "seq":
        log_w = delta.sum(-1, keepdim=True).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).expand_as(delta)
    elif level == "geo":
        log_w = (delta.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)).expand_as(delta)
    else:
        raise _choice_error("is_correction", level, IS_LEVELS)
    w = torch.exp(log_w).detach()                                         # (B, T)
    if mode == "truncate":
        return w.clamp(low, high), torch.zeros_like(mask)
    elif mode == "mask":
        outside = (w < low) | (w > high)                                  # (B, T)
        return torch.where(outside, torch.zeros_like(w), w), mask & outside
    raise _choice_error("is_mode", mode, IS_MODES)


def m2po_drop(log_ratio, mask, threshold: float):
    """M2PO (arXiv 2510.01161, second-moment constraint): drop the tokens with the largest squared
    log-ratio, one by one, until
      M2 = mean over kept tokens of (log pi / pi_behav)^2 <= threshold.
    Greedy in one pass: sort the squared log-ratios descending, the mean after dropping the k largest is
    (S - cumsum_k) / (N - k); take the smallest such k. Departure: M2 is taken over the tokens of this
    call (one micro-batch on one rank), not over the whole mini-batch; since every micro-batch ends at
    M2 <= threshold, so does their union, at the price of dropping somewhat more tokens. Returns the
    dropped tokens (B, T) bool."""
    sq = (log_ratio.detach() ** 2)[mask]                                  # (N,) squared log-ratios
    n = sq.numel()
    dropped = torch.zeros_like(mask)
    if n == 0:
        return dropped
    order = torch.argsort(sq, descending=True)                            # (N,)
    removed = torch.cat([sq.new_zeros(1), torch.cumsum(sq[order], 0)])   # (N+1,) sum of the k largest
    kept_n = (n - torch.arange(n + 1, device=sq.device)).clamp(min=1)     # (N+1,)
    m2 = (sq.sum() - removed).clamp(min=0) / kept_n                       # (N+1,) M2 after dropping k
    k = int(torch.nonzero(m2 <= threshold)[0].item())                     # dropping all N gives M2 = 0
    flat = torch.zeros(n, dtype=torch.bool, device=sq.device)
    flat[order[:k]] = True
    dropped[mask] = flat
    return dropped


def opsm_drop(logp, behav_logp, adv, mask, delta: float):
    """Off-policy sequence masking (DeepSeek-V3.2, arXiv 2512.02556, "off-policy sequence masking"): drop
    sequence i when
      A_i < 0  and  (1/|y_i|) sum_t log(pi_behav(y_t) / pi(y_t)) > delta
    i.e. negative samples the current policy has drifted away from (their gradient is mostly noise).
    Departure: the test A < 0 is per token, which is the same for sequence-level advantages.
    Returns dropped (B, T) bool."""
    n_tok = mask.sum(-1).clamp(min=1)                                     # (B,)
    seq_kl = _log_ratio(behav_logp, logp.detach(), mask).sum(-1) / n_tok  # (B,)
    return mask & (adv < 0) & (seq_kl[:, None] > delta)


# --------------------------------------------------------------------------------------------------------
# The loss the trainer calls
# --------------------------------------------------------------------------------------------------------

def policy_loss(cfg, logp, old_logp, adv, loss_mask, *, rollout_logp=None, ref_logp=None, entropy=None,
                stale_mask=None, denom):
    """Loss of one micro-batch, divided by the mini-batch's global `denom`; returns (loss, metrics).
      loss = agg(w * keep * L_pg) + kl_coef * agg(KL(pi || pi_ref)) - entropy_coef * agg(H)
    L_pg per token from `_pg_token_loss`; w the train-inference IS weight (is_correction, else 1); keep
    drops tokens by IS masking, M2PO, OPSM and stale-token masking. Dropped tokens still count in the
    denominators (global counts are fixed before the micro-batches run). The KL term is left out when
    kl_in_reward (it is in the advantages then). Corrections apply to L_pg only, not to KL or entropy.

    All tensors (B, T); loss_mask 1 on model tokens only (off it, values are ignored). rollout_logp: the
    engine's logprobs (needed by is_correction; else optional, used for monitoring and as the behaviour
    policy of M2PO/OPSM). stale_mask: 1 on tokens generated under older weights (None: none are).
    Metrics are scalar tensors already divided by the global denominators (so the trainer sums them): pg_loss,
    kl, entropy with cfg.loss_agg; every fraction (clip_frac, dual_clip_frac, mask_frac, is_mask_frac, m2po_frac,
    opsm_frac, stale_frac), is_weight_mean and the trainer-vs-rollout gap (rollout_k3, rollout_abs_diff) as token
    means."""
    mask = loss_mask > 0                                                  # (B, T) model tokens

    def clean(x):  # 0 off the mask BEFORE any math, so inf/nan there cannot reach a value or a gradient
        return None if x is None else torch.where(mask, x.float(), torch.zeros((), device=x.device))

    logp, old_logp, adv = clean(logp), clean(old_logp), clean(adv)        # (B, T) each
    rollout_logp, ref_logp, entropy = clean(rollout_logp), clean(ref_logp), clean(entropy)

    def tok_mean(x):
        return aggregate(x.float(), mask, "token_mean", denom).detach()

    def agg(x):
        return aggregate(x, mask, cfg.loss_agg, denom)

    metrics = {}
    behav_logp = old_logp if rollout_logp is None else rollout_logp       # (B, T) the sampling policy
    weight = torch.ones_like(logp)                                        # (B, T) IS weight
    dropped = torch.zeros_like(mask)                                      # (B, T) tokens left out of L_pg
    if cfg.is_correction:                                                 # ALGO: train-inference correction
        if rollout_logp is None:
            raise ValueError(f"is_correction={cfg.is_correction!r} needs rollout_logp")
        weight, is_dropped = is_weight(cfg.is_correction, old_logp, behav_logp, mask, cfg.is_low,
                                       cfg.is_high, cfg.is_mode)
        metrics["is_weight_mean"] = tok_mean(weight)
        metrics["is_mask_frac"] = tok_mean(is_dropped)
        dropped |= is_dropped
    if cfg.m2po_threshold > 0:                                            # ALGO: M2PO second-moment mask
        m2_dropped = m2po_drop(_log_ratio(logp, behav_logp, mask), mask, cfg.m2po_threshold)
        metrics["m2po_frac"] = tok_mean(m2_dropped)
        dropped |= m2_dropped
    if cfg.opsm_delta > 0:                                                # ALGO: off-policy sequence masking
        op_dropped = opsm_drop(logp, behav_logp, adv, mask, cfg.opsm_delta)
        metrics["opsm_frac"] = tok_mean(op_dropped)
        dropped |= op_dropped
    if cfg.mask_stale_tokens and stale_mask is not None:                  # ALGO: partial-rollout stale tokens
        stale = mask & (stale_mask > 0)
        metrics["stale_frac"] = tok_mean(stale)
        dropped |= stale
    metrics["mask_frac"] = tok_mean(dropped)

    pg_tok, clipped, dual = _pg_token_loss(cfg, logp, old_logp, adv, mask)  # (B, T)
    pg_tok = torch.where(dropped, torch.zeros_like(pg_tok), pg_tok * weight)
    pg_loss = agg(pg_tok)
    loss = pg_loss
    metrics["pg_loss"] = pg_loss.detach()
    if cfg.policy_loss in ("ppo_clip", "gspo", "cispo"):
        metrics["clip_frac"] = tok_mean(clipped & mask)
    if cfg.dual_clip_c > 0:
        metrics["dual_clip_frac"] = tok_mean(dual & mask)

    if ref_logp is not None:
        kl = agg(kl_estimate(cfg.kl_type, logp, ref_logp, old_logp))
        metrics["kl"] = kl.detach()
        if cfg.kl_coef > 0 and not cfg.kl_in_reward:                      # ALGO: KL-to-reference loss term
            loss = loss + cfg.kl_coef * kl
    elif cfg.kl_coef > 0 and not cfg.kl_in_reward:
        raise ValueError("kl_coef > 0 (KL as a loss term) needs ref_logp")
    if entropy is not None:
        ent = agg(entropy)
        metrics["entropy"] = ent.detach()
        if cfg.entropy_coef != 0:                                         # ALGO: entropy bonus
            loss = loss - cfg.entropy_coef * ent
    elif cfg.entropy_coef != 0:
        raise ValueError("entropy_coef != 0 needs the per-token entropy")
    if rollout_logp is not None:
        metrics["rollout_k3"] = tok_mean(kl_estimate("k3", behav_logp, old_logp))
        metrics["rollout_abs_diff"] = tok_mean(_log_ratio(old_logp, behav_logp, mask).abs())
    return loss, metrics


def sft_loss(logp, loss_mask, denom) -> torch.Tensor:
    """Supervised fine-tuning: token-mean negative log-likelihood, sum_{i,t} m_it (-log p_it) / N_tokens,
    with the global token count so micro-batches add up."""
    return aggregate(nll_loss(logp.float()), loss_mask, "token_mean", denom)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c pass (Chen et al. 2021, arXiv 2107.03374, eq. 1):
      pass@k = 1 - C(n - c, k) / C(n, k)      (the chance that k of the n samples, drawn without
                                               replacement, include at least one that passes)
    computed as 1 - prod_{i=n-c+1}^{n} (1 - k / i) for numerical stability (the paper's form). k <= n."""
    if not 0 < k <= n:
        raise ValueError(f"pass@k needs 0 < k <= n samples, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def gap_metrics(train_logp, rollout_logp, loss_mask) -> dict:
    """Train-inference mismatch of one batch, as python floats, over the loss tokens:
      k3 = mean_t k3 estimate of KL(pi_rollout || pi_train) (tokens were sampled by the engine),
      abs_diff = mean_t |log pi_train - log pi_rollout|,  max_abs_diff = max_t of the same.
    An empty mask gives zeros."""
    mask = loss_mask > 0
    if not mask.any():
        return {"k3": 0.0, "abs_diff": 0.0, "max_abs_diff": 0.0}
    train_logp, rollout_logp = train_logp.float(), rollout_logp.float()
    diff = _log_ratio(train_logp, rollout_logp, mask).abs()[mask]        # (N,)
    k3 = kl_estimate("k3", rollout_logp, train_logp)[mask]                # (N,)
    return {"k3": k3.mean().item(), "abs_diff": diff.mean().item(), "max_abs_diff": diff.max().item()}


# --------------------------------------------------------------------------------------------------------
# Reward shaping (called by the trainer) and group filters
# --------------------------------------------------------------------------------------------------------

def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO soft overlong punishment (arXiv 2503.14476 §3.4), per sequence (B,):
      0                                       if |y| <= L_max - L_cache
      ((L_max - L_cache) - |y|) / L_cache * p  if L_max - L_cache < |y| <= L_max
      -p                                       if |y| > L_max
    with L_cache = buffer and p = penalty (the paper uses p = 1). buffer = 0 turns it off."""
    lengths = lengths.float()
    if buffer <= 0:
        return torch.zeros_like(lengths)
    start = max_len - buffer
    ramp = (start - lengths) / buffer * penalty                           # (B,)
    return torch.where(lengths <= start, torch.zeros_like(lengths),
                       torch.where(lengths <= max_len, ramp, torch.full_like(lengths, -penalty)))


def linear_length_penalty(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """Linear length cost: -|y| / L_max per sequence (B,); scaled by length_penalty_coef by the caller."""
    return -lengths.float() / max_len


def kimi_length_reward(rewards: torch.Tensor, lengths: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Group-relative length reward (Kimi k1.5, arXiv 2501.12599, "length penalty"), per sequence (B,):
      lambda_i = 0.5 - (len_i - min_len) / (max_len - min_len)     min/max over i's group
      correct:   lambda_i;    incorrect:  min(0, lambda_i)
    Departure: "correct" means reward > 0. A group with one length gives 0."""
    lengths = lengths.float()
    inv, num_groups = _group_index(group_ids.to(lengths.device))
    if num_groups == 0:
        return lengths
    empty = lengths.new_zeros(num_groups)                                 # (G,) scatter target
    lo = empty.scatter_reduce(0, inv, lengths, "amin", include_self=False)[inv]  # (B,) shortest in my group
    hi = empty.scatter_reduce(0, inv, lengths, "amax", include_self=False)[inv]  # (B,) longest in my group
    lam = torch.where(hi > lo, 0.5 - (lengths - lo) / (hi - lo).clamp(min=1e-9), torch.zeros_like(lengths))
    return torch.where(rewards > 0, lam, lam.clamp(max=0))


def shape_rewards(cfg, rewards: torch.Tensor, lengths: torch.Tensor, group_ids: torch.Tensor, max_len: int):
    """Reward (B,) after length shaping: + DAPO overlong penalty (overlong_buffer > 0) + length_penalty_coef *
    the chosen length penalty. lengths (B,) = model-generated tokens per sample; max_len = the generation
    budget. Dynamic sampling (loongsage.Producer) decides on the raw reward, before this shaping."""
    rewards = rewards.float()
    out = rewards + overlong_penalty(lengths, max_len, cfg.overlong_buffer, cfg.overlong_penalty)
    name, coef = cfg.length_penalty, cfg.length_penalty_coef
    if name == "linear":
        out = out + coef * linear_length_penalty(lengths, max_len)
    elif name == "kimi":
        out = out + coef * kimi_length_reward(rewards, lengths, group_ids)
    elif name != "":
        raise _choice_error("length_penalty", name, LENGTH_PENALTIES)
    return out


# --------------------------------------------------------------------------------------------------------
# On-policy distillation (Teacher Manager, teacher.py)
#
#   L = (1 - gkd_ratio) * L_RL(A')  +  gkd_ratio * L_GKD,     A'_t = A_t - pg_ratio * sg(KL_t)
#
# KL_t is the sampled reverse KL (`sampled_reverse_kl`), L_GKD one of `distill_loss`'s divergences.
# gkd_ratio = 1 is pure distillation (no reward, no old-logprob forward); gkd_ratio = 0 with pg_ratio > 0
# is PG-style on-policy distillation (the teacher's logprob is a dense per-token reward).
# --------------------------------------------------------------------------------------------------------

def sampled_reverse_kl(logp, teacher_logp):
    """Reverse KL on the sampled token: log pi_student(y_t) - log pi_teacher(y_t), per token (B, T) — the
    single-sample (k1) estimate of KL(student || teacher) at y_t ~ student (on-policy distillation;
    GKD, arXiv 2306.13649; MiniLLM, arXiv 2306.08543)."""
    return logp - teacher_logp


def distill_advantage(cfg, adv, logp, teacher_logp, loss_mask):
    """Use the sampled reverse KL as a per-token advantage penalty:
      A'_t = A_t - pg_ratio * (log pi_student(y_t) - log pi_teacher(y_t))    (B, T), 0 off the mask
    Detached: the policy gradient does the rest (minimising it is minimising the reverse KL)."""
    mask = loss_mask > 0
    penalty = torch.where(mask, sampled_reverse_kl(logp.float(), teacher_logp.float()), torch.zeros_like(adv))
    return torch.where(mask, adv - cfg.pg_ratio * penalty.detach(), torch.zeros_like(adv))


def opd_objective(cfg, rl_loss, gkd_loss):
    """L = (1 - gkd_ratio) * L_RL + gkd_ratio * L_GKD (both already divided by the global denominators)."""
    g = cfg.gkd_ratio
    return (1 - g) * rl_loss + g * gkd_loss


def mixture_logp(logps, weights):
    """Log-probabilities of a weighted mixture of teachers (an ensemble target):
      log q(v) = log sum_j w_j p_j(v)
    logps (J, ..., V) log-probabilities of J teachers; weights (J, ...) per token, summing to 1 over J
    (a weight 0 drops teacher j there). Returns (..., V)."""
    w = weights.float().unsqueeze(-1)                                     # (J, ..., 1)
    logw = torch.where(w > 0, w.clamp(min=1e-30).log(), torch.full_like(w, -math.inf))  # (J, ..., 1)
    return torch.logsumexp(logps.float() + logw, 0)                       # (..., V)


def categorical_kl(p_logp, q_logp):
    """KL(p || q) = sum_v p_v (log p_v - log q_v) over the last dim; inputs are log-probabilities (..., V),
    output (...). Terms with p_v = 0 contribute 0."""
    p = p_logp.exp()
    return (p * torch.where(p > 0, p_logp - q_logp, torch.zeros_like(p_logp))).sum(-1)


def topk_forward_kl(student_logits, teacher_topk_logp, teacher_topk_ids):
    """Forward KL on the teacher's top-k support, both distributions renormalised on it:
      p = softmax over k of teacher logp,  q = student logp at the k ids renormalised over the k,
      KL(p || q)      per token (B, T)
    student_logits (B, T, V), teacher_topk_logp / teacher_topk_ids (B, T, K). Departure from full-vocab
    forward KL: mass outside the top-k is ignored on both sides (the teacher sends only k numbers)."""
    p_log = teacher_topk_logp.float() - torch.logsumexp(teacher_topk_logp.float(), -1, keepdim=True)  # (B,T,K)
    s_log = torch.log_softmax(student_logits.float(), -1).gather(-1, teacher_topk_ids.long())       # (B,T,K)
    q_log = s_log - torch.logsumexp(s_log, -1, keepdim=True)                                        # (B,T,K)
    return categorical_kl(p_log, q_log)


def generalized_jsd(student_logits, teacher_logits, beta: float):
    """Generalised Jensen-Shannon divergence (GKD, arXiv 2306.13649, "generalized JSD"), per token (B, T):
      M = beta * P + (1 - beta) * Q,  JSD_beta = beta * KL(P || M) + (1 - beta) * KL(Q || M)
    with P the teacher, Q the student, over the full vocabulary. beta in (0, 1)."""
    p_log = torch.log_softmax(teacher_logits.float(), -1)                 # (B, T, V)
    q_log = torch.log_softmax(student_logits.float(), -1)                 # (B, T, V)
    m_log = torch.logsumexp(torch.stack([p_log + math.log(beta), q_log + math.log(1 - beta)]), 0)  # (B,T,V)
    return beta * categorical_kl(p_log, m_log) + (1 - beta) * categorical_kl(q_log, m_log)


def topk_overlap(student_logits, teacher_topk_ids):
    """Fraction of the teacher's top-k ids that are also among the student's top-k, per token (B, T)."""
    k = teacher_topk_ids.size(-1)
    s_ids = student_logits.topk(k, -1).indices                            # (B, T, K)
    hit = (teacher_topk_ids.unsqueeze(-1) == s_ids.unsqueeze(-2)).any(-1)  # (B, T, K) teacher id in student top-k
    return hit.float().mean(-1)


def distill_loss(cfg, student_logits, loss_mask, denom, *, teacher_logits=None, teacher_topk_logp=None,
                 teacher_topk_ids=None):
    """L_GKD: the one dispatch over `cfg.distill_type` (the divergence of the GKD term):
      topk_kl     KL(teacher || student) on the teacher's top-k, renormalised    needs teacher_topk_*
      forward_kl  KL(teacher || student) over the full vocabulary               needs teacher_logits
      reverse_kl  KL(student || teacher) over the full vocabulary               needs teacher_logits
      jsd         generalised JSD with jsd_beta                                  needs teacher_logits
    teacher_logits may be log-probabilities (an ensemble's `mixture_logp`): only their softmax is used.
    Returns (agg(D), metrics) with the same global-denominator aggregation as `policy_loss`; the weight
    gkd_ratio is applied by `opd_objective`."""
    name = cfg.distill_type
    if name == "topk_kl":
        if teacher_topk_logp is None or teacher_topk_ids is None:
            raise ValueError("distill_type='topk_kl' needs teacher_topk_logp and teacher_topk_ids")
        div = topk_forward_kl(student_logits, teacher_topk_logp, teacher_topk_ids)
    elif name in ("forward_kl", "reverse_kl", "jsd"):
        if teacher_logits is None:
            raise ValueError(f"distill_type={name!r} needs teacher_logits (B, T, V)")
        t_log = torch.log_softmax(teacher_logits.float(), -1)             # (B, T, V)
        s_log = torch.log_softmax(student_logits.float(), -1)             # (B, T, V)
        if name == "forward_kl":
            div = categorical_kl(t_log, s_log)
        elif name == "reverse_kl":
            div = categorical_kl(s_log, t_log)
        else:
            div = generalized_jsd(student_logits, teacher_logits, cfg.jsd_beta)
    elif data.is_dotted(name):  # EXT: a user's divergence, fn(student_logits, *, teacher_logits, teacher_topk_logp,
        #                           teacher_topk_ids) -> (B, T) per token (the trainer reports it as train/opd_loss)
        div = data.import_object(name)(student_logits, teacher_logits=teacher_logits,
                                       teacher_topk_logp=teacher_topk_logp, teacher_topk_ids=teacher_topk_ids)
    else:
        raise _choice_error("distill_type", name, DISTILL_TYPES)
    value = aggregate(div, loss_mask, cfg.loss_agg, denom)
    return value, {"distill_" + name: value.detach()}
