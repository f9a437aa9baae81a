"""Sandboxes: where black-box agents and code-test rewards run, with limits, and killed whole at the end.

`LocalSandbox` is a temp directory and a process group with CPU-time, memory, file-size and wall-clock limits;
where the OS allows (root or user namespaces, a writable cgroup) it also makes everything outside its directory
read-only, cuts the network when asked (code tests; agents keep loopback for the router) and caps its process
count and total memory; `LocalSandbox.contained` says what holds on this machine. `DockerSandbox` is one
container per sandbox. `make_sandbox(kind)` picks one ("local" | "docker" | "auto" | a user's "module.fn").

`WarmPython` runs Python agents without starting Python: one interpreter imports the agent's libraries once
(`agent_preload`, e.g. openai) and each command is a fork of it that enters the sandbox as a new process would.
Forked, an agent that imports the openai SDK starts in milliseconds (docs/AGENTFLOW.md has the measurements).

This file imports nothing of LoongSage at module level (the warm interpreter runs it as its main program).
Test: `.venv/bin/pytest tests/test_reliability.py tests/test_sandbox.py`.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib
import importlib.metadata
import json
import logging
import os
import pkgutil
import re
import resource
import runpy
import select
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("loongsage.sandbox")
ROOT = Path(__file__).resolve().parent
# The system's hashed CA directory, whose certificates OpenSSL reads when a handshake needs one: without it an
# httpx-based SDK (openai, anthropic) parses certifi's whole bundle per client made, ~25 ms of every agent run.
_CA = ssl.get_default_verify_paths().openssl_capath
_CA_DIR = {"SSL_CERT_DIR": _CA} if os.path.isdir(_CA) and any(n.endswith(".0") for n in os.listdir(_CA)) else {}


@dataclass
class ExecResult:
    exit_code: int          # the process's exit code; -9 etc. when killed by a signal
    stdout: str
    stderr: str
    timed_out: bool         # the wall-clock limit hit and the process group was killed
    wall_s: float


# What a LocalSandbox can contain depends on the OS and the user, so it is probed once per process:
#   writes outside the sandbox dir + network: a new mount namespace (everything else remounted
#     read-only, a private /dev/shm) and, when network=False, a new network namespace (no interface up,
#     not even loopback). Needs root, or unprivileged user namespaces.
#   the number of processes and the total memory: a pids + memory cgroup per sandbox. Needs write access
#     to a cgroup hierarchy (root, usually). RLIMIT_NPROC is no substitute: the kernel ignores it for
#     root, and for other users it counts every process of the user, not the sandbox's.
# Whatever is unavailable is not contained; `LocalSandbox.contained` says which, and a warning says so once.
# The namespaces are entered with raw syscalls in the forked child, before exec: the `unshare`/`mount`
# programs cost a process per mount point (docs/AGENTFLOW.md).
_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
_MS = {"ro": 1, "nosuid": 2, "nodev": 4, "noexec": 8, "remount": 32, "noatime": 1024, "nodiratime": 2048,
       "bind": 4096, "rec": 16384, "private": 1 << 18, "relatime": 1 << 21, "strictatime": 1 << 24}
_LIBC = None
_ISOLATION: bool | None = None  # probed once: can a child enter the namespaces here?


def _syscall(name: str, *args) -> None:
    if getattr(_LIBC, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}{args!r}: {os.strerror(err)}")


def _isolate(root_dir: str, network: bool) -> None:
    """In the child between fork and exec: new mount (+ user, + network) namespaces; every mount but
    `root_dir` becomes read-only (keeping its nosuid/nodev/noexec flags, which a user namespace may not
    drop), /dev/shm becomes a private tmpfs, and the cwd moves onto the new bind mount of root_dir."""
    uid, gid = os.getuid(), os.getgid()
    flags = _CLONE_NEWNS | (0 if network else _CLONE_NEWNET) | (_CLONE_NEWUSER if uid != 0 else 0)
    _syscall("unshare", flags)
    if uid != 0:  # map ourselves to root inside, so the mounts below are allowed
        for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"0 {uid} 1"),
                           ("/proc/self/gid_map", f"0 {gid} 1")):
            with open(path, "w") as f:
                f.write(text)
    d = root_dir.encode()
    _syscall("mount", None, b"/", None, _MS["rec"] | _MS["private"], None)  # nothing propagates to the host
    _syscall("mount", d, d, None, _MS["bind"], None)
    with contextlib.suppress(OSError):
        _syscall("mount", b"tmpfs", b"/dev/shm", b"tmpfs", _MS["nosuid"] | _MS["nodev"], b"size=64m")
    with open("/proc/self/mountinfo") as f:
        mounts = [(line.split()[4], line.split()[5].split(",")) for line in f]
    for point, opts in reversed(mounts):  # mountinfo escapes spaces as \040; such mounts stay as they are
        if point in (root_dir, "/dev/shm"):
            continue
        keep = sum(_MS.get(o, 0) for o in opts if o in ("nosuid", "nodev", "noexec", "noatime", "nodiratime",
                                                         "relatime", "strictatime"))
        with contextlib.suppress(OSError):
            _syscall("mount", None, point.encode(), None, _MS["remount"] | _MS["bind"] | _MS["ro"] | keep, None)
    os.chdir(root_dir)  # the old cwd is the directory under the new mount, which is now read-only


def _isolation_available() -> bool:
    """Whether a child can enter the namespaces here (probed once, in a throwaway child)."""
    global _ISOLATION, _LIBC
    if _ISOLATION is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here, not in the forked child
        probe = tempfile.mkdtemp(prefix="loongsage-probe-")
        try:
            _ISOLATION = subprocess.run(["sh", "-c", "! touch /loongsage-probe 2>/dev/null && touch ok"], cwd=probe,
                                        preexec_fn=lambda: _isolate(probe, False), capture_output=True,
                                        timeout=30).returncode == 0 and os.path.exists(f"{probe}/ok")
        except (OSError, subprocess.SubprocessError):
            _ISOLATION = False
        finally:
            shutil.rmtree(probe, ignore_errors=True)
    return _ISOLATION


def _killpg(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _cgroup(controller: str, name: str, limit_value: int) -> Path | None:
    """Create cgroup `name` with `controller` and its limit at `limit_value` (v1 hierarchy /sys/fs/cgroup/<controller>,
    or v2 /sys/fs/cgroup with the controller enabled for children); None where neither is writable."""
    v1_limit = {"pids": "pids.max", "memory": "memory.limit_in_bytes"}[controller]
    for base, limit in ((Path("/sys/fs/cgroup", controller), v1_limit), (Path("/sys/fs/cgroup"), f"{controller}.max")):
        path = base / name
        try:
            path.mkdir(exist_ok=False)
        except OSError:
            continue
        if (path / limit).exists():
            (path / limit).write_text(str(limit_value))
            return path
        with contextlib.suppress(OSError):
            path.rmdir()
    return None


def _cgroup_kill(path: Path) -> None:
    """SIGKILL every process left in the cgroup (even ones that left the process group with setsid).
    Orphans are reaped by init: until then they still count against pids.max (on this machine's init,
    for up to seconds) and the cgroup cannot be removed."""
    for _ in range(100):
        try:
            pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
        except OSError:
            return
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


async def _communicate(proc, stdin: str, timeout_s: float, kill, t0: float) -> ExecResult:
    """Feed `stdin` to `proc` and read its output; at the wall-clock limit `kill()` (SIGKILL: exit code -9) and read
    what it wrote until then."""
    timed_out = False
    try:
        out, err = await asyncio.wait_for(proc.communicate(stdin.encode()), timeout_s)
    except asyncio.TimeoutError:
        timed_out = True
        kill()
        out, err = await proc.communicate()
    return ExecResult(proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"), timed_out,
                      time.perf_counter() - t0)


_WARNED: set[str] = set()


class LocalSandbox:
    """What it contains where this machine allows: the module docstring and the comment above `_CLONE_NEWNS`;
    always CPU time, address space and file size per process, the wall clock, and every process killed at the end.
    Not a security boundary (the same kernel and user; root stays root, read-only): docs/AGENTFLOW.md#sandboxes."""

    def __init__(self, *, cpu_s: int = 60, memory_mb: int = 4096, file_mb: int = 64, max_procs: int = 256,
                 network: bool = True):
        self.cpu_s, self.memory_mb, self.file_mb, self.max_procs = cpu_s, memory_mb, file_mb, max_procs
        self.network = network
        self.dir: str | None = None
        self._cgroups: list[Path] = []
        self.contained: dict[str, bool] = {}  # what this sandbox really enforces (writes, network, procs,
        #                                       total_memory), filled by create()

    async def create(self) -> "LocalSandbox":
        self.dir = tempfile.mkdtemp(prefix="loongsage-sbx-")
        name = Path(self.dir).name
        pids, mem = _cgroup("pids", name, self.max_procs), _cgroup("memory", name, self.memory_mb * 2 ** 20)
        self._cgroups = [c for c in (pids, mem) if c is not None]
        isolate = _isolation_available()
        # network: cut (only asked for with network=False; black-box agents need loopback to the router)
        self.contained = {"writes": isolate, "network": isolate and not self.network, "procs": pids is not None,
                          "total_memory": mem is not None}
        missing = sorted(k for k, v in self.contained.items() if not v and (k != "network" or not self.network))
        if missing and ",".join(missing) not in _WARNED:
            _WARNED.add(",".join(missing))
            log.warning("LocalSandbox cannot contain %s on this machine (needs root or user namespaces, and a "
                        "writable pids/memory cgroup); use sandbox: docker for those", missing)
        return self

    def _limits(self) -> None:  # runs in the child between fork and exec
        for cg in self._cgroups:  # join first: every process forked from here on is counted
            (cg / "cgroup.procs").write_text(str(os.getpid()))
        if self.contained.get("writes"):
            _isolate(self.dir, self.network)
        for limit, value in ((resource.RLIMIT_CPU, self.cpu_s), (resource.RLIMIT_AS, self.memory_mb * 2 ** 20),
                             (resource.RLIMIT_FSIZE, self.file_mb * 2 ** 20), (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(limit, (value, value))

    def write(self, name: str, text: str) -> str:
        path = Path(self.dir) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return str(path)

    def _env(self, env: dict | None) -> dict:
        """A command's whole environment: nothing of the caller's but these, then `env`."""
        return {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", "HOME": self.dir,
                "TMPDIR": self.dir, "LANG": "C.UTF-8", "PYTHONPATH": str(ROOT), "LOONGSAGE_ROOT": str(ROOT),
                **_CA_DIR, **(env or {})}

    async def execute(self, command: str, *, stdin: str = "", env: dict | None = None,
                      timeout_s: float = 30.0) -> ExecResult:
        """Run `bash -c command` in the sandbox dir; at the wall-clock limit kill its whole process group."""
        if self.dir is None:
            raise RuntimeError("LocalSandbox.execute before create(); call `await sandbox.create()` first")
        t0 = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            "bash", "-c", command, cwd=self.dir, env=self._env(env), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, preexec_fn=self._limits)
        try:  # start_new_session: the pid is the process group id
            return await _communicate(proc, stdin, timeout_s, lambda: _killpg(proc.pid), t0)
        finally:
            self._end(proc.pid)

    async def execute_warm(self, warm: "WarmPython", command: str, *, stdin: str = "", env: dict | None = None,
                           timeout_s: float = 30.0) -> ExecResult:
        """`execute` for a Python command (`python_command` reads it), forked from `warm` rather than started:
        the same directory, environment, limits, containment and wall-clock kill; the import time is saved."""
        if self.dir is None:
            raise RuntimeError("LocalSandbox.execute_warm before create(); call `await sandbox.create()` first")
        spec = python_command(command)
        if spec is None:
            raise ValueError(f"a warm Python runs `[VAR=value ...] python SCRIPT|-m MODULE [ARGS]`, got {command!r}")
        words, env = spec[1], self._env({**(env or {}), **spec[0]})
        words = [re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), ""), w) for w in words]  # as bash would
        limits = {"cpu_s": self.cpu_s, "memory_mb": self.memory_mb, "file_mb": self.file_mb, "network": self.network}
        box = {"dir": self.dir, "cgroups": [str(c) for c in self._cgroups], "contained": self.contained}
        return await warm.run(self, {"argv": words, "env": env, "limits": limits, **box}, stdin, timeout_s)

    def _end(self, pgid: int) -> None:
        """After a command: its background children die with it, and so do those that left its process group
        (setsid, daemons) but not the sandbox's cgroup."""
        _killpg(pgid)
        for cg in self._cgroups[:1]:
            _cgroup_kill(cg)

    async def delete(self) -> None:
        """Kill what is left in the cgroups (a command's process group dies with it: _end); remove them and the dir."""
        for cg in self._cgroups:
            _cgroup_kill(cg)
        for _ in range(100):  # removable once init has reaped the killed processes
            for cg in list(self._cgroups):
                with contextlib.suppress(OSError):
                    cg.rmdir()
                    self._cgroups.remove(cg)
            if not self._cgroups:
                break
            await asyncio.sleep(0.05)
        if self._cgroups:
            log.warning("sandbox cgroups %s still hold unreaped processes; left in place", self._cgroups)
        self._cgroups = []
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


