"""The actors of a run and everything that keeps them going: where each goes (`placement`, `reserve`), starting
trainers, engines, AgentFlow, teachers and the judge of `reward: judge` (`start_judge`), the model they start from
(`base_model`, `prepare_model`: the tiny model and its warm start), waits that cannot hang (`wait`), engine health
and re-creation (`check_engines`, `restart_engine`), the weight sync (`sync_engines`, `update_engines`), the
colocated hand-off (`colocate_hand_off`), checkpoints that lose nothing (`save_run_state`, `load_run_state`), the
metric sinks (`Logger`), and the end of a run's actors (`stop`, `stop_on_exit`: Ray stays up). Engines are driven
as SGLang 0.5.23 behaves (cpu_engine.SGLANG_BEHAVIOURS): probed by /server_info, which a paused engine answers;
sent a resume only of memory they released; flushed after every update.

loongsage.train() calls these in order and holds what they return: actor handles and URLs (a `Fleet` for the
engines), never tensors. Every function that blocks says on what, and under which config deadline (`wait`).

Test: `.venv/bin/pytest tests/test_placement.py tests/test_reliability.py tests/test_recover.py
tests/test_colocate.py tests/test_warmstart.py -q` (placement on simulated GPUs, dead and hung engines re-created,
crashes at every point of a save, the colocated hand-off's memory and an engine re-created mid-way, the cached warm
start); update_engines in tests/test_transfermesh.py.
Left out: multi-node launch scripts (join the nodes to one Ray cluster and set `ray_address`), restarting a
dead trainer rank (the run stops with its traceback; `resume: true` goes on from the last checkpoint), and
re-creating a dead judge engine or placing it in the plan (on CUDA it takes any free GPU).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import ray
import yaml
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy
from tqdm import tqdm

import cpu
import data
import lora
import teacher
import trainer  # cheap: Megatron loads inside the trainer actors, not here
import transfermesh
from config import TEACHER_BUILD_KEYS, Config, teacher_spec


# ================================================================================================
# the model a run starts from: build, warm-start with SFT through the same trainer, cache


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


def warm_start_dir(cfg: Config, base: str) -> Path:
    """Where the warm start of checkpoint `base` with cfg's SFT settings is cached (prepare_model writes it):
    named by the base checkpoint's fingerprint and the SFT settings."""
    keys = [k for k in TEACHER_BUILD_KEYS if k != "tiny_model"]  # the SFT's own: the tiny model is in `base`
    settings = {k: getattr(cfg, k) for k in keys} | {"base": checkpoint_fingerprint(base)}
    return data.default_cache_dir() / f"{Path(base).name}-sft-{data.settings_hash(settings)}"


def prepare_model(cfg: Config, trainers) -> str:
    """The checkpoint RL starts from (weight version 0): cfg.model_path ("tiny" builds and caches the tiny Qwen3
    of data.py, anything else is an HF directory), or with `warmstart_steps` its warm start: SFT on
    `warmstart_dataset` through the same Megatron trainers, saved as HF and cached (warm_start_dir)."""
    base = base_model(cfg)
    if cfg.warmstart_steps == 0:
        return base
    out = warm_start_dir(cfg, base)
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
        batch = [example(tok, s, rng, cfg.warmstart_label_noise) for s in rng.sample(samples, cfg.warmstart_batch_size)]
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


def prepare_teachers(cfg: Config, trainers) -> dict[str, str]:
    """{teacher: HF dir}. A `path: tiny` teacher is built like the student (prepare_model, on the same trainers, cached
    by its settings) with its own warm-start data: that is how the tiny recipes train a teacher per sub-task."""
    paths = {}
    for name, spec in cfg.teachers.items():
        spec = teacher_spec(name, spec)
        if spec["path"] == "tiny":
            over = {k: v for k, v in spec.items() if k != "path"}
            paths[name] = prepare_model(dataclasses.replace(cfg, model_path="tiny", **over), trainers)
        else:
            paths[name] = spec["path"]
    return paths


# ================================================================================================
# placement: where every actor goes, and reserving it


