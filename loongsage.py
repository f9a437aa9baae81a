"""LoongSage controller: one process that drives every Ray actor of an RL run.

    python loongsage.py recipes/arith_cpu.yaml                  # the default CPU recipe
    python loongsage.py recipes/arith_cpu.yaml num_steps=5 lr=1e-5 sglang.mem_fraction_static=0.8

Read `train()` first: it is the whole system, top to bottom. Every blocking point is a visible
`ray.get`; the controller holds actor handles and object refs, never tensors.

    AgentFlow (agents, router)  --input_ids-->  RolloutEngine x N (SGLang / CPU engine, HTTP)
          |  trajectories (token ids, masks, logprobs, rewards)            ^
          v                                                                |  TransferMesh buckets
    TrainerWorker x (TP*PP*DP) (Megatron-Core): old/ref logprobs, advantages, loss, step

Modes: `mode: sync` (generate, then train, then sync weights) and `mode: async` (the next batches
are generated while this one trains; at most `max_staleness` batches in flight, partial rollouts
continue across weight updates and record the version of every token). Debug seams: `rollout_only`,
`train_only` with `load_rollouts`, `dump_rollouts`, decoded samples printed every `print_every` steps.

Teachers (teacher.py) score every batch between "generate" and "train" when `teachers:` is set;
`data_sources:` mixes several datasets (each with its agent, reward, teacher and eval set) by weight.
Left out here (see the issues): multi-node launch scripts.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import random
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import yaml

import data


# ================================================================================================
# Config: one dataclass, a comment on every field. Derived fields are computed in `finalize`.


@dataclass
class Config:
    # --- run ---
    recipe: str = ""  # the YAML this config came from (set by load_config)
    output_dir: str = "runs/default"  # metrics.jsonl, TensorBoard, reward curve, checkpoints, final HF model
    seed: int = 1234  # seeds data order, sampling and init
    num_steps: int = 20  # RL steps (one rollout batch and one policy update each)
    mode: str = "sync"  # "sync" or "async" (generation overlaps training)
    max_staleness: int = 1  # async: rollout batches in flight while training (the sliding window)
    eval_every: int = 5  # evaluate every N steps (and before step 0 and after the last); 0 = never
    save_every: int = 0  # Megatron checkpoint every N steps; 0 = only the final HF export
    resume: bool = False  # resume from the newest checkpoint in output_dir/checkpoints
    print_every: int = 5  # print a decoded sample every N steps; 0 = never
    device: str = "auto"  # "auto" | "cpu" | "cuda"; resolved in finalize
    dtype: str = "float32"  # training/inference dtype: "float32" | "bfloat16"
    rollout_only: bool = False  # debug: only generate (and dump), never train
    train_only: bool = False  # debug: train on `load_rollouts` instead of generating
    dump_rollouts: str = ""  # directory: write every step's trajectories as jsonl
    load_rollouts: str = ""  # directory written by dump_rollouts, replayed by train_only

    # --- cluster ---
    ray_address: str = ""  # "" starts a local Ray; else an existing cluster ("auto" or host:port)
    trainer_workers: int = 1  # trainer ranks = tensor_parallel * pipeline_parallel * data_parallel
    tensor_parallel: int = 1  # Megatron TP size
    pipeline_parallel: int = 1  # Megatron PP size
    expert_parallel: int = 1  # Megatron EP size (MoE models)
    data_parallel: int = 1  # derived: trainer_workers // (tensor_parallel * pipeline_parallel)
    num_engines: int = 1  # rollout engines (each one SGLang server or CPU engine)
    colocate: bool = False  # engines share the trainers' placement bundles (GPUs), instead of their own
    cpus_per_trainer: float = 1.0  # Ray CPU resources per trainer rank
    cpus_per_engine: float = 1.0  # Ray CPU resources per engine
    gpus_per_engine: int = 1  # GPUs per SGLang engine (its tensor parallel size); CUDA only

    # --- model ---
    model_path: str = "tiny"  # HF directory, or "tiny" to build (and cache) the tiny Qwen3 of data.py
    tiny_model: dict = field(default_factory=dict)  # settings for data.build_tiny_model (model_path: tiny)
    megatron: dict = field(default_factory=dict)  # passed through to Megatron's TransformerConfig untouched
    sglang: dict = field(default_factory=dict)  # passed through to the SGLang server as --key value flags

    # --- warm start (SFT through the same trainer, before RL; cached) ---
    warmstart_steps: int = 0  # SFT optimizer steps; 0 = none
    warmstart_dataset: str = "synthetic:arith:4096:7"  # data.load_dataset spec of the SFT data
    warmstart_batch_size: int = 64  # samples per SFT step
    warmstart_lr: float = 1e-3  # SFT learning rate (constant)
    warmstart_label_noise: float = 0.0  # fraction of SFT answers replaced by a near-miss (see data.sft_trajectory)
    warmstart_example: str = "data.sft_trajectory"  # fn(tokenizer, sample, rng, label_noise) -> trajectory dict

    # --- data ---
    dataset: str = "synthetic:arith:4096:1"  # training prompts (data.load_dataset spec)
    eval_dataset: str = "synthetic:arith:128:2"  # eval prompts
    reward: str = "data.exact_match"  # reward(response_text, sample) -> float, dotted path
    agent: str = ""  # dotted path of an agent; "" = single-turn chat straight to the engine
    agent_command: str = ""  # black-box agent: a shell command run in a sandbox against the session URL
    sandbox: str = "local"  # "local" | "docker" | "auto" (docker where a Docker engine answers)
    max_parallel_sandboxes: int = 32  # black-box agents / code-test rewards running at once
    router_host: str = "127.0.0.1"  # where the AgentFlow router listens (0.0.0.0 for agents on other machines)
    max_turns: int = 8  # agent turns per trajectory
    agent_timeout: float = 120.0  # seconds per trajectory
    agent_retries: int = 1  # retries of a failed trajectory
    max_context_len: int = 1024  # token budget per trajectory (prompt + all turns)

    # --- rollout ---
    prompts_per_step: int = 32  # B prompts per step
    samples_per_prompt: int = 8  # N samples per prompt (the group)
    max_prompt_len: int = 256  # longer prompts are rejected by the engine
    max_new_tokens: int = 16  # per model call
    temperature: float = 1.0  # sampling temperature for training rollouts
    top_p: float = 1.0
    top_k: int = -1
    eval_temperature: float = 0.0  # 0 = greedy eval
    eval_samples: int = 1  # samples per eval prompt
    engine: str = "auto"  # "auto" (sglang on CUDA, cpu elsewhere) | "sglang" | "cpu"
    engine_max_batch: int = 256  # concurrent sequences per CPU engine

    # --- train ---
    global_batch_size: int = 256  # samples per optimizer step (a mini-batch); a step may do several
    micro_batch_size: int = 64  # samples per forward/backward on one DP rank
    lr: float = 1e-4
    min_lr: float = 0.0  # cosine decay floor; = lr means constant
    lr_warmup_steps: int = 0  # optimizer steps of linear warmup
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0  # global grad-norm clip; 0 = off

    # --- algo (see algos.py and ALGORITHMS.md; validated by algos.validate) ---
    advantage: str = "grpo"  # grpo | drgrpo | rloo | reinforce_pp | returns | gae
    adv_norm: str = "group"  # grpo normaliser: group | group_mean | batch | none
    policy_loss: str = "ppo_clip"  # ppo_clip | gspo | cispo | reinforce | sft
    loss_agg: str = "token_mean"  # token_mean | seq_mean_token_mean | seq_mean_token_sum
    clip_low: float = 0.2  # PPO ratio lower clip (1 - clip_low)
    clip_high: float = 0.2  # PPO ratio upper clip (1 + clip_high); > clip_low is "clip-higher"
    dual_clip_c: float = 0.0  # dual clip bound for negative advantages (e.g. 3.0); 0 = off
    kl_coef: float = 0.0  # KL-to-reference weight; 0 = no reference model kept
    kl_type: str = "k3"  # k1 | k2 | k3 | low_var_k3 | k3_unbiased
    kl_in_reward: bool = False  # fold KL into the reward (REINFORCE++) instead of the loss
    entropy_coef: float = 0.0  # entropy bonus weight
    gamma: float = 1.0  # discount for token-level returns / GAE
    lam: float = 1.0  # GAE lambda
    use_rollout_logprobs: bool = False  # old_logp := engine logprobs (skip the recompute)
    is_correction: str = ""  # train-inference IS correction: "" | token | seq | geo
    is_mode: str = "truncate"  # truncate | mask (outside [is_low, is_high])
    is_low: float = 0.0
    is_high: float = 2.0
    m2po_threshold: float = 0.0  # M2PO second-moment bound; 0 = off
    opsm_delta: float = 0.0  # OPSM KL bound for negative-advantage sequences; 0 = off
    mask_stale_tokens: bool = False  # drop tokens generated by older weights (partial rollouts)
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal, refill to the batch size
    overlong_buffer: int = 0  # DAPO overlong penalty window in tokens; 0 = off
    overlong_penalty: float = 1.0  # DAPO overlong penalty at max length
    length_penalty: str = ""  # "" | linear | kimi
    length_penalty_coef: float = 0.0  # weight of the length penalty
    distill_type: str = "topk_kl"  # GKD divergence to the teachers: topk_kl | forward_kl | reverse_kl | jsd
    pg_ratio: float = 0.0  # A' = A - pg_ratio * (log pi - log pi_teacher) on the sampled token; needs teachers
    gkd_ratio: float = 0.0  # L = (1 - gkd_ratio) * RL loss + gkd_ratio * GKD loss; 1 = pure distillation
    jsd_beta: float = 0.5  # beta of the generalised JSD

    # --- teachers and data sources (teacher.py; the objective is in algos.py, "On-policy distillation") ---
    teachers: dict = field(default_factory=dict)  # {name: HF dir | {path: HF dir or "tiny", tiny_model/warmstart_* overrides}}
    teacher_route: str = ""  # dotted path: fn(trajectory) -> per response token a teacher, {teacher: weight} or None
    teacher_tp: int = 1  # tensor parallel size of the teacher group (independent of the student's)
    teacher_placement: str = "own"  # "own": the teachers' own bundles | "trainer": time-share the trainers' (CPU)
    cpus_per_teacher: float = 1.0  # Ray CPU resources per teacher rank
    teacher_topk: int = 16  # K of the top-k targets each teacher returns per token
    teacher_micro_batch: int = 64  # samples per teacher forward
    teacher_eval: bool = True  # before training, evaluate each teacher (same architecture as the student) on the eval sets
    data_sources: list = field(default_factory=list)  # [{name, dataset, weight, eval_dataset, reward, agent, teacher}]

    # --- weights ---
    transfer: str = "auto"  # TransferMesh transport: auto | shm | cuda_ipc | broadcast | disk
    bucket_mb: float = 64.0  # bucket size for weight sync


def _closest(key: str, valid) -> str:
    match = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.0)
    return f"; did you mean {match[0]!r}?" if match else ""


def load_config(recipe: str | None, overrides: list[str] = ()) -> Config:
    """Recipe YAML + `key=value` overrides (values parsed as YAML; `sglang.x=1` sets a pass-through key)."""
    raw: dict = {}
    if recipe:
        if not Path(recipe).exists():
            raise FileNotFoundError(f"recipe {recipe!r} not found; the recipes are in {sorted(map(str, Path('recipes').glob('*.yaml')))}")
        raw = yaml.safe_load(Path(recipe).read_text()) or {}
    for ov in overrides:
        if "=" not in ov:
            raise ValueError(f"override {ov!r} must look like key=value")
        key, value = ov.split("=", 1)
        if "." in key:  # pass-through dicts: megatron.x=..., sglang.y=..., tiny_model.z=...
            top, sub = key.split(".", 1)
            raw.setdefault(top, {})[sub] = yaml.safe_load(value)
        else:
            raw[key] = yaml.safe_load(value)
    names = {f.name: f for f in dataclasses.fields(Config)}
    for key in raw:
        if key not in names:
            raise ValueError(f"unknown config key {key!r}{_closest(key, names)}")
    cfg = Config(**raw)
    cfg.recipe = recipe or ""
    for f in dataclasses.fields(Config):
        v, d = getattr(cfg, f.name), f.default
        if isinstance(d, float) and isinstance(v, (int, str)) and not isinstance(v, bool):
            try:  # YAML reads 1e-3 (no dot) as a string, and 1 as an int
                setattr(cfg, f.name, float(v))
                continue
            except ValueError:
                pass
        elif d is not dataclasses.MISSING and type(d) in (int, float, bool, str) and not isinstance(v, type(d)):
            raise ValueError(f"config key {f.name!r} should be a {type(d).__name__}, got {v!r}")
    return finalize(cfg)


def finalize(cfg: Config) -> Config:
    """Derived values and the batch algebra, with messages that say what to change."""
    import algos

    def need(ok: bool, msg: str):
        if not ok:
            raise ValueError(msg)

    if cfg.device == "auto":
        try:
            import torch
            cfg.device = "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:
            cfg.device = "cpu"
    need(cfg.device in ("cpu", "cuda"), f"device={cfg.device!r}: choose 'auto', 'cpu' or 'cuda'")
    if cfg.engine == "auto":
        cfg.engine = "sglang" if cfg.device == "cuda" else "cpu"
    need(cfg.engine in ("sglang", "cpu"), f"engine={cfg.engine!r}: choose 'sglang', 'cpu' or 'auto'")
    need(cfg.engine != "sglang" or cfg.device == "cuda", "engine=sglang runs on CUDA only; set device=cuda or engine=cpu")
    need(cfg.mode in ("sync", "async"), f"mode={cfg.mode!r}: choose 'sync' or 'async'")
    need(cfg.dtype in ("float32", "bfloat16"), f"dtype={cfg.dtype!r}: choose 'float32' or 'bfloat16'")
    need(cfg.pipeline_parallel == 1, f"pipeline_parallel={cfg.pipeline_parallel}: the trainer runs tensor and data "
         "parallelism only for now; set pipeline_parallel=1 and use tensor_parallel/trainer_workers")
    need(cfg.expert_parallel == 1, f"expert_parallel={cfg.expert_parallel}: MoE weights cannot yet be exported "
         "from several expert ranks to the engines; set expert_parallel=1 (MoE models train with TP/DP)")
    mp = cfg.tensor_parallel * cfg.pipeline_parallel
    need(cfg.trainer_workers % mp == 0, f"trainer_workers={cfg.trainer_workers} is not a multiple of "
         f"tensor_parallel*pipeline_parallel={mp}; use {mp * max(1, cfg.trainer_workers // mp)}")
    cfg.data_parallel = cfg.trainer_workers // mp
    n, dp = cfg.samples_per_prompt, cfg.data_parallel
    rollout = cfg.prompts_per_step * n
    need(cfg.global_batch_size % n == 0, f"global_batch_size={cfg.global_batch_size} must hold whole groups: "
         f"make it a multiple of samples_per_prompt={n}")
    need(rollout % cfg.global_batch_size == 0, f"prompts_per_step*samples_per_prompt={rollout} must be a multiple "
         f"of global_batch_size={cfg.global_batch_size}; e.g. global_batch_size={rollout}")
    need((cfg.global_batch_size // n) % dp == 0, f"each mini-batch has {cfg.global_batch_size // n} groups, which "
         f"must split evenly over data_parallel={dp} ranks (groups stay on one rank); change global_batch_size")
    per_rank = cfg.global_batch_size // dp
    need(per_rank % cfg.micro_batch_size == 0, f"global_batch_size/data_parallel={per_rank} samples per rank must be "
         f"a multiple of micro_batch_size={cfg.micro_batch_size}; try micro_batch_size={math.gcd(per_rank, cfg.micro_batch_size)}")
    need(cfg.max_staleness >= 1, f"max_staleness={cfg.max_staleness} must be >= 1")
    need(not (cfg.train_only and not cfg.load_rollouts), "train_only needs load_rollouts=<dir written by dump_rollouts>")
    for name in ("reward", "warmstart_example") + (("agent",) if cfg.agent else ()):
        data.import_object(getattr(cfg, name))  # fail now, not after the model is built
    algos.validate(cfg)
    check_teachers(cfg)
    return cfg


TEACHER_BUILD_KEYS = ("tiny_model", "warmstart_steps", "warmstart_dataset", "warmstart_batch_size", "warmstart_lr",
                      "warmstart_label_noise", "warmstart_example", "seed")
SOURCE_KEYS = ("name", "dataset", "weight", "eval_dataset", "reward", "agent", "teacher")


def _teacher_spec(name: str, spec) -> dict:
    """A `teachers:` entry as {"path": ..., build overrides...}, checked."""
    spec = {"path": spec} if isinstance(spec, str) else spec
    if not isinstance(spec, dict) or "path" not in spec:
        raise ValueError(f"teachers.{name}={spec!r}: give an HF directory, or {{path: tiny, warmstart_dataset: ...}}")
    for key in spec:
        if key != "path" and key not in TEACHER_BUILD_KEYS:
            raise ValueError(f"teachers.{name}.{key} is not a teacher setting{_closest(key, ('path',) + TEACHER_BUILD_KEYS)}")
    if spec["path"] != "tiny" and len(spec) > 1:
        raise ValueError(f"teachers.{name}: build settings {sorted(set(spec) - {'path'})} apply to path: tiny only")
    return spec


def _vocab_of(path: str, tiny_model: dict) -> tuple | None:
    """What must match between student and teacher: (vocab_size, tokenizer vocab hash), or the tiny
    builder's tokenizer settings; None where it cannot be known before anything is built."""
    if path == "tiny":
        s = {**data.TINY_DEFAULTS, **tiny_model}
        return ("tiny", s["tokenizer_vocab"], s["vocab_multiple"])
    cfg_file = Path(path) / "config.json"
    if not cfg_file.exists():
        return None
    tok = Path(path) / "tokenizer.json"
    return (json.loads(cfg_file.read_text()).get("vocab_size"),
            data.settings_hash(tok.read_text()) if tok.exists() else None)


