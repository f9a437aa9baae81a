"""TransferMesh: trainer -> rollout engines weight sync, over the fastest path each receiver has (docs/TRANSFERMESH.md:
the transports, buckets and streaming, and what each costs).

Trainer rank 0 calls `push_weights` with a stream of HF-named tensors (trainer.py gathers them over TP/EP/PP one at a
time, on the device, as the stream is read; no rank holds the whole model) while the controller holds the engines
paused (fleet.update_engines). It speaks SGLang 0.5.23's weight-update contract (/work/shared/SGLANG_CONTRACT.md):
every update sits inside `POST /begin_weight_update {"selector": "all"}` ... `POST /end_weight_update {}`; tensors
travel in buckets in SGLang's "flattened_bucket" layout (bytes back to back, each offset a multiple of its dtype's
size), each cut from the stream as it arrives, sent, and let go before the next is gathered (`buckets_with_last`);
the last bucket carries `weight_version`. One persistent HTTP connection per engine serves every sync. The receiver
side is the CPU engine's endpoints (cpu_engine.py), using the helpers at the bottom of this file.

Transports, per engine by `pick_transport` or `transfer=` in the recipe: `shm`, `cuda_ipc`, `broadcast`, `disk`, or a
user's push function by dotted path, `push(tensors, engines, bucket_bytes, config_dir, version) -> (buckets, bytes)`,
called inside the engines' weight-update session (docs/EXTENDING.md). Every bucket carries an XXH3-64 checksum per
8 MB chunk (a LoongSage field SGLang ignores); the CPU engine refuses a bucket that does not match and keeps its old
weights. `rss_bytes` and `trim_freed_memory` serve the colocated memory hand-off.

Processes: senders and receivers of shm buckets are separate processes, as in a run (trainer rank 0, engine actors).
torch's shared-memory manager table is per process, and a new segment is registered with whichever manager the table
lists first: a process that has mapped another sender's segment and then allocates its own can reach that sender's
manager after it exited (RuntimeError: Broken pipe).

Test: tests/test_transfermesh.py; `python bench.py sync` measures each transport against a memcpy.
Left out: RDMA/NIXL transports, pipelining buckets over several collectives at once, and atomicity across
buckets (a refused bucket leaves the earlier buckets of the same sync loaded, as in SGLang; the weight version
only moves when the last bucket lands).
"""
from __future__ import annotations

import base64
import binascii
import contextlib
import ctypes
import ctypes.util
import hashlib
import io
import itertools
import os
import pickle
import queue
import random
import shutil
import socket
import tempfile
import time
import types
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from typing import Collection, Iterable
from urllib.parse import urlparse

import httpx
import numpy as np
import torch
import torch.distributed as dist
import xxhash
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world
from torch.multiprocessing import reductions  # importing it also registers torch's tensor reducers with ForkingPickler

import convert
import data
import lora

TRANSPORTS = ("auto", "shm", "cuda_ipc", "broadcast", "disk")


# ----------------------------------------------------------------------------------------------
# buckets: lists of (hf_name, tensor) whose bytes add up to about `bucket_bytes`, in SGLang's flattened layout


def _nbytes(dtype: torch.dtype, shape) -> int:
    n = dtype.itemsize
    for s in shape:
        n *= int(s)
    return n


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int):
    """Group tensors into buckets of at most `bucket_bytes` (a larger tensor travels alone). A tensor whose
    offset in the packed layout would not be a multiple of its dtype's size starts a new bucket."""
    for bucket, _ in buckets_with_last(named_tensors, bucket_bytes):
        yield bucket


def buckets_with_last(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int):
    """(bucket, is_last) pairs of `iter_buckets`, reading `named_tensors` lazily: a bucket is handed on as soon as
    the next tensor does not fit, so besides the bucket only that one tensor has been read (a stream gathered
    tensor by tensor never has two buckets alive here); the last is known when the stream ends."""
    bucket, size = [], 0
    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > bucket_bytes or size % t.element_size()):
            yield bucket, False
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket, True


