"""The warm Python (sandbox.WarmPython): a Python agent forked from an interpreter that has imported its
libraries must behave as the same command started fresh in the same sandbox (argv, cwd, environment, stdin,
limits, containment, exit codes, the wall-clock kill), only without the import time."""
from __future__ import annotations

import asyncio
import os
import ssl
import time
from pathlib import Path

import pytest

import sandbox

PROBE = r'''
import os, resource, sys
print("argv", sys.argv[1:], "file", __file__, "name", __name__, "path0", sys.path[0])
print("cwd", os.getcwd() == os.environ["HOME"], "stdin", sys.stdin.read().strip(), "env", os.environ.get("X"),
      os.environ.get("Y"), sorted(k for k in os.environ if k.startswith("LOONGSAGE")))
print("cpu", resource.getrlimit(resource.RLIMIT_CPU), "fsize", resource.getrlimit(resource.RLIMIT_FSIZE))
try:
    open("/etc/loongsage-escape", "w").write("x")
    print("escaped")
except OSError as e:
    print("contained", e.errno)
sys.exit(int(sys.argv[2]))
'''


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


@pytest.mark.parametrize("command, expected", [
    ("python agent.py", ({}, ["agent.py"])),
    ("A=1 B='two words' python3 $LOONGSAGE_ROOT/a.py x --flag", ({"A": "1", "B": "two words"},
                                                                 ["$LOONGSAGE_ROOT/a.py", "x", "--flag"])),
    ("/usr/bin/python3.11 -m pkg.tool arg", ({}, ["-m", "pkg.tool", "arg"])),
    ("python -u agent.py", None),          # interpreter options: only a fresh interpreter can honour them
    ("python -m", None),
    ("python", None),
    ("node agent.js", None),
    ("python a.py | wc -c", None),         # shell syntax needs bash
    ("python a.py && echo done", None),
    ("python a.py > out.txt", None),
    ("python 'unclosed", None),
])
def test_python_command_reads_plain_python_invocations_only(command, expected):
    assert sandbox.python_command(command) == expected


def test_warm_run_is_the_fresh_run_without_the_imports():
    """Same command, same sandbox: the fresh (bash + python) and the warm run print the same lines and exit alike."""
    async def body():
        warm = await sandbox.WarmPython(["openai"]).start()
        box = await sandbox.LocalSandbox(cpu_s=7, file_mb=3).create()
        try:
            box.write("agent.py", PROBE)
            box.write("loaded.py", "import sys\nprint('openai' in sys.modules)\n")
            cmd, kw = "X=1 python agent.py hello 3", dict(stdin="the task\n", env={"Y": "2"}, timeout_s=60)
            fresh = await box.execute(cmd, **kw)
            forked = await box.execute_warm(warm, cmd, **kw)
            loaded = [(await box.execute("python loaded.py")).stdout.strip(),
                      (await box.execute_warm(warm, "python loaded.py")).stdout.strip()]
            return fresh, forked, loaded, dict(box.contained)
        finally:
            await box.delete()
            await warm.close()
    fresh, forked, loaded, contained = run(body())
    assert fresh.exit_code == forked.exit_code == 3 and not forked.timed_out, (fresh, forked)
    assert forked.stdout == fresh.stdout and forked.stderr == fresh.stderr == ""
    lines = forked.stdout.splitlines()
    assert lines[0].startswith("argv ['hello', '3'] file /") and "/agent.py name __main__" in lines[0]
    assert lines[1] == "cwd True stdin the task env 1 2 ['LOONGSAGE_ROOT']"
    assert lines[2] == f"cpu (7, 7) fsize {(3 * 2 ** 20, 3 * 2 ** 20)}"
    assert lines[3] == ("contained 30" if contained["writes"] else "escaped")  # EROFS where namespaces exist
    assert loaded == ["False", "True"]  # the fork saw openai imported already: the point of it


def test_sandbox_gives_tls_clients_the_system_ca_directory():
    """With SSL_CERT_DIR, the TLS context httpx makes (under the openai and anthropic SDKs) loads no certificate up
    front, OpenSSL reads each when a handshake needs it; without it every client parses certifi's whole bundle."""
    capath = ssl.get_default_verify_paths().openssl_capath
    hashed = os.path.isdir(capath) and any(n.endswith(".0") for n in os.listdir(capath))

    async def body():
        box = await sandbox.LocalSandbox().create()
        try:
            box.write("tls.py", "import os, httpx\nprint(os.environ.get('SSL_CERT_DIR'), "
                                "httpx.create_ssl_context().cert_store_stats()['x509_ca'])\n")
            return await box.execute("python tls.py")
        finally:
            await box.delete()
    r = run(body())
    ca_dir, loaded = r.stdout.split()
    if hashed:  # none loaded up front: each is read when a certificate chain asks for it
        assert (ca_dir, loaded) == (capath, "0"), r
    else:  # no such directory here: the sandbox leaves the variable out and clients load a bundle
        assert ca_dir == "None" and int(loaded) > 0, r