def check_teacher_vocab(student_path: str, teacher_paths: dict[str, str], student_tiny: dict | None = None,
                        teacher_tiny: dict | None = None) -> None:
    """Every teacher must share the student's vocabulary. Compared like with like: two built/HF dirs by
    vocab_size and tokenizer.json, two `tiny` specs by their tokenizer settings; a tiny spec against an HF
    dir is compared again in train(), once the tiny model is built."""
    student = _vocab_of(student_path, student_tiny or {})
    for n, path in teacher_paths.items():
        theirs = _vocab_of(path, (teacher_tiny or {}).get(n, student_tiny or {}))
        if student is None or theirs is None or (student[0] == "tiny") != (theirs[0] == "tiny"):
            continue
        if student != theirs:
            raise ValueError(f"teacher {n!r} ({path}) has another vocabulary than the student ({student_path}): "
                             f"{theirs} vs {student}. Distillation compares distributions token by token: give "
                             "teachers that share the student's tokenizer")


def check_teachers(cfg: Config) -> None:
    """Teachers, routing and data sources: meaningless combinations fail here, at --check."""
    def need(ok: bool, msg: str):
        if not ok:
            raise ValueError(msg)

    names = list(cfg.teachers)
    specs = {n: _teacher_spec(n, s) for n, s in cfg.teachers.items()}
    need(not names or cfg.pg_ratio > 0 or cfg.gkd_ratio > 0, f"teachers {names} are set but pg_ratio=0 and "
         "gkd_ratio=0, so they would teach nothing; set pg_ratio > 0 (PG-style) and/or gkd_ratio > 0 (GKD)")
    need(names or (cfg.pg_ratio == 0 and cfg.gkd_ratio == 0), f"pg_ratio={cfg.pg_ratio} / gkd_ratio={cfg.gkd_ratio} "
         "distil from teachers, but `teachers:` is empty; add teachers or set both to 0")
    need(cfg.teacher_placement in ("own", "trainer"), f"teacher_placement={cfg.teacher_placement!r}: choose 'own' or 'trainer'")
    need(cfg.teacher_placement == "own" or cfg.device == "cpu", "teacher_placement='trainer' time-shares CPU bundles "
         "only for now; on CUDA use teacher_placement='own' (the teachers' own GPUs)")
    need(cfg.teacher_placement == "own" or cfg.teacher_tp <= cfg.trainer_workers, f"teacher_placement='trainer' "
         f"puts teacher_tp={cfg.teacher_tp} ranks on {cfg.trainer_workers} trainer bundles; lower teacher_tp")
    need(cfg.teacher_tp >= 1 and cfg.teacher_topk >= 1 and cfg.teacher_micro_batch >= 1,
         f"teacher_tp={cfg.teacher_tp}, teacher_topk={cfg.teacher_topk}, teacher_micro_batch={cfg.teacher_micro_batch} must be >= 1")
    if cfg.teacher_route:
        need(bool(names), f"teacher_route={cfg.teacher_route!r} without teachers; add `teachers:`")
        data.import_object(cfg.teacher_route)
    check_teacher_vocab(cfg.model_path, {n: spec["path"] for n, spec in specs.items()},
                        cfg.tiny_model, {n: spec.get("tiny_model", cfg.tiny_model) for n, spec in specs.items()})

    def check_teacher_ref(ref, where: str):
        for t in ([ref] if isinstance(ref, str) else list(dict(ref))):
            need(t in names, f"{where} names teacher {t!r}, which is not in teachers: {names}{_closest(str(t), names)}")

    seen = set()
    for i, src in enumerate(cfg.data_sources):
        need(isinstance(src, dict) and "name" in src and "dataset" in src,
             f"data_sources[{i}]={src!r} needs at least name and dataset")
        for key in src:
            need(key in SOURCE_KEYS, f"data_sources[{i}].{key} is not a source key{_closest(key, SOURCE_KEYS)}")
        need(src["name"] not in seen, f"data_sources: the name {src['name']!r} is used twice")
        seen.add(src["name"])
        need(float(src.get("weight", 1.0)) > 0, f"data_sources {src['name']!r}: weight={src.get('weight')} must be > 0")
        for key in ("reward", "agent"):
            if src.get(key):
                data.import_object(src[key])
        if src.get("teacher") is not None:
            need(bool(names), f"data source {src['name']!r} names teacher {src['teacher']!r} but `teachers:` is empty")
            check_teacher_ref(src["teacher"], f"data source {src['name']!r}")
        elif len(names) > 1 and not cfg.teacher_route:
            raise ValueError(f"data source {src['name']!r} has no teacher, and there are {len(names)} teachers "
                             f"{names}; set its `teacher:` (a name or {{name: weight}}), or set teacher_route")


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
                                 f"in teachers: {names}{_closest(str(t), names)}")
        if ref is None and len(names) > 1 and not cfg.teacher_route:
            raise ValueError(f"a sample of {s.get('source') or cfg.dataset!r} has no teacher and there are "
                             f"{len(names)} teachers {names}; add a `teacher` field, a source teacher or teacher_route")
    return samples, evals


