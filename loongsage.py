"""LoongSage controller: one process that drives every Ray actor of an RL run.

    python loongsage.py recipes/arith_cpu.yaml                  # the default CPU recipe
    python loongsage.py recipes/arith_cpu.yaml num_steps=5 lr=1e-5 sglang.mem_fraction_static=0.8
    python loongsage.py recipes/arith_cpu.yaml --check          # validate, print the config and placement, run nothing

Read `train()` first, right below: it is the whole system, top to bottom. Every blocking point is a visible
`ray.get` / `wait`; the controller holds actor handles and object refs, never tensors.

    AgentFlow (agents, router)  --input_ids-->  RolloutEngine x N (SGLang / CPU engine, HTTP)
          |  trajectories (token ids, masks, logprobs, rewards)            ^
          v                                                                |  TransferMesh buckets
    TrainerWorker x (TP*PP*DP) (Megatron-Core): old/ref logprobs, advantages, loss, step

This file, in reading order: `train()`; the producer that feeds it and its window rules (`Producer`,
`groups_to_dispatch`, `collectable`, the version-lag bound); eval; `main`. Beside it (docs/READING.md maps every
file): config.py (`Config`, validation, `--check`), fleet.py (the actors' plumbing: placement, start-up, `wait`,
engine health, weight sync, hand-off, checkpoints, `Logger`), cpu.py (only what exists because there is no GPU).

Modes: `mode: async` runs a rollout producer beside the trainer: prompt groups are dispatched under a sliding
window (capacity C = B*(1+stale_steps) groups in flight or buffered), each is collected the moment it finishes,
a step trains on the B oldest complete groups while the rest keep generating, and at a weight update requests
in flight continue on the new weights, every token recording its version (`max_version_lag` bounds how old a
trained token may be). `mode: sync` is the same pipeline with C = B: generate, train, sync, in turn.
Debug seams: `rollout_only`, `train_only` with `load_rollouts`, `dump_rollouts`, decoded samples printed every
`print_every` steps, `recompute_old_logprobs`.

Nothing lost: a dead or hung rollout engine leaves routing and is re-created with the current weights
(fleet.check_engines); every wait on an actor fails fast and has a deadline (fleet.wait); checkpoints hold the
trainers' whole state and the controller's data cursor and RNG, and `resume: true` goes on bit-exactly
(fleet.save_run_state, fleet.load_run_state). Drills: `pytest tests/test_recover.py`.

Teachers (teacher.py) score every batch between "generate" and "train" when `teachers:` is set;
`data_sources:` mixes several datasets (each with its agent, reward, teacher and eval set) by weight.
Colocated (`colocate: true`): engines release weights and KV cache while the trainers train, and the trainers
offload optimizer state, grads and weights while the engines generate (fleet.colocate_hand_off, three visible
lines in train()).

Test: `.venv/bin/pytest tests/test_loongsage.py tests/test_async.py -q` (end-to-end runs of the CPU recipe in
sync and async mode, the producer against a simulated engine); tests/test_reading_path.py keeps this reading path.
Left out: multi-node launch scripts (join the nodes to one Ray cluster and set `ray_address`).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import random
import sys
import time
import traceback
from pathlib import Path

import ray
import yaml
from tqdm import tqdm

import algos
import convert
import data
import teacher
from config import Config, capacity, check_runtime, check_teacher_vocab, closest, explain, load_config, warn_off_policy
from fleet import (Logger, base_model, check_engines, colocate_hand_off, load_run_state, off_node, placement,
                   placement_table, prepare_model, prepare_teachers, reserve, rng_state, save_run_state, set_rng_state,
                   score_batch, start_rollout, start_teachers, start_trainers, step_usage, stop_on_exit, sync_engines,
                   update_engines, usage, wait)


@stop_on_exit  # however train() ends, its actors are stopped and its bundles freed (fleet.stop); Ray stays up
def train(cfg: Config) -> list[dict]:
    """The whole system: launch actors, then per step: rollout (a producer keeps up to C prompt groups in flight
    or buffered), train on B complete groups, sync weights, eval, checkpoint. Returns every logged metrics row.
    Reads cfg, never writes it: what the run derives (the warm start, the engines) lives in `fleet`."""
    start = time.perf_counter()  # every logged row's time/wall counts from here
    check_runtime(cfg)
    print("config:\n" + explain(cfg))
    warn_off_policy(cfg)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    samples, eval_sets = load_data(cfg)  # before any actor: a bad teacher name in the data fails here

    # --- 0. actors: the engines load the base model while the trainers start (and warm-start it, and build tiny
    #        teachers); a warm start reaches the engines as weight version 0, below. Colocated on GPUs with a warm
    #        start, the engines start after it: its training needs the memory an SGLang server holds.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        built = pool.submit(base_model, cfg)  # the tiny model is built while Ray starts (which mostly waits)
        fleet = reserve(cfg)  # Ray, the placement bundles; the engines join the fleet below
        fleet.model = base = built.result()  # what an engine loads when it is (re-)created
    late = cfg.colocate and cfg.device == "cuda" and cfg.warmstart_steps > 0
    flow = None if late else start_rollout(cfg, fleet)  # the engines (fleet.actors) and AgentFlow, which routes to them
    trainers = start_trainers(cfg, fleet)
    teacher_paths = prepare_teachers(cfg, trainers) if cfg.teachers else {}
    fleet.model = prepare_model(cfg, trainers)  # base, or its warm start (a re-created engine loads this one)
    check_teacher_vocab(fleet.model, teacher_paths)  # the built dirs, before any teacher starts
    built = ray.get([t.load_hf.remote(fleet.model) for t in trainers])
    print(f"trainer: Megatron-Core with {built[0]['megatron']}")  # what `auto` resolved to on the trainers
    flow = start_rollout(cfg, fleet) if late else flow
    fleet.urls = wait([e.url.remote() for e in fleet.actors], "starting the rollout engines", cfg.actor_timeout)
    print(f"engines: {fleet.urls}")
    teachers = start_teachers(cfg, fleet, teacher_paths) if cfg.teachers else []  # teacher.py, scores each batch
    if teachers and teacher.needs_hidden(cfg):  # hidden-state targets
        heads = teachers[0].lm_heads.remote()  # the teachers' LM heads, sent to the trainers once
        ray.get([t.set_teacher_heads.remote(heads) for t in trainers])

    # --- resume from checkpoints/latest: the trainers' state, the producer's place in the data, the RNG
    start_step, state = load_run_state(cfg, trainers) if cfg.resume else (0, None)
    if state:
        set_rng_state(state["rng"])
        sync_engines(cfg, fleet, flow, trainers, start_step, base=True)  # the engines get the checkpoint's
        print(f"resumed after step {start_step - 1}")
    elif fleet.model != base and not late:
        sync_engines(cfg, fleet, flow, trainers, 0, base=True)  # the warm start: version 0 == the trainers' weights
    logger = Logger(cfg, resume_step=start_step if state else None, start=start)

    sampling = dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, max_new_tokens=cfg.max_new_tokens)
    N = cfg.samples_per_prompt
    # --- eval before training; with teachers, each teacher of the student's architecture too (once)
    if cfg.teacher_eval and teachers and eval_sets and start_step == 0:
        logger.log(0, m := evaluate_teachers(cfg, trainers, flow, fleet, teacher_paths, eval_sets))
        print("teachers' eval accuracy: " + ", ".join(f"{k} {v:.3f}" for k, v in m.items()))
    if cfg.eval_every and eval_sets and not state:  # a resumed run logged this eval before it stopped
        logger.log(start_step, m := evaluate(cfg, flow, eval_sets, start_step))
        print("eval before training: " + ", ".join(f"{k} {v:.3f}" for k, v in m.items() if "accuracy" in k))

    producer = Producer(cfg, samples, state["producer"] if state else None)
    used = usage(fleet)  # engine busy seconds, wall clock, node CPU time: each step's perf/ fractions
    bar = tqdm(range(start_step, cfg.num_steps), desc="RL", file=sys.stdout, mininterval=5)
    for step in bar:
        t_step, metrics = time.perf_counter(), {}

        # --- 1. rollout (+ reward, inside AgentFlow): top the window up to C groups, collect finished groups
        #        until B are buffered, take the B oldest. Sync (C = B) dispatches B and waits for all of them;
        #        async leaves up to C - B groups generating while this step trains and syncs.
        t0 = time.perf_counter()
        if cfg.train_only:
            trajs = [json.loads(line) for line in open(Path(cfg.load_rollouts) / f"step_{step:05d}.jsonl")]
        else:
            while not producer.full():
                new = producer.dispatch()
                if new:  # submit returns at once: the groups start
                    wait(flow.submit.remote(new, N, sampling, step), "AgentFlow.submit", cfg.actor_timeout)
                # blocks until a group finishes; meanwhile engines are probed and dead ones re-created (the
                # trainers are idle here and hold version `step`, which a re-created engine gets)
                producer.receive(wait(flow.completed.remote(), f"rollouts of step {step}", cfg.actor_timeout,
                                      every=cfg.engine_check_every,
                                      tick=lambda: check_engines(cfg, fleet, flow, trainers,
                                                                 0 if cfg.rollout_only else step)), version=step)
            trajs, m = producer.pop_batch()
            metrics.update(m)
            # async: top the window up now, so the engines generate while this step trains
            wait(flow.submit.remote(producer.refill(), N, sampling, step), "AgentFlow.submit", cfg.actor_timeout)
        metrics["timing/generate"] = time.perf_counter() - t0  # the trainer's wait for rollouts
        metrics.update(rollout_metrics(trajs, step))
        metrics["perf/rollout_tokens_per_s"] = (metrics["rollout/generated_tokens"]
                                               / max(metrics["timing/generate"], 1e-9))
        if cfg.dump_rollouts:
            dump(trajs, Path(cfg.dump_rollouts) / f"step_{step:05d}.jsonl")
        if cfg.print_every and step % cfg.print_every == 0 and trajs:
            bar.write(logger.sample(step, trajs[0]))  # a decoded sample: prompt -> response, its reward

        trajs, metrics["rollout/empty_groups"], error = drop_empty_groups(trajs)
        if not trajs:  # every group failed, was aborted or was filtered out: nothing to learn from
            bar.write(f"step {step}: no group has a token to train on (every group failed, was aborted or "
                      f"was filtered out){'; first error: ' + error[:500] if error else ''}; skipping the update")
        if not cfg.rollout_only and trajs:
            # --- 2. old/ref logprobs, advantages, policy update (all inside the trainers; one call per rank); with
            #        advantage=gae also the critic's values and its update (a second model in each trainer rank)
            metrics.update(colocate_hand_off(cfg, fleet, flow, trainers, "train"))  # colocated: engines release memory
            t0 = time.perf_counter()
            batch_ref = ray.put(trajs)
            # TEACHERS (teacher.py): rank 0's per-token targets reach the trainers by ref; the metrics get blocks
            targets_ref = None
            if teachers:
                teachers, targets_ref, m = score_batch(cfg, fleet, teachers, teacher_paths, batch_ref, step)
                metrics.update(m)
                metrics["timing/teacher"], t0 = time.perf_counter() - t0, time.perf_counter()
            metrics.update(wait([t.train_step.remote(batch_ref, step, targets_ref) for t in trainers],
                                f"train step {step}", cfg.actor_timeout)[0])  # reduced over DP ranks
            metrics["timing/train"] = time.perf_counter() - t0

            # --- 3. weights -> engines (TransferMesh); engines then report version step + 1. Requests in
            #        flight keep their tokens and continue on the new weights (partial rollouts).
            metrics.update(colocate_hand_off(cfg, fleet, flow, trainers, "sync"))  # engines get their weights back
            t0 = time.perf_counter()
            metrics.update(sync_engines(cfg, fleet, flow, trainers, step + 1))  # skips, then re-creates, dead engines
            metrics["timing/sync"] = time.perf_counter() - t0
            metrics.update(colocate_hand_off(cfg, fleet, flow, trainers, "rollout"))  # engine KV cache back, continue

        # --- 4. eval
        last = step == cfg.num_steps - 1
        if cfg.eval_every and eval_sets and ((step + 1) % cfg.eval_every == 0 or last):
            t0 = time.perf_counter()
            metrics.update(evaluate(cfg, flow, eval_sets, step + 1))
            metrics["timing/eval"] = time.perf_counter() - t0

        perf, used = step_usage(fleet, used, t_step, metrics["timing/generate"], local=not cfg.ray_address)
        metrics.update({**perf, **wait(flow.engine_metrics.remote(), "AgentFlow.engine_metrics", cfg.actor_timeout)})
        logger.log(step, metrics)
        bar.write(logger.line(step, metrics))

        # --- 5. checkpoint, after the step's metrics are logged: a resumed run has every row up to it
        if cfg.save_every and not cfg.rollout_only and ((step + 1) % cfg.save_every == 0 or last):
            save_run_state(cfg, trainers, step, {"producer": producer.state(), "rng": rng_state()})

    # --- end: stop the producer, export HF weights, plot
    ray.get(flow.abort.remote())
    if not cfg.rollout_only:
        ray.get([t.save_hf.remote(str(out / "final_hf"), str(out / "final_adapter")) for t in trainers])
        print(f"final HF checkpoint: {out / 'final_hf'}" + (f" (LoRA merged in; the PEFT adapter: "
                                                            f"{out / 'final_adapter'})" if cfg.lora_rank else ""))
    print(f"reward curve: {logger.plot()}\nmetrics: {out / 'metrics.jsonl'}")
    logger.close()
    return logger.history


# ================================================================================================
# the data and the rollout producer (fully async): two pure functions decide how many prompt groups to dispatch
# and which finished ones to collect. R = groups dispatched and not yet collected (running, or finished but held
# back by the window); Q = groups collected into the buffer and not yet trained on; C = capacity (config.capacity).


def load_data(cfg: Config) -> tuple[list[dict], dict[str, list[dict]]]:
    """(training samples, eval sets {name: samples}): "" is eval_dataset (or the data sources' eval sets, when
    there are any), the others are cfg.eval_sets. With data_sources every sample carries `source` and, unless it
    has its own, the source's `teacher`; sample teachers are checked against `teachers:` here."""
    if not cfg.data_sources:
        samples = data.load_dataset(cfg.dataset)
        evals = data.load_dataset(cfg.eval_dataset) if cfg.eval_dataset else []
    else:
        samples, evals = [], []
        for src in cfg.data_sources:
            for spec, into in ((src["dataset"], samples), (src.get("eval_dataset"), evals)):
                for s in (data.load_dataset(spec) if spec else []):
                    s["source"] = src["name"]
                    if src.get("teacher") is not None and s.get("teacher") is None:
                        s["teacher"] = src["teacher"]
                    into.append(s)
    names = list(cfg.teachers)
    for s in samples:
        ref = s.get("teacher")
        for t in ([] if ref is None else [ref] if isinstance(ref, str) else list(dict(ref))):
            if t not in names:
                raise ValueError(f"a sample of {s.get('source') or cfg.dataset!r} names teacher {t!r}, which is not "
                                 f"in teachers: {names}{closest(str(t), names)}")
        if ref is None and len(names) > 1 and not cfg.teacher_route:
            raise ValueError(f"a sample of {s.get('source') or cfg.dataset!r} has no teacher and there are "
                             f"{len(names)} teachers {names}; add a `teacher` field, a source teacher or teacher_route")
    others = {name: data.load_dataset(spec) for name, spec in cfg.eval_sets.items()}
    evals_by_name = {**({"": evals} if evals else {}), **others}
    seen = {json.dumps(s["messages"], sort_keys=True) for s in samples}
    for name, ev in evals_by_name.items():  # an eval item also trained on measures memory, not skill: say how many
        both = sum(json.dumps(s["messages"], sort_keys=True) in seen for s in ev)
        print(f"eval set {name or 'eval_dataset'}: {both} of {len(ev)} items also in the training data")
    return samples, evals_by_name


