"""GPU checks for the lent air-gapped GPU machine (Python 3.12, torch with CUDA, transformers, peft; no registry, Ray,
Megatron-Core or SGLang): LoongSage's own trainer (trainer.TrainerWorker on Megatron-Core) and weight-sync code
(transfermesh) on CUDA, in at most 5 minutes, one PASS / FAIL / SKIP line per part printed as it finishes.

What travels with the working tree: .gpu_wheels/ (made beforehand where the registries are: `scripts/gpu_wheels.sh`,
which checks the 64 MiB budget): Megatron-Core, xxhash and httpx's wheels, unpacked onto sys.path here only where
this machine lacks them (nothing is installed), and the two source files of SGLang 0.5.23's weight receiver.
    python3 scripts/gpu_check.py [--part NAME ...]    the check (the model: a ~0.44B-parameter Qwen3, random weights
                                                      built here, no hub)
    python3 scripts/gpu_check.py --dry-run             any machine, CPU, a tiny model: the same parts and controls
    python3 scripts/gpu_check.py --break NAME          a control: NAME's check broken on purpose, NAME must FAIL
tests/test_gpu_check.py runs the dry run and each control in the CPU suite (the sglang part's in the conformance tier,
where SGLang's source is at hand).

Parts, each with the control that must make it fail:
  logprobs  the trainer's bf16 logprobs against transformers' fp32 ones on the same GPU, checkpoint and tokens: within
            3x (+2e-3) of transformers' own bf16 error (dry run, fp32 on both sides: 1e-4). Control: transformers'
            final norm doubled.
  ipc       the trainer's weights pushed bucket by bucket as CUDA IPC handles (transfermesh.cuda_ipc_payloads, the
            device named by UUID) into a second process holding a transformers model of other weights: each of its
            parameters must then have the pushed bytes (xxh3-128 digests), and none may have had them before (a push
            that never arrived cannot pass). Control: one bit of one tensor flipped after its digest was taken.
  sglang    the same push read by SGLang 0.5.23's own receiver (TpModelWorker.deserialize_own_rank's calls:
            monkey_patch_torch_reductions, MultiprocessingSerializer.deserialize through its SafeUnpickler): imported
            where SGLang imports, else its definitions run from the carried source files (its package's imports need
            orjson, pybase64, triton and more, which this machine lacks); SKIP without either. Control: the flipped bit.
  offload   offload / onload (HandOff, the colocated hand-off): optimizer + grads, then weights freed (their storage
            bytes to 0, torch.cuda.memory_allocated down by as much), onload restoring them bit for bit (digests), and
            it trains after; device memory at each stage and the peak printed. Control: an offload that frees nothing.
  distopt   Megatron's DistributedOptimizer at DP=1 against its plain optimizer: two steps from the same weights land
            on the same weights within 5% of how far they moved (and they move). Control: the distributed run at 1.5x
            the learning rate. Dry run: both runs on the CPU optimizer (the distributed one needs CUDA).
Left out: SGLang's server (scripts/gpu_check.sh, on a GPU machine with registries), multi-GPU layouts, throughput.
"""
from __future__ import annotations

import __future__
import argparse
import ast
import base64
import importlib.util
import io
import math
import pickle
import sys
import tempfile
import time
import traceback
import types
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WHEELS = ROOT / ".gpu_wheels"
# what scripts/gpu_wheels.sh fetches: {distribution: its top-level module}, beyond torch + transformers + peft's own
CARRIED = {"megatron_core": "megatron", "xxhash": "xxhash", "httpx": "httpx", "httpcore": "httpcore",
           "certifi": "certifi", "h11": "h11", "anyio": "anyio", "idna": "idna", "sniffio": "sniffio"}
PARTS = ("logprobs", "ipc", "sglang", "offload", "distopt")  # distopt reloads the worker: it runs last
BUDGET_S = 270  # parts not begun by then are reported, not run: the lent machine's 5 minutes hold the whole check
RECV_TIMEOUT_S = 120  # the engine process's longest silence


def use_carried_wheels() -> str:
    """Unpack each carried wheel whose module this machine lacks into .gpu_wheels/site and put that on sys.path (a
    wheel is a zip; spawned processes inherit the path). Returns what was unpacked."""
    missing = [d for d, m in CARRIED.items() if importlib.util.find_spec(m) is None]
    site = WHEELS / "site"
    for dist in missing:
        wheels = sorted(WHEELS.glob(f"{dist}-*.whl"))
        if not wheels:
            sys.exit(f"{CARRIED[dist]} does not import here and {WHEELS} has no {dist} wheel: run "
                     "scripts/gpu_wheels.sh on a machine with registries, then carry the working tree here")
        zipfile.ZipFile(wheels[-1]).extractall(site)
    if missing:
        sys.path.insert(1, str(site))
    return ", ".join(missing) or "none"