def placement(cfg: Config) -> dict:
    """Where every actor goes, as data (reserve() and start_* follow it; `--check` prints it).

    GPU: one {"GPU": 1} bundle per GPU; trainer rank r holds bundle r. Engine i (tensor parallel size
    k = gpus_per_engine) spans k consecutive bundles, its actor on the first: disaggregated, after the trainers';
    colocated, bundles i*k .. i*k+k-1 of the trainers', each side taking half a GPU. The server sees all k GPUs
    (`bundle_gpus`). CPU: one {"CPU": n} bundle per trainer rank and per engine; colocated, a trainer's bundle also
    holds its engine. Returns {"bundles", "trainers": [actor options], "engines": [actor options + "gpu_bundles"]}.
    """
    gpu, T, E = cfg.device == "cuda", cfg.trainer_workers, cfg.num_engines
    k, gpus = (cfg.gpus_per_engine, {"GPU": 1}) if gpu else (1, {})  # a CPU engine: one bundle
    bundles = [{**gpus, "CPU": cfg.cpus_per_trainer} for _ in range(T)]
    if cfg.colocate:  # engine i on the trainers' bundles: i*k .. i*k+k-1 on GPUs, spread over them on CPU
        spans = [list(range(i * k, (i + 1) * k)) if gpu else [i * T // E] for i in range(E)]
        for b in [b for span in spans for b in span]:
            bundles[b]["CPU"] += cfg.cpus_per_engine / k  # the engine's CPUs, spread over its bundles
    else:  # bundles of their own, after the trainers'
        spans = [list(range(T + i * k, T + (i + 1) * k)) for i in range(E)]
        bundles += [{**gpus, "CPU": cfg.cpus_per_engine / k} for _ in range(E * k)]
    share = (0.5 if cfg.colocate else 1.0) if gpu else 0
    trainers = [dict(bundle=r, num_gpus=share, num_cpus=cfg.cpus_per_trainer) for r in range(T)]
    engines = [dict(bundle=span[0], num_gpus=share, num_cpus=cfg.cpus_per_engine / k, gpu_bundles=span if gpu else [])
               for span in spans]
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
            rows.append(f"{kind + ' ' + str(i):12s} {o['bundle']:6d} {o['num_gpus']:5.2g} {o['num_cpus']:5.3g}  "
                        f"{loc}{span}")
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


@dataclass
class Fleet:
    """What the controller knows of its actors' places and of the rollout engines: handles, URLs and paths, never
    tensors. reserve() makes it; train() fills in the model and the engines; restart_engine() replaces engines in
    it. What a run derives at start lives here, so the Config it was given stays as given."""
    pg: object  # the placement group; engine i always lives on the same bundle (start_engine)
    plan: dict  # placement(cfg): every actor's bundle and resources
    where: list  # each bundle's (node, GPU ids)
    busy_file: str = ""  # async on a CPU node: where engines say they compute (cpu.engine_busy_file); "" = none
    model: str = ""  # the HF directory an engine loads when (re-)created: the base model, then its warm start
    actors: list = field(default_factory=list)  # RolloutEngine actor handles, engine i at index i
    urls: list = field(default_factory=list)  # their HTTP URLs, same order (AgentFlow's pool routes over these)
    restarts: int = 0  # engines re-created in this run (metric engines/restarts)
    # colocated (colocate_hand_off): the memory tags engine i has released and not resumed, the only ones it may be
    # sent a resume of (SGLang dies on a resume of any other); and the tags the hand-off holds released right now,
    # engines paused meanwhile: a re-created engine joins that state (restart_engine)
    released: list = field(default_factory=list)
    hand_off: list = field(default_factory=list)
    flow: object = None  # the AgentFlow actor (start_rollout)
    judge: object = None  # the judge engine of `reward: judge` (start_judge); None with judge.url or no judge
    others: list = field(default_factory=list)  # trainer ranks and teachers: stop() ends them with the engines
    teacher_pg: object = None  # the teachers' own placement group (teacher_placement "own"), removed by stop()


def reserve(cfg: Config) -> Fleet:
    """Start Ray and reserve the placement bundles (see `placement`). Returns the Fleet of placement group, plan,
    each bundle's (node, GPU ids) and, async on a local CPU node, the engines' busy file; no actor yet."""
    if not ray.is_initialized():
        if cfg.ray_address:
            ray.init(address=cfg.ray_address, log_to_driver=True)
        else:  # logical CPUs: actors are mostly waiting on each other; torch threads are set per actor
            need = cfg.trainer_workers * cfg.cpus_per_trainer + cfg.num_engines * cfg.cpus_per_engine + 1
            need += cfg.teacher_tp * cfg.cpus_per_teacher if cfg.teachers and cfg.teacher_placement == "own" else 0
            # address="local": a Ray of its own (else ray.init joins a cluster another run here advertises, then refuses
            # num_cpus). Workers inherit this env: with a runtime_env each actor waited ~2 s for a worker of its own
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            ray.init(address="local", num_cpus=max(int(math.ceil(need)), os.cpu_count() or 1), include_dashboard=False)
    plan = placement(cfg)
    fleet = Fleet(placement_group(plan["bundles"], strategy="PACK"), plan, [])
    _live.append(fleet)  # from here on stop() frees the bundles, however the run ends (stop_on_exit)
    try:
        ray.get(fleet.pg.ready(), timeout=300)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"Ray could not reserve the placement bundles {plan['bundles']} within 300 s (cluster "
                           f"has {ray.cluster_resources()}); lower trainer_workers / num_engines / cpus_per_* or "
                           "add nodes") from None
    fleet.where = bundle_gpus(fleet.pg, len(plan["bundles"]))
    for i, e in enumerate(plan["engines"]):
        nodes = {fleet.where[b][0] for b in e["gpu_bundles"]}
        if len(nodes) > 1:
            raise RuntimeError(f"engine {i} spans bundles {e['gpu_bundles']} on several nodes {sorted(nodes)}; an "
                               "SGLang server needs its GPUs on one node: make gpus_per_engine divide GPUs per node")
    print("placement:\n" + placement_table(cfg, plan, fleet.where))
    fleet.busy_file = cpu.engine_busy_file(cfg)
    return fleet


_live: list[Fleet] = []  # fleets reserved in this process and not stopped yet


def stop(fleet: Fleet) -> None:
    """End a run's actors and free its bundles; Ray stays up for the next run (a test session, a notebook calling
    train() twice). AgentFlow and the engines first close what they started themselves (the router and agents'
    sandboxes; an SGLang server and its GPU memory), each given 30 s; then every actor is killed and the placement
    groups removed. Safe on a run that failed half-way, and a second time."""
    _live[:] = [f for f in _live if f is not fleet]
    if ray.is_initialized():
        closing = [e.shutdown.remote() for e in fleet.actors + ([fleet.judge] if fleet.judge is not None else [])]
        closing += [fleet.flow.close.remote()] if fleet.flow is not None else []
        if closing:  # a dead or hung actor answers with an error or not at all: it is killed below either way
            ray.wait(closing, num_returns=len(closing), timeout=30)
        for actor in [fleet.flow, fleet.judge, *fleet.actors, *fleet.others]:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        for pg in (fleet.pg, fleet.teacher_pg):
            if pg is not None:
                remove_placement_group(pg)
    if fleet.busy_file and os.path.exists(fleet.busy_file):
        os.unlink(fleet.busy_file)


def stop_on_exit(run):
    """Decorates loongsage.train: however the run ends (it returns, raises, or is interrupted), stop() every fleet
    it reserved. A decorator, so train() reads without a try/finally around its whole body."""
    @functools.wraps(run)
    def wrapper(*args, **kwargs):
        before = len(_live)
        try:
            return run(*args, **kwargs)
        finally:
            while len(_live) > before:
                stop(_live[-1])
    return wrapper


# ================================================================================================
# start-up: trainers, engines, AgentFlow, teachers


def start_trainers(cfg: Config, fleet: Fleet) -> list:
    """The trainer ranks on their bundles, started and (async on CPU) pinned to their cores."""
    TrainerActor = ray.remote(trainer.TrainerWorker)
    pg, plan = fleet.pg, fleet.plan
    for attempt in range(1, 4):
        addr, port = ray.get(ray.remote(_addr_and_port).options(
            num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0)).remote())
        trainers = [TrainerActor.options(num_cpus=o["num_cpus"], num_gpus=o["num_gpus"],
                                         scheduling_strategy=PlacementGroupSchedulingStrategy(pg, o["bundle"]))
                    .remote(cfg, r, cfg.trainer_workers, addr, port) for r, o in enumerate(plan["trainers"])]
        fleet.others += trainers
        try:
            wait([t.__ray_ready__.remote() for t in trainers], "starting the trainer ranks", cfg.actor_timeout)
            for r, t in enumerate(trainers):  # async on CPU: each rank on cores of its own (see cpu.actor_cores)
                if cores := cpu.actor_cores(cfg, "trainer", r):
                    t.__ray_call__.remote(lambda _, c: cpu.pin_process(c), cores)
                if (lent := cpu.lent_cores(cfg, r)) and fleet.busy_file:  # ... and on its engines' while they idle
                    t.borrow_cores.remote(fleet.busy_file, lent)
            return trainers
        except ray.exceptions.RayActorError as e:
            # The port was free when picked, but rank 0 binds it only once its actor has started
            # (seconds later): another process may take it meanwhile. Pick another; other errors are real.
            for t in trainers:
                ray.kill(t)
            if "EADDRINUSE" not in str(e) or attempt == 3:
                raise
            print(f"trainer rendezvous port {port} was taken before rank 0 could bind it; trying another")


