"""GPU checks for an air-gapped GPU machine without Ray, Megatron-Core, SGLang or a web stack: LoongSage's own trainer
code (trainer.TrainerWorker, Megatron-Core) and weight-sync code (transfermesh) on CUDA, one PASS/FAIL line per part.

Needs there: Python 3.12, torch (CUDA), transformers, safetensors, xxhash, httpx, pyarrow, tokenizers; megatron-core
and the web packages come with the working tree as wheels in .gpu_wheels/ (built here, before: `scripts/gpu_wheels.sh`,
which checks they stay under the 64 MiB that travels). One command on the GPU machine:
    python scripts/gpu_check.py          (installs .gpu_wheels/ first when megatron-core is missing)
    python scripts/gpu_check.py --dry-run   (any machine, CPU: the same plan on a tiny model; by hand, no test runs it)

Parts (each bounded at 3 minutes; the model is a ~0.44B-parameter Qwen3 with random weights built locally, no hub):
  1. megatron bf16 RL step on CUDA (GRPO loss, Megatron's optimizer): finite loss and grad norm;
  2. offload/onload of optimizer, grads and weights: torch.cuda.memory_allocated at each stage, falling and back;
  3. CUDA IPC weight push from the trainer process into an engine process on the same GPU (transfermesh's
     cuda_ipc_payloads, device named by UUID as SGLang reads it); the engine's logprobs then match the trainer's;
  4. training throughput: tokens/s and MFU (6 * params * tokens/s over the GPU's bf16 dense peak);
  5. the FP32 LM head (fp32_lm_head=true): a step, and its train-inference gap beside the bf16 head's.
Left out: SGLang itself (scripts/gpu_check.sh, on a GPU machine with registries), multi-GPU layouts. The engine of
part 3 is transformers' model with the pushed weights (the CPU engine's forward pass runs on CPU only).
"""
from __future__ import annotations

import argparse
import base64
import importlib.util
import io
import math
import os
import pickle
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WHEELS = ROOT / ".gpu_wheels"
CARRIED = ["megatron-core", "fastapi", "starlette", "uvicorn", "click", "pydantic", "pydantic-core", "annotated-types",
           "typing-inspection", "annotated-doc"]  # what scripts/gpu_wheels.sh fetches
PART_LIMIT_S = 180
BF16_PEAK = {"H200": 989e12, "H100": 989e12, "A100": 312e12}  # dense bf16 FLOP/s by GPU name (SXM datasheets)


def install_carried_wheels() -> None:
    if importlib.util.find_spec("megatron") is not None:
        return
    if not WHEELS.is_dir():
        sys.exit(f"megatron-core is not installed and {WHEELS} is missing: run scripts/gpu_wheels.sh on a machine with "
                 f"registries, then carry the working tree here")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--find-links",
                    str(WHEELS), *CARRIED], check=True)


def model_settings(dry: bool) -> dict:
    if dry:
        return dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    intermediate_size=128)
    # Qwen3-0.6B's layer shape (28 layers, 16 q / 8 kv heads of 128, MLP 3072) with the tiny tokenizer's vocabulary
    return dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                intermediate_size=3072)