def digest(t) -> str:
    """xxh3-128 of a tensor's bytes: equal digests, equal bits."""
    import torch
    import xxhash
    return xxhash.xxh3_128_hexdigest(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy())


def own_receiver():
    """torch's rebuild of the pushed handles, the device's UUID mapped to this process's index as SGLang's receiver
    maps it (transfermesh sends the UUID: a bare index names another GPU when CUDA_VISIBLE_DEVICES differ)."""
    import torch
    from torch.multiprocessing import reductions
    by_uuid = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
                return lambda *a: reductions.rebuild_cuda_tensor(*a[:6], by_uuid.get(a[6], a[6]), *a[7:])
            return super().find_class(module, name)
    return (lambda payloads: Unpickler(io.BytesIO(base64.b64decode(payloads[0]))).load()), "torch's rebuild"


SGLANG_DEFS = {"sglang/srt/utils/common.py": ("MultiprocessingSerializer", "SafeUnpickler", "_safe_load_torch_storage"),
               "sglang/srt/utils/patch_torch.py": (
                   "monkey_patch_torch_reductions", "_reduce_tensor_modified", "_rebuild_cuda_tensor_modified",
                   "_device_to_uuid", "_device_from_maybe_uuid", "_modify_tuple", "_REDUCE_TENSOR_ARG_DEVICE_INDEX")}


def sglang_receiver(src: str | None):
    """SGLang 0.5.23's receiver as TpModelWorker.deserialize_own_rank runs it: monkey_patch_torch_reductions(), then
    MultiprocessingSerializer.deserialize(payloads[tp_rank]). From the source files under `src` (the definitions named
    in SGLANG_DEFS, executed as written) where given, else imported; None where neither is possible."""
    import torch
    from torch.multiprocessing import reductions
    if src is None:
        try:
            from sglang.srt.utils.common import MultiprocessingSerializer
            from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        except ImportError:
            return None
        how = "SGLang imported"
    else:
        from multiprocessing.reduction import ForkingPickler
        from typing import Callable, Union
        ns = {"io": io, "pickle": pickle, "torch": torch, "reductions": reductions, "ForkingPickler": ForkingPickler,
              "pybase64": base64, "Callable": Callable, "Union": Union, "_is_npu": False}
        for rel, names in SGLANG_DEFS.items():
            tree = ast.parse((Path(src) / rel).read_text())
            body = [n for n in tree.body if getattr(n, "name", None) in names or isinstance(n, ast.Assign) and any(
                getattr(t, "id", None) in names for t in n.targets)]
            assert len(body) == len(names), f"{rel}: found {len(body)} of the definitions {names}"
            ns["__name__"] = rel[:-3].replace("/", ".")
            exec(compile(ast.Module(body, []), str(Path(src) / rel), "exec", __future__.annotations.compiler_flag,
                         dont_inherit=True), ns)
        MultiprocessingSerializer, monkey_patch_torch_reductions = ns["MultiprocessingSerializer"], \
            ns["monkey_patch_torch_reductions"]
        how = f"SGLang's definitions run from {src}"

    def read(payloads):
        monkey_patch_torch_reductions()
        return MultiprocessingSerializer.deserialize(payloads[0])
    return read, how


def _engine(conn, model_dir: str, device: str, reader: str, src: str | None) -> None:
    """The receiving process of parts ipc and sglang: a transformers model of the checkpoint's shape with weights of
    its own (another seed, so a push that does not arrive leaves them different) on the same device; it reads each
    pushed bucket, copies it in by name, and at the end answers {name: (digest before, digest after)}."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        torch.manual_seed(1)
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).to(device=device, dtype=dtype)
        receiver = own_receiver() if reader == "own" else sglang_receiver(src)
        before = {n: digest(p) for n, p in model.named_parameters()}
        conn.send(("ready", receiver and receiver[1]))
        while (msg := conn.recv())[0] == "load":
            named = receiver[0](msg[1])
            with torch.no_grad():
                for name, t in named:
                    model.get_parameter(name).copy_(t)
            conn.send(len(named))
        conn.send({n: (before[n], digest(p)) for n, p in model.named_parameters()})
    except EOFError:  # the parent is gone or done with this process
        pass
    except Exception:  # noqa: BLE001 - the parent reports it
        conn.send(("error", traceback.format_exc()))


def recv(conn, proc):
    """The engine process's next answer; its traceback raised here, and never a wait on a dead or silent process."""
    deadline = time.monotonic() + RECV_TIMEOUT_S
    while not conn.poll(1):
        if not proc.is_alive() or time.monotonic() > deadline:
            raise TimeoutError(f"the engine process died or said nothing for {RECV_TIMEOUT_S} s")
    msg = conn.recv()
    if isinstance(msg, tuple) and msg[0] == "error":
        raise RuntimeError(f"engine process: {msg[1]}")
    return msg