def start_engine(cfg: Config, fleet: Fleet, i: int):
    """Engine i's RolloutEngine actor on its bundle, loading fleet.model; an SGLang server sees the GPUs of all its
    bundles. Always the same bundle for the same i, so a re-created engine takes its predecessor's place."""
    import rollout  # late: FastAPI and uvicorn (~0.4 s), which --check does not need
    o = fleet.plan["engines"][i]
    ecfg = dataclasses.replace(cfg, model_path=fleet.model)  # the model this run prepared (tiny, warm-started)
    engine = ray.remote(rollout.RolloutEngine).options(
        num_cpus=o["num_cpus"], num_gpus=o["num_gpus"],
        scheduling_strategy=PlacementGroupSchedulingStrategy(fleet.pg, o["bundle"])).remote(
            ecfg, i, engine_visible_gpus(fleet.plan, fleet.where, i), fleet.busy_file)
    if cores := cpu.actor_cores(cfg, "engine", i):  # async on CPU: cores no trainer uses (after __init__)
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


def start_rollout(cfg: Config, fleet: Fleet):
    """The engines (into fleet.actors), loading fleet.model, and the AgentFlow actor (rollouts, agents, rewards, the
    router), which gets their URLs as refs and so starts while they load. Returns the AgentFlow actor."""
    import agentflow  # late: ~1 s (OpenAI client, Starlette server), which --check does not need
    fleet.actors = [start_engine(cfg, fleet, i) for i in range(cfg.num_engines)]
    fleet.released = [set() for _ in fleet.actors]
    fleet.judge = start_judge(cfg) if cfg.judge and not cfg.judge.get("url") else None
    # hard on the controller's node (Ray spills a soft one): a lost node takes both or neither, unlike engines, trainers
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    fleet.flow = ray.remote(agentflow.AgentFlow).options(num_cpus=0, scheduling_strategy=here).remote(
        cfg, [e.url.remote() for e in fleet.actors], fleet.model, fleet.judge.url.remote() if fleet.judge else None)
    return fleet.flow


