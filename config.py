"""What a run is configured to do, and whether that is valid: the `Config` dataclass (every field commented, in
`# --- section ---` groups), `load_config` (a recipe YAML + `key=value` overrides), `finalize` (derived values and
the batch algebra) and the rules that reject meaningless combinations before any actor starts (`check_critic`,
`check_teachers`, `check_teacher_vocab`, `check_judge`, `check_fast_paths`, `check_lora`, `algos.validate`),
`check_runtime` (what only this machine can say), and what `python loongsage.py RECIPE --check` prints (`explain`,
`describe`, `fast_paths`).

Every error names what was wrong, the value seen and what to change; a misspelt key names the closest valid one.
Nothing here starts Ray or builds a model: `--check` runs this file (and fleet.placement, convert.layer_spec)
only.

Test: `.venv/bin/pytest tests/test_loongsage.py -k "closest or typed or algebra or missing or validation or exit_codes"`
(config errors, overrides, the batch algebra, --check, in seconds);
the rules' own tests sit beside their subjects (tests/test_teacher.py, test_critic.py, test_pipeline.py, test_moe.py).
Left out: config files that include other files, and environment-variable overrides: one YAML plus the command
line says everything a run did (the run saves it as output_dir/config.yaml).
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import math
import string
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

import algos
import chat
import convert
import cpu
import data
import lora
import sandbox
import transfermesh

LAYER_SPECS = ("auto", "te", "local")  # Config.layer_spec
RECOMPUTE = ("none", "selective", "full")  # Config.recompute
# TransformerConfig fields LoongSage sets from its own Config fields, which it acts on beyond Megatron (placement,
# batch algebra, padding, rules): a `megatron:` pass-through of one would silently disagree, so it is refused
MEGATRON_OWNED = {"tensor_model_parallel_size": "tensor_parallel", "pipeline_model_parallel_size": "pipeline_parallel",
                  "expert_model_parallel_size": "expert_parallel", "context_parallel_size": "context_parallel",
                  "sequence_parallel": "sequence_parallel", "recompute_granularity": "recompute"}
SEGMENT_LABELS = ("main", "side", "compaction", "count_tokens")  # what a router request is (agentflow.Router._admit)
WINDOWS = ("no-window", "window-gated", "windowed-fifo")  # the built-in async windows (loongsage.groups_to_dispatch)
TRACKERS = {"wandb": "wandb", "mlflow": "mlflow"}  # tracker name -> the optional package it needs
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "deepseek_v3")  # HF model types with routers (R3, expert parallelism)
TEACHER_BUILD_KEYS = ("tiny_model", "warmstart_steps", "warmstart_dataset", "warmstart_batch_size", "warmstart_lr",
                      "warmstart_label_noise", "warmstart_example", "warmstart_stop_loss", "seed")
SOURCE_KEYS = ("name", "dataset", "weight", "eval_dataset", "reward", "agent", "teacher")
JUDGE_KEYS = ("model_path", "url", "prompt_template", "parse", "max_new_tokens", "timeout", "max_context_len")
JUDGE_FIELDS = ("prompt", "response", "answer")  # what a judge prompt_template may name (data.judge_prompt)


@dataclass
class Config:
    """One run: every knob, its default, and what it does. A recipe YAML sets some, `key=value` overrides others,
    `finalize` derives the rest once (fields marked "derived"); train() reads it and never writes it."""

    # --- run ---
    recipe: str = ""  # the YAML this config came from (set by load_config)
    output_dir: str = "runs/default"  # metrics.jsonl, TensorBoard, reward curve, checkpoints, final HF model
    seed: int = 1234  # seeds data order, sampling and init
    num_steps: int = 20  # RL steps (one rollout batch and one policy update each)
    mode: str = "sync"  # "sync" (generate, train, sync in turn) or "async" (a producer generates while it trains)
    stale_steps: float = 1.0  # async: capacity C = prompts_per_step*(1+stale_steps) groups in flight or buffered
    # (fractions allowed); mode=sync is stale_steps=0: C = one step's groups, dispatched after each sync. It also
    # sets AgentFlow's engine batching (agentflow.AgentFlow._session_args): > 0, each group is an engine batch,
    # returned as it finishes; 0, a loop tick's rows go together, so the engine's batches (and a run's bits) repeat
    window: str = "window-gated"  # async dispatch/collect rule: no-window | window-gated | windowed-fifo (see
    # loongsage.groups_to_dispatch), or a dotted path to an object with groups_to_dispatch(C, R, Q, next_seq,
    # oldest_uncollected) and collectable(finished, min_unfinished, oldest_uncollected, B, C), the built-ins'
    # signatures without `window`
    max_version_lag: int = -1  # hard bound: no trained token older than this many weight versions; -1 = no bound
    lag_policy: str = "mask"  # a group over the bound: "mask" its too-old tokens, or "regenerate" it (once)
    eval_every: int = 5  # evaluate every N steps (and before step 0 and after the last); 0 = never
    save_every: int = 0  # Megatron checkpoint every N steps; 0 = only the final HF export
    resume: bool | str = False  # true: go on from the checkpoint output_dir/checkpoints/latest names; "previous":
    # from the complete one before it (when latest fails its checksums: docs/RELIABILITY.md)
    on_save_error: str = "stop"  # a checkpoint that cannot be written (disk full; the partial one is removed):
    # "stop" the run with the error, or "skip" that checkpoint and train on (the next save_every tries again)
    print_every: int = 5  # print a decoded sample every N steps; 0 = never
    trackers: list = field(default_factory=list)  # metric sinks beside JSONL/TensorBoard/PNG: "wandb", "mlflow"
    tracker_project: str = "loongsage"  # the W&B project / MLflow experiment; the run is named after output_dir
    mlflow_tracking_uri: str = ""  # MLflow store (a server URL, ...); "" = a local file store, output_dir/mlruns
    device: str = "auto"  # "auto" | "cpu" | "cuda"; resolved in finalize
    dtype: str = "float32"  # training/inference dtype: "float32" | "bfloat16"
    rollout_only: bool = False  # debug: only generate (and dump), never train
    train_only: bool = False  # debug: train on `load_rollouts` instead of generating
    dump_rollouts: str = ""  # directory: write every step's trajectories as jsonl
    load_rollouts: str = ""  # directory written by dump_rollouts, replayed by train_only

    # --- cluster ---
    ray_address: str = ""  # "" starts a local Ray; else an existing cluster ("auto" or host:port)
    trainer_workers: int = 1  # trainer ranks = tensor_parallel * pipeline_parallel * context_parallel * data_parallel
    tensor_parallel: int = 1  # Megatron TP size
    pipeline_parallel: int = 1  # Megatron PP size: each stage a contiguous share of the layers (divides their number)
    context_parallel: int = 1  # Megatron CP size: each trajectory's tokens split over this many ranks (2*CP causal
    # chunks, rank r holding chunks r and 2*CP-1-r so each does equal attention work); for long trajectories. CUDA
    # with the TE layer spec only (TE's attention passes K/V between the ranks; Megatron's local attention cannot)
    expert_parallel: int = 1  # Megatron EP size (MoE models): each rank holds num_experts / EP experts; divides
    # trainer_workers / (tensor_parallel * pipeline_parallel)
    data_parallel: int = 1  # derived: trainer_workers // (tensor_parallel * pipeline_parallel * context_parallel)
    num_engines: int = 1  # rollout engines (each one SGLang server or CPU engine)
    colocate: bool = False  # engines on the trainers' bundles (GPUs) hand memory over: generation waits as they train
    cpus_per_trainer: float = 1.0  # Ray CPU resources per trainer rank
    cpus_per_engine: float = 1.0  # Ray CPU resources per engine
    trainer_threads: int = 0  # torch threads per trainer rank; 0 = derive (async: its Ray CPUs; sync: a node share)
    engine_threads: int = 0  # torch threads per CPU engine; 0 = derive (likewise)
    borrow_engine_cores: bool = True  # async on a local CPU node: a trainer rank also computes on an engine's cores
    # while that engine has nothing to generate (a shared-memory flag per engine, read at every transformer layer)
    gpus_per_engine: int = 1  # GPUs per SGLang engine (its tensor parallel size); CUDA only

    # --- model ---
    model_path: str = "tiny"  # HF directory, or "tiny" to build (and cache) the tiny Qwen3 of data.py
    tiny_model: dict = field(default_factory=dict)  # settings for data.build_tiny_model (model_path: tiny)
    megatron: dict = field(default_factory=dict)  # passed through to Megatron's TransformerConfig untouched
    sglang: dict = field(default_factory=dict)  # passed through to the SGLang server as --key value flags
    vllm: dict = field(default_factory=dict)  # engine=vllm: passed through to the vLLM server as --key value flags
    vllm_kv_cache_gb: int = 1  # engine=vllm: VLLM_CPU_KVCACHE_SPACE (GiB), its K/V cache (else 90% of RAM)
    fp32_lm_head: bool = False  # LM head (logits) in fp32 on trainer and engines (SGLang --enable-fp32-lm-head)

    # --- Megatron-Core fast paths (convert.megatron_config, trainer.Optim; check_fast_paths; --check says which are on)
    layer_spec: str = "auto"  # "auto": Transformer Engine's layer spec (fused norm+linear, flash attention) where a
    # CUDA trainer can import transformer_engine, Megatron's local spec elsewhere | "te": TE or fail | "local"
    use_distributed_optimizer: bool = False  # Megatron's DistributedOptimizer: Adam's moments and the fp32 master
    # weights sharded over data-parallel ranks (grads reduce-scattered, weights all-gathered); CUDA only
    sequence_parallel: bool = False  # with tensor_parallel > 1: norms and residuals hold T/tp of the sequence per
    # rank (activation memory / tp); on CUDA needs the TE spec (Megatron's torch norms refuse it; on CPU shimmed)
    recompute: str = "none"  # activation recomputation in the backward: "none" | "selective" (core attention) |
    # "full" (each layer from its input; megatron.recompute_method / recompute_num_layers refine it: uniform, 1)

    # --- warm start (SFT through the same trainer, before RL; of the tiny model or any HF directory; cached) ---
    warmstart_steps: int = 0  # SFT optimizer steps; 0 = none
    warmstart_dataset: str = "synthetic:arith:4096:7"  # data.load_dataset spec of the SFT data
    warmstart_batch_size: int = 64  # samples per SFT step
    warmstart_lr: float = 1e-3  # SFT learning rate (constant)
    warmstart_label_noise: float = 0.0  # fraction of SFT answers replaced by a near-miss (see data.sft_trajectory)
    warmstart_example: str = "data.sft_trajectory"  # fn(tokenizer, sample, rng, label_noise) -> trajectory dict
    warmstart_stop_loss: float = 0.0  # stop SFT once its loss averaged over the last 20 steps is below this; then
    #                                   warmstart_steps is a cap (0 = run all warmstart_steps)

    # --- data ---
    dataset: str = "synthetic:arith:4096:1"  # training prompts (data.load_dataset spec)
    eval_dataset: str = "synthetic:arith:128:2"  # eval prompts (metrics eval/accuracy, eval/pass@k, ...)
    eval_sets: dict = field(default_factory=dict)  # more eval sets at once: {name: spec} -> eval/<name>/accuracy, ...
    reward: str = "data.exact_match"  # reward(response_text, sample) -> float, dotted path; "judge": the `judge`
    # model's parsed verdict (agentflow.AgentFlow._judge)
    judge: dict = field(default_factory=dict)  # the model of `reward: judge` (check_judge): {model_path: HF dir (its
    # tokenizer renders the prompt; served by its own engine unless url is given), url: a running server speaking
    # SGLang's /generate, prompt_template: text with {prompt} {response} {answer}, parse: dotted fn(text) -> float or a
    # regex whose first group (or match) is the number, max_new_tokens: 16, timeout: 60 s per group's batch,
    # max_context_len: the judge engine's token budget, 2 * max_context_len}
    agent: str = ""  # dotted path of an agent; "" = single-turn chat straight to the engine
    agent_command: str = ""  # black-box agent: a shell command run in a sandbox against the session URL
    sandbox: str = "local"  # "local" | "docker" | "auto" (docker where a Docker engine answers) | a dotted path to
    # fn(**limits) -> a sandbox with LocalSandbox's methods (create, write, execute, delete)
    max_parallel_sandboxes: int = 32  # black-box agents / code-test rewards running at once
    agent_preload: list = field(default_factory=list)  # modules a Python agent_command imports (e.g. [openai]):
    # each trajectory forks from one interpreter that imported them, not a new Python (sandbox: local only)
    strict_fields: bool = False  # router: refuse every request field wire.py does not know (default: accept, count
    #                              and record the unknown ones, refusing only near-misses of sampling fields)
    train_labels: list = field(default_factory=lambda: ["main"])  # which of an agent's requests train, by the label
    # the router gives their segments (SEGMENT_LABELS): main (the agent's loop), side (calls naming its small/fast
    # model agentflow.SIDE_MODEL, as recipes/agents.py sets it), compaction (Codex's), count_tokens (a prompt only);
    # segments of the other labels stay in the trajectory with loss mask 0
    first_turn_constraint: dict = field(default_factory=dict)  # one SGLang grammar parameter (regex, ebnf,
    # json_schema or structural_tag: a string) holding the first turn that offers tools, e.g. to one call of a
    # program's shell tool by a model that cannot call it yet; recorded in metadata.constraint
    router_host: str = "127.0.0.1"  # where the AgentFlow router listens (0.0.0.0 for agents on other machines)
    max_turns: int = 8  # agent turns per trajectory
    agent_timeout: float = 120.0  # seconds per trajectory
    agent_retries: int = 1  # retries of a failed trajectory
    max_context_len: int = 1024  # token budget per trajectory (prompt + all turns); also the length of each CPU
    # engine KV slot (rollout.RolloutEngine): with engine_max_batch it sizes the cache the engine preallocates
    chat_template: str = ""  # dotted path to a Jinja chat template string (router, fast path); "" = the tokenizer's
    # (chat.QWEN3_KEEP_THINKING_TEMPLATE: Qwen3's, keeping past thinking, so a multi-turn trajectory stays one segment)
    chat_template_kwargs: dict = field(default_factory=dict)  # variables every chat render gets (router, fast path),
    # e.g. {enable_thinking: false}; a request's own chat_template_kwargs override them
    tool_parser: str = ""  # how tool calls are read from the model's text: SGLang's parser names hermes, qwen25 (qwen),
    # llama3, mistral, deepseekv3; "none"; a dotted path to fn(text, tools) -> (content, tool_calls); "" = the one the
    # chat template shows (chat.pick_tool_parser)
    reasoning_parser: str = ""  # how thinking is split from the answer: qwen3 (<think>...</think> the model writes),
    # deepseek-r1 (the generation prompt opens <think>); "none"; "" = the one the chat template shows
    group_filter: str = ""  # dotted path: fn(group: list[trajectory dict]) -> bool; False drops the group, and the
    # producer dispatches another in its place (as for dynamic_sampling)

    # --- rollout ---
    prompts_per_step: int = 32  # B prompts per step
    samples_per_prompt: int = 8  # N samples per prompt (the group)
    max_prompt_len: int = 256  # longer prompts are rejected by the engine
    max_new_tokens: int = 16  # per model call; also the trainer's constant length: loss_agg seq_mean_token_sum's
    # divisor and the overlong / length penalties' max length (trainer.denominators, algos.shape_rewards)
    temperature: float = 1.0  # sampling temperature for training rollouts
    top_p: float = 1.0  # nucleus sampling for training rollouts; 1 = off
    top_k: int = -1  # top-k sampling for training rollouts; -1 = off
    eval_temperature: float = 0.0  # 0 = greedy eval
    eval_samples: int = 1  # k samples per eval prompt: eval/accuracy is mean@k, eval/pass@k the unbiased pass@k
    eval_greedy: bool = False  # also one greedy sample per prompt (eval/greedy_accuracy) beside the sampled ones
    engine: str = "auto"  # "auto" (sglang on CUDA, cpu elsewhere) | "sglang" | "cpu" | a dotted path:
    # fn(cfg, rank, host, seed) -> (url, handle with .shutdown()), a server speaking SGLang's HTTP contract
    # (rollout.RolloutEngine calls it; rollout.CONTRACT lists what it must serve)
    engine_max_batch: int = 256  # concurrent sequences per CPU engine

    # --- train ---
    global_batch_size: int = 256  # samples per optimizer step (a mini-batch); a step may do several
    micro_batch_size: int = 64  # samples per forward/backward on one DP rank
    max_tokens_per_micro_batch: int = 0  # > 0: packed sequences instead of padded rows: consecutive samples share a
    # micro-batch while their tokens fit this budget (a longer sample goes alone), back to back in one row (THD,
    # each attending to itself only); micro_batch_size is then unused by the trainer. 0 = padded micro-batches
    lr: float = 1e-4  # peak learning rate (AdamW), reached after lr_warmup_steps, then cosine to min_lr
    min_lr: float = 0.0  # cosine decay floor; = lr means constant
    lr_warmup_steps: int = 0  # optimizer steps of linear warmup
    weight_decay: float = 0.0  # AdamW decoupled weight decay (not on norms and biases)
    adam_beta1: float = 0.9  # AdamW first-moment decay
    adam_beta2: float = 0.999  # AdamW second-moment decay
    adam_eps: float = 1e-8  # AdamW denominator epsilon
    grad_clip: float = 1.0  # global grad-norm clip; 0 = off
    router_replay: bool = False  # R3, MoE models only: engines return every token's routed experts and the trainer's
    # routers replay them in every forward over those trajectories (old logp and update), so training routes as
    # inference did

    # --- LoRA (lora.py; checked by check_lora): adapters on a frozen base, only they train and go to the engines ---
    lora_rank: int = 0  # r of every adapter; 0 = no LoRA (every weight trains, full weight syncs)
    lora_alpha: float = 16.0  # adapters add (lora_alpha / lora_rank) * B A, PEFT's scaling
    lora_targets: list = field(default_factory=lambda: list(lora.TARGETS))  # HF projections that get an adapter:
    # q_proj k_proj v_proj o_proj gate_proj up_proj down_proj (Megatron's fused linear_qkv / linear_fc1 get theirs per
    # slice of rows)
    lora_train_norm: bool = False  # the final RMSNorm's gain trains too, so the logits' scale is RL's (lora.py)

    # --- algo (see algos.py and ALGORITHMS.md; validated by algos.validate) ---
    advantage: str = "grpo"  # grpo | drgrpo | rloo | reinforce_pp | returns | gae (trains a critic, see below)
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
    critic_lr: float = 1e-4  # advantage=gae: the value model's learning rate (constant; AdamW like the policy)
    value_clip: float = 0.2  # advantage=gae: PPO value clip, V kept within V_old +- value_clip in the loss; 0 = off
    critic_warmup_steps: int = 0  # advantage=gae: the first N RL steps train the critic only (the policy waits)
    use_rollout_logprobs: bool = False  # old_logp := engine logprobs (skip the recompute)
    recompute_old_logprobs: bool = False  # debug: a no-grad forward for mini-batch 0 too (by default it takes old
    # logprobs from its own training forward, detached: the same weights and numbers, one forward fewer)
    is_correction: str = ""  # train-inference IS correction: "" | token | seq | geo
    is_mode: str = "truncate"  # truncate | mask (outside [is_low, is_high])
    is_low: float = 0.0  # IS weight lower bound (truncate clamps to it, mask drops below it)
    is_high: float = 2.0  # IS weight upper bound (likewise)
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
    teachers: dict = field(default_factory=dict)  # {name: HF dir | {path: HF dir or "tiny", tiny_model/warmstart_*}}
    teacher_route: str = ""  # dotted path: fn(trajectory) -> per response token a teacher, {teacher: weight} or None
    teacher_tp: int = 1  # tensor parallel size of the teacher group (independent of the student's)
    teacher_placement: str = "own"  # "own": the teachers' own bundles | "trainer": time-share the trainers' (CPU)
    cpus_per_teacher: float = 1.0  # Ray CPU resources per teacher rank
    teacher_topk: int = 16  # K of the top-k targets each teacher returns per token
    teacher_micro_batch: int = 64  # samples per teacher forward
    teacher_eval: bool = True  # before training, evaluate each teacher (the student's architecture) on the eval sets
    data_sources: list = field(default_factory=list)  # [{name, dataset, weight, eval_dataset, reward, agent, teacher}]

    # --- weights ---
    transfer: str = "auto"  # TransferMesh transport: auto | shm | cuda_ipc | broadcast | disk | a dotted path to a
    # push function with the built-ins' signature (see transfermesh.push_weights)
    bucket_mb: float = 64.0  # bucket size for weight sync

    # --- reliability: engine health and timeouts (see fleet.check_engines, fleet.wait, fleet.save_run_state) ---
    engine_check_every: float = 5.0  # seconds between engine health probes (also probed after any failed call)
    engine_health_timeout: float = 10.0  # silent on /server_info this long at 2 probes in a row: hung, re-created
    engine_wait: float = 180.0  # seconds a request waits for a replacement when no engine is up, before it fails
    max_engine_restarts: int = 20  # engine re-creations per run before it stops (a crash loop needs a fix)
    weight_sync_timeout: float = 600.0  # seconds one weight sync (trainers -> engines) may take
    actor_timeout: float = 3600.0  # seconds any other Ray call (rollout batch, train step, eval, checkpoint) may take


# ================================================================================================
# loading: recipe YAML + key=value overrides -> a Config, derived values filled in, every rule checked


def closest(key: str, valid) -> str:
    """"; did you mean X?" with X the valid name closest to `key`: the tail of every "unknown name" error."""
    match = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.0)
    return f"; did you mean {match[0]!r}?" if match else ""


def need(ok: bool, msg: str) -> None:
    """A rule: `msg` (what was wrong, the value seen, what to change) as a ValueError unless `ok`."""
    if not ok:
        raise ValueError(msg)


def load_config(recipe: str | None, overrides: list[str] = ()) -> Config:
    """Recipe YAML + `key=value` overrides (values parsed as YAML; `sglang.x=1` sets a pass-through key)."""
    raw: dict = {}
    if recipe:
        if not Path(recipe).exists():
            raise FileNotFoundError(f"recipe {recipe!r} not found; the recipes are in "
                                    f"{sorted(map(str, Path('recipes').glob('*.yaml')))}")
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
            raise ValueError(f"unknown config key {key!r}{closest(key, names)}")
    if raw.get("mode", "sync") == "sync" and float(raw.get("stale_steps") or 0) > 0:
        raise ValueError(f"stale_steps={raw['stale_steps']} applies to mode=async only (sync runs with 0); set "
                         "mode=async or drop stale_steps")
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
        elif (d is not dataclasses.MISSING and type(d) in (int, float, bool, str) and not isinstance(v, type(d))
              and "|" not in f.type):  # a union (resume) has its own rule in finalize
            raise ValueError(f"config key {f.name!r} should be a {type(d).__name__}, got {v!r}")
    return finalize(cfg)


def finalize(cfg: Config) -> Config:
    """Derived values and the batch algebra, with messages that say what to change; the rules by concern are the
    check_* functions below, run in the order they are called here (the first broken rule is the one reported)."""
    if cfg.device == "auto":
        cfg.device = "cuda" if torch.cuda.is_available() else "cpu"
    need(cfg.device in ("cpu", "cuda"), f"device={cfg.device!r}: choose 'auto', 'cpu' or 'cuda'")
    if cfg.engine == "auto":
        cfg.engine = "sglang" if cfg.device == "cuda" else "cpu"
    need(cfg.engine in ("sglang", "cpu", "vllm") or data.is_dotted(cfg.engine),
         f"engine={cfg.engine!r}: choose 'sglang', 'cpu', 'vllm', 'auto' or a dotted path 'module.function'")
    need(cfg.engine != "sglang" or cfg.device == "cuda",
         "engine=sglang runs on CUDA only; set device=cuda or engine=cpu")
    need(cfg.mode in ("sync", "async"), f"mode={cfg.mode!r}: choose 'sync' or 'async'")
    need(cfg.dtype in ("float32", "bfloat16"), f"dtype={cfg.dtype!r}: choose 'float32' or 'bfloat16'")
    need(cfg.dtype == "float32" or cfg.device == "cuda", f"dtype={cfg.dtype!r} with device={cfg.device!r}: the trainer "
         "trains in bfloat16 only on CUDA (Megatron's mixed-precision optimizer keeps fp32 master weights there); on "
         "CPU use dtype=float32")
    # SGLang 0.5.23 on Hopper: FlashAttention-3 (arg_groups/overrides.py, _deterministic_attention_backend)
    need(cfg.dtype != "float32" or cfg.engine != "sglang", "dtype=float32 with engine=sglang: SGLang would serve "
         "with --dtype float32, and on Hopper it picks FlashAttention-3, which has no fp32 kernels; set "
         "dtype=bfloat16 (the trainer keeps fp32 master weights; fp32_lm_head=true keeps the logits in fp32)")
    check_vllm(cfg)
    check_counts(cfg)
    check_pipeline(cfg)
    check_rollout(cfg)
    check_models(cfg)
    check_placement(cfg)
    check_fast_paths(cfg)
    check_packing(cfg)
    mp = cfg.tensor_parallel * cfg.pipeline_parallel * cfg.context_parallel
    need(cfg.trainer_workers % mp == 0, f"trainer_workers={cfg.trainer_workers} is not a multiple of "
         f"tensor_parallel*pipeline_parallel*context_parallel={mp}; use {mp * max(1, cfg.trainer_workers // mp)}")
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
         f"a multiple of micro_batch_size={cfg.micro_batch_size}; "
         f"try micro_batch_size={math.gcd(per_rank, cfg.micro_batch_size)}")
    # --- async: capacity, window, lag bound (train() reads them; see loongsage.groups_to_dispatch / collectable)
    need(cfg.stale_steps >= 0, f"stale_steps={cfg.stale_steps} must be >= 0 (0 = no step runs ahead of training)")
    need(cfg.window in WINDOWS or data.is_dotted(cfg.window),
         f"window={cfg.window!r}: choose one of {WINDOWS} or a dotted path{closest(cfg.window, WINDOWS)}")
    need(cfg.lag_policy in ("mask", "regenerate"), f"lag_policy={cfg.lag_policy!r}: choose 'mask' or 'regenerate'")
    need(cfg.max_version_lag >= -1, f"max_version_lag={cfg.max_version_lag}: use -1 (no bound) or a lag >= 0")
    if cfg.mode == "sync":
        cfg.stale_steps = 0.0  # one code path: sync is the pipeline with nothing running ahead
    cfg.trainer_threads, cfg.engine_threads = cpu.torch_threads(cfg)  # those left at 0, derived from the cores
    need(cfg.resume in (True, False, "previous"), f"resume={cfg.resume!r}: choose true, false or previous")
    need(cfg.on_save_error in ("stop", "skip"), f"on_save_error={cfg.on_save_error!r}: choose 'stop' or 'skip'")
    need(not cfg.train_only or bool(cfg.load_rollouts), "train_only needs load_rollouts=<dir written by dump_rollouts>")
    for t in cfg.trackers:
        need(t in TRACKERS,
             f"trackers: {t!r} is not a tracker; choose from {sorted(TRACKERS)}{closest(str(t), TRACKERS)}")
        try:
            __import__(TRACKERS[t])
        except ImportError:
            raise ValueError(f"trackers: {t!r} needs the {TRACKERS[t]} package: pip install -e .[tracking]") from None
    check_chat(cfg)
    plugged = [k for k in ("agent", "chat_template", "tool_parser", "group_filter", "window", "engine", "transfer",
                           "sandbox") if data.is_dotted(getattr(cfg, k))]
    for name in ["reward", "warmstart_example"] + plugged:
        if not (name == "reward" and cfg.reward == "judge"):
            data.import_object(getattr(cfg, name))  # fail now, not after the model is built
    algos.validate(cfg)
    check_teachers(cfg)
    if isinstance(cfg.judge, dict) and cfg.judge:  # derived: the judge's defaults, filled once
        cfg.judge = {"max_new_tokens": 16, "timeout": 60.0, "max_context_len": 2 * cfg.max_context_len, **cfg.judge}
    check_judge(cfg)
    check_critic(cfg)
    check_lora(cfg)
    return cfg


# ================================================================================================
# the rules: meaningless combinations fail here, at --check, before any actor starts


def check_pipeline(cfg: Config) -> None:
    """Pipeline parallelism: the stages split the model's layers evenly; what it does not serve."""
    if cfg.pipeline_parallel > 1:
        hf = _hf_config(cfg.model_path, cfg.tiny_model)
        layers, tied = hf.get("num_hidden_layers"), bool(hf.get("tie_word_embeddings", False))
        need(layers is None or layers % cfg.pipeline_parallel == 0, f"pipeline_parallel={cfg.pipeline_parallel} "
             f"does not divide the model's {layers} layers; choose a divisor of {layers}")
        need(not tied, f"pipeline_parallel={cfg.pipeline_parallel} with tied input/output embeddings "
             f"({cfg.model_path!r}) is not supported; use pipeline_parallel=1 for this model")
        need(cfg.expert_parallel == 1, f"pipeline_parallel={cfg.pipeline_parallel} with expert_parallel="
             f"{cfg.expert_parallel} is not wired in; use one of them")


