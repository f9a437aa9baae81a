"""TransferMesh: trainer -> rollout engines weight sync, over the fastest path each receiver has.

After each optimizer step, trainer rank 0 holds the full weights in HF names (TP shards gathered by
trainer.py). `push_weights` sends them to every engine in buckets (never one round-trip per
parameter) and stamps the engines with the new weight version, which they then report in every
`/generate` response. The receiver side is the engine's own HTTP endpoints (rollout.py), using the
small helpers at the bottom of this file.

Transports (chosen per engine by `pick_transport`, or forced with `transfer=` in the recipe):

| name      | receiver                    | how                                                        |
|-----------|-----------------------------|------------------------------------------------------------|
| shm       | same machine, CPU engine    | bucket written once into POSIX shared memory, every local  |
|           |                             | engine copies it out (`/update_weights_from_tensor`,       |
|           |                             | load_format "shm"); the CPU analogue of CUDA IPC           |
| cuda_ipc  | same machine, SGLang on GPU | CUDA IPC handles of the trainer's tensors, serialised the  |
|           |                             | way SGLang expects (`/update_weights_from_tensor`)          |
| broadcast | any machine                 | one flat bucket per collective over a gloo (CPU) or NCCL   |
|           |                             | group (`/init_weights_update_group`,                        |
|           |                             | `/update_weights_from_distributed`)                         |
| disk      | anything that shares a disk | safetensors + config in a directory                        |
|           |                             | (`/update_weights_from_disk`); slowest, simplest            |

Measured on the 2-core CPU machines (DESIGN.md): a memcpy moves 9.7-12.3 GB/s, gloo broadcast 1.5-2.0
GB/s, so local receivers get shared memory. `python bench.py transfer` measures each transport here.
Every bucket carries a checksum (float64 sum of its bytes viewed as uint8, cheap and order-free
enough to catch a torn or misaligned copy); receivers verify it before loading.

Left out: RDMA/NIXL transports and pipelining buckets over several collectives at once.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from multiprocessing import shared_memory
from typing import Iterable
from urllib.parse import urlparse

import httpx
import torch

TRANSPORTS = ("auto", "shm", "cuda_ipc", "broadcast", "disk")


# ----------------------------------------------------------------------------------------------
# buckets: lists of (hf_name, tensor) whose bytes add up to about `bucket_bytes`


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int):
    """Group tensors into buckets of at most `bucket_bytes` (a larger tensor travels alone)."""
    bucket, size = [], 0
    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def bucket_layout(bucket: list[tuple[str, torch.Tensor]]) -> tuple[list[list], int]:
    """[[name, dtype, shape, byte_offset], ...] and the total size; offsets 64-byte aligned."""
    metas, offset = [], 0
    for name, t in bucket:
        metas.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset])
        offset += (t.numel() * t.element_size() + 63) // 64 * 64
    return metas, offset


def flatten_bucket(bucket: list[tuple[str, torch.Tensor]], out: torch.Tensor | None = None):
    """Copy a bucket into one flat uint8 tensor (`out` if given, e.g. a view of shared memory)."""
    metas, total = bucket_layout(bucket)
    flat = out if out is not None else torch.zeros(total, dtype=torch.uint8)
    for (_, t), (_, _, _, off) in zip(bucket, metas):
        src = t.detach().contiguous().view(-1).view(torch.uint8)  # (nbytes,) raw bytes of the tensor
        flat[off:off + src.numel()].copy_(src)
    return flat, metas


def unflatten_bucket(flat: torch.Tensor, metas: list[list]) -> list[tuple[str, torch.Tensor]]:
    """Inverse of `flatten_bucket`: views into `flat` (clone them if `flat` goes away)."""
    out = []
    for name, dtype, shape, off in metas:
        dt = getattr(torch, dtype)
        n = dt.itemsize
        for s in shape:
            n *= s
        out.append((name, flat[off:off + n].view(dt).view(shape)))
    return out


def checksum(flat: torch.Tensor) -> float:
    return float(flat.to(torch.float64).sum())


# ----------------------------------------------------------------------------------------------
# choosing a transport


def is_local(url: str) -> bool:
    host = urlparse(url).hostname or ""
    if host in ("localhost", "127.0.0.1", "::1") or host.startswith("127."):
        return True
    try:
        return host in (socket.gethostname(), socket.gethostbyname(socket.gethostname()))
    except OSError:
        return False


def pick_transport(url: str, requested: str) -> str:
    if requested not in TRANSPORTS:
        raise ValueError(f"transfer={requested!r} is not a transport; choose one of {TRANSPORTS}")
    if requested != "auto":
        return requested
    if is_local(url):
        return "cuda_ipc" if torch.cuda.is_available() else "shm"
    return "broadcast"


# ----------------------------------------------------------------------------------------------
# sender side (trainer rank 0)


def _post(client: httpx.Client, url: str, path: str, payload: dict, timeout: float = 600.0) -> dict:
    r = client.post(url.rstrip("/") + path, json=payload, timeout=timeout)
    if r.status_code >= 400:
        raise RuntimeError(f"engine {url}{path} answered HTTP {r.status_code}: {r.text[:500]}")
    return r.json() if r.content else {}


def push_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], engine_urls: list[str], version: int, *,
                 transport: str = "auto", bucket_mb: float = 64, config_dir: str | None = None) -> dict:
    """Send all weights to every engine in buckets, then set the engines' weight version.

    Engines are paused in place around the update, so requests in flight keep their KV cache and
    continue with the new weights (partial rollouts survive; each token records the version that
    produced it). Returns `weights/` metrics: bytes, buckets, seconds and GB/s per transport.
    """
    t0 = time.perf_counter()
    bucket_bytes = int(bucket_mb * 2**20)
    groups: dict[str, list[str]] = {}
    for url in engine_urls:
        groups.setdefault(pick_transport(url, transport), []).append(url)
    stats = {"weights/version": version, "weights/buckets": 0, "weights/bytes": 0}
    with httpx.Client() as client:
        for url in engine_urls:
            _post(client, url, "/pause_generation", {"mode": "in_place"})
        try:
            tensors = list(named_tensors)  # rank 0 holds them anyway; several transports may read them
            for kind, urls in groups.items():
                n, nbytes = {"shm": _push_shm, "cuda_ipc": _push_cuda_ipc, "broadcast": _push_broadcast,
                             "disk": _push_disk}[kind](client, tensors, urls, bucket_bytes, config_dir)
                stats["weights/buckets"] += n
                stats["weights/bytes"] += nbytes
            for url in engine_urls:
                # abort_all_requests defaults to true in SGLang: requests in flight must survive the update
                _post(client, url, "/update_weight_version", {"new_version": str(version), "abort_all_requests": False})
        finally:
            for url in engine_urls:
                _post(client, url, "/continue_generation", {})
    stats["weights/seconds"] = time.perf_counter() - t0
    stats["weights/gbps"] = stats["weights/bytes"] / max(stats["weights/seconds"], 1e-9) / 1e9
    return stats


def _push_shm(client, tensors, urls, bucket_bytes, config_dir):
    """One shared-memory segment per bucket, written once, read by every local engine."""
    n = nbytes = 0
    for bucket in iter_buckets(tensors, bucket_bytes):
        metas, total = bucket_layout(bucket)
        shm = shared_memory.SharedMemory(create=True, size=max(total, 1), name=f"loongsage_{uuid.uuid4().hex[:16]}")
        try:
            flat = torch.frombuffer(shm.buf, dtype=torch.uint8, count=total) if total else torch.empty(0, dtype=torch.uint8)
            flatten_bucket(bucket, out=flat)
            desc = json.dumps({"shm": shm.name, "size": total, "tensors": metas, "checksum": checksum(flat)})
            payload = {"serialized_named_tensors": [desc], "load_format": "shm", "flush_cache": False}
            with ThreadPoolExecutor(len(urls)) as pool:
                list(pool.map(lambda u: _post(client, u, "/update_weights_from_tensor", payload), urls))
            del flat
        finally:
            shm.close()
            shm.unlink()
        n, nbytes = n + 1, nbytes + total
    return n, nbytes


def _push_cuda_ipc(client, tensors, urls, bucket_bytes, config_dir):
    """SGLang's own format: base64 of torch's ForkingPickler dump of [(name, cuda_tensor), ...]."""
    from torch.multiprocessing.reductions import ForkingPickler
    import io
    n = nbytes = 0
    for bucket in iter_buckets(tensors, bucket_bytes):
        bucket = [(name, t.detach().cuda().contiguous()) for name, t in bucket]
        buf = io.BytesIO()
        ForkingPickler(buf).dump(bucket)
        payload = {"serialized_named_tensors": [base64.b64encode(buf.getvalue()).decode()], "flush_cache": False}
        for url in urls:
            _post(client, url, "/update_weights_from_tensor", payload)
        torch.cuda.synchronize()
        n, nbytes = n + 1, nbytes + sum(t.numel() * t.element_size() for _, t in bucket)
    return n, nbytes


_BROADCAST_GROUPS: dict[tuple, object] = {}


def _push_broadcast(client, tensors, urls, bucket_bytes, config_dir):
    """Flat buckets broadcast from rank 0 (this process) to every engine over one process group."""
    key = tuple(urls)
    if key not in _BROADCAST_GROUPS:
        addr = socket.gethostbyname(socket.gethostname()) if not all(is_local(u) for u in urls) else "127.0.0.1"
        port, backend = free_port(), ("nccl" if torch.cuda.is_available() else "gloo")
        world = 1 + len(urls)  # one rank per engine (an SGLang engine with TP>1 would take several)
        with ThreadPoolExecutor(len(urls)) as pool:
            futs = [pool.submit(_post, client, u, "/init_weights_update_group", {
                "master_address": addr, "master_port": port, "rank_offset": 1 + i, "world_size": world,
                "group_name": "loongsage", "backend": backend}) for i, u in enumerate(urls)]
            group = new_gloo_group(addr, port, 0, world)
            [f.result() for f in futs]
        _BROADCAST_GROUPS[key] = group
    group = _BROADCAST_GROUPS[key]
    n = nbytes = 0
    for bucket in iter_buckets(tensors, bucket_bytes):
        flat, metas = flatten_bucket(bucket)
        payload = {"names": [m[0] for m in metas], "dtypes": [m[1] for m in metas], "shapes": [m[2] for m in metas],
                   "group_name": "loongsage", "flush_cache": False, "checksum": checksum(flat)}
        with ThreadPoolExecutor(len(urls)) as pool:
            futs = [pool.submit(_post, client, u, "/update_weights_from_distributed", payload) for u in urls]
            group.broadcast(flat, 0).wait()
            [f.result() for f in futs]
        n, nbytes = n + 1, nbytes + flat.numel()
    return n, nbytes


def _push_disk(client, tensors, urls, bucket_bytes, config_dir):
    """Write an HF directory (safetensors + the source config/tokenizer files) and point engines at it."""
    from safetensors.torch import save_file
    out = tempfile.mkdtemp(prefix="loongsage_weights_")
    try:
        if config_dir:
            for f in os.listdir(config_dir):
                if f.endswith((".json", ".jinja", ".txt", ".model")) and f != "model.safetensors.index.json":
                    shutil.copy(os.path.join(config_dir, f), out)
        state = {name: t.detach().contiguous().cpu() for name, t in tensors}
        save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        for url in urls:
            _post(client, url, "/update_weights_from_disk", {"model_path": out})
        return 1, sum(t.numel() * t.element_size() for t in state.values())
    finally:
        shutil.rmtree(out, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------------
# receiver side (used by the engine's HTTP handlers in rollout.py)


def read_shm_bucket(descriptor: str) -> list[tuple[str, torch.Tensor]]:
    """Copy one shared-memory bucket out into tensors (the sender unlinks the segment after)."""
    d = json.loads(descriptor)
    if d["size"] == 0:
        flat = torch.empty(0, dtype=torch.uint8)
    elif os.path.exists(f"/dev/shm/{d['shm']}"):
        # Linux: a private mapping of the segment's file; it stays valid after the sender unlinks it,
        # and no resource tracker gets involved.
        flat = torch.from_file(f"/dev/shm/{d['shm']}", shared=False, size=d["size"], dtype=torch.uint8)
    else:  # other POSIX systems: attach, copy, detach
        shm = shared_memory.SharedMemory(name=d["shm"])
        try:
            flat = torch.frombuffer(shm.buf, dtype=torch.uint8, count=d["size"]).clone()
        finally:
            shm.close()
    verify_checksum(flat, d.get("checksum"))
    return unflatten_bucket(flat, d["tensors"])


def verify_checksum(flat: torch.Tensor, expected: float | None) -> None:
    if expected is not None and checksum(flat) != expected:
        raise ValueError(f"weight bucket checksum mismatch: got {checksum(flat)}, sender wrote {expected}; "
                         "the copy was torn or misaligned")


def new_gloo_group(master_address: str, master_port: int, rank: int, world_size: int, timeout_s: float = 300):
    """A standalone process group (not the default one) between the trainer and engines.

    Built from a TCPStore directly, so it lives beside whatever default group the process has
    (Megatron's, in the trainer). On GPU, SGLang builds its own NCCL group from the same fields.
    """
    import torch.distributed as dist
    store = dist.TCPStore(master_address, int(master_port), world_size, is_master=(rank == 0),
                          timeout=timedelta(seconds=timeout_s))
    return dist.ProcessGroupGloo(dist.PrefixStore("loongsage_weights", store), rank, world_size,
                                 timedelta(seconds=timeout_s))


def recv_broadcast(group, names: list[str], dtypes: list[str], shapes: list[list[int]],
                   expected_checksum: float | None = None) -> list[tuple[str, torch.Tensor]]:
    """Receive one flat bucket broadcast by rank 0 and split it into named tensors."""
    metas, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        dt = getattr(torch, dtype.removeprefix("torch."))
        n = dt.itemsize
        for s in shape:
            n *= s
        metas.append([name, dtype.removeprefix("torch."), list(shape), offset])
        offset += (n + 63) // 64 * 64
    flat = torch.empty(offset, dtype=torch.uint8)
    group.broadcast(flat, 0).wait()
    verify_checksum(flat, expected_checksum)
    return unflatten_bucket(flat, metas)
