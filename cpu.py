"""What exists only because there is no GPU: the speed machinery that lets a laptop CPU run the same actors fast.
On GPUs none of it runs (every function here answers "nothing to do" there), so a GPU reader can skip this file.

Why it is needed: Ray reserves CPUs as a count and pins nothing, and torch sizes its thread pool from the whole
machine, so on a 2-core node a trainer and an engine computing at once fight over both cores. In async mode on a
local CPU node each actor is pinned to cores of its own (`actor_cores`, `pin_process`), a trainer rank also
computes on an engine's cores while that engine has nothing to generate (`lent_cores`, `engine_busy_file`), and
every actor gets a torch thread count that fits its share of the machine (`torch_threads`).

Test: `.venv/bin/pytest tests/test_async.py -k "cores or pinned or idle_engine or busy_file" -q` (the core plan on a
8-core node, real pinning of a trainer and an engine, a trainer computing on an idle engine's core), and
`tests/test_loongsage.py -k no_affinity` (no `os.sched_getaffinity`, as on macOS: --check and a run, unpinned).
Left out: NUMA placement and hyper-thread siblings (cores are taken in the order the OS lists them), and pinning on
a Ray cluster (its nodes' cores are not this process's to plan).
"""
from __future__ import annotations

import os
import sys
import tempfile

# --- cores: placing CPU actors on cores (controller side) ---

_NOTED = False  # the "no affinity call here" note is printed once per process


def usable_cores() -> list[int]:
    """The cores this process may run on (`os.sched_getaffinity`, which Linux has). Where the OS has no such call
    (macOS, Windows) nothing is pinned: [] and a one-line note, once."""
    global _NOTED
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    if not _NOTED:
        print("note: no os.sched_getaffinity on this OS (Linux only): CPU actors run unpinned, placed by Ray's "
              "CPU counts alone", file=sys.stderr)
        _NOTED = True
    return []


def torch_threads(cfg) -> tuple[int, int]:
    """(trainer_threads, engine_threads), each as configured or, where 0, derived: async runs trainers and engines
    at once, each on its own Ray CPUs; sync on a CPU runs one phase at a time, so the phase running may use the
    node's cores (split among the actors of that phase)."""
    sync_cpu, cores = cfg.mode == "sync" and cfg.device == "cpu", os.cpu_count() or 1
    trainer = cfg.trainer_threads if cfg.trainer_threads > 0 else \
        max(1, cores // cfg.trainer_workers if sync_cpu else int(cfg.cpus_per_trainer))
    engine = cfg.engine_threads if cfg.engine_threads > 0 else \
        max(1, cores // cfg.num_engines if sync_cpu else int(cfg.cpus_per_engine))
    return trainer, engine


def actor_cores(cfg, kind: str, i: int) -> list[int]:
    """The cores trainer rank i (kind "trainer") or engine i ("engine") is pinned to: in async mode on a local CPU
    node, trainers take trainer_threads cores each from the first, engines engine_threads each after them, so a
    training step and the engine's decoding never share a core (Ray reserves CPUs as a count; it pins nothing).
    The controller and AgentFlow stay unpinned (mostly waiting). [] = no pinning: sync (each phase may use every
    core), GPUs, a Ray cluster, colocated actors, more threads asked for than this machine has cores, or an OS
    without an affinity call (see usable_cores)."""
    if cfg.mode != "async" or cfg.device != "cpu" or cfg.ray_address or cfg.colocate:
        return []
    cores = usable_cores()
    T, E, tt, te = cfg.trainer_workers, cfg.num_engines, int(cfg.trainer_threads), int(cfg.engine_threads)
    if T * tt + E * te > len(cores):
        return []
    first, n = (i * tt, tt) if kind == "trainer" else (T * tt + i * te, te)
    return cores[first:first + n]


def lent_cores(cfg, r: int) -> list[tuple[int, list[int]]]:
    """(engine i, its cores) for every engine whose cores trainer rank r also computes on while that engine is idle
    (`borrow_engine_cores`): engine i lends to rank i % trainer_workers. Only where actors are pinned (async on a
    local CPU node, see actor_cores): elsewhere [] (in sync mode the running phase has every core anyway)."""
    if not cfg.borrow_engine_cores or not actor_cores(cfg, "trainer", r):
        return []
    return [(i, actor_cores(cfg, "engine", i)) for i in range(cfg.num_engines) if i % cfg.trainer_workers == r]


def engine_busy_file(cfg) -> str:
    """A fresh file of one byte per engine (in /dev/shm where there is one: memory, never written back), where CPU
    engine i keeps byte i at 1 while it has requests to compute and the trainer ranks that borrow its cores read it;
    "" where no trainer borrows (see lent_cores). The run removes it at the end (fleet.Fleet.busy_file)."""
    if not any(lent_cores(cfg, r) for r in range(cfg.trainer_workers)):
        return ""
    fd, path = tempfile.mkstemp(prefix="loongsage-busy-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.write(fd, bytes(cfg.num_engines))
    os.close(fd)
    return path


def pin_process(cores: list[int]) -> list[int]:
    """Pin every thread of this process to `cores` (threads started later inherit it); runs inside an actor
    (`actor.__ray_call__`). Best effort: a thread that ended meanwhile is skipped. Returns the cores it has."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # the thread ended meanwhile, or may not be moved
            pass
    return sorted(os.sched_getaffinity(0))