def packed_layout(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> tuple[list[list], int]:
    """SGLang's flattened_bucket layout: [[name, dtype, shape, byte_offset], ...] back to back, no padding,
    and the total size. Raises ValueError (SGLang's "Unaligned received tensor") if an offset is not a multiple
    of its tensor's dtype size, as SGLang's receiver would."""
    metas, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        dt = getattr(torch, str(dtype).removeprefix("torch."), None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"tensor {name!r} has dtype {dtype!r}, which is not a torch dtype name")
        if offset % dt.itemsize:
            raise ValueError(f"Unaligned received tensor {name!r}: offset {offset} is not a multiple of its dtype "
                             f"size {dt.itemsize} ({dtype}); order the bucket so each offset is aligned")
        metas.append([name, str(dt).removeprefix("torch."), [int(s) for s in shape], offset])
        offset += _nbytes(dt, shape)
    return metas, offset


def bucket_layout(bucket: list[tuple[str, torch.Tensor]]) -> tuple[list[list], int]:
    """[[name, dtype, shape, byte_offset], ...] of a bucket in the packed layout, and its total size."""
    return packed_layout([n for n, _ in bucket], [str(t.dtype) for _, t in bucket], [list(t.shape) for _, t in bucket])


def flatten_bucket(bucket: list[tuple[str, torch.Tensor]], out: torch.Tensor | None = None):
    """Copy a bucket into one flat uint8 tensor (`out` if given, e.g. a view of shared memory)."""
    metas, total = bucket_layout(bucket)
    device = bucket[0][1].device if bucket else None  # on the tensors' device: a GPU bucket never visits the host
    flat = out if out is not None else torch.empty(total, dtype=torch.uint8, device=device)
    for (_, t), (_, _, _, off) in zip(bucket, metas):
        src = t.detach().contiguous().view(-1).view(torch.uint8)  # (nbytes,) raw bytes of the tensor
        flat[off:off + src.numel()].copy_(src)
    return flat, metas


def unflatten_bucket(flat: torch.Tensor, metas: list[list]) -> list[tuple[str, torch.Tensor]]:
    """Inverse of `flatten_bucket`: views into `flat` (clone them if `flat` goes away)."""
    out = []
    for name, dtype, shape, off in metas:
        dt = getattr(torch, dtype)
        out.append((name, flat[off:off + _nbytes(dt, shape)].view(dt).view(shape)))
    return out


CHECKSUM_CHUNK = 8 * 2**20  # bytes per checksum entry: the list locates the first damaged chunk in an error


def checksum(flat: torch.Tensor) -> list[int]:
    """XXH3-64 of each CHECKSUM_CHUNK-byte chunk of a flat uint8 tensor, in order. XXH3 mixes every byte with its
    position, so a flipped bit, two chunks that trade places (the list is positional, and within a chunk the hash
    is order-sensitive) or shifted bytes change it except with probability ~2**-64 per chunk. Chosen over CRC32
    for speed: XXH3 hashes faster than a memcpy, where CRC32 bounded a shared-memory sync at ~0.1x a memcpy."""
    buf = memoryview(flat.contiguous().numpy()) if flat.numel() else memoryview(b"")
    return [xxhash.xxh3_64_intdigest(buf[i:i + CHECKSUM_CHUNK]) for i in range(0, max(len(buf), 1), CHECKSUM_CHUNK)]


def verify_checksum(flat: torch.Tensor, expected: list[int] | None) -> None:
    """Raise ValueError if the bucket's bytes do not match the sender's checksum (None: nothing to check)."""
    if expected is None:
        return
    got = checksum(flat)
    if got != list(expected):
        bad = [i for i, (a, b) in enumerate(zip(got, expected)) if a != b] or ["count"]
        raise ValueError(f"weight bucket checksum mismatch: XXH3-64 {got} over {flat.numel()} bytes, the sender wrote "
                         f"{list(expected)} (first differing chunk: {bad[0]}); the bytes were corrupted, reordered or "
                         f"shifted in transit, so the bucket was not loaded and the engine keeps its old weights")


def adapter_sha256(named) -> dict[str, str]:
    """SGLang 0.5.23's `expected_checksums` of an adapter: sha256 hex of each full tensor's bytes (host copy), by name.
    SGLang checks them on every TP rank before slicing, so they are of the full tensors."""
    return {n: hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for n, t in named}


def verify_adapter_sha256(named: list[tuple[str, torch.Tensor]], expected: dict[str, str] | None) -> None:
    """SGLang 0.5.23's `expected_checksums` of /load_lora_adapter_from_tensors (None: nothing to check): sha256 hex
    of each tensor's bytes by name. Raise ValueError, as SGLang refuses the adapter, on any value mismatch, any
    expected name missing or any tensor not expected."""
    if expected is None:
        return
    if not isinstance(expected, dict):
        raise ValueError("expected_checksums must map tensor names to sha256 hex strings, "
                         f"got {type(expected).__name__}")
    got = adapter_sha256(named)
    mismatch = [n for n, want in expected.items() if n in got and got[n] != want]
    missing, extra = [n for n in expected if n not in got], [n for n in got if n not in expected]
    if mismatch or missing or extra:
        raise ValueError(f"adapter sync mismatch of {len(expected)} expected tensors (sha256): {len(mismatch)} "
                         f"value-diff {mismatch[:5]}, {len(missing)} missing {missing[:5]}, {len(extra)} extra "
                         f"{extra[:5]}; the adapter was not loaded")


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


def pick_transport(url: str, requested: str, remote: bool = False) -> str:
    """The transport `auto` means for the engine at `url`: shared memory (CPU) or CUDA IPC (GPU) where it is on the
    sender's machine, else a broadcast. `remote`: the engine is on another Ray node than the sender (the controller
    knows from the placement, fleet.off_node), which settles it whatever the URL's host looks like: Ray nodes are
    placed as separate machines even when two of them share one (a test cluster), and a hostname can resolve to a
    different address than the one an engine binds."""
    if data.is_dotted(requested):  # a user's transport (see push_weights)
        return requested
    if requested not in TRANSPORTS:
        raise ValueError(f"transfer={requested!r} is not a transport; choose one of {TRANSPORTS} or a dotted path "
                         "'module.function' to your own")
    if requested != "auto":
        return requested
    if not remote and is_local(url):
        return "cuda_ipc" if torch.cuda.is_available() else "shm"
    return "broadcast"


# ----------------------------------------------------------------------------------------------
# sender side (the controller pauses/continues; trainer rank 0 pushes)

_CLIENT: httpx.Client | None = None  # one per process: keeps one open connection per engine across syncs


def _client() -> httpx.Client:
    global _CLIENT
    if _CLIENT is None:
        # TCP_NODELAY: without it each small request waits on Nagle's algorithm meeting a delayed ACK
        transport = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        _CLIENT = httpx.Client(timeout=600.0, transport=transport,
                               limits=httpx.Limits(max_keepalive_connections=64, keepalive_expiry=3600))
    return _CLIENT


def _post(url: str, path: str, payload: dict) -> dict:
    r = _client().post(url.rstrip("/") + path, json=payload)
    if r.status_code >= 400:
        raise RuntimeError(f"engine {url}{path} answered HTTP {r.status_code}: {r.text[:500]}")
    try:
        return r.json() if r.content else {}
    except ValueError:
        return {"text": r.text}


def _each(fn, items: list) -> list:
    """fn(item) for every engine at once (threads: each call waits on its own engine)."""
    if len(items) <= 1:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


def pause_engines(engine_urls: list[str]) -> None:
    """Pause generation in place: running requests keep their KV cache and continue after the update."""
    _each(lambda u: _post(u, "/pause_generation", {"mode": "in_place"}), list(engine_urls))


def continue_engines(engine_urls: list[str]) -> None:
    _each(lambda u: _post(u, "/continue_generation", {}), list(engine_urls))


def _engines(engines) -> list[tuple[str, int]]:
    """Accept urls or (url, tp_size) pairs; tp_size is the engine's tensor-parallel size (SGLang's tp_size)."""
    out = []
    for e in engines:
        url, tp = (e, 1) if isinstance(e, str) else (e[0], int(e[1]))
        if tp < 1:
            raise ValueError(f"engine {url} has tp_size {tp}; it must be >= 1 (cfg.gpus_per_engine)")
        out.append((url, tp))
    return out


def push_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], engines: list, version: int, *,
                 transport: str = "auto", bucket_mb: float = 64, config_dir: str | None = None,
                 remote: Collection[str] = ()) -> dict:
    """Send all weights to every engine in buckets inside one weight-update session per engine; the last bucket
    sets the engines' weight version. `engines`: urls, or (url, tp_size) pairs; `remote`: the urls among them on
    another Ray node (pick_transport). `named_tensors` is read once, lazily: only the bucket in hand is held.
    Does not pause: the controller calls `pause_engines` before and `continue_engines` after. Returns `weights/`
    metrics: bytes, buckets, seconds, GB/s and the engines each transport served (`weights/engines_<transport>`)."""
    t0 = time.perf_counter()
    bucket_bytes = int(bucket_mb * 2**20)
    engines = _engines(engines)
    groups: dict[str, list[tuple[str, int]]] = {}
    for url, tp in engines:
        groups.setdefault(pick_transport(url, transport, url in remote), []).append((url, tp))
    # EXT: a dotted path names a user's push function with the built-ins' signature, called inside the engines'
    # weight-update session; it returns (buckets sent, bytes sent)
    pushes = [({"shm": _push_shm, "cuda_ipc": _push_cuda_ipc, "broadcast": _push_broadcast,
                "disk": _push_disk}.get(kind) or data.import_object(kind), group) for kind, group in groups.items()]
    stats = {"weights/version": version, "weights/buckets": 0, "weights/bytes": 0,
             **{f"weights/engines_{kind.rsplit('.', 1)[-1]}": len(group) for kind, group in groups.items()}}
    urls = [u for u, _ in engines]
    _each(lambda u: _post(u, "/begin_weight_update", {"selector": "all"}), urls)
    try:
        if len(pushes) == 1:  # the usual case: the push reads the stream itself
            (push, group), = pushes
            sent = [push(named_tensors, group, bucket_bytes, config_dir, str(version))]
        else:
            sent = _fan_out(named_tensors, pushes, bucket_bytes, config_dir, str(version))
        for n, nbytes in sent:
            stats["weights/buckets"] += n
            stats["weights/bytes"] += nbytes
        if not stats["weights/buckets"]:  # nothing carried the version: set it directly
            # abort_all_requests defaults to true in SGLang: requests in flight must survive the update
            _each(lambda u: _post(u, "/update_weight_version", {"new_version": str(version),
                                                                 "abort_all_requests": False}), urls)
    finally:
        _each(lambda u: _post(u, "/end_weight_update", {}), urls)
    stats["weights/seconds"] = time.perf_counter() - t0
    stats["weights/gbps"] = stats["weights/bytes"] / max(stats["weights/seconds"], 1e-9) / 1e9
    return stats


