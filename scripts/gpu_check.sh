#!/usr/bin/env bash
# The CUDA paths of LoongSage with SGLang, on a GPU machine of your own that reaches the package registries
# (./bootstrap.sh installs the [gpu] extra there): one PASS / FAIL / SKIP line per item, in six runs of under 10
# minutes each (a whole-pipeline run is bounded at 270 s, at most two per run):
#   ./bootstrap.sh && scripts/gpu_check.sh --run 1   SGLang launch + /generate weight_versions spans; Megatron bf16 step
#   scripts/gpu_check.sh --run 2   FP32 LM head on both sides; 3-step async run syncing by CUDA IPC
#   scripts/gpu_check.sh --run 3   3-step async run syncing by NCCL broadcast (2 GPUs); the colocated hand-off, GPU
#                                  memory read after each stage (after the KV cache resumes, for rollout)
#   scripts/gpu_check.sh --run 4   the sync proven: SGLang's own /weights_checker checksum after each push equals the
#                                  one of the trainer's weights loaded from disk; pause in place -> update -> continue
#                                  with requests in flight (each has streamed its first token); GPU memory read after
#                                  the KV cache resumes
#   scripts/gpu_check.sh --run 5   Megatron's fast paths: the layer spec picked, the distributed optimizer +
#                                  recompute=full through a checkpoint and a resume
#   scripts/gpu_check.sh --run 6   with two GPUs and Transformer Engine: SP (TP=2) and CP (CP=2)
#   scripts/gpu_check.sh --dry-run (any machine with ./bootstrap.sh's .venv: every run's config through
#                                  `loongsage.py --check` and the SGLang command line; run 4's flow on a CPU engine)
# Every whole-pipeline run asserts engines/restarts == 0 and weights/bytes > 0 on every step. The tiny model is built
# locally (no hub access needed). Logs go to runs/gpu_check/. The lent GPU machine (no registries, Ray, Megatron-Core
# or SGLang) runs scripts/gpu_check.py instead.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || { echo "gpu_check.sh: no $PY: run ./bootstrap.sh first (or set PYTHON); a machine without registries" \
  "runs scripts/gpu_check.py" >&2; exit 1; }
mkdir -p runs/gpu_check
exec "$PY" - "$@" <<'PYEOF'
import asyncio, json, os, subprocess, sys, threading, time, traceback
sys.path.insert(0, os.getcwd())
DRY = "--dry-run" in sys.argv[1:]
RUN = sys.argv[sys.argv.index("--run") + 1] if "--run" in sys.argv else None  # None: all (the dry run)
RUN_LIMIT_S = 270  # one whole-pipeline run: two fit a run's 10 minutes
results = []
try:  # LoongSage's environment, with SGLang for a real run: say so at once rather than fail on an import later
    import ray, megatron.core  # noqa: F401
    if not DRY:
        import sglang  # noqa: F401
except ImportError as e:
    sys.exit(f"FAIL prerequisites: {e.name} does not import with {sys.executable}. gpu_check.sh runs in LoongSage's "
             "environment on a GPU machine with registries (./bootstrap.sh installs it, SGLang included where a GPU "
             "is visible); a machine without registries, Ray or SGLang runs scripts/gpu_check.py")

def in_run(n: str) -> bool:
    return DRY or RUN is None or RUN == n

def item(name, run_no):
    """Run the decorated check now if it belongs to this run (the dry run: every run's), one line for it."""
    def run(fn):
        if not in_run(run_no):
            return
        t0 = time.time()
        try:
            note = fn() or ""
            results.append(("SKIP" if note.startswith("SKIP") else "PASS", name, note.removeprefix("SKIP: ")))
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
GPU = [f"model_path={model}", "device=cuda", "engine=sglang", "dtype=bfloat16", "eval_every=0", "warmstart_steps=0",
       "print_every=0", "prompts_per_step=8", "samples_per_prompt=4", "global_batch_size=32", "micro_batch_size=16",
       "sglang.mem_fraction_static=0.3", "colocate=true"]  # colocated: trainer and engine share the one GPU

def run(name: str, *overrides: str) -> list[dict]:
    """loongsage.py on the arith recipe with GPU + overrides; the rows of metrics.jsonl that trained.
    Dry run: the same command line through --check only."""
    d = f"runs/gpu_check/{name}"
    cmd = [sys.executable, "loongsage.py", "recipes/arith_cpu.yaml", *GPU, *overrides, f"output_dir={d}"]
    r = subprocess.run(cmd + (["--check"] if DRY else []), capture_output=True, text=True, timeout=RUN_LIMIT_S)
    open(f"{d}.log", "w").write(" ".join(cmd) + "\n" + r.stdout + r.stderr)
    assert r.returncode == 0, f"{name}: " + r.stderr[-2000:]
    rows = [] if DRY else [x for x in map(json.loads, open(f"{d}/metrics.jsonl")) if "train/loss" in x]
    for x in rows:  # what every run must show: no engine was re-created, and every step's sync moved bytes
        assert x.get("engines/restarts", 0) == 0, f"{name}: engines/restarts {x.get('engines/restarts')} at {x}"
        assert x.get("weights/bytes", 0) > 0, f"{name}: weights/bytes {x.get('weights/bytes')} at {x}"
    return rows

