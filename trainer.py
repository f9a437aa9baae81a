"""The Megatron-Core trainer worker: one `TrainerWorker` per rank, wrapped with `ray.remote` by the controller.

What lives here, top to bottom:

* (elsewhere: HF <-> Megatron conversion and model building in convert.py; what only CPU needs in cpu.py)
* the per-token log-probability / entropy forward, vocab-parallel aware (`vocab_parallel_logp_entropy`);
* `TrainerWorker`: distributed init, load, `compute_logprobs`, `train_step` (RL), `sft_step`,
  weight export for TransferMesh, HF save, checkpoints, `offload` / `onload` of weights,
  optimizer state and grads for the colocated memory hand-off; the student side of on-policy distillation
  (`_opd_terms`, `distill_step`: teacher targets from teacher.py, algos' objective); with `advantage: gae`
  the critic (`ValueHead`, `_critic_update`): a second GPTModel in the same rank, trunk from the policy's
  checkpoint, a scalar head in place of the LM head, its own optimizer, saved in the same checkpoint file.

Batches are padded, not packed: each micro-batch is a right-padded (B, T) tensor of prompt+response ids.
With right padding a causal mask alone is exact (real tokens never see the pads after them), so the
attention needs no padding mask. Per-token tensors handed to algos.py are response-aligned (B, R):
column j is response token j of each sample, with `loss_mask` 0 on padding and on tool tokens.

Gradients across data-parallel ranks are SUMMED, never averaged: the TransformerConfig sets
`calculate_per_token_loss=True`, which makes Megatron's DDP reduce with scaling factor 1.0, and each
micro-batch loss is already divided by GLOBAL mini-batch counts (`denom`), so a batch yields the same
gradient on 1 data-parallel rank or N.

Parallel layouts: TP, DP, PP (each stage its share of the layers; every micro-batch loop goes through
`_forward_backward`, which is Megatron-Core's 1F1B schedule when PP > 1), EP (experts split over ranks that
are data-parallel for the dense layers). MoE routing replay (R3, `replay_routing`): trajectories that carry
the engine's routed experts are routed by them in every forward.

Test: `.venv/bin/pytest tests/test_trainer.py` (real Ray actors, real Megatron-Core over gloo; parity
against transformers, TP=2 and DP=2 equivalence, HF round trip, checkpoint resume), tests/test_pipeline.py
(PP=2 against one rank), tests/test_moe.py (EP=2 against one rank, R3).
Left out: sequence/context parallelism, virtual pipeline stages, PP together with EP, PP with tied
embeddings, packed sequences, an HF export of the critic (it lives in the Megatron checkpoints only), the critic with
pipeline or expert parallelism (rejected at `--check`).
"""
from __future__ import annotations

import base64
import math
import os
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import algos
import convert
import cpu
import transfermesh
# Megatron-Core is imported inside the functions that use it (`# Megatron: late`): it takes ~2 s to import, a cost
# for the trainer actors only, while the controller imports this module (loongsage, teacher) and builds no model.

# Megatron-Core warns on import that Transformer Engine / Apex are absent and it falls back to plain torch:
# that fallback is exactly what this worker uses (local layer spec), so the warning carries no news.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")


def replay_routing(model, routed: torch.Tensor | None) -> None:
    """R3 (rollout routing replay): make every MoE router of `model` route the next forward with the engine's
    experts instead of its own top-k. routed: (B, T, L, K) global expert ids per token and layer (collate), or
    None to switch replay off (the routers choose their own experts again).

    Megatron-Core 0.16 has the mechanism (`moe_enable_routing_replay` gives each TopKRouter a RouterReplay whose
    REPLAY_FORWARD action takes the top-k indices as given and gathers the router's own scores at them, so the
    gating weights keep their gradient). Its class-level helpers address every router built in the process, the
    frozen reference's included; this sets each router's own instance instead, by the router's global layer
    number (so a pipeline stage reads its own layers). Megatron flattens tokens sequence-first: row s*B + b is
    token s of sample b."""
    from megatron.core.transformer.moe.router import TopKRouter  # Megatron: late
    from megatron.core.transformer.moe.router_replay import RouterReplayAction  # Megatron: late
    for m in model.modules():
        if not isinstance(m, TopKRouter) or m.router_replay is None:
            continue
        m.router_replay.clear_indices()  # also drops the backward-replay list, which grows at every set
        if routed is None:
            m.router_replay.clear_router_replay_action()
            continue
        B, T, _, K = routed.shape
        layer = routed[:, :, m.layer_number - 1]  # (B, T, K) this router's layer (layer_number is 1-based, global)
        m.router_replay.set_target_indices(layer.transpose(0, 1).reshape(T * B, K))  # (T*B, K) sequence-first
        m.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)



class ValueHead(torch.nn.Module):
    """The critic's head: V = w . h + b, one scalar per position, put in the place of GPTModel's output layer
    (the LM head). GPTModel calls its output layer as `layer(hidden, weight=..., runtime_gather_output=...)`
    on the final-normed hidden states (S, B, H) and returns the result batch-first, so the critic's forward
    gives (B, S, 1) with no change to Megatron. Replicated on every TP rank (H is whole there, 1 output is
    not worth splitting); zero-initialised, so a fresh critic says V = 0 and its first GAE is the
    return-to-go."""

    def __init__(self, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size, 1, dtype=dtype)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        # weight: the tied embedding GPTModel offers its LM head; a value head has its own
        return self.linear(hidden_states), None  # (S, B, 1)




# ----------------------------------------------------------------------------------------------
# log-probabilities and entropy from (vocab-parallel) logits


def vocab_parallel_logp_entropy(logits: torch.Tensor, labels: torch.Tensor, tp_group):
    """(logp, entropy), both (B, T) fp32, of `labels` under logits split over the vocab across TP ranks.

    logits: (B, T, V/tp), this rank's contiguous vocab slice; labels: (B, T) global token ids.
    log p(y) = z_y - log sum_v exp(z_v) with z = logits - max; entropy H = log Z - sum_v p_v z_v.
    The sums over the vocab are all-reduced across TP ranks with Megatron's differentiable
    `reduce_from_tensor_model_parallel_region` (its backward is the identity, which is the right
    gradient because every TP rank computes the same replicated loss). TP=1: the reductions vanish.
    """
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region  # Megatron: late

    tp = torch.distributed.get_world_size(tp_group) if tp_group is not None else 1
    rank = torch.distributed.get_rank(tp_group) if tp_group is not None else 0
    logits = logits.float()  # (B, T, V/tp)
    v_local = logits.size(-1)
    with torch.no_grad():
        zmax = logits.max(-1).values  # (B, T) local max
        if tp > 1:
            torch.distributed.all_reduce(zmax, op=torch.distributed.ReduceOp.MAX, group=tp_group)
    z = logits - zmax.unsqueeze(-1)  # (B, T, V/tp), <= 0 everywhere
    exp_z = z.exp()  # (B, T, V/tp)
    sum_exp = reduce_from_tensor_model_parallel_region(exp_z.sum(-1), group=tp_group)  # (B, T) global Z
    local_ids = labels - rank * v_local  # (B, T) label index inside this rank's slice
    here = (local_ids >= 0) & (local_ids < v_local)  # (B, T) label lives on this rank
    z_label = z.gather(-1, local_ids.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1) * here  # (B, T)
    z_label = reduce_from_tensor_model_parallel_region(z_label, group=tp_group)  # (B, T)
    log_z = sum_exp.log()  # (B, T)
    logp = z_label - log_z  # (B, T)
    pz = reduce_from_tensor_model_parallel_region((exp_z * z).sum(-1), group=tp_group) / sum_exp  # (B, T) E_p[z]
    entropy = log_z - pz  # (B, T)
    return logp, entropy


# ----------------------------------------------------------------------------------------------
# batches: trajectory dicts -> padded tensors


def decode_routed_experts(b64: str, layers: int, topk: int) -> torch.Tensor:
    """An engine's `meta_info.routed_experts` (SGLang's encoding: base64 of little-endian int32) as a (n, layers,
    topk) long tensor: row i is the experts each layer chose for token i of prompt + response."""
    flat = np.frombuffer(base64.b64decode(b64), dtype="<i4")
    if flat.size % (layers * topk):
        raise ValueError(f"routed_experts holds {flat.size} int32 values, not a whole number of ({layers} layers x "
                         f"top-{topk}) rows; the engine served another model than the trainer's")
    return torch.from_numpy(flat.astype(np.int64)).view(-1, layers, topk)  # (n, L, K)


