"""LoongSage controller: one process that drives every Ray actor of an RL run.

    python loongsage.py recipes/arith_cpu.yaml                  # the default CPU recipe
    python loongsage.py recipes/arith_cpu.yaml num_steps=5 lr=1e-5 sglang.mem_fraction_static=0.8

Read `train()` first: it is the whole system, top to bottom. Every blocking point is a visible
`ray.get`; the controller holds actor handles and object refs, never tensors.

    AgentFlow (agents, router)  --input_ids-->  RolloutEngine x N (SGLang / CPU engine, HTTP)
          |  trajectories (token ids, masks, logprobs, rewards)            ^
          v                                                                |  TransferMesh buckets
    TrainerWorker x (TP*PP*DP) (Megatron-Core): old/ref logprobs, advantages, loss, step

Modes: `mode: async` runs a rollout producer beside the trainer: prompt groups are dispatched under a sliding
window (capacity C = B*(1+stale_steps) groups in flight or buffered), each is collected the moment it finishes,
a step trains on the B oldest complete groups while the rest keep generating, and at a weight update requests
in flight continue on the new weights, every token recording its version (`max_version_lag` bounds how old a
trained token may be). `mode: sync` is the same pipeline with C = B: generate, train, sync, in turn.
Debug seams: `rollout_only`, `train_only` with `load_rollouts`, `dump_rollouts`, decoded samples printed every
`print_every` steps, `recompute_old_logprobs`.

Nothing lost: a dead or hung rollout engine leaves routing and is re-created with the current weights
(`check_engines`); every wait on an actor fails fast and has a deadline (`wait`); checkpoints hold the
trainers' whole state and the controller's data cursor and RNG, and `resume: true` goes on bit-exactly
(`save_run_state`, `load_run_state`). Drills: `pytest tests/test_recover.py`.

Teachers (teacher.py) score every batch between "generate" and "train" when `teachers:` is set;
`data_sources:` mixes several datasets (each with its agent, reward, teacher and eval set) by weight.
Colocated (`colocate: true`): engines release weights and KV cache while the trainers train, and the trainers offload
optimizer state, grads and weights while the engines generate (`colocate_hand_off`, three visible lines in train()).
Left out here (see the issues): multi-node launch scripts.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import itertools
import json
import math
import os
import random
import shutil
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import ray
import yaml
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from tqdm import tqdm

import algos
import cpu
import data
import teacher
import trainer  # cheap: Megatron loads inside the trainer actors, not here
import transfermesh
from config import (Config, capacity, check_runtime, check_teacher_vocab, closest, explain, load_config, teacher_spec,
                    warn_off_policy)


# ================================================================================================
# data


def load_data(cfg: Config) -> tuple[list[dict], list[dict]]:
    """(training samples, eval samples). With data_sources every sample carries `source` and, unless it
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
    return samples, evals


# ================================================================================================
# the tiny model: build, warm-start with SFT through the same trainer, cache


def checkpoint_fingerprint(path: str) -> str:
    """A fast hash of an HF model directory: every file's name and size, plus the first and last MiB of each
    weight file (a changed checkpoint almost always changes one of these; hashing GBs in full would not pay)."""
    h = hashlib.sha256()
    for f in sorted(Path(path).iterdir()):
        if f.is_file():
            h.update(f"{f.name}:{f.stat().st_size}".encode())
            if f.suffix in (".safetensors", ".json", ".bin", ".jinja"):
                with open(f, "rb") as fh:
                    h.update(fh.read(2**20))
                    fh.seek(max(0, f.stat().st_size - 2**20))
                    h.update(fh.read(2**20))
    return h.hexdigest()[:12]


def base_model(cfg: Config) -> str:
    """The checkpoint a run starts from, before any warm start: "tiny" builds (and caches) the tiny Qwen3 of
    data.py; anything else is an HF directory."""
    if cfg.model_path != "tiny":
        return cfg.model_path
    return data.build_tiny_model(data.default_cache_dir() / f"tiny-{data.settings_hash(cfg.tiny_model)}",
                                 **cfg.tiny_model)


def prepare_model(cfg: Config, trainers) -> str:
    """Resolve cfg.model_path: "tiny" builds (and caches) the tiny Qwen3 of data.py, anything else is an HF
    directory. With `warmstart_steps`, SFT it on `warmstart_dataset` through the same Megatron trainers first,
    save it as HF, and cache it by the base checkpoint's fingerprint and the SFT settings."""
    base = base_model(cfg)
    if cfg.warmstart_steps == 0:
        return base
    keys = ("warmstart_steps", "warmstart_dataset", "warmstart_batch_size", "warmstart_lr",
            "warmstart_label_noise", "warmstart_example", "warmstart_stop_loss", "seed")
    settings = {k: getattr(cfg, k) for k in keys} | {"base": checkpoint_fingerprint(base)}
    out = data.default_cache_dir() / f"{Path(base).name}-sft-{data.settings_hash(settings)}"
    if (out / "model.safetensors").exists():
        print(f"warm start: cached SFT model {out}")
        return str(out)
    tok = data.load_tokenizer(base)
    example = data.import_object(cfg.warmstart_example)
    samples = data.load_dataset(cfg.warmstart_dataset)
    rng = random.Random(cfg.seed)
    ray.get([t.load_hf.remote(base, lr=cfg.warmstart_lr) for t in trainers])
    bar = tqdm(range(cfg.warmstart_steps), desc="warm start (SFT)", file=sys.stdout, mininterval=2)
    losses = []
    for step in bar:
        batch = [example(tok, s, rng, cfg.warmstart_label_noise)
                 for s in rng.sample(samples, cfg.warmstart_batch_size)]
        m = ray.get([t.sft_step.remote(batch) for t in trainers])[0]
        bar.set_postfix(loss=f"{m['train/sft_loss']:.3f}", refresh=False)
        # a skill a tiny model learns in a sudden, seed-dependent transition (calc's copying of digits) needs a
        # stop on the loss, not a fixed count; 20 steps average out one small batch's noise
        losses.append(m["train/sft_loss"])
        if cfg.warmstart_stop_loss > 0 and len(losses) >= 20 and sum(losses[-20:]) / 20 < cfg.warmstart_stop_loss:
            break
    bar.close()
    if cfg.warmstart_stop_loss > 0:
        recent = sum(losses[-20:]) / len(losses[-20:])
        if len(losses) >= 20 and recent < cfg.warmstart_stop_loss:
            print(f"warm start: SFT loss {recent:.3f} (mean of the last 20 steps) < warmstart_stop_loss "
                  f"{cfg.warmstart_stop_loss} after {len(losses)} steps")
        else:
            print(f"warm start: WARNING: SFT loss {recent:.3f} (mean of the last 20 steps) is still above "
                  f"warmstart_stop_loss {cfg.warmstart_stop_loss} after all {cfg.warmstart_steps} warmstart_steps: "
                  f"the policy may not have learned the task's protocol; raise warmstart_steps")
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")  # two runs warm-starting the same model do not share it
    ray.get([t.save_hf.remote(str(tmp)) for t in trainers])
    try:
        tmp.rename(out)
    except OSError:  # the other run saved first: same settings, so the same model; keep its copy
        if not (out / "model.safetensors").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


