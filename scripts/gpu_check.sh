#!/usr/bin/env bash
# The CUDA paths of LoongSage in one run on one GPU (about 10 minutes): one PASS / FAIL / SKIP line per item.
#   ./bootstrap.sh && scripts/gpu_check.sh            (bootstrap installs the [gpu] extra where a GPU is visible)
#   scripts/gpu_check.sh --dry-run                    (any machine: builds the tiny model and validates every run's
#                                                      config with `loongsage.py --check` and the SGLang command line)
# Items: SGLang server launch and /generate (with per-token weight_versions spans); Megatron-Core on CUDA (Megatron's
# optimizer, bf16) for a train step; the FP32 LM head on both sides (fp32_lm_head, SGLang --enable-fp32-lm-head), its
# train-inference gap beside the bf16 head's; TransferMesh CUDA IPC into SGLang (per-TP-rank payloads, device UUIDs)
# and NCCL broadcast (two GPUs: NCCL puts no two ranks on one device; SKIP on one), each in a 3-step async run of the
# whole pipeline; the colocated memory hand-off (engines release weights + KV cache, trainer offloads) with device
# memory per stage; Megatron's fast paths: the layer spec the trainer picked (Transformer Engine where it imports),
# the distributed optimizer with full recomputation through a checkpoint and a resume, and with two GPUs sequence
# parallelism (TP=2) and context parallelism (CP=2, needs TE). Every run is colocated (trainer and engine share the
# GPU), so each also exercises the hand-off.
# The tiny model is built locally (no hub access needed). Logs go to runs/gpu_check/.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p runs/gpu_check
exec "$PY" - "$@" <<'PYEOF'
import json, os, subprocess, sys, time, traceback
sys.path.insert(0, os.getcwd())
DRY = "--dry-run" in sys.argv[1:]
results = []

def item(name):
    def run(fn):
        t0 = time.time()
        try:
            note = fn() or ""
            results.append(("PASS", name, note))
        except Exception as e:  # noqa: BLE001 - every item reports, none stops the others
            traceback.print_exc()
            results.append(("FAIL", name, f"{type(e).__name__}: {str(e)[:300]}"))
        print(f"{results[-1][0]}{' (dry run)' if DRY else ''} {name} ({time.time() - t0:.0f}s) {results[-1][2]}",
              flush=True)
    return run

import torch
if not DRY and not torch.cuda.is_available():
    print("SKIP all: no CUDA device visible (scripts/gpu_check.sh --dry-run checks the configs on any machine)")
    sys.exit(0)
import config, data, rollout
model = data.build_tiny_model(data.default_cache_dir() / "tiny-gpu-check")
GPU = [f"model_path={model}", "device=cuda", "engine=sglang", "eval_every=0", "warmstart_steps=0", "print_every=0",
       "prompts_per_step=8", "samples_per_prompt=4", "global_batch_size=32", "micro_batch_size=16",
       "sglang.mem_fraction_static=0.3", "colocate=true"]  # colocated: trainer and engine share the one GPU

def run(name: str, *overrides: str) -> list[dict]:
    """loongsage.py on the arith recipe with GPU + overrides; the rows of metrics.jsonl that trained.
    Dry run: the same command line through --check only."""
    d = f"runs/gpu_check/{name}"
    cmd = [sys.executable, "loongsage.py", "recipes/arith_cpu.yaml", *GPU, *overrides, f"output_dir={d}"]
    r = subprocess.run(cmd + (["--check"] if DRY else []), capture_output=True, text=True, timeout=600)
    open(f"{d}.log", "w").write(" ".join(cmd) + "\n" + r.stdout + r.stderr)
    assert r.returncode == 0, f"{name}: " + r.stderr[-2000:]
    return [] if DRY else [x for x in map(json.loads, open(f"{d}/metrics.jsonl")) if "train/loss" in x]

@item("sglang launch + /generate with weight_versions spans")
def _():
    cfg = config.load_config(None, [f"model_path={model}", "device=cuda", "engine=sglang", "output_dir=runs/gpu_check",
                                    "sglang.mem_fraction_static=0.3", "fp32_lm_head=true", "colocate=true"])
    cmd = rollout.sglang_command(cfg, "127.0.0.1", 30000, 0)
    assert "--enable-fp32-lm-head" in cmd and "--enable-memory-saver" in cmd, cmd
    if DRY:
        return " ".join(cmd[2:])
    eng = rollout.RolloutEngine(cfg, 0)
    try:
        out = rollout.post(eng.url(), "/generate", {"input_ids": [1, 2, 3, 4], "return_logprob": True,
                                                    "sampling_params": {"max_new_tokens": 8, "temperature": 1.0}})
        meta = out["meta_info"]
        assert len(meta["output_token_logprobs"]) == len(out["output_ids"]), meta
        assert meta.get("weight_versions"), f"no weight_versions spans in {sorted(meta)}"
        return f"{len(out['output_ids'])} tokens, spans {meta['weight_versions']}"
    finally:
        eng.shutdown()