def check_counts(cfg: Config) -> None:
    """Counts, budgets, rates and sampling knobs in their ranges."""
    # counts and budgets: zero or less would divide by zero in finalize's batch algebra or hang/do nothing later
    for name in ("trainer_workers", "tensor_parallel", "pipeline_parallel", "context_parallel", "expert_parallel",
                 "num_engines", "prompts_per_step", "samples_per_prompt", "global_batch_size", "micro_batch_size",
                 "max_new_tokens", "max_prompt_len", "max_context_len", "max_turns", "eval_samples", "engine_max_batch",
                 "max_parallel_sandboxes", "warmstart_batch_size", "teacher_tp", "teacher_topk", "teacher_micro_batch"):
        need(isinstance(getattr(cfg, name), int) and getattr(cfg, name) >= 1,
             f"{name}={getattr(cfg, name)!r} must be a positive integer")
    for name in ("num_steps", "eval_every", "save_every", "print_every", "agent_retries", "warmstart_steps",
                 "lr_warmup_steps", "warmstart_stop_loss", "max_engine_restarts"):
        need(getattr(cfg, name) >= 0, f"{name}={getattr(cfg, name)!r} must be >= 0 (0 = off / none)")
    for name in ("agent_timeout", "cpus_per_trainer", "cpus_per_engine", "bucket_mb", "engine_check_every",
                 "engine_health_timeout", "engine_wait", "weight_sync_timeout", "actor_timeout"):
        need(getattr(cfg, name) > 0, f"{name}={getattr(cfg, name)!r} must be > 0")
    need(cfg.lr >= 0 and 0 <= cfg.min_lr <= max(cfg.lr, 0),
         f"lr={cfg.lr!r}, min_lr={cfg.min_lr!r}: need 0 <= min_lr <= lr")
    for name in ("temperature", "eval_temperature"):  # SGLang and the CPU engine refuse negative ones
        need(getattr(cfg, name) >= 0, f"{name}={getattr(cfg, name)!r} must be >= 0 (0 = greedy)")
    need(0 < cfg.top_p <= 1, f"top_p={cfg.top_p!r} must be in (0, 1]")
    need(cfg.top_k == -1 or cfg.top_k >= 1, f"top_k={cfg.top_k!r}: use -1 (off) or a positive integer")