def test_warm_run_exit_paths_and_wall_clock_kill():
    async def body():
        warm = await sandbox.WarmPython([]).start()
        box = await sandbox.LocalSandbox().create()
        try:
            box.write("message.py", "import sys\nsys.exit('bad input')\n")
            box.write("raises.py", "print('before', flush=True)\nraise KeyError('boom')\n")
            box.write("plain.py", "print('done')\n")
            # a background grandchild in the same session, then a hang: the kill must take both
            box.write("hang.py", "import subprocess, sys, time\n"
                                 "p = subprocess.Popen(['sleep', '300'])\nprint(p.pid, flush=True)\ntime.sleep(300)\n")
            results = {name: await box.execute_warm(warm, f"python {name}.py", timeout_s=30)
                       for name in ("message", "raises", "plain")}
            t0 = time.perf_counter()
            results["hang"] = await box.execute_warm(warm, "python hang.py", timeout_s=2)
            waited = time.perf_counter() - t0
            await asyncio.sleep(0.3)
            return results, waited
        finally:
            await box.delete()
            await warm.close()
    r, waited = run(body())
    assert (r["message"].exit_code, r["message"].stderr) == (1, "bad input\n")
    assert r["raises"].exit_code == 1 and r["raises"].stdout == "before\n"
    assert r["raises"].stderr.startswith("Traceback") and r["raises"].stderr.endswith("KeyError: 'boom'\n")
    assert (r["plain"].exit_code, r["plain"].stdout, r["plain"].timed_out) == (0, "done\n", False)
    hang = r["hang"]
    # killed at its 2 s timeout (not before), not left to run out its 300 s sleep
    assert hang.timed_out and hang.exit_code == -9 and 2 <= waited < 300
    grandchild = int(hang.stdout.split()[0])
    assert not Path(f"/proc/{grandchild}").exists() or "State:\tZ" in Path(f"/proc/{grandchild}/status").read_text()


def test_warm_runs_in_parallel_and_a_cancelled_caller_kills_its_child():
    async def body():
        warm = await sandbox.WarmPython([]).start()

        async def one(i: int, script: str, timeout_s: float = 60):
            box = await sandbox.LocalSandbox().create()
            try:
                box.write("a.py", script)
                return await box.execute_warm(warm, f"python a.py {i}", stdin=f"in{i}", timeout_s=timeout_s)
            finally:
                await box.delete()
        try:
            echo = "import sys\nprint(sys.argv[1], sys.stdin.read())\n"
            outs = await asyncio.gather(*[one(i, echo) for i in range(16)])
            # a caller that goes away (its task cancelled) leaves no child behind
            box = await sandbox.LocalSandbox().create()
            box.write("hang.py", "import os, time\nopen('pid.tmp', 'w').write(str(os.getpid()))\n"
                                 "os.rename('pid.tmp', 'pid')\ntime.sleep(300)\n")
            hang = asyncio.ensure_future(box.execute_warm(warm, "python hang.py", timeout_s=300))
            pid_file = Path(box.dir) / "pid"
            while not pid_file.exists():
                await asyncio.sleep(0.02)
            pid = int(pid_file.read_text())
            hang.cancel()
            with pytest.raises(asyncio.CancelledError):
                await hang
            for _ in range(100):
                if not os.path.exists(f"/proc/{pid}"):
                    break
                await asyncio.sleep(0.05)
            alive = os.path.exists(f"/proc/{pid}")
            await box.delete()
            after = await one(99, echo)  # the warm interpreter still serves
            return [o.stdout for o in outs], alive, after.stdout
        finally:
            await warm.close()
    outs, alive, after = run(body())
    assert outs == [f"{i} in{i}\n" for i in range(16)]
    assert not alive and after == "99 in99\n"


def test_warm_start_names_the_module_that_failed():
    with pytest.raises(RuntimeError, match="no_such_module_here.*agent_preload"):
        run(sandbox.WarmPython(["no_such_module_here"]).start())


def test_preload_takes_the_required_packages_not_the_extras():
    deps = sandbox._requirements(["openai"])
    assert {"pydantic", "anyio", "jiter"} <= set(deps)  # openai's own requirements, imported lazily by it
    assert "numpy" not in deps and "websockets" not in deps  # extras (datalib, realtime) are not requirements
    assert sandbox._requirements(["json"]) == []  # the standard library has no distribution


def test_preload_takes_every_submodule_but_main():
    import openai  # noqa: F401  (_submodules walks imported packages)
    subs = sandbox._submodules(["openai"])
    assert "openai.resources.chat.completions" in subs  # what the client imports at its first chat call
    assert not any(m.endswith("__main__") for m in subs)  # importing it would run the SDK's command line
    assert sandbox._submodules(["json"]) == ["json.decoder", "json.encoder", "json.scanner", "json.tool"]