@item("sglang launch + /generate with weight_versions spans", "1")
def _():
    cfg = config.load_config(None, [f"model_path={model}", "device=cuda", "engine=sglang", "dtype=bfloat16",
                                    "output_dir=runs/gpu_check",
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

@item("megatron on cuda: bf16 train step with Megatron's optimizer", "1")
def _():
    rows = run("bf16", "dtype=bfloat16", "num_steps=1")
    if rows:
        gaps["bf16 head"] = rows[-1].get("train/gap_k3")
        m = rows[-1]
        return f"loss {m['train/loss']:.4f} grad_norm {m['train/grad_norm']:.3f} gap_k3 {gaps['bf16 head']}"

@item("fp32 LM head on both sides (fp32_lm_head=true, SGLang --enable-fp32-lm-head)", "2")
def _():
    rows = run("fp32_head", "dtype=bfloat16", "num_steps=1", "fp32_lm_head=true")
    if rows:
        gaps["fp32 head"] = rows[-1].get("train/gap_k3")
        return f"train-inference gap_k3: {gaps}"  # the fp32 head's should be the smaller (tests/test_fp32_head.py)

@item("transfermesh cuda_ipc into sglang, 3-step async run", "2")
def _():
    rows = run("async_cuda_ipc", "mode=async", "stale_steps=1", "max_version_lag=1", "num_steps=3", "transfer=cuda_ipc")
    if rows:
        assert [x["weights/version"] for x in rows] == [1, 2, 3], rows
        return f"gap_k3 {[x.get('train/gap_k3') for x in rows]}, {rows[-1]['weights/gbps']:.2f} GB/s"

if DRY or torch.cuda.device_count() >= 2:
    @item("transfermesh nccl broadcast into sglang, 3-step async run (trainer and engine on two GPUs)", "3")
    def _():
        rows = run("async_broadcast", "colocate=false", "mode=async", "stale_steps=1", "max_version_lag=1",
                   "num_steps=3", "transfer=broadcast")
        if rows:
            assert [x["weights/version"] for x in rows] == [1, 2, 3], rows
            return f"gap_k3 {[x.get('train/gap_k3') for x in rows]}, {rows[-1]['weights/gbps']:.2f} GB/s"
elif in_run("3"):  # NCCL refuses a communicator with two ranks on one device ("Duplicate GPU detected")
    results.append(("SKIP", "transfermesh nccl broadcast: needs 2 GPUs (NCCL puts no two ranks on one GPU)", ""))
    print(f"SKIP {results[-1][1]}", flush=True)

@item("colocated memory hand-off on one GPU (release/resume_memory_occupation, trainer offload)", "3")
def _():
    rows = run("colocate", "colocate=true", "num_steps=2", "dtype=bfloat16")
    for m in rows:  # device memory in use once each stage is done on both sides (rollout: after the KV cache is
        # resumed): engines' weights + KV come back only for the rollouts
        used = [m[f"memory/{s}_gpu_used_mb"] for s in ("train", "sync", "rollout")]
        assert used[0] < used[2] - 1024 and used[1] < used[2], f"GPU MB in use after train/sync/rollout: {used}"
    if rows:
        return "GPU MB in use after train/sync/rollout stages: " + "; ".join(
            str([round(m[f"memory/{s}_gpu_used_mb"]) for s in ("train", "sync", "rollout")]) for m in rows)

@item("the sync proven on SGLang: checksums, pause in place with requests in flight, memory after KV resume", "4")
def _():
    """A trainer (Megatron on CUDA) and one SGLang engine on the GPU, driven step by step. After each of two
    train-and-push steps: SGLang's /weights_checker checksum of the pushed weights equals the checksum of the same
    engine after it loads the trainer's own HF export from disk (so the push delivered the trainer's weights bit for
    bit, whatever SGLang's internal layout); the push runs as train() runs it, pause in place -> update -> continue,
    with /generate requests in flight that finish with weight_versions spans across both versions. Then the
    colocated release -> resume weights -> push -> resume KV cache, and the device memory read after the resume.
    Dry run: the same flow against a CPU engine (no checksum route there)."""
    import httpx, trainer, transfermesh as tm
    overrides = [f"model_path={model}", "output_dir=runs/gpu_check/sync3", "eval_every=0", "warmstart_steps=0",
                 "prompts_per_step=2", "samples_per_prompt=4", "global_batch_size=8", "micro_batch_size=8"]
    overrides += ["device=cpu", "engine=cpu"] if DRY else ["device=cuda", "engine=sglang", "transfer=cuda_ipc",
                                                          "sglang.mem_fraction_static=0.3", "colocate=true",
                                                          "dtype=bfloat16"]
    cfg = config.load_config(None, overrides)
    eng = rollout.RolloutEngine(cfg, 0)
    url, notes = eng.url(), []
    w = trainer.TrainerWorker(cfg, 0, 1, "127.0.0.1", tm.free_port())
    try:
        w.load_hf(model)
        tok = data.load_tokenizer(model)
        prompts = [data.prompt_ids(tok, s) for s in data.arith_samples(2, 0)]
        for version in (1, 2):
            batch = []
            for g, p in enumerate(prompts):
                for i in range(4):
                    r = rollout.post(url, "/generate", {"input_ids": p, "return_logprob": True, "sampling_params": {
                        "temperature": 1.0, "max_new_tokens": 8}})
                    n = len(r["output_ids"])
                    batch.append({"prompt_ids": p, "response_ids": r["output_ids"], "loss_mask": [1] * n,
                                  "rollout_logprobs": [x[0] for x in r["meta_info"]["output_token_logprobs"]],
                                  "weight_versions": [version - 1] * n, "reward": float(i % 2), "status": "ok",
                                  "group_id": g, "sample_index": i})
            w.train_step(batch, version - 1)
            answers, started = [], [threading.Event() for _ in prompts]  # requests in flight across the update

            async def stream(p, first):
                async with httpx.AsyncClient() as client:
                    return await rollout.generate_stream(client, url, p, {
                        "temperature": 1.0, "max_new_tokens": 256, "ignore_eos": True}, on_chunk=lambda c: first.set(),
                        timeout=600)
            flights = [threading.Thread(target=lambda p=p, e=e: answers.append(asyncio.run(stream(p, e))))
                       for p, e in zip(prompts, started)]
            [t.start() for t in flights]
            assert all(e.wait(timeout=120) for e in started), "a request in flight streamed no token in 120 s"
            tm.pause_engines([url])  # each request has streamed a token and decodes 255 more: paused mid-decode
            stats = w.sync_weights([url], version)
            tm.continue_engines([url])
            [t.join(timeout=600) for t in flights]
            assert stats["weights/bytes"] > 0 and len(answers) == len(prompts), (stats, len(answers))
            spans = [a["meta_info"].get("weight_versions") for a in answers]
            assert any(s and {x["version"] for x in s} == {str(version - 1), str(version)} for s in spans), spans
            if not DRY:
                pushed = rollout.post(url, "/weights_checker", {"action": "checksum"})["per_engine_checksum"]
                export = w.save_hf(f"runs/gpu_check/sync3/step{version}")
                rollout.post(url, "/update_weights_from_disk", {"model_path": export, "flush_cache": False,
                                                               "abort_all_requests": False})
                own = rollout.post(url, "/weights_checker", {"action": "checksum"})["per_engine_checksum"]
                assert pushed == own, f"step {version}: SGLang's checksum after the push {pushed} != trainer's {own}"
                notes.append(f"step {version}: checksum {pushed[:12]} = trainer's")
        # the colocated hand-off by hand: memory read after the KV cache comes back
        import torch
        used = lambda: (lambda f, t: (t - f) / 2**20)(*torch.cuda.mem_get_info()) if not DRY else tm.rss_bytes() / 2**20
        tm.pause_engines([url])
        rollout.post(url, "/release_memory_occupation", {"tags": ["weights", "kv_cache"]})
        released = used()
        rollout.post(url, "/resume_memory_occupation", {"tags": ["weights"]})
        w.sync_weights([url], 3)
        rollout.post(url, "/resume_memory_occupation", {"tags": ["kv_cache"]})
        resumed = used()
        tm.continue_engines([url])
        out = rollout.post(url, "/generate", {"input_ids": prompts[0], "sampling_params": {"max_new_tokens": 4}})
        assert out["meta_info"]["weight_version"] == "3", out["meta_info"]
        if not DRY:
            assert resumed > released + 64, f"device MB in use: {released:.0f} released, {resumed:.0f} resumed"
        notes.append(f"MB in use: {released:.0f} released -> {resumed:.0f} after the KV resume")
        return "; ".join(notes)
    finally:
        eng.shutdown()

def te_importable() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
        return True
    except (ImportError, OSError):
        return False

@item("megatron fast paths: layer spec, distributed optimizer + recompute=full, checkpoint and resume", "5")
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
    @item("sequence parallel (TP=2) and context parallel (CP=2), 2-step runs on two GPUs", "6")
    def _():
        if not te_importable():  # (--check refuses them without it, dry run included)
            return "SKIP: transformer_engine does not import here (sequence and context parallelism need its spec)"
        sp = run("sequence_parallel", "dtype=bfloat16", "num_steps=2", "trainer_workers=2", "tensor_parallel=2",
                 "sequence_parallel=true")
        cp = run("context_parallel", "dtype=bfloat16", "num_steps=2", "trainer_workers=2", "context_parallel=2")
        if sp:
            return f"losses SP {[round(x['train/loss'], 4) for x in sp]}, CP {[round(x['train/loss'], 4) for x in cp]}"
elif in_run("6"):
    results.append(("SKIP", "sequence / context parallelism: needs 2 GPUs", ""))
    print(f"SKIP {results[-1][1]}", flush=True)

print("\nsummary:")
for status, name, note in results:
    print(f"  {status} {name}")
sys.exit(any(s == "FAIL" for s, _, _ in results))
PYEOF