def check_vllm(cfg: Config) -> None:
    """engine=vllm (vllm_engine.py): vLLM's CPU build in .venv-vllm, with what its front serves today."""
    if cfg.engine != "vllm":
        return
    import vllm_engine  # late: only an engine=vllm config reads it
    try:
        vllm_engine.python()
    except RuntimeError as e:
        need(False, str(e))
    need(cfg.device == "cpu", "engine=vllm runs vLLM's CPU build (scripts/vllm_env.sh); set device=cpu")
    for key, why in (("colocate", "release/resume of memory"), ("lora_rank", "LoRA adapters"),
                     ("router_replay", "routed experts"), ("judge", "a judge engine"), ("teachers", "teacher engines")):
        need(not getattr(cfg, key), f"engine=vllm does not serve {why} yet; unset {key} or use engine=cpu")
    need(cfg.transfer in ("auto", "shm"), f"transfer={cfg.transfer!r} with engine=vllm: its weights arrive through "
         "vllm_plugin.py's shared-memory backend only; set transfer=auto or shm (engines on the trainer's machine)")
    need(cfg.mode != "async" or not cfg.borrow_engine_cores, "engine=vllm in async mode: a trainer rank borrows "
         "an engine's cores only while a CPU engine flags them idle, and vLLM flags nothing; set "
         "borrow_engine_cores=false")
    head_dim = _hf_config(cfg.model_path, cfg.tiny_model).get("head_dim")
    need(head_dim is None or int(head_dim) >= 32, f"engine=vllm: the model's head_dim is {head_dim}, and vLLM's CPU "
         "attention needs >= 32 (it starts, then dies on the first request); use a model (tiny_model.head_dim) "
         "with head_dim >= 32")