# ================================================================================================
# Ray: placement and actors


def placement(cfg: Config) -> dict:
    """Where every actor goes, as data (reserve() and start_* follow it; `--check` prints it; tests place it on simulated GPUs).

    GPU: one {"GPU": 1} bundle per GPU. Trainer rank r holds bundle r. Engine i (an SGLang server with
    tensor parallel size k = gpus_per_engine) spans k consecutive bundles and its actor sits on the first:
    disaggregated, the k bundles after the trainers'; colocated (`colocate`), bundles i*k .. i*k+k-1 of the
    trainers', where trainer and engine actors take half a GPU each (they hand the memory over in turn). The
    server process sees all k GPUs (CUDA_VISIBLE_DEVICES from the bundles' GPU ids, see `bundle_gpus`).
    CPU: one {"CPU": n} bundle per trainer rank and per engine; colocated, a trainer's bundle also holds its engine.
    Returns {"bundles": [resource dicts], "trainers": [actor options], "engines": [actor options + "gpu_bundles"]}.
    """
    gpu, T, E, k = cfg.device == "cuda", cfg.trainer_workers, cfg.num_engines, cfg.gpus_per_engine
    if gpu:
        bundles = [{"GPU": 1, "CPU": cfg.cpus_per_trainer} for _ in range(T)]
        first = 0 if cfg.colocate else T  # the bundle engine 0 starts on
        if cfg.colocate:
            for i in range(E * k):
                bundles[i]["CPU"] += cfg.cpus_per_engine / k  # the engine's CPUs, spread over its bundles
        else:
            bundles += [{"GPU": 1, "CPU": cfg.cpus_per_engine / k} for _ in range(E * k)]
        share = 0.5 if cfg.colocate else 1.0
        trainers = [dict(bundle=r, num_gpus=share, num_cpus=cfg.cpus_per_trainer) for r in range(T)]
        engines = [dict(bundle=first + i * k, num_gpus=share, num_cpus=cfg.cpus_per_engine / k,
                        gpu_bundles=list(range(first + i * k, first + (i + 1) * k))) for i in range(E)]
    else:
        bundles = [{"CPU": cfg.cpus_per_trainer} for _ in range(T)]
        if cfg.colocate:
            for i in range(E):
                bundles[i * T // E]["CPU"] += cfg.cpus_per_engine
        else:
            bundles += [{"CPU": cfg.cpus_per_engine} for _ in range(E)]
        trainers = [dict(bundle=r, num_gpus=0, num_cpus=cfg.cpus_per_trainer) for r in range(T)]
        engines = [dict(bundle=(i * T // E) if cfg.colocate else T + i, num_gpus=0, num_cpus=cfg.cpus_per_engine,
                        gpu_bundles=[]) for i in range(E)]
    return {"bundles": bundles, "trainers": trainers, "engines": engines}


def placement_table(cfg: Config, plan: dict, where: list | None = None) -> str:
    """One line per actor: bundle, Ray resources, and (once reserved) node and GPU ids."""
    rows = [f"{'actor':12s} {'bundle':>6s} {'GPU':>5s} {'CPU':>5s}  " + ("node / GPU ids" if where else "")]
    for kind, opts in (("trainer", plan["trainers"]), ("engine", plan["engines"])):
        for i, o in enumerate(opts):
            span = f" (+ bundles {o['gpu_bundles'][1:]})" if len(o.get("gpu_bundles", [])) > 1 else ""
            loc = ""
            if where:
                bs = o.get("gpu_bundles") or [o["bundle"]]
                loc = f"{where[o['bundle']][0][:12]} / {[g for b in bs for g in where[b][1]]}"
            rows.append(f"{kind + ' ' + str(i):12s} {o['bundle']:6d} {o['num_gpus']:5.2g} {o['num_cpus']:5.3g}  {loc}{span}")
    return "\n".join(rows)


def bundle_gpus(pg, n: int) -> list[tuple[str, list[str]]]:
    """(node id, GPU ids) of each of the n bundles, asked of Ray by a tiny task on each (before any actor
    holds them). Engines spanning several bundles pass these ids to their server as CUDA_VISIBLE_DEVICES."""
    def where_am_i() -> tuple[str, list[str]]:  # defined in here, so Ray ships it by value and the task's worker
        # imports only Ray (a module-level function would import this module and torch: ~1.3 s of every start)
        return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]

    has_gpu = ray.available_resources().get("GPU", 0) > 0 or ray.cluster_resources().get("GPU", 0) > 0
    probe = ray.remote(where_am_i)
    return ray.get([probe.options(num_cpus=0, num_gpus=0.01 if has_gpu else 0,
                                  scheduling_strategy=PlacementGroupSchedulingStrategy(pg, b)).remote()
                    for b in range(n)])


def reserve(cfg: Config):
    """Start Ray and reserve the placement bundles (see `placement`).
    Returns (placement group, the placement plan, each bundle's (node, GPU ids))."""
    if not ray.is_initialized():
        if cfg.ray_address:
            ray.init(address=cfg.ray_address, log_to_driver=True)
        else:  # logical CPUs: actors are mostly waiting on each other; torch threads are set per actor
            need = cfg.trainer_workers * cfg.cpus_per_trainer + cfg.num_engines * cfg.cpus_per_engine + 1
            need += cfg.teacher_tp * cfg.cpus_per_teacher if cfg.teachers and cfg.teacher_placement == "own" else 0
            # address="local": always a Ray of its own. Without it, ray.init joins a cluster another run on
            # this machine advertises (/tmp/ray/ray_current_cluster), and then refuses num_cpus.
            ray.init(address="local", num_cpus=max(int(math.ceil(need)), os.cpu_count() or 1), include_dashboard=False,
                     log_to_driver=True, runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    plan = placement(cfg)
    pg = placement_group(plan["bundles"], strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=300)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"Ray could not reserve the placement bundles {plan['bundles']} within 300 s (cluster "
                           f"has {ray.cluster_resources()}); lower trainer_workers / num_engines / cpus_per_* or "
                           "add nodes") from None
    where = bundle_gpus(pg, len(plan["bundles"]))
    for i, e in enumerate(plan["engines"]):
        nodes = {where[b][0] for b in e["gpu_bundles"]}
        if len(nodes) > 1:
            raise RuntimeError(f"engine {i} spans bundles {e['gpu_bundles']} on several nodes {sorted(nodes)}; an "
                               "SGLang server needs its GPUs on one node: make gpus_per_engine divide GPUs per node")
    print("placement:\n" + placement_table(cfg, plan, where))
    return pg, plan, where


def start_trainers(cfg: Config, pg, plan: dict) -> list:
    """The trainer ranks on their bundles, started and (async on CPU) pinned to their cores."""
    TrainerActor = ray.remote(trainer.TrainerWorker)
    for attempt in range(1, 4):
        addr, port = ray.get(ray.remote(_addr_and_port).options(
            num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0)).remote())
        trainers = [TrainerActor.options(num_cpus=o["num_cpus"], num_gpus=o["num_gpus"],
                                         scheduling_strategy=PlacementGroupSchedulingStrategy(pg, o["bundle"]))
                    .remote(cfg, r, cfg.trainer_workers, addr, port) for r, o in enumerate(plan["trainers"])]
        try:
            wait([t.__ray_ready__.remote() for t in trainers], "starting the trainer ranks", cfg.actor_timeout,
                 "actor_timeout")
            for r, t in enumerate(trainers):  # async on CPU: each rank on cores of its own (see cpu.actor_cores)
                if cores := cpu.actor_cores(cfg, "trainer", r):
                    t.__ray_call__.remote(lambda _, c: cpu.pin_process(c), cores)
                if (lent := cpu.lent_cores(cfg, r)) and cfg.engine_busy_file:  # ... and on its engines' while they idle
                    t.borrow_cores.remote(cfg.engine_busy_file, lent)
            return trainers
        except ray.exceptions.RayActorError as e:
            # The port was free when picked, but rank 0 binds it only once its actor has started
            # (seconds later): another process may take it meanwhile. Pick another; other errors are real.
            for t in trainers:
                ray.kill(t)
            if "EADDRINUSE" not in str(e) or attempt == 3:
                raise
            print(f"trainer rendezvous port {port} was taken before rank 0 could bind it; trying another")