def groups_to_dispatch(window: str, C: int, R: int, Q: int, next_seq: int, oldest_uncollected: int) -> int:
    """How many new groups to dispatch now. Every window keeps R + Q <= C. window-gated also keeps every
    dispatched sequence number within C of the oldest uncollected group, so one slow group holds new work
    back (its lag stays bounded) instead of the producer racing ahead of it."""
    if data.is_dotted(window):  # EXT: a user's window strategy
        return data.import_object(window).groups_to_dispatch(C, R, Q, next_seq, oldest_uncollected)
    room = C - R - Q
    if window == "window-gated":
        room = min(room, oldest_uncollected + C - next_seq)
    return max(0, room)


def collectable(window: str, finished: list[int], min_unfinished: int | None, oldest_uncollected: int,
                B: int, C: int) -> list[int]:
    """Which finished groups (sequence numbers) move into the buffer now. no-window: any; window-gated: those
    inside the window [oldest uncollected, + C); windowed-fifo: only those fewer than B sequence numbers past
    the oldest unfinished group, so the buffer fills roughly in dispatch order (others wait)."""
    if data.is_dotted(window):  # EXT: a user's window strategy
        return data.import_object(window).collectable(finished, min_unfinished, oldest_uncollected, B, C)
    if window == "windowed-fifo" and min_unfinished is not None:
        return sorted(s for s in finished if s - min_unfinished < B)
    if window == "window-gated":
        return sorted(s for s in finished if s - oldest_uncollected < C)
    return sorted(finished)