def start_judge(cfg: Config):
    """The judge engine of `reward: judge`: one more RolloutEngine (cfg.engine) serving judge.model_path, greedy;
    no weight update ever reaches it. Outside the placement plan: on CPU it shares the node's cores like AgentFlow
    (num_cpus 0), on CUDA it asks Ray for one GPU of its own."""
    import rollout  # late, as in start_engine
    j = cfg.judge
    jcfg = dataclasses.replace(cfg, model_path=j["model_path"], lora_rank=0, router_replay=False,
                               gpus_per_engine=1, max_new_tokens=j["max_new_tokens"],
                               max_prompt_len=j["max_context_len"] - j["max_new_tokens"],
                               max_context_len=j["max_context_len"])
    gpu = cfg.device == "cuda"
    # rank num_engines: its own seed and SGLang log file (sglang_engine_<rank>.log) beside the rollout engines'
    return ray.remote(rollout.RolloutEngine).options(num_cpus=1 if gpu else 0, num_gpus=1 if gpu else 0).remote(
        jcfg, cfg.num_engines)


def start_teachers(cfg: Config, fleet: Fleet, paths: dict[str, str]) -> list:
    """The teacher group: `teacher_tp` TeacherWorker ranks in their own placement group ("own") or on the
    trainers' bundles ("trainer": they compute while the trainers wait), every teacher registered."""
    gpu, pg = cfg.device == "cuda", fleet.pg
    if cfg.teacher_placement == "own":
        bundle = {"GPU": 1, "CPU": cfg.cpus_per_teacher} if gpu else {"CPU": cfg.cpus_per_teacher}
        pg = fleet.teacher_pg = placement_group([dict(bundle) for _ in range(cfg.teacher_tp)], strategy="PACK")
        ray.get(pg.ready(), timeout=300)
        cpus = cfg.cpus_per_teacher
    else:
        cpus = 0  # the trainer bundle's CPUs are the trainers'; a teacher runs while they wait
    on = [dict(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, r), num_cpus=cpus, num_gpus=1 if gpu else 0)
          for r in range(cfg.teacher_tp)]
    addr, port = ray.get(ray.remote(_addr_and_port).options(**{**on[0], "num_cpus": 0, "num_gpus": 0}).remote())
    Actor = ray.remote(teacher.TeacherWorker)
    group = [Actor.options(**on[r]).remote(cfg, r, cfg.teacher_tp, addr, port) for r in range(cfg.teacher_tp)]
    fleet.others += group
    info = ray.get([t.load_teachers.remote(paths, str(Path(cfg.output_dir) / "teacher_snapshots")) for t in group])[0]
    print(f"teachers: {info}")
    return group


def score_batch(cfg: Config, fleet: Fleet, teachers: list, paths: dict[str, str], batch_ref, step: int):
    """(teachers, targets ref, `teacher/` metrics) of the step's batch. A teacher rank that dies while scoring (OOM,
    a lost node) takes its group's collectives with it: the group is re-created from the same teachers and scores
    the whole batch again, once, so the step trains on complete targets or not at all."""
    for attempt in (1, 2):
        refs = [t.score.options(num_returns=2).remote(batch_ref) for t in teachers]
        try:  # every rank's, so a dead rank's error arrives while the others wait for it in a collective
            return teachers, refs[0][0], wait([m for _, m in refs], f"teacher scoring of step {step}",
                                              cfg.actor_timeout)[0]
        except ray.exceptions.RayActorError as e:
            if attempt == 2:
                raise
            print(f"a teacher rank died scoring step {step} ({str(e).splitlines()[0]}): re-creating the teachers")
            fleet.others = [a for a in fleet.others if a not in teachers]
            for t in teachers:
                ray.kill(t, no_restart=True)
            if fleet.teacher_pg is not None:
                remove_placement_group(fleet.teacher_pg)
            teachers = start_teachers(cfg, fleet, paths)


def _addr_and_port():
    return ray.util.get_node_ip_address(), transfermesh.free_port()


# ================================================================================================
# reliability: waits that cannot hang, engines that are re-created when they die; the weight sync; the
# colocated hand-off


def wait(refs, what: str, timeout: float, knob: str = "actor_timeout", every: float = 0.0, tick=None):
    """`ray.get(refs)` that cannot hang. A failure is raised the moment it arrives, even while other
    ranks still wait for the failed one inside a collective; past `timeout` seconds it raises
    TimeoutError naming `what` and the config `knob` that sets the limit (a bare ray.get would wait
    forever on a hung actor; most calls' limit is `actor_timeout`). `tick()` runs every `every` seconds
    meanwhile (the engine health check while a rollout batch is generated)."""
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


def off_node(fleet: Fleet, urls: list[str]) -> list[str]:
    """The engines among `urls` placed on another Ray node than trainer rank 0, the weights' sender: TransferMesh
    sends them no shared memory or IPC handles (transfermesh.pick_transport), whatever machine the nodes are on."""
    here = fleet.where[fleet.plan["trainers"][0]["bundle"]][0]
    return [u for i, u in enumerate(fleet.urls)
            if u in urls and fleet.where[fleet.plan["engines"][i]["bundle"]][0] != here]