def start_engine(cfg: Config, pg, plan: dict, where: list, i: int):
    """Engine i's RolloutEngine actor on its bundle; an SGLang server sees the GPUs of all its bundles.
    Always the same bundle for the same i, so a re-created engine takes its predecessor's place."""
    import rollout  # late: FastAPI and uvicorn (~0.4 s), which --check does not need
    o = plan["engines"][i]
    engine = ray.remote(rollout.RolloutEngine).options(
        num_cpus=o["num_cpus"], num_gpus=o["num_gpus"],
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, o["bundle"])).remote(cfg, i,
                                                                                      engine_visible_gpus(plan, where, i))
    if cores := cpu.actor_cores(cfg, "engine", i):  # async on CPU: cores no trainer uses; after __init__, before requests
        engine.__ray_call__.remote(lambda _, c: cpu.pin_process(c), cores)
    return engine


def engine_gpu_ids(plan: dict, where: list, i: int) -> list[str]:
    """The GPU ids engine i's server must see: those of every bundle it spans, in order."""
    return [g for b in plan["engines"][i]["gpu_bundles"] for g in where[b][1]]


def engine_visible_gpus(plan: dict, where: list, i: int) -> list[str]:
    """CUDA_VISIBLE_DEVICES for engine i's server: its own GPUs first (SGLang's TP rank r drives device r), then
    trainer rank 0's GPU when it is on the same node and not among them. CUDA IPC weight updates carry handles of
    rank 0's GPU (named by UUID, transfermesh.cuda_ipc_payloads), and a TP rank can map only a GPU it sees."""
    own = engine_gpu_ids(plan, where, i)
    node = where[plan["engines"][i]["gpu_bundles"][0]][0] if plan["engines"][i]["gpu_bundles"] else None
    t_node, t_gpus = where[plan["trainers"][0]["bundle"]]
    return own + [g for g in t_gpus if g not in own] if own and t_node == node else own


def start_engines(cfg: Config, pg, plan: dict, where: list) -> list:
    return [start_engine(cfg, pg, plan, where, i) for i in range(cfg.num_engines)]


def start_rollout(cfg: Config, pg, plan: dict, where: list, model: str) -> tuple[list, object]:
    """The engines, loading `model`, and the AgentFlow actor (rollouts, agents, rewards, the router), which gets
    their URLs as refs and so starts while they load. Returns (engine actors, AgentFlow actor)."""
    import agentflow  # late: ~1 s (OpenAI client, FastAPI server), which --check does not need
    engines = start_engines(dataclasses.replace(cfg, model_path=model), pg, plan, where)
    flow = ray.remote(agentflow.AgentFlow).options(num_cpus=0).remote(cfg, [e.url.remote() for e in engines], model)
    return engines, flow


def prepare_teachers(cfg: Config, trainers) -> dict[str, str]:
    """{teacher: HF dir}. A `path: tiny` teacher is built like the student (prepare_model, on the same
    trainers, cached by its settings) with its own warm-start data: that is how the tiny recipes train a
    teacher per sub-task."""
    paths = {}
    for name, spec in cfg.teachers.items():
        spec = teacher_spec(name, spec)
        if spec["path"] == "tiny":
            over = {k: v for k, v in spec.items() if k != "path"}
            paths[name] = prepare_model(dataclasses.replace(cfg, model_path="tiny", **over), trainers)
        else:
            paths[name] = spec["path"]
    return paths


def start_teachers(cfg: Config, pg, paths: dict[str, str]) -> list:
    """The teacher group: `teacher_tp` TeacherWorker ranks in their own placement group ("own") or on the
    trainers' bundles ("trainer": they compute while the trainers wait), every teacher registered."""
    gpu = cfg.device == "cuda"
    if cfg.teacher_placement == "own":
        bundle = {"GPU": 1, "CPU": cfg.cpus_per_teacher} if gpu else {"CPU": cfg.cpus_per_teacher}
        pg = placement_group([dict(bundle) for _ in range(cfg.teacher_tp)], strategy="PACK")
        ray.get(pg.ready(), timeout=300)
        cpus = cfg.cpus_per_teacher
    else:
        cpus = 0  # the trainer bundle's CPUs are the trainers'; a teacher runs while they wait
    on = [dict(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, r), num_cpus=cpus, num_gpus=1 if gpu else 0)
          for r in range(cfg.teacher_tp)]
    addr, port = ray.get(ray.remote(_addr_and_port).options(**{**on[0], "num_cpus": 0, "num_gpus": 0}).remote())
    Actor = ray.remote(teacher.TeacherWorker)
    group = [Actor.options(**on[r]).remote(cfg, r, cfg.teacher_tp, addr, port) for r in range(cfg.teacher_tp)]
    info = ray.get([t.load_teachers.remote(paths, str(Path(cfg.output_dir) / "teacher_snapshots")) for t in group])[0]
    print(f"teachers: {info}")
    return group