def check_rollout(cfg: Config) -> None:
    """The rollout side: not train_only and rollout_only both, the sandbox, the weight transport, one kind of agent,
    what agent_preload needs."""
    need(not (cfg.train_only and cfg.rollout_only), "train_only and rollout_only together would neither generate "
         "nor train; set one of them")
    need(cfg.sandbox in ("local", "docker", "auto") or data.is_dotted(cfg.sandbox),
         f"sandbox={cfg.sandbox!r}: choose 'local', 'docker', 'auto' or a dotted path 'module.function'")
    need(cfg.transfer in transfermesh.TRANSPORTS or data.is_dotted(cfg.transfer),
         f"transfer={cfg.transfer!r}: choose one of {transfermesh.TRANSPORTS} or a dotted path 'module.function'")
    need(cfg.transfer != "cuda_ipc" or cfg.device == "cuda", "transfer=cuda_ipc needs device=cuda (CUDA IPC handles "
         "of GPU tensors); on CPU use transfer=auto (shared memory to local engines) or broadcast")
    need(cfg.transfer != "shm" or cfg.engine == "cpu", "transfer=shm is the CPU engine's shared-memory path; SGLang "
         "engines take cuda_ipc, broadcast or disk (or auto)")
    need(not (cfg.agent and cfg.agent_command), f"set either agent ({cfg.agent!r}, a Python function) or "
         f"agent_command ({cfg.agent_command!r}, a black-box program), not both")
    need(bool(cfg.train_labels) and set(cfg.train_labels) <= set(SEGMENT_LABELS), f"train_labels="
         f"{cfg.train_labels}: choose one or more of {list(SEGMENT_LABELS)}")
    c = cfg.first_turn_constraint
    need(not c or len(c) == 1 and next(iter(c)) in ("regex", "ebnf", "json_schema", "structural_tag") and
         isinstance(next(iter(c.values())), str), f"first_turn_constraint={c!r:.200}: give one of regex, ebnf, "
         "json_schema, structural_tag, as a string (SGLang's sampling parameter)")
    if cfg.agent_preload:
        need(bool(cfg.agent_command), f"agent_preload={cfg.agent_preload} preloads modules for agent_command, which "
             "is empty; set agent_command or remove agent_preload")
        need(cfg.sandbox == "local", f"agent_preload forks agents from a warm interpreter on this machine, which "
             f"sandbox={cfg.sandbox!r} cannot take; set sandbox=local or remove agent_preload")
        need(sandbox.python_command(cfg.agent_command) is not None, f"agent_preload runs Python agents only: "
             f"agent_command must read `[VAR=value ...] python SCRIPT [ARGS]` or `python -m MODULE [ARGS]` (no shell "
             f"operators), got {cfg.agent_command!r}; remove agent_preload to run it through bash")