def lag_over(group: list[dict], version: int, max_lag: int) -> int:
    """Loss tokens of a group generated more than `max_lag` weight versions before `version` (the weights
    about to be updated); 0 when there is no bound."""
    if max_lag < 0:
        return 0
    return sum(m and 0 <= v < version - max_lag for t in group for v, m in zip(t["weight_versions"], t["loss_mask"]))


def mask_lagging(group: list[dict], version: int, max_lag: int) -> None:
    """Drop from the loss (loss_mask 0, rollout logprob 0) every token older than the lag bound allows."""
    for t in group:
        for i, v in enumerate(t["weight_versions"]):
            if t["loss_mask"][i] and 0 <= v < version - max_lag:
                t["loss_mask"][i], t["rollout_logprobs"][i] = 0, 0.0


def _epochs(pool: list[dict], key: str):
    """Endless shuffled epochs of `pool`; epoch e is shuffled by its own seed (`key`/e)."""
    for epoch in itertools.count():
        order = list(range(len(pool)))
        random.Random(f"{key}/{epoch}").shuffle(order)
        for j in order:
            yield pool[j]


def prompt_stream(cfg: Config, samples: list[dict], cursor: int = 0):
    """Endless shuffled epochs of samples from position `cursor` on: yields (cursor, sample), cursor counting the
    samples drawn so far. The order is a function of the seed alone, so a resumed run continues it from its
    saved cursor. With `data_sources` each source is its own stream and position i goes to the source whose
    share (weight / total) is most owed, so every prefix of the stream holds each source's share to within one."""
    if not cfg.data_sources:
        streams, weights = {"": _epochs(samples, str(cfg.seed))}, {"": 1.0}
    else:
        weights = {src["name"]: float(src.get("weight", 1.0)) for src in cfg.data_sources}
        streams = {n: _epochs([x for x in samples if x["source"] == n], f"{cfg.seed}/{n}") for n in weights}
    total, owed = sum(weights.values()), {n: 0.0 for n in weights}
    for i in itertools.count(1):
        owed = {n: owed[n] + w / total for n, w in weights.items()}
        name = max(owed, key=owed.get)  # ties: the first source listed
        owed[name] -= 1.0
        sample = next(streams[name])
        if i > cursor:  # positions before the cursor were drawn by the run being resumed: replayed, not yielded
            yield i, sample