def _addr_and_port():
    return ray.util.get_node_ip_address(), transfermesh.free_port()


# ================================================================================================
# reliability: waits that cannot hang, engines that are re-created when they die


@dataclass
class Fleet:
    """The rollout engines as the controller tracks them: handles and URLs, never tensors."""
    pg: object  # the placement group; engine i always lives on the same bundle (start_engine)
    plan: dict  # placement(cfg): every actor's bundle and resources
    where: list  # each bundle's (node, GPU ids)
    actors: list  # RolloutEngine actor handles, engine i at index i
    urls: list  # their HTTP URLs, same order (AgentFlow's pool routes over these)
    restarts: int = 0  # engines re-created in this run (metric engines/restarts)
    released: bool = False  # colocated: the engines' KV cache is handed to the trainers (colocate_hand_off)


def wait(refs, what: str, timeout: float, knob: str, every: float = 0.0, tick=None):
    """`ray.get(refs)` that cannot hang. A failure is raised the moment it arrives, even while other
    ranks still wait for the failed one inside a collective; past `timeout` seconds it raises
    TimeoutError naming `what` and the config `knob` that sets the limit (a bare ray.get would wait
    forever on a hung actor). `tick()` runs every `every` seconds meanwhile (the engine health check
    while a rollout batch is generated)."""
    order = list(refs) if isinstance(refs, list) else [refs]
    pending, results = list(order), {}
    start = time.monotonic()
    last_tick = start
    while pending:
        now = time.monotonic()
        if now - start >= timeout:
            raise TimeoutError(f"{what} did not finish within {timeout:.0f}s (config `{knob}`); if it is only "
                               f"slow, raise {knob}, else the actors' logs above show where it is stuck")
        if tick is not None and every > 0 and now - last_tick >= every:
            tick()
            last_tick = time.monotonic()
        limit = min(timeout - (now - start), every if tick is not None and every > 0 else 1.0)
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(limit, 0.01))
        for ref in ready:  # raises the actor's error (with its traceback) now, not after the others finish
            results[ref] = ray.get(ref)
    return [results[ref] for ref in order] if isinstance(refs, list) else results[refs]


def restart_engine(cfg: Config, fleet: Fleet, i: int, flow, trainers, version: int) -> str:
    """Re-create dead engine i on its bundle, load the trainers' current weights (labelled `version`)
    into it, and route to it again. The trainers must be idle and hold weight version `version`."""
    if fleet.restarts >= cfg.max_engine_restarts:
        raise RuntimeError(f"rollout engine {i} ({fleet.urls[i]}) is dead, and {fleet.restarts} engines were already "
                           f"re-created in this run (max_engine_restarts={cfg.max_engine_restarts}); the engines' logs "
                           "above say why they die. Fix that, or raise max_engine_restarts")
    old = fleet.urls[i]
    ray.kill(fleet.actors[i], no_restart=True)  # a hung engine still holds its bundle (and port, GPU)
    fleet.actors[i] = start_engine(cfg, fleet.pg, fleet.plan, fleet.where, i)
    url = wait(fleet.actors[i].url.remote(), f"re-creating rollout engine {i}", cfg.actor_timeout, "actor_timeout")
    if version > 0:  # it loaded cfg.model_path (version 0); every later version lives only in the trainers
        wait([t.sync_weights.remote([url], version) for t in trainers], f"weight sync to re-created engine {i}",
             cfg.weight_sync_timeout, "weight_sync_timeout")
    wait(flow.replace_engine.remote(old, url), "AgentFlow.replace_engine", cfg.actor_timeout, "actor_timeout")
    fleet.urls[i] = url
    fleet.restarts += 1
    print(f"engine {i} at {old} was dead or hung: re-created at {url}, serving weight version {version}")
    return url


def check_engines(cfg: Config, fleet: Fleet, flow, trainers=None, version: int = 0) -> list[str]:
    """Probe every engine now: AgentFlow's pool takes a dead or hung one out of routing at once (its
    requests in flight move to the others). With `trainers` (only while they are idle and hold weight
    version `version`), each dead engine is also re-created on those weights. Returns the dead URLs."""
    dead = wait(flow.check_engines.remote(), "the engine health check (AgentFlow.check_engines)",
                cfg.engine_health_timeout + 60, "engine_health_timeout")
    if trainers is not None:
        for url in dead:
            restart_engine(cfg, fleet, fleet.urls.index(url), flow, trainers, version)
    return dead


def sync_engines(cfg: Config, fleet: Fleet, flow, trainers, version: int) -> dict:
    """Weights -> engines (TransferMesh) as version `version`: the live engines pause in place (requests in
    flight keep their KV cache and tokens), take every bucket, then continue on the new weights. A dead engine
    is skipped and re-created on these weights afterwards; one that dies during the push fails it, so probe
    and push once more to the engines left (a push is idempotent). Returns the trainers' `weights/` metrics."""
    for attempt in (1, 2):
        dead = check_engines(cfg, fleet, flow)
        live = [u for u in fleet.urls if u not in dead]
        try:
            transfermesh.pause_engines(live)  # in place: no forward step sees half-updated weights
            try:
                stats = wait([t.sync_weights.remote(live, version) for t in trainers],
                             f"weight sync of version {version} to {len(live)} engine(s)", cfg.weight_sync_timeout,
                             "weight_sync_timeout")[0]
            finally:
                if not fleet.released:  # colocated: they continue once their KV cache is back (colocate_hand_off)
                    transfermesh.continue_engines(live)
            break
        except (ray.exceptions.RayTaskError, RuntimeError, httpx.HTTPError) as e:
            if attempt == 2 or not check_engines(cfg, fleet, flow):
                raise  # no engine died: the error is the sync's own
            print(f"weight sync of version {version} failed as an engine died ({str(e).splitlines()[0]}); "
                  "pushing again to the others")
    check_engines(cfg, fleet, flow, trainers, version)
    return stats