def restart_engine(cfg: Config, fleet: Fleet, i: int, flow, trainers, version: int) -> str:
    """Re-create dead engine i on its bundle, load the trainers' current weights (labelled `version`)
    into it, and route to it again. The trainers must be idle and hold weight version `version`."""
    if fleet.restarts >= cfg.max_engine_restarts:
        raise RuntimeError(f"rollout engine {i} ({fleet.urls[i]}) is dead, and {fleet.restarts} engines were already "
                           f"re-created in this run (max_engine_restarts={cfg.max_engine_restarts}); the engines' logs "
                           "above say why they die. Fix that, or raise max_engine_restarts")
    old = fleet.urls[i]
    # its server's process group signalled first, as stop() does (Ray's kill ends the server alone: vLLM's engine
    # core and worker lived on, ~2.7 GB); a hung engine answers not at all, and it still holds its bundle (and port)
    ray.wait([fleet.actors[i].shutdown.remote()], timeout=10)
    ray.kill(fleet.actors[i], no_restart=True)
    deadline, bundle = time.monotonic() + cfg.actor_timeout, fleet.plan["engines"][i]["bundle"]
    while True:  # its node lost: an engine started before Ray places the bundle on another node dies, so again
        node = placement_group_table(fleet.pg)["bundles_to_node_id"].get(bundle)
        fleet.actors[i] = start_engine(cfg, fleet, i)
        try:
            url = wait(fleet.actors[i].url.remote(), f"re-creating rollout engine {i}", deadline - time.monotonic())
            break
        except ray.exceptions.RayActorError:
            if node in {n["NodeID"] for n in ray.nodes() if n["Alive"]}:
                raise  # its node is up: the engine's own failure
            time.sleep(1.0)
    # it loaded fleet.model (version 0); every later version lives only in the trainers, and with LoRA the router
    # names the current adapter (version 0's too, after a warm start), which this engine must have
    if version > 0 or cfg.lora_rank:
        remote = [url] if off_node(fleet, [old]) else []  # the same bundle, so the same node as its predecessor
        transfermesh.pause_engines([url])  # idle, yet an update comes paused (engine=vllm refuses it unpaused)
        wait([t.sync_weights.remote([url], version, remote=remote) for t in trainers],
             f"weight sync to re-created engine {i}", cfg.weight_sync_timeout, "weight_sync_timeout")
        transfermesh.continue_engines([url])
    fleet.released[i] = set()
    if fleet.hand_off:  # mid-way through the colocated hand-off: paused and released as the others are
        import rollout  # late: FastAPI and uvicorn (~0.4 s), which --check does not need
        rollout.post(url, "/pause_generation", {"mode": "retract"}, timeout=cfg.weight_sync_timeout)
        rollout.post(url, "/release_memory_occupation", {"tags": list(fleet.hand_off)}, timeout=cfg.weight_sync_timeout)
        fleet.released[i] = set(fleet.hand_off)
    wait(flow.replace_engine.remote(old, url), "AgentFlow.replace_engine", cfg.actor_timeout)
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


def _post_each(urls: list[str], path: str, payload: dict, timeout: float, busy_retry: bool = False) -> None:
    """POST to every engine, even past one that fails; then raise the first failure (a dead engine's among them).
    `busy_retry` (/flush_cache): again to each that answers 400 until `timeout` (weight_sync_timeout) has passed:
    SGLang flushes only when idle, and a request whose grammar is still compiling keeps it busy even while paused
    (scheduler.is_fully_idle counts the grammar queue)."""
    import rollout  # late: FastAPI and uvicorn (~0.4 s), which --check does not need
    deadline, errors = time.monotonic() + timeout, []
    while urls:
        refused = []
        for url in urls:
            try:
                rollout.post(url, path, payload, timeout=timeout)
            except rollout.EngineError as e:
                if not busy_retry or rollout.http_status(e) != 400:
                    errors.append(e)
                elif time.monotonic() < deadline:
                    refused.append(url)
                else:
                    errors.append(rollout.EngineError(f"{e} (still, after weight_sync_timeout={timeout} s of retries: "
                                                      "SGLang flushes only when idle; raise weight_sync_timeout)"))
            except httpx.HTTPError as e:
                errors.append(e)
        urls = refused
        time.sleep(0.2 if urls else 0)
    if errors:
        raise errors[0]


def update_engines(cfg: Config, fleet: Fleet, urls: list[str], push):
    """`push()` (a weight push to `urls`) with the engines paused, so no forward step sees half-updated weights;
    returns what it returns. No K/V outlives the weights that computed it: the engines pause with "retract"
    (running requests give their K/V back and wait, keeping their tokens), the cache is flushed after the push
    (SGLang flushes only when idle: _post_each retries), and on continue every request in flight is prefilled
    again under the new weights. Mid-way through the colocated hand-off the engines stay paused (colocate_hand_off
    continues). A push that fails (an engine died or stalled in it) may have loaded part of the weights: the engines
    stay paused, so no token is computed on mixed weights, until sync_engines pushes again to the live ones or the
    run stops."""
    _post_each(urls, "/pause_generation", {"mode": "retract"}, cfg.weight_sync_timeout)
    out = push()
    # an engine that released its KV cache flushed it then and computed nothing since
    kv = [u for u in urls if "kv_cache" not in fleet.released[fleet.urls.index(u)]] if fleet.released else urls
    _post_each(kv, "/flush_cache", {}, cfg.weight_sync_timeout, busy_retry=True)
    if not fleet.hand_off:
        _post_each(urls, "/continue_generation", {}, cfg.weight_sync_timeout)
    return out