def check_models(cfg: Config) -> None:
    """What the model must be for the options set: an MoE model for router_replay, known tiny_model settings."""
    if cfg.router_replay:
        mt = _hf_config(cfg.model_path, cfg.tiny_model).get("model_type")
        need(mt in (None,) + MOE_MODEL_TYPES, f"router_replay=true needs an MoE model ({', '.join(MOE_MODEL_TYPES)}), "
             f"but {cfg.model_path!r} is {mt!r}, which has no router; set router_replay=false"
             + (" or tiny_model.num_experts > 0" if cfg.model_path == "tiny" else ""))
        need(cfg.engine != "cpu" or mt != "mixtral", "router_replay with engine=cpu: the CPU engine runs Qwen3-MoE "
             "and DeepSeek-V3 but not Mixtral; use a qwen3_moe or deepseek_v3 model or engine=sglang")
    unknown = sorted(set(cfg.tiny_model) - set(data.TINY_DEFAULTS))
    need(cfg.model_path != "tiny" or not unknown, f"unknown tiny_model setting(s) {unknown}"
         f"{closest(unknown[0], data.TINY_DEFAULTS) if unknown else ''}; valid: {sorted(data.TINY_DEFAULTS)}")
    fam = cfg.tiny_model.get("chat_format", "chatml")
    need(cfg.model_path != "tiny" or fam in chat.FAMILIES, f"tiny_model.chat_format={fam!r}: the tiny tokenizer is "
         f"built in one of {sorted(chat.FAMILIES)}{closest(str(fam), chat.FAMILIES)}")


def check_placement(cfg: Config) -> None:
    """Where things run: colocated engines fit on the trainers' GPUs, an SGLang engine's TP size, the
    expert-parallel grid."""
    if cfg.device == "cuda" and cfg.colocate:
        need(cfg.num_engines * cfg.gpus_per_engine <= cfg.trainer_workers, f"colocate: {cfg.num_engines} engines x "
             f"gpus_per_engine={cfg.gpus_per_engine} GPUs must fit on the trainers' {cfg.trainer_workers} GPUs; lower "
             "num_engines or set colocate=false")
    need(not (cfg.engine == "sglang" and cfg.colocate and cfg.sglang.get("enable_memory_saver") is False),
         "colocate=true hands the engines' memory to the trainers with SGLang's release_memory_occupation, which needs "
         "its memory saver; drop sglang.enable_memory_saver=false or set colocate=false")
    if cfg.engine == "sglang" and "tp_size" in cfg.sglang:
        need(int(cfg.sglang["tp_size"]) == cfg.gpus_per_engine, f"sglang.tp_size={cfg.sglang['tp_size']} but "
             f"gpus_per_engine={cfg.gpus_per_engine}: an engine's tensor parallel size is its GPU count; "
             "set them equal")
    if cfg.expert_parallel > 1:
        hf = _hf_config(cfg.model_path, cfg.tiny_model)
        mt = hf.get("model_type")
        need(mt in (None,) + MOE_MODEL_TYPES, f"expert_parallel={cfg.expert_parallel} needs an MoE model, but "
             f"{cfg.model_path!r} is {mt!r}; set expert_parallel=1")
        experts = hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts")
        need(not experts or experts % cfg.expert_parallel == 0, f"expert_parallel={cfg.expert_parallel} does not "
             f"divide the model's {experts} experts; choose a divisor of {experts}")
        ranks = cfg.tensor_parallel * cfg.pipeline_parallel * cfg.expert_parallel  # Megatron's expert grid
        need(cfg.trainer_workers % ranks == 0, f"trainer_workers={cfg.trainer_workers} is not a multiple of "
             f"tensor_parallel*pipeline_parallel*expert_parallel={ranks}; "
             f"use {ranks * max(1, cfg.trainer_workers // ranks)}")