class Producer:
    """The rollout producer's bookkeeping, fully async, in plain Python (no Ray, so tests drive it directly).

    Every prompt group is known by its sequence number (its group id). `dispatch()` hands out new groups while
    the window allows; `receive()` takes the groups AgentFlow finished, collects them into the buffer as the
    window allows (dropping uninformative ones under dynamic sampling), and moves the oldest buffered groups
    into the step's batch, applying the version-lag bound (a group it leaves with no token to train on gives its
    place to the next complete one); `pop_batch()` returns the batch once it holds B groups. train() moves groups
    between it and AgentFlow with visible calls.
    """

    def __init__(self, cfg: Config, samples: list[dict], state: dict | None = None):
        """`state`: what `state()` returned when a checkpoint was saved (resume)."""
        self.cfg, self.B, self.C = cfg, cfg.prompts_per_step, capacity(cfg)
        self.next_seq, self.cursor = (state or {}).get("next_seq", 0), (state or {}).get("cursor", 0)
        self.prompts = prompt_stream(cfg, samples, self.cursor)  # (cursor, sample) from where the run was
        self.prompt_of: dict[int, dict] = {}  # seq -> sample, for every group dispatched and not yet trained on
        self.running: set[int] = set()  # R: dispatched, not collected (generating, or finished and held back)
        self.finished: dict[int, list[dict]] = {}  # finished, waiting for the window to collect them
        self.buffer: dict[int, list[dict]] = {}  # collected, not yet in a batch
        self.batch: list[list[dict]] = []  # the groups of the step being assembled (with buffer: Q)
        # (prompt, is a regeneration) to dispatch first; at a resume, the groups that were in flight
        self.redo: list[tuple[dict, bool]] = [(sample, again) for sample, again in (state or {}).get("pending", [])]
        self.second_try: set[int] = set()  # seqs dispatched as a regeneration: never regenerated again
        self.stats = dict(dropped=0, regenerated=0, masked=0, stale=0)  # this step's counts

    def state(self) -> dict:
        """JSON for a checkpoint: the place in the data and the next sequence number, plus the prompts of groups
        dispatched and not yet trained on (in flight or buffered), which a resumed run dispatches again (their
        partial tokens are not kept: sync mode has none at a checkpoint, so it resumes exactly)."""
        pending = [[self.prompt_of[seq], seq in self.second_try] for seq in sorted(self.prompt_of)]
        return {"next_seq": self.next_seq, "cursor": self.cursor, "pending": pending + [list(r) for r in self.redo]}

    def dispatch(self, capacity: int | None = None) -> list[tuple[int, dict]]:
        """New (seq, prompt) groups to start now, as many as the window allows (`capacity`: C unless given)."""
        queued = len(self.buffer) + len(self.batch)  # Q: collected and not yet trained on
        n = groups_to_dispatch(self.cfg.window, self.C if capacity is None else capacity, len(self.running), queued,
                               self.next_seq, min(self.running, default=self.next_seq))
        new = []
        for _ in range(n):
            if self.redo:
                sample, again = self.redo.pop(0)
            else:
                (self.cursor, sample), again = next(self.prompts), False
            if again:
                self.second_try.add(self.next_seq)
            self.prompt_of[self.next_seq] = sample
            self.running.add(self.next_seq)
            new.append((self.next_seq, sample))
            self.next_seq += 1
        return new

    def receive(self, groups: list[dict], version: int) -> None:
        """Record finished groups ({"seq", "trajs", "aborted"} from AgentFlow.completed), collect what the
        window allows, and fill the batch from the oldest buffered groups. `version`: the weights the
        batch will update (the lag bound's reference)."""
        cfg = self.cfg
        if not groups and self.running - self.finished.keys():
            raise RuntimeError(f"AgentFlow reports nothing running, but groups {sorted(self.running)[:8]} were "
                               "dispatched and never came back; they were lost (was AgentFlow restarted?)")
        for g in groups:
            if g["aborted"]:  # an engine cut it short: its prompt goes again
                self.running.discard(g["seq"])
                self.redo.append((self.prompt_of.pop(g["seq"]), g["seq"] in self.second_try))
            else:
                self.finished[g["seq"]] = g["trajs"]
        unfinished = self.running - self.finished.keys()
        for seq in collectable(cfg.window, list(self.finished), min(unfinished, default=None),
                               min(self.running, default=self.next_seq), self.B, self.C):
            self.running.discard(seq)
            group = self.finished.pop(seq)
            # DAPO dynamic sampling (arXiv 2503.14476 §3.2): equal rewards give every sample a zero advantage.
            # Departure: "not all equal" rather than "not all correct/incorrect", so graded rewards work too
            equal = cfg.dynamic_sampling and len({t["reward"] for t in group}) == 1
            if equal or (cfg.group_filter and not data.import_object(cfg.group_filter)(group)):
                self.stats["dropped"] += 1  # equal rewards (DAPO: zero advantages) or the user's filter; refilled
                self.prompt_of.pop(seq)
            else:
                self.buffer[seq] = group
        while self.buffer and len(self.batch) < self.B:  # oldest first
            seq = min(self.buffer)
            group, sample = self.buffer.pop(seq), self.prompt_of.pop(seq)
            over = lag_over(group, version, cfg.max_version_lag)  # tokens older than the bound allows
            if over and cfg.lag_policy == "regenerate" and seq not in self.second_try:
                self.redo.append((sample, True))  # once: a long trajectory is masked next time, not starved
                self.stats["regenerated"] += 1
                continue
            if over:
                mask_lagging(group, version, cfg.max_version_lag)
                self.stats["masked"] += over
                if not any(m for t in group for m in t["loss_mask"]):
                    # every token was too old (a group that waited on its tools across the bound): it has nothing
                    # left to train on, so the next complete group takes its place and the step still trains B
                    self.stats["stale"] += 1
                    continue
            self.batch.append(group)

    def refill(self) -> list[tuple[int, dict]]:
        """Right after pop_batch, async only: groups dispatched before the step trains, so the engines generate
        while the trainers train. They start one version older than groups dispatched after the sync, so the window
        keeps a batch's room (R + Q <= C - B) and they are still trained within stale_steps versions (filling to C
        would put each one version past max_version_lag, masking whole batches). Sync dispatches nothing here."""
        return self.dispatch(self.C - self.B) if self.cfg.stale_steps > 0 else []

    def full(self) -> bool:
        """B groups are ready (or dynamic sampling found too few informative ones: train on what there is)."""
        gave_up = (self.cfg.dynamic_sampling or self.cfg.group_filter) and self.stats["dropped"] >= 4 * self.B
        return len(self.batch) >= self.B or gave_up

    def pop_batch(self) -> tuple[list[dict], dict]:
        trajs = [t for group in self.batch for t in group]
        metrics = {"rollout/buffer_groups": len(self.buffer), "rollout/running_groups": len(self.running),
                   "rollout/lag_masked_tokens": self.stats["masked"],
                   "rollout/regenerated_groups": self.stats["regenerated"],
                   "rollout/lag_dropped_groups": self.stats["stale"]}
        if self.cfg.dynamic_sampling or self.cfg.group_filter:
            metrics.update({"rollout/groups_kept": len(self.batch),
                            "rollout/groups_sampled": len(self.batch) + self.stats["dropped"]})
        self.batch, self.stats = [], dict(dropped=0, regenerated=0, masked=0, stale=0)
        return trajs, metrics