def sync_engines(cfg: Config, fleet: Fleet, flow, trainers, version: int, base: bool = False) -> dict:
    """Weights -> engines (TransferMesh) as version `version`, through update_engines. A dead engine is skipped and
    re-created on these weights afterwards; one that dies during the push fails it, so probe and push once more to
    the engines left (a push is idempotent). Returns the trainers' `weights/` metrics. LoRA: the adapters alone
    travel, as a new adapter AgentFlow names in new requests, with no pause; `base` sends the base weights too."""
    for attempt in (1, 2):
        dead = check_engines(cfg, fleet, flow)
        live = [u for u in fleet.urls if u not in dead]

        def push():
            return wait([t.sync_weights.remote(live, version, base, off_node(fleet, live)) for t in trainers],
                        f"weight sync of version {version} to {len(live)} engine(s)", cfg.weight_sync_timeout,
                        "weight_sync_timeout")[0]
        try:
            # LoRA without the base: a new adapter, loaded by name beside the weights nothing changes; requests keep
            # the adapter they named and prefix K/V is keyed by adapter, so no pause, retract or flush is needed
            # no engine left (all dead, a lost node): nothing to push now; each is re-created on these weights below
            stats = {} if not live else push() if cfg.lora_rank and not base else update_engines(cfg, fleet, live, push)
            break
        except (ray.exceptions.RayTaskError, RuntimeError, httpx.HTTPError) as e:
            if attempt == 2 or not check_engines(cfg, fleet, flow):
                raise  # no engine died: the error is the sync's own
            print(f"weight sync of version {version} failed as an engine died ({str(e).splitlines()[0]}); "
                  "pushing again to the others")
    if cfg.lora_rank:  # every live engine has the new adapter: new requests name it
        wait(flow.use_adapter.remote(lora.adapter_name(version), version), "AgentFlow.use_adapter", cfg.actor_timeout)
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
    trainer rank 0's, the largest engine's where it reports it) and its seconds; {} unless cfg.colocate."""
    if not cfg.colocate:
        return {}
    import rollout  # late: FastAPI and uvicorn (~0.4 s), which --check does not need
    t0 = time.perf_counter()

    def engine(url: str, path: str, payload: dict) -> bool:
        """POST to one engine; False when it is dead (out of routing now: sync_engines re-creates it after the next
        push, and it joins the hand-off's state then)."""
        try:
            rollout.post(url, path, payload, timeout=cfg.weight_sync_timeout)
            return True
        except (rollout.EngineError, httpx.HTTPError):
            if url not in check_engines(cfg, fleet, flow):
                raise  # alive: the error is the hand-off's own
            return False

    def memory(call: str, tags: list[str]) -> None:
        """Release or resume `tags` on every engine; a resume only of what that engine released (fleet.released)."""
        for i, url in enumerate(fleet.urls):
            mine = tags if call == "release" else [t for t in tags if t in fleet.released[i]]
            if mine and engine(url, f"/{call}_memory_occupation", {"tags": mine}):
                if call == "release":
                    fleet.released[i] |= set(mine)
                else:
                    fleet.released[i] -= set(mine)

    if stage == "train":
        for url in fleet.urls:  # SGLang releases memory only with nothing running (else its server ends)
            engine(url, "/pause_generation", {"mode": "retract"})
        memory("release", ["weights", "kv_cache"])
        fleet.hand_off = ["weights", "kv_cache"]
        mem = wait([t.onload.remote() for t in trainers], "trainer onload", cfg.actor_timeout)
    elif stage == "sync":
        mem = wait([t.offload.remote(["optimizer", "grads"]) for t in trainers], "trainer offload", cfg.actor_timeout)
        memory("resume", ["weights"])
        fleet.hand_off = ["kv_cache"]
    elif stage == "rollout":
        mem = wait([t.offload.remote(["weights"]) for t in trainers], "trainer offload", cfg.actor_timeout)
        memory("resume", ["kv_cache"])
        fleet.hand_off = []
        for url in fleet.urls:
            engine(url, "/continue_generation", {})
    else:
        raise ValueError(f"colocate_hand_off stage {stage!r}: choose 'train', 'sync' or 'rollout'")
    out = {f"memory/{stage}_trainer_mb": mem[0]["rss_bytes"] / 2**20,
           f"timing/hand_off_{stage}": time.perf_counter() - t0}
    if "gpu_used_bytes" in mem[0]:  # the whole device: read again now the engines' half of the stage is done too
        used = wait([trainers[0].memory.remote()], "trainer memory", cfg.actor_timeout)[0]
        out[f"memory/{stage}_gpu_used_mb"] = used["gpu_used_bytes"] / 2**20
    if rss := [s["rss_bytes"] for s in engine_states(fleet.urls) if "rss_bytes" in s]:  # the CPU engine reports it
        out[f"memory/{stage}_engine_mb"] = max(rss) / 2**20
    return out


# ================================================================================================
# run state: checkpoints that lose nothing, and resume


def _atomic_write(path: Path, text: str) -> list:
    return trainer.write_durable(path, lambda f: f.write(text.encode()))  # fsync + atomic rename; [bytes, xxh3]


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


def save_run_state(cfg: Config, trainers, step: int, controller_state: dict) -> Path | None:
    """Checkpoint after RL step `step`, in checkpoints/step_XXXXX/: every trainer rank's model and optimizer files
    (trainer.save_checkpoint), the `controller_state` train() hands over (JSON: data cursor, RNG, ...), config.yaml
    and manifest.json (each file's size and xxh3 checksum, checked at resume), each written durably
    (trainer.write_durable). Then, last, `checkpoints/latest` is rewritten to name it: a crash anywhere in a save
    leaves `latest` naming the previous checkpoint, complete. A save that fails with an OSError (disk full) is
    removed; then the run stops with the error, or with on_save_error=skip trains on without it (returns None)."""
    root = Path(cfg.output_dir) / "checkpoints"
    path, marker = root / f"step_{step:05d}", root / "latest"
    marked = lambda: marker.exists() and marker.read_text().strip() == path.name  # noqa: E731
    if path.exists() and not marked():
        shutil.rmtree(path)  # debris of a save that crashed before its marker
    try:
        files = {}
        for sums in wait([t.save_checkpoint.remote(str(path)) for t in trainers],
                         f"checkpoint of step {step} (trainer ranks)", cfg.actor_timeout):
            files |= sums
        trainer.fault("controller", step)
        files["controller_state.json"] = _atomic_write(path / "controller_state.json",
                                                       json.dumps({"step": step, **controller_state}))
        files["config.yaml"] = _atomic_write(path / "config.yaml", yaml.safe_dump(dataclasses.asdict(cfg),
                                                                                  sort_keys=False))
        _atomic_write(path / "manifest.json", json.dumps({"step": step, "files": files}, indent=1))
        trainer.fault("latest", step)
        _atomic_write(marker, path.name + "\n")
    except OSError as e:  # a rank's arrives wrapped by Ray (RayTaskError(OSError)), the original in .cause
        e = getattr(e, "cause", None) or e
        if not marked():
            shutil.rmtree(path, ignore_errors=True)
        msg = (f"the checkpoint of step {step} could not be written ({e}) and was removed; checkpoints/latest names "
               f"{marker.read_text().strip() if marker.exists() else 'no checkpoint'}, complete")
        if cfg.on_save_error == "stop":
            raise OSError(e.errno, f"{msg}. Free space in {root} and resume=true, or set on_save_error=skip to "
                                   "train on without the checkpoints that cannot be written") from e
        print(f"{msg}; training goes on without it (on_save_error=skip)")
        return None
    return path


def load_run_state(cfg: Config, trainers) -> tuple[int, dict | None]:
    """Restore the checkpoint `checkpoints/latest` names (resume=previous: the complete one before it, which
    `latest` then names) into every trainer rank (after load_hf) and return (the first step to run, the
    controller_state saved with it); (0, None) when there is none. Each file is checked against the manifest by
    the process that reads it (the controller its JSON, each rank its own files: trainer.verify), so a truncated or
    corrupted file is refused with an error naming it."""
    root = Path(cfg.output_dir) / "checkpoints"
    marker = root / "latest"
    if not marker.exists():
        if root.exists() and any(root.iterdir()):
            print(f"resume: {root} has no `latest` marker (no save completed, or written by an older "
                  "version without controller state); starting from step 0")
        return 0, None
    path = root / marker.read_text().strip()
    if cfg.resume == "previous":
        older = sorted(p for p in root.glob("step_*") if p.name < path.name and (p / "manifest.json").exists())
        if not older:
            raise FileNotFoundError(f"resume=previous: {root} has no complete checkpoint before {path.name}")
        print(f"resume=previous: loading {older[-1].name}, the checkpoint before {path.name}; `latest` names it now")
        path = older[-1]
        _atomic_write(marker, path.name + "\n")  # the later ones are debris now, replaced when those steps save
    try:
        files = json.loads((path / "manifest.json").read_text())["files"]
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{path / 'manifest.json'} cannot be read ({e!r}): written by a LoongSage without "
                         "checksums, or damaged; set resume=previous to go on from the checkpoint before") from e
    trainer.verify(path / "controller_state.json", files["controller_state.json"])
    state = json.loads((path / "controller_state.json").read_text())
    wait([t.load_checkpoint.remote(str(path), files) for t in trainers], f"loading checkpoint {path}",
         cfg.actor_timeout)
    return int(state["step"]) + 1, state