def check_chat(cfg: Config) -> None:
    """The chat side: tool and reasoning parsers, chat template variables."""
    need(cfg.tool_parser in chat.TOOL_PARSERS + ("", "none") or data.is_dotted(cfg.tool_parser),
         f"tool_parser={cfg.tool_parser!r}: choose one of {chat.TOOL_PARSERS}, 'none', '' (the chat template's) or a "
         f"dotted path to fn(text, tools) -> (content, tool_calls){closest(cfg.tool_parser, chat.TOOL_PARSERS)}")
    need(cfg.reasoning_parser in chat.REASONING_PARSERS + ("", "none"),
         f"reasoning_parser={cfg.reasoning_parser!r}: choose one of {chat.REASONING_PARSERS}, 'none' or '' (the chat "
         f"template's){closest(cfg.reasoning_parser, chat.REASONING_PARSERS)}")
    need(isinstance(cfg.chat_template_kwargs, dict), f"chat_template_kwargs={cfg.chat_template_kwargs!r} must be a "
         "mapping of template variables, e.g. {enable_thinking: false}")


def check_critic(cfg: Config) -> None:
    """advantage=gae trains a critic inside every trainer rank (trainer.py): its knobs, and the combinations it
    cannot serve, fail here, at --check."""
    if cfg.advantage != "gae":
        need(cfg.critic_warmup_steps == 0, f"critic_warmup_steps={cfg.critic_warmup_steps} applies to advantage='gae' "
             f"(the only estimator with a critic), not {cfg.advantage!r}; set critic_warmup_steps=0 or advantage=gae")
        return
    need(cfg.critic_lr > 0, f"critic_lr={cfg.critic_lr!r} must be > 0: advantage='gae' learns its values")
    need(cfg.value_clip >= 0, f"value_clip={cfg.value_clip!r} must be >= 0 (0 = no value clipping)")
    need(0 <= cfg.critic_warmup_steps < max(cfg.num_steps, 1), f"critic_warmup_steps={cfg.critic_warmup_steps} must be "
         f">= 0 and below num_steps={cfg.num_steps}, or the policy is never trained")
    need(cfg.gkd_ratio < 1, "advantage='gae' with gkd_ratio=1: pure distillation has no RL loss, so the critic's "
         "values would feed nothing; set gkd_ratio < 1 or another advantage")
    need(cfg.pipeline_parallel == 1, f"advantage='gae' with pipeline_parallel={cfg.pipeline_parallel}: the critic's "
         "value head runs on a whole model in each rank; set pipeline_parallel=1 (tensor and data parallel work)")
    need(cfg.expert_parallel == 1, f"advantage='gae' with expert_parallel={cfg.expert_parallel}: the critic's forward "
         "does not keep expert ranks in step (no idle micro-batches); set expert_parallel=1")


def check_lora(cfg: Config) -> None:
    """LoRA (lora_rank > 0, lora.py): its knobs, and what it cannot serve yet, fail here, at --check."""
    need(isinstance(cfg.lora_rank, int) and cfg.lora_rank >= 0, f"lora_rank={cfg.lora_rank!r} must be an integer "
         ">= 0 (0 = no LoRA)")
    need(cfg.lora_rank or not cfg.lora_train_norm, "lora_train_norm=true needs lora_rank > 0 (else all weights train)")
    if not cfg.lora_rank:
        return
    need(cfg.lora_alpha > 0,
         f"lora_alpha={cfg.lora_alpha!r} must be > 0 (the adapters' scale is lora_alpha / lora_rank)")
    targets = cfg.lora_targets if isinstance(cfg.lora_targets, list) else [cfg.lora_targets]
    bad = [t for t in targets if t not in lora.TARGETS]
    need(bool(targets) and not bad, f"lora_targets={cfg.lora_targets!r}: "
         + (f"{bad[0]!r} is not a projection{closest(str(bad[0]), lora.TARGETS)} " if bad else "empty; ")
         + f"(choose from {list(lora.TARGETS)})")
    mt = _hf_config(cfg.model_path, cfg.tiny_model).get("model_type")
    need(mt not in MOE_MODEL_TYPES, f"lora_rank={cfg.lora_rank} with {mt} ({cfg.model_path!r}): LoRA on MoE "
         "experts and multi-latent attention is not wired in (dense Qwen3 / Qwen2 / Llama / Mistral only); "
         "set lora_rank=0")
    need(cfg.pipeline_parallel == 1, f"lora_rank={cfg.lora_rank} with pipeline_parallel={cfg.pipeline_parallel}: the "
         "adapters are gathered from one whole model per TP group; use pipeline_parallel=1 (TP and DP work)")
    need(not cfg.colocate, "lora_rank > 0 with colocate=true: a colocated engine's released weights come back zeroed "
         "and a LoRA sync sends only the adapters, so the base would be lost; set colocate=false")
    need(cfg.transfer in ("auto", "shm", "cuda_ipc", "disk"), f"transfer={cfg.transfer!r} with lora_rank > 0: SGLang "
         "0.5.23 loads adapters from tensors (same machine) or a directory only; use auto, shm, cuda_ipc or disk")
    need(not (cfg.teachers and cfg.teacher_eval), "teacher_eval=true with lora_rank > 0: the teachers' eval swaps "
         "whole models into the engines and back, and a LoRA sync carries adapters (one engine adapter per weight "
         "version, loaded once); set teacher_eval=false (distillation itself works with LoRA)")
    need(not cfg.sequence_parallel, "sequence_parallel=true with lora_rank > 0: the adapters read each linear "
         "layer's input as the layer is called, and under sequence parallelism that is one rank's slice of the "
         "sequence (the layer gathers it inside); set sequence_parallel=false")
    need(not cfg.use_distributed_optimizer, "use_distributed_optimizer=true with lora_rank > 0 is not tested (the "
         "adapters are a few MB per rank, so sharding their optimizer state saves little); set "
         "use_distributed_optimizer=false")


def check_packing(cfg: Config) -> None:
    """Packed sequences (max_tokens_per_micro_batch > 0): one row per micro-batch, so no stage shapes, expert ranks or
    per-row routing to keep in step; on CUDA the attention must take THD (Transformer Engine's layer spec: checked by
    convert.layer_spec, through check_fast_paths)."""
    budget = cfg.max_tokens_per_micro_batch
    need(isinstance(budget, int) and budget >= 0, f"max_tokens_per_micro_batch={budget!r} must be an integer >= 0 "
         "(0: padded micro-batches of micro_batch_size samples)")
    if not budget:
        return
    for key, value in (("pipeline_parallel", cfg.pipeline_parallel), ("context_parallel", cfg.context_parallel),
                       ("expert_parallel", cfg.expert_parallel)):
        need(value == 1, f"max_tokens_per_micro_batch={budget} with {key}={value}: packed sequences are wired in for "
             f"tensor and data parallelism only; set {key}=1 or max_tokens_per_micro_batch=0")
    need(not cfg.router_replay, "max_tokens_per_micro_batch with router_replay=true: the replayed routing is laid "
         "out per padded row; set max_tokens_per_micro_batch=0 or router_replay=false")