def make_batch(vocab: int, n: int, prompt_len: int, response_len: int) -> list[dict]:
    import torch
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        ids = torch.randint(5, vocab, (prompt_len + response_len,), generator=g).tolist()
        out.append({"prompt_ids": ids[:prompt_len], "response_ids": ids[prompt_len:], "loss_mask": [1] * response_len,
                    "rollout_logprobs": [0.0] * response_len, "weight_versions": [0] * response_len,
                    "reward": float(i % 2), "status": "ok", "group_id": i // 4, "sample_index": i % 4})
    return out


def hf_logprobs(model, rows: list[dict]) -> list[float]:
    """transformers' logprob of every response token, flat."""
    import torch
    out = []
    with torch.no_grad():
        for r in rows:
            x = torch.tensor([r["prompt_ids"] + r["response_ids"]], device=model.device)
            logp = torch.log_softmax(model(x).logits[0, len(r["prompt_ids"]) - 1:-1].float(), -1)  # (R, V)
            out += logp.gather(1, torch.tensor(r["response_ids"], device=model.device)[:, None])[:, 0].tolist()
    return out


def part_logprobs(c) -> str:
    import torch
    from transformers import AutoModelForCausalLM
    w = c.worker()
    rows = c.batch[:4]
    ours = [x for row in w.compute_logprobs(rows) for x in row]
    ref = AutoModelForCausalLM.from_pretrained(c.model_dir).to(device=c.device, dtype=torch.float32).eval()
    if "logprobs" in c.broken:  # control: a model the trainer does not hold
        with torch.no_grad():
            ref.model.norm.weight.mul_(2)
    fp32 = hf_logprobs(ref, rows)
    err = [abs(a - b) for a, b in zip(ours, fp32)]
    mean, spread = sum(err) / len(err), float(torch.tensor(fp32).std())
    note = f"|trainer - HF fp32| mean {mean:.2e} max {max(err):.2e} over {len(err)} tokens (logprob std {spread:.2f})"
    if c.dry:
        assert max(err) < 1e-4, note
        return note
    own = [abs(a - b) for a, b in zip(hf_logprobs(ref.to(torch.bfloat16), rows), fp32)]
    bound = 3 * sum(own) / len(own) + 2e-3
    note += f"; HF's own bf16 mean {sum(own) / len(own):.2e}, bound {bound:.2e}"
    assert mean <= bound, note
    return note


def push(c, name: str, reader: str) -> str:
    """Parts ipc and sglang: the trainer's HF weights to an engine process by cuda_ipc_payloads, digests compared."""
    import torch
    import torch.multiprocessing as mp
    import transfermesh as tm
    named = [(n, t.detach().to(c.device).contiguous().clone()) for n, t in c.worker().export.hf_weights()]
    sent = {n: digest(t) for n, t in named}
    if name in c.broken:  # control: one bit of one tensor flipped after its digest was taken
        flat = named[len(named) // 2][1].view(-1).view(torch.uint8)
        flat[0] = flat[0] ^ 1
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_engine, args=(child, c.model_dir, c.device, reader, c.sglang_src), daemon=True)
    proc.start()
    try:
        _, how = recv(conn, proc)
        if how is None:
            raise Skip("no SGLang here: scripts/gpu_wheels.sh carries its receiver's source (or --sglang-src DIR)")
        t0, n_buckets = time.perf_counter(), 0
        for bucket in tm.iter_buckets(named, 256 * 2**20):
            conn.send(("load", tm.cuda_ipc_payloads(bucket, 1)))
            assert recv(conn, proc) == len(bucket)
            n_buckets += 1
        seconds = time.perf_counter() - t0
        conn.send(("done",))
        got = recv(conn, proc)
    finally:
        conn.close()
        proc.join(timeout=30)
        proc.kill()
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    assert set(got) == set(sent), f"engine parameters {sorted(set(got) ^ set(sent))[:4]} not in both"
    held = [n for n in sent if got[n][0] == sent[n]]
    assert not held, f"the engine held {held[:3]} already: a push that never arrived would pass for them"
    wrong = [n for n in sent if got[n][1] != sent[n]]
    assert not wrong, f"{len(wrong)} of {len(sent)} tensors arrived with other bytes than pushed: {wrong[:3]}"
    return (f"{len(sent)} tensors bit for bit ({nbytes / 2**20:.0f} MiB, {n_buckets} buckets, "
            f"{nbytes / seconds / 1e9:.1f} GB/s with the digests); reader: {how}")


def part_distopt(c) -> str:
    import config
    w, runs = c.worker(), []
    for distributed in (False, True):
        lr = 1e-3 * (1.5 if distributed and "distopt" in c.broken else 1)  # control: another learning rate
        on = str(distributed and not c.dry).lower()
        w.cfg = config.load_config(None, c.base + [f"lr={lr}", f"use_distributed_optimizer={on}"])
        info = w.load_hf(c.model_dir)
        start = w.export_hf_weights()
        norms = [round(w.train_step(c.batch, s)["train/grad_norm"], 5) for s in range(2)]
        runs.append((norms, w.export_hf_weights(), info["megatron"]))
    moved = sum(float((a.float() - b.float()).abs().sum()) for (_, a), (_, b) in zip(runs[0][1], start))
    apart = sum(float((a.float() - b.float()).abs().sum()) for (_, a), (_, b) in zip(runs[1][1], runs[0][1]))
    note = (f"grad norms plain {runs[0][0]}, distributed {runs[1][0]} ({runs[1][2]}); sum |plain - distributed| "
            f"{apart:.3e} vs sum |step moves| {moved:.3e}")
    assert moved > 0 and apart <= 0.05 * moved, note
    return note


def part_offload(c) -> str:
    import torch
    w = c.worker()
    if not w.optim.tensors():
        w.train_step(c.batch, 0)  # Adam's moments exist after a first step
    held = {tag: w.hand_off.tensors(tag) for tag in ("weights", "optimizer", "grads")}
    kept = {tag: [digest(t) for t in held[tag]] for tag in ("weights", "optimizer")}  # grads come back zeroed
    if "offload" in c.broken:  # control: an offload that frees nothing
        w.hand_off.offload = lambda tags: w.hand_off.memory()
    cuda = not c.dry

    def stage(label, fn):
        fn()
        return label, {t: sum(x.untyped_storage().nbytes() for x in held[t]) for t in held}, \
            torch.cuda.memory_allocated() if cuda else 0

    stages = [stage("resident", lambda: None), stage("optimizer+grads off", lambda: w.offload(["optimizer", "grads"])),
              stage("weights off", lambda: w.offload(["weights"])), stage("onloaded", w.onload)]
    mib = lambda b: f"{b / 2**20:.{3 if c.dry else 0}f}"  # noqa: E731
    note = "held MiB (weights/optimizer/grads) | CUDA allocated MiB: " + "; ".join(
        f"{label} {'/'.join(mib(v) for v in b.values())} | {mib(a)}" for label, b, a in stages)
    (_, b0, a0), (_, b1, a1), (_, b2, a2), (_, b3, a3) = stages
    assert b1["optimizer"] == b1["grads"] == 0 < b0["optimizer"] and b2["weights"] == 0 < b0["weights"], note
    assert b3 == b0 and {tag: [digest(t) for t in held[tag]] for tag in kept} == kept, "onload changed bytes: " + note
    if cuda:  # the device gives back at least 90% of each stage's bytes, and takes them again
        assert a0 - a1 >= 0.9 * (b0["optimizer"] + b0["grads"]) and a1 - a2 >= 0.9 * b0["weights"], note
        assert abs(a3 - a0) <= 16 * 2**20, note
        note += f"; CUDA peak so far {mib(torch.cuda.max_memory_allocated())}"
    loss = w.train_step(c.batch, 1)["train/loss"]
    assert math.isfinite(loss), loss
    return note + f"; a step after onload: loss {loss:.4f}"


class Skip(Exception):
    pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model: the parts and controls without a GPU")
    ap.add_argument("--part", action="append", choices=PARTS, help="run this part only (repeatable)")
    ap.add_argument("--break", dest="broken", action="append", choices=PARTS, default=[],
                    help="control: break this part's check on purpose; it must FAIL (repeatable)")
    ap.add_argument("--sglang-src", help="a directory holding SGLang 0.5.23's sglang/ sources (default: "
                    ".gpu_wheels/sglang where scripts/gpu_wheels.sh put them; else SGLang imported, if it imports)")
    args = ap.parse_args()
    t_start, dry = time.perf_counter(), args.dry_run
    unpacked = use_carried_wheels()
    import torch
    if not dry and not torch.cuda.is_available():
        print("FAIL no CUDA device visible (scripts/gpu_check.py --dry-run checks the parts on any machine)")
        return 1
    import config
    import data
    import trainer
    import transfermesh
    src = args.sglang_src or (str(WHEELS / "sglang") if (WHEELS / "sglang").is_dir() else None)
    shape = (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=128) if dry else  # Qwen3-0.6B's layers with the tiny tokenizer's vocabulary
             dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  intermediate_size=3072))
    # norm_std: random norms too, so no tensor of the engine process's own weights equals the checkpoint's
    model_dir = data.build_tiny_model(data.default_cache_dir() / ("gpu-check-dry" if dry else "gpu-check-0.4b"),
                                      norm_std=0.1, **shape)
    n, prompt_len, response_len = (8, 16, 16) if dry else (16, 128, 384)
    base = [f"model_path={model_dir}", f"device={'cpu' if dry else 'cuda'}", "engine=cpu" if dry else "engine=sglang",
            f"prompts_per_step={n // 4}", "samples_per_prompt=4", f"global_batch_size={n}", "micro_batch_size=8",
            f"output_dir={tempfile.mkdtemp(prefix='loongsage_gpu_check_')}"] + ([] if dry else ["dtype=bfloat16"])
    c = types.SimpleNamespace(dry=dry, device="cpu" if dry else "cuda", model_dir=model_dir, base=base,
                              broken=set(args.broken), sglang_src=src, state={})

    def worker():
        if "worker" not in c.state:
            w = trainer.TrainerWorker(config.load_config(None, base), 0, 1, "127.0.0.1", transfermesh.free_port())
            w.load_hf(model_dir)
            rows = make_batch(len(data.load_tokenizer(model_dir)), n, prompt_len, response_len)
            # rollout logprobs from the trainer itself: a train-inference gap of 0 on the same weights
            c.batch = [{**r, "rollout_logprobs": lp} for r, lp in zip(rows, w.compute_logprobs(rows))]
            c.state["worker"] = w
        return c.state["worker"]
    c.worker = worker

    fns = {"logprobs": part_logprobs, "ipc": lambda c: push(c, "ipc", "own"),
           "sglang": lambda c: push(c, "sglang", "sglang"), "distopt": part_distopt, "offload": part_offload}
    tag = " (dry run)" if dry else ""
    print(f"gpu_check{tag}: {torch.cuda.get_device_name() if not dry else 'cpu'}, torch {torch.__version__}; carried "
          f"wheels unpacked: {unpacked}" + (f"; CONTROLS broken on purpose, each must FAIL: {sorted(c.broken)}"
                                            if c.broken else ""), flush=True)
    results = []
    for name in [p for p in PARTS if p in (args.part or PARTS)]:
        t0 = time.perf_counter()
        if t0 - t_start > BUDGET_S:
            status, note = "FAIL", f"not run: {t0 - t_start:.0f} s spent, over the {BUDGET_S} s budget"
        else:
            try:
                status, note = "PASS", fns[name](c)
            except Skip as e:
                status, note = "SKIP", str(e)
            except Exception as e:  # noqa: BLE001 - every part reports, none stops the others
                traceback.print_exc()
                status, note = "FAIL", f"{type(e).__name__}: {str(e)[:600]}"
        results.append(status)
        print(f"{status}{tag} {name} ({time.perf_counter() - t0:.0f} s) {note}", flush=True)
    peak = f", peak CUDA allocated {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB" if not dry else ""
    print(f"\nsummary: {results.count('PASS')}/{len(results)} passed, {results.count('SKIP')} skipped in "
          f"{time.perf_counter() - t_start:.0f} s{peak}", flush=True)
    return 1 if "FAIL" in results else 0


if __name__ == "__main__":
    sys.exit(main())