class DockerSandbox:
    """One container per sandbox (docker CLI), `docker exec` per command, `docker rm -f` at the end.

    The container: memory (no extra swap), CPUs, pids, per-process CPU time and file size limits; a
    read-only root filesystem with a small /tmp tmpfs; the work dir mounted read-write at /work and
    LoongSage read-only at /loongsage; no capabilities, no privilege gain. `network=True` shares the
    host network so an agent reaches the router on loopback; `network=False` gives it none.
    """

    def __init__(self, *, image: str | None = None, cpus: float = 1.0, cpu_s: int = 60, memory_mb: int = 4096,
                 file_mb: int = 64, max_procs: int = 256, network: bool = True):
        self.image = image or os.environ.get("LOONGSAGE_SANDBOX_IMAGE", "python:3.11-slim")
        self.cpus, self.cpu_s, self.memory_mb, self.file_mb = cpus, cpu_s, memory_mb, file_mb
        self.max_procs, self.network = max_procs, network
        self.name: str | None = None
        self.dir: str | None = None

    async def _docker(self, *args: str, stdin: str = "", timeout_s: float = 120.0) -> ExecResult:
        t0 = time.perf_counter()
        proc = await asyncio.create_subprocess_exec("docker", *args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                    stderr=subprocess.PIPE)
        return await _communicate(proc, stdin, timeout_s, proc.kill, t0)

    def run_args(self) -> list[str]:
        """The `docker run` arguments that start this sandbox's container (after create() named it)."""
        fsize = self.file_mb * 2 ** 20  # docker passes ulimit values to setrlimit as they are: bytes, seconds
        return ["run", "-d", "--rm", "--name", self.name, "--network", "host" if self.network else "none",
                "--memory", f"{self.memory_mb}m", "--memory-swap", f"{self.memory_mb}m", "--cpus", str(self.cpus),
                "--pids-limit", str(self.max_procs), "--ulimit", f"cpu={self.cpu_s}:{self.cpu_s}",
                "--ulimit", f"fsize={fsize}:{fsize}", "--read-only", "--tmpfs", "/tmp:rw,size=64m",
                "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
                "-v", f"{self.dir}:/work", "-v", f"{ROOT}:/loongsage:ro", "-w", "/work",
                self.image, "sleep", "infinity"]

    async def create(self) -> "DockerSandbox":
        self.dir = tempfile.mkdtemp(prefix="loongsage-sbx-")
        os.chmod(self.dir, 0o777)  # the image's user may not be ours
        self.name = "loongsage-" + uuid.uuid4().hex[:12]
        r = await self._docker(*self.run_args())
        if r.exit_code != 0:
            raise RuntimeError(f"docker run {self.image} failed ({r.exit_code}): {r.stderr.strip()[:500]}")
        return self

    def write(self, name: str, text: str) -> str:
        LocalSandbox.write(self, name, text)  # into self.dir, which the container mounts at /work
        return f"/work/{name}"

    async def execute(self, command: str, *, stdin: str = "", env: dict | None = None,
                      timeout_s: float = 30.0) -> ExecResult:
        envs = [a for k, v in {"PYTHONPATH": "/loongsage", "LOONGSAGE_ROOT": "/loongsage", **(env or {})}.items()
                for a in ("-e", f"{k}={v}")]
        # `timeout -s KILL` inside the container kills the command; the container (and any stragglers)
        # goes away at delete().
        r = await self._docker("exec", "-i", *envs, self.name, "timeout", "-s", "KILL", str(int(timeout_s) + 1),
                               "bash", "-c", command, stdin=stdin, timeout_s=timeout_s + 10)
        r.timed_out = r.timed_out or r.exit_code in (124, 137)
        return r

    async def delete(self) -> None:
        if self.name:
            await self._docker("rm", "-f", self.name, timeout_s=60)
            self.name = None
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