def make_batch(vocab: int, n: int, prompt_len: int, response_len: int, seed: int) -> list[dict]:
    import torch
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(5, vocab, (prompt_len + response_len,), generator=g).tolist()
        out.append({"prompt_ids": ids[:prompt_len], "response_ids": ids[prompt_len:], "loss_mask": [1] * response_len,
                    "rollout_logprobs": [0.0] * response_len, "weight_versions": [0] * response_len,
                    "reward": float(i % 2), "status": "ok", "group_id": i // 4, "sample_index": i % 4})
    return out


def with_engine_logprobs(worker, batch: list[dict]) -> list[dict]:
    """The batch with rollout_logprobs from the trainer itself: a train-inference gap of ~0 on the same weights."""
    lps = worker.compute_logprobs(batch)
    return [{**t, "rollout_logprobs": lp} for t, lp in zip(batch, lps)]


def _engine(conn, model_dir: str, device: str) -> None:
    """The engine process of part 3: a transformers model on the same device, loaded from the same directory, that
    takes the trainer's CUDA IPC payloads (each TP rank's entry: rank 0 here) and answers logprobs."""
    import torch
    from torch.multiprocessing import reductions
    from transformers import AutoModelForCausalLM
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the trainer's dtype in each mode
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    by_uuid = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())} \
        if device == "cuda" else {}

    def rebuild_cuda_tensor(*args):  # the device travels as its UUID (transfermesh): map it to this process's index
        args = list(args)
        args[6] = by_uuid[args[6]] if isinstance(args[6], str) else args[6]
        return reductions.rebuild_cuda_tensor(*args)

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
                return rebuild_cuda_tensor
            return super().find_class(module, name)

    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            return
        if msg[0] == "load":
            named = Unpickler(io.BytesIO(base64.b64decode(msg[1][0]))).load()
            with torch.no_grad():
                for name, t in named:
                    model.get_parameter(name).copy_(t)
            conn.send(len(named))
        elif msg[0] == "logprobs":
            out = []
            with torch.no_grad():
                for prompt, response in msg[1]:
                    x = torch.tensor([prompt + response], device=device)
                    logp = torch.log_softmax(model(x).logits[0, len(prompt) - 1:-1].float(), -1)  # (R, V)
                    out.append(logp.gather(1, torch.tensor(response, device=device)[:, None])[:, 0].tolist())
            conn.send(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model: the plan without a GPU")
    args = ap.parse_args()
    dry = args.dry_run
    if not dry:
        install_carried_wheels()
    import torch
    import torch.multiprocessing as mp
    if not dry and not torch.cuda.is_available():
        print("FAIL no CUDA device visible (scripts/gpu_check.py --dry-run checks the plan on any machine)")
        return 1
    import config
    import data
    import trainer
    import transfermesh
    device = "cpu" if dry else "cuda"
    settings = model_settings(dry)
    model_dir = data.build_tiny_model(data.default_cache_dir() / ("gpu-check-dry" if dry else "gpu-check-0.4b"),
                                      **settings)
    vocab = len(data.load_tokenizer(model_dir))
    n, prompt_len, response_len = (8, 16, 16) if dry else (32, 256, 768)
    base = [f"model_path={model_dir}", f"device={device}", "engine=cpu" if dry else "engine=sglang",
            "prompts_per_step=8", "samples_per_prompt=4", f"global_batch_size={n}", f"micro_batch_size={min(n, 8)}",
            "lr=1e-5", f"output_dir={tempfile.mkdtemp(prefix='loongsage_gpu_check_')}"]
    if not dry:
        base.append("dtype=bfloat16")
    results, state = [], {}

    def part(name):
        def run(fn):
            t0 = time.perf_counter()
            try:
                note = fn() or ""
                ok = time.perf_counter() - t0 <= PART_LIMIT_S
                note += "" if ok else f" (over the {PART_LIMIT_S} s bound)"
            except Exception as e:  # noqa: BLE001 - every part reports, none stops the others
                traceback.print_exc()
                ok, note = False, f"{type(e).__name__}: {str(e)[:300]}"
            results.append(ok)
            print(f"{'PASS' if ok else 'FAIL'}{' (dry run)' if dry else ''} {name} ({time.perf_counter() - t0:.0f} s) "
                  f"{note}", flush=True)
        return run

    def new_worker(*overrides):
        cfg = config.load_config(None, base + list(overrides))
        w = trainer.TrainerWorker(cfg, 0, 1, "127.0.0.1", transfermesh.free_port())
        w.load_hf(model_dir)
        return w

    @part("megatron bf16 RL step")
    def _():
        w = state["bf16"] = new_worker()
        batch = state["batch"] = with_engine_logprobs(w, make_batch(vocab, n, prompt_len, response_len, 0))
        m = w.train_step(batch, 0)
        assert math.isfinite(m["train/loss"]) and math.isfinite(m["train/grad_norm"]), m
        state["gap_bf16"] = m.get("train/gap_k3")
        params = sum(p.numel() for p in w.policy.gpt.parameters())
        state["params"] = params
        return f"{params / 1e9:.2f}B params, loss {m['train/loss']:.4f}, grad_norm {m['train/grad_norm']:.3f}"

    @part("offload / onload with memory at each stage")
    def _():
        w = state["bf16"]
        key = "rss_bytes" if dry else "cuda_allocated_bytes"
        stages = [("resident", w.memory()), ("optimizer+grads off", w.offload(["optimizer", "grads"])),
                  ("weights off", w.offload(["weights"])), ("onloaded", w.onload())]
        mb = [round(m[key] / 2**20) for _, m in stages]
        if not dry:  # host RSS on CPU moves with the allocator's mood; the device's count is exact
            assert mb[0] > mb[1] > mb[2] and mb[3] >= mb[0] - 1, mb
        m = w.train_step(state["batch"], 1)  # and it still trains
        assert math.isfinite(m["train/loss"])
        return f"{key} MB: " + ", ".join(f"{s} {v}" for (s, _), v in zip(stages, mb))

    @part("CUDA IPC push into an engine process, logprobs match")
    def _():
        w = state["bf16"]
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=_engine, args=(child, model_dir, device), daemon=True)
        proc.start()
        try:
            assert conn.recv() == "ready"
            named = [(name, t.to(device)) for name, t in w.export_hf_weights()]
            loaded = 0
            for bucket in transfermesh.iter_buckets(named, 256 * 2**20):
                payload = transfermesh.cuda_ipc_payloads([(n_, t.contiguous()) for n_, t in bucket], 1)
                conn.send(("load", payload))
                loaded += conn.recv()
                torch.cuda.synchronize() if not dry else None
            batch = state["batch"][:4]
            conn.send(("logprobs", [(t["prompt_ids"], t["response_ids"]) for t in batch]))
            engine = conn.recv()
            ours = w.compute_logprobs(batch)
            diffs = [abs(a - b) for e, o in zip(engine, ours) for a, b in zip(e, o)]
            diff, mean = max(diffs), sum(diffs) / len(diffs)
            assert loaded == len(named), (loaded, len(named))
            # fp32 on CPU: the same numbers up to summation order; bf16 on GPU: Megatron's kernels and transformers'
            # round differently, so a bound on the mean and a loose one on the largest
            assert (diff < 1e-4) if dry else (mean < 1e-2 and diff < 0.1), (
                f"|engine - trainer|: max {diff}, mean {mean}")
            return f"{loaded} tensors, |engine - trainer| logprob: max {diff:.2e}, mean {mean:.2e}"
        finally:
            conn.send(("stop",))
            proc.join(timeout=60)

    @part("training throughput")
    def _():
        w = state["bf16"]
        steps, t0 = (1, time.perf_counter()) if dry else (3, time.perf_counter())
        for s in range(steps):
            w.train_step(state["batch"], 2 + s)
        torch.cuda.synchronize() if not dry else None
        tokens = steps * n * (prompt_len + response_len)
        tps = tokens / (time.perf_counter() - t0)
        name = torch.cuda.get_device_name() if not dry else "cpu"
        peak = next((v for k, v in BF16_PEAK.items() if k in name), None)
        mfu = f", MFU {6 * state['params'] * tps / peak:.1%} of {name}'s {peak / 1e12:.0f} TFLOP/s" if peak else ""
        return f"{tps:,.0f} tokens/s over {steps} steps{mfu}"

    @part("fp32 LM head")
    def _():
        w = state["bf16"]  # the same worker rebuilt: Megatron keeps one parallel state per process
        w.cfg = config.load_config(None, base + ["fp32_lm_head=true"])
        w.load_hf(model_dir)
        batch = with_engine_logprobs(w, make_batch(vocab, n, prompt_len, response_len, 0))
        m = w.train_step(batch, 0)
        assert math.isfinite(m["train/loss"]), m
        return f"train-inference gap_k3: bf16 head {state.get('gap_bf16')}, fp32 head {m.get('train/gap_k3')}"

    print(f"\nsummary: {sum(results)}/{len(results)} parts passed", flush=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