# ================================================================================================
# logging: one flat dict per step -> stdout line, metrics.jsonl, TensorBoard; reward curve at the end; the
# probes behind the perf/ metrics


class Logger:
    """Every step's metrics to metrics.jsonl, TensorBoard and (cfg.trackers) W&B / MLflow; the reward curve
    at the end. W&B and MLflow are imported only when a recipe asks for them."""

    def __init__(self, cfg: Config, resume_step: int | None = None, start: float | None = None):
        """`resume_step`: a resumed run continues the same metrics.jsonl and TensorBoard run from that
        step; rows of later steps (logged after the checkpoint, before the crash) are dropped, as the
        run does those steps again. `start`: the run's start (time.perf_counter()), from which every row's
        `time/wall` counts, so any step can be timed from outside the run's own timers (default: now)."""
        self.start = time.perf_counter() if start is None else start
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
        metrics = {"step": step, **{k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))},
                   "time/wall": time.perf_counter() - self.start}  # when the row is written: after all its work
        self.history.append(metrics)
        self.jsonl.write(json.dumps(metrics) + "\n")
        self.jsonl.flush()
        scalars = {k: v for k, v in metrics.items() if k != "step"}
        if self.tb:  # one event holds every scalar: an event each (add_scalar) cost ~15 ms a row in GIL hand-offs
            from tensorboard.compat.proto.summary_pb2 import Summary  # optional: self.tb is None without it
            self.tb.file_writer.add_summary(Summary(value=[Summary.Value(tag=k, simple_value=v)
                                                           for k, v in scalars.items()]), step)
            for k, v in hists.items():
                if v:
                    self.tb.add_histogram(k, np.asarray(v), step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)
        if self.mlflow is not None:  # MLflow metric names allow no '@': eval/pass@4 -> eval/pass_at_4
            import mlflow  # optional dependency, imported only when on
            mlflow.log_metrics({k.replace("@", "_at_"): v for k, v in scalars.items()}, step=step)

    def sample(self, step: int, t: dict) -> str:
        """A decoded sample of the step (every `print_every` steps): its reward, status, prompt and response."""
        return (f"[sample step {step}] reward={t['reward']} status={t['status']}\n"
                f"  {t.get('prompt_text', '')!r} -> {t.get('response_text', '')!r}")

    def line(self, step: int, m: dict) -> str:
        keys = [("reward", "rollout/reward_mean"), ("eval", "eval/accuracy"), ("loss", "train/loss"),
                ("gap_k3", "train/gap_k3"), ("len", "rollout/response_len"), ("step_s", "timing/step"),
                ("tok/s", "perf/rollout_tokens_per_s")]
        line = f"step {step:4d} | " + " | ".join(f"{k} {m[v]:.4g}" for k, v in keys if v in m)
        if "rollout/on_policy_frac" in m:  # how on-policy the step was
            line += f" | on-policy {m['rollout/on_policy_frac']:.0%} · max lag {m['rollout/lag_max']:.0f}"
        if "weights/full_bytes" in m:  # LoRA: the bytes one sync moved, against a full sync's
            line += f" | sync {m['weights/bytes'] / 1e6:.3g} MB (full {m['weights/full_bytes'] / 1e6:.3g} MB)"
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
                ax.axhline(v, color=color, ls=("--", ":", "-.")[j % 3], lw=1,
                           label=f"{k.split('/')[1]} (teacher) on {src}")
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