_DOCKER_OK: bool | None = None


def docker_available() -> bool:
    """True when a Docker engine answers (`docker info`), checked once per process."""
    global _DOCKER_OK
    if _DOCKER_OK is None:
        try:
            _DOCKER_OK = shutil.which("docker") is not None and subprocess.run(
                ["docker", "info"], capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            _DOCKER_OK = False
    return _DOCKER_OK


def make_sandbox(kind: str = "local", **limits):
    """"local" | "docker" | "auto" (docker where an engine answers, else local)."""
    if kind == "auto":
        kind = "docker" if docker_available() else "local"
    if kind == "local":
        return LocalSandbox(**limits)
    if kind == "docker":
        if not docker_available():
            raise RuntimeError("sandbox='docker' but no Docker engine answers `docker info`; start dockerd "
                               "or set sandbox: local")
        return DockerSandbox(**limits)
    import data  # here, not at the top: data imports torch, and the warm interpreter below imports this file
    if data.is_dotted(kind):  # EXT: a user's sandbox, fn(**limits) -> an object with this file's sandbox methods
        return data.import_object(kind)(**limits)
    raise ValueError(f"unknown sandbox {kind!r}; valid: local, docker, auto, or a dotted path 'module.function'")


# ----------------------------------------------------------------------------------------------
# a warm Python: a Python agent forked from an interpreter that has already imported its libraries


def python_command(command: str) -> tuple[dict, list[str]] | None:
    """`[VAR=value ...] python[3] SCRIPT [ARGS]` or `... python -m MODULE [ARGS]` as (assignments, [SCRIPT or
    -m MODULE, ARGS...]); None for any other command (options before the script, pipes, lists, redirections)."""
    if any(c in command for c in "|&;<>()`\n"):
        return None
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    assigned = {}
    while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
        key, value = words.pop(0).split("=", 1)
        assigned[key] = value
    if len(words) < 2 or not re.fullmatch(r"(.*/)?python(3(\.\d+)?)?", words[0]):
        return None
    if (words[1] == "-m" and len(words) >= 3) or not words[1].startswith("-"):
        return assigned, words[1:]
    return None


class WarmPython:
    """One long-lived interpreter (`python sandbox.py warm SOCKET MODULE...`) that has imported `preload`;
    each `run` forks a child from it instead of starting Python. The child does what a new process would:
    it enters the sandbox (cgroups, namespaces, rlimits: `LocalSandbox._limits`), takes the sandbox dir as
    cwd, the command's environment and stdio, and runs the script (or module) as __main__ with its argv.
    Only the imports are shared. What differs from a fresh interpreter: modules imported by the preload are not
    re-imported (a program that reads the environment at import time of one sees the warm interpreter's), and the
    interpreter is this one (`sys.executable`), whatever the command's `python` names."""

    def __init__(self, preload: list[str]):
        self.preload = list(preload)
        self.dir = tempfile.mkdtemp(prefix="loongsage-warm-")
        self.socket = f"{self.dir}/warm.sock"
        self.proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    async def start(self) -> "WarmPython":
        async with self._lock:
            if self.proc is None or self.proc.returncode is not None:
                self.proc = await asyncio.create_subprocess_exec(
                    sys.executable, str(ROOT / "sandbox.py"), "warm", self.socket, *self.preload,
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
                line = (await self.proc.stdout.readline()).decode().strip()
                if line != "ready":
                    await self.proc.wait()
                    raise RuntimeError(f"the warm Python (preload {self.preload}) did not start: {line or 'it exited'}"
                                       "; check that agent_preload names importable modules")
        return self

    async def run(self, box: LocalSandbox, request: dict, stdin: str, timeout_s: float) -> ExecResult:
        """Fork one child for `request` (argv, env, limits) with stdin/stdout/stderr as unnamed files."""
        await self.start()
        loop = asyncio.get_running_loop()
        stdio = [tempfile.TemporaryFile(dir=self.dir) for _ in range(3)]
        stdio[0].write(stdin.encode())
        stdio[0].seek(0)
        t0 = time.perf_counter()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.setblocking(False)
        pid, code, timed_out = None, -1, False
        try:
            await loop.sock_connect(conn, self.socket)
            socket.send_fds(conn, [json.dumps(request).encode()], [f.fileno() for f in stdio])
            reply = await loop.sock_recv(conn, 64)  # b"pid N", then b"exit CODE"; b"" if the warm Python died
            if not reply.startswith(b"pid "):
                raise RuntimeError(f"the warm Python refused the command: {reply.decode(errors='replace')!r}")
            pid = int(reply.split()[1])  # the child called setsid: its pid is its process group, killed by _end
            try:
                reply = await asyncio.wait_for(loop.sock_recv(conn, 64), timeout_s)
                code = int(reply.split()[1]) if reply.startswith(b"exit ") else -1
            except asyncio.TimeoutError:
                timed_out = True
        finally:
            if pid is not None:
                box._end(pid)
            conn.close()
        for f in stdio:
            f.seek(0)
        out, err = (f.read().decode(errors="replace") for f in stdio[1:])
        for f in stdio:
            f.close()
        return ExecResult(-9 if timed_out else code, out, err, timed_out, time.perf_counter() - t0)

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.stdin.close()  # the warm Python kills its children and exits on end of stdin
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 10)
            if self.proc.returncode is None:
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def _serve_warm(path: str, preload: list[str]) -> None:
    """The warm interpreter's loop (single-threaded, so that a fork copies no other thread's locks): accept a
    request, fork, answer "pid N"; reap children as SIGCHLD arrives and answer "exit CODE"; kill a child whose
    caller hung up; exit when stdin (the caller's pipe) ends."""
    try:
        for name in preload:
            importlib.import_module(name)
        for name in _submodules(preload) + _requirements(preload):  # best effort: what fails here is the child's
            with contextlib.suppress(Exception):
                importlib.import_module(name)
        _isolation_available()  # probed and libc loaded here, once, not in every child
    except Exception as e:
        print(f"error: {e!r}", flush=True)
        sys.exit(1)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(256)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket | None] = {}  # pid -> its caller's connection (None once it hung up)
    print("ready", flush=True)
    while True:
        waiting = [c for c in children.values() if c is not None]
        ready, _, _ = select.select([listener, wake_r, sys.stdin.fileno(), *waiting], [], [])
        if sys.stdin.fileno() in ready and not os.read(sys.stdin.fileno(), 1):
            for pid in children:
                _killpg(pid)
            return
        if wake_r in ready:
            os.read(wake_r, 512)
        if listener in ready:
            conn, _ = listener.accept()
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            if len(fds) == 3:
                sys.stdout.flush()
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for other in waiting:
                        other.close()
                    _warm_child(json.loads(msg), fds, conn)  # never returns
                conn.send(f"pid {pid}".encode())
                children[pid] = conn
            else:
                conn.send(b"error: expected stdin, stdout and stderr")
                conn.close()
            for fd in fds:  # closed here either way: a forked child has its own copies
                os.close(fd)
        for pid, conn in list(children.items()):
            if conn is not None and conn in ready and not conn.recv(64):  # the caller gave up: kill the child
                _killpg(pid)
                conn.close()
                children[pid] = None
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.send(f"exit {os.waitstatus_to_exitcode(status)}".encode())
                conn.close()