def colocate_hand_off(cfg: Config, fleet: Fleet, flow, trainers, stage: str) -> dict:
    """The colocated memory hand-off (`colocate: true`): engines and trainers share their GPUs, so each gives its
    memory to the other between phases, in three stages (one line each in train()):

      "train"   before the step: engines pause (retract: running requests give back their KV and wait) and
                release weights + KV cache (SGLang's /release_memory_occupation); trainers onload everything
      "sync"    after the step: trainers offload optimizer state + grads; engines resume their weights (zeroed until
                sync_engines pushes the new ones)
      "rollout" after the sync: trainers offload their weights; engines resume the KV cache, then continue

    so at no point do both sides hold everything. Returns each side's memory after the stage (`memory/` metrics:
    trainer rank 0's, and the largest engine's where the engine reports it, i.e. the CPU engine) and its seconds.
    Does nothing (returns {}) unless cfg.colocate."""
    if not cfg.colocate:
        return {}
    import rollout  # late: FastAPI and uvicorn (~0.4 s), which --check does not need
    t0 = time.perf_counter()

    def engines(path: str, payload: dict) -> list[dict]:
        answers = []
        for url in fleet.urls:
            try:
                answers.append(rollout.post(url, path, payload, timeout=cfg.weight_sync_timeout))
            except (rollout.EngineError, httpx.HTTPError):
                if url not in check_engines(cfg, fleet, flow):
                    raise  # alive: the error is the hand-off's own
                # dead: out of routing now; sync_engines re-creates it (with all its memory) after the next push
        return answers

    if stage == "train":
        engines("/pause_generation", {"mode": "retract"})  # SGLang releases memory only with nothing running
        answers = engines("/release_memory_occupation", {"tags": ["weights", "kv_cache"]})
        fleet.released = True
        mem = wait([t.onload.remote() for t in trainers], "trainer onload", cfg.actor_timeout, "actor_timeout")
    elif stage == "sync":
        mem = wait([t.offload.remote(["optimizer", "grads"]) for t in trainers], "trainer offload", cfg.actor_timeout,
                   "actor_timeout")
        answers = engines("/resume_memory_occupation", {"tags": ["weights"]})
    elif stage == "rollout":
        mem = wait([t.offload.remote(["weights"]) for t in trainers], "trainer offload", cfg.actor_timeout,
                   "actor_timeout")
        answers = engines("/resume_memory_occupation", {"tags": ["kv_cache"]})
        fleet.released = False
        engines("/continue_generation", {})
    else:
        raise ValueError(f"colocate_hand_off stage {stage!r}: choose 'train', 'sync' or 'rollout'")
    out = {f"memory/{stage}_trainer_mb": mem[0]["rss_bytes"] / 2**20, f"timing/hand_off_{stage}": time.perf_counter() - t0}
    if "gpu_used_bytes" in mem[0]:
        out[f"memory/{stage}_gpu_used_mb"] = mem[0]["gpu_used_bytes"] / 2**20
    rss = [a["rss_bytes"] for a in answers if isinstance(a, dict) and "rss_bytes" in a]
    if rss:
        out[f"memory/{stage}_engine_mb"] = max(rss) / 2**20
    return out


# ================================================================================================
# run state: checkpoints that lose nothing, and resume


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one, never a part