def adapter_transport(url: str, requested: str, remote: bool = False) -> str:
    """The transport of a LoRA adapter to the engine at `url`: pick_transport's, except that `auto` sends a remote
    engine a PEFT directory ("disk") where full weights would go by broadcast (SGLang has no adapter broadcast)."""
    kind = pick_transport(url, requested, remote)
    return "disk" if kind == "broadcast" and requested == "auto" else kind


def push_adapter(adapters: dict[str, torch.Tensor], config: dict, engines: list, version: int, name: str, *,
                 transport: str = "auto", remote: Collection[str] = ()) -> dict:
    """LoRA: load `adapters` ({PEFT name: full tensor}, lora.gather) into every engine as a new adapter `name` with
    its PEFT `config`, then make `version` the engines' weight version. No weight-update session: SGLang 0.5.23
    loads adapters outside one. One adapter per version: SGLang refuses a name already loaded, and a request keeps
    the adapter it named, so requests in flight finish on their own (AgentFlow names the new one for new requests
    and unloads the old one once unused). `engines`: urls or (url, tp_size) pairs; `remote`: as in push_weights.

    Transports (SGLang has no adapter broadcast): "shm" / "cuda_ipc" send `/load_lora_adapter_from_tensors` one
    payload of the full tensors per TP rank (`tensor_payloads` / `cuda_ipc_payloads`, load_format null); "disk" (what
    `auto` picks for another machine) a PEFT directory and `/load_lora_adapter`. Returns `weights/` metrics."""
    t0 = time.perf_counter()
    engines = _engines(engines)
    tensors = sorted(adapters.items())
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    served = [adapter_transport(u, transport, u in remote) for u, _ in engines]  # each engine's transport
    kinds = set(served)
    for kind in kinds:
        if kind not in ("shm", "cuda_ipc", "disk"):
            raise ValueError(f"transfer={kind!r} cannot carry a LoRA adapter (SGLang 0.5.23 loads adapters from "
                             "tensors or from disk only); use transfer=auto, shm, cuda_ipc or disk")
    # expected_checksums: SGLang's own field (sha256 per tensor), checked by SGLang's TP worker and the CPU engine alike
    fields = {"lora_name": name, "config_dict": config}
    sha = {"expected_checksums": adapter_sha256(tensors)} if kinds & {"shm", "cuda_ipc"} else {}
    if "shm" in kinds:  # written once, read by every local engine
        flat, metas, _ = write_shm_bucket(tensors)

    def load(engine_and_kind):
        (url, tp), kind = engine_and_kind
        if kind == "shm":
            _post(url, "/load_lora_adapter_from_tensors", {**fields, **sha, "load_format": "flattened_bucket",
                                                          "serialized_named_tensors": tensor_payloads(flat, metas, tp)})
        elif kind == "cuda_ipc":
            on_gpu = {n: t.detach().cuda().contiguous() for n, t in tensors}
            _post(url, "/load_lora_adapter_from_tensors", {**fields, **sha, "serialized_named_tensors":
                                                          cuda_ipc_payloads(on_gpu, tp)})
            torch.cuda.synchronize()
        else:
            out = tempfile.mkdtemp(prefix="loongsage_adapter_")
            try:
                _post(url, "/load_lora_adapter",
                      {"lora_name": name, "lora_path": lora.save_peft(adapters, config, out)})
            finally:
                shutil.rmtree(out, ignore_errors=True)
        # abort_all_requests defaults to true in SGLang: requests in flight must survive the version change
        _post(url, "/update_weight_version", {"new_version": str(version), "abort_all_requests": False})
    _each(load, list(zip(engines, served)))
    seconds = time.perf_counter() - t0
    # bytes of one copy, as push_weights counts them: what one engine receives
    return {"weights/version": version, "weights/buckets": 1, "weights/bytes": nbytes, "weights/seconds": seconds,
            "weights/gbps": nbytes / max(seconds, 1e-9) / 1e9,
            **{f"weights/engines_{kind}": served.count(kind) for kind in kinds}}