def _submodules(packages: list[str]) -> list[str]:
    """Every submodule of `packages` but `__main__` (an SDK imports its resources and types lazily, at the first
    client or call: cheaper once in the warm interpreter than in every child)."""
    names = []
    for name in packages:
        path = getattr(sys.modules[name], "__path__", None)
        if path is not None:
            names += [m.name for m in pkgutil.walk_packages(path, f"{name}.", onerror=lambda _: None)
                      if not m.name.endswith(".__main__")]
    return names


def _requirements(modules: list[str]) -> list[str]:
    """The top-level packages of every distribution that the distributions providing `modules` require,
    recursively (extras left out). Libraries import some of their dependencies lazily (openai imports its HTTP
    transport at the first client), so the warm interpreter imports them all."""
    dists_of = importlib.metadata.packages_distributions()  # top-level package -> the distributions providing it
    provided: dict[str, list[str]] = {}  # normalized distribution name -> its top-level packages
    for module, dists in dists_of.items():
        for dist in dists:
            provided.setdefault(re.sub(r"[-_.]+", "-", dist).lower(), []).append(module)
    todo = [dist for m in modules for dist in dists_of.get(m, [])]
    seen: set[str] = set()
    while todo:
        try:
            requires = importlib.metadata.requires(todo.pop()) or []
        except importlib.metadata.PackageNotFoundError:  # required only on other Pythons: not installed
            continue
        for req in requires:
            name = re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", req).group(0)).lower()
            if "extra ==" not in req and name not in seen:
                seen.add(name)
                todo.append(name)
    return sorted({m for name in seen for m in provided.get(name, []) if not m.startswith("_")})


def _warm_child(request: dict, fds: list[int], conn: socket.socket) -> None:
    """In the forked child: become the command, as a new process in the sandbox would, and exit with its code."""
    code = 1
    try:
        conn.close()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        for fd, std in zip(fds, (0, 1, 2)):
            os.dup2(fd, std)
            os.close(fd)
        box = LocalSandbox(**request["limits"])  # the sandbox execute_warm was called on: its dir, cgroups, containment
        box.dir, box.contained = request["dir"], request["contained"]
        box._cgroups = [Path(c) for c in request["cgroups"]]
        box._limits()
        os.chdir(box.dir)
        os.environ.clear()
        os.environ.update(request["env"])
        argv = request["argv"]
        try:
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                sys.path[0] = os.getcwd()
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                script = os.path.abspath(argv[0])  # __main__.__file__ is absolute in a fresh interpreter too
                sys.argv = [script, *argv[1:]]
                sys.path[0] = os.path.dirname(script)
                runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:  # sys.exit(n), sys.exit() and sys.exit("message") as a fresh interpreter reads them
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "warm":
        sys.exit("usage: python sandbox.py warm SOCKET [MODULE ...]  (started by WarmPython, not by hand)")
    _serve_warm(sys.argv[2], sys.argv[3:])