def collate(samples: list[dict], per_token: dict[str, list[torch.Tensor]] | None = None,
            routed_shape: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """Right-padded tensors for a list of trajectory dicts.

    Returns tokens (B, T) prompt+response ids; resp_pos (B, R): index into the shifted logp row
    (B, T-1) of each response token (its prediction comes from the previous position); and the
    response-aligned (B, R) tensors loss_mask (1 on model-generated tokens, 0 on tool tokens and
    padding), rollout_logp, weight_versions, plus any `per_token` extras (lists of 1-D tensors,
    one per sample, padded with 0). Also rewards (B,) and group_ids (B,).

    A trajectory that failed before its first model call has no response tokens: it becomes a row of
    padding with loss_mask all 0 (it stays in its group, reward 0, and adds nothing to the loss).
    R and T are at least 1 and 2, so even a micro-batch of only such rows has a position to gather.

    `routed_shape` = (layers, top_k) with router replay: routed_experts (B, T, L, K), each sample's engine routing
    (decode_routed_experts) on its tokens; positions the engine never ran on (the last token, padding, tool tokens
    after the last call) hold experts 0..K-1. No real token attends to them (causal mask, right padding), so they
    cannot change any loss token.
    """
    B = len(samples)
    plen = [len(s["prompt_ids"]) for s in samples]
    rlen = [len(s["response_ids"]) for s in samples]
    for s, p, r in zip(samples, plen, rlen):
        if p == 0 and r > 0:
            raise ValueError(f"sample group_id={s.get('group_id')} sample_index={s.get('sample_index')} has "
                             f"{r} response tokens but no prompt token; the first response token needs a "
                             "prompt token before it (keep the rendered prompt in prompt_ids)")
        if len(s["loss_mask"]) != r:
            raise ValueError(f"loss_mask has {len(s['loss_mask'])} entries for {r} response tokens "
                             f"(group_id={s.get('group_id')}); they must match one to one")
    T, R = max([p + r for p, r in zip(plen, rlen)] + [2]), max(rlen + [1])
    tokens = torch.zeros(B, T, dtype=torch.long)  # (B, T) pad id 0 is never attended to (right padding)
    resp_pos = torch.zeros(B, R, dtype=torch.long)  # (B, R)
    out = {k: torch.zeros(B, R) for k in ("loss_mask", "rollout_logp")}
    versions = torch.full((B, R), -1, dtype=torch.long)  # (B, R)
    for b, s in enumerate(samples):
        p, r = plen[b], rlen[b]
        tokens[b, :p + r] = torch.tensor(list(s["prompt_ids"]) + list(s["response_ids"]), dtype=torch.long)
        resp_pos[b, :r] = torch.arange(p - 1, p - 1 + r)
        out["loss_mask"][b, :r] = torch.tensor(s["loss_mask"], dtype=torch.float)
        if s.get("rollout_logprobs"):
            out["rollout_logp"][b, :r] = torch.tensor(s["rollout_logprobs"], dtype=torch.float)
        if s.get("weight_versions"):
            versions[b, :r] = torch.tensor(s["weight_versions"], dtype=torch.long)
    for key, rows in (per_token or {}).items():
        t = torch.zeros(B, R)
        for b, row in enumerate(rows):
            t[b, :row.numel()] = row
        out[key] = t  # (B, R)
    out["rollout_logp"] = torch.where(out["loss_mask"] > 0, out["rollout_logp"], 0.0)  # (B, R) 0 where loss_mask == 0
    if routed_shape is not None and any(s.get("routed_experts") for s in samples):
        L, K = routed_shape
        routed = torch.arange(K).expand(B, T, L, K).clone()  # (B, T, L, K) filler: experts 0..K-1
        for b, s in enumerate(samples):
            if not s.get("routed_experts"):
                if any(s["loss_mask"]):  # else (a trajectory that failed before any model call) it trains nothing
                    raise ValueError(f"router_replay: sample group_id={s.get('group_id')} sample_index="
                                     f"{s.get('sample_index')} has model tokens but no routed_experts while others in "
                                     "its batch do; every trajectory must come from an engine asked for "
                                     "return_routed_experts")
                continue
            rows = decode_routed_experts(s["routed_experts"], L, K)  # (n, L, K)
            if rows.size(0) > plen[b] + rlen[b]:
                raise ValueError(f"routed_experts has {rows.size(0)} rows for {plen[b] + rlen[b]} tokens (group_id="
                                 f"{s.get('group_id')}); it must cover prompt + response ids from position 0")
            routed[b, :rows.size(0)] = rows
        out["routed_experts"] = routed
    return dict(tokens=tokens, resp_pos=resp_pos, weight_versions=versions,
                rewards=torch.tensor([float(s.get("reward", 0.0)) for s in samples]),
                group_ids=torch.tensor([int(s.get("group_id", i)) for i, s in enumerate(samples)]),
                resp_len=torch.tensor(rlen), **out)


def segment_rows(batch: list[dict]) -> list[dict]:
    """Every trainable segment of every trajectory as its own training row. A trajectory whose agent compacted
    or edited its history has several segments (agentflow: the last one is the trajectory's top-level fields);
    each earlier segment with model tokens becomes a row of its own that trains with its trajectory's
    advantage. Rows keep the trajectory's group_id and reward; `traj` indexes the trajectory in `batch` and
    `last` marks the row the advantage is computed on (one per trajectory, so group statistics count each
    trajectory once). A failed trajectory trains nothing: its earlier segments make no rows (its last one
    arrives with a zero mask)."""
    rows = []
    for i, t in enumerate(batch):
        for seg in (t.get("segments") or [])[:-1]:
            if any(seg["loss_mask"]) and t.get("status") != "failed":
                rows.append({**t, **seg, "segments": [], "traj": i, "last": False})
        rows.append({**t, "traj": i, "last": True})
    return rows


def shared_advantage(traj_adv: torch.Tensor, loss_mask: list[int]) -> torch.Tensor:
    """An earlier segment's advantage: its trajectory's advantage at the trajectory's first trained token (the
    sequence advantage for grpo / rloo / drgrpo; the return from the start of the last segment for token-level
    estimators), on every model token of the segment."""
    first = traj_adv[traj_adv != 0][:1]  # (1,) or (0,) when the trajectory has no trained token
    value = float(first) if first.numel() else 0.0
    return torch.tensor(loss_mask, dtype=torch.float) * value  # (R_seg,)


def segment_returns(local: list[dict], lasts: list[int], ret: torch.Tensor) -> list[torch.Tensor]:
    """CRITIC: the value target of every row of `local` (R_j,), from `ret` (B_traj, R), the targets of the
    `lasts` rows (one per trajectory). An earlier segment regresses on its trajectory's target at the first model
    token of the last segment on each of its model tokens, as `shared_advantage` gives it the advantage there."""
    of = {}
    for b, j in enumerate(lasts):
        row = ret[b, :len(local[j]["response_ids"])]  # (R_j,)
        first = [t for t, m in enumerate(local[j]["loss_mask"]) if m][:1]
        of[local[j]["traj"]] = (row, float(row[first[0]]) if first else 0.0)
    return [of[s["traj"]][0] if s["last"] else torch.tensor(s["loss_mask"], dtype=torch.float) * of[s["traj"]][1]
            for s in local]


def turn_token_rewards(cfg, rows: list[dict], rewards: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor | None:
    """(B, R) token rewards for the token-level estimators (returns, gae, reinforce_pp) when some trajectory
    carries per-turn rewards (`turn_rewards`, one per model turn of its last segment, from its agent): each on
    the last token of its turn; trajectories without them keep their outcome reward `rewards` (B,) on their
    last model token. None when no trajectory has them or the estimator is sequence-level."""
    has = [bool(r.get("turn_rewards")) for r in rows]
    if cfg.advantage not in ("returns", "gae", "reinforce_pp") or not any(has):
        return None
    per_turn = algos.turn_rewards_to_tokens([list(r.get("turn_rewards") or []) for r in rows], loss_mask)  # (B, R)
    outcome = algos.outcome_to_tokens(rewards, loss_mask)  # (B, R)
    return torch.where(torch.tensor(has)[:, None], per_turn, outcome)


def collate_targets(targets: list[dict], R: int) -> dict:
    """Teacher targets (teacher.py, one dict per sample) as right-padded tensors aligned with `collate`'s
    response columns: (B, R) teacher_logp / teacher_mask, (B, R, K) teacher_topk_logp / _ids, and in
    hidden mode {teacher: (B, R, H)} teacher_hidden and {teacher: (B, R)} teacher_weight. Padding is 0
    (teacher_mask 0 there, so it never reaches a loss)."""
    B = len(targets)
    out: dict = {}
    for key in ("teacher_logp", "teacher_mask", "teacher_topk_logp", "teacher_topk_ids"):
        if key not in targets[0]:
            continue
        first = targets[0][key]
        x = torch.zeros((B, R) + tuple(first.shape[1:]), dtype=first.dtype)  # (B, R[, K])
        for b, tg in enumerate(targets):
            x[b, :tg[key].size(0)] = tg[key]
        out[key] = x
    if "teacher_hidden" in targets[0]:
        names = sorted({n for tg in targets for n in tg["teacher_hidden"]})
        out["teacher_hidden"], out["teacher_weight"] = {}, {}
        for n in names:
            H = next(tg["teacher_hidden"][n].size(-1) for tg in targets if n in tg["teacher_hidden"])
            h, w = torch.zeros(B, R, H), torch.zeros(B, R)  # (B, R, H), (B, R)
            for b, tg in enumerate(targets):
                if n in tg["teacher_hidden"]:
                    r = tg["teacher_hidden"][n].size(0)
                    h[b, :r], w[b, :r] = tg["teacher_hidden"][n], tg["teacher_weight"][n]
            out["teacher_hidden"][n], out["teacher_weight"][n] = h, w
    return out


def plan_minibatches(batch: list[dict], n_minibatches: int, dp_rank: int, dp_size: int,
                     by_group: bool) -> list[list[int]]:
    """Indices into `batch` of this DP rank's share of each mini-batch.

    Groups (all samples sharing a group_id, in order of first appearance; every sample its own group
    when by_group is False) are split into `n_minibatches` consecutive global mini-batches, and the
    groups of each mini-batch are dealt round-robin to the DP ranks. The global mini-batches do not
    depend on dp_size, so 1 rank and N ranks step on the same samples. A rank may get an empty share
    (fewer groups than ranks); it still joins the gradient all-reduce.

    Each share is ordered by length (prompt + response tokens; ties keep batch order), so its micro-batches,
    consecutive slices of it, hold samples of similar length and pad little: on a long-tail batch where every
    slice in batch order held one long sample, that is most of the padding. The losses are sums over samples with
    global denominators, so the order changes only the order of floating-point additions.
    """
    groups: dict[Any, list[int]] = {}
    for i, s in enumerate(batch):
        groups.setdefault(s.get("group_id", i) if by_group else i, []).append(i)
    order = list(groups.values())
    per = [len(c) for c in _split_evenly(len(order), n_minibatches)]
    length = [len(s.get("prompt_ids", ())) + len(s.get("response_ids", ())) for s in batch]
    out, start = [], 0
    for n in per:
        mb_groups = order[start:start + n]
        start += n
        out.append(sorted((i for g in mb_groups[dp_rank::dp_size] for i in g), key=length.__getitem__))
    return out


def _split_evenly(n: int, parts: int) -> list[range]:
    """`parts` consecutive ranges covering range(n), sizes differing by at most one."""
    q, r = divmod(n, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + q + (1 if i < r else 0))
    return [range(bounds[i], bounds[i + 1]) for i in range(parts)]


def optimizer_steps_per_rl_step(cfg) -> int:
    """Mini-batches (optimizer steps) in one RL step: rollout samples / global_batch_size, at least 1."""
    return max(1, round(int(cfg.prompts_per_step) * int(cfg.samples_per_prompt) / int(cfg.global_batch_size)))


def lr_at(cfg, it: int) -> float:
    """Learning rate of optimizer step `it` (0-based): linear warmup over cfg.lr_warmup_steps, then a
    cosine from cfg.lr down to cfg.min_lr over the whole run (cfg.num_steps RL steps of
    `optimizer_steps_per_rl_step` optimizer steps each); constant when min_lr == lr."""
    warmup = int(cfg.lr_warmup_steps or 0)
    if it < warmup:
        return cfg.lr * (it + 1) / warmup
    if cfg.min_lr == cfg.lr:
        return cfg.lr
    total = int(cfg.num_steps) * optimizer_steps_per_rl_step(cfg)
    frac = min(1.0, (it - warmup) / max(1, total - warmup))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * frac))