def _fan_out(named_tensors, pushes, bucket_bytes, config_dir, version) -> list[tuple[int, int]]:
    """Engines on several transports: each push reads the one stream in a thread of its own, every tensor handed to
    all of them before the next is read (a queue of one each), so the stream is read once and never held whole;
    each push holds at most its own bucket."""
    end = object()
    queues = [queue.Queue(maxsize=1) for _ in pushes]

    def feed(q):
        while (item := q.get()) is not end:
            yield item

    with ThreadPoolExecutor(len(pushes), thread_name_prefix="push") as pool:
        futs = [pool.submit(push, feed(q), group, bucket_bytes, config_dir, version)
                for (push, group), q in zip(pushes, queues)]
        for item in itertools.chain(named_tensors, [end]):
            for q, fut in zip(queues, futs):
                while not fut.done():  # a push that failed reads no more: its error surfaces below
                    with contextlib.suppress(queue.Full):
                        q.put(item, timeout=1)
                        break
        return [f.result() for f in futs]


def _update_fields(last: bool, version: str) -> dict:
    """Fields every update request carries: no cache flush (requests are running, paused in place), no abort,
    and the new version on the last bucket only (SGLang sets it when that request succeeds)."""
    fields = {"flush_cache": False, "abort_all_requests": False}
    if last:
        fields["weight_version"] = version
    return fields


_SEGMENT: list = []  # [uint8 tensor in shared memory, numpy view of it]: one segment of two halves, every sync


@contextlib.contextmanager
def _file_system_sharing():
    """torch's "file_system" sharing strategy inside: storage is a named file in /dev/shm any process can map. The
    default "file_descriptor" strategy authenticates with the sender's authkey, so only its own children could open
    it (an engine started by Ray gets AuthenticationError). Scoped: the process-wide default is left as it was."""
    old = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(old)