def describe(cfg: Config) -> str:
    """The derived sizes, in one line."""
    rollout = cfg.prompts_per_step * cfg.samples_per_prompt
    return (f"data_parallel={cfg.data_parallel}, rollout batch={rollout} samples, {rollout // cfg.global_batch_size} "
            f"optimizer step(s) per RL step, {cfg.global_batch_size // cfg.data_parallel // cfg.micro_batch_size} "
            f"micro-batch(es) per rank per optimizer step, device={cfg.device}, engine={cfg.engine}")


def check_runtime(cfg: Config) -> None:
    """What only this machine can say: the device exists, the model and data are there."""
    if cfg.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise ValueError("device=cuda but no CUDA device is visible; run on a GPU machine or set device=cpu engine=cpu")
    if cfg.model_path != "tiny" and not Path(cfg.model_path).is_dir():
        raise FileNotFoundError(f"model_path={cfg.model_path!r} is not a directory; give a local HF model directory "
                                "(config.json + safetensors + tokenizer) or model_path=tiny")
    for spec in (cfg.dataset, cfg.eval_dataset):
        if spec and not spec.startswith("synthetic:") and not Path(spec).exists():
            raise FileNotFoundError(f"dataset {spec!r} not found; give a .jsonl/.parquet path or 'synthetic:arith:<n>:<seed>'")