gaps = {}

@item("megatron on cuda: bf16 train step with Megatron's optimizer")
def _():
    rows = run("bf16", "dtype=bfloat16", "num_steps=1")
    if rows:
        gaps["bf16 head"] = rows[-1].get("train/gap_k3")
        return f"loss {rows[-1]['train/loss']:.4f} grad_norm {rows[-1]['train/grad_norm']:.3f} gap_k3 {gaps['bf16 head']}"

@item("fp32 LM head on both sides (fp32_lm_head=true, SGLang --enable-fp32-lm-head)")
def _():
    rows = run("fp32_head", "dtype=bfloat16", "num_steps=1", "fp32_lm_head=true")
    if rows:
        gaps["fp32 head"] = rows[-1].get("train/gap_k3")
        return f"train-inference gap_k3: {gaps}"  # the fp32 head's should be the smaller (CPU test: tests/test_fp32_head.py)

@item("transfermesh cuda_ipc into sglang, 3-step async run")
def _():
    rows = run("async_cuda_ipc", "mode=async", "stale_steps=1", "max_version_lag=1", "num_steps=3", "transfer=cuda_ipc")
    if rows:
        assert [x["weights/version"] for x in rows] == [1, 2, 3], rows
        return f"gap_k3 {[x.get('train/gap_k3') for x in rows]}, {rows[-1]['weights/gbps']:.2f} GB/s"

if DRY or torch.cuda.device_count() >= 2:
    @item("transfermesh nccl broadcast into sglang, 3-step async run (trainer and engine on two GPUs)")
    def _():
        rows = run("async_broadcast", "colocate=false", "mode=async", "stale_steps=1", "max_version_lag=1",
                   "num_steps=3", "transfer=broadcast")
        if rows:
            assert [x["weights/version"] for x in rows] == [1, 2, 3], rows
            return f"gap_k3 {[x.get('train/gap_k3') for x in rows]}, {rows[-1]['weights/gbps']:.2f} GB/s"
else:  # NCCL refuses a communicator with two ranks on one device ("Duplicate GPU detected")
    results.append(("SKIP", "transfermesh nccl broadcast: needs 2 GPUs (NCCL puts no two ranks on one GPU)", ""))
    print(f"SKIP {results[-1][1]}", flush=True)

@item("colocated memory hand-off on one GPU (release/resume_memory_occupation, trainer offload)")
def _():
    rows = run("colocate", "colocate=true", "num_steps=2", "dtype=bfloat16")
    for m in rows:  # device memory in use after each stage: engines' weights + KV come back only for the rollouts
        used = [m[f"memory/{s}_gpu_used_mb"] for s in ("train", "sync", "rollout")]
        assert used[0] < used[2] - 1024 and used[1] < used[2], f"GPU MB in use after train/sync/rollout: {used}"
    if rows:
        return "GPU MB in use after train/sync/rollout stages: " + "; ".join(
            str([round(m[f"memory/{s}_gpu_used_mb"]) for s in ("train", "sync", "rollout")]) for m in rows)

def te_importable() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
        return True
    except (ImportError, OSError):
        return False

@item("megatron fast paths: layer spec, distributed optimizer + recompute=full, checkpoint and resume")
def _():
    fast = ["dtype=bfloat16", "use_distributed_optimizer=true", "recompute=full", "save_every=1"]
    rows = run("fastpaths", *fast, "num_steps=2")
    if DRY:
        return ""
    rows = run("fastpaths", *fast, "num_steps=3", "resume=true")  # the optimizer's shards come back from rank files
    assert [x["step"] for x in rows][-3:] == [0, 1, 2] and all(x["train/loss"] == x["train/loss"] for x in rows), rows
    spec = next(x for x in open("runs/gpu_check/fastpaths.log") if x.startswith("trainer: Megatron-Core"))
    return f"{spec.strip()}; losses {[round(x['train/loss'], 4) for x in rows]}"

if DRY or torch.cuda.device_count() >= 2:
    @item("sequence parallel (TP=2) and context parallel (CP=2), 2-step runs on two GPUs")
    def _():
        if not DRY and not te_importable():
            return "SKIP: transformer_engine does not import here (sequence and context parallelism need its spec)"
        sp = run("sequence_parallel", "dtype=bfloat16", "num_steps=2", "trainer_workers=2", "tensor_parallel=2",
                 "sequence_parallel=true")
        cp = run("context_parallel", "dtype=bfloat16", "num_steps=2", "trainer_workers=2", "context_parallel=2")
        if sp:
            return f"losses SP {[round(x['train/loss'], 4) for x in sp]}, CP {[round(x['train/loss'], 4) for x in cp]}"
else:
    results.append(("SKIP", "sequence / context parallelism: needs 2 GPUs", ""))
    print(f"SKIP {results[-1][1]}", flush=True)

print("\nsummary:")
for status, name, note in results:
    print(f"  {status} {name}")
sys.exit(any(s == "FAIL" for s, _, _ in results))
PYEOF