def reserve_shm(nbytes: int) -> None:
    """Make this process's segment hold two buckets of `nbytes` (a new segment if it is smaller; the old one lives
    while a receiver still maps it)."""
    half = -(-max(nbytes, 1) // 4096) * 4096  # whole pages: the second half starts aligned for any dtype's view
    if not _SEGMENT or _SEGMENT[0].numel() < 2 * half:
        _SEGMENT.clear()
        with _file_system_sharing():
            seg = torch.empty(2 * half, dtype=torch.uint8).share_memory_()
        _SEGMENT.extend([seg, seg.numpy()])


HASH_STEP = 2**20  # bytes copied into the segment, then hashed while they are still in cache


def write_shm_bucket(bucket: list[tuple[str, torch.Tensor]],
                     half: int = 0) -> tuple[torch.Tensor, list[list], list[int]]:
    """Write a bucket into one half (0 or 1) of this process's shared-memory segment in the packed layout; returns
    the bucket's bytes (a view of the segment), its layout and its checksum. Two halves let the next bucket be
    written while receivers copy the previous one out. The segment is reused because fresh pages cost a page fault
    each on first write; a half is written again only after every receiver answered the request that read it.
    Copy and checksum are one pass: each HASH_STEP piece is hashed right after it is copied, while in cache; the
    streamed XXH3 equals the one-shot hash, so the list is exactly `checksum()` of the bytes."""
    metas, total = bucket_layout(bucket)
    reserve_shm(total)
    seg_t, seg = _SEGMENT
    base = half * (seg.size // 2)  # byte offset of the half in the segment
    sums, h = [], xxhash.xxh3_64()  # one XXH3-64 per CHECKSUM_CHUNK bytes of the bucket, in order
    for (_, t), (*_, off) in zip(bucket, metas):
        src = t.detach().contiguous().view(-1).view(torch.uint8).numpy()  # (nbytes,) raw bytes of the tensor
        pos, end = off, off + src.size  # this tensor's bytes in the bucket
        while pos < end:
            stop = min(end, (pos // HASH_STEP + 1) * HASH_STEP)  # pieces never cross a HASH_STEP (so chunk) boundary
            piece = seg[base + pos:base + stop]
            # numpy's copy: torch's copy_ into this MAP_SHARED mapping is many times slower (docs/TRANSFERMESH.md)
            np.copyto(piece, src[pos - off:stop - off])
            h.update(piece)
            pos = stop
            if pos % CHECKSUM_CHUNK == 0:
                sums.append(h.intdigest())
                h.reset()
    if total % CHECKSUM_CHUNK or not total:  # the last, partial chunk (an empty bucket hashes the empty string)
        sums.append(h.intdigest())
    return seg_t[base:base + total], metas, sums


def tensor_payloads(flat: torch.Tensor, metas: list[list], tp_size: int) -> list[str]:
    """SGLang 0.5.23's serialized_named_tensors for a load_format "flattened_bucket" update: per TP rank, base64 of
    a ForkingPickler dump of {"flattened_tensor": uint8 tensor, "metadata": [FlattenedTensorMetadata]}. The tensor
    travels as a handle of its shared-memory storage, so the receiver maps the sender's bytes. The metadata are
    SimpleNamespaces with FlattenedTensorMetadata's fields (SGLang reads them by attribute and its SafeUnpickler
    allows them; its own class would need sglang here). One dump per TP rank: each takes one storage reference."""
    meta = [types.SimpleNamespace(name=name, shape=torch.Size(shape), dtype=getattr(torch, dtype), start_idx=off,
                                  end_idx=off + _nbytes(getattr(torch, dtype), shape),
                                  numel=_nbytes(getattr(torch, dtype), shape)) for name, dtype, shape, off in metas]
    out = []
    for _ in range(tp_size):
        buf = io.BytesIO()
        with _file_system_sharing():
            ForkingPickler(buf).dump({"flattened_tensor": flat, "metadata": meta})
        out.append(base64.b64encode(buf.getvalue()).decode())
    return out


def release_shm() -> None:
    """Give back this process's shared-memory staging (colocated hand-off): the sender's kept segment and the
    receiver's kept mapping of one. The next sync creates / maps them again (first-touch page faults once)."""
    _SEGMENT.clear()
    _MAPPED.clear()


def _push_shm(tensors, engines, bucket_bytes, config_dir, version):
    """Each bucket written once into shared memory, read by every local engine. The segment's halves alternate:
    bucket i+1 is written while the engines copy bucket i out (one request in flight, so buckets load in order and
    the version-carrying last one last)."""
    n = nbytes = 0
    pending = None
    with ThreadPoolExecutor(1, thread_name_prefix="shm-update") as pool:
        for bucket, last in buckets_with_last(tensors, bucket_bytes):
            if n == 0:  # halves of a full bucket (unless this one is all there is): later buckets fit them
                reserve_shm(max(bucket_layout(bucket)[1], 0 if last else bucket_bytes))
            # a tensor larger than a bucket grows the segment; the pending request keeps the old one mapped
            flat, metas, sums = write_shm_bucket(bucket, half=n % 2)
            del bucket
            # checksum: a LoongSage field (SGLang ignores unknown fields); the CPU engine verifies it before loading
            body = {"load_format": "flattened_bucket", "checksum": sums, **_update_fields(last, version)}
            if pending is not None:
                pending.result()  # bucket n-1 loaded everywhere; also frees the half bucket n+1 will overwrite
            pending = pool.submit(_each, lambda e, flat=flat, metas=metas, body=body: _post(
                e[0], "/update_weights_from_tensor",
                {"serialized_named_tensors": tensor_payloads(flat, metas, e[1]), **body}), engines)
            n, nbytes = n + 1, nbytes + flat.numel()
        if pending is not None:
            pending.result()
    return n, nbytes


def _device_uuid(index: int) -> str:
    """The UUID of this process's CUDA device `index` (CUDA only)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def _reduce_tensor_with_device_uuid(t: torch.Tensor):
    """torch's own reduction of a tensor for ForkingPickler, with a CUDA storage's device index replaced by the
    device's UUID, which SGLang 0.5.23's receiver (utils/patch_torch.py) maps back to its own index: a bare index
    names another GPU whenever the two sides' CUDA_VISIBLE_DEVICES differ. Argument 6 is the storage device."""
    rebuild, args = reductions.reduce_tensor(t)
    if rebuild is reductions.rebuild_cuda_tensor:
        args = (*args[:6], _device_uuid(args[6]), *args[7:])
    return rebuild, args


def cuda_ipc_payloads(bucket: list[tuple[str, torch.Tensor]] | dict[str, torch.Tensor], tp_size: int) -> list[str]:
    """SGLang's serialized_named_tensors for one bucket: base64 of a ForkingPickler dump of [(name, tensor), ...]
    (a weight update) or {name: tensor} (a LoRA adapter), one per TP rank: CUDA IPC counts references per dump,
    so one dump read by two ranks would be released twice. Devices travel as UUIDs; the dump holds only what
    SGLang's SafeUnpickler allows. Works on CPU tensors too (shared-memory handles)."""
    out = []
    for _ in range(tp_size):
        buf = io.BytesIO()
        pickler = ForkingPickler(buf)
        pickler.dispatch_table[torch.Tensor] = _reduce_tensor_with_device_uuid
        pickler.dispatch_table[torch.nn.Parameter] = _reduce_tensor_with_device_uuid
        pickler.dump(bucket)
        out.append(base64.b64encode(buf.getvalue()).decode())
    return out


def _push_cuda_ipc(tensors, engines, bucket_bytes, config_dir, version):
    """Each bucket's tensors shared by CUDA IPC handle where they lie (no host copy); every engine TP rank copies
    them into its weights before its request returns, then the next bucket is gathered."""
    n = nbytes = 0
    for bucket, last in buckets_with_last(tensors, bucket_bytes):
        bucket = [(name, t.detach().cuda().contiguous()) for name, t in bucket]
        fields = _update_fields(last, version)
        _each(lambda e: _post(e[0], "/update_weights_from_tensor", {
            "serialized_named_tensors": cuda_ipc_payloads(bucket, e[1]), **fields}), engines)
        torch.cuda.synchronize()
        n, nbytes = n + 1, nbytes + sum(t.numel() * t.element_size() for _, t in bucket)
    return n, nbytes


# engine set -> (group name, this side's group): the set the last broadcast went to. A new set gets a group of a new
# name, the old one destroyed on both sides first (torch refuses two groups of one name; SGLang keeps the old one).
_BROADCAST_GROUPS: dict[tuple, tuple[str, object]] = {}


def _destroy_broadcast_groups() -> None:
    for engines in list(_BROADCAST_GROUPS):
        name, group = _BROADCAST_GROUPS.pop(engines)
        for url, _ in engines:
            with contextlib.suppress(RuntimeError, httpx.HTTPError):  # a dead engine took its side of the group
                _post(url, "/destroy_weights_update_group", {"group_name": name})
        dist.destroy_process_group(group)  # registered by name (new_sglang_group): the name is free again


def broadcast_ranks(engines: list[tuple[str, int]]) -> tuple[list[int], int]:
    """Each engine's rank_offset and the group's world size: the trainer is rank 0, then every TP rank of
    every engine (SGLang: rank = rank_offset + tp_rank)."""
    offsets, nxt = [], 1
    for _, tp in engines:
        offsets.append(nxt)
        nxt += tp
    return offsets, nxt


def _push_broadcast(tensors, engines, bucket_bytes, config_dir, version):
    """Flattened buckets broadcast from rank 0 (this process) to every engine rank over one process group."""
    key = tuple(engines)
    if key not in _BROADCAST_GROUPS:
        _destroy_broadcast_groups()
        name = f"loongsage-{uuid.uuid4().hex[:8]}"
        urls = [u for u, _ in engines]
        addr = socket.gethostbyname(socket.gethostname()) if not all(is_local(u) for u in urls) else "127.0.0.1"
        port, backend = free_port(), ("nccl" if torch.cuda.is_available() else "gloo")
        offsets, world = broadcast_ranks(engines)
        with ThreadPoolExecutor(len(engines)) as pool:
            futs = [pool.submit(_post, u, "/init_weights_update_group", {
                "master_address": addr, "master_port": port, "rank_offset": off, "world_size": world,
                "group_name": name, "backend": backend}) for u, off in zip(urls, offsets)]
            # SGLang's rendezvous on every backend (gloo too), so a CPU trainer meets a real SGLang as a GPU one does
            group = new_sglang_group(addr, port, 0, world, name, backend)
            [f.result() for f in futs]
        _BROADCAST_GROUPS[key] = (name, group)
    name, group = _BROADCAST_GROUPS[key]
    n = nbytes = 0
    for bucket, last in buckets_with_last(tensors, bucket_bytes):
        flat, metas = flatten_bucket(bucket)  # on the bucket's device: a GPU bucket is packed and sent in place
        del bucket
        # the checksum where the bytes are on the host; a GPU bucket is not copied out to hash it (SGLang ignores
        # the field, and NCCL checks its own transfers)
        crc = {"checksum": checksum(flat)} if flat.device.type == "cpu" else {}
        if torch.cuda.is_available():  # NCCL broadcasts device memory
            flat = flat.cuda()
        payload = {"names": [m[0] for m in metas], "dtypes": [m[1] for m in metas], "shapes": [m[2] for m in metas],
                   "group_name": name, "load_format": "flattened_bucket", **crc, **_update_fields(last, version)}
        with ThreadPoolExecutor(len(engines)) as pool:
            futs = [pool.submit(_post, u, "/update_weights_from_distributed", payload) for u, _ in engines]
            group.broadcast(flat, 0).wait()
            [f.result() for f in futs]
        n, nbytes = n + 1, nbytes + flat.numel()
    return n, nbytes


def _push_disk(tensors, engines, bucket_bytes, config_dir, version):
    """Write an HF directory (safetensors shards of one bucket each + the source config/tokenizer files) and point
    engines at it."""
    out = tempfile.mkdtemp(prefix="loongsage_weights_")
    try:
        shards, nbytes = convert.save_hf_dir(tensors, out, config_dir or out, shard_bytes=bucket_bytes)
        _each(lambda e: _post(e[0], "/update_weights_from_disk", {
            "model_path": out, **_update_fields(True, version)}), engines)
        return shards, nbytes
    finally:
        shutil.rmtree(out, ignore_errors=True)


_given_ports: set[int] = set()  # handed out by free_port in this process: never twice


def free_port(host: str = "") -> int:
    """A TCP port another process will bind in a moment, free now and below the kernel's ephemeral range: a bind(0)
    port is ephemeral, and any outgoing connection (Ray opens many) may take it first (EADDRINUSE). Drawn from its
    own RNG, never the seeded global one a run's reproducibility rests on."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: the IANA range, macOS's default
        low = 49152
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.randrange(max(1024, low - 16384), low)
        if port in _given_ports:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:  # taken: draw again
                continue
        _given_ports.add(port)
        return port
    with socket.socket() as s:  # 200 taken ports in a row: let the kernel choose
        s.bind((host, 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------------
# process memory, for the colocated hand-off (engines and trainers give memory back between phases)


def rss_bytes() -> int:
    """This process's resident memory in bytes (Linux /proc; 0 where it is not available)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def reset_peak_rss() -> None:
    """Start this process's peak resident memory (VmHWM) afresh from its current RSS: Linux resets it when 5 is
    written to /proc/self/clear_refs (no-op where that file is not writable)."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM) since it started or since `reset_peak_rss`; 0 where unknown.
    The kernel updates it at every page fault that grows RSS, so no sampling can miss a short peak."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, ValueError, StopIteration):
        return 0


def trim_freed_memory() -> None:
    """Return freed heap pages to the OS (glibc's malloc_trim): tensors of a few MB come from malloc's arenas,
    and without a trim their pages stay in this process after a free, so the colocated peer would not get them."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: the allocator decides
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)


# ----------------------------------------------------------------------------------------------
# receiver side (used by the engine's HTTP handlers in cpu_engine.py)


_MAPPED: dict = {}  # "last" -> the last bucket received from shared memory: keeps its mapping for the next one


class _BucketUnpickler(pickle.Unpickler):
    """SGLang 0.5.23's SafeUnpickler (utils/common.py), as far as a tensor update from CPU memory needs it; any other
    global is refused as SGLang refuses it. SGLang's FlattenedTensorMetadata loads as a SimpleNamespace with the same
    fields, so the CPU engine takes both forms without importing sglang."""
    ALLOWED = {("builtins", n) for n in ("bool", "bytearray", "bytes", "complex", "dict", "float", "frozenset", "int",
                                         "list", "range", "set", "slice", "str", "tuple")} | \
        {("collections", n) for n in ("OrderedDict", "defaultdict", "deque", "Counter")} | \
        {("torch._utils", n) for n in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3",
                                       "_rebuild_parameter", "_rebuild_parameter_with_state")} | \
        {("torch.multiprocessing.reductions", n) for n in ("rebuild_tensor", "rebuild_typed_storage",
                                                           "rebuild_typed_storage_child", "rebuild_storage_filename",
                                                           "rebuild_storage_fd", "rebuild_storage_empty")} | \
        {("copyreg", "__newobj__"), ("copyreg", "__newobj_ex__"), ("types", "SimpleNamespace"), ("_codecs", "encode"),
         ("torch", "Size"), ("torch", "Tensor"), ("torch", "device"), ("torch.nn.parameter", "Parameter"),
         ("torch._tensor", "_rebuild_from_type_v2"), ("torch.storage", "UntypedStorage"),
         ("torch.storage", "TypedStorage"), ("multiprocessing.resource_sharer", "DupFd")}

    def find_class(self, module, name):
        if (module, name) == ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"):
            return types.SimpleNamespace
        if (module, name) == ("torch.storage", "_load_from_bytes"):  # a tensor pickled by value, as SGLang loads it
            return lambda b: torch.load(io.BytesIO(b), weights_only=True)
        # torch's dtypes and storage classes by name (torch.float32, torch.FloatStorage, torch.UntypedStorage, ...)
        torch_data = module == "torch" and (isinstance(getattr(torch, name, None), torch.dtype)
                                            or name.endswith("Storage"))
        if (module, name) in self.ALLOWED or torch_data:
            return super().find_class(module, name)
        raise ValueError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization (SGLang's "
                         f"SafeUnpickler refuses it too)")


def read_tensor_payload(entry, load_format: str | None, expected_checksum: list[int] | None = None,
                        adapter: bool = False) -> list[tuple[str, torch.Tensor]]:
    """One serialized_named_tensors entry of `/update_weights_from_tensor` as SGLang 0.5.23 reads it: base64 of a
    ForkingPickler dump; with load_format "flattened_bucket" {"flattened_tensor": uint8, "metadata": [...]} cut into
    tensors as SGLang's FlattenedTensorBucket does; with None a list of (name, tensor) pairs, or with `adapter`
    (`/load_lora_adapter_from_tensors`) a {name: tensor} dict. CPU tensors arrive as handles of the sender's shared
    memory: the engine's copy into its parameters is the only one. A bucket's bytes are verified against the sender's
    checksum (if sent) before any tensor is returned. Raises ValueError on anything SGLang would refuse."""
    try:
        raw = base64.b64decode(entry, validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise ValueError(f"serialized_named_tensors entries are base64 strings of SGLang's MultiprocessingSerializer "
                         f"payload (Expected base64-encoded bytes); got {str(entry)[:80]!r}") from None
    try:
        obj = _BucketUnpickler(io.BytesIO(raw)).load()
    except ValueError:
        raise
    except Exception as e:  # a truncated pickle, or a storage handle that cannot be opened on this machine
        raise ValueError(f"serialized_named_tensors entry could not be unpickled ({type(e).__name__}: {e}); CPU "
                         f"tensors must come from a process on this machine sharing them through torch's "
                         f"file_system strategy") from None
    if load_format is None and adapter:
        if not (isinstance(obj, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in obj.items())):
            raise ValueError(f"load_format null takes a {{name: tensor}} dict for a LoRA adapter (SGLang reads its "
                             f"items()); got {type(obj).__name__}")
        return list(obj.items())
    if load_format is None:
        if not (isinstance(obj, list) and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
                                              and isinstance(p[1], torch.Tensor) for p in obj)):
            raise ValueError(f"load_format null takes a list of (name, tensor) pairs; got {type(obj).__name__}")
        return obj
    if load_format != "flattened_bucket":
        raise ValueError(f"load_format {load_format!r} is not one the CPU engine loads; use 'flattened_bucket' or "
                         f"null (SGLang also takes 'direct' and custom loaders, which need its model classes)")
    try:
        flat, metas = obj["flattened_tensor"], obj["metadata"]
        assert isinstance(flat, torch.Tensor) and flat.dtype == torch.uint8 and flat.dim() == 1, "flattened_tensor"
        verify_checksum(flat, expected_checksum)
        out = [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)) for m in metas]
    except (TypeError, KeyError, AttributeError, AssertionError, RuntimeError) as e:
        raise ValueError(f"a flattened_bucket payload is {{'flattened_tensor': 1-D uint8 tensor, 'metadata': "
                         f"[FlattenedTensorMetadata]}} whose entries cut the tensor into named tensors; this one "
                         f"does not ({type(e).__name__}: {e})") from None
    _MAPPED["last"] = flat  # the sender reuses its segment: keeping it mapped saves a page fault per page per sync
    return out


def new_sglang_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                     backend: str = "nccl", timeout_s: float = 300):
    """The trainer's side of an SGLang weight-update group, built as SGLang 0.5.23's `init_custom_process_group`
    builds its side: a TCP store hosted by rank 0, prefixed with group_name, then torch's group constructor with that
    name, so both sides use the same store keys."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, int(master_port), world_size, is_master=(rank == 0), timeout=timeout)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                      group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}  # as SGLang's: destroy_process_group reads it
    return pg


def recv_broadcast(group, names: list[str], dtypes: list[str], shapes: list[list[int]],
                   load_format: str | None = None, expected_checksum: list[int] | None = None
                   ) -> list[tuple[str, torch.Tensor]]:
    """Receive what rank 0 broadcasts for one /update_weights_from_distributed call, as SGLang does: with
    load_format "flattened_bucket" one uint8 buffer in the packed layout (checksum verified, if sent); without,
    one broadcast per tensor in `names` order, each of its own dtype and shape."""
    metas, total = packed_layout(names, dtypes, shapes)
    if load_format == "flattened_bucket":
        flat = torch.empty(total, dtype=torch.uint8)
        group.broadcast(flat, 0).wait()
        verify_checksum(flat, expected_checksum)
        return unflatten_bucket(flat, metas)
    if load_format not in (None, "auto"):
        raise ValueError(f"load_format {load_format!r} is not one the CPU engine receives; use "
                         f"'flattened_bucket' or none (one broadcast per tensor)")
    out = []
    for name, dtype, shape, _ in metas:
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        group.broadcast(t, 0).wait()
        out.append((name, t))
    return out