# ================================================================================================
# the tiny model: build, warm-start with SFT through the same trainer, cache


def prepare_model(cfg: Config, trainers) -> str:
    """Resolve cfg.model_path. For "tiny": build the random model, SFT it on `warmstart_dataset`
    with the Megatron trainers for `warmstart_steps`, save it as HF, and cache both by settings."""
    import ray
    if cfg.model_path != "tiny":
        return cfg.model_path
    base = data.build_tiny_model(data.default_cache_dir() / f"tiny-{data.settings_hash(cfg.tiny_model)}", **cfg.tiny_model)
    if cfg.warmstart_steps == 0:
        return base
    keys = ("tiny_model", "warmstart_steps", "warmstart_dataset", "warmstart_batch_size", "warmstart_lr",
            "warmstart_label_noise", "warmstart_example", "seed")
    out = data.default_cache_dir() / f"tiny-sft-{data.settings_hash({k: getattr(cfg, k) for k in keys})}"
    if (out / "model.safetensors").exists():
        print(f"warm start: cached SFT model {out}")
        return str(out)
    tok = data.load_tokenizer(base)
    example = data.import_object(cfg.warmstart_example)
    samples = data.load_dataset(cfg.warmstart_dataset)
    rng = random.Random(cfg.seed)
    ray.get([t.load_hf.remote(base, lr=cfg.warmstart_lr) for t in trainers])
    from tqdm import tqdm
    bar = tqdm(range(cfg.warmstart_steps), desc="warm start (SFT)", file=sys.stdout, mininterval=2)
    for step in bar:
        batch = [example(tok, s, rng, cfg.warmstart_label_noise)
                 for s in rng.sample(samples, cfg.warmstart_batch_size)]
        m = ray.get([t.sft_step.remote(batch) for t in trainers])[0]
        bar.set_postfix(loss=f"{m['train/sft_loss']:.3f}", refresh=False)
    tmp = out.with_name(out.name + ".tmp")
    ray.get([t.save_hf.remote(str(tmp)) for t in trainers])
    tmp.rename(out)
    return str(out)