def rng_state() -> dict:
    """The controller's python and numpy global RNG states, as JSON."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(internal), gauss], "numpy": [name, keys.tolist(), pos, has_gauss, cached]}


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def save_run_state(cfg: Config, trainers, step: int, controller_state: dict) -> Path:
    """Checkpoint after RL step `step`, in checkpoints/step_XXXXX/: one file per trainer rank (model,
    optimizer, LR schedule position, python/numpy/torch RNG: trainer.save_checkpoint), the
    `controller_state` train() hands over (JSON: data cursor, RNG, ...) and config.yaml. Then, last,
    `checkpoints/latest` is rewritten (atomically) to name it: a crash anywhere in a save leaves
    `latest` naming the previous checkpoint, complete."""
    root = Path(cfg.output_dir) / "checkpoints"
    path = root / f"step_{step:05d}"
    marker = root / "latest"
    if path.exists() and not (marker.exists() and marker.read_text().strip() == path.name):
        shutil.rmtree(path)  # debris of a save that crashed before its marker
    wait([t.save_checkpoint.remote(str(path)) for t in trainers], f"checkpoint of step {step} (trainer ranks)",
         cfg.actor_timeout, "actor_timeout")
    _atomic_write(path / "controller_state.json", json.dumps({"step": step, **controller_state}))
    _atomic_write(path / "config.yaml", yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    _atomic_write(marker, path.name + "\n")
    return path


def load_run_state(cfg: Config, trainers) -> tuple[int, dict | None]:
    """Restore the checkpoint `checkpoints/latest` names into every trainer rank (after load_hf) and
    return (the first step to run, the controller_state saved with it); (0, None) when there is none."""
    root = Path(cfg.output_dir) / "checkpoints"
    marker = root / "latest"
    if not marker.exists():
        if root.exists() and any(root.iterdir()):
            print(f"resume: {root} has no `latest` marker (no save completed, or written by an older "
                  "version without controller state); starting from step 0")
        return 0, None
    path = root / marker.read_text().strip()
    state = json.loads((path / "controller_state.json").read_text())
    wait([t.load_checkpoint.remote(str(path)) for t in trainers], f"loading checkpoint {path}",
         cfg.actor_timeout, "actor_timeout")
    return int(state["step"]) + 1, state


# ================================================================================================
# logging: one flat dict per step -> stdout line, metrics.jsonl, TensorBoard; reward curve at the end


class Logger:
    """Every step's metrics to metrics.jsonl, TensorBoard and (cfg.trackers) W&B / MLflow; the reward curve
    at the end. W&B and MLflow are imported only when a recipe asks for them."""

    def __init__(self, cfg: Config, resume_step: int | None = None):
        """`resume_step`: a resumed run continues the same metrics.jsonl and TensorBoard run from that
        step; rows of later steps (logged after the checkpoint, before the crash) are dropped, as the
        run does those steps again."""
        self.dir = Path(cfg.output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / "metrics.jsonl"
        self.history: list[dict] = []
        if resume_step is not None and path.exists():
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # the line a kill cut short
                    continue
                if row.get("step", 0) < resume_step:
                    self.history.append(row)
            _atomic_write(path, "".join(json.dumps(r) + "\n" for r in self.history))
        self.jsonl = open(path, "a" if resume_step is not None else "w")
        try:
            from torch.utils.tensorboard import SummaryWriter  # here: tensorboard may be absent (below)
            # purge_step: TensorBoard hides this run's earlier events from resume_step on (the redone steps)
            self.tb = SummaryWriter(str(self.dir / "tb"), purge_step=resume_step)
        except ImportError:  # tensorboard is optional
            self.tb = None
        params = {k: v for k, v in dataclasses.asdict(cfg).items()}
        self.wandb = self.mlflow = None
        if "wandb" in cfg.trackers:  # optional dependency (pip install -e .[tracking]); WANDB_MODE=offline works
            import wandb
            self.wandb = wandb.init(project=cfg.tracker_project, name=self.dir.name, dir=str(self.dir),
                                    config=params, reinit="finish_previous")
        if "mlflow" in cfg.trackers:  # optional dependency, likewise
            import mlflow
            if not cfg.mlflow_tracking_uri:  # the local file store (MLflow 3 asks for an opt-in to use it)
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri(cfg.mlflow_tracking_uri or (self.dir / "mlruns").resolve().as_uri())
            mlflow.set_experiment(cfg.tracker_project)
            self.mlflow = mlflow.start_run(run_name=self.dir.name)
            mlflow.log_params({k: str(v)[:500] for k, v in params.items()})

    def log(self, step: int, metrics: dict):
        """Scalars to every sink; lists of numbers (per-token lags) to TensorBoard histograms only."""
        hists = {k: v for k, v in metrics.items() if isinstance(v, list)}
        metrics = {"step": step, **{k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}}
        self.history.append(metrics)
        self.jsonl.write(json.dumps(metrics) + "\n")
        self.jsonl.flush()
        if self.tb:
            for k, v in metrics.items():
                if k != "step":
                    self.tb.add_scalar(k, v, step)
            for k, v in hists.items():
                if v:
                    self.tb.add_histogram(k, np.asarray(v), step)
        scalars = {k: v for k, v in metrics.items() if k != "step"}
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)
        if self.mlflow is not None:  # MLflow metric names allow no '@': eval/pass@4 -> eval/pass_at_4
            import mlflow  # optional dependency, imported only when on
            mlflow.log_metrics({k.replace("@", "_at_"): v for k, v in scalars.items()}, step=step)

    def line(self, step: int, m: dict) -> str:
        keys = [("reward", "rollout/reward_mean"), ("eval", "eval/accuracy"), ("loss", "train/loss"),
                ("gap_k3", "train/gap_k3"), ("len", "rollout/response_len"), ("step_s", "timing/step"),
                ("tok/s", "perf/rollout_tokens_per_s")]
        line = f"step {step:4d} | " + " | ".join(f"{k} {m[v]:.4g}" for k, v in keys if v in m)
        if "rollout/on_policy_frac" in m:  # how on-policy the step was
            line += f" | on-policy {m['rollout/on_policy_frac']:.0%} · max lag {m['rollout/lag_max']:.0f}"
        return line

    def plot(self) -> Path | None:
        import matplotlib  # late: ~0.5 s, only for the plot at the end of a run
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # after use("Agg"): pyplot picks its backend on import
        fig, ax = plt.subplots(figsize=(7, 4))
        for key, style in (("rollout/reward_mean", "-"), ("eval/accuracy", "o-")):
            pts = [(h["step"], h[key]) for h in self.history if key in h]
            if pts:
                ax.plot(*zip(*pts), style, label=key)
        # data sources: the student's eval curve per source, each teacher's accuracy there as a flat line
        keys = sorted({k for h in self.history for k in h})
        for i, src in enumerate(k.split("/")[1] for k in keys if k.startswith("eval/") and k.count("/") == 2):
            color = f"C{i + 2}"
            pts = [(h["step"], h[f"eval/{src}/accuracy"]) for h in self.history if f"eval/{src}/accuracy" in h]
            ax.plot(*zip(*pts), "s-", color=color, label=f"student eval/{src}")
            for j, k in enumerate(k for k in keys if k.startswith("teacher/") and k.endswith(f"/{src}/accuracy")):
                v = next(h[k] for h in self.history if k in h)
                ax.axhline(v, color=color, ls=("--", ":", "-.")[j % 3], lw=1, label=f"{k.split('/')[1]} (teacher) on {src}")
        ax.set_xlabel("step")
        ax.set_ylabel("reward / accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        path = self.dir / "reward_curve.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path

    def close(self):
        self.jsonl.close()
        if self.tb:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.mlflow is not None:
            import mlflow  # optional dependency, imported only when on
            mlflow.end_run()


# ================================================================================================
# the rollout producer's window (fully async): two pure functions decide how many prompt groups to dispatch
# and which finished ones to collect. R = groups dispatched and not yet collected (running, or finished but
# held back by the window); Q = groups collected into the buffer and not yet trained on; C = capacity.

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
    into the step's batch, applying the version-lag bound; `pop_batch()` returns the batch once it holds B
    groups. train() moves groups between it and AgentFlow with visible calls.
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
        self.redo: list[tuple[dict, bool]] = []  # (prompt, is a regeneration) to dispatch first
        self.second_try: set[int] = set()  # seqs dispatched as a regeneration: never regenerated again
        self.stats = dict(dropped=0, regenerated=0, masked=0)  # this step's counts
        for sample, again in (state or {}).get("pending", []):  # groups that were in flight: dispatched first
            self.redo.append((sample, again))

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
            equal = cfg.dynamic_sampling and len({t["reward"] for t in group}) == 1
            if equal or (cfg.group_filter and not data.import_object(cfg.group_filter)(group)):
                self.stats["dropped"] += 1  # equal rewards (DAPO: zero advantages) or the user's filter; refilled
                self.prompt_of.pop(seq)
            else:
                self.buffer[seq] = group
        for seq in sorted(self.buffer)[:self.B - len(self.batch)]:  # oldest first
            group, sample = self.buffer.pop(seq), self.prompt_of.pop(seq)
            over = lag_over(group, version, cfg.max_version_lag)  # tokens older than the bound allows
            if over and cfg.lag_policy == "regenerate" and seq not in self.second_try:
                self.redo.append((sample, True))  # once: a long trajectory is masked next time, not starved
                self.stats["regenerated"] += 1
                continue
            if over:
                mask_lagging(group, version, cfg.max_version_lag)
                self.stats["masked"] += over
            self.batch.append(group)

    def refill(self) -> list[tuple[int, dict]]:
        """Right after pop_batch, async only: groups dispatched before the step trains, so the engines generate
        while the trainers train. They start on weights one version older than groups dispatched after the sync,
        so the window keeps a batch's room here (R + Q <= C - B): with C - B groups ahead of them, they are
        trained within stale_steps versions, as if dispatched after the sync (filling to C here put every refilled
        group one version past stale_steps, and past max_version_lag = stale_steps, where the lag bound then
        masked whole batches). Sync (stale_steps=0) dispatches nothing here: its next groups need the new weights."""
        return self.dispatch(self.C - self.B) if self.cfg.stale_steps > 0 else []

    def full(self) -> bool:
        """B groups are ready (or dynamic sampling found too few informative ones: train on what there is)."""
        gave_up = (self.cfg.dynamic_sampling or self.cfg.group_filter) and self.stats["dropped"] >= 4 * self.B
        return len(self.batch) >= self.B or gave_up

    def pop_batch(self) -> tuple[list[dict], dict]:
        trajs = [t for group in self.batch for t in group]
        metrics = {"rollout/buffer_groups": len(self.buffer), "rollout/running_groups": len(self.running),
                   "rollout/lag_masked_tokens": self.stats["masked"],
                   "rollout/regenerated_groups": self.stats["regenerated"]}
        if self.cfg.dynamic_sampling or self.cfg.group_filter:
            metrics.update({"rollout/groups_kept": len(self.batch),
                            "rollout/groups_sampled": len(self.batch) + self.stats["dropped"]})
        self.batch, self.stats = [], dict(dropped=0, regenerated=0, masked=0)
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
        **{f"rollout/{src}/reward_mean": sum(t["reward"] for t in ts) / len(ts) for src, ts in _by_source(trajs).items()},
    }


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
    with open(path, "w") as f:
        for t in trajs:
            f.write(json.dumps(t) + "\n")


# ================================================================================================
# the training loop


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
                     cfg.actor_timeout, "actor_timeout")
        out.update(eval_metrics(trajs, cfg.eval_samples, prefix))
        for src, ts in _by_source(trajs).items():  # data_sources: one accuracy per source's eval set
            out[f"{prefix}{src}/accuracy"] = sum(t["reward"] for t in ts) / len(ts)
        if cfg.eval_greedy:
            greedy = wait(flow.generate.remote(samples, 1, {**sampled, "temperature": 0.0}, step),
                          f"greedy eval at step {step}", cfg.actor_timeout, "actor_timeout")
            out[f"{prefix}greedy_accuracy"] = eval_metrics(greedy, 1)["eval/accuracy"]
    return out


_STATS_HTTP: httpx.Client | None = None  # engine_busy_seconds' client, kept: a new one builds an SSL context each time
# (~40 ms here, half of the controller's busy time in an async step, py-spy)


def engine_busy_seconds(engine_urls: list[str]) -> float:
    """Seconds CPU engines have spent computing so far (their /get_server_info); 0 for other engines."""
    global _STATS_HTTP
    _STATS_HTTP = _STATS_HTTP or httpx.Client(timeout=30.0)
    try:
        return sum(_STATS_HTTP.get(f"{u}/get_server_info").raise_for_status().json()["internal_states"][0]
                   .get("busy_s", 0.0) for u in engine_urls)
    except (httpx.HTTPError, KeyError, IndexError, ValueError, OSError):
        return 0.0


def node_cpu_jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of this machine so far, in jiffies, from /proc/stat (Linux); (0, 0) elsewhere. Busy:
    user, nice, system, irq and softirq time; the rest is idle, waiting on I/O or stolen by a hypervisor."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return 0, 0
    return v[0] + v[1] + v[2] + v[5] + v[6], sum(v)


def _by_source(trajs: list[dict]) -> dict[str, list[dict]]:
    by: dict[str, list[dict]] = {}
    for t in trajs:
        src = (t.get("metadata") or {}).get("source")
        if src is not None:
            by.setdefault(src, []).append(t)
    return by


def evaluate_teachers(cfg: Config, trainers, flow, engine_urls, paths: dict[str, str], eval_sets) -> dict:
    """`teacher/<name>/<source>/accuracy` (and `teacher/<name>/accuracy`): each teacher of the student's
    architecture is loaded into the trainers, pushed to the engines and evaluated like the student; then
    the student's weights go back (version 0). Other architectures cannot be served by the student's
    engines and are skipped."""
    mine = teacher.arch_key(trainer.read_hf_config(cfg.model_path))
    out = {}
    for name, path in paths.items():
        if teacher.arch_key(trainer.read_hf_config(path)) != mine:
            print(f"teacher {name}: another architecture than the student, not evaluated")
            continue
        ray.get([t.load_hf.remote(path) for t in trainers])
        ray.get([t.sync_weights.remote(engine_urls, -1) for t in trainers])
        m = evaluate(cfg, flow, eval_sets, 0)
        out.update({f"teacher/{name}/{k[len('eval/'):]}": v for k, v in m.items() if k.endswith("accuracy")})
    ray.get([t.load_hf.remote(cfg.model_path) for t in trainers])
    ray.get([t.sync_weights.remote(engine_urls, 0) for t in trainers])
    return out


def train(cfg: Config) -> list[dict]:
    """The whole system: launch actors, then per step: rollout (a producer keeps up to C prompt groups in
    flight or buffered), train on B complete groups, sync weights, eval, checkpoint."""
    check_runtime(cfg)
    print("config:\n" + explain(cfg))
    warn_off_policy(cfg)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))

    samples, eval_samples = load_data(cfg)  # before any actor: a bad teacher name in the data fails here

    # --- actors: the engines load the base model while the trainers start (and warm-start it, and build tiny
    #     teachers); a warm start reaches the engines as weight version 0, below. Colocated on GPUs with a warm
    #     start, the engines start after it: its training needs the memory an SGLang server holds.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        built = pool.submit(base_model, cfg)  # the tiny model is built while Ray starts (which mostly waits)
        pg, plan, where = reserve(cfg)
        base = built.result()
    late = cfg.colocate and cfg.device == "cuda" and cfg.warmstart_steps > 0
    cfg.engine_busy_file = cpu.engine_busy_file(cfg)  # async on CPU: trainers compute on idle engines' cores
    engine_model = None if late else base
    if engine_model:
        engines, flow = start_rollout(cfg, pg, plan, where, engine_model)
    trainers = start_trainers(cfg, pg, plan)
    teacher_paths = prepare_teachers(cfg, trainers) if cfg.teachers else {}
    cfg.model_path = prepare_model(cfg, trainers)  # base, or its warm start (a re-created engine loads this one)
    check_teacher_vocab(cfg.model_path, teacher_paths)  # the built dirs, before any teacher starts
    ray.get([t.load_hf.remote(cfg.model_path) for t in trainers])
    if not engine_model:
        engine_model = cfg.model_path
        engines, flow = start_rollout(cfg, pg, plan, where, engine_model)
    engine_urls = wait([e.url.remote() for e in engines], "starting the rollout engines", cfg.actor_timeout,
                       "actor_timeout")
    fleet = Fleet(pg, plan, where, engines, engine_urls)  # the engines, re-created when they die
    print(f"engines: {engine_urls}")
    teachers = start_teachers(cfg, pg, teacher_paths) if cfg.teachers else []  # teacher.py, scores each batch
    if teachers and float(cfg.gkd_ratio) > 0 and cfg.distill_type != "topk_kl":  # hidden-state targets
        heads = teachers[0].lm_heads.remote()  # the teachers' LM heads, sent to the trainers once
        ray.get([t.set_teacher_heads.remote(heads) for t in trainers])

    # resume from checkpoints/latest: the trainers' state, the producer's place in the data, the RNG
    start_step, state = load_run_state(cfg, trainers) if cfg.resume else (0, None)
    if state:
        set_rng_state(state["rng"])
        sync_engines(cfg, fleet, flow, trainers, start_step)  # the engines get the checkpoint's weights
        print(f"resumed after step {start_step - 1}")
    elif engine_model != cfg.model_path:
        sync_engines(cfg, fleet, flow, trainers, 0)  # the warm start: version 0 == the trainers' weights
    logger = Logger(cfg, resume_step=start_step if state else None)

    eval_sets = {name: data.load_dataset(spec) for name, spec in cfg.eval_sets.items()}
    eval_sets = {**({"": eval_samples} if eval_samples else {}), **eval_sets}
    sampling = dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, max_new_tokens=cfg.max_new_tokens)
    N = cfg.samples_per_prompt

    if cfg.teacher_eval and teachers and eval_sets and start_step == 0:
        m = evaluate_teachers(cfg, trainers, flow, engine_urls, teacher_paths, eval_sets)
        logger.log(0, m)
        print("teachers' eval accuracy: " + ", ".join(f"{k} {v:.3f}" for k, v in m.items()))
    if cfg.eval_every and eval_sets and not state:  # a resumed run logged this eval before it stopped
        m = evaluate(cfg, flow, eval_sets, start_step)
        logger.log(start_step, m)
        print("eval before training: " + ", ".join(f"{k} {v:.3f}" for k, v in m.items() if "accuracy" in k))

    producer = Producer(cfg, samples, state["producer"] if state else None)
    busy0, wall0, jiffies0 = engine_busy_seconds(fleet.urls), time.perf_counter(), node_cpu_jiffies()
    bar = tqdm(range(start_step, cfg.num_steps), desc="RL", file=sys.stdout, mininterval=5)
    for step in bar:
        t_step = time.perf_counter()
        metrics: dict = {}

        # --- 1. rollout (+ reward, inside AgentFlow): top the window up to C groups, collect finished groups
        #        until B are buffered, take the B oldest. Sync (C = B) dispatches B and waits for all of them;
        #        async leaves up to C - B groups generating while this step trains and syncs.
        t0 = time.perf_counter()
        if cfg.train_only:
            trajs = [json.loads(line) for line in open(Path(cfg.load_rollouts) / f"step_{step:05d}.jsonl")]
        else:
            while not producer.full():
                new = producer.dispatch()
                if new:
                    wait(flow.submit.remote(new, N, sampling, step), "AgentFlow.submit", cfg.actor_timeout,
                         "actor_timeout")  # returns at once: the groups start
                # blocks until a group finishes; meanwhile engines are probed and dead ones re-created (the
                # trainers are idle here and hold version `step`, which a re-created engine gets)
                producer.receive(wait(flow.completed.remote(), f"rollouts of step {step}", cfg.actor_timeout,
                                      "actor_timeout", every=cfg.engine_check_every,
                                      tick=lambda: check_engines(cfg, fleet, flow, trainers,
                                                                 0 if cfg.rollout_only else step)), version=step)
            trajs, m = producer.pop_batch()
            metrics.update(m)
            wait(flow.submit.remote(producer.refill(), N, sampling, step), "AgentFlow.submit", cfg.actor_timeout,
                 "actor_timeout")  # async: top the window up now, so the engines generate while this step trains
        metrics["timing/generate"] = time.perf_counter() - t0  # the trainer's wait for rollouts
        metrics.update(rollout_metrics(trajs, step))
        metrics["perf/rollout_tokens_per_s"] = metrics["rollout/generated_tokens"] / max(metrics["timing/generate"], 1e-9)
        if cfg.dump_rollouts:
            dump(trajs, Path(cfg.dump_rollouts) / f"step_{step:05d}.jsonl")
        if cfg.print_every and step % cfg.print_every == 0 and trajs:
            t = trajs[0]
            bar.write(f"[sample step {step}] reward={t['reward']} status={t['status']}\n"
                      f"  {t.get('prompt_text', '')!r} -> {t.get('response_text', '')!r}")

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
            # TEACHERS (teacher.py): every teacher rank scores, rank 0's per-token targets go to the trainers
            # by ref (never through the controller); the metrics get is the blocking point of this phase.
            targets_ref = None
            if teachers:
                refs = [t.score.options(num_returns=2).remote(batch_ref) for t in teachers]
                targets_ref = refs[0][0]
                metrics.update(wait(refs[0][1], f"teacher scoring of step {step}", cfg.actor_timeout,
                                    "actor_timeout"))
                metrics["timing/teacher"] = time.perf_counter() - t0
                t0 = time.perf_counter()
            results = wait([t.train_step.remote(batch_ref, step, targets_ref) for t in trainers],
                           f"train step {step}", cfg.actor_timeout, "actor_timeout")
            metrics.update(results[0])  # already reduced over DP ranks
            metrics["timing/train"] = time.perf_counter() - t0

            # --- 3. weights -> engines (TransferMesh); engines then report version step + 1. Requests in
            #        flight keep their tokens and continue on the new weights (partial rollouts).
            metrics.update(colocate_hand_off(cfg, fleet, flow, trainers, "sync"))  # trainers offload, engine weights back
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

        busy, wall, jiffies = engine_busy_seconds(fleet.urls), time.perf_counter(), node_cpu_jiffies()
        metrics.update({"timing/step": wall - t_step, "perf/trainer_wait_frac": metrics["timing/generate"] / (wall - t_step),
                        "perf/engine_idle_frac": max(0.0, 1 - (busy - busy0) / len(fleet.urls) / (wall - wall0)),
                        "engines/restarts": fleet.restarts,
                        **wait(flow.engine_metrics.remote(), "AgentFlow.engine_metrics", cfg.actor_timeout,
                               "actor_timeout")})
        if jiffies[1] > jiffies0[1] and not cfg.ray_address:  # a local run: every actor is on this machine
            metrics["perf/node_cpu_busy_frac"] = (jiffies[0] - jiffies0[0]) / (jiffies[1] - jiffies0[1])
        busy0, wall0, jiffies0 = busy, wall, jiffies
        logger.log(step, metrics)
        bar.write(logger.line(step, metrics))

        # --- 5. checkpoint, after the step's metrics are logged: a resumed run has every row up to it
        if cfg.save_every and not cfg.rollout_only and ((step + 1) % cfg.save_every == 0 or last):
            save_run_state(cfg, trainers, step, {"producer": producer.state(), "rng": rng_state()})

    # --- end: stop the producer, export HF weights, plot
    ray.get(flow.abort.remote())
    if not cfg.rollout_only:
        ray.get([t.save_hf.remote(str(out / "final_hf")) for t in trainers])
        print(f"final HF checkpoint: {out / 'final_hf'}")
    png = logger.plot()
    print(f"reward curve: {png}\nmetrics: {out / 'metrics.jsonl'}")
    logger.close()
    if cfg.engine_busy_file:
        os.unlink(cfg.engine_busy_file)
    return logger.history


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
    try:
        train(cfg)
    except Exception:  # noqa: BLE001  an actor's traceback arrives here inside the RayTaskError
        print("run failed:\n" + traceback.format_exc(), file=sys.stderr)
        return 1
    finally:
        if ray.is_initialized():
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
