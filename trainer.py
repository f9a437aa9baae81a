"""The Megatron-Core trainer: one `TrainerWorker` per rank, wrapped with `ray.remote` by the controller.

Top to bottom (HF <-> Megatron conversion and model building are in convert.py, CPU stand-ins in cpu.py): the logp /
entropy of vocab-parallel logits and MoE routing replay (R3); batches (`collate`, `segment_rows`, `plan_minibatches`,
global denominators, the lr schedule); `opd_terms`, the student side of distillation; the rooms a rank is made of, small
classes used by composition: `Parallel` (this rank's place in the layout), `Model` (one GPTModel: build, load shards,
`run` = the one micro-batch loop, `stream_full` for the weight sync; the policy, reference, critic and teacher skeletons
are one each), `Optim`, `Critic` (a `ValueHead` in place of the LM head), `HandOff` (colocated offload / onload),
`Export` (weights out: sync, HF save); and `TrainerWorker`: load, `train_step`, `distill_step`, `sft_step`, checkpoints.

Micro-batches are right-padded (B, T) prompt+response ids (a causal mask alone is then exact), or with
`max_tokens_per_micro_batch` packed back to back in Megatron's THD layout (`Model._packed_output`); either way the
outputs are read at the same response positions. Per-token tensors handed to algos.py are response-aligned (B, R),
`loss_mask` 0 on padding and tool tokens.

Gradients across data-parallel ranks are SUMMED, never averaged: `calculate_per_token_loss=True` makes Megatron's
DDP reduce with factor 1.0, and each micro-batch loss is already divided by GLOBAL mini-batch counts (`denom`), so
a batch yields the same gradient on 1 data-parallel rank or N.

Parallel layouts: TP, DP, PP (`Model.run` uses Megatron-Core's 1F1B schedule), EP (expert ranks kept in step with
padding-only micro-batches), sequence parallelism, and on CUDA with TE's spec CP (`cp_positions`, outputs gathered
back into whole sequences by `GatherSequence`); the distributed optimizer (`Optim`); recomputation (a
TransformerConfig setting, convert.megatron_config).

Test: `.venv/bin/pytest tests/test_trainer.py` (real Ray actors, real Megatron-Core over gloo; parity
against transformers, TP=2 and DP=2 equivalence, HF round trip, checkpoint resume), tests/test_pipeline.py
(PP=2 against one rank), tests/test_moe.py (EP=2 against one rank, R3), tests/test_critic.py, tests/test_lora.py.
Left out (each rejected at `--check`): CP and the distributed optimizer on CPU, CP with EP, R3 with SP or CP, virtual
pipeline stages, PP with EP, PP with tied embeddings, packed sequences with PP, CP, EP or R3, the critic with PP or
EP; and an HF export of the critic (it lives in the Megatron checkpoints only).
"""
from __future__ import annotations

import base64
import contextlib
import itertools
import math
import os
import random
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import xxhash

import algos
import convert
import cpu
import lora
import transfermesh
# Megatron-Core is imported inside the functions that use it (`# Megatron: late`): it takes ~2 s to import, a cost
# for the trainer actors only, while the controller imports this module (loongsage, teacher) and builds no model.

# Megatron-Core warns on import that Transformer Engine / Apex are absent and it falls back to plain torch:
# that fallback is exactly what this worker uses (local layer spec), so the warning carries no news.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")


def replay_routing(model, routed: torch.Tensor | None) -> None:
    """R3 (rollout routing replay): make every MoE router of `model` route the next forward with the engine's
    experts. routed: (B, T, L, K) global expert ids per token and layer (collate), or None to switch replay off.
    Megatron-Core 0.16's RouterReplay (REPLAY_FORWARD) takes the indices as given and gathers the router's own scores
    at them, so the gating keeps its gradient. Its class-level helpers address every router in the process (the
    reference's too): this sets each router's own instance, by global layer number. Rows are sequence-first."""
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


# ----------------------------------------------------------------------------------------------
# log-probabilities and entropy from (vocab-parallel) logits


def vocab_parallel_logp_entropy(logits: torch.Tensor, labels: torch.Tensor, tp_group):
    """(logp, entropy), both (B, T) fp32, of `labels` under logits split over the vocab across TP ranks.

    logits: (B, T, V/tp), this rank's contiguous vocab slice; labels: (B, T) global token ids.
    log p(y) = z_y - log sum_v exp(z_v) with z = logits - max; entropy H = log Z - sum_v p_v z_v.
    Vocab sums are all-reduced over TP with Megatron's `reduce_from_tensor_model_parallel_region` (backward is the
    identity: every TP rank computes the same replicated loss)."""
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