_STATS_HTTP: httpx.Client | None = None  # engine_states' client, kept: a new one builds an SSL context each time


def engine_states(engine_urls: list[str]) -> list[dict]:
    """Each engine's /server_info internal_states[0] (the CPU engine adds busy_s and rss_bytes there); {} for an
    engine that does not answer."""
    global _STATS_HTTP
    _STATS_HTTP = _STATS_HTTP or httpx.Client(timeout=30.0)
    states = []
    for u in engine_urls:
        try:
            states.append(_STATS_HTTP.get(f"{u}/server_info").raise_for_status().json()["internal_states"][0])
        except (httpx.HTTPError, KeyError, IndexError, ValueError, OSError):
            states.append({})
    return states


def engine_busy_seconds(states: list[dict]) -> float:
    """Seconds CPU engines have spent computing so far (their engine_states); 0 when any engine does not tell."""
    return sum(s["busy_s"] for s in states) if all("busy_s" in s for s in states) else 0.0


def node_cpu_jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of this machine so far, in jiffies, from /proc/stat (Linux); (0, 0) elsewhere. Busy:
    user, nice, system, irq and softirq time; the rest is idle, waiting on I/O or stolen by a hypervisor."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return 0, 0
    return v[0] + v[1] + v[2] + v[5] + v[6], sum(v)


def usage(fleet: Fleet, states: list[dict] | None = None) -> tuple[float, float, tuple[int, int]]:
    """(engine busy seconds, wall clock, node CPU jiffies) now, from the engines' `states` if just read; step_usage
    compares two of these."""
    return engine_busy_seconds(states or engine_states(fleet.urls)), time.perf_counter(), node_cpu_jiffies()


def step_usage(fleet: Fleet, before: tuple, t_step: float, t_generate: float, local: bool) -> tuple[dict, tuple]:
    """The step's timing/step and perf/ fractions since `before` (a usage()), and the usage now, for the next step.
    `local`: every actor is on this machine, so its CPU time (perf/node_cpu_busy_frac) is the run's. Also the
    resident MB of the controller and of the largest CPU engine, each step (a leak shows as a slope)."""
    (busy0, wall0, jiffies0), (busy, wall, jiffies) = before, (now := usage(fleet, states := engine_states(fleet.urls)))
    m = {"timing/step": wall - t_step, "perf/trainer_wait_frac": t_generate / (wall - t_step),
         "perf/engine_idle_frac": max(0.0, 1 - (busy - busy0) / len(fleet.urls) / (wall - wall0)),
         "engines/restarts": fleet.restarts, "memory/controller_mb": transfermesh.rss_bytes() / 2**20}
    if rss := [s["rss_bytes"] for s in states if "rss_bytes" in s]:
        m["memory/engine_mb"] = max(rss) / 2**20
    if jiffies[1] > jiffies0[1] and local:
        m["perf/node_cpu_busy_frac"] = (jiffies[0] - jiffies0[0]) / (jiffies[1] - jiffies0[1])
    return m, now