# ================================================================================================
# Ray: placement and actors


def launch(cfg: Config):
    """Start Ray, reserve placement bundles (trainers' and engines'), create the trainer ranks.

    CPU: one {"CPU": n} bundle per trainer rank and per engine. GPU: one {"GPU": 1} bundle per
    trainer rank; engines get their own GPU bundles, or share the trainers' when `colocate`.
    """
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    import trainer

    gpu = cfg.device == "cuda"
    if not ray.is_initialized():
        if cfg.ray_address:
            ray.init(address=cfg.ray_address, log_to_driver=True)
        else:  # logical CPUs: actors are mostly waiting on each other; torch threads are set per actor
            need = cfg.trainer_workers * cfg.cpus_per_trainer + cfg.num_engines * cfg.cpus_per_engine + 1
            need += cfg.teacher_tp * cfg.cpus_per_teacher if cfg.teachers and cfg.teacher_placement == "own" else 0
            ray.init(num_cpus=max(int(math.ceil(need)), os.cpu_count() or 1), include_dashboard=False,
                     log_to_driver=True, runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    t_bundle = {"GPU": 1, "CPU": cfg.cpus_per_trainer} if gpu else {"CPU": cfg.cpus_per_trainer}
    e_bundle = {"GPU": cfg.gpus_per_engine, "CPU": cfg.cpus_per_engine} if gpu else {"CPU": cfg.cpus_per_engine}
    bundles = [dict(t_bundle) for _ in range(cfg.trainer_workers)]
    if not cfg.colocate:
        bundles += [dict(e_bundle) for _ in range(cfg.num_engines)]
    pg = placement_group(bundles, strategy="PACK")
    ray.get(pg.ready(), timeout=300)

    def on(i, **res):
        return dict(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i), **res)

    addr, port = ray.get(ray.remote(_addr_and_port).options(**on(0, num_cpus=0)).remote())
    share = 0.5 if cfg.colocate else 1.0  # colocated actors split their bundle
    TrainerActor = ray.remote(trainer.TrainerWorker)
    trainers = [TrainerActor.options(**on(r, num_cpus=cfg.cpus_per_trainer * share, num_gpus=share if gpu else 0))
                .remote(cfg, r, cfg.trainer_workers, addr, port) for r in range(cfg.trainer_workers)]
    return pg, trainers