# ----------------------------------------------------------------------------------------------
# the worker


class TrainerWorker:
    """One Megatron-Core rank. The controller creates world_size of them (`ray.remote(TrainerWorker)`),
    and calls every method on all ranks at once; collectives inside pair them up.

    Rank layout is Megatron's default order: TP varies fastest, then DP (EP within it), then PP. Rank 0 returns
    the gathered weights and writes HF files; metrics are identical on every rank (pipeline stages get the last
    stage's).
    """

    def __init__(self, cfg, rank: int, world_size: int, master_addr: str, master_port: int):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.cpu = cpu.apply_cpu_shims()  # first: it imports Megatron on CPU
        from megatron.core import parallel_state  # Megatron: late
        if cfg.trainer_threads > 0:  # see Config.trainer_threads: sync uses every core
            torch.set_num_threads(int(cfg.trainer_threads))
        tp, pp = int(cfg.tensor_parallel), int(cfg.pipeline_parallel)
        ep = int(cfg.expert_parallel)
        if pp > 1 and ep > 1:
            raise ValueError(f"pipeline_parallel={pp} with expert_parallel={ep} is not wired in (the padding that "
                             "keeps expert ranks in step runs outside the pipeline schedule); use one of them")
        if world_size % (tp * pp):
            raise ValueError(f"world_size={world_size} is not a multiple of tensor_parallel*pipeline_parallel="
                             f"{tp * pp}; use a world size of k*{tp * pp}")
        if self.cpu:
            self.device = torch.device("cpu")
        else:
            torch.cuda.set_device(rank % torch.cuda.device_count())
            self.device = torch.device("cuda", torch.cuda.current_device())
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("gloo" if self.cpu else "nccl", rank=rank, world_size=world_size,
                                                 init_method=f"tcp://{master_addr}:{master_port}")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                 expert_model_parallel_size=ep)
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_size = tp
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp_group_gloo = parallel_state.get_data_parallel_group_gloo()  # for python-object collectives
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        # EP > 1: Megatron's allgather token dispatcher all-gathers every expert rank's (T*B, H) tokens, so those ranks
        # (data-parallel replicas of the dense layers, each with its own samples) must run the same number of forwards
        # with the same shapes; `_ep_micro_starts` and `_forward_logp` pad them to that (None: no padding needed)
        self.ep_group = parallel_state.get_expert_tensor_and_model_parallel_group() if ep > 1 else None
        self.pp_size, self.pp_group = pp, parallel_state.get_pipeline_model_parallel_group()
        self.pre_process = parallel_state.is_pipeline_first_stage()   # this stage holds the embedding
        self.post_process = parallel_state.is_pipeline_last_stage()   # ... the final norm, output layer, logp
        self.pp_last_rank = parallel_state.get_pipeline_model_parallel_last_rank()  # global rank of that stage
        self.pad_to = (0, 0)  # (B, T) every micro-batch is padded to at least (set per pipeline schedule run)
        torch.manual_seed(int(cfg.seed))
        if not self.cpu:
            from megatron.core import tensor_parallel  # Megatron: late
            tensor_parallel.model_parallel_cuda_manual_seed(int(cfg.seed))
        self.model = self.ref_model = self.optimizer = None
        self.offloaded: dict[str, tuple] = {}  # tag -> (freed storages, file) while offloaded (colocated hand-off)
        self.optim_steps = 0  # optimizer steps taken (drives the lr schedule)
        self.critic = self.critic_optimizer = None  # the value model (advantage: gae), see load_hf
        self.critic_steps = 0  # critic optimizer steps taken
        self.lr_override: float | None = None  # constant lr given to load_hf (SFT warm start)
        self.lent = None  # borrow_cores: (the engines' busy flags, [(engine, its core count)])

    # --- model, optimizer, reference ------------------------------------------------------------

    def load_hf(self, path: str, lr: float | None = None) -> dict:
        """Build the model (+ optimizer, + frozen reference when a KL term needs one) from an HF dir.

        `lr` set: a constant learning rate instead of cfg's schedule (the SFT warm start uses it).
        Calling it again rebuilds everything from the new directory (optimizer state and step reset).
        With `advantage: gae` (and no `lr`: the warm start trains the policy only) it also builds the critic.
        """
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # Megatron: late

        self.hf_path, self.lr_override, self.optim_steps, self.critic_steps = str(path), lr, 0, 0
        self.model = self.ref_model = self.optimizer = None  # free a previous model before building the next
        self.critic = self.critic_optimizer = None
        self.offloaded = {}
        self.hf_config = convert.read_hf_config(path)
        self.tcfg, self.model_kwargs = convert.megatron_config(self.hf_config, self.cfg, self.cpu)
        # R3: (layers, top_k) of the routed_experts rows that collate decodes; None without router replay
        self.routed_shape = ((self.tcfg.num_layers, self.tcfg.moe_router_topk)
                             if self.tcfg.moe_enable_routing_replay else None)
        if self.routed_shape is not None:  # Megatron keeps every RouterReplay ever built in a class-level list:
            from megatron.core.transformer.moe.router_replay import RouterReplay  # forget the previous models'
            RouterReplay.clear_global_router_replay_instances()
        hf_state = convert.load_hf_state(path)
        full = convert.hf_to_megatron(hf_state, self.hf_config)
        del hf_state
        gpt = convert.build_gpt_model(self.tcfg, self.model_kwargs, self.device, self.pre_process, self.post_process,
                              fp32_lm_head=self.cfg.fp32_lm_head)
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset  # Megatron: late
        self.layer_offset = get_transformer_layer_offset(self.tcfg) if self.pp_size > 1 else 0  # first global layer
        self.n_local_layers = len(gpt.decoder.layers)
        self._load_full_state(gpt, full)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=False)
        self.model = DistributedDataParallel(config=self.tcfg, ddp_config=ddp_config, module=gpt)
        self.optimizer = self._build_optimizer()
        needs_ref = float(self.cfg.kl_coef) > 0 or bool(self.cfg.kl_in_reward)
        if needs_ref:
            self.ref_model = convert.build_gpt_model(self.tcfg, self.model_kwargs, self.device, self.pre_process,
                                             self.post_process,
                                             fp32_lm_head=self.cfg.fp32_lm_head)
            self._load_full_state(self.ref_model, full)
            self.ref_model.requires_grad_(False).eval()
        if self.cfg.advantage == "gae" and lr is None:  # CRITIC: the same trunk and weights, a value head
            critic = convert.build_gpt_model(self.tcfg, self.model_kwargs, self.device)
            self._load_full_state(critic, full)  # the policy's checkpoint (LM head included, then replaced)
            critic.output_layer = ValueHead(self.tcfg.hidden_size, self.tcfg.params_dtype).to(self.device)
            self.critic = DistributedDataParallel(config=self.tcfg, ddp_config=ddp_config, module=critic)
            self.critic_optimizer = self._build_optimizer(self.critic, float(self.cfg.critic_lr))
        for model in (self.model, self.ref_model, self.critic):
            self._hook_layers(model)
        n_params = sum(p.numel() for p in gpt.parameters())
        return {"params_this_rank": n_params, "reference": needs_ref, "critic": self.critic is not None}

    # --- borrowed cores (async on a local CPU node: cfg.borrow_engine_cores; cpu.BorrowedCores) ------------------

    def borrow_cores(self, busy_file: str, lent: list[tuple[int, list[int]]]) -> list[int]:
        """Also compute on the cores of the engines in `lent` ((engine, its cores), from loongsage.lent_cores) while
        they have nothing to generate (cpu.BorrowedCores). Returns the cores this rank may run on."""
        self.lent = cpu.BorrowedCores(busy_file, lent, int(self.cfg.trainer_threads))
        for model in (self.model, self.ref_model, self.critic):
            self._hook_layers(model)
        return sorted(self.lent.cores)

    def _hook_layers(self, model) -> None:
        if self.lent is not None and model is not None:
            self.lent.hook_layers(getattr(model, "module", model))  # DDP wraps the GPTModel

    def _expert_rank_info(self):
        from megatron.core import parallel_state  # Megatron: late
        if not self.tcfg.num_moe_experts:
            return 0, 1, 0, 1
        return (parallel_state.get_expert_model_parallel_rank(),
                parallel_state.get_expert_model_parallel_world_size(),
                parallel_state.get_expert_tensor_parallel_rank(),
                parallel_state.get_expert_tensor_parallel_world_size())

    def _stage_name(self, name: str) -> str | None:
        """A full-model Megatron name as this pipeline stage names it (its layers count from 0), or None when
        another stage holds the tensor. PP=1: the name itself."""
        if self.pp_size == 1:
            return name
        if name.startswith("embedding."):
            return name if self.pre_process else None
        if name.startswith(("decoder.final_layernorm.", "output_layer.")):
            return name if self.post_process else None
        _, _, layer, rest = name.split(".", 3)  # decoder.layers.<L>.<rest>
        local = int(layer) - self.layer_offset
        return f"decoder.layers.{local}.{rest}" if 0 <= local < self.n_local_layers else None

    def _global_name(self, name: str) -> str:
        """Inverse of _stage_name: this stage's parameter name as the full model names it."""
        if self.pp_size == 1 or not name.startswith("decoder.layers."):
            return name
        _, _, layer, rest = name.split(".", 3)
        return f"decoder.layers.{int(layer) + self.layer_offset}.{rest}"

    def _load_full_state(self, gpt, full: dict[str, torch.Tensor]) -> None:
        """Copy this rank's shard of every full Megatron tensor into `gpt` (and check nothing is missing)."""
        ep_rank, ep_size, etp_rank, etp_size = self._expert_rank_info()
        n_local_experts = (self.tcfg.num_moe_experts or 0) // ep_size
        params = dict(gpt.named_parameters())
        missing = set(params)
        for name, tensor in full.items():
            name = self._stage_name(name)
            if name is None:  # another pipeline stage's
                continue
            local_name, rank, size = name, self.tp_rank, self.tp_size
            if ".local_experts." in name:
                head, rest = name.split(".local_experts.")
                e, tail = rest.split(".", 1)
                owner, local_e = divmod(int(e), n_local_experts)
                if owner != ep_rank:
                    continue
                local_name, rank, size = f"{head}.local_experts.{local_e}.{tail}", etp_rank, etp_size
            if local_name not in params:
                raise KeyError(f"converted weight {name!r} has no Megatron parameter {local_name!r}; the "
                               "HF config and the built model disagree")
            shard = convert.shard_for_rank(local_name, tensor, rank, size)
            p = params[local_name]
            if p.shape != shard.shape:
                raise ValueError(f"{local_name}: HF-converted shard {tuple(shard.shape)} != parameter {tuple(p.shape)}")
            with torch.no_grad():
                p.copy_(shard)
            missing.discard(local_name)
        if missing:
            raise KeyError(f"no HF weight for Megatron parameter(s) {sorted(missing)}")

    def _build_optimizer(self, model=None, lr: float | None = None):
        """AdamW over `model` (default: the policy) at `lr` (default cfg.lr). CUDA: Megatron's optimizer (fp32
        master weights, clipping inside). CPU (shim 3): torch.optim.AdamW; clipping is done by
        `_grad_norm_and_clip`. Norms and biases get no decay."""
        cfg = self.cfg
        model = self.model if model is None else model
        lr = cfg.lr if lr is None else lr
        if not self.cpu:
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # Megatron: late
            ocfg = OptimizerConfig(optimizer="adam", lr=lr, min_lr=min(cfg.min_lr, lr), weight_decay=cfg.weight_decay,
                                   adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
                                   clip_grad=float(cfg.grad_clip or 0.0), bf16=self.tcfg.bf16,
                                   params_dtype=self.tcfg.params_dtype)
            return get_megatron_optimizer(ocfg, [model])
        return cpu.adamw(model, cfg, lr)

    # --- colocated memory hand-off ---------------------------------------------------------------------
    # Between its phases a colocated trainer gives memory to the engines on the same GPUs (loongsage.colocate_hand_off):
    # after the step its optimizer state and gradients, after the weight sync its weights; all come back before the
    # next step. Tags: "weights" (the model's and the frozen reference's parameters), "optimizer" (Adam's moments and,
    # on CUDA, Megatron's fp32 master weights), "grads" (DDP's gradient buffers: zero between steps, so nothing is
    # kept, and their storage is resized to zero and back, so every param.main_grad view stays valid). Weights and
    # optimizer tensors keep their identity (the optimizer and DDP hold them) and swap their `.data`: to pinned host
    # memory on CUDA; on CPU to a file in output_dir/offload, so the bytes really leave this process.

    OFFLOAD_TAGS = ("weights", "optimizer", "grads")

    def _offload_tensors(self, tag: str) -> list[torch.Tensor]:
        models = [m for m in (self.model, self.critic) if m is not None]  # the critic (advantage: gae) goes too
        if tag == "weights":
            tensors = [p for m in models + ([self.ref_model] if self.ref_model else []) for p in m.parameters()]
        elif tag == "optimizer":
            tensors = []
            for opt in [o for o in (self.optimizer, self.critic_optimizer) if o is not None]:
                for o in getattr(opt, "chained_optimizers", [opt]):
                    inner = getattr(o, "optimizer", o)  # Megatron wraps a torch optimizer; on CPU it is one
                    tensors += [t for st in inner.state.values() for t in st.values() if torch.is_tensor(t)]
                    tensors += [p for group in getattr(o, "fp32_from_float16_groups", []) for p in group]  # masters
        elif tag == "grads":
            tensors = [b.grad_data for m in models for b in list(m.buffers) + list(m.expert_parallel_buffers)]
        else:
            raise ValueError(f"offload tag {tag!r}: choose from {self.OFFLOAD_TAGS}")
        unique = {t.untyped_storage().data_ptr(): t for t in tensors if t.numel() > 0}
        return list(unique.values())

    def offload(self, tags: list[str]) -> dict:
        """Free the memory of `tags` (see above); returns this rank's memory afterwards (`memory`)."""
        for tag in tags:
            if tag in self.offloaded:
                continue
            tensors = self._offload_tensors(tag)
            path = Path(self.cfg.output_dir) / "offload" / f"rank{self.rank}_{tag}.bin"
            if tag == "grads":
                entries = [(t, t.untyped_storage().nbytes()) for t in tensors]
                for t, _ in entries:
                    t.untyped_storage().resize_(0)
            elif self.cpu:
                path.parent.mkdir(parents=True, exist_ok=True)
                total = sum(t.numel() * t.element_size() for t in tensors)
                dst = torch.from_file(str(path), shared=True, size=max(total, 1), dtype=torch.uint8)  # (total,) file
                entries, off = [], 0
                for t in tensors:
                    n = t.numel() * t.element_size()
                    dst[off:off + n].copy_(t.data.contiguous().view(-1).view(torch.uint8))
                    entries.append((t, off, t.shape))
                    off += n
                    t.data = torch.empty(0, dtype=t.dtype)
                del dst  # unmapped: the bytes live in the file only
            else:
                entries = []
                for t in tensors:
                    entries.append((t, torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t.data)))
                    t.data = torch.empty(0, dtype=t.dtype, device=t.device)
            self.offloaded[tag] = (entries, path)
        if "weights" in tags:
            transfermesh.release_shm()  # the weight-sync staging segment is a further copy of the weights
        if not self.cpu:
            torch.cuda.empty_cache()  # the caching allocator would keep the freed blocks from the engines
        transfermesh.trim_freed_memory()
        return self.memory()

    def onload(self, tags: list[str] | None = None) -> dict:
        """Bring back what `offload` freed (all tags by default); a no-op for tags that are resident."""
        for tag in list(self.offloaded) if tags is None else [t for t in tags if t in self.offloaded]:
            entries, path = self.offloaded.pop(tag)
            if tag == "grads":
                for t, nbytes in entries:
                    t.untyped_storage().resize_(nbytes)
                    t.zero_()
            elif self.cpu:
                src = torch.from_file(str(path), shared=False, size=max(path.stat().st_size, 1), dtype=torch.uint8)
                for t, off, shape in entries:
                    fresh = torch.empty(shape, dtype=t.dtype)
                    n = fresh.numel() * fresh.element_size()
                    fresh.view(-1).view(torch.uint8).copy_(src[off:off + n])
                    t.data = fresh
                del src
                path.unlink(missing_ok=True)
            else:
                for t, host in entries:
                    t.data = host.to(self.device, non_blocking=True)
        return self.memory()

    def memory(self) -> dict:
        """This rank's memory: resident bytes of the process; on CUDA also the device memory torch holds and the
        whole device's used memory (which shows colocated engines releasing theirs)."""
        out = {"rss_bytes": transfermesh.rss_bytes()}
        if not self.cpu:
            free, total = torch.cuda.mem_get_info()
            out.update(cuda_allocated_bytes=torch.cuda.memory_allocated(), gpu_used_bytes=total - free)
        return out

    # --- forward ----------------------------------------------------------------------------------

    def _forward_logp(self, model, mb: dict[str, torch.Tensor], return_logits: bool = False):
        """(logp, entropy), both (B, R) fp32, of each response token under `model`; with `return_logits`
        also the logits that predict each response token, (B, R, V/tp) (distillation needs them). One whole model
        (PP=1); pipeline stages go through `_forward_backward`."""
        output, shape = self._model_output(model, mb)
        return self._logp_from_logits(mb, output, shape, return_logits)

    def _model_output(self, model, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, tuple[int, int]]:
        """The model's output for a micro-batch: logits (B, T, V/tp) on the last pipeline stage, the hidden states
        handed to the next stage elsewhere; and (B0, T0), the micro-batch's own shape before any EP padding."""
        tokens = mb["tokens"].to(self.device)  # (B, T)
        B0, T0 = tokens.shape
        replay = mb.get("routed_experts")  # (B, T, L, K) R3: route as the engine did (cfg.router_replay)
        B, T = max(B0, self.pad_to[0]), max(T0, self.pad_to[1])  # PP: one activation shape for the whole schedule
        if self.ep_group is not None:  # the same (B, T) on every expert rank
            size = torch.tensor([B, T])
            torch.distributed.all_reduce(size, op=torch.distributed.ReduceOp.MAX, group=self.ep_group)
            B, T = size.tolist()
        if (B, T) != (B0, T0):  # pad with rows / columns of padding
            tokens = F.pad(tokens, (0, T - T0, 0, B - B0))  # (B, T) zeros after each row / as extra rows
            if replay is not None:  # padded positions route to experts 0..K-1 (never a loss token)
                fill = torch.arange(replay.size(-1), device=replay.device).expand(B, T, *replay.shape[2:]).clone()
                fill[:B0, :T0] = replay
                replay = fill  # (B, T, L, K)
        B, T = tokens.shape
        position_ids = torch.arange(T, device=self.device).unsqueeze(0).expand(B, T)  # (B, T)
        extra = {}
        if self.tcfg.num_moe_experts:
            seq_len = (mb["resp_pos"][:, :1] + 1 + mb["resp_len"].unsqueeze(1)).to(self.device)  # (B0, 1) real tokens
            seq_len = F.pad(seq_len, (0, 0, 0, B - B0))  # (B, 1) EP padding rows: no real token
            extra["padding_mask"] = position_ids >= seq_len  # (B, T) True on padding: kept out of expert routing
        if replay is not None:
            replay_routing(model, replay.to(self.device))
        try:
            output = model(input_ids=tokens, position_ids=position_ids, attention_mask=None, **extra)  # (B, T, V/tp)
        finally:
            if replay is not None:  # the indices were used in the forward; backward needs no re-routing
                replay_routing(model, None)
        return output, (B0, T0)

    def _logp_from_logits(self, mb: dict[str, torch.Tensor], logits: torch.Tensor, shape: tuple[int, int],
                          return_logits: bool):
        """(logp, entropy) (B0, R) [, response logits (B0, R, V/tp)] from a last stage's logits (B, T, V/tp)."""
        B0, T0 = shape
        logits = logits[:B0, :T0]  # (B0, T0, V/tp) this rank's own rows and columns
        tokens = mb["tokens"].to(self.device)  # (B0, T0)
        pos = mb["resp_pos"].to(self.device)  # (B, R) the positions whose logits predict the response tokens
        # the response positions first: prompt positions need no log-softmax (the same numbers, row by row)
        resp_logits = logits.gather(1, pos.unsqueeze(-1).expand(-1, -1, logits.size(-1)))  # (B, R, V/tp)
        logp, entropy = vocab_parallel_logp_entropy(resp_logits, tokens.gather(1, pos + 1), self.tp_group)  # (B, R)
        return (logp, entropy, resp_logits) if return_logits else (logp, entropy)  # (B, R) each on self.device

    def _forward_values(self, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        """CRITIC: V(s_t) (B, R) fp32 for each response token t: the value head at the position whose logits
        predict token t (resp_pos), i.e. the value of the context before the model emits it."""
        tokens = mb["tokens"].to(self.device)  # (B, T)
        B, T = tokens.shape
        position_ids = torch.arange(T, device=self.device).unsqueeze(0).expand(B, T)  # (B, T)
        extra = {}
        if self.tcfg.num_moe_experts:  # as in _forward_logp: padding stays out of expert routing
            seq_len = (mb["resp_pos"][:, :1] + 1 + mb["resp_len"].unsqueeze(1)).to(self.device)  # (B, 1)
            extra["padding_mask"] = position_ids >= seq_len  # (B, T)
        values = self.critic(input_ids=tokens, position_ids=position_ids, attention_mask=None, **extra)  # (B, T, 1)
        return values[..., 0].float().gather(1, mb["resp_pos"].to(self.device))  # (B, R)

    @torch.no_grad()
    def compute_values(self, samples: list[dict]) -> list[torch.Tensor]:
        """CRITIC: per-sample 1-D V(s_t) of every response token, in micro-batches, no grad, eval mode (the
        V_old of a step; also for tests)."""
        was_training = self.critic.training
        self.critic.eval()
        out = []
        mbs = int(self.cfg.micro_batch_size)
        for start in range(0, len(samples), mbs):
            chunk = samples[start:start + mbs]
            values = self._forward_values(collate(chunk))  # (b, R)
            out += [values[b, :len(s["response_ids"])].cpu() for b, s in enumerate(chunk)]
        self.critic.train(was_training)
        return out

    def _forward_backward(self, model, mbs: list[dict], on_output, forward_only: bool,
                          return_logits: bool = False) -> None:
        """Run collated micro-batches `mbs` through `model`: for micro-batch i, forward, then
        `on_output(i, mb, logp, entropy, logits)` (logits None unless return_logits) returns its loss, a scalar
        tensor (anything when forward_only), and the loss's backward accumulates gradients.

        PP = 1: one micro-batch after another, here. PP > 1: Megatron-Core's non-interleaved 1F1B schedule
        (`get_forward_backward_func`) over the pipeline group, gloo p2p on CPU; `on_output` runs on the last stage
        only (its side effects, e.g. metric sums, exist there alone: `_from_last_stage` hands them to the others).
        The loss goes back unscaled: calculate_per_token_loss=True, and every loss is already divided by global
        counts, as without pipelining."""
        if self.pp_size == 1:
            for i, mb in enumerate(mbs):
                logp, entropy, *logits = self._forward_logp(model, mb, return_logits)
                loss = on_output(i, mb, logp, entropy, logits[0] if logits else None)
                if not forward_only:
                    loss.backward()
            return
        if not mbs:  # every stage of a pipeline holds the same samples: all skip together
            return
        from megatron.core.pipeline_parallel import get_forward_backward_func  # Megatron: late

        def forward_step(data_iterator, stage_model):
            i, mb = next(data_iterator)
            output, shape = self._model_output(stage_model, mb)  # logits on the last stage, hidden states elsewhere

            def loss_func(logits):  # last stage only
                logp, entropy, *resp_logits = self._logp_from_logits(mb, logits, shape, return_logits)
                loss = on_output(i, mb, logp, entropy, resp_logits[0] if resp_logits else None)
                if not isinstance(loss, torch.Tensor):
                    loss = torch.zeros((), device=self.device)
                return loss, torch.tensor(1), {}  # (loss, tokens: unused with pre-divided losses, reported: none)
            return output, loss_func

        # one (B, T) for every micro-batch of this run: the shape the stages send each other (same on every stage:
        # they hold the same samples)
        self.pad_to = (max(mb["tokens"].size(0) for mb in mbs), max(mb["tokens"].size(1) for mb in mbs))
        try:
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(list(enumerate(mbs))), model=[model],
                num_microbatches=len(mbs), seq_length=self.pad_to[1], micro_batch_size=self.pad_to[0],
                forward_only=forward_only)
        finally:
            self.pad_to = (0, 0)

    def _from_last_stage(self, obj):
        """`obj` as the last pipeline stage holds it, on every stage of this rank's pipeline (PP=1: obj)."""
        if self.pp_size == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=self.pp_last_rank, group=self.pp_group)
        return box[0]

    def _ep_micro_starts(self, n: int, mbs: int) -> list[int]:
        """Start offsets of the micro-batches over `n` local samples. With EP > 1 every expert rank runs as many
        as the busiest one: the extra starts lie at or past `n`, and the caller runs `_ep_idle_microbatch` there."""
        count = -(-n // mbs)  # ceil
        if self.ep_group is not None:
            t = torch.tensor([count])
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.ep_group)
            count = int(t)
        return [i * mbs for i in range(count)]

    def _ep_idle_microbatch(self, model, backward: bool) -> None:
        """A forward (and backward, with zero gradient) of padding only, so this expert rank joins the token
        dispatcher's collectives of a micro-batch another expert rank runs."""
        logp, _ = self._forward_logp(model, collate([]))  # (0, 1): no rows of this rank's own
        if backward:
            (logp.sum() * 0.0).backward()

    def _to_device(self, mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device) for k, v in mb.items()}

    @torch.no_grad()
    def _logp_no_grad(self, model, samples: list[dict]) -> list[torch.Tensor]:
        """Per-sample 1-D logp of every response token, in micro-batches, no grad, eval mode."""
        was_training = model.training
        model.eval()
        mbs = int(self.cfg.micro_batch_size)
        starts = self._ep_micro_starts(len(samples), mbs)
        chunks = [samples[start:start + mbs] for start in starts if start < len(samples)]
        rows: dict[int, list[torch.Tensor]] = {}

        def keep(i, mb, logp, entropy, logits):  # logp (b, R)
            rows[i] = [logp[b, :len(s["response_ids"])].cpu() for b, s in enumerate(chunks[i])]
        self._forward_backward(model, [collate(c, routed_shape=self.routed_shape) for c in chunks], keep,
                               forward_only=True)
        for _ in range(len(starts) - len(chunks)):  # EP: another expert rank has micro-batches more
            self._ep_idle_microbatch(model, backward=False)
        rows = self._from_last_stage(rows)
        model.train(was_training)
        return [r for i in range(len(chunks)) for r in rows[i]]

    @torch.no_grad()
    def routing_used(self, batch: list[dict]) -> list[torch.Tensor]:
        """The experts every router actually dispatched each token to, per sample a (P+R, L, K) long tensor, sorted
        within each token (a routing map has no order): read from the routers' outputs in a no-grad forward, with
        replay when the batch carries routed_experts and router_replay is on. For the R3 tests."""
        from megatron.core.transformer.moe.router import TopKRouter  # Megatron: late
        if self.pp_size > 1:
            raise NotImplementedError("routing_used reads one whole model; call it with pipeline_parallel=1")
        maps = {}
        hooks = [m.register_forward_hook(lambda mod, inp, out: maps.__setitem__(mod.layer_number, out[1]))
                 for m in self.model.modules() if isinstance(m, TopKRouter)]
        was_training = self.model.training
        self.model.eval()
        try:
            mb = collate(batch, routed_shape=self.routed_shape)
            self._forward_logp(self.model, mb)
        finally:
            for h in hooks:
                h.remove()
            self.model.train(was_training)
        B, T = mb["tokens"].shape
        K = self.tcfg.moe_router_topk
        per_layer = []
        for n in sorted(maps):  # routing_map (T*B, E) bool, sequence-first rows
            idx = maps[n].float().topk(K, dim=-1).indices.sort(-1).values  # (T*B, K) the K chosen experts, ascending
            per_layer.append(idx.view(T, B, K).transpose(0, 1))  # (B, T, K)
        used = torch.stack(per_layer, 2).cpu()  # (B, T, L, K)
        return [used[b, :len(s["prompt_ids"]) + len(s["response_ids"])] for b, s in enumerate(batch)]

    def compute_logprobs(self, batch: list[dict]) -> list[list[float]]:
        """Per response token logprobs for every sample (every rank computes all samples; for parity
        tests and debugging, not the training hot path)."""
        self.onload(["weights"])
        return [row.tolist() for row in self._logp_no_grad(self.model, batch)]

    # --- optimizer step ----------------------------------------------------------------------------

    def _optimizer_step(self, critic: bool = False) -> tuple[float, float]:
        """Finish the DP gradient sum, clip, step at the scheduled lr (the critic: its constant critic_lr).
        Returns (grad_norm, lr)."""
        from megatron.core.distributed import finalize_model_grads  # Megatron: late

        model, optimizer = (self.critic, self.critic_optimizer) if critic else (self.model, self.optimizer)
        finalize_model_grads([model])  # DP all-reduce (SUM) + TP sum of qk-layernorm grads
        if critic:
            lr = float(self.cfg.critic_lr)
        else:
            lr = self.lr_override if self.lr_override is not None else lr_at(self.cfg, self.optim_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if self.cpu:
            for p in model.parameters():
                p.grad = p.main_grad if p.requires_grad else None  # DDP accumulated into main_grad
            grad_norm = cpu.clip_grad_norm(model, float(self.cfg.grad_clip or 0.0),
                                           self.tp_group if self.tp_size > 1 else None,
                                           self.pp_group if self.pp_size > 1 else None, bool(self.tcfg.num_moe_experts))
            optimizer.step()
            for p in model.parameters():
                p.grad = None  # else DDP's hook would add the next grads into main_grad twice
        else:
            ok, grad_norm, _ = optimizer.step()
            if not ok:
                raise RuntimeError(f"{'critic ' if critic else ''}optimizer step "
                                   f"{self.critic_steps if critic else self.optim_steps} skipped (inf/nan gradients)")
            grad_norm = float(grad_norm or 0.0)
            optimizer.zero_grad()
        model.zero_grad_buffer()
        if critic:
            self.critic_steps += 1
        else:
            self.optim_steps += 1
        return float(grad_norm), lr

    def _dp_sum(self, values: dict[str, float]) -> dict[str, float]:
        """Sum float dicts over DP ranks (keys may differ: a rank with no samples has none)."""
        if self.dp_size == 1:
            return dict(values)
        gathered = [None] * self.dp_size
        torch.distributed.all_gather_object(gathered, values, group=self.dp_group_gloo)
        out: dict[str, float] = {}
        for d in gathered:
            for k, v in d.items():
                out[k] = out.get(k, 0.0) + v
        return out

    # --- RL step ------------------------------------------------------------------------------------

    def train_step(self, batch: list[dict], step: int, targets: list[dict] | None = None) -> dict[str, float]:
        """One RL step on `batch` (all trajectories of the step, the same list on every rank).

        `step` is also the version of the weights this worker holds (one sync per step). 1. this DP rank's
        share, by group (plan_minibatches); old logp (unless use_rollout_logprobs) of every mini-batch but
        the first, and ref logp, in no-grad forwards before any update; 2. advantages
        (algos.compute_advantages, on the local groups); 3. for each mini-batch of global_batch_size
        samples: micro-batches of micro_batch_size, policy loss with the mini-batch's GLOBAL denominators,
        backward, one optimizer step; 4. the train-inference gap of the step's starting weights against
        the engine's logprobs. Returns `train/` metrics as python floats, reduced over DP ranks
        (identical on every rank).

        `targets`: teacher targets from teacher.py's `TeacherWorker.score`, one dict per sample of `batch`
        (same order), or None without teachers; see `_opd_terms`.
        """
        cfg = self.cfg
        self.onload()  # colocated: whatever the hand-off offloaded comes back before the step
        if not batch:
            raise ValueError("train_step got an empty batch; the controller must skip steps with no trajectories")
        if self.lent is not None:  # borrow_cores: count this step's layer passes from its first one
            self.lent.new_step()
        if targets is not None and float(cfg.gkd_ratio) == 1.0:  # TEACHERS: pure distillation, no RL forward
            return self.distill_step(batch, targets)
        n_groups = len({s.get("group_id", i) for i, s in enumerate(batch)})
        # never more mini-batches than groups: an empty one would still move Adam's weights (momentum)
        n_mb = max(1, min(n_groups, round(len(batch) / int(cfg.global_batch_size))))
        # from here on a row is one trainable segment (teachers score the top-level segment only: one row each)
        n_traj = len(batch)
        batch = segment_rows(batch) if targets is None else [{**t, "traj": i, "last": True} for i, t in enumerate(batch)]
        plan = plan_minibatches(batch, n_mb, self.dp_rank, self.dp_size, by_group=True)
        local = [batch[i] for mb in plan for i in mb]
        row_of = {i: j for j, i in enumerate(i for mb in plan for i in mb)}  # batch index -> row in `local`
        has_rollout = all(len(s.get("rollout_logprobs") or []) == len(s["response_ids"]) for s in batch)
        if cfg.use_rollout_logprobs and not has_rollout:
            raise ValueError("use_rollout_logprobs=True but some trajectories lack rollout_logprobs (one per "
                             "response token); set use_rollout_logprobs=False to recompute old logprobs")
        dp_group = self.dp_group_gloo if self.dp_size > 1 else None  # algos reduces small CPU tensors: gloo

        # --- 1. old/ref logprobs, before any update of this step (old-policy consistency: every mini-batch's
        #     old logp comes from the weights at the start of the step). The first mini-batch takes its old
        #     logp from its own training forward, detached: same weights, same numbers, ratio exactly 1, so
        #     only the later mini-batches pay a no-grad forward. KL-in-reward advantages need every old logp
        #     up front, and use_rollout_logprobs takes the engine's.
        first = set(range(len(plan[0]))) if not (cfg.recompute_old_logprobs or cfg.use_rollout_logprobs) and \
            not (cfg.kl_in_reward and cfg.kl_coef > 0) else set()  # rows of `local` in mini-batch 0
        if cfg.use_rollout_logprobs:
            old = [torch.tensor(s["rollout_logprobs"], dtype=torch.float) for s in local]  # behaviour = engine
        else:
            rest = [j for j in range(len(local)) if j not in first]
            computed = dict(zip(rest, self._logp_no_grad(self.model, [local[j] for j in rest])))
            old = [computed.get(j) for j in range(len(local))]  # None: filled by mini-batch 0's forward
        ref = self._logp_no_grad(self.ref_model, local) if self.ref_model is not None else None
        values = self.compute_values(local) if self.critic is not None else None  # CRITIC: V_old(s_t) per row

        # --- 2. advantages over this rank's whole groups (every rank calls: batch norm all-reduces), one per
        #     trajectory (its last segment's row); earlier segments share their trajectory's advantage
        zeros = [torch.zeros(len(s["response_ids"])) for s in local]
        if local:
            lasts = [j for j, s in enumerate(local) if s["last"]]
            lb = collate([local[j] for j in lasts], {
                "old_logp": [old[j] if old[j] is not None else zeros[j] for j in lasts],
                **({"ref_logp": [ref[j] for j in lasts]} if ref is not None else {}),
                **({"values": [values[j] for j in lasts]} if values is not None else {})})
            # reward shaping (DAPO overlong penalty, length penalties); identity with the defaults
            rewards = algos.shape_rewards(cfg, lb["rewards"], lb["loss_mask"].sum(1), lb["group_ids"],
                                          int(cfg.max_new_tokens))  # (B_traj,)
            tok_r = turn_token_rewards(cfg, [local[j] for j in lasts], rewards, lb["loss_mask"])  # (B_traj, R) or None
            adv = algos.compute_advantages(cfg, rewards, lb["group_ids"], lb["loss_mask"],
                                           old_logp=lb["old_logp"], ref_logp=lb.get("ref_logp"),
                                           values=lb.get("values"), token_rewards=tok_r,
                                           dp_group=dp_group)  # (B_traj, R) 0 where loss_mask == 0
            if values is not None:  # CRITIC: its targets R = raw GAE + V_old, one row per trained segment
                ret = algos.gae_returns(cfg, rewards, lb["group_ids"], lb["loss_mask"], lb["values"],
                                        old_logp=lb["old_logp"], ref_logp=lb.get("ref_logp"), token_rewards=tok_r)
                returns = segment_returns(local, lasts, ret)
            adv_of = {local[j]["traj"]: adv[b, :len(local[j]["response_ids"])] for b, j in enumerate(lasts)}
            adv_rows = [adv_of[s["traj"]] if s["last"] else
                        shared_advantage(adv_of[s["traj"]], s["loss_mask"]) for s in local]
        else:
            algos.compute_advantages(cfg, torch.zeros(0), torch.zeros(0, dtype=torch.long), torch.zeros(0, 1),
                                     old_logp=torch.zeros(0, 1), ref_logp=None, values=torch.zeros(0, 1),
                                     dp_group=dp_group)
            adv_rows, returns = [], []

        # --- 3. mini-batches: micro-batch losses with global denominators, one optimizer step each
        totals: dict[str, float] = {}
        before_update: dict[int, torch.Tensor] = {}  # row -> trainer logp under the step's starting weights
        mbs = int(cfg.micro_batch_size)
        newest = max(max(s.get("weight_versions") or [-1]) for s in batch)  # newest policy version in the batch
        self.model.train()
        policy_trains = self.critic is None or step >= int(cfg.critic_warmup_steps)  # CRITIC: warm-up trains it alone
        for mb_i, mine in enumerate(plan if policy_trains else []):
            denom = self._denominators(batch, n_mb, mb_i, by_group=True)
            sums: dict[str, float] = {}
            starts = self._ep_micro_starts(len(mine), mbs)
            parts = [mine[start:start + mbs] for start in starts if start < len(mine)]  # batch indices per micro-batch
            mb_rows = [[row_of[i] for i in part] for part in parts]  # rows of `local` per micro-batch
            micro = []
            for rows in mb_rows:
                extras = {"old_logp": [old[j] if old[j] is not None else zeros[j] for j in rows],
                          "adv": [adv_rows[j] for j in rows]}
                if ref is not None:
                    extras["ref_logp"] = [ref[j] for j in rows]
                micro.append(self._to_device(collate([local[j] for j in rows], extras,
                                                     routed_shape=self.routed_shape)))

            def micro_loss(i, mb, logp, entropy, logits):  # logp, entropy (b, R); on the last pipeline stage
                rows = mb_rows[i]
                if mb_i == 0:  # still the step's starting weights: this forward IS the old policy's
                    for b, j in enumerate(rows):
                        before_update[j] = logp.detach()[b, :len(local[j]["response_ids"])].cpu()
                old_logp = logp.detach() if rows[0] in first else mb["old_logp"]  # (b, R) 0 off the mask
                # TEACHERS (teacher.py): A' = A - pg_ratio * KL_token, and the GKD term; off without teachers
                opd = None
                if targets is not None:
                    opd = self._opd_terms(mb, logp, logits, [targets[k] for k in parts[i]], denom)
                    mb["adv"] = opd.pop("adv")
                stale = (mb["weight_versions"] >= 0) & (mb["weight_versions"] < newest)  # (b, R) older weights
                loss, m = algos.policy_loss(cfg, logp, old_logp, mb["adv"], mb["loss_mask"],
                                            rollout_logp=mb["rollout_logp"] if has_rollout else None,
                                            ref_logp=mb.get("ref_logp"), entropy=entropy, stale_mask=stale,
                                            denom=denom)
                if opd is not None:  # TEACHERS: L = (1 - gkd_ratio) * L_RL + gkd_ratio * L_GKD
                    loss = algos.opd_objective(cfg, loss, opd.pop("gkd_loss"))
                    m.update(opd)
                _add(sums, "loss", float(loss.detach()))
                for k, v in m.items():
                    _add(sums, k, float(v))
                return loss  # backward: _forward_backward
            self._forward_backward(self.model, micro, micro_loss, forward_only=False, return_logits=targets is not None)
            for _ in range(len(starts) - len(parts)):  # EP: another expert rank has micro-batches more
                self._ep_idle_microbatch(self.model, backward=True)
            self._step_minibatch(self._from_last_stage(sums), totals, n_mb)
        before_update = self._from_last_stage(before_update)
        # CRITIC: the value model regresses on R over the same mini-batches (clipped value loss), own optimizer
        critic_metrics = {} if values is None else self._critic_update(batch, plan, row_of, local, values, returns,
                                                                        n_mb)

        # --- 4. metrics: the train-inference gap under the step's starting weights, losses, norms
        if not cfg.use_rollout_logprobs:
            before_update.update({j: o for j, o in enumerate(old) if o is not None})
        # gap: numerics only, on the tokens sampled by these very weights (version == step); off-policy: every
        # token, so in async it also holds the policy's drift since the tokens were sampled
        gap_local: dict[str, float] = {}
        off_local: dict[str, float] = {}
        if has_rollout and before_update:
            rows = sorted(before_update)
            lb = collate([local[j] for j in rows], {"logp": [before_update[j] for j in rows]})
            versions = lb["weight_versions"]  # (b, R), -1 on padding
            first = torch.where(lb["loss_mask"] > 0, versions, torch.full_like(versions, 2 ** 30)).amin(
                dim=1, keepdim=True)  # (b, 1) the version of each row's first model token
            # a request that spanned an update went on over a KV cache that older weights computed (paused
            # "in_place", as SGLang does), so its newer tokens are not numerics only: rows sampled from the start
            on_policy = lb["loss_mask"] * (versions == step) * (first == step)  # (b, R)
            gap_local = self._gap_sums(lb["logp"], lb["rollout_logp"], on_policy)
            off_local = self._gap_sums(lb["logp"], lb["rollout_logp"], lb["loss_mask"])
        metrics = {f"train/{k}": v for k, v in totals.items()}
        gap = self._dp_sum({k: v for k, v in gap_local.items() if k != "max"})
        gap_max = self._dp_max(gap_local.get("max", 0.0))
        if gap.get("tokens", 0) > 0:
            metrics.update({"train/gap_k3": gap["k3"] / gap["tokens"], "train/gap_abs": gap["abs"] / gap["tokens"],
                            "train/gap_max": gap_max})
        off = self._dp_sum({k: v for k, v in off_local.items() if k != "max"})
        if off.get("tokens", 0) > 0:
            metrics["train/offpolicy_k3"] = off["k3"] / off["tokens"]
        metrics.update(self.lent.metrics() if self.lent else {})
        metrics.update({"train/num_minibatches": float(n_mb), "train/optim_steps": float(self.optim_steps),
                        "train/samples": float(n_traj), "train/rows": float(len(batch)), **critic_metrics})
        return metrics

    def _critic_update(self, batch, plan, row_of, local, old_values, returns, n_mb) -> dict[str, float]:
        """CRITIC: per mini-batch of the policy's plan, micro-batches of algos.value_loss (the clipped value loss
        with the mini-batch's GLOBAL token count, so DP ranks and micro-batches add up), then one critic
        optimizer step. `old_values` / `returns`: (R_j,) per row of `local`. Returns `critic/` metrics reduced over
        DP ranks: value_loss, clipfrac, grad_norm, lr (means over mini-batches), and before the update
        vf_explained_var and values_mean over every trained token."""
        cfg, mbs, totals = self.cfg, int(self.cfg.micro_batch_size), {}
        self.critic.train()
        for mb_i, mine in enumerate(plan):
            denom = self._denominators(batch, n_mb, mb_i, by_group=True)
            sums: dict[str, float] = {}
            for start in range(0, len(mine), mbs):
                rows = [row_of[i] for i in mine[start:start + mbs]]
                mb = self._to_device(collate([local[j] for j in rows], {"old_values": [old_values[j] for j in rows],
                                                                        "returns": [returns[j] for j in rows]}))
                v = self._forward_values(mb)  # (b, R) with grad
                loss, m = algos.value_loss(v, mb["old_values"], mb["returns"], mb["loss_mask"], float(cfg.value_clip),
                                           denom)
                loss.backward()
                for k, x in m.items():
                    _add(sums, k, float(x))
            self._step_minibatch(sums, totals, n_mb, critic=True)
        # the values the advantages used (before this update) against their targets, over every DP rank's tokens
        lb = collate(local, {"old_values": old_values, "returns": returns}) if local else \
            {k: torch.zeros(0, 1) for k in ("old_values", "returns", "loss_mask")}  # (B_local, R)
        ev = algos.explained_variance(lb["old_values"], lb["returns"], lb["loss_mask"],
                                      self.dp_group_gloo if self.dp_size > 1 else None)
        vsum = self._dp_sum({"v": float((lb["old_values"] * lb["loss_mask"]).sum()), "n": float(lb["loss_mask"].sum())})
        totals.update({"vf_explained_var": ev, "values_mean": vsum["v"] / max(vsum["n"], 1.0)})
        return {f"critic/{k}": v for k, v in totals.items()}

    # --- on-policy distillation (targets from teacher.py) ---------------------------------------------

    def set_teacher_heads(self, heads: dict[str, torch.Tensor]) -> None:
        """Keep each teacher's LM head (V, H), sent once: with full-vocabulary divergences the teachers
        send final hidden states and the student side turns them into logits (no V-sized logits travel)."""
        self.teacher_heads = {name: w.to(self.device) for name, w in heads.items()}

    def _opd_terms(self, mb: dict, logp, logits, targets: list[dict], denom: dict) -> dict:
        """The distillation pieces of one micro-batch: {"adv": A', "gkd_loss": L_GKD, metrics...}.

        logp (b, R) student logprobs of the sampled tokens (with grad); logits (b, R, V/tp) the student's.
        Each target dict holds (R_i,)/(R_i, K) tensors: teacher_logp, teacher_mask (1 where a teacher
        scored the token), teacher_topk_logp/ids, and in hidden mode teacher_hidden {name: (R_i, H)} and
        teacher_weight {name: (R_i,)}. Tokens without a teacher (route None, tool tokens) are left out.
        Metrics are token means over the mini-batch's global token count, so micro-batches sum up.
        """
        cfg = self.cfg
        t = collate_targets(targets, logp.size(1))  # (b, R) / (b, R, K) / per-teacher (b, R, H)
        t = {k: ({n: x.to(self.device) for n, x in v.items()} if isinstance(v, dict) else v.to(self.device))
             for k, v in t.items()}
        mask = mb["loss_mask"] * t["teacher_mask"]  # (b, R) distilled tokens
        if self.tp_size > 1:  # full-vocabulary divergences need the whole row: gather the vocab shards
            # Megatron: late
            from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
            logits = gather_from_tensor_model_parallel_region(logits, group=self.tp_group)  # (b, R, V)
        logits = logits.float()
        adv = mb["adv"]
        if float(cfg.pg_ratio) > 0:
            adv = algos.distill_advantage(cfg, mb["adv"], logp.detach(), t["teacher_logp"], mask)  # (b, R)
            adv = torch.where(mask > 0, adv, mb["adv"])  # (b, R) a token no teacher scored keeps its A
        teacher_logits = None
        if "teacher_hidden" in t:  # full vocabulary: teacher LM head applied here, mixture over teachers
            names = sorted(t["teacher_hidden"])
            logps = torch.stack([torch.log_softmax(t["teacher_hidden"][n].float() @ self.teacher_heads[n].float().T, -1)
                                 for n in names])  # (J, b, R, V)
            weights = torch.stack([t["teacher_weight"][n] for n in names])  # (J, b, R)
            weights = torch.where(mask.unsqueeze(0) > 0, weights, torch.full_like(weights, 1.0 / len(names)))
            teacher_logits = algos.mixture_logp(logps, weights)  # (b, R, V) log-probs of the target
        gkd, m = algos.distill_loss(cfg, logits, mask, denom, teacher_logits=teacher_logits,
                                    teacher_topk_logp=t.get("teacher_topk_logp"),
                                    teacher_topk_ids=t.get("teacher_topk_ids"))
        tok = lambda x: algos.aggregate(x.detach().float(), mask, "token_mean", denom)  # noqa: E731
        pg_kl = algos.sampled_reverse_kl(logp.detach(), t["teacher_logp"])  # (b, R)
        out = {"adv": adv, "gkd_loss": gkd, "opd_loss": m[f"distill_{cfg.distill_type}"],
               "opd_pg_kl": tok(pg_kl), "opd_kl": tok(algos.kl_estimate("k3", logp.detach(), t["teacher_logp"])),
               "opd_tokens": mask.sum().detach() / denom["tokens"]}
        if "teacher_topk_ids" in t:
            out["opd_topk_overlap"] = tok(algos.topk_overlap(logits.detach(), t["teacher_topk_ids"]))
        return out

    def distill_step(self, batch: list[dict], targets: list[dict]) -> dict[str, float]:
        """gkd_ratio = 1: pure distillation. No old/ref logprobs and no advantages (rewards are not used);
        per mini-batch the GKD loss (algos.distill_loss) with global denominators, one optimizer step."""
        cfg = self.cfg
        n_groups = len({s.get("group_id", i) for i, s in enumerate(batch)})
        n_mb = max(1, min(n_groups, round(len(batch) / int(cfg.global_batch_size))))
        plan = plan_minibatches(batch, n_mb, self.dp_rank, self.dp_size, by_group=True)
        mbs, totals = int(cfg.micro_batch_size), {}
        self.model.train()
        for mb_i, mine in enumerate(plan):
            denom = self._denominators(batch, n_mb, mb_i, by_group=True)
            sums: dict[str, float] = {}
            starts = self._ep_micro_starts(len(mine), mbs)
            parts = [mine[start:start + mbs] for start in starts if start < len(mine)]  # batch indices per micro-batch
            zero_adv = [[torch.zeros(len(batch[i]["response_ids"])) for i in idx] for idx in parts]  # unused by GKD
            micro = [self._to_device(collate([batch[i] for i in idx], {"adv": adv}, routed_shape=self.routed_shape))
                     for idx, adv in zip(parts, zero_adv)]

            def micro_loss(i, mb, logp, entropy, logits):  # (b, R), (b, R), (b, R, V/tp); last pipeline stage
                opd = self._opd_terms(mb, logp, logits, [targets[j] for j in parts[i]], denom)
                opd.pop("adv")
                loss = opd.pop("gkd_loss")
                _add(sums, "loss", float(loss.detach()))
                _add(sums, "entropy", float(algos.aggregate(entropy.detach(), mb["loss_mask"], "token_mean", denom)))
                for k, v in opd.items():
                    _add(sums, k, float(v))
                return loss
            self._forward_backward(self.model, micro, micro_loss, forward_only=False, return_logits=True)
            for _ in range(len(starts) - len(parts)):  # EP: another expert rank has micro-batches more
                self._ep_idle_microbatch(self.model, backward=True)
            self._step_minibatch(self._from_last_stage(sums), totals, n_mb)
        metrics = {f"train/{k}": v for k, v in totals.items()}
        metrics.update(self.lent.metrics() if self.lent else {})
        metrics.update({"train/num_minibatches": float(n_mb), "train/optim_steps": float(self.optim_steps),
                        "train/samples": float(len(batch))})
        return metrics

    def _step_minibatch(self, sums: dict[str, float], totals: dict[str, float], n_mb: int,
                        critic: bool = False) -> None:
        """End a mini-batch: one optimizer step (of the critic with `critic`), then its DP-summed metric sums and
        grad norm into the step's means over `n_mb` mini-batches (`totals`, updated in place; lr is the last one's)."""
        grad_norm, lr = self._optimizer_step(critic)
        for k, v in self._dp_sum(sums).items():
            _add(totals, k, v / n_mb)
        _add(totals, "grad_norm", grad_norm / n_mb)
        totals["lr"] = lr

    def _denominators(self, batch: list[dict], n_mb: int, mb_i: int, by_group: bool) -> dict[str, float]:
        """GLOBAL counts of mini-batch `mb_i` over all DP ranks, from the full batch every rank holds.

        tokens: loss-mask tokens; seqs: samples with at least one loss token (as
        algos.global_denominators counts them); max_len: cfg.max_new_tokens, the constant length
        normaliser of seq_mean_token_sum (Dr. GRPO).
        """
        idx = plan_minibatches(batch, n_mb, 0, 1, by_group)[mb_i]  # the whole mini-batch: as if one DP rank
        counts = [sum(batch[i]["loss_mask"]) for i in idx]
        max_len = self.cfg.max_new_tokens
        return {"tokens": float(max(sum(counts), 1)), "seqs": float(max(sum(c > 0 for c in counts), 1)),
                "max_len": float(max_len)}

    def _gap_sums(self, train_logp, rollout_logp, loss_mask) -> dict[str, float]:
        """algos.gap_metrics on this rank's tokens, as token-weighted sums ready for a DP sum."""
        n = float(loss_mask.sum())
        if n == 0:
            return {}
        g = algos.gap_metrics(train_logp, rollout_logp, loss_mask)
        return {"k3": g["k3"] * n, "abs": g["abs_diff"] * n, "max": g["max_abs_diff"], "tokens": n}

    def _dp_max(self, value: float) -> float:
        if self.dp_size == 1:
            return float(value)
        t = torch.tensor([float(value)], dtype=torch.float64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.dp_group_gloo)
        return float(t)

    # --- SFT step -----------------------------------------------------------------------------------

    def sft_step(self, batch: list[dict]) -> dict[str, float]:
        """One optimizer step of cross-entropy on the loss_mask tokens of `batch` (algos.sft_loss,
        token mean over the whole batch); samples dealt to DP ranks one by one. Warm-starts the tiny model."""
        plan = plan_minibatches(batch, 1, self.dp_rank, self.dp_size, by_group=False)[0]
        denom = self._denominators(batch, 1, 0, by_group=False)
        sums: dict[str, float] = {}
        mbs = int(self.cfg.micro_batch_size)
        self.model.train()
        starts = self._ep_micro_starts(len(plan), mbs)
        micro = [self._to_device(collate([batch[i] for i in plan[start:start + mbs]])) for start in starts
                 if start < len(plan)]

        def micro_loss(i, mb, logp, entropy, logits):  # (b, R) each; last pipeline stage
            loss = algos.sft_loss(logp, mb["loss_mask"], denom)
            _add(sums, "sft_loss", float(loss.detach()))
            _add(sums, "entropy", float((entropy.detach() * mb["loss_mask"]).sum()) / denom["tokens"])
            return loss
        self._forward_backward(self.model, micro, micro_loss, forward_only=False)
        for _ in range(len(starts) - len(micro)):  # EP: another expert rank has micro-batches more
            self._ep_idle_microbatch(self.model, backward=True)
        grad_norm, lr = self._optimizer_step()
        metrics = {f"train/{k}": v for k, v in self._dp_sum(self._from_last_stage(sums)).items()}
        metrics.update({"train/grad_norm": grad_norm, "train/lr": lr})
        return metrics

    # --- weights out --------------------------------------------------------------------------------

    def export_hf_weights(self) -> list[tuple[str, torch.Tensor]]:
        """HF-named full tensors (CPU) on rank 0, [] elsewhere. Every rank must call it: TP shards are
        all-gathered within each TP group (only data-parallel replica 0's result is kept); with expert
        parallelism each rank holds num_experts / EP experts, so expert tensors are first gathered within the
        expert-tensor-parallel group, then all-gathered across the expert-parallel group (whose ranks are
        different data-parallel replicas of the dense layers, so then every rank takes part). With pipeline
        parallelism each stage's TP rank 0 gathers its layers (named as in the full model) and the stages'
        tensors meet on rank 0 (the first stage's) through the pipeline group."""
        from megatron.core import parallel_state  # Megatron: late
        self.onload(["weights"])  # colocated: a re-created engine may need them while they are offloaded
        ep_rank, ep_size, _, etp_size = self._expert_rank_info()
        gpt = self.model.module
        keep = self.rank == 0 if self.pp_size == 1 else self.tp_rank == 0  # dp_rank is 0 from here on
        if self.dp_rank != 0 and ep_size == 1:  # another replica: same weights, no need to gather
            return []
        full = {}
        etp_group = parallel_state.get_expert_tensor_parallel_group() if self.tcfg.num_moe_experts else None
        ep_group = parallel_state.get_expert_model_parallel_group() if ep_size > 1 else None
        n_local = (self.tcfg.num_moe_experts or 0) // ep_size
        with torch.no_grad():
            for name, p in gpt.named_parameters():
                if ".local_experts." not in name:
                    t = convert.gather_full(name, p.detach(), self.tp_group if self.tp_size > 1 else None)
                    if keep:
                        full[self._global_name(name)] = t.cpu()
                    continue
                t = convert.gather_full(name, p.detach(), etp_group if etp_size > 1 else None)
                head, rest = name.split(".local_experts.")
                local_e, tail = rest.split(".", 1)
                parts = [t]
                if ep_group is not None:  # EP rank r holds global experts r*n_local .. (r+1)*n_local - 1
                    parts = [torch.empty_like(t) for _ in range(ep_size)]
                    torch.distributed.all_gather(parts, t.contiguous(), group=ep_group)
                if keep:
                    for r, part in enumerate(parts):
                        global_e = r * n_local + int(local_e)
                        full[self._global_name(f"{head}.local_experts.{global_e}.{tail}")] = part.cpu()
        if self.pp_size > 1:  # every stage of this TP rank's pipeline sends its layers; rank 0 merges them
            stages = [None] * self.pp_size
            torch.distributed.all_gather_object(stages, full, group=self.pp_group)
            full = {k: v for stage in stages for k, v in stage.items()}
            keep = self.rank == 0
        return convert.megatron_to_hf(full, self.hf_config) if keep else []

    def sync_weights(self, engine_urls: list[str], version: int) -> dict:
        """Push the current weights to the rollout engines (rank 0 sends; the others join the gather)."""
        named = self.export_hf_weights()
        if self.rank != 0:
            return {}
        # SGLang engines run with tensor parallel size tp_size (cfg.gpus_per_engine unless cfg.sglang sets it);
        # the CPU engine is one rank
        sglang = self.cfg.engine == "sglang" or (self.cfg.engine == "auto" and torch.cuda.is_available())
        tp = int((self.cfg.sglang or {}).get("tp_size") or self.cfg.gpus_per_engine) if sglang else 1
        return transfermesh.push_weights(named, [(u, tp) for u in engine_urls], version, transport=self.cfg.transfer,
                                         bucket_mb=self.cfg.bucket_mb, config_dir=self.hf_path)

    def save_hf(self, path: str) -> str:
        """Write an HF model directory (safetensors + the source dir's config and tokenizer files)."""
        named = self.export_hf_weights()
        if self.rank == 0:
            convert.save_hf_dir(named, path, self.hf_path)
        torch.distributed.barrier()
        return str(path)

    # --- checkpoints --------------------------------------------------------------------------------

    def save_checkpoint(self, directory: str) -> str:
        """This rank's model shard, optimizer state, LR schedule position (optimizer steps taken), the critic's
        shard and optimizer state (advantage: gae) and python / numpy / torch RNG states, in one file per rank
        (call on all ranks). The frozen reference is not saved: load_hf() rebuilds it from the HF dir before
        load_checkpoint. The file is written under a temporary name and renamed, so a rank file that exists is
        complete; the controller's `latest` marker (loongsage.save_run_state) names the newest complete
        checkpoint directory."""
        self.onload()
        os.makedirs(directory, exist_ok=True)
        path = Path(directory) / f"rank_{self.rank:05d}.pt"
        rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
        if torch.cuda.is_available() and not self.cpu:
            rng["cuda"] = torch.cuda.get_rng_state()
        critic = {} if self.critic is None else {  # CRITIC: its weights and optimizer travel in the same file
            "critic": self.critic.module.state_dict(), "critic_optimizer": self.critic_optimizer.state_dict(),
            "critic_steps": self.critic_steps}
        torch.save({"model": self.model.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "optim_steps": self.optim_steps, "lr_override": self.lr_override, "rng": rng,
                    "world_size": self.world_size, "tensor_parallel": self.tp_size, **critic}, str(path) + ".tmp")
        os.replace(str(path) + ".tmp", path)
        torch.distributed.barrier()
        return str(path)

    def load_checkpoint(self, directory: str) -> int:
        """Restore what save_checkpoint wrote (same world size and TP), after load_hf() built the model.
        Returns the optimizer step count (the LR schedule continues from it)."""
        path = Path(directory) / f"rank_{self.rank:05d}.pt"
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist; checkpoints are per rank, so resume with the "
                                    f"world size they were saved with")
        if self.model is None:
            raise RuntimeError("load_checkpoint needs the model built first: call load_hf(model dir) before it")
        self.onload()
        state = torch.load(path, map_location=self.device, weights_only=False)
        if (state["world_size"], state["tensor_parallel"]) != (self.world_size, self.tp_size):
            raise ValueError(f"checkpoint {directory} was saved with world_size={state['world_size']}, "
                             f"tensor_parallel={state['tensor_parallel']}; this run has {self.world_size}, "
                             f"{self.tp_size}. Resume with the same layout")
        self.model.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.optim_steps = int(state["optim_steps"])
        self.lr_override = state.get("lr_override")
        if self.critic is not None:
            if "critic" not in state:
                raise ValueError(f"checkpoint {directory} has no critic (it was saved by a run without "
                                 "advantage='gae'); resume it with its own advantage, or start this gae run in a new "
                                 "output_dir")
            self.critic.module.load_state_dict(state["critic"])
            self.critic_optimizer.load_state_dict(state["critic_optimizer"])
            self.critic_steps = int(state["critic_steps"])
        rng = state["rng"]
        if isinstance(rng, torch.Tensor):  # checkpoints written before python/numpy states were kept
            rng = {"torch": rng}
        torch.set_rng_state(rng["torch"].cpu())
        if "python" in rng:
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
        if "cuda" in rng and torch.cuda.is_available() and not self.cpu:
            torch.cuda.set_rng_state(rng["cuda"].cpu())
        return self.optim_steps

    def shutdown(self) -> None:
        from megatron.core import parallel_state  # Megatron: late
        parallel_state.destroy_model_parallel()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _add(d: dict[str, float], key: str, value: float) -> None:
    d[key] = d.get(key, 0.0) + value