def rollout_metrics(trajs: list[dict], version: int) -> dict:
    """`rollout/` metrics of one batch of trajectory dicts trained at weight `version`."""
    n = max(len(trajs), 1)
    versions = [v for t in trajs for v, m in zip(t["weight_versions"], t["loss_mask"]) if m]
    lags = [version - v for v in versions]
    return {
        "rollout/samples": len(trajs),
        "rollout/reward_mean": sum(t["reward"] for t in trajs) / n,
        "rollout/response_len": sum(len(t["response_ids"]) for t in trajs) / n,
        "rollout/generated_tokens": len(versions),
        "rollout/failed_frac": sum(t["status"] == "failed" for t in trajs) / n,
        "rollout/failed": sum(t["status"] == "failed" for t in trajs),
        "rollout/truncated_frac": sum(t["status"] == "truncated" for t in trajs) / n,
        "rollout/weight_version_min": min(versions, default=-1),
        "rollout/weight_version_max": max(versions, default=-1),
        # async: how off-policy the trained tokens are (lag = version being updated - version that sampled it)
        "rollout/lag_min": min(lags, default=0), "rollout/lag_max": max(lags, default=0),
        "rollout/lag_mean": sum(lags) / max(len(lags), 1),
        "rollout/on_policy_frac": sum(lag == 0 for lag in lags) / max(len(lags), 1),
        "rollout/partial_frac": sum(len({v for v, m in zip(t["weight_versions"], t["loss_mask"]) if m}) > 1
                                    for t in trajs) / n,  # trajectories whose tokens span a weight update
        "rollout/lag": lags,  # per token: a TensorBoard histogram
        **{f"rollout/{src}/reward_mean": sum(t["reward"] for t in ts) / len(ts)
           for src, ts in _by_source(trajs).items()},
    }