def start_engines(cfg: Config, pg) -> list:
    """One RolloutEngine actor per engine, on its own bundle or (colocate) on a trainer's bundle."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    import rollout
    gpu, share = cfg.device == "cuda", (0.5 if cfg.colocate else 1.0)
    EngineActor = ray.remote(rollout.RolloutEngine)
    engines = []
    for i in range(cfg.num_engines):
        b = (i * cfg.trainer_workers // cfg.num_engines) if cfg.colocate else cfg.trainer_workers + i
        engines.append(EngineActor.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, b), num_cpus=cfg.cpus_per_engine * share,
            num_gpus=(cfg.gpus_per_engine * share) if gpu else 0).remote(cfg, i))
    return engines


def prepare_teachers(cfg: Config, trainers) -> dict[str, str]:
    """{teacher: HF dir}. A `path: tiny` teacher is built like the student (prepare_model, on the same
    trainers, cached by its settings) with its own warm-start data: that is how the tiny recipes train a
    teacher per sub-task."""
    paths = {}
    for name, spec in cfg.teachers.items():
        spec = _teacher_spec(name, spec)
        if spec["path"] == "tiny":
            over = {k: v for k, v in spec.items() if k != "path"}
            paths[name] = prepare_model(dataclasses.replace(cfg, model_path="tiny", **over), trainers)
        else:
            paths[name] = spec["path"]
    return paths


def start_teachers(cfg: Config, pg, paths: dict[str, str]) -> list:
    """The teacher group: `teacher_tp` TeacherWorker ranks in their own placement group ("own") or on the
    trainers' bundles ("trainer": they compute while the trainers wait), every teacher registered."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    import teacher
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
    import transfermesh
    import ray
    return ray.util.get_node_ip_address(), transfermesh.free_port()


# ================================================================================================
# logging: one flat dict per step -> stdout line, metrics.jsonl, TensorBoard; reward curve at the end


class Logger:
    def __init__(self, cfg: Config):
        self.dir = Path(cfg.output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(self.dir / "metrics.jsonl", "a")
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(self.dir / "tb"))
        except ImportError:  # tensorboard is optional
            self.tb = None
        self.history: list[dict] = []

    def log(self, step: int, metrics: dict):
        metrics = {"step": step, **{k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}}
        self.history.append(metrics)
        self.jsonl.write(json.dumps(metrics) + "\n")
        self.jsonl.flush()
        if self.tb:
            for k, v in metrics.items():
                if k != "step":
                    self.tb.add_scalar(k, v, step)

    def line(self, step: int, m: dict) -> str:
        keys = [("reward", "rollout/reward_mean"), ("eval", "eval/accuracy"), ("loss", "train/loss"),
                ("gap_k3", "train/gap_k3"), ("len", "rollout/response_len"), ("step_s", "timing/step"),
                ("tok/s", "perf/rollout_tokens_per_s")]
        return f"step {step:4d} | " + " | ".join(f"{k} {m[v]:.4g}" for k, v in keys if v in m)

    def plot(self) -> Path | None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
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


def rollout_metrics(trajs: list[dict]) -> dict:
    """`rollout/` metrics of one batch of trajectory dicts."""
    n = max(len(trajs), 1)
    gen = sum(sum(t["loss_mask"]) for t in trajs)
    versions = [v for t in trajs for v, m in zip(t["weight_versions"], t["loss_mask"]) if m]
    return {
        "rollout/reward_mean": sum(t["reward"] for t in trajs) / n,
        "rollout/response_len": sum(len(t["response_ids"]) for t in trajs) / n,
        "rollout/generated_tokens": gen,
        "rollout/failed_frac": sum(t["status"] == "failed" for t in trajs) / n,
        "rollout/truncated_frac": sum(t["status"] == "truncated" for t in trajs) / n,
        "rollout/weight_version_min": min(versions, default=-1),
        "rollout/weight_version_max": max(versions, default=-1),
        **{f"rollout/{src}/reward_mean": sum(t["reward"] for t in ts) / len(ts) for src, ts in _by_source(trajs).items()},
    }