def cp_positions(T: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """The positions of a length-T sequence that CP rank `cp_rank` computes: 2*cp_size equal chunks, rank r holding
    chunks r and 2*cp_size-1-r (equal causal attention work; TE's and Megatron's RoPE layout). T: a multiple of
    2*cp_size. Returns (T/cp_size,) positions."""
    c = T // (2 * cp_size)
    late = 2 * cp_size - 1 - cp_rank
    return torch.cat([torch.arange(cp_rank * c, (cp_rank + 1) * c), torch.arange(late * c, (late + 1) * c)])


class GatherSequence(torch.autograd.Function):
    """`GatherSequence.apply(x, group)`: (B, T/cp, ...) this CP rank's share of dim 1 (`cp_positions`) -> (B, T, ...)
    whole sequences. Every rank computes the same loss, so a rank's gradient is the slice at its own positions (not a
    sum over ranks)."""

    @staticmethod
    def forward(ctx, x, group):
        size, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
        T = x.size(1) * size
        parts = [torch.empty_like(x) for _ in range(size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=group)  # size x (B, T/cp, ...)
        whole = x.new_empty((x.size(0), T, *x.shape[2:]))  # (B, T, ...)
        for r, part in enumerate(parts):
            whole[:, cp_positions(T, r, size).to(x.device)] = part
        ctx.mine = cp_positions(T, rank, size).to(x.device)
        return whole

    @staticmethod
    def backward(ctx, grad):
        return grad[:, ctx.mine], None  # (B, T/cp, ...)


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

    Returns tokens (B, T) prompt+response ids; resp_pos (B, R): index into the shifted logp row (B, T-1) of each
    response token; the response-aligned (B, R) loss_mask (1 on model-generated tokens, 0 on tool tokens and
    padding), rollout_logp, weight_versions and any `per_token` extras (1-D tensors per sample, padded with 0);
    rewards (B,) and group_ids (B,). A trajectory that failed before its first model call is a row of padding with
    loss_mask all 0; R and T are at least 1 and 2, so a micro-batch of only such rows has a position to gather.

    `routed_shape` = (layers, top_k) with router replay: routed_experts (B, T, L, K), each sample's engine routing;
    positions the engine never ran on hold experts 0..K-1, which no loss token attends to.
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
                resp_len=torch.tensor(rlen),
                seq_len=torch.tensor([p + r for p, r in zip(plen, rlen)], dtype=torch.long), **out)


def segment_rows(batch: list[dict]) -> list[dict]:
    """Every trainable segment of every trajectory as its own row. A trajectory whose agent compacted or edited its
    history has several segments (the last is its top-level fields); each earlier one with model tokens trains with
    its trajectory's advantage. `traj` indexes the trajectory in `batch`; `last` marks the row the advantage is
    computed on (group statistics count each trajectory once). A failed trajectory's earlier segments make no rows."""
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

    Groups (samples sharing a group_id, in order of first appearance; each sample alone when not by_group) are split
    into `n_minibatches` consecutive global mini-batches, whose groups are dealt round-robin to the DP ranks, so 1
    rank and N step on the same samples. A rank may get an empty share; it still joins the all-reduce. Each share is
    sorted by length (ties keep batch order) so its micro-batches pad little; with global denominators the order
    changes only the order of floating-point additions.
    """
    groups: dict[Any, list[int]] = {}
    for i, s in enumerate(batch):
        groups.setdefault(s.get("group_id", i) if by_group else i, []).append(i)
    order = list(groups.values())
    length = [len(s.get("prompt_ids", ())) + len(s.get("response_ids", ())) for s in batch]
    q, r = divmod(len(order), n_minibatches)  # consecutive spans of groups, sizes differing by at most one
    bounds = [0, *itertools.accumulate(q + (1 if i < r else 0) for i in range(n_minibatches))]
    return [sorted((i for g in order[a:b][dp_rank::dp_size] for i in g), key=length.__getitem__)
            for a, b in zip(bounds, bounds[1:])]


def lr_at(cfg, it: int) -> float:
    """Learning rate of optimizer step `it` (0-based): linear warmup over cfg.lr_warmup_steps, then a
    cosine from cfg.lr down to cfg.min_lr over the whole run (cfg.num_steps RL steps of rollout samples /
    global_batch_size optimizer steps each, at least 1); constant when min_lr == lr."""
    warmup = int(cfg.lr_warmup_steps or 0)
    if it < warmup:
        return cfg.lr * (it + 1) / warmup
    if cfg.min_lr == cfg.lr:
        return cfg.lr
    per_step = max(1, round(int(cfg.prompts_per_step) * int(cfg.samples_per_prompt) / int(cfg.global_batch_size)))
    total = int(cfg.num_steps) * per_step
    frac = min(1.0, (it - warmup) / max(1, total - warmup))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * frac))


def n_minibatches(cfg, batch: list[dict]) -> int:
    """Mini-batches (optimizer steps) for this batch: samples / global_batch_size, at least 1 and never more than
    the groups (an empty mini-batch would still move Adam's weights through its momentum)."""
    n_groups = len({s.get("group_id", i) for i, s in enumerate(batch)})
    return max(1, min(n_groups, round(len(batch) / int(cfg.global_batch_size))))


def denominators(cfg, batch: list[dict], n_mb: int, mb_i: int, by_group: bool) -> dict[str, float]:
    """algos.global_denominators of mini-batch `mb_i` over all DP ranks, from the full batch every rank holds (no
    all-reduce), with max_len = cfg.max_new_tokens (Dr. GRPO's constant normaliser)."""
    idx = plan_minibatches(batch, n_mb, 0, 1, by_group)[mb_i]  # the whole mini-batch: as if one DP rank
    return algos.global_denominators([sum(batch[i]["loss_mask"]) for i in idx], cfg.max_new_tokens)


def gap_sums(train_logp, rollout_logp, loss_mask) -> dict[str, float]:
    """algos.gap_metrics on this rank's tokens, as token-weighted sums ready for a DP sum."""
    n = float(loss_mask.sum())
    if n == 0:
        return {}
    g = algos.gap_metrics(train_logp, rollout_logp, loss_mask)
    return {"k3": g["k3"] * n, "abs": g["abs_diff"] * n, "max": g["max_abs_diff"], "tokens": n}


def add_up(dicts) -> dict[str, float]:
    """The per-key sums of float dicts (metric sums of micro-batches), added in order."""
    out: dict[str, float] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return out


# ----------------------------------------------------------------------------------------------
# checkpoint files: written durably, checked against their manifest, and the drills' fault points


def write_durable(path: Path, write) -> list:
    """`write(f)` into `path`.tmp, fsync, rename into place, fsync the directory: a crash at any moment leaves the
    old file or the new one, never a part, and a rename that returned survives a power cut. Returns `digest(path)`,
    what a checkpoint's manifest records of the file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except RuntimeError as e:  # torch.save's zip writer turns a failed write (disk full) into a RuntimeError
        raise e.__context__ if isinstance(e.__context__, OSError) else e
    os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself
    finally:
        os.close(fd)
    return digest(path)


def digest(path: Path) -> list:
    """[bytes, xxh3-64 hex] of a file: xxh3 hashes faster than a disk reads, so a check costs one read."""
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return [path.stat().st_size, h.hexdigest()]


def verify(path: Path, want: list) -> None:
    """Refuse a checkpoint file that is not what its manifest says was written (truncated by a failed copy,
    corrupted on disk), naming the file: a load would train on garbage, or fail somewhere less clear."""
    got = digest(path) if path.exists() else None
    if got != list(want):
        seen = "missing" if got is None else f"{got[0]} bytes with xxh3 {got[1]}"
        raise ValueError(f"checkpoint file {path} is {seen}; its manifest says {want[0]} bytes with xxh3 {want[1]} "
                         "(truncated, corrupted or replaced). Set resume=previous to go on from the checkpoint before")


def fault(point: str, step: int | None, rank: int | None = None, detail: str = "") -> None:
    """A drill's kill -9 (or SIGSTOP) at a named point (tests/test_recover.py). LOONGSAGE_FAULT=point[:rank][@step]
    strikes the process that reaches `point` at step `step` (at any step without @), saying so on stderr first.
    In the save of a step: `model` (rank r wrote its model file, not yet its optimizer file), `optim` (rank r wrote
    both), `controller` (every rank wrote its files, the controller none of its own), `latest` (everything is
    written but the `latest` marker). In the weight sync to version `step` (an engine holding version step-1, so
    not one re-created meanwhile, which starts from 0): `sync` (engine r loaded the first bucket and has not
    answered), `stall` (the same point, SIGSTOP: a hung engine, not a dead one), `push` (trainer rank r gathered
    every tensor; rank 0 has handed the engines every bucket but the last). In train step `step`: `step` (rank r
    ran the step's forwards, not its update: the others block in the update's gradient all-reduce). `teacher`
    (teacher rank r, in its group's score call `step`, counted from 0 by each group, so a re-created group is not
    struck at once: one teacher scored the batch, another has not)."""
    where, _, at = os.environ.get("LOONGSAGE_FAULT", "").partition("@")
    here = point + ("" if rank is None else f":{rank}")
    if where == here and (not at or step == int(at)):
        print(f"LOONGSAGE_FAULT={where}{'@' + at if at else ''} strikes{': ' + detail if detail else ''}",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSTOP if point == "stall" else signal.SIGKILL)


def push_fault(stream, version: int, rank: int):
    """`stream`, then the drill point `push` (fault): every bucket but the last has left for the engines."""
    yield from stream
    fault("push", version, rank, f"rank {rank} sent every bucket of weight version {version} but the last")


# ----------------------------------------------------------------------------------------------
# on-policy distillation, the student side (targets from teacher.py)


def opd_terms(cfg, mb: dict, logp, logits, targets: list[dict], denom: dict, heads: dict[str, torch.Tensor],
              tp_group=None) -> dict:
    """The distillation pieces of one micro-batch: {"adv": A', "gkd_loss": L_GKD, metrics...}.

    logp (b, R) student logprobs of the sampled tokens (with grad); logits (b, R, V/tp) the student's (vocab split
    over `tp_group`, None at TP=1). Each target dict holds (R_i,)/(R_i, K) tensors (collate_targets); `heads` {name:
    LM head (V, H)} turns hidden-mode teacher states into logits. Tokens without a teacher (teacher_mask 0) are left
    out. Metrics are token means over the mini-batch's global token count, so micro-batches sum up.
    """
    t = collate_targets(targets, logp.size(1))  # (b, R) / (b, R, K) / per-teacher (b, R, H)
    t = {k: ({n: x.to(logp.device) for n, x in v.items()} if isinstance(v, dict) else v.to(logp.device))
         for k, v in t.items()}
    mask = mb["loss_mask"] * t["teacher_mask"]  # (b, R) distilled tokens
    if tp_group is not None:  # full-vocabulary divergences need the whole row: gather the vocab shards
        # Megatron: late
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
        logits = gather_from_tensor_model_parallel_region(logits, group=tp_group)  # (b, R, V)
    logits = logits.float()
    adv = mb["adv"]
    if float(cfg.pg_ratio) > 0:
        adv = algos.distill_advantage(cfg, mb["adv"], logp.detach(), t["teacher_logp"], mask)  # (b, R)
        adv = torch.where(mask > 0, adv, mb["adv"])  # (b, R) a token no teacher scored keeps its A
    teacher_logits = None
    if "teacher_hidden" in t:  # full vocabulary: teacher LM head applied here, mixture over teachers
        names = sorted(t["teacher_hidden"])
        logps = torch.stack([torch.log_softmax(t["teacher_hidden"][n].float() @ heads[n].float().T, -1)
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


# ----------------------------------------------------------------------------------------------
# this rank in Megatron's layout


class Parallel:
    """This process's place in Megatron-Core's rank layout (TP varies fastest, then CP, then DP with EP inside it,
    then PP), and the collectives the workers' metrics use. A trainer rank and a teacher rank build one each."""

    def __init__(self, cfg, rank: int, world_size: int, master_addr: str, master_port: int):
        self.rank, self.world_size = rank, world_size
        self.on_cpu = cpu.apply_cpu_shims()  # first: it imports Megatron on CPU
        from megatron.core import parallel_state  # Megatron: late
        if cfg.trainer_threads > 0:  # see Config.trainer_threads: sync uses every core
            torch.set_num_threads(int(cfg.trainer_threads))
        tp, pp, ep = int(cfg.tensor_parallel), int(cfg.pipeline_parallel), int(cfg.expert_parallel)
        cp = int(cfg.context_parallel)  # the layout itself is checked at --check (config.check_pipeline, finalize)
        if self.on_cpu:
            self.device = torch.device("cpu")
        else:
            torch.cuda.set_device(rank % torch.cuda.device_count())
            self.device = torch.device("cuda", torch.cuda.current_device())
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("gloo" if self.on_cpu else "nccl", rank=rank, world_size=world_size,
                                                 init_method=f"tcp://{master_addr}:{master_port}")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                 context_parallel_size=cp, expert_model_parallel_size=ep)
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_size = tp
        self.dp_group_gloo = parallel_state.get_data_parallel_group_gloo()  # for python-object collectives
        self.dp_rank = parallel_state.get_data_parallel_rank()  # CP ranks of one replica share it: the same rows
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.cp_size, self.cp_rank = cp, parallel_state.get_context_parallel_rank()
        self.cp_group = parallel_state.get_context_parallel_group() if cp > 1 else None
        # EP > 1: the allgather token dispatcher pairs up the expert ranks' forwards, so they must run as many, of the
        # same shapes; Model.run and Model.output pad them to that (None: no padding needed)
        self.ep_group = parallel_state.get_expert_tensor_and_model_parallel_group() if ep > 1 else None
        self.pp_size, self.pp_group = pp, parallel_state.get_pipeline_model_parallel_group()
        self.pre_process = parallel_state.is_pipeline_first_stage()   # this stage holds the embedding
        self.post_process = parallel_state.is_pipeline_last_stage()   # ... the final norm, output layer, logp
        self.pp_last_rank = parallel_state.get_pipeline_model_parallel_last_rank()  # global rank of that stage
        torch.manual_seed(int(cfg.seed))
        if not self.on_cpu:
            from megatron.core import tensor_parallel  # Megatron: late
            tensor_parallel.model_parallel_cuda_manual_seed(int(cfg.seed))

    def experts(self, num_experts: int | None) -> tuple[int, int, int, int]:
        """(EP rank, EP size, expert-TP rank, expert-TP size) of this rank; (0, 1, 0, 1) for a dense model."""
        from megatron.core import parallel_state  # Megatron: late
        if not num_experts:
            return 0, 1, 0, 1
        return (parallel_state.get_expert_model_parallel_rank(),
                parallel_state.get_expert_model_parallel_world_size(),
                parallel_state.get_expert_tensor_parallel_rank(),
                parallel_state.get_expert_tensor_parallel_world_size())

    def dp_sum(self, values: dict[str, float]) -> dict[str, float]:
        """Sum float dicts over DP ranks (keys may differ: a rank with no samples has none)."""
        if self.dp_size == 1:
            return dict(values)
        gathered = [None] * self.dp_size
        torch.distributed.all_gather_object(gathered, values, group=self.dp_group_gloo)
        return add_up(gathered)

    def dp_max(self, value: float) -> float:
        if self.dp_size == 1:
            return float(value)
        t = torch.tensor([float(value)], dtype=torch.float64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.dp_group_gloo)
        return float(t)

    def shutdown(self) -> None:
        from megatron.core import parallel_state  # Megatron: late
        parallel_state.destroy_model_parallel()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# one GPTModel on this rank, and the one micro-batch loop


PHASES = ("collate", "forward", "backward", "optimizer", "step")  # the trainer's step timeline (Model.timings)


@contextlib.contextmanager
def timed(clock: dict[str, list[float]], key: str):
    """Adds the block's [wall, CPU] seconds to clock[key]; CPU is the process's, every torch thread: core-seconds."""
    wall, core = time.perf_counter(), time.process_time()
    yield
    clock[key] = [a + b for a, b in zip(clock.get(key, [0.0, 0.0]), (time.perf_counter() - wall,
                                                                      time.process_time() - core))]


class Model:
    """One GPTModel on this rank (this pipeline stage's share), forward only until `wrap_ddp` makes it trainable:
    `load` this rank's shards of full HF-converted weights, `run` micro-batches (the one loop every pass uses),
    `stream_full` back as full tensors one at a time."""

    def __init__(self, par: Parallel, tcfg, model_kwargs: dict, micro_batch_size: int, fp32_lm_head: bool = False,
                 replay: bool = True, max_tokens: int = 0):
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset  # Megatron: late
        self.par, self.tcfg, self.micro_batch_size = par, tcfg, int(micro_batch_size)
        self.max_tokens = int(max_tokens)  # > 0: packed micro-batches of at most this many tokens (run, _packed_output)
        self.tokens = [0, 0]  # [real tokens, tokens computed] of every forward: what padding costs (pad_frac)
        self.clock: dict[str, list[float]] = {}  # phase -> [wall, CPU] seconds since the last `timings` (PHASES)
        self.gpt = convert.build_gpt_model(tcfg, model_kwargs, par.device, par.pre_process, par.post_process,
                                           fp32_lm_head=fp32_lm_head)
        self.module = self.gpt  # what a forward calls: the GPTModel, or Megatron's DDP around it (wrap_ddp)
        self.layer_offset = get_transformer_layer_offset(tcfg) if par.pp_size > 1 else 0  # first global layer
        self.n_local_layers = len(self.gpt.decoder.layers)
        self.distributed_optimizer = False  # set by wrap_ddp
        # the TE spec's names for the norms it fuses into linear layers ({local-spec name: its name}; {} for local)
        self.fused = convert.fused_norm_names(n for n, _ in self.gpt.named_parameters())
        self.unfused = {v: k for k, v in self.fused.items()}
        # a micro-batch's length is padded to a multiple of this: SP splits it over TP ranks, CP into 2*CP chunks
        self.seq_multiple = (par.tp_size if tcfg.sequence_parallel else 1) * (2 * par.cp_size if par.cp_size > 1 else 1)
        # R3: (layers, top_k) of the routed_experts rows collate decodes; None without replay (or `replay` False)
        self.routed_shape = ((tcfg.num_layers, tcfg.moe_router_topk)
                             if replay and tcfg.moe_enable_routing_replay else None)

    def wrap_ddp(self, distributed_optimizer: bool = False) -> None:
        """Make it trainable: Megatron's DDP around the GPTModel, fp32 gradient buffers summed over DP ranks. With
        `distributed_optimizer` (CUDA) gradients are reduce-scattered, each DP rank steps its shard, and the parameters
        are all-gathered after the step into one buffer per dtype that every parameter views."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # Megatron: late
        self.distributed_optimizer = bool(distributed_optimizer)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=self.distributed_optimizer)
        self.module = DistributedDataParallel(config=self.tcfg, ddp_config=ddp_config, module=self.gpt)

    # --- weights in and out -------------------------------------------------------------------------------

    def _stage_name(self, name: str) -> str | None:
        """A full-model Megatron name (local spec) as this pipeline stage's layer spec names it (its layers count
        from 0), or None when another stage holds the tensor. PP=1 on the local spec: the name itself."""
        if self.par.pp_size == 1:
            return self.fused.get(name, name)
        if name.startswith("embedding."):
            return name if self.par.pre_process else None
        if name.startswith(("decoder.final_layernorm.", "output_layer.")):
            return name if self.par.post_process else None
        _, _, layer, rest = name.split(".", 3)  # decoder.layers.<L>.<rest>
        local = int(layer) - self.layer_offset
        name = f"decoder.layers.{local}.{rest}"
        return self.fused.get(name, name) if 0 <= local < self.n_local_layers else None

    def _global_name(self, name: str) -> str:
        """Inverse of _stage_name: this stage's parameter name as the full model names it on the local spec."""
        name = self.unfused.get(name, name)
        if self.par.pp_size == 1 or not name.startswith("decoder.layers."):
            return name
        _, _, layer, rest = name.split(".", 3)
        return f"decoder.layers.{int(layer) + self.layer_offset}.{rest}"

    def load(self, full: dict[str, torch.Tensor]) -> None:
        """Copy this rank's shard of every full Megatron tensor (convert.hf_to_megatron) into the model: its stage's
        layers, its TP slice, its EP share of the experts; and check nothing is missing."""
        par = self.par
        ep_rank, ep_size, etp_rank, etp_size = par.experts(self.tcfg.num_moe_experts)
        n_local_experts = (self.tcfg.num_moe_experts or 0) // ep_size
        params = dict(self.gpt.named_parameters())
        missing = set(params)
        for name, tensor in full.items():
            name = self._stage_name(name)
            if name is None:  # another pipeline stage's
                continue
            local_name, rank, size = name, par.tp_rank, par.tp_size
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

    def stream_full(self):
        """The full Megatron tensors (TP=1 layout, every expert, every stage's layers, whole-model names), one at a
        time, on global rank 0's device; nothing is yielded elsewhere. Every rank must drain it at once: the collectives
        inside pair up tensor by tensor, so no rank ever holds the whole model.

        TP shards are all-gathered within each TP group (replica 0's result is sent); expert tensors within the
        expert-TP group, then across the EP group (every rank takes part); with PP each stage's sender sends its tensors
        to rank 0 point to point, in an order both sides know from one exchange of names, shapes and dtypes."""
        from megatron.core import parallel_state  # Megatron: late
        par = self.par
        _, ep_size, _, etp_size = par.experts(self.tcfg.num_moe_experts)
        if (par.dp_rank != 0 or par.cp_rank != 0) and ep_size == 1:  # another replica (or CP rank): same weights
            return
        sender = par.tp_rank == 0  # with PP: this stage's rank in rank 0's pipeline (dp_rank, cp_rank are 0 here)
        etp_group = parallel_state.get_expert_tensor_parallel_group() if self.tcfg.num_moe_experts else None
        ep_group = parallel_state.get_expert_model_parallel_group() if ep_size > 1 else None
        n_local = (self.tcfg.num_moe_experts or 0) // ep_size
        stages = None  # PP: per stage, [(name, shape, dtype)] of what its sender sends, in order
        if par.pp_size > 1 and sender:
            mine = []
            for name, p in self.gpt.named_parameters():  # full shapes: TP-split dims times the (expert-)TP size
                if lora.is_adapter(name):
                    continue
                shape, dim = list(p.shape), convert.tp_split_dim(name)
                if dim is not None:  # (EP with PP is refused by Parallel: one global expert per local one here)
                    shape[dim] *= etp_size if ".local_experts." in name else par.tp_size
                mine.append((self._global_name(name), shape, p.dtype))
            stages = [None] * par.pp_size
            torch.distributed.all_gather_object(stages, mine, group=par.pp_group)
        # no torch.no_grad() here: a generator suspended inside one would leave grad mode off in its consumer;
        # every tensor below is detached, so nothing records a graph anyway
        for name, p in self.gpt.named_parameters():
            if lora.is_adapter(name):  # LoRA: the adapters travel on their own (lora.gather)
                continue
            if ".local_experts." not in name:
                t = convert.gather_full(name, p.detach(), par.tp_group if par.tp_size > 1 else None)
                yield from self._emit(self._global_name(name), t, sender)
                continue
            t = convert.gather_full(name, p.detach(), etp_group if etp_size > 1 else None)
            head, rest = name.split(".local_experts.")
            local_e, tail = rest.split(".", 1)
            parts = [t]
            if ep_group is not None:  # EP rank r holds global experts r*n_local .. (r+1)*n_local - 1
                parts = [torch.empty_like(t) for _ in range(ep_size)]
                torch.distributed.all_gather(parts, t.contiguous(), group=ep_group)
            for r, part in enumerate(parts):
                global_e = r * n_local + int(local_e)
                yield from self._emit(self._global_name(f"{head}.local_experts.{global_e}.{tail}"), part, sender)
            del t, parts
        if stages is not None and par.rank == 0:  # the later stages' tensors, as their senders send them
            ranks = torch.distributed.get_process_group_ranks(par.pp_group)
            for stage in range(1, par.pp_size):
                for name, shape, dtype in stages[stage]:
                    t = torch.empty(shape, dtype=dtype, device=par.device)
                    torch.distributed.recv(t, src=ranks[stage])
                    yield name, t

    def _emit(self, name: str, t: torch.Tensor, sender: bool):
        """Yield a gathered tensor on rank 0; with PP a later stage's sender sends it to rank 0 instead."""
        if self.par.rank == 0:
            yield name, t
        elif self.par.pp_size > 1 and sender:
            torch.distributed.send(t.contiguous(), dst=0)

    # --- forward ------------------------------------------------------------------------------------------

    def output(self, mb: dict[str, torch.Tensor], pad_to: tuple[int, int] = (0, 0)):
        """The model's output for a micro-batch: logits (B, T, V/tp) on the last stage (critic: values (B, T, 1)),
        hidden states elsewhere; and (B0, T0), its own shape before padding to `pad_to` (PP) or the other EP ranks'."""
        par = self.par
        if self.max_tokens:
            return self._packed_output(mb)
        tokens = mb["tokens"].to(par.device)  # (B, T)
        B0, T0 = tokens.shape
        replay = mb.get("routed_experts")  # (B, T, L, K) R3: route as the engine did (cfg.router_replay)
        B, T = max(B0, pad_to[0]), max(T0, pad_to[1])
        if par.ep_group is not None:  # the same (B, T) on every expert rank (NCCL reduces device tensors only)
            size = torch.tensor([B, T], device=par.device)
            torch.distributed.all_reduce(size, op=torch.distributed.ReduceOp.MAX, group=par.ep_group)
            B, T = size.tolist()
        T = -(-T // self.seq_multiple) * self.seq_multiple  # SP / CP split the sequence evenly
        if (B, T) != (B0, T0):  # pad with rows / columns of padding
            tokens = F.pad(tokens, (0, T - T0, 0, B - B0))  # (B, T) zeros after each row / as extra rows
            if replay is not None:  # padded positions route to experts 0..K-1 (never a loss token)
                fill = torch.arange(replay.size(-1), device=replay.device).expand(B, T, *replay.shape[2:]).clone()
                fill[:B0, :T0] = replay
                replay = fill  # (B, T, L, K)
        self.tokens[0] += int(mb["seq_len"].sum())
        self.tokens[1] += B * T
        position_ids = torch.arange(T, device=par.device).unsqueeze(0).expand(B, T)  # (B, T)
        extra = {}
        if self.tcfg.num_moe_experts:
            seq_len = mb["seq_len"].unsqueeze(1).to(par.device)  # (B0, 1) real tokens (collate's prompt + response)
            seq_len = F.pad(seq_len, (0, 0, 0, B - B0))  # (B, 1) EP padding rows: no real token
            extra["padding_mask"] = position_ids >= seq_len  # (B, T) True on padding: kept out of expert routing
        if par.cp_size > 1:  # this rank's share of every sequence; Megatron's RoPE takes the same positions
            mine = cp_positions(T, par.cp_rank, par.cp_size).to(par.device)  # (T/cp,)
            tokens, position_ids = tokens[:, mine], position_ids[:, mine]  # (B, T/cp)
            extra = {k: v[:, mine] for k, v in extra.items()}
        if replay is not None:
            replay_routing(self.module, replay.to(par.device))
        try:
            output = self.module(input_ids=tokens, position_ids=position_ids, attention_mask=None, **extra)
        finally:
            if replay is not None:  # the indices were used in the forward; backward needs no re-routing
                replay_routing(self.module, None)
        if par.cp_size > 1 and par.post_process:  # (B, T/cp, V/tp) -> (B, T, V/tp): what follows sees whole rows
            output = GatherSequence.apply(output, par.cp_group)
        return output, (B0, T0)

    def _packed_output(self, mb: dict[str, torch.Tensor]):
        """`output` for packed sequences (max_tokens_per_micro_batch): the B0 sequences back to back in one row
        (1, N), each attending to itself with positions from 0 (Megatron's THD format, cu_seqlens). SP needs N a
        multiple of TP: the extra tokens form a sequence of their own no loss reads. Returns (1, N, V/tp) and
        (B0, T0); mb["pack_start"] (B0,) is where each sequence starts, which `head` reads through."""
        from megatron.core.packed_seq_params import PackedSeqParams  # Megatron: late
        par = self.par
        lens = mb["seq_len"].tolist()  # (B0,) prompt + response tokens of each sequence
        n = sum(lens)
        width = -(-n // self.seq_multiple) * self.seq_multiple
        spans = lens + ([width - n] if width > n else [])  # SP: the padding as one more sequence
        tokens = torch.cat([mb["tokens"][b, :k] for b, k in enumerate(lens)] +
                           [torch.zeros(width - n, dtype=torch.long, device=mb["tokens"].device)])  # (N,)
        positions = torch.cat([torch.arange(k) for k in spans])  # (N,) each sequence from 0
        cu = torch.tensor([0] + list(itertools.accumulate(spans)), dtype=torch.int32, device=par.device)  # (S+1,)
        mb["pack_start"] = cu[:len(lens)].long()  # (B0,)
        self.tokens[0] += n
        self.tokens[1] += width
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(spans),
                                 max_seqlen_kv=max(spans))
        output = self.module(input_ids=tokens.to(par.device).unsqueeze(0), position_ids=positions.to(par.device)
                             .unsqueeze(0), attention_mask=None, packed_seq_params=packed)  # (1, N, V/tp)
        return output, tuple(mb["tokens"].shape)

    def head(self, head: str, mb: dict[str, torch.Tensor], output: torch.Tensor, shape: tuple[int, int]) -> dict:
        """What a last stage's `output` gives for each response token, (B0, R) fp32 each:
        "logp": {logp, entropy}; "logits": also the logits that predict each response token, (B0, R, V/tp)
        (distillation needs them); "values" (CRITIC): {values}, V(s_t) at the position whose logits would predict
        token t, i.e. the value of the context before the model emits it."""
        B0, T0 = shape
        pos = mb["resp_pos"].to(self.par.device)  # (B, R) the positions whose outputs predict the response tokens
        # the response positions first: prompt positions need no log-softmax (the same numbers, row by row)
        if "pack_start" in mb:  # packed (_packed_output): position t of sequence b is column pack_start[b] + t
            resp_logits = output[0][mb["pack_start"].unsqueeze(1) + pos]  # (B, R, V/tp)
        else:
            output = output[:B0, :T0]  # (B0, T0, V/tp) this rank's own rows and columns
            resp_logits = output.gather(1, pos.unsqueeze(-1).expand(-1, -1, output.size(-1)))  # (B, R, V/tp)
        if head == "values":
            return {"values": resp_logits[..., 0].float()}  # (B, R)
        if head not in ("logp", "logits"):
            raise ValueError(f"head={head!r}; valid: logp, logits, values")
        tokens = mb["tokens"].to(self.par.device)  # (B0, T0)
        logp, entropy = vocab_parallel_logp_entropy(resp_logits, tokens.gather(1, pos + 1), self.par.tp_group)
        out = {"logp": logp, "entropy": entropy}  # (B, R) each on the rank's device
        if head == "logits":
            out["logits"] = resp_logits
        return out

    def run(self, rows: list[dict], fn, extras: dict[str, list[torch.Tensor]] | None = None,
            backward: bool = False, head: str = "logp") -> list:
        """The micro-batch loop of every pass (RL, SFT, distillation, critic, logprobs, teachers).

        `rows` go in consecutive micro-batches, collated with their `extras` (per-row 1-D tensors) and R3 routing.
        For each: forward, `head`, then `fn(part, mb, out)` (`part`: the micro-batch's positions in `rows`) returns
        (loss, keep): with `backward` the loss's backward accumulates gradients (train mode); without, no grad, eval
        mode, and the loss may be None. Returns every micro-batch's `keep`, in order.

        PP > 1: Megatron-Core's 1F1B schedule; `fn` runs on the last stage and the keeps reach every stage from
        there; the loss goes back unscaled (already divided by global counts). EP > 1: every expert rank runs as
        many micro-batches as the busiest one, the extra ones padding only with a zero gradient."""
        par, size = self.par, self.micro_batch_size
        parts = [range(s, min(s + size, len(rows))) for s in range(0, len(rows), size)]
        if self.max_tokens:  # packed: consecutive rows while their tokens fit the budget (a longer row goes alone)
            parts, first, used = [], 0, 0
            for j, row in enumerate(rows):
                n = len(row["prompt_ids"]) + len(row["response_ids"])
                if j > first and used + n > self.max_tokens:
                    parts.append(range(first, j))
                    first, used = j, 0
                used += n
            parts += [range(first, len(rows))] if rows else []
        count = len(parts)
        if par.ep_group is not None:  # on the device: on GPU the expert group is an NCCL one
            t = torch.tensor([count], device=par.device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=par.ep_group)
            count = int(t)
        mbs = []
        with timed(self.clock, "collate"):
            for part in parts:
                mb = collate([rows[j] for j in part], {key: [x[j] for j in part] for key, x in (extras or {}).items()},
                             routed_shape=self.routed_shape)
                mbs.append({k: v.to(par.device) for k, v in mb.items()})
        kept = [None] * len(mbs)
        was_training = self.module.training
        self.module.train(backward)
        try:
            with torch.set_grad_enabled(backward):
                if par.pp_size == 1:
                    for i, mb in enumerate(mbs):
                        with timed(self.clock, "forward"):  # and the loss
                            loss, kept[i] = fn(parts[i], mb, self.head(head, mb, *self.output(mb)))
                        if backward:
                            with timed(self.clock, "backward"):
                                loss.backward()
                elif mbs:  # every stage of a pipeline holds the same rows: all skip together
                    self._pipeline(parts, mbs, fn, kept, backward, head)
                for _ in range(count - len(mbs)):  # EP: another expert rank has micro-batches more
                    empty = collate([])  # (0, 1): no rows of this rank's own
                    out = self.head(head, empty, *self.output(empty))
                    if backward:
                        (next(iter(out.values())).sum() * 0.0).backward()
        finally:
            self.module.train(was_training)
        if par.pp_size > 1:  # the keeps as the last stage holds them, on every stage of this pipeline
            box = [kept]
            torch.distributed.broadcast_object_list(box, src=par.pp_last_rank, group=par.pp_group)
            kept = box[0]
        return kept

    def _pipeline(self, parts: list[range], mbs: list[dict], fn, kept: list, backward: bool, head: str) -> None:
        """`run`'s micro-batches through Megatron-Core's 1F1B schedule (PP > 1); `kept` is filled on the last stage."""
        from megatron.core.pipeline_parallel import get_forward_backward_func  # Megatron: late
        # one (B, T) for every micro-batch of this run: the shape the stages send each other
        T = max(mb["tokens"].size(1) for mb in mbs)
        pad_to = (max(mb["tokens"].size(0) for mb in mbs), -(-T // self.seq_multiple) * self.seq_multiple)

        def forward_step(data_iterator, stage_model):  # stage_model: self.module, this stage's layers
            i, mb = next(data_iterator)
            output, shape = self.output(mb, pad_to)  # logits on the last stage, hidden states elsewhere

            def loss_func(logits):  # last stage only
                loss, kept[i] = fn(parts[i], mb, self.head(head, mb, logits, shape))
                if not isinstance(loss, torch.Tensor):
                    loss = torch.zeros((), device=self.par.device)
                return loss, torch.tensor(1), {}  # (loss, tokens: unused with pre-divided losses, reported: none)
            return output, loss_func

        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(list(enumerate(mbs))), model=[self.module],
            num_microbatches=len(mbs), seq_length=pad_to[1], micro_batch_size=pad_to[0], forward_only=not backward)

    def per_token(self, rows: list[dict], head: str = "logp") -> list[torch.Tensor]:
        """Per-row 1-D `head` output of every response token, no grad: "logp" (old and reference logprobs) or, of the
        critic's model, "values" (V_old of a step)."""
        kept = self.run(rows, lambda part, mb, out: (None, [out[head][b, :len(rows[j]["response_ids"])].cpu()
                                                            for b, j in enumerate(part)]), head=head)
        return [row for rows_of_mb in kept for row in rows_of_mb]

    def timings(self, since: tuple[float, float]) -> dict[str, float]:
        """The PHASES of a step begun at `since` (perf_counter, process_time; the clock cleared then): wall seconds as
        timing/trainer_<phase> and CPU seconds as perf/trainer_<phase>_core_s, the slowest rank's (so identical on
        every rank)."""
        self.clock["step"] = [time.perf_counter() - since[0], time.process_time() - since[1]]
        t = torch.tensor([self.clock.get(k, [0.0, 0.0]) for k in PHASES], dtype=torch.float64, device=self.par.device)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return {**{f"timing/trainer_{k}": float(w) for k, (w, _) in zip(PHASES, t)},
                **{f"perf/trainer_{k}_core_s": float(c) for k, (_, c) in zip(PHASES, t)}}

    @torch.no_grad()
    def routing_used(self, batch: list[dict]) -> list[torch.Tensor]:
        """The experts every router dispatched each token to, per sample a (P+R, L, K) long tensor sorted within each
        token, from a no-grad forward (replayed when the batch carries routed_experts). For the R3 tests."""
        from megatron.core.transformer.moe.router import TopKRouter  # Megatron: late
        if self.par.pp_size > 1:
            raise NotImplementedError("routing_used reads one whole model; call it with pipeline_parallel=1")
        maps = {}
        hooks = [m.register_forward_hook(lambda mod, inp, out: maps.__setitem__(mod.layer_number, out[1]))
                 for m in self.gpt.modules() if isinstance(m, TopKRouter)]
        was_training = self.module.training
        self.module.eval()
        try:
            mb = collate(batch, routed_shape=self.routed_shape)
            self.output(mb)
        finally:
            for h in hooks:
                h.remove()
            self.module.train(was_training)
        B, T = mb["tokens"].shape
        K = self.tcfg.moe_router_topk
        per_layer = []
        for n in sorted(maps):  # routing_map (T*B, E) bool, sequence-first rows
            idx = maps[n].float().topk(K, dim=-1).indices.sort(-1).values  # (T*B, K) the K chosen experts, ascending
            per_layer.append(idx.view(T, B, K).transpose(0, 1))  # (B, T, K)
        used = torch.stack(per_layer, 2).cpu()  # (B, T, L, K)
        return [used[b, :len(s["prompt_ids"]) + len(s["response_ids"])] for b, s in enumerate(batch)]


# ----------------------------------------------------------------------------------------------
# the optimizer of a trained Model


class Optim:
    """AdamW over one trained Model, its learning rate and step count. CUDA: Megatron's optimizer (fp32 masters,
    clipping inside; or its DistributedOptimizer); CPU: cpu.adamw with cpu.clip_grad_norm (Megatron's need CUDA)."""

    def __init__(self, model: Model, cfg, lr: float | None = None, name: str = "policy"):
        """`lr`: a constant learning rate; None: cfg's schedule (`lr_at`)."""
        self.model, self.cfg, self.lr, self.name = model, cfg, lr, name
        self.steps = 0  # optimizer steps taken (drives the lr schedule)
        base = cfg.lr if lr is None else lr
        if model.par.on_cpu:
            self.optimizer = cpu.adamw(model.module, cfg, base)
        else:
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # Megatron: late
            ocfg = OptimizerConfig(optimizer="adam", lr=base, min_lr=min(cfg.min_lr, base),
                                   weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1,
                                   adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
                                   clip_grad=float(cfg.grad_clip or 0.0), bf16=model.tcfg.bf16,
                                   params_dtype=model.tcfg.params_dtype,
                                   use_distributed_optimizer=model.distributed_optimizer)
            self.optimizer = get_megatron_optimizer(ocfg, [model.module])  # norms and biases get no decay

    def step(self) -> tuple[float, float]:
        """Finish the DP gradient sum, clip, step at this step's lr. Returns (grad_norm, lr)."""
        from megatron.core.distributed import finalize_model_grads  # Megatron: late
        model, par = self.model.module, self.model.par
        finalize_model_grads([model])  # DP all-reduce (SUM) + TP sum of qk-layernorm grads
        lr = self.lr if self.lr is not None else lr_at(self.cfg, self.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if par.on_cpu:
            for p in model.parameters():
                p.grad = p.main_grad if p.requires_grad else None  # DDP accumulated into main_grad
            grad_norm = cpu.clip_grad_norm(model, float(self.cfg.grad_clip or 0.0),
                                           par.tp_group if par.tp_size > 1 else None,
                                           par.pp_group if par.pp_size > 1 else None,
                                           bool(self.model.tcfg.num_moe_experts))
            self.optimizer.step()
            for p in model.parameters():
                p.grad = None  # else DDP's hook would add the next grads into main_grad twice
        else:
            ok, grad_norm, _ = self.optimizer.step()
            if not ok:
                raise RuntimeError(f"{self.name} optimizer step {self.steps} skipped (inf/nan gradients)")
            grad_norm = float(grad_norm or 0.0)
            self.optimizer.zero_grad()
        model.zero_grad_buffer()
        self.steps += 1
        return float(grad_norm), lr

    def end_minibatch(self, sums: dict[str, float], totals: dict[str, float], n_mb: int) -> None:
        """End a mini-batch: one optimizer step, then its DP-summed metric sums and grad norm into the step's means
        over `n_mb` mini-batches (`totals`, updated in place; lr is the last one's)."""
        with timed(self.model.clock, "optimizer"):
            grad_norm, lr = self.step()
        for k, v in {**self.model.par.dp_sum(sums), "grad_norm": grad_norm}.items():
            totals[k] = totals.get(k, 0.0) + v / n_mb
        totals["lr"] = lr

    def tensors(self) -> list[torch.Tensor]:
        """The optimizer's state tensors (Adam's moments; on CUDA also Megatron's fp32 master weights, this DP
        rank's shard of them under the distributed optimizer)."""
        out = []
        for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = getattr(o, "optimizer", o)  # Megatron wraps a torch optimizer; on CPU it is one
            out += [t for st in inner.state.values() for t in st.values() if torch.is_tensor(t)]
            for masters in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups"):  # bf16 weights' masters
                out += [p for group in getattr(o, masters, []) for p in group]
        return out

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the optimizer (each rank its own file). Megatron's DistributedOptimizer leaves
        the moments and fp32 masters out of its state_dict(); here each rank keeps its own shard: each inner torch
        optimizer's state and its parameters, the masters (load_checkpoint checks the layout matches)."""
        if not self.model.distributed_optimizer:
            return self.optimizer.state_dict()
        return {"shards": [(o.optimizer.state_dict(), [p for g in o.optimizer.param_groups for p in g["params"]])
                           for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer])]}

    def load_state_dict(self, state: dict) -> None:
        """Inverse of state_dict."""
        if not self.model.distributed_optimizer:
            self.optimizer.load_state_dict(state)
            return
        chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        for o, (inner_state, masters) in zip(chained, state["shards"], strict=True):
            o.optimizer.load_state_dict(inner_state)
            with torch.no_grad():
                for p, saved in zip([p for g in o.optimizer.param_groups for p in g["params"]], masters, strict=True):
                    p.copy_(saved)


# ----------------------------------------------------------------------------------------------
# the critic (advantage: gae)


class ValueHead(torch.nn.Module):
    """The critic's head: V = w . h + b per position, in the place of GPTModel's output layer, which GPTModel calls
    on the final-normed hidden states (S, B, H): the critic's forward gives (B, S, 1) with no change to Megatron.
    Replicated on every TP rank; zero-initialised, so a fresh critic's first GAE is the return-to-go. With sequence
    parallelism the hidden states are gathered first, as the LM head does."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, sequence_parallel: bool = False):
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size, 1, dtype=dtype)
        self.sequence_parallel = sequence_parallel
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        # weight: the tied embedding GPTModel offers its LM head; a value head has its own
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region  # Megatron: late
            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return self.linear(hidden_states), None  # (S, B, 1)


class Critic:
    """CRITIC: PPO's value model, in the same rank as the policy: a second GPTModel from the policy's checkpoint with
    a `ValueHead`, its own optimizer at the constant cfg.critic_lr, saved in the policy's checkpoint file. It routes
    MoE tokens by itself (R3 replays the policy's routing)."""

    def __init__(self, par: Parallel, cfg, tcfg, model_kwargs: dict, full: dict[str, torch.Tensor], hf: dict):
        self.cfg = cfg
        self.model = Model(par, tcfg, model_kwargs, cfg.micro_batch_size, replay=False,
                           max_tokens=cfg.max_tokens_per_micro_batch)
        self.model.load(full)  # the policy's checkpoint (LM head included, then replaced)
        if cfg.lora_rank:  # LoRA: the critic's trunk is frozen too; its adapters and its value head train
            lora.add_adapters(self.model.gpt, cfg, hf, par.tp_group if par.tp_size > 1 else None)
        self.model.gpt.output_layer = ValueHead(tcfg.hidden_size, tcfg.params_dtype,
                                                tcfg.sequence_parallel).to(par.device)
        self.model.wrap_ddp(cfg.use_distributed_optimizer)
        self.optim = Optim(self.model, cfg, float(cfg.critic_lr), name="critic")

    def update(self, batch: list[dict], spans: list[range], local: list[dict], old_values: list[torch.Tensor],
               returns: list[torch.Tensor], n_mb: int) -> dict[str, float]:
        """Per mini-batch of the policy's plan (`spans`: its rows of `local`), micro-batches of algos.value_loss with
        GLOBAL counts, then one critic step. `old_values` / `returns`: (R_j,) per row of `local`. Returns `critic/`
        metrics over DP ranks: value_loss, clipfrac, grad_norm, lr, and (before the update) vf_explained_var and
        values_mean."""
        cfg, par, totals = self.cfg, self.model.par, {}
        for mb_i, rows in enumerate(spans):
            denom = denominators(cfg, batch, n_mb, mb_i, by_group=True)

            def value_loss(part, mb, out):  # out["values"] (b, R) with grad
                loss, m = algos.value_loss(out["values"], mb["old_values"], mb["returns"], mb["loss_mask"],
                                           float(cfg.value_clip), denom)
                return loss, {k: float(x) for k, x in m.items()}
            kept = self.model.run([local[j] for j in rows], value_loss, backward=True, head="values",
                                  extras={"old_values": [old_values[j] for j in rows],
                                          "returns": [returns[j] for j in rows]})
            self.optim.end_minibatch(add_up(kept), totals, n_mb)
        # the values the advantages used (before this update) against their targets, over every DP rank's tokens
        lb = collate(local, {"old_values": old_values, "returns": returns})  # (B_local, R), (0, 1) with no rows
        ev = algos.explained_variance(lb["old_values"], lb["returns"], lb["loss_mask"],
                                      par.dp_group_gloo if par.dp_size > 1 else None)
        vsum = par.dp_sum({"v": float((lb["old_values"] * lb["loss_mask"]).sum()), "n": float(lb["loss_mask"].sum())})
        totals.update({"vf_explained_var": ev, "values_mean": vsum["v"] / max(vsum["n"], 1.0)})
        return {f"critic/{k}": v for k, v in totals.items()}


# ----------------------------------------------------------------------------------------------
# the colocated memory hand-off


def _storage_bytes(storage) -> torch.Tensor:
    """A uint8 tensor over all of `storage` (an untyped storage), on its device."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class HandOff:
    """COLOCATED: the memory a rank lends the engines on its GPUs between phases (fleet.colocate_hand_off): after the
    step its optimizer state and gradients, after the sync its weights; all come back before the next step. Tags:
    "weights", "optimizer" (moments, fp32 masters), "grads" (zero between steps: nothing kept). Tensors keep their
    identity (the optimizer and DDP hold them): each storage is resized to zero and back, its bytes kept in pinned
    host memory on CUDA, in a file in output_dir/offload on CPU (cpu.offload_to_file)."""

    TAGS = ("weights", "optimizer", "grads")

    def __init__(self, par: Parallel, output_dir: str, models=(), optims=()):
        """`models`: every model of the rank (weights); `optims`: the trained ones' optimizers (state, gradients)."""
        self.par, self.output_dir = par, output_dir
        self.models, self.optims = list(models), list(optims)
        self.offloaded: dict[str, tuple] = {}  # tag -> (freed storages, file) while offloaded

    def tensors(self, tag: str) -> list[torch.Tensor]:
        if tag == "weights":
            tensors = [p for m in self.models for p in m.module.parameters()]
        elif tag == "optimizer":
            tensors = [t for o in self.optims for t in o.tensors()]
        elif tag == "grads":
            tensors = [b.grad_data for o in self.optims
                       for b in list(o.model.module.buffers) + list(o.model.module.expert_parallel_buffers)]
        else:
            raise ValueError(f"offload tag {tag!r}: choose from {self.TAGS}")
        unique = {t.untyped_storage().data_ptr(): t for t in tensors if t.numel() > 0}
        return list(unique.values())

    def offload(self, tags: list[str]) -> dict:
        """Free the memory of `tags` (see the class); returns this rank's memory afterwards (`memory`)."""
        for tag in tags:
            if tag in self.offloaded:
                continue
            tensors = self.tensors(tag)
            path = Path(self.output_dir) / "offload" / f"rank{self.par.rank}_{tag}.bin"
            if tag == "grads":
                entries = [(t, t.untyped_storage().nbytes()) for t in tensors]
                for t, _ in entries:
                    t.untyped_storage().resize_(0)
            elif self.par.on_cpu:
                entries = cpu.offload_to_file(tensors, path)
            else:  # each storage's bytes to pinned host memory, then the storage emptied: every tensor viewing it
                # (under the distributed optimizer, every parameter views DDP's parameter buffer) stays valid
                entries = []
                for t in tensors:
                    storage = t.untyped_storage()
                    entries.append((storage, torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=True)
                                    .copy_(_storage_bytes(storage))))
                    storage.resize_(0)
            self.offloaded[tag] = (entries, path)
        if "weights" in tags:
            transfermesh.release_shm()  # the weight-sync staging segment is a further copy of the weights
        if not self.par.on_cpu:
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
            elif self.par.on_cpu:
                cpu.onload_from_file(entries, path)
            else:
                for storage, host in entries:
                    storage.resize_(host.numel())
                    _storage_bytes(storage).copy_(host, non_blocking=True)
        return self.memory()

    def memory(self) -> dict:
        """This rank's memory: resident bytes of the process; on CUDA also the device memory torch holds and the
        whole device's used memory (which shows colocated engines releasing theirs)."""
        out = {"rss_bytes": transfermesh.rss_bytes()}
        if not self.par.on_cpu:
            free, total = torch.cuda.mem_get_info()
            out.update(cuda_allocated_bytes=torch.cuda.memory_allocated(), gpu_used_bytes=total - free)
        return out


# ----------------------------------------------------------------------------------------------
# the policy's weights out: to the engines, to HF directories


class Export:
    """The trained policy's weights leaving the rank: streamed under their HF names (`hf_weights`), pushed to the
    rollout engines (`sync`, TransferMesh) and written as an HF directory (`save_hf`). With LoRA a sync sends the
    adapters alone (`adapters`), and the HF directory is the merged model, beside it a PEFT adapter directory."""

    def __init__(self, cfg, policy: Model, hf_path: str, hf_config, peft: dict | None, full_bytes: int,
                 hand_off: HandOff):
        """`hf_path`, `hf_config`: the HF directory the policy was built from; `peft`: LoRA's PEFT config or None;
        `full_bytes`: what a sync without LoRA moves (weights/full_bytes)."""
        self.cfg, self.par, self.policy, self.hand_off = cfg, policy.par, policy, hand_off
        self.hf_path, self.hf_config, self.peft, self.full_bytes = str(hf_path), hf_config, peft, full_bytes

    def hf_weights(self):
        """HF-named full tensors on rank 0's device, one Megatron tensor's worth at a time (Model.stream_full, renamed
        by convert.megatron_to_hf_tensor); nothing is yielded elsewhere. Every rank must drain it at once."""
        self.hand_off.onload(["weights"])  # colocated: a re-created engine may need them while they are offloaded
        for name, t in self.policy.stream_full():
            yield from convert.megatron_to_hf_tensor(name, t, self.hf_config)

    def adapters(self) -> dict[str, torch.Tensor]:
        """LoRA: every adapter matrix, full (TP shards gathered), by its PEFT name, on rank 0; {} elsewhere and
        without LoRA. Every rank must call it (the TP gather)."""
        if not self.peft or self.par.dp_rank != 0:  # another data-parallel replica holds the same adapters
            return {}
        self.hand_off.onload(["weights"])
        return lora.gather(self.policy.gpt, self.par.tp_group if self.par.tp_size > 1 else None, self.par.rank == 0)

    def sync(self, engine_urls: list[str], version: int, base: bool = False, remote: list[str] = ()) -> dict:
        """Push the current weights to the rollout engines as `version`, bucket by bucket as they are gathered (rank
        0 sends). With LoRA only the adapters travel (adapter lora.adapter_name(version)); `base` also sends the
        frozen base first (a warm start, a resume). Returns rank 0's `weights/` metrics with the sync's peak extra
        resident memory (`weights/peak_extra_mb`), with LoRA also weights/full_bytes. `remote`: engines on another
        Ray node (fleet.off_node), never sent shared memory or IPC handles."""
        full = base or not self.peft  # else with lora_train_norm the final norm's gain goes as a base weight
        stream = push_fault(self.hf_weights(), version, self.par.rank) if full else iter(lora.trained_base(
            self.policy.gpt))
        adapters = self.adapters()
        if self.par.rank != 0:
            for _ in stream:  # the collectives of every tensor's gather
                pass
            return {}
        # SGLang engines run with tensor parallel size tp_size (cfg.gpus_per_engine unless cfg.sglang sets it);
        # the CPU engine is one rank
        sglang = self.cfg.engine == "sglang" or (self.cfg.engine == "auto" and torch.cuda.is_available())
        tp = int((self.cfg.sglang or {}).get("tp_size") or self.cfg.gpus_per_engine) if sglang else 1
        engines = [(u, tp) for u in engine_urls]
        before = transfermesh.rss_bytes()  # freed heap the process keeps is reused first: that costs the node nothing
        transfermesh.reset_peak_rss()
        stats = {}
        try:
            if full or self.cfg.lora_train_norm:
                stats = transfermesh.push_weights(stream, engines, version, transport=self.cfg.transfer,
                                                  bucket_mb=self.cfg.bucket_mb, config_dir=self.hf_path, remote=remote)
        finally:
            for _ in stream:  # a failed push: the other ranks still wait in the remaining gathers
                pass
        if self.peft:  # LoRA: the adapters alone, loaded as a new adapter of the engines (SGLang's LoRA endpoints)
            sent = transfermesh.push_adapter(adapters, self.peft, engines, version, lora.adapter_name(version),
                                             transport=self.cfg.transfer, remote=remote)
            for key in ("weights/bytes", "weights/buckets", "weights/seconds"):  # + the base, when it went too
                sent[key] += stats.get(key, 0)
            sent["weights/gbps"] = sent["weights/bytes"] / max(sent["weights/seconds"], 1e-9) / 1e9
            stats = {**sent, "weights/full_bytes": self.full_bytes}
        stats["weights/peak_extra_mb"] = max(transfermesh.peak_rss_bytes() - before, 0) / 2**20
        return stats

    def save_hf(self, path: str, adapter_path: str | None = None) -> str:
        """Write an HF model directory (safetensors shards of at most 5 GiB, with the source config and tokenizer
        files) as the weights are gathered: rank 0 holds one shard at a time. With LoRA the adapters are merged in
        (W + scale B A), and `adapter_path` gets a PEFT adapter directory (lora.save_peft)."""
        adapters = self.adapters()
        stream = self.hf_weights()
        if self.par.rank == 0:
            named = stream
            if adapters:
                named = lora.merge(stream, adapters, float(self.cfg.lora_alpha) / int(self.cfg.lora_rank))
                if adapter_path:
                    lora.save_peft(adapters, self.peft, adapter_path, lora.trained_base(self.policy.gpt))
            convert.save_hf_dir(named, path, self.hf_path)
        for _ in stream:
            pass
        torch.distributed.barrier()
        return str(path)


# ----------------------------------------------------------------------------------------------
# the worker


class TrainerWorker:
    """One Megatron-Core rank of the policy. The controller creates world_size of them and calls every method on all
    ranks at once; collectives inside pair them up. Its parts: `par`, `policy` with `optim`, `ref` (when a KL term
    needs one), `critic`, `export`, `hand_off`. Metrics are identical on every rank. LoRA (lora.py): base weights
    frozen, only the adapters (and with lora_train_norm the final norm's gain) in the optimizer; the reference is the
    policy with its adapters off (Export: what leaves the rank)."""

    def __init__(self, cfg, rank: int, world_size: int, master_addr: str, master_port: int):
        self.cfg = cfg
        self.par = Parallel(cfg, rank, world_size, master_addr, master_port)
        self.policy = self.optim = self.ref = self.critic = self.export = None  # built by load_hf
        self.hand_off = HandOff(self.par, cfg.output_dir)  # holds no model until load_hf
        self.borrowed: cpu.BorrowedCores | None = None  # borrow_cores
        self.teacher_heads: dict[str, torch.Tensor] = {}  # set_teacher_heads
        self.lora: dict | None = None  # LoRA: the adapters' PEFT config (lora.peft_config), set by load_hf

    # --- model, optimizer, reference, critic ------------------------------------------------------------

    def load_hf(self, path: str, lr: float | None = None) -> dict:
        """Build the policy (+ optimizer, + frozen reference when a KL term needs one) from an HF dir; again:
        everything rebuilt, optimizer state reset. `lr` set (the SFT warm start): a constant learning rate, and
        neither the critic (`advantage: gae`) nor LoRA adapters (the warm start trains every weight)."""
        cfg, par = self.cfg, self.par
        # free a previous model before building the next
        self.policy = self.optim = self.ref = self.critic = self.export = None
        self.hand_off = HandOff(par, cfg.output_dir)
        self.hf_config = convert.read_hf_config(path)
        tcfg, model_kwargs = convert.megatron_config(self.hf_config, cfg, par.on_cpu)
        if tcfg.moe_enable_routing_replay:  # Megatron keeps every RouterReplay ever built in a class-level list:
            from megatron.core.transformer.moe.router_replay import RouterReplay  # forget the previous models'
            RouterReplay.clear_global_router_replay_instances()
        full = convert.hf_to_megatron(convert.load_hf_state(path), self.hf_config)
        full_bytes = sum(t.numel() * t.element_size() for t in full.values())  # what a sync without LoRA moves
        self.policy = Model(par, tcfg, model_kwargs, cfg.micro_batch_size, fp32_lm_head=cfg.fp32_lm_head,
                            max_tokens=cfg.max_tokens_per_micro_batch)
        self.policy.load(full)
        self.lora = lora.peft_config(cfg, path) if cfg.lora_rank and lr is None else None
        if self.lora:  # before DDP: it keeps gradient buffers for the parameters that train only
            lora.add_adapters(self.policy.gpt, cfg, self.hf_config, par.tp_group if par.tp_size > 1 else None)
        self.policy.wrap_ddp(cfg.use_distributed_optimizer)
        self.optim = Optim(self.policy, cfg, lr)
        if self._needs_reference() and not self.lora:
            self.ref = Model(par, tcfg, model_kwargs, cfg.micro_batch_size, fp32_lm_head=cfg.fp32_lm_head,
                             max_tokens=cfg.max_tokens_per_micro_batch)
            self.ref.load(full)
            self.ref.gpt.requires_grad_(False).eval()
        if cfg.advantage == "gae" and lr is None:
            self.critic = Critic(par, cfg, tcfg, model_kwargs, full, self.hf_config)
        self.hand_off = HandOff(par, cfg.output_dir, self._models(),
                                [self.optim] + ([self.critic.optim] if self.critic is not None else []))
        self.export = Export(cfg, self.policy, path, self.hf_config, self.lora, full_bytes, self.hand_off)
        self._hook_layers()
        fast = (f"layer spec {convert.layer_spec(cfg, par.on_cpu)}, distributed optimizer "
                f"{'on' if self.policy.distributed_optimizer else 'off'}, sequence parallel "
                f"{'on' if tcfg.sequence_parallel else 'off'}, context parallel {tcfg.context_parallel_size}, "
                f"recompute {tcfg.recompute_granularity or 'none'}")
        optimized = {id(p): p for g in self.optim.optimizer.param_groups for p in g["params"]}
        return {"params_this_rank": sum(p.numel() for p in self.policy.gpt.parameters()),
                "trained_params_this_rank": sum(p.numel() for p in self.policy.gpt.parameters() if p.requires_grad),
                "optimizer_params_this_rank": sum(p.numel() for p in optimized.values()),
                "reference": self.ref is not None, "reference_by_disabling_adapters": bool(self.lora) and
                self._needs_reference(), "critic": self.critic is not None, "megatron": fast}

    def _needs_reference(self) -> bool:
        return float(self.cfg.kl_coef) > 0 or bool(self.cfg.kl_in_reward)

    def _reference_logp(self, rows: list[dict]) -> list[torch.Tensor] | None:
        """Per-row reference logprobs for a KL term (None without one): the frozen reference model's; with LoRA the
        policy's own base, its adapters switched off for the forward (the reference LoRA keeps no copy of)."""
        if self.ref is not None:
            return self.ref.per_token(rows)
        if self.lora and self._needs_reference():
            with lora.disabled(self.policy.gpt):
                return self.policy.per_token(rows)
        return None

    def _models(self) -> list[Model]:
        return [m for m in (self.policy, self.ref, self.critic and self.critic.model) if m is not None]

    def borrow_cores(self, busy_file: str, lent: list[tuple[int, list[int]]]) -> list[int]:
        """Async on a local CPU node (cfg.borrow_engine_cores): also compute on the cores of the engines in `lent`
        ((engine, its cores), from cpu.lent_cores) while they have nothing to generate (cpu.BorrowedCores).
        Returns the cores this rank may run on."""
        self.borrowed = cpu.BorrowedCores(busy_file, lent, int(self.cfg.trainer_threads))
        self._hook_layers()
        return sorted(self.borrowed.cores)

    def _hook_layers(self) -> None:
        if self.borrowed is not None:
            for m in self._models():
                self.borrowed.hook_layers(m.gpt)

    # --- RL step ------------------------------------------------------------------------------------

    def train_step(self, batch: list[dict], step: int, targets: list[dict] | None = None) -> dict[str, float]:
        """One RL step on `batch` (all trajectories of the step, the same list on every rank), in the four numbered
        blocks below; `step` is also the version of the weights this worker holds (one sync per step). Returns
        `train/` (and `critic/`) metrics as python floats, identical on every rank. `targets`: teacher targets
        (teacher.py's `TeacherWorker.score`), one dict per sample of `batch`, or None; they add `opd_terms`."""
        cfg, par, since = self.cfg, self.par, (time.perf_counter(), time.process_time())
        self.policy.clock.clear()  # the step's own timeline (Model.timings)
        self.onload()  # colocated: whatever the hand-off offloaded comes back before the step
        if not batch:
            raise ValueError("train_step got an empty batch; the controller must skip steps with no trajectories")
        if self.borrowed is not None:  # borrow_cores: count this step's layer passes from its first one
            self.borrowed.new_step()
        if targets is not None and float(cfg.gkd_ratio) == 1.0:  # TEACHERS: pure distillation, no RL forward
            return self.distill_step(batch, targets)
        n_mb, n_traj = n_minibatches(cfg, batch), len(batch)
        tokens0 = list(self.policy.tokens)  # the policy's forwards of this step: real vs computed tokens (pad_frac)
        # from here on a row is one trainable segment (teachers score the top-level segment only: one row each)
        batch = segment_rows(batch) if targets is None else [{**t, "traj": i, "last": True}
                                                             for i, t in enumerate(batch)]
        plan = plan_minibatches(batch, n_mb, par.dp_rank, par.dp_size, by_group=True)
        local = [batch[i] for mine in plan for i in mine]  # this rank's rows, mini-batch after mini-batch
        ends = itertools.accumulate(len(mine) for mine in plan)
        spans = [range(end - len(mine), end) for mine, end in zip(plan, ends)]  # each mini-batch's rows of `local`
        has_rollout = all(len(s.get("rollout_logprobs") or []) == len(s["response_ids"]) for s in batch)
        if cfg.use_rollout_logprobs and not has_rollout:
            raise ValueError("use_rollout_logprobs=True but some trajectories lack rollout_logprobs (one per "
                             "response token); set use_rollout_logprobs=False to recompute old logprobs")

        # --- 1. old/ref logprobs under the step's starting weights. Mini-batch 0 takes its old logp from its own
        #     training forward, detached (same weights: ratio exactly 1), so only later ones pay a no-grad forward;
        #     KL-in-reward needs every old logp up front, and use_rollout_logprobs takes the engine's.
        first = set(spans[0]) if not (cfg.recompute_old_logprobs or cfg.use_rollout_logprobs) and \
            not (cfg.kl_in_reward and cfg.kl_coef > 0) else set()  # rows of `local` in mini-batch 0
        if cfg.use_rollout_logprobs:
            old = [torch.tensor(s["rollout_logprobs"], dtype=torch.float) for s in local]  # behaviour = engine
        else:
            rest = [j for j in range(len(local)) if j not in first]
            computed = dict(zip(rest, self.policy.per_token([local[j] for j in rest])))
            old = [computed.get(j) for j in range(len(local))]  # None: filled by mini-batch 0's forward
        ref = self._reference_logp(local)
        values = self.critic.model.per_token(local, "values") if self.critic else None  # CRITIC: V_old(s_t) per row

        # --- 2. advantages over this rank's whole groups (every rank calls: batch norm all-reduces), one per
        #     trajectory (its last segment's row); earlier segments share their trajectory's advantage
        adv, returns = self._advantages(local, old, ref, values)

        # --- 3. mini-batches: micro-batch losses with global denominators, one optimizer step each; then the
        #     critic regresses on its targets over the same mini-batches (clipped value loss, its own optimizer)
        policy_trains = self.critic is None or step >= int(cfg.critic_warmup_steps)  # CRITIC: warm-up trains it alone
        fault("step", step, par.rank)
        totals, before_update = self._policy_updates(batch, spans if policy_trains else [], n_mb, local, old, ref,
                                                     adv, first, targets, has_rollout)
        critic_metrics = self.critic.update(batch, spans, local, values, returns, n_mb) if self.critic else {}

        # --- 4. metrics: the train-inference gap under the step's starting weights, losses, norms
        if not cfg.use_rollout_logprobs:
            before_update.update({j: o for j, o in enumerate(old) if o is not None})
        metrics = {f"train/{k}": v for k, v in totals.items()}
        metrics.update(self._gap_metrics(local, before_update if has_rollout else {}, step))
        metrics.update(self.borrowed.metrics() if self.borrowed is not None else {})
        metrics.update({"train/num_minibatches": float(n_mb), "train/optim_steps": float(self.optim.steps),
                        "train/samples": float(n_traj), "train/rows": float(len(batch)), **critic_metrics})
        seen = par.dp_sum({"real": self.policy.tokens[0] - tokens0[0], "computed": self.policy.tokens[1] - tokens0[1]})
        metrics["train/pad_frac"] = 1.0 - seen["real"] / max(seen["computed"], 1.0)
        return {**metrics, **self.policy.timings(since)}

    def _advantages(self, local: list[dict], old: list, ref: list | None, values: list | None):
        """(advantage per row of `local`, the critic's value target per row or None): algos' estimator on the
        rows that end a trajectory (after reward shaping), shared with the trajectory's earlier segments."""
        cfg, par = self.cfg, self.par
        # a rank with no rows runs the same path on (0, 1) tensors: it still joins the estimator's collectives
        dp_group = par.dp_group_gloo if par.dp_size > 1 else None  # algos reduces small CPU tensors: gloo
        lasts = [j for j, s in enumerate(local) if s["last"]]
        lb = collate([local[j] for j in lasts], {
            "old_logp": [old[j] if old[j] is not None else torch.zeros(len(local[j]["response_ids"])) for j in lasts],
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
        returns = None
        if values is not None:  # CRITIC: its targets R = raw GAE + V_old, one row per trained segment
            ret = algos.gae_returns(cfg, rewards, lb["group_ids"], lb["loss_mask"], lb["values"],
                                    old_logp=lb["old_logp"], ref_logp=lb.get("ref_logp"), token_rewards=tok_r)
            returns = segment_returns(local, lasts, ret)
        adv_of = {local[j]["traj"]: adv[b, :len(local[j]["response_ids"])] for b, j in enumerate(lasts)}
        return [adv_of[s["traj"]] if s["last"] else shared_advantage(adv_of[s["traj"]], s["loss_mask"])
                for s in local], returns

    def _policy_updates(self, batch, spans, n_mb, local, old, ref, adv, first, targets, has_rollout):
        """Step 3 for the policy: per mini-batch (`spans`: its rows of `local`) the policy loss of algos (plus the
        teachers' terms with `targets`) over micro-batches, one optimizer step. Returns (metric means over the
        mini-batches, {row: logp under the step's starting weights} from mini-batch 0's forwards)."""
        cfg, par = self.cfg, self.par
        newest = max(max(s.get("weight_versions") or [-1]) for s in batch)  # newest policy version in the batch
        totals: dict[str, float] = {}
        before_update: dict[int, torch.Tensor] = {}  # row -> trainer logp under the step's starting weights
        for mb_i, rows in enumerate(spans):
            denom = denominators(cfg, batch, n_mb, mb_i, by_group=True)

            def policy_loss(part, mb, out):  # logp, entropy (b, R); on the last pipeline stage
                mine = [rows[k] for k in part]  # this micro-batch's rows of `local`
                logp = out["logp"]
                starting = {}
                if mb_i == 0:  # still the step's starting weights: this forward IS the old policy's
                    starting = {j: logp.detach()[b, :len(local[j]["response_ids"])].cpu() for b, j in enumerate(mine)}
                old_logp = logp.detach() if mine[0] in first else mb["old_logp"]  # (b, R) 0 off the mask
                # TEACHERS (teacher.py): A' = A - pg_ratio * KL_token, and the GKD term; off without teachers
                opd = None
                if targets is not None:
                    opd = opd_terms(cfg, mb, logp, out["logits"], [targets[local[j]["traj"]] for j in mine], denom,
                                    self.teacher_heads, par.tp_group if par.tp_size > 1 else None)
                    mb["adv"] = opd.pop("adv")
                stale = (mb["weight_versions"] >= 0) & (mb["weight_versions"] < newest)  # (b, R) older weights
                loss, m = algos.policy_loss(cfg, logp, old_logp, mb["adv"], mb["loss_mask"],
                                            rollout_logp=mb["rollout_logp"] if has_rollout else None,
                                            ref_logp=mb.get("ref_logp"), entropy=out["entropy"], stale_mask=stale,
                                            denom=denom)
                if opd is not None:  # TEACHERS: L = (1 - gkd_ratio) * L_RL + gkd_ratio * L_GKD
                    loss = algos.opd_objective(cfg, loss, opd.pop("gkd_loss"))
                    m.update(opd)
                return loss, ({k: float(v) for k, v in {"loss": loss.detach(), **m}.items()}, starting)
            extras = {"old_logp": [old[j] if old[j] is not None else torch.zeros(len(local[j]["response_ids"]))
                                   for j in rows], "adv": [adv[j] for j in rows]}
            if ref is not None:
                extras["ref_logp"] = [ref[j] for j in rows]
            kept = self.policy.run([local[j] for j in rows], policy_loss, extras, backward=True,
                                   head="logits" if targets is not None else "logp")
            for _, starting in kept:
                before_update.update(starting)
            self.optim.end_minibatch(add_up(m for m, _ in kept), totals, n_mb)
        return totals, before_update

    def _gap_metrics(self, local: list[dict], before_update: dict[int, torch.Tensor], step: int) -> dict:
        """Step 4: the train-inference gap of the rows in `before_update` (logp under the step's starting weights)
        against the engine's logprobs, DP-reduced. gap: on tokens sampled by these very weights (version == step);
        off-policy: every token, so in async it also holds the policy's drift."""
        gap_local, off_local = {}, {}  # both token-weighted sums (gap_sums) of this rank's rows
        if before_update:
            rows = sorted(before_update)
            lb = collate([local[j] for j in rows], {"logp": [before_update[j] for j in rows]})
            versions = lb["weight_versions"]  # (b, R), -1 on padding
            first = torch.where(lb["loss_mask"] > 0, versions, torch.full_like(versions, 2 ** 30)).amin(
                dim=1, keepdim=True)  # (b, 1) the version of each row's first model token
            # a request that spanned an update may have sampled its newer tokens over K/V older weights computed (an
            # engine paused "in_place"; fleet.update_engines' retract recomputes it), so: rows sampled from the start
            on_policy = lb["loss_mask"] * (versions == step) * (first == step)  # (b, R)
            gap_local = gap_sums(lb["logp"], lb["rollout_logp"], on_policy)
            off_local = gap_sums(lb["logp"], lb["rollout_logp"], lb["loss_mask"])
        out, gap_max = {}, self.par.dp_max(gap_local.get("max", 0.0))
        s = self.par.dp_sum({**{k: v for k, v in gap_local.items() if k != "max"},
                             **{f"off_{k}": v for k, v in off_local.items() if k != "max"}})
        if s.get("tokens", 0) > 0:
            out.update({"train/gap_k3": s["k3"] / s["tokens"], "train/gap_abs": s["abs"] / s["tokens"],
                        "train/gap_max": gap_max})
        if s.get("off_tokens", 0) > 0:
            out["train/offpolicy_k3"] = s["off_k3"] / s["off_tokens"]
        return out

    # --- on-policy distillation (targets from teacher.py) ---------------------------------------------

    def set_teacher_heads(self, heads: dict[str, torch.Tensor]) -> None:
        """Keep each teacher's LM head (V, H), sent once: with full-vocabulary divergences the teachers
        send final hidden states and the student side turns them into logits (no V-sized logits travel)."""
        self.teacher_heads = {name: w.to(self.par.device) for name, w in heads.items()}

    def distill_step(self, batch: list[dict], targets: list[dict]) -> dict[str, float]:
        """gkd_ratio = 1: pure distillation. No old/ref logprobs and no advantages (rewards are not used);
        per mini-batch the GKD loss (algos.distill_loss) with global denominators, one optimizer step."""
        cfg, par = self.cfg, self.par
        n_mb = n_minibatches(cfg, batch)
        plan = plan_minibatches(batch, n_mb, par.dp_rank, par.dp_size, by_group=True)
        totals: dict[str, float] = {}
        for mb_i, mine in enumerate(plan):
            denom = denominators(cfg, batch, n_mb, mb_i, by_group=True)

            def gkd_loss(part, mb, out):  # logp, entropy (b, R), logits (b, R, V/tp); last pipeline stage
                opd = opd_terms(cfg, mb, out["logp"], out["logits"], [targets[mine[k]] for k in part], denom,
                                self.teacher_heads, par.tp_group if par.tp_size > 1 else None)
                opd.pop("adv")
                loss = opd.pop("gkd_loss")
                entropy = algos.aggregate(out["entropy"].detach(), mb["loss_mask"], "token_mean", denom)
                sums = {"loss": loss.detach(), "entropy": entropy, **opd}
                return loss, {k: float(v) for k, v in sums.items()}
            zero_adv = [torch.zeros(len(batch[i]["response_ids"])) for i in mine]  # unused by GKD
            kept = self.policy.run([batch[i] for i in mine], gkd_loss, {"adv": zero_adv}, backward=True, head="logits")
            self.optim.end_minibatch(add_up(kept), totals, n_mb)
        metrics = {f"train/{k}": v for k, v in totals.items()}
        metrics.update(self.borrowed.metrics() if self.borrowed is not None else {})
        metrics.update({"train/num_minibatches": float(n_mb), "train/optim_steps": float(self.optim.steps),
                        "train/samples": float(len(batch))})
        return metrics

    # --- SFT step -----------------------------------------------------------------------------------

    def sft_step(self, batch: list[dict]) -> dict[str, float]:
        """One optimizer step of cross-entropy on the loss_mask tokens of `batch` (algos.sft_loss,
        token mean over the whole batch); samples dealt to DP ranks one by one. Warm-starts the tiny model."""
        plan = plan_minibatches(batch, 1, self.par.dp_rank, self.par.dp_size, by_group=False)[0]
        denom = denominators(self.cfg, batch, 1, 0, by_group=False)

        def sft_loss(part, mb, out):  # logp, entropy (b, R); last pipeline stage
            loss = algos.sft_loss(out["logp"], mb["loss_mask"], denom)
            entropy = float((out["entropy"].detach() * mb["loss_mask"]).sum()) / denom["tokens"]
            return loss, {"sft_loss": float(loss.detach()), "entropy": entropy}
        totals: dict[str, float] = {}
        self.optim.end_minibatch(add_up(self.policy.run([batch[i] for i in plan], sft_loss, backward=True)), totals, 1)
        return {f"train/{k}": v for k, v in totals.items()}

    # --- forward-only passes ------------------------------------------------------------------------

    def compute_logprobs(self, batch: list[dict], reference: bool = False) -> list[list[float]]:
        """Per response token logprobs of every sample on every rank, for parity tests and debugging; `reference`:
        the KL term's reference model's instead."""
        self.onload(["weights"])
        return [row.tolist() for row in (self._reference_logp(batch) if reference else self.policy.per_token(batch))]

    def compute_values(self, samples: list[dict]) -> list[torch.Tensor]:
        """CRITIC: per-sample 1-D V(s_t) of every response token (for tests)."""
        return self.critic.model.per_token(samples, "values")

    def routing_used(self, batch: list[dict]) -> list[torch.Tensor]:
        """The experts the policy's routers dispatched each token of `batch` to (Model.routing_used; R3 tests)."""
        return self.policy.routing_used(batch)

    # --- weights out (Export) ---------------------------------------------------------------------------

    def export_hf_weights(self) -> list[tuple[str, torch.Tensor]]:
        """Every HF-named tensor (CPU) in one list on rank 0, [] elsewhere: for tests and tools that compare whole
        models; the weight sync and save_hf stream instead (`Export.hf_weights`). Every rank must call it."""
        return [(name, t.detach().cpu().clone()) for name, t in self.export.hf_weights()]

    def export_adapters(self) -> dict[str, torch.Tensor]:
        """LoRA: the full adapter matrices on rank 0 (Export.adapters; for tests). Every rank must call it."""
        return self.export.adapters()

    def sync_weights(self, engine_urls: list[str], version: int, base: bool = False, remote: list[str] = ()) -> dict:
        """Push the current weights to the rollout engines as `version` (Export.sync). Every rank must call it."""
        return self.export.sync(engine_urls, version, base, remote)

    def save_hf(self, path: str, adapter_path: str | None = None) -> str:
        """Write an HF model directory, with LoRA also a PEFT adapter directory (Export.save_hf); on every rank."""
        return self.export.save_hf(path, adapter_path)

    # --- checkpoints --------------------------------------------------------------------------------

    def save_checkpoint(self, directory: str) -> dict:
        """This rank's two files (call on all ranks): rank_XXXXX_model.pt (the policy's shard; advantage: gae, the
        critic's too) and rank_XXXXX_optim.pt (optimizer state, LR schedule position = optimizer steps taken, the
        critic's optimizer, python / numpy / torch RNG states). The frozen reference is not saved: load_hf()
        rebuilds it from the HF dir before load_checkpoint. Each file is written durably (write_durable: one that
        exists is complete); returns {file name: [bytes, xxh3]} for the manifest the controller writes
        (fleet.save_run_state). A write that fails on any rank (disk full) fails the save on every rank, each with
        its own files removed and the same OSError: no rank is left waiting for another in a collective."""
        self.onload()
        par, out, critic = self.par, Path(directory), self.critic
        files = {"model": {"model": self.policy.gpt.state_dict(), "world_size": par.world_size,
                           "tensor_parallel": par.tp_size}, "optim": {
            "optimizer": self.optim.state_dict(), "optim_steps": self.optim.steps, "lr_override": self.optim.lr,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}}}
        if not par.on_cpu:  # on_cpu is False exactly where CUDA runs the model
            files["optim"]["rng"]["cuda"] = torch.cuda.get_rng_state()
        if critic is not None:  # CRITIC: its weights and optimizer travel in the same files
            files["model"]["critic"] = critic.model.gpt.state_dict()
            files["optim"] |= {"critic_optimizer": critic.optim.state_dict(), "critic_steps": critic.optim.steps}
        sums, error, target = {}, None, out
        try:
            out.mkdir(parents=True, exist_ok=True)
            for kind, state in files.items():
                target = out / f"rank_{par.rank:05d}_{kind}.pt"
                sums[target.name] = write_durable(target, lambda f, state=state: torch.save(state, f))
                fault(kind, int(out.name[5:]) if out.name[5:].isdigit() else None, par.rank)
        except OSError as e:  # disk full, I/O error: every rank hears of it below
            error = (e.errno, f"rank {par.rank} writing {target}: {e.strerror or e}")
        errors = [None] * par.world_size
        torch.distributed.all_gather_object(errors, error)
        if failed := [e for e in errors if e]:  # every rank removes its part of the checkpoint
            for p in [target.with_name(target.name + ".tmp"), *(out / name for name in sums)]:
                p.unlink(missing_ok=True)
            raise OSError(failed[0][0], "; ".join(msg for _, msg in failed))
        return sums

    def load_checkpoint(self, directory: str, sums: dict) -> int:
        """Restore what save_checkpoint wrote (same world size and TP), after load_hf() built the model, each file
        checked first against `sums` (the checkpoint's manifest: {file name: [bytes, xxh3]}). Returns the optimizer
        step count (the LR schedule continues from it)."""
        par = self.par
        names = [f"rank_{par.rank:05d}_{kind}.pt" for kind in ("model", "optim")]
        if any(name not in sums for name in names):
            raise FileNotFoundError(f"checkpoint {directory} has no {names[0]}; checkpoints are per rank, so resume "
                                    f"with the world size they were saved with")
        if self.policy is None:
            raise RuntimeError("load_checkpoint needs the model built first: call load_hf(model dir) before it")
        for name in names:
            verify(Path(directory) / name, sums[name])
        self.onload()
        model, state = (torch.load(Path(directory) / name, map_location=par.device, weights_only=False)
                        for name in names)
        if (model["world_size"], model["tensor_parallel"]) != (par.world_size, par.tp_size):
            raise ValueError(f"checkpoint {directory} was saved with world_size={model['world_size']}, "
                             f"tensor_parallel={model['tensor_parallel']}; this run has {par.world_size}, "
                             f"{par.tp_size}. Resume with the same layout")
        self.policy.gpt.load_state_dict(model["model"])
        self.optim.load_state_dict(state["optimizer"])
        self.optim.steps = int(state["optim_steps"])
        self.optim.lr = state.get("lr_override")
        if self.critic is not None:
            if "critic" not in model:
                raise ValueError(f"checkpoint {directory} has no critic (it was saved by a run without "
                                 "advantage='gae'); resume it with its own advantage, or start this gae run in a new "
                                 "output_dir")
            self.critic.model.gpt.load_state_dict(model["critic"])
            self.critic.optim.load_state_dict(state["critic_optimizer"])
            self.critic.optim.steps = int(state["critic_steps"])
        rng = state["rng"]
        torch.set_rng_state(rng["torch"].cpu())
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        if "cuda" in rng and not par.on_cpu:
            torch.cuda.set_rng_state(rng["cuda"].cpu())
        return self.optim.steps

    # --- colocated memory hand-off (HandOff) ---------------------------------------------------------

    def offload(self, tags: list[str]) -> dict:
        """Free the memory of `tags` (HandOff.TAGS); returns this rank's memory afterwards (`memory`)."""
        return self.hand_off.offload(tags)

    def onload(self, tags: list[str] | None = None) -> dict:
        """Bring back what `offload` freed (all tags by default); a no-op for tags that are resident."""
        return self.hand_off.onload(tags)

    def memory(self) -> dict:
        """This rank's memory (HandOff.memory)."""
        return self.hand_off.memory()

    def shutdown(self) -> None:
        self.par.shutdown()