def _by_source(trajs: list[dict]) -> dict[str, list[dict]]:
    by: dict[str, list[dict]] = {}
    for t in trajs:
        src = (t.get("metadata") or {}).get("source")
        if src is not None:
            by.setdefault(src, []).append(t)
    return by


def drop_empty_groups(trajs: list[dict]) -> tuple[list[dict], int, str]:
    """Leave out groups with no trainable token (every sample failed, or generated nothing): they carry
    no signal, and a mini-batch of only such groups would still move Adam's weights (momentum) on zero
    gradients. Groups with some failed samples stay whole: those keep reward 0 and an all-zero loss
    mask. Returns (kept trajectories, groups left out, the first error seen, for the log)."""
    by: dict[int, list[dict]] = {}
    for t in trajs:
        by.setdefault(t["group_id"], []).append(t)
    kept = [g for g in by.values() if any(any(t["loss_mask"]) for t in g)]
    error = next((t.get("metadata", {}).get("error") for t in trajs if t.get("metadata", {}).get("error")), "")
    return [t for g in kept for t in g], len(by) - len(kept), error


def dump(trajs: list[dict], path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(t) + "\n" for t in trajs))


# ================================================================================================
# eval


def eval_metrics(trajs: list[dict], k: int, prefix: str = "eval/") -> dict:
    """mean@k (`accuracy`: the mean reward of k samples per prompt) and the unbiased pass@j for j = 1, 2, 4, ..
    up to k (a sample passes when its reward is >= 1), from complete groups of k."""
    groups: dict[int, list[float]] = {}
    for t in trajs:
        groups.setdefault(t["group_id"], []).append(t["reward"])
    out = {f"{prefix}accuracy": sum(t["reward"] for t in trajs) / max(len(trajs), 1),
           f"{prefix}response_len": sum(len(t["response_ids"]) for t in trajs) / max(len(trajs), 1),
           # agents: samples whose model spoke more than once (calc: the first turn was a tool call)
           f"{prefix}multi_turn_frac": sum((t.get("metadata") or {}).get("turns", 1) > 1 for t in trajs)
           / max(len(trajs), 1)}
    j = 1
    while j <= k and k > 1:
        out[f"{prefix}pass@{j}"] = sum(algos.pass_at_k(len(r), sum(x >= 1 for x in r), j)
                                       for r in groups.values()) / max(len(groups), 1)
        j = j * 2 if j * 2 <= k or j == k else k
    return out