def dump(trajs: list[dict], path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for t in trajs:
            f.write(json.dumps(t) + "\n")


# ================================================================================================
# the training loop


def batches(cfg: Config, samples: list[dict]):
    """Endless shuffled epochs of `prompts_per_step` samples."""
    rng = random.Random(cfg.seed)
    while True:
        order = list(range(len(samples)))
        rng.shuffle(order)
        for i in range(0, len(order) - cfg.prompts_per_step + 1, cfg.prompts_per_step):
            yield [samples[j] for j in order[i:i + cfg.prompts_per_step]]


def refill_informative_groups(cfg: Config, flow, trajs: list[dict], prompts, sampling: dict, step: int,
                              max_rounds: int = 4) -> tuple[list[dict], dict]:
    """Dynamic sampling (DAPO): drop groups whose rewards are all equal (their advantages are all 0)
    and sample more prompts until `prompts_per_step` informative groups are kept, at most `max_rounds`
    extra rounds; then train on what was kept (possibly fewer groups, never more)."""
    import algos
    import ray

    def groups(ts):
        by: dict[int, list[dict]] = {}
        for t in ts:
            by.setdefault(t["group_id"], []).append(t)
        return list(by.values())

    kept, seen, rounds = [], 0, 0
    pending = groups(trajs)
    while True:
        keep, stats = algos.filter_groups([[t["reward"] for t in g] for g in pending])
        seen += stats["groups"]
        kept += [g for g, k in zip(pending, keep.tolist()) if k]
        more = algos.groups_to_request(len(kept), cfg.prompts_per_step, len(kept) / max(seen, 1))
        if more == 0 or rounds == max_rounds:
            break
        rounds += 1
        batch = [s for _ in range(math.ceil(more / cfg.prompts_per_step)) for s in next(prompts)][:more]
        pending = groups(ray.get(flow.generate.remote(batch, cfg.samples_per_prompt, sampling, step)))
    kept = kept[:cfg.prompts_per_step]
    return [t for g in kept for t in g], {"rollout/groups_kept": len(kept), "rollout/groups_sampled": seen,
                                          "rollout/refill_rounds": rounds}


def evaluate(cfg: Config, flow, eval_samples: list[dict], step: int) -> dict:
    import ray
    sampling = dict(temperature=cfg.eval_temperature, top_p=1.0, top_k=-1, max_new_tokens=cfg.max_new_tokens)
    trajs = ray.get(flow.generate.remote(eval_samples, cfg.eval_samples, sampling, step))
    out = {"eval/accuracy": sum(t["reward"] for t in trajs) / max(len(trajs), 1),
           "eval/response_len": sum(len(t["response_ids"]) for t in trajs) / max(len(trajs), 1)}
    for src, ts in _by_source(trajs).items():  # data_sources: one accuracy per source's eval set
        out[f"eval/{src}/accuracy"] = sum(t["reward"] for t in ts) / len(ts)
    return out


def _by_source(trajs: list[dict]) -> dict[str, list[dict]]:
    by: dict[str, list[dict]] = {}
    for t in trajs:
        src = (t.get("metadata") or {}).get("source")
        if src is not None:
            by.setdefault(src, []).append(t)
    return by


def mixed_batches(cfg: Config, samples: list[dict]):
    """data_sources: endless batches of `prompts_per_step` samples mixed by source weight. Each source is
    its own shuffled epoch stream; a step takes floor(share) from each and the remainder goes to the
    sources with the largest carried-over fraction, so over steps every source gets its exact share."""
    weights = {s["name"]: float(s.get("weight", 1.0)) for s in cfg.data_sources}
    total = sum(weights.values())
    streams, carry = {}, {n: 0.0 for n in weights}
    for i, name in enumerate(weights):
        pool = [s for s in samples if s["source"] == name]
        streams[name] = batches(dataclasses.replace(cfg, prompts_per_step=1, seed=cfg.seed + i), pool)
    while True:
        want = {n: cfg.prompts_per_step * w / total + carry[n] for n, w in weights.items()}
        take = {n: int(math.floor(v)) for n, v in want.items()}
        for n in sorted(want, key=lambda n: want[n] - take[n], reverse=True)[:cfg.prompts_per_step - sum(take.values())]:
            take[n] += 1
        carry = {n: want[n] - take[n] for n in want}
        yield [next(streams[n])[0] for n in weights for _ in range(take[n])]


def evaluate_teachers(cfg: Config, trainers, flow, engine_urls, paths: dict[str, str], eval_samples) -> dict:
    """`teacher/<name>/<source>/accuracy` (and `teacher/<name>/accuracy`): each teacher of the student's
    architecture is loaded into the trainers, pushed to the engines and evaluated like the student; then
    the student's weights go back (version 0). Other architectures cannot be served by the student's
    engines and are skipped."""
    import ray

    import trainer
    import teacher
    mine = teacher.arch_key(trainer.read_hf_config(cfg.model_path))
    out = {}
    for name, path in paths.items():
        if teacher.arch_key(trainer.read_hf_config(path)) != mine:
            print(f"teacher {name}: another architecture than the student, not evaluated")
            continue
        ray.get([t.load_hf.remote(path) for t in trainers])
        ray.get([t.sync_weights.remote(engine_urls, -1) for t in trainers])
        m = evaluate(cfg, flow, eval_samples, 0)
        out.update({f"teacher/{name}/{k[len('eval/'):]}": v for k, v in m.items() if k.endswith("accuracy")})
    ray.get([t.load_hf.remote(cfg.model_path) for t in trainers])
    ray.get([t.sync_weights.remote(engine_urls, 0) for t in trainers])
    return out


def train(cfg: Config) -> list[dict]:
    """The whole system: launch actors, then generate -> reward -> train -> sync -> eval -> checkpoint."""
    import ray
    from tqdm import tqdm

    check_runtime(cfg)
    print("config:\n" + yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    print(f"derived: {describe(cfg)}")
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    logger = Logger(cfg)

    samples, eval_samples = load_data(cfg)  # before any actor: a bad teacher name in the data fails here

    # --- actors: trainers first (they also warm-start the tiny model and build tiny teachers), then engines
    import agentflow
    pg, trainers = launch(cfg)
    teacher_paths = prepare_teachers(cfg, trainers) if cfg.teachers else {}
    cfg.model_path = prepare_model(cfg, trainers)
    check_teacher_vocab(cfg.model_path, teacher_paths)  # the built dirs, before any teacher starts
    ray.get([t.load_hf.remote(cfg.model_path) for t in trainers])
    engines = start_engines(cfg, pg)  # they load cfg.model_path: weight version 0 == the trainers' weights
    engine_urls = ray.get([e.url.remote() for e in engines])
    flow = ray.remote(agentflow.AgentFlow).options(num_cpus=0).remote(cfg, engine_urls, cfg.model_path)
    print(f"engines: {engine_urls}")
    teachers = start_teachers(cfg, pg, teacher_paths) if cfg.teachers else []  # teacher.py, scores each batch
    if teachers and float(cfg.gkd_ratio) > 0 and cfg.distill_type != "topk_kl":  # hidden-state targets
        heads = teachers[0].lm_heads.remote()  # the teachers' LM heads, sent to the trainers once
        ray.get([t.set_teacher_heads.remote(heads) for t in trainers])

    start_step = 0
    ckpt_root = out / "checkpoints"
    if cfg.resume and ckpt_root.exists() and any(ckpt_root.iterdir()):
        latest = max(ckpt_root.iterdir(), key=lambda p: int(p.name.split("_")[-1]))
        ray.get([t.load_checkpoint.remote(str(latest)) for t in trainers])
        start_step = int(latest.name.split("_")[-1]) + 1
        ray.get([t.sync_weights.remote(engine_urls, start_step) for t in trainers])
        print(f"resumed from {latest} at step {start_step}")

    prompts = mixed_batches(cfg, samples) if cfg.data_sources else batches(cfg, samples)
    for _ in range(start_step):  # keep the data order of an uninterrupted run
        next(prompts)
    sampling = dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, max_new_tokens=cfg.max_new_tokens)

    if cfg.teacher_eval and teachers and eval_samples and start_step == 0:
        m = evaluate_teachers(cfg, trainers, flow, engine_urls, teacher_paths, eval_samples)
        logger.log(0, m)
        print("teachers' eval accuracy: " + ", ".join(f"{k} {v:.3f}" for k, v in m.items()))
    if cfg.eval_every and eval_samples:
        m = evaluate(cfg, flow, eval_samples, start_step)
        logger.log(start_step, m)
        print(f"eval before training: accuracy {m['eval/accuracy']:.3f}")

    in_flight: deque = deque()  # ObjectRefs of rollout batches being generated (async: the window)
    bar = tqdm(range(start_step, cfg.num_steps), desc="RL", file=sys.stdout, mininterval=5)
    for step in bar:
        t_step = time.perf_counter()
        metrics: dict = {}

        # --- 1. generate (+ reward, inside AgentFlow). Async keeps `max_staleness` batches in flight, so
        #        the next batches sample while this one trains; sync waits for the one it just asked for.
        t0 = time.perf_counter()
        if cfg.train_only:
            trajs = [json.loads(line) for line in open(Path(cfg.load_rollouts) / f"step_{step:05d}.jsonl")]
        else:
            window = cfg.max_staleness if cfg.mode == "async" else 1
            while len(in_flight) < window:
                in_flight.append(flow.generate.remote(next(prompts), cfg.samples_per_prompt, sampling, step))
            trajs = ray.get(in_flight.popleft())
            if cfg.mode == "async" and step + 1 < cfg.num_steps:  # refill now: overlaps with training below
                in_flight.append(flow.generate.remote(next(prompts), cfg.samples_per_prompt, sampling, step + 1))
            if cfg.dynamic_sampling:
                trajs, ds = refill_informative_groups(cfg, flow, trajs, prompts, sampling, step)
                metrics.update(ds)
        metrics["timing/generate"] = time.perf_counter() - t0
        metrics.update(rollout_metrics(trajs))
        metrics["perf/rollout_tokens_per_s"] = metrics["rollout/generated_tokens"] / max(metrics["timing/generate"], 1e-9)
        if cfg.dump_rollouts:
            dump(trajs, Path(cfg.dump_rollouts) / f"step_{step:05d}.jsonl")
        if cfg.print_every and step % cfg.print_every == 0 and trajs:
            t = trajs[0]
            bar.write(f"[sample step {step}] reward={t['reward']} status={t['status']}\n"
                      f"  {t.get('prompt_text', '')!r} -> {t.get('response_text', '')!r}")

        if not trajs:  # every group failed, was aborted or was filtered out: nothing to learn from
            bar.write(f"step {step}: no trajectories to train on; skipping the update")
        if not cfg.rollout_only and trajs:
            # --- 2. old/ref logprobs, advantages, policy update (all inside the trainers; one call per rank)
            t0 = time.perf_counter()
            batch_ref = ray.put(trajs)
            # TEACHERS (teacher.py): every teacher rank scores, rank 0's per-token targets go to the trainers
            # by ref (never through the controller); the metrics get is the blocking point of this phase.
            targets_ref = None
            if teachers:
                refs = [t.score.options(num_returns=2).remote(batch_ref) for t in teachers]
                targets_ref = refs[0][0]
                metrics.update(ray.get(refs[0][1]))
                metrics["timing/teacher"] = time.perf_counter() - t0
                t0 = time.perf_counter()
            results = ray.get([t.train_step.remote(batch_ref, step, targets_ref) for t in trainers])
            metrics.update(results[0])  # already reduced over DP ranks
            metrics["timing/train"] = time.perf_counter() - t0

            # --- 3. weights -> engines (TransferMesh); engines then report version step + 1
            t0 = time.perf_counter()
            sync = ray.get([t.sync_weights.remote(engine_urls, step + 1) for t in trainers])
            metrics.update(sync[0])
            metrics["timing/sync"] = time.perf_counter() - t0

        # --- 4. eval
        last = step == cfg.num_steps - 1
        if cfg.eval_every and eval_samples and ((step + 1) % cfg.eval_every == 0 or last):
            t0 = time.perf_counter()
            metrics.update(evaluate(cfg, flow, eval_samples, step + 1))
            metrics["timing/eval"] = time.perf_counter() - t0

        # --- 5. checkpoint
        if cfg.save_every and not cfg.rollout_only and ((step + 1) % cfg.save_every == 0 or last):
            path = ckpt_root / f"step_{step:05d}"
            ray.get([t.save_checkpoint.remote(str(path)) for t in trainers])
            (path / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))

        metrics["timing/step"] = time.perf_counter() - t_step
        logger.log(step, metrics)
        bar.write(logger.line(step, metrics))

    # --- end: drain the async window, export HF weights, plot
    for ref in in_flight:
        ray.cancel(ref)
    if not cfg.rollout_only:
        ray.get([t.save_hf.remote(str(out / "final_hf")) for t in trainers])
        print(f"final HF checkpoint: {out / 'final_hf'}")
    png = logger.plot()
    print(f"reward curve: {png}\nmetrics: {out / 'metrics.jsonl'}")
    logger.close()
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
        print(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False) + f"config OK: {describe(cfg)}")
        return 0
    try:
        train(cfg)
    except Exception:  # noqa: BLE001  an actor's traceback arrives here inside the RayTaskError
        print("run failed:\n" + traceback.format_exc(), file=sys.stderr)
        return 1
    finally:
        import ray
        if ray.is_initialized():
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