def check_fast_paths(cfg: Config) -> None:
    """Megatron-Core's fast paths (layer_spec, use_distributed_optimizer, sequence_parallel, context_parallel,
    recompute): what each needs. A CPU trainer has Megatron's local spec, with recomputation and sequence parallelism
    (through the CPU shims); the distributed optimizer needs CUDA, and on CUDA sequence and context parallelism and
    packed sequences need Transformer Engine's layer spec, which LoRA cannot use: convert.layer_spec decides it, here
    with transformer_engine as it imports on this machine (so run --check where the trainers run)."""
    tp, cp = cfg.tensor_parallel, cfg.context_parallel
    need(cfg.layer_spec in LAYER_SPECS, f"layer_spec={cfg.layer_spec!r}: choose from {LAYER_SPECS}"
         f"{closest(str(cfg.layer_spec), LAYER_SPECS)}")
    need(cfg.recompute in RECOMPUTE, f"recompute={cfg.recompute!r}: choose from {RECOMPUTE}"
         f"{closest(str(cfg.recompute), RECOMPUTE)}")
    for key, owner in MEGATRON_OWNED.items():
        need(key not in cfg.megatron, f"megatron.{key}={cfg.megatron.get(key)!r}: LoongSage sets it from its own "
             f"field `{owner}` (which it acts on beyond Megatron); set {owner} instead and drop megatron.{key}")
    refines = {"recompute_method": "full", "recompute_num_layers": "full", "recompute_modules": "selective"}
    for key, mode in refines.items():
        need(key not in cfg.megatron or cfg.recompute == mode, f"megatron.{key} refines recompute={mode!r}, but "
             f"recompute={cfg.recompute!r}; set recompute={mode} or drop megatron.{key}")
    if cfg.device == "cpu":
        need(not cfg.use_distributed_optimizer, "use_distributed_optimizer=true needs CUDA: Megatron-Core 0.16's "
             "optimizers (its DistributedOptimizer among them) allocate CUDA tensors and take torch.cuda parameters "
             "only, so a CPU trainer steps torch's AdamW over whole states (cpu.adamw); set "
             "use_distributed_optimizer=false, or device=cuda")
    need(not cfg.sequence_parallel or tp > 1, "sequence_parallel=true splits the sequence over the tensor-parallel "
         "ranks, and tensor_parallel=1 has none; set tensor_parallel >= 2 or sequence_parallel=false")
    need(cp == 1 or cfg.expert_parallel == 1, f"context_parallel={cp} with expert_parallel={cfg.expert_parallel} is "
         "not wired in (the padding that keeps expert ranks in step counts data-parallel ranks only); use one of them")
    need(not (cfg.router_replay and (cfg.sequence_parallel or cp > 1)), "router_replay=true with sequence_parallel or "
         "context_parallel: R3 hands every router the experts of all the micro-batch's tokens, and those split the "
         "tokens over ranks; set router_replay=false, or sequence_parallel=false and context_parallel=1")
    mt = _hf_config(cfg.model_path, cfg.tiny_model).get("model_type")
    need(not (mt in ("qwen3_moe", "mixtral") and tp > 1 and not cfg.sequence_parallel), f"{cfg.model_path!r} is an "
         f"MoE model ({mt}) and tensor_parallel={tp}: Megatron-Core trains MoE layers under tensor parallelism only "
         "with sequence parallelism (its MoELayer refuses otherwise); set sequence_parallel=true, or split the "
         "experts with expert_parallel instead")
    # DeepSeek-V3 under TP: a forward is tested (tests/test_deepseek.py), a training step not yet
    need(not (mt == "deepseek_v3" and tp > 1), f"tensor_parallel={tp} with an MoE model ({mt}): training DeepSeek-V3 "
         "under tensor parallelism is not tested; use tensor_parallel=1 and split the experts with expert_parallel")
    convert.layer_spec(cfg, cfg.device == "cpu")  # what the spec this machine would build cannot serve (LoRA, CP, SP,
    # packing), as each trainer checks again where it builds the model


def fast_paths(cfg: Config) -> str:
    """Which of Megatron's fast paths this run asks for, in one line (--check and the start of a run print it). The
    layer spec `auto` is what this machine would build; the trainers resolve it again where they run."""
    spec = convert.layer_spec(cfg, cfg.device == "cpu")
    spec = f"auto -> {spec} here" if cfg.layer_spec == "auto" else spec
    return (f"layer spec {spec}; distributed optimizer {'on' if cfg.use_distributed_optimizer else 'off'}; "
            f"sequence parallel {'on' if cfg.sequence_parallel else 'off'}; context parallel {cfg.context_parallel}; "
            f"recompute {cfg.recompute}")


def teacher_spec(name: str, spec) -> dict:
    """A `teachers:` entry as {"path": ..., build overrides...}, checked."""
    spec = {"path": spec} if isinstance(spec, str) else spec
    if not isinstance(spec, dict) or "path" not in spec:
        raise ValueError(f"teachers.{name}={spec!r}: give an HF directory, or {{path: tiny, warmstart_dataset: ...}}")
    for key in spec:
        if key != "path" and key not in TEACHER_BUILD_KEYS:
            raise ValueError(f"teachers.{name}.{key} is not a teacher setting"
                             f"{closest(key, ('path',) + TEACHER_BUILD_KEYS)}")
    if spec["path"] != "tiny" and len(spec) > 1:
        raise ValueError(f"teachers.{name}: build settings {sorted(set(spec) - {'path'})} apply to path: tiny only")
    return spec


def _hf_config(path: str, tiny_model: dict) -> dict:
    """config.json of the HF directory `path`, {} where it does not exist yet; for "tiny" the fields the rules read
    (model_type, num_hidden_layers, tie_word_embeddings, num_experts, head_dim) as the tiny builder will write them."""
    if path == "tiny":
        s = {**data.TINY_DEFAULTS, **tiny_model}
        experts = int(s["num_experts"] or 0)
        return {"model_type": "qwen3_moe" if s["model_type"] == "qwen3" and experts else s["model_type"],
                "num_hidden_layers": int(s["num_hidden_layers"]), "tie_word_embeddings": bool(s["tie_word_embeddings"]),
                "num_experts": experts, "head_dim": s["head_dim"]}
    cfg_file = Path(path) / "config.json"
    return json.loads(cfg_file.read_text()) if cfg_file.exists() else {}


def _vocab_of(path: str, tiny_model: dict) -> tuple | None:
    """What must match between student and teacher: (vocab_size, tokenizer vocab hash), or the tiny
    builder's tokenizer settings; None where it cannot be known before anything is built."""
    if path == "tiny":
        s = {**data.TINY_DEFAULTS, **tiny_model}
        return ("tiny", s["tokenizer_vocab"], s["vocab_multiple"], s["chat_format"])
    hf, tok = _hf_config(path, {}), Path(path) / "tokenizer.json"
    return (hf.get("vocab_size"), data.settings_hash(tok.read_text()) if tok.exists() else None) if hf else None


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
    names = list(cfg.teachers)
    specs = {n: teacher_spec(n, s) for n, s in cfg.teachers.items()}
    need(not names or cfg.pg_ratio > 0 or cfg.gkd_ratio > 0, f"teachers {names} are set but pg_ratio=0 and "
         "gkd_ratio=0, so they would teach nothing; set pg_ratio > 0 (PG-style) and/or gkd_ratio > 0 (GKD)")
    need(names or (cfg.pg_ratio == 0 and cfg.gkd_ratio == 0), f"pg_ratio={cfg.pg_ratio} / gkd_ratio={cfg.gkd_ratio} "
         "distil from teachers, but `teachers:` is empty; add teachers or set both to 0")
    need(cfg.teacher_placement in ("own", "trainer"),
         f"teacher_placement={cfg.teacher_placement!r}: choose 'own' or 'trainer'")
    need(cfg.teacher_placement == "own" or cfg.device == "cpu", "teacher_placement='trainer' time-shares CPU bundles "
         "only for now; on CUDA use teacher_placement='own' (the teachers' own GPUs)")
    need(cfg.teacher_placement == "own" or cfg.teacher_tp <= cfg.trainer_workers, f"teacher_placement='trainer' "
         f"puts teacher_tp={cfg.teacher_tp} ranks on {cfg.trainer_workers} trainer bundles; lower teacher_tp")
    if cfg.teacher_route:
        need(bool(names), f"teacher_route={cfg.teacher_route!r} without teachers; add `teachers:`")
        data.import_object(cfg.teacher_route)
    check_teacher_vocab(cfg.model_path, {n: spec["path"] for n, spec in specs.items()},
                        cfg.tiny_model, {n: spec.get("tiny_model", cfg.tiny_model) for n, spec in specs.items()})

    seen = set()
    for i, src in enumerate(cfg.data_sources):
        need(isinstance(src, dict) and "name" in src and "dataset" in src,
             f"data_sources[{i}]={src!r} needs at least name and dataset")
        for key in src:
            need(key in SOURCE_KEYS, f"data_sources[{i}].{key} is not a source key{closest(key, SOURCE_KEYS)}")
        need(src["name"] not in seen, f"data_sources: the name {src['name']!r} is used twice")
        seen.add(src["name"])
        need(float(src.get("weight", 1.0)) > 0, f"data_sources {src['name']!r}: weight={src.get('weight')} must be > 0")
        for key in ("reward", "agent"):
            if src.get(key) and not (key == "reward" and src[key] == "judge"):
                data.import_object(src[key])
        if src.get("teacher") is not None:
            need(bool(names), f"data source {src['name']!r} names teacher {src['teacher']!r} but `teachers:` is empty")
            for t in ([src["teacher"]] if isinstance(src["teacher"], str) else list(dict(src["teacher"]))):
                need(t in names, f"data source {src['name']!r} names teacher {t!r}, which is not in teachers: "
                     f"{names}{closest(str(t), names)}")
        elif len(names) > 1 and not cfg.teacher_route:
            raise ValueError(f"data source {src['name']!r} has no teacher, and there are {len(names)} teachers "
                             f"{names}; set its `teacher:` (a name or {{name: weight}}), or set teacher_route")