def evaluate(cfg: Config, flow, eval_sets: dict[str, list[dict]], step: int) -> dict:
    """Every eval set ("" is cfg.eval_dataset: eval/accuracy; others eval/<name>/accuracy), k = eval_samples
    samples per prompt at eval_temperature, plus a greedy pass when eval_greedy."""
    sampled = dict(temperature=cfg.eval_temperature, top_p=1.0, top_k=-1, max_new_tokens=cfg.max_new_tokens)
    out = {}
    for name, samples in eval_sets.items():
        prefix = f"eval/{name}/" if name else "eval/"
        trajs = wait(flow.generate.remote(samples, cfg.eval_samples, sampled, step), f"eval at step {step}",
                     cfg.actor_timeout)
        out.update(eval_metrics(trajs, cfg.eval_samples, prefix))
        for src, ts in _by_source(trajs).items():  # data_sources: one accuracy per source's eval set
            out[f"{prefix}{src}/accuracy"] = sum(t["reward"] for t in ts) / len(ts)
        if cfg.eval_greedy:
            greedy = wait(flow.generate.remote(samples, 1, {**sampled, "temperature": 0.0}, step),
                          f"greedy eval at step {step}", cfg.actor_timeout)
            out[f"{prefix}greedy_accuracy"] = eval_metrics(greedy, 1)["eval/accuracy"]
    return out


def evaluate_teachers(cfg: Config, trainers, flow, fleet, paths: dict[str, str], eval_sets) -> dict:
    """`teacher/<name>/<source>/accuracy` (and `teacher/<name>/accuracy`): each teacher of the student's architecture is
    loaded into the trainers, pushed to the engines and evaluated like the student; then the student's weights
    (fleet.model) go back (version 0). Other architectures cannot be served by the student's engines and are skipped."""
    mine = teacher.arch_key(convert.read_hf_config(fleet.model))

    def serve(path: str, version: int) -> None:  # update_engines: no answer runs over the previous model's prefix K/V
        ray.get([t.load_hf.remote(path) for t in trainers])
        update_engines(cfg, fleet, fleet.urls, lambda: ray.get([
            t.sync_weights.remote(fleet.urls, version, remote=off_node(fleet, fleet.urls)) for t in trainers]))
    out = {}
    for name, path in paths.items():
        if teacher.arch_key(convert.read_hf_config(path)) != mine:
            print(f"teacher {name}: another architecture than the student, not evaluated")
            continue
        serve(path, -1)
        m = evaluate(cfg, flow, eval_sets, 0)
        out.update({f"teacher/{name}/{k[len('eval/'):]}": v for k, v in m.items() if k.endswith("accuracy")})
    serve(fleet.model, 0)
    return out


def main(argv: list[str]) -> int:
    """`python loongsage.py RECIPE.yaml [key=value ...] [--check]` (--check: validate and print, run nothing)."""
    check_only = "--check" in argv
    argv = [a for a in argv if a != "--check"]
    recipe = argv[0] if argv and "=" not in argv[0] else None
    overrides = argv[1:] if recipe else argv
    try:
        cfg = load_config(recipe, overrides)
    except (ValueError, FileNotFoundError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if check_only:
        print(explain(cfg, placement_table(cfg, placement(cfg))) + "\nconfig OK")
        return 0
    ours = not ray.is_initialized()  # the Ray train() starts is shut down here; a caller's Ray stays up
    try:
        train(cfg)
    except Exception:  # noqa: BLE001  an actor's traceback arrives here inside the RayTaskError
        print("run failed:\n" + traceback.format_exc(), file=sys.stderr)
        return 1
    finally:
        if ours and ray.is_initialized():
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