def check_judge(cfg: Config) -> None:
    """`reward: judge` (top-level or a data source's) and `judge:` come together, and the judge's settings are sound."""
    users = [r for r in [cfg.reward] + [s.get("reward") for s in cfg.data_sources if isinstance(s, dict)]
             if r == "judge"]
    j = cfg.judge
    need(isinstance(j, dict), f"judge={j!r} must be a mapping: {{model_path, prompt_template, parse, ...}}")
    need(bool(users) or not j, "judge: is set but no reward is 'judge'; set reward: judge (or a data source's "
         "reward: judge), or drop judge:")
    if not users:
        return
    need(bool(j), "reward: judge needs a `judge:` section: {model_path: HF dir, prompt_template: '... {response} ...', "
         "parse: regex or dotted fn}")
    for key in j:
        need(key in JUDGE_KEYS, f"judge.{key} is not a judge setting{closest(key, JUDGE_KEYS)}")
    for key in ("model_path", "prompt_template", "parse"):
        need(isinstance(j.get(key), str) and j.get(key) != "", f"judge.{key} is required (got {j.get(key)!r})")
    need(Path(j["model_path"]).is_dir(), f"judge.model_path={j['model_path']!r} is not a directory; give a local HF "
         "model directory (its tokenizer renders the judge prompt, and its engine serves it unless judge.url is set)")
    fields = [f for _, f, _, _ in string.Formatter().parse(j["prompt_template"]) if f is not None]
    for f in fields:
        need(f in JUDGE_FIELDS, f"judge.prompt_template names {{{f}}}; its fields are {list(JUDGE_FIELDS)}, and a "
             f"literal brace is written twice{closest(f, JUDGE_FIELDS)}")
    need("response" in fields, "judge.prompt_template has no {response}: the judge would never see what it judges")
    data.judge_parser(j["parse"])  # a dotted parse must import, a regex compile, now
    for key in ("max_new_tokens", "max_context_len"):
        need(isinstance(j[key], int) and not isinstance(j[key], bool) and j[key] >= 1,
             f"judge.{key}={j[key]!r} must be a positive integer")
    need(j["max_context_len"] > j["max_new_tokens"], f"judge.max_context_len={j['max_context_len']} leaves no room "
         f"for a prompt beside judge.max_new_tokens={j['max_new_tokens']}; raise it")
    timeout = j["timeout"]
    need(isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0,
         f"judge.timeout={timeout!r} must be > 0 (seconds the judge has for one group's batch)")
    need(j.get("url") is None or (isinstance(j["url"], str) and j["url"].startswith(("http://", "https://"))),
         f"judge.url={j.get('url')!r} must be an http(s) URL of a server speaking SGLang's /generate, or left out")


# ================================================================================================
# at the start of a run: what only this machine can say; what --check and the run print


def check_runtime(cfg: Config) -> None:
    """What only this machine can say: the device exists, the model and data are there."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but no CUDA device is visible; run on a GPU machine or set device=cpu engine=cpu")
    if cfg.model_path != "tiny" and not Path(cfg.model_path).is_dir():
        raise FileNotFoundError(f"model_path={cfg.model_path!r} is not a directory; give a local HF model directory "
                                "(config.json + safetensors + tokenizer) or model_path=tiny")
    if cfg.agent_command and cfg.sandbox == "docker" and not sandbox.docker_available():
        raise ValueError("sandbox=docker but no Docker engine answers `docker info` on this machine; start "
                         "dockerd, or set sandbox=local (LocalSandbox.contained says what it contains here)")
    for name in cfg.agent_preload:
        if importlib.util.find_spec(name) is None:
            raise ValueError(f"agent_preload: no module {name!r} here; install it, or drop it from agent_preload")
    for spec in (cfg.dataset, cfg.eval_dataset, *cfg.eval_sets.values(), *[s.get(k) for s in cfg.data_sources
                                                                             for k in ("dataset", "eval_dataset")]):
        if spec and not spec.startswith("synthetic:") and not Path(spec).exists():
            # reasoning_gym / a generator: loaded now, so an unknown task or setting fails naming the valid ones;
            # anything else is a missing file, refused naming the forms a dataset takes
            data.load_dataset(spec)


def warn_off_policy(cfg: Config) -> None:
    """A warning (stderr), not an error: async training on stale tokens with nothing that corrects for it."""
    if cfg.mode == "async" and cfg.stale_steps > 0 and cfg.max_version_lag != 0 and not (
            cfg.is_correction or cfg.m2po_threshold > 0 or cfg.opsm_delta > 0 or cfg.mask_stale_tokens):
        print(f"warning: mode=async with stale_steps={cfg.stale_steps} trains on tokens up to "
              f"{'unbounded' if cfg.max_version_lag < 0 else cfg.max_version_lag} versions old with no off-policy "
              "correction; consider is_correction=token, m2po_threshold, opsm_delta, mask_stale_tokens=true or "
              "max_version_lag", file=sys.stderr)


def capacity(cfg: Config) -> int:
    """C = B * (1 + stale_steps) groups in flight or buffered (B = prompts_per_step); C = B in sync mode."""
    return max(cfg.prompts_per_step, int(round(cfg.prompts_per_step * (1 + cfg.stale_steps))))


def describe(cfg: Config) -> str:
    """The derived sizes, in one line."""
    rollout = cfg.prompts_per_step * cfg.samples_per_prompt
    engine_cores, lent = cpu.actor_cores(cfg, "engine", 0), cpu.lent_cores(cfg, 0)  # async on a CPU node
    return (f"data_parallel={cfg.data_parallel}, rollout batch={rollout} samples, {rollout // cfg.global_batch_size} "
            f"optimizer step(s) per RL step, {cfg.global_batch_size // cfg.data_parallel // cfg.micro_batch_size} "
            f"micro-batch(es) per rank per optimizer step, device={cfg.device}, engine={cfg.engine}, "
            f"torch threads trainer/engine={cfg.trainer_threads}/{cfg.engine_threads}"
            + (f", cores trainer 0 / engine 0: {cpu.actor_cores(cfg, 'trainer', 0)} / {engine_cores}"
               if engine_cores else "")
            + (f" (trainer 0 also on {[c for _, cs in lent for c in cs]} while its engines idle)" if lent else "")
            + (", critic (value model) in every trainer rank" if cfg.advantage == "gae" else "")
            + (f", LoRA r={cfg.lora_rank} alpha={cfg.lora_alpha:g} on {','.join(cfg.lora_targets)} (base frozen)"
               if cfg.lora_rank else "")
            + (f", async: capacity C={capacity(cfg)} groups, window={cfg.window}, max_version_lag="
               f"{cfg.max_version_lag} ({cfg.lag_policy})" if cfg.mode == "async" else ""))


def explain(cfg: Config, placement: str = "") -> str:
    """What `--check` prints and train() prints first: the whole config as YAML (derived values filled in), the
    placement table where given (fleet.placement_table), Megatron's fast paths and the derived sizes."""
    text = yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
    if placement:
        text += "placement (bundle = one GPU on CUDA):\n" + placement + "\n"
    return text + f"megatron fast paths: {fast_paths(cfg)}\nderived: {describe(cfg)}"
