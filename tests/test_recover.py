"""Nothing lost: drills that kill parts of a real run and check what survives.

- kill -9 one of two CPU engines mid-run, then kill -9 the controller after the checkpoint of step 3
  of 6, plant the debris of a crash in the middle of a later save, and resume: every step of the
  run is bit-identical to an uninterrupted one (sync, fp32, dynamic sampling on), and the re-created
  engine serves the trainer's weights and version. The controller runs as its own process
  (`python loongsage.py ...`) with Ray actors, Megatron-Core over gloo and CPU engines over HTTP;
- AgentFlow's engine pool against real CPU engines, one killed (kill -9) and one hung (SIGSTOP) while
  requests are in flight on them: the requests finish on the other engine, exactly as sent there;
- `fleet.wait`: a rank that dies ends the wait at once; a deadline names what timed out and the knob;
- the producer state a checkpoint saves hands out exactly the groups an uninterrupted run dispatches next;
- checkpoints at their worst moment (docs/RELIABILITY.md's table): a trainer rank and the controller killed
  inside a save at named fault points (LOONGSAGE_FAULT), a damaged file refused by its checksum and
  resume=previous, a real disk-full (ENOSPC from a size-limited tmpfs) in the middle of a save;
- weight syncs at their worst moment: a CPU engine killed (shm and broadcast) or stalled (SIGSTOP) after a bucket
  that is not the last, at named fault points (LOONGSAGE_FAULT=sync / stall); a trainer rank killed inside a train
  step (`step`) and inside the sync (`push`), then resumed;
- a teacher killed mid-scoring (`teacher`): re-created, the same targets; a Ray node lost (two-node cluster): the
  engine's re-placed, the trainer's stops the run, which resumes;
- a flooded router: 2,000 concurrent agent sessions over loopback, some slow, some hanging up: nothing lost or
  crossed, and the router's memory back to its baseline after they close.
"""
import asyncio
import contextlib
import dataclasses
import errno
import json
import os
import random
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import transfermesh

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128)


def short_run(out: Path, *extra: str) -> list[str]:
    """The default recipe, shrunk to seconds per step: 6 steps of 4 prompts x 4 samples, fp32, sync."""
    return [sys.executable, "loongsage.py", "recipes/arith_cpu.yaml", f"output_dir={out}", "num_steps=6",
            "prompts_per_step=4", "samples_per_prompt=4", "global_batch_size=8", "micro_batch_size=4",
            "max_new_tokens=6", "eval_every=0", "warmstart_steps=2", "warmstart_batch_size=8", "lr=1e-3",
            "print_every=0", "reward=tests.rewards.digit_fraction", f"tiny_model={json.dumps(TINY)}", *extra]


def env_for(tmp_path: Path) -> dict:
    return {**os.environ, "LOONGSAGE_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}


def launch(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    # its own session: whatever Ray leaves behind when the controller is killed is cleaned up by process group
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def finish(p: subprocess.Popen, log: Path, timeout: float = 240) -> str:
    try:
        p.wait(timeout=timeout)
    finally:
        reap(p)
    return log.read_text()


def reap(p: subprocess.Popen) -> None:
    """Kill what is left of a controller's process group (Ray's processes started by it)."""
    if p.poll() is None:
        p.kill()
        p.wait()
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def wait_for(predicate, p: subprocess.Popen, log: Path, timeout: float = 240, what: str = ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if p.poll() is not None:
            raise AssertionError(f"the run ended (rc={p.returncode}) before {what}:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    reap(p)
    raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()[-3000:]}")


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def train_rows(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in metrics(out) if "train/loss" in r}


def pid_listening_on(port: int) -> int:
    """The process with a listening TCP socket on `port` (read from /proc: no psutil here)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "0A":  # 0A: LISTEN
                inodes.add(f[9])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in {f"socket:[{i}]" for i in inodes}
                   for fd in os.listdir(f"/proc/{pid}/fd")):
                return int(pid)
        except OSError:
            continue
    raise AssertionError(f"no process listens on port {port}")


def plant_crashed_save(out: Path) -> None:
    """What a crash in the middle of save_run_state(step 5) leaves: a rank file cut short under its
    temporary name, the controller state half written, the new marker not yet renamed into place."""
    ckpt = out / "checkpoints"
    (ckpt / "step_00004").mkdir()
    good = (ckpt / "step_00002" / "rank_00000_model.pt").read_bytes()
    (ckpt / "step_00004" / "rank_00000_model.pt.tmp").write_bytes(good[:len(good) // 3])
    (ckpt / "step_00004" / "controller_state.json.tmp").write_text('{"step": 4, "data_cur')
    (ckpt / "latest.tmp").write_text("step_00004\n")


@pytest.mark.slow
def test_engine_and_controller_killed_mid_run_lose_nothing(tmp_path):
    """Two drills in one run (each launch of the controller costs ~30-60 s here, so they share them):

    1. kill -9 one of two CPU engines after step 1 of 6: the run goes on, the engine is re-created on
       its bundle with the trainer's weights, and steps 1-3 are bit-identical to an uninterrupted run
       (per-request seeds make the draws independent of the engine and the batch; the engine's logprobs can
       differ in their last bits with the batch, and nothing compared bit for bit here reads them). So every step
       trained the same full batch;
    2. kill -9 the controller after the checkpoint of step 3, plant the debris of a crash in the middle
       of a later save, and resume: the previous checkpoint loads, and steps 4-6 are bit-identical to
       the uninterrupted run, with dynamic sampling on (it reads a varying number of prompts per step,
       so only a saved data cursor gets the data order right).

    Planted bugs this catches: a dead engine kept in routing or never re-created (requests fail, groups
    go missing); a re-created engine left on version-0 weights or mislabelled (gap and versions);
    a data cursor re-derived by skipping batches; RNG or optimizer state not restored; an LR schedule
    restarted at 0; a marker written before the checkpoint; rows of redone steps logged twice.
    """
    common = ["num_engines=2", "dynamic_sampling=true", "save_every=3"]
    base, crash = tmp_path / "base", tmp_path / "crash"
    # the uninterrupted run goes alongside (its own Ray and model cache): the draws do not depend on timing
    b = launch(short_run(base, *common), env_for(tmp_path / "b"), tmp_path / "base.log")
    env = env_for(tmp_path)
    p = launch(short_run(crash, *common, f"dump_rollouts={tmp_path}/dump"), env, tmp_path / "crash.log")
    urls = wait_for(lambda: [ln for ln in (tmp_path / "crash.log").read_text().splitlines()
                             if ln.startswith("engines: ")], p, tmp_path / "crash.log", what="the engines")
    victim = json.loads(urls[0][len("engines: "):].replace("'", '"'))[1]
    wait_for(lambda: "step    0 |" in (tmp_path / "crash.log").read_text(), p, tmp_path / "crash.log",
             what="step 1")
    os.kill(pid_listening_on(int(victim.rsplit(":", 1)[1])), signal.SIGKILL)
    marker = crash / "checkpoints" / "latest"
    wait_for(lambda: marker.exists() and marker.read_text().strip() == "step_00002", p, tmp_path / "crash.log",
             what="the checkpoint of step 3")
    os.kill(p.pid, signal.SIGKILL)  # the controller only; its Ray actors lose their driver
    p.wait()
    reap(p)
    crash_log = (tmp_path / "crash.log").read_text()
    plant_crashed_save(crash)

    p = launch(short_run(crash, *common, "resume=true"), env, tmp_path / "resume.log")
    log = finish(p, tmp_path / "resume.log")
    assert p.returncode == 0, log[-3000:]
    assert "resumed after step 2" in log
    base_log = finish(b, tmp_path / "base.log")
    assert b.returncode == 0, base_log[-3000:]

    want, got = train_rows(base), train_rows(crash)
    assert sorted(got) == [0, 1, 2, 3, 4, 5]  # one row per step: rows logged after the checkpoint were dropped
    assert len([r for r in metrics(crash) if "train/loss" in r]) == 6
    for step in range(6):
        for key in ("train/loss", "train/grad_norm", "rollout/reward_mean", "rollout/samples",
                    "rollout/groups_sampled", "rollout/response_len"):
            assert got[step][key] == want[step][key], (step, key, got[step][key], want[step][key])
        assert got[step]["rollout/weight_version_min"] == got[step]["rollout/weight_version_max"] == step
        assert got[step]["train/gap_max"] < 1e-4  # engines sampled with exactly the trainer's weights
    # dynamic sampling read more prompts than steps x prompts_per_step: a skip-based cursor would be wrong
    assert sum(r["rollout/groups_sampled"] for r in want.values()) > 6 * 4

    # the engine drill: re-created once, and the new engine served later steps with the trainer's version
    assert max(got[s]["engines/restarts"] for s in (0, 1, 2)) == 1 and got[2]["engines/healthy"] == 2
    new_url = next(ln.split("re-created at ")[1].split(",")[0] for ln in crash_log.splitlines()
                   if "re-created at" in ln)
    served = [(json.loads(line), s) for s in (2,) for line in open(tmp_path / "dump" / f"step_{s:05d}.jsonl")]
    mine = [t for t, s in served if t["metadata"]["engine"] == new_url]
    assert mine and all(v == s for t, s in served if t["metadata"]["engine"] == new_url
                        for v, m in zip(t["weight_versions"], t["loss_mask"]) if m)


def died(log: str, spec: str, t_struck: float, t_exit: float) -> str:
    """The run's error after LOONGSAGE_FAULT=`spec` killed a trainer rank: the death of that rank's process (its pid
    in the error), not a deadline passed waiting on it; prints how long the run took to stop."""
    pid = re.search(r"pid=(\d+)", next(ln for ln in log.splitlines() if f"LOONGSAGE_FAULT={spec} strikes" in ln))[1]
    tail = log[log.index("run failed:"):]
    assert "ActorDiedError" in tail and pid in re.findall(r"(?i)pid[:=]\s*(\d+)", tail), tail[-3000:]
    assert "TimeoutError" not in tail, tail[-3000:]
    print(f"{spec}: the run stopped {t_exit - t_struck:.1f} s after the strike")
    return tail


@pytest.mark.slow
def test_rank_killed_mid_step_mid_save_and_mid_sync_and_controller_mid_save_resume_exactly(tmp_path):
    """kill -9 at named points (LOONGSAGE_FAULT) inside a train step, a save and a weight sync, with 2 trainer ranks
    saving every 2 steps of 6, resuming after each:

    1. trainer rank 1 dies inside step 3 (`step:1@3`: it ran the step's forwards, not its update; rank 0 blocks in
       the gradient all-reduce): the run exits 1 with that rank's death as its error (ActorDiedError naming its
       pid, no TimeoutError: no wait sat out its deadline), `latest` names step 1, steps 0-2 are logged;
    2. resumed, rank 1 dies in the save of step 3 right after writing its model file: that checkpoint holds rank 1's
       model and not its optimizer file nor a manifest (the kill struck inside the save), `latest` still names 1;
    3. resumed, rank 0 dies inside the weight sync to version 5 (`push:0@5`: it sent the engines every bucket but
       the last, the version-carrying one; n >= 2 buckets per sync, so 1 <= k < n): exit 1 with rank 0's death,
       `latest` names step 3, steps up to 3 are logged (step 4 trained, its sync failed);
    4. resumed, the controller dies in the save of step 5 with everything written but `latest`: `latest` names 3;
    5. resumed again, it goes on from step 3 and every step of the run is bit-identical to an uninterrupted one
       (sync, fp32).
    Planted bugs this catches: a dead rank's error lost while the survivor waits in a collective (a hang until
    actor_timeout), `latest` written before (or alongside) the rank files, a marker moved by the rank that finished
    first, resume taking the newest directory rather than the one `latest` names (step 5's checkpoint is complete but
    unmarked), the debris of a crashed save loaded or left to mix with a new save of the same step, a rank's
    optimizer state taken from another save than its model, rows of redone steps logged twice, a half-done step or
    sync leaking into the resumed run.
    """
    common = ["trainer_workers=2", "save_every=2", "bucket_mb=0.05"]  # several buckets per sync
    base, run = tmp_path / "base", tmp_path / "run"
    b = launch(short_run(base, *common), env_for(tmp_path / "b"), tmp_path / "base.log")
    env, ckpt = env_for(tmp_path), run / "checkpoints"
    logs = []
    for i, fault in enumerate(("step:1@3", "model:1@3", "push:0@5", "latest@5", "")):
        log = tmp_path / f"{i}.log"
        p = launch(short_run(run, *common, *(["resume=true"] if i else [])), {**env, "LOONGSAGE_FAULT": fault}, log)
        if fault in ("step:1@3", "push:0@5"):  # when it struck, to time how long the run takes to stop
            wait_for(lambda: f"LOONGSAGE_FAULT={fault} strikes" in log.read_text(), p, log, what=f"{fault} to strike")
            t_struck = time.monotonic()
        logs.append(finish(p, log))
        assert (ckpt / "latest").exists(), logs[-1][-3000:]
        latest, rows = (ckpt / "latest").read_text().strip(), train_rows(run)
        assert ("resumed after step " in logs[-1]) == (i > 0), logs[-1][-3000:]
        if fault in ("step:1@3", "push:0@5"):
            assert p.returncode == 1, logs[-1][-3000:]
            died(logs[-1], fault, t_struck, time.monotonic())
            assert latest == ("step_00001" if i == 0 else "step_00003") and max(rows) == (2 if i == 0 else 3)
        if fault == "push:0@5":
            assert "but the last" in logs[-1] and rows[3]["weights/buckets"] >= 2, rows[3]
        elif fault == "model:1@3":
            assert p.returncode not in (0, -signal.SIGKILL), logs[-1][-3000:]  # the controller saw its rank die
            written = sorted(os.listdir(ckpt / "step_00003"))
            assert "rank_00001_model.pt" in written and "rank_00001_optim.pt" not in written, written
            assert "manifest.json" not in written and latest == "step_00001"
        elif fault == "latest@5":
            assert p.returncode == -signal.SIGKILL and "resumed after step 3" in logs[-1], logs[-1][-3000:]
            assert (ckpt / "step_00005" / "manifest.json").exists() and latest == "step_00003"
        elif not fault:
            assert p.returncode == 0 and "resumed after step 3" in logs[-1], logs[-1][-3000:]
    base_log = finish(b, tmp_path / "base.log")
    assert b.returncode == 0, base_log[-3000:]
    want, got = train_rows(base), train_rows(run)
    assert sorted(got) == [0, 1, 2, 3, 4, 5] and len([r for r in metrics(run) if "train/loss" in r]) == 6
    for step in range(6):
        for key in ("train/loss", "train/grad_norm", "rollout/reward_mean", "rollout/samples", "rollout/response_len"):
            assert got[step][key] == want[step][key], (step, key, got[step][key], want[step][key])
    assert (ckpt / "latest").read_text().strip() == "step_00005"


def struck(log: str, spec: str) -> int:
    """The pid of the engine that LOONGSAGE_FAULT=`spec` struck (Ray prefixes an actor's lines with its pid)."""
    line = next((ln for ln in log.splitlines() if f"LOONGSAGE_FAULT={spec} strikes" in ln), None)
    assert line and "not its last" in line, f"the fault {spec} never struck inside a sync:\n{log[-3000:]}"
    return int(re.search(r"pid=(\d+)", line).group(1))


@pytest.mark.slow
@pytest.mark.parametrize("transfer", ["shm", "broadcast"])
def test_engine_killed_mid_sync_comes_back_at_the_current_version_and_nothing_trains_on_mixed_weights(
        tmp_path, transfer):
    """kill -9 one of two CPU engines inside the weight sync to version 2 (LOONGSAGE_FAULT=sync:1@2: it has loaded
    a bucket of that sync that is not the last, so k < n buckets reached it; n comes from the step's metrics), in a
    sync run of 4 steps, over shared memory and over a gloo broadcast:
    the sync neither hangs nor fails the run: it is pushed again to the engine left, the dead one is re-created on
    the trainer's weights at version 2 and serves the next steps; every token of every step was sampled at the
    version it trained as, and with exactly the trainer's weights of that version (gap < 1e-4: a half-applied
    sync, a surviving engine left on mixed weights or a re-created engine on version 0, would show).
    Planted bugs this catches: a failed push taken as the sync's own failure (the run stops), engines continued on
    half-loaded weights, a re-created engine labelled 2 holding other weights, a sync waiting on the dead engine."""
    out = tmp_path / "run"
    p = launch(short_run(out, "num_steps=4", "num_engines=2", "bucket_mb=0.05", f"transfer={transfer}",
                         f"dump_rollouts={tmp_path}/dump"),
               {**env_for(tmp_path), "LOONGSAGE_FAULT": "sync:1@2"}, tmp_path / "run.log")
    log = finish(p, tmp_path / "run.log")
    assert p.returncode == 0, log[-3000:]
    struck(log, "sync:1@2")
    assert "weight sync of version 2 failed as an engine died" in log, log[-3000:]
    new_url = re.search(r"re-created at (\S+), serving weight version 2\n", log)
    assert new_url, log[-3000:]
    rows = train_rows(out)
    assert sorted(rows) == [0, 1, 2, 3]
    assert rows[1]["weights/version"] == 2 and rows[1]["weights/buckets"] >= 2  # k = 1 < n
    for step, r in rows.items():
        assert r["rollout/weight_version_min"] == r["rollout/weight_version_max"] == step, (step, r)
        assert r["train/gap_max"] < 1e-4, (step, r["train/gap_max"])
    assert rows[3]["engines/restarts"] == 1 and rows[3]["engines/healthy"] == 2
    served = [json.loads(line) for s in (2, 3) for line in open(tmp_path / "dump" / f"step_{s:05d}.jsonl")]
    assert any(t["metadata"]["engine"] == new_url.group(1) for t in served)


@pytest.mark.slow
def test_engine_stalled_mid_sync_fails_the_sync_within_its_deadline_naming_the_knob(tmp_path):
    """SIGSTOP one of two CPU engines inside the weight sync to version 2 (LOONGSAGE_FAULT=stall:1@2: a hung
    receiver, its connection open and silent, after k < n buckets): the run stops with exit code 1 and its error is
    the sync's deadline, naming the sync and the knob (weight_sync_timeout), not a later wait on the stalled engine
    (the engines' flush and continue also wait on it, each for as long) nor a hang.
    Planted bugs this catches: a push with no deadline, cleanup after a failed push that waits on the stalled
    engine again and replaces the error, an error that does not say which knob to raise."""
    out, path = tmp_path / "run", tmp_path / "run.log"
    # a deadline of 5 s: a sync of this model takes ~0.1 s (weights/seconds), so the one before the stall succeeds on
    # a machine 10 times as loaded, and the stall is sat out for 5 s, not the default 600
    p = launch(short_run(out, "num_steps=4", "num_engines=2", "bucket_mb=0.05", "weight_sync_timeout=5"),
               # no "Unhandled error" print of the trainer's push, which fails once the engines are gone: the error
               # read below is the run's own, the traceback the controller prints
               {**env_for(tmp_path), "LOONGSAGE_FAULT": "stall:1@2", "RAY_IGNORE_UNHANDLED_ERRORS": "1"}, path)
    try:
        urls = wait_for(lambda: [ln for ln in path.read_text().splitlines() if ln.startswith("engines: ")], p, path,
                        what="the engines")
        healthy = int(json.loads(urls[0][len("engines: "):].replace("'", '"'))[0].rsplit(":", 1)[1])
        wait_for(lambda: "LOONGSAGE_FAULT=stall:1@2 strikes" in path.read_text(), p, path, what="the stall")
        # the deadline passes and the run's end closes its engines (fleet.stop): once engine 0 no longer listens, the
        # stalled one is killed rather than sat out for the 30 s stop gives each engine to close (its half-done update
        # would hold it that long even if let go on)
        wait_for(lambda: p.poll() is not None or not listening(healthy), p, path, what="the engines' close")
        with contextlib.suppress(ProcessLookupError):
            os.kill(struck(path.read_text(), "stall:1@2"), signal.SIGKILL)
        log = finish(p, path)
    finally:
        if "strikes" in (tmp_path / "run.log").read_text():
            with contextlib.suppress(ProcessLookupError, AssertionError):
                os.kill(struck((tmp_path / "run.log").read_text(), "stall:1@2"), signal.SIGKILL)
    assert p.returncode == 1, log[-3000:]
    struck(log, "stall:1@2")
    tail = log[log.index("run failed:"):]
    error = [ln for ln in tail.splitlines() if re.match(r"[\w.]+(Error|Exception): ", ln)][-1]
    assert error.startswith("TimeoutError: weight sync of version 2 to 2 engine(s) did not finish within 5s "
                            "(config `weight_sync_timeout`)"), tail[-3000:]
    assert sorted(train_rows(out)) == [0]  # step 1 trained, and its row is logged after its sync: the one stalled


def listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=5):
        return True
    return False


def mopd_run(out: Path, *extra: str) -> list[str]:
    """recipes/mopd_cpu.yaml shrunk to seconds per step: two tiny teachers (2 SFT steps each), each teaching one of
    two data sources mixed 50/50, 3 steps of 4 prompts x 2 samples, pure distillation (the loss is the top-k KL to
    the teachers' targets alone)."""
    build = {"warmstart_steps": 2, "warmstart_batch_size": 8, "tiny_model": TINY}
    teachers = {"add_teacher": {"path": "tiny", "warmstart_dataset": "synthetic:add:64:11:9", **build},
                "sub_teacher": {"path": "tiny", "warmstart_dataset": "synthetic:sub:64:12:9", **build}}
    sources = [{"name": "add", "dataset": "synthetic:add:64:1:9", "teacher": "add_teacher"},
               {"name": "sub", "dataset": "synthetic:sub:64:3:9", "teacher": "sub_teacher"}]
    return [sys.executable, "loongsage.py", "recipes/mopd_cpu.yaml", f"output_dir={out}", "num_steps=3",
            "prompts_per_step=4", "samples_per_prompt=2", "global_batch_size=8", "micro_batch_size=8", "eval_every=0",
            "teacher_eval=false", "warmstart_steps=2", "warmstart_batch_size=8", "print_every=0",
            f"tiny_model={json.dumps(TINY)}", f"teachers={json.dumps(teachers)}", f"data_sources={json.dumps(sources)}",
            *extra]


@pytest.mark.slow
def test_teacher_killed_mid_scoring_is_recreated_and_the_step_trains_on_the_same_targets(tmp_path):
    """kill -9 the teacher worker inside the scoring of a two-teacher run (LOONGSAGE_FAULT=teacher:0@1: in a group's
    second scoring, one teacher scored the batch, the other not yet; so the first group dies in step 1 and the one
    re-created then in step 2): each time the controller re-creates the teacher group, which scores the whole batch
    again, and the run goes on to the end. Every step's targets equal an uninterrupted run's: with pure distillation
    the loss is the KL to the targets alone, and it and the tokens each teacher scored are bit-identical (sync,
    fp32), steps 1 and 2 included; the sampler's KL to each teacher (it reads the engine's logprobs) agrees to 1e-4.
    Planted bugs this catches: a step trained on the half-scored batch (targets of one teacher only, zeros for the
    other: a different loss), a dead teacher taken as the run's end, a re-created group that serves other weights
    (another snapshot, an unloaded skeleton)."""
    b = launch(mopd_run(tmp_path / "base"), env_for(tmp_path / "b"), tmp_path / "base.log")
    p = launch(mopd_run(tmp_path / "run"), {**env_for(tmp_path), "LOONGSAGE_FAULT": "teacher:0@1"}, tmp_path / "run.log")
    log, base_log = finish(p, tmp_path / "run.log"), finish(b, tmp_path / "base.log")
    assert p.returncode == 0 and b.returncode == 0, (log[-3000:], base_log[-3000:])
    lines = [ln for ln in log.splitlines() if "LOONGSAGE_FAULT=teacher:0@1 strikes" in ln]
    assert len(lines) == 2 and all("_teacher scored, " in ln and "not yet" in ln for ln in lines), lines
    assert "a teacher rank died scoring step 1" in log and "a teacher rank died scoring step 2" in log, log[-3000:]
    want, got = train_rows(tmp_path / "base"), train_rows(tmp_path / "run")
    assert sorted(got) == sorted(want) == [0, 1, 2]
    for step in range(3):
        for key in ("train/loss", "train/opd_loss", "train/opd_kl", "train/grad_norm", "teacher/add_teacher/tokens",
                    "teacher/sub_teacher/tokens"):
            assert got[step][key] == want[step][key], (step, key, got[step][key], want[step][key])
        # the sampler's KL to each teacher reads the engine's logprobs, whose last bits depend on which requests
        # shared a decode step (the batch's longest key length; a one-row step's GEMV): timing, not the targets
        for key in ("teacher/add_teacher/kl", "teacher/sub_teacher/kl"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-4), (step, key)
        assert got[step]["teacher/add_teacher/tokens"] > 0 and got[step]["teacher/sub_teacher/tokens"] > 0


def descendants(pid: int) -> set[int]:
    """Every process under `pid` (read from /proc)."""
    children = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):  # stat: "pid (name) state ppid ..."
            ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(d))
    found, todo = set(), [pid]
    while todo:
        found.update(new := children.get(todo.pop(), []))
        todo += new
    return found


def running(pid: int) -> bool:
    """The process exists and is not a zombie (an exited child its parent has not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def lose_node(p: subprocess.Popen, cluster, node) -> None:
    """A spare node joins and `node` is removed while the controller `p` is held, then it goes on once the node's
    workers (the raylet's processes) noticed their raylet is gone and exited and the cluster counts the node dead
    and the spare alive (or after 10 s)."""
    from ray._private import ray_constants
    os.kill(p.pid, signal.SIGSTOP)
    try:
        cluster.add_node(num_cpus=1)
        workers = descendants(node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid)
        cluster.remove_node(node)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(map(running, workers)):
            time.sleep(0.05)
        with contextlib.suppress(TimeoutError):
            cluster.wait_for_nodes(timeout=max(deadline - time.monotonic(), 0.1))
    finally:
        os.kill(p.pid, signal.SIGCONT)


@pytest.mark.slow
def test_node_lost_engine_node_replaced_trainer_node_stops_and_resumes_exactly(tmp_path):
    """A two-node Ray cluster on this machine (as tests/test_loongsage.py's two-node test builds it: a head with no
    CPU, a node of one CPU for the trainer rank's bundle and one for the engine's), a sync run of 10 steps saving
    every 2, the controller in its own process:

    1. after step 1 a spare node joins and the node holding the engine is removed (its raylet and every process on
       it end): Ray places the engine's bundle again on the spare, the controller re-creates the engine there on
       the trainer's weights (the log says so; engines/restarts = 1) and the run goes on;
    2. once a checkpoint is written after that, a node joins and the node holding the trainer rank is removed: the
       run stops with exit code 1 and the trainer's death as its error;
    3. `resume=true` on the same cluster goes on from `latest` and every step of the run is bit-identical to an
       uninterrupted run on one node (the two-node test shows the layout changes no bit).
    Planted bugs this catches: a re-created engine that waits on the lost node's bundle forever, or is left out of
    routing; an engine re-created on version-0 weights (rows differ); a lost trainer node that hangs the run; a resume
    that does not restore the state (rows differ)."""
    import ray
    from ray.cluster_utils import Cluster
    common = ["num_steps=10", "save_every=2", "engine_wait=600", "trainer_threads=1", "engine_threads=1",
              "borrow_engine_cores=false"]
    base, run = tmp_path / "base", tmp_path / "run"
    b = launch(short_run(base, *common), env_for(tmp_path / "b"), tmp_path / "base.log")
    ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
    env = {k: v for k, v in env_for(tmp_path).items() if k != "RAY_ADDRESS"}
    cmd = short_run(run, *common, f"ray_address={cluster.address}")
    try:
        p = launch(cmd, env, tmp_path / "0.log")
        table = wait_for(lambda: "engine 0 " in (tmp_path / "0.log").read_text() and (tmp_path / "0.log").read_text(),
                         p, tmp_path / "0.log", what="the placement table")
        on = {kind: next(n for n in nodes if n.node_id[:12] in next(ln for ln in table.splitlines()
                                                                    if ln.startswith(kind)))
              for kind in ("trainer 0", "engine 0")}
        assert on["trainer 0"] is not on["engine 0"], table
        wait_for(lambda: "step    1 |" in (tmp_path / "0.log").read_text(), p, tmp_path / "0.log", what="step 1")
        # each node is lost while the controller is held (SIGSTOP), so the fault lands mid-run however fast the
        # steps go (a quiet machine runs all 10 in ~2 s); it comes back to find the node gone
        lose_node(p, cluster, on["engine 0"])  # its raylet ends (SIGTERM) and every process on the node with it
        wait_for(lambda: "re-created at" in (tmp_path / "0.log").read_text(), p, tmp_path / "0.log",
                 what="the engine re-created on another node")
        marker = run / "checkpoints" / "latest"
        seen = marker.read_text() if marker.exists() else ""
        wait_for(lambda: marker.exists() and marker.read_text() != seen, p, tmp_path / "0.log",
                 what="a checkpoint after the engine came back")
        lose_node(p, cluster, on["trainer 0"])
        log = finish(p, tmp_path / "0.log")
        assert p.returncode == 1, log[-3000:]
        tail = log[log.index("run failed:"):]
        # the trainer's actor is gone (dead, or unreachable: Ray may not have marked its node dead yet); no deadline
        assert re.search(r"ray\.exceptions\.Actor(Died|Unavailable)Error", tail) and "TimeoutError" not in tail, tail
        assert re.search(r"engine 0 at \S+ was dead or hung: re-created at \S+, serving weight version \d+", log), \
            log[-3000:]
        latest = marker.read_text().strip()
        p = launch(cmd + ["resume=true"], env, tmp_path / "1.log")
        log = finish(p, tmp_path / "1.log")
        assert p.returncode == 0 and f"resumed after step {int(latest[5:])}" in log, log[-3000:]
    finally:
        cluster.shutdown()
    base_log = finish(b, tmp_path / "base.log")
    assert b.returncode == 0, base_log[-3000:]
    want, got = train_rows(base), train_rows(run)
    assert sorted(got) == list(range(10)) and len([r for r in metrics(run) if "train/loss" in r]) == 10
    for step in range(10):
        for key in ("train/loss", "train/grad_norm", "rollout/reward_mean", "rollout/samples", "rollout/response_len"):
            assert got[step][key] == want[step][key], (step, key, got[step][key], want[step][key])
        assert got[step]["train/gap_max"] < 1e-4
    assert max(r["engines/restarts"] for r in got.values()) == 1  # the first launch's rows; a resume counts anew


# ------------------------------------------------------------------------------------------------
# a flooded router: thousands of agent sessions at once over loopback, the router in its own process


async def flood_session(http, base: str, sid: str, key: str, i: int, kind: str, latencies: list) -> tuple:
    """One agent session of 3 turns, each user turn "<nonce> t<turn>" that the echo engine answers "... ok". `kind`:
    "plain"; "slow" (streams and reads each chunk late, thinks between turns); "gone" (sends turn 1 whole on a raw
    socket and hangs up without reading). Returns (nonce, turns whose answers came back, answers that were wrong)."""
    nonce, wrong, history = f"n{i:04d}x{os.urandom(3).hex()}", [], []
    url, headers = f"{base}/s/{sid}/v1/chat/completions", {"Authorization": f"Bearer {key}"}
    for t in range(3):
        history.append({"role": "user", "content": f"{nonce} t{t}"})
        body = {"model": "loongsage", "messages": history, "max_tokens": 16, "stream": kind == "slow"}
        if kind == "gone" and t == 1:
            raw = json.dumps(body).encode()
            host, port = base.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(f"POST /s/{sid}/v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer "
                         f"{key}\r\nContent-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n".encode()
                         + raw)
            await writer.drain()
            writer.close()
            return nonce, t, wrong
        t0 = time.perf_counter()
        try:
            reply = await flood_turn(http, url, body, headers, kind == "slow")
        except httpx.HTTPError as e:  # the router dropped the connection or did not answer
            wrong.append((t, repr(e)))
            return nonce, t, wrong
        latencies.append(time.perf_counter() - t0)
        if reply != f"{nonce} t{t} ok":
            wrong.append((t, reply[:80]))
        history.append({"role": "assistant", "content": reply})
        if kind == "slow":
            await asyncio.sleep(random.uniform(0, 0.5))  # a client that thinks between turns
    return nonce, 3, wrong


async def flood_turn(http, url: str, body: dict, headers: dict, slow: bool) -> str:
    """One turn's answer; `slow`: streamed, each chunk read late, so the router's writes back up."""
    if slow:
        reply = ""
        async with http.stream("POST", url, json=body, headers=headers) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    reply += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                    await asyncio.sleep(0.02)
        return reply
    r = await http.post(url, json=body, headers=headers)
    return r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else f"HTTP {r.status_code}"


@pytest.mark.slow
def test_router_flood_of_2000_sessions_loses_and_crosses_nothing_and_gives_its_memory_back(tiny_model_dir):
    """2,000 concurrent agent sessions of 3 short turns against AgentFlow's Router over loopback (real HTTP, the
    router in its own process: tests/flood_router.py, an echo engine in place of the model): 10% stream and read
    late, 10% hang up after sending a turn. Every turn carries its session's nonce and the echo engine answers it
    back, so a reply given to the wrong session, or a trajectory holding another session's turns, is caught:
    0 wrong answers, 0 lost turns (every answered turn is in its trajectory), 0 crossed trajectories. After the
    sessions close no Session object is alive in the router and its RSS is within 10% of its baseline. The baseline
    is taken after a warm-up flood of the same size: the first flood of a cold router raises its RSS for good (~15%
    here) though every object is freed, as CPython and glibc keep the arenas of their high-water mark; measured,
    later floods leave it within 1%, so what this bounds is growth per flood, a leak. Prints sessions, p99 turn
    latency and RSS cold / baseline / peak / after.
    Planted bugs this catches: a reply routed by anything but the session (crossed), a session table or per-session
    buffer that is never freed at close (RSS), a hung-up client's turn written into another session."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    assert hard >= 4500, f"RLIMIT_NOFILE hard limit {hard}: 2,000 sessions need ~2 descriptors each here and there"
    router = subprocess.Popen([sys.executable, "tests/flood_router.py", tiny_model_dir], cwd=ROOT, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def ask(cmd: dict) -> dict:
        router.stdin.write(json.dumps(cmd) + "\n")
        router.stdin.flush()
        return json.loads(router.stdout.readline())

    async def agent(*args) -> tuple:
        # a client of its own, its connection kept alive across the session's turns, as an agent's SDK does: the
        # router keeps an idle connection 75 s and the client 5 s, so none is closed under a client sending on it.
        # verify=False: plain HTTP here, and it spares each client loading the CA bundle (~24 ms)
        async with httpx.AsyncClient(timeout=300, verify=False) as http:
            return await flood_session(http, base, *args)

    async def flood(sessions: list, first: int) -> tuple[list, list]:
        latencies = []
        kinds = ["slow" if i % 10 == 3 else "gone" if i % 10 == 7 else "plain" for i in range(len(sessions))]
        done = await asyncio.wait_for(asyncio.gather(*(agent(sid, key, first + i, kind, latencies)
                                                       for i, ((sid, key), kind) in enumerate(zip(sessions, kinds)))),
                                      900)
        return done, latencies

    try:
        base, n = json.loads(router.stdout.readline())["url"], 2000
        cold = ask({"rss": True})["rss"]
        asyncio.run(flood(ask({"open": n})["sessions"], 5000))  # the warm-up flood: see the docstring
        ask({"close": True})
        baseline = ask({"rss": True})["rss"]
        sessions = ask({"open": n})["sessions"]
        done, latencies = asyncio.run(flood(sessions, 0))
        peak = ask({"rss": True})["peak"]
        texts = ask({"close": True})["texts"]
        after = ask({"rss": True})
    finally:
        router.kill()
        router.wait()
    p99 = sorted(latencies)[int(0.99 * len(latencies))]
    print(f"router flood: {n} sessions, {len(latencies)} answered turns, p99 {p99 * 1000:.0f} ms; router RSS cold "
          f"{cold / 2**20:.1f} MiB, baseline {baseline / 2**20:.1f} MiB, peak {peak / 2**20:.1f} MiB, after "
          f"{after['rss'] / 2**20:.1f} MiB")
    wrong = [(i, w) for i, (_, _, w) in enumerate(done) if w]
    assert not wrong, wrong[:5]
    lost, crossed = [], []
    for (sid, _), (nonce, turns, _) in zip(sessions, done):
        found = set(re.findall(r"n\d{4}x[0-9a-f]{6}(?= t\d)", texts[sid]))
        crossed += [(sid, found - {nonce})] if found - {nonce} else []
        for t in range(turns):  # every turn answered to the client is in the trajectory, question and answer
            if f"{nonce} t{t} ok" not in texts[sid]:
                lost.append((sid, t))
    assert not crossed and not lost, (crossed[:5], lost[:5])
    assert len(latencies) == sum(turns for _, turns, _ in done) > 2 * n  # the plain and slow sessions' 3 turns
    assert after["alive"] == 0  # every session closed is freed: nothing of them is kept
    assert after["rss"] <= 1.1 * baseline, (cold, baseline, peak, after)

# ------------------------------------------------------------------------------------------------
# engine health at the pool: real CPU engines, one in this process, the victims in their own processes


def engine_process(model_dir: str, port: int, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "cpu_engine.py", "--model-path", model_dir, "--port", str(port),
                             "--max-len", "512"], cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def free_port() -> int:
    return transfermesh.free_port("127.0.0.1")


LONG = dict(temperature=1.0, max_new_tokens=300, ignore_eos=True)  # 300 decode steps: still in flight when hit


@pytest.mark.slow
def test_engine_pool_moves_requests_off_a_killed_and_a_hung_engine(tiny_model_dir, tmp_path):
    """A request on an engine that is killed (connection reset) or hung (SIGSTOP: the connection stays
    open, nothing answers) finishes on the other engine with exactly the tokens that engine gives the
    same seeded request; the bad engine leaves routing and replace() brings in its successor.
    Planted bugs this catches: no probe after a failed call (the killed engine stays in routing), no
    periodic probe (requests on the hung engine wait for the pool's 600 s HTTP timeout: the drill's 300 s bound
    fails them), retried requests not counted, replace() not routing to the new engine."""
    import asyncio

    import agentflow
    import cpu_engine
    import rollout
    # seeded requests draw the same tokens on any engine under deterministic inference only (as on SGLang)
    good_url, good = cpu_engine.serve(tiny_model_dir, max_batch=64, max_len=512, seed=0,
                                      enable_deterministic_inference=True)
    ports = [free_port(), free_port()]
    victims = [engine_process(tiny_model_dir, port, tmp_path / f"engine{i}.log") for i, port in enumerate(ports)]
    try:
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        for url, proc, i in zip(urls, victims, range(2)):
            rollout.wait_healthy(url, 120, proc, str(tmp_path / f"engine{i}.log"))

        async def drill(victim_url: str, victim: subprocess.Popen, sig: int, check_every_s: float):
            # 5 s: the probe (/server_info) is answered by the scheduler between two steps, in this process beside the
            # drill, on a shared machine
            pool = rollout.EnginePool([victim_url, good_url], check_every_s=check_every_s, health_timeout_s=5.0)
            prompts = [[1 + i, 2, 3] for i in range(6)]
            tasks = [asyncio.ensure_future(pool.generate(ids, dict(LONG, sampling_seed=100 + i), f"r{i}",
                                                         prefer=victim_url)) for i, ids in enumerate(prompts)]

            async def generating() -> set[str]:  # rids the victim runs, each with a token or more
                state = (await pool.http.get(f"{victim_url}/get_server_info")).json()["internal_states"][0]
                return {r["rid"] for r in state["running"] if r["completion_tokens"] > 0}
            # hit while the victim generates all six with hundreds of tokens to go (a fixed sleep before the signal
            # was a race a fast machine lost: it finished the requests first)
            while not {f"r{i}" for i in range(len(prompts))} <= await generating():
                await asyncio.sleep(0.01)
            os.kill(victim.pid, sig)
            # half the pool's HTTP timeout: only a probe, not a failed call, moves requests off a hung engine sooner
            answers = await asyncio.wait_for(asyncio.gather(*tasks), pool.timeout_s / 2)
            # the same seeded requests sent straight to the good engine: the retry was invisible
            direct = await asyncio.gather(*(rollout.generate(pool.http, good_url, ids, dict(LONG, sampling_seed=100 + i))
                                            for i, ids in enumerate(prompts)))
            state = (sorted(pool.dead), pool.healthy(), pool.retried)
            pool.replace(victim_url, good_url + "/")  # a successor at a new URL (here: the good engine again)
            after = (pool.urls, pool.healthy(), pool.pick())
            await pool.close()
            return answers, direct, state, after

        # killed: found by the probe that follows the failed call (no periodic probe running);
        # hung: no call fails, only the periodic probe can find it
        for victim_url, victim, sig, every in ((urls[0], victims[0], signal.SIGKILL, 0.0),
                                               (urls[1], victims[1], signal.SIGSTOP, 0.5)):
            answers, direct, (dead, healthy, retried), (urls_after, healthy_after, pick) = \
                asyncio.run(drill(victim_url, victim, sig, every))
            assert [u for u, _ in answers] == [good_url] * 6
            assert [a["output_ids"] for _, a in answers] == [d["output_ids"] for d in direct]
            assert all(len(a["output_ids"]) == 300 for _, a in answers)
            assert dead == [victim_url] and healthy == [good_url] and retried == 6
            assert urls_after == [good_url, good_url] and len(healthy_after) == 2 and pick == good_url
    finally:
        for v in victims:
            v.kill()
            v.wait()
        good.shutdown()


# ------------------------------------------------------------------------------------------------
# no silent hang: fleet.wait


def test_wait_fails_fast_on_a_dead_rank_and_names_the_knob_on_a_timeout(ray_session):
    """A rank that dies while the other waits for it in a collective ends the wait at once; a call
    past its deadline raises naming what timed out and the config knob that sets the limit, and the
    health check ticks while it waits.
    Planted bugs this catches: getting the results one by one in list order (waits on the survivor
    first); a timeout without the knob's name; no tick while waiting."""
    import ray

    import fleet

    @ray.remote(num_cpus=0)
    class Rank:
        def collective(self, die: bool):
            if die:
                time.sleep(0.5)
                os._exit(1)  # killed mid-step, as by the OOM killer
            time.sleep(300)  # the survivor: blocked on its dead peer

    ranks = [Rank.remote(), Rank.remote()]
    try:
        # the dead rank's error, not a TimeoutError after 120 s: the wait did not sit on the survivor first
        with pytest.raises(ray.exceptions.RayActorError, match="Rank"):
            fleet.wait([ranks[0].collective.remote(False), ranks[1].collective.remote(True)],
                       "train step 7", 120, "actor_timeout")
        ticks = []
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"weight sync of version 3 did not finish within 2s "
                                               r"\(config `weight_sync_timeout`\)"):
            fleet.wait(ranks[0].collective.remote(False), "weight sync of version 3", 2.0, "weight_sync_timeout",
                       every=0.5, tick=lambda: ticks.append(1))
        assert time.monotonic() - t0 >= 2.0 and len(ticks) >= 1  # it waited out its deadline, checking health meanwhile
    finally:
        for r in ranks:
            ray.kill(r)


# ------------------------------------------------------------------------------------------------
# the pieces resume rests on (pure functions)


def test_producer_state_goes_on_where_it_stopped_across_epochs():
    """A producer rebuilt from the state a checkpoint saved hands out exactly the groups (prompts and sequence
    numbers, hence sampling seeds) the first one would have handed out next, across an epoch boundary; groups
    in flight at the checkpoint are dispatched again first. Planted bugs this catches: a cursor counted
    before the sample is taken, an epoch's order not reproducible from the seed, in-flight prompts dropped."""
    import config
    import loongsage
    cfg = config.load_config(None, ["prompts_per_step=3", "samples_per_prompt=2", "global_batch_size=6",
                                    "micro_batch_size=6"])
    samples = [{"i": i} for i in range(10)]

    def step(prod):  # one sync step: dispatch B groups, all finish, train on them
        new = prod.dispatch()
        prod.receive([{"seq": seq, "aborted": False, "trajs": [{"reward": 1.0, "weight_versions": [0],
                       "loss_mask": [1], "rollout_logprobs": [0.0], "group_id": seq}]} for seq, _ in new], 0)
        prod.pop_batch()
        return [(seq, sample["i"]) for seq, sample in new]

    first = loongsage.Producer(cfg, samples)
    taken = [step(first) for _ in range(4)]  # 12 prompts: past the end of epoch 0
    saved = json.loads(json.dumps(first.state()))  # what a checkpoint stores
    assert saved["next_seq"] == 12 and saved["cursor"] == 12 and saved["pending"] == []
    rest = [step(first) for _ in range(5)]
    again = loongsage.Producer(cfg, samples, saved)
    assert [step(again) for _ in range(5)] == rest
    seen = [i for batch in taken + rest for _, i in batch]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))  # whole epochs
    # a group in flight at the checkpoint goes out again first on resume
    inflight = loongsage.Producer(cfg, samples)
    new = inflight.dispatch()
    resumed = loongsage.Producer(cfg, samples, json.loads(json.dumps(inflight.state())))
    assert [s["i"] for _, s in resumed.dispatch()] == [s["i"] for _, s in new]


# ------------------------------------------------------------------------------------------------
# checkpoints that survive the worst moment: checksums, resume=previous, a full disk (fleet.save_run_state and
# load_run_state driving real trainer ranks)


def ckpt_cfg(out: Path, **over):
    from test_trainer import make_cfg
    return dataclasses.replace(make_cfg(), output_dir=str(out), resume=True, **over)


def exported(ranks) -> dict:
    return dict(ranks.call("export_hf_weights")[0])


def test_checksums_refuse_a_damaged_file_by_name_and_previous_goes_back_one(ray_session, tiny_model_dir, tmp_path):
    """Two checkpoints (steps 0 and 1) of one real rank, then the second one damaged four ways, each refused at
    resume with an error naming the damaged file: a byte flipped in the middle of the optimizer file (same size),
    the model file cut short, one digit of the controller's JSON changed (still valid JSON: it would load), the
    manifest gone. Undamaged, it loads; with the optimizer file damaged, resume=previous loads step 0 exactly
    (the weights exported then, and the same next training step), and `latest` names step 0 from then on.
    Planted bugs this catches: no checksum (a flipped byte trains on garbage, a changed cursor replays the wrong
    data), a size-only check (the flip keeps the size), a check of the rank files only (the JSON), a manifest
    hashed from memory rather than from the file written, `previous` taking latest itself or the oldest one,
    `latest` left naming the damaged checkpoint (a crash after resuming would load it again)."""
    import fleet
    from test_trainer import Ranks, assert_same_weights, make_batch, step_numbers
    cfg = ckpt_cfg(tmp_path / "run")
    one = Ranks(cfg, 1)
    try:
        one.call("load_hf", tiny_model_dir)
        batch_a, batch_b = make_batch(seed=2), make_batch(seed=3)
        one.call("train_step", batch_a, 0)
        fleet.save_run_state(cfg, one.workers, 0, {"producer": {"cursor": 4}, "rng": fleet.rng_state()})
        w0 = exported(one)
        [m1] = one.call("train_step", batch_b, 1)
        fleet.save_run_state(cfg, one.workers, 1, {"producer": {"cursor": 8}, "rng": fleet.rng_state()})
        w1 = exported(one)
        ckpt = tmp_path / "run" / "checkpoints"
        step1 = ckpt / "step_00001"
        one.call("load_hf", tiny_model_dir)
        assert fleet.load_run_state(cfg, one.workers)[0] == 2  # undamaged: it loads
        assert_same_weights(list(exported(one).items()), w1)

        def damage(name: str, change) -> None:
            good = (step1 / name).read_bytes()
            (step1 / name).write_bytes(change(good))
            with pytest.raises(Exception, match=re.escape(str(step1 / name))):
                fleet.load_run_state(cfg, one.workers)
            (step1 / name).write_bytes(good)

        flip = lambda b: b[:len(b) // 2] + bytes([b[len(b) // 2] ^ 1]) + b[len(b) // 2 + 1:]  # noqa: E731
        damage("rank_00000_optim.pt", flip)
        damage("rank_00000_model.pt", lambda b: b[:len(b) - 4096])
        damage("controller_state.json", lambda b: b.replace(b'"cursor": 8', b'"cursor": 9'))
        damage("manifest.json", lambda b: b"")
        (step1 / "rank_00000_optim.pt").write_bytes(flip((step1 / "rank_00000_optim.pt").read_bytes()))
        one.call("load_hf", tiny_model_dir)
        start, state = fleet.load_run_state(dataclasses.replace(cfg, resume="previous"), one.workers)
        assert (start, state["producer"]) == (1, {"cursor": 4})
        assert_same_weights(list(exported(one).items()), w0)
        [again] = one.call("train_step", batch_b, 1)
        assert step_numbers(again) == step_numbers(m1)  # optimizer state and RNG came back too
        assert (ckpt / "latest").read_text().strip() == "step_00000"
    finally:
        one.close()


def test_fault_points_strike_only_where_named_and_the_spellings_are_checked(monkeypatch):
    """LOONGSAGE_FAULT=point[:rank][@step] kills (SIGKILL; SIGSTOP for `stall`) at that point of that step's save or
    weight sync on that rank, nowhere else; resume and on_save_error take only their documented values.
    Planted bugs this catches: a rank's point firing on every rank or on the controller, `@step` ignored (a drill
    would strike the first save, with no checkpoint before it to keep), a stall that kills (the drill of a hung
    engine would test a dead one), a typo such as resume=prevous read as true (it would load latest, the
    checkpoint the user meant to skip)."""
    import config
    import trainer
    hits = []
    monkeypatch.setattr(trainer.os, "kill", lambda pid, sig: hits.append(sig))
    for spec, (point, step, rank), sig in [
            ("model:1@3", ("model", 3, 1), signal.SIGKILL), ("model:1@3", ("model", 3, 0), None),
            ("model:1@3", ("model", 1, 1), None), ("model:1@3", ("optim", 3, 1), None),
            ("optim:0", ("optim", 9, 0), signal.SIGKILL), ("latest@5", ("latest", 5, None), signal.SIGKILL),
            ("latest@5", ("controller", 5, None), None), ("", ("latest", 5, None), None),
            ("model:0@3", ("model", None, 0), None), ("sync:1@2", ("sync", 2, 1), signal.SIGKILL),
            ("sync:1@2", ("stall", 2, 1), None), ("stall:1@2", ("stall", 2, 1), signal.SIGSTOP),
            ("stall:1@2", ("stall", 1, 1), None), ("push:0@5", ("push", 5, 0), signal.SIGKILL),
            ("push:0@5", ("push", 5, 1), None), ("step:1@3", ("step", 3, 1), signal.SIGKILL),
            ("step:1@3", ("step", 3, 0), None)]:
        monkeypatch.setenv("LOONGSAGE_FAULT", spec)
        hits.clear()
        trainer.fault(point, step, rank)
        assert hits == ([sig] if sig else []), (spec, point, step, rank)
    assert config.load_config(None, ["resume=previous"]).resume == "previous"
    for bad, message in (("resume=prevous", "choose true, false or previous"), ("on_save_error=ignore",
                                                                               "choose 'stop' or 'skip'")):
        with pytest.raises(ValueError, match=re.escape(message)):
            config.load_config(None, [bad])


def mount_tmpfs(where: Path, size: int) -> None:
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if done.returncode:
        pytest.skip(f"a size-limited filesystem needs `mount -t tmpfs`, refused here: {done.stderr.decode()}")


def test_disk_full_mid_save_removes_the_partial_checkpoint_and_stops_or_skips(ray_session, tiny_model_dir,
                                                                             tmp_path, capsys):
    """A real ENOSPC: output_dir on a tmpfs with room for one and a half checkpoints of two ranks (DP=2), so the
    second save runs out of space part way. With on_save_error=stop the save raises an OSError (errno ENOSPC)
    saying which step failed and which checkpoint `latest` still names; with skip it returns None and says so.
    Either way the partial checkpoint and every temporary file are gone, `latest` names step 0, whose files all
    match their manifest and load, and both ranks go on training (a step needs both: neither waits in a
    collective for the other).
    Planted bugs this catches: the partial directory or a .tmp file left behind (the disk stays full), `latest`
    moved to the failed save, the rank without the error left in the save's barrier (the run hangs), an error
    that hides ENOSPC or is raised for on_save_error=skip, a removal that takes the previous checkpoint too."""
    import fleet
    import trainer
    from test_trainer import Ranks, assert_same_weights, make_batch
    dp2 = Ranks(ckpt_cfg(tmp_path / "probe", trainer_workers=2), 2)
    disk = tmp_path / "disk"
    try:
        dp2.call("load_hf", tiny_model_dir)
        batch = make_batch()
        dp2.call("train_step", batch, 0)
        probe = ckpt_cfg(tmp_path / "probe")
        size = sum(p.stat().st_size for p in fleet.save_run_state(probe, dp2.workers, 0, {}).iterdir())
        mount_tmpfs(disk, size * 3 // 2)
        cfg = ckpt_cfg(disk)
        assert fleet.save_run_state(cfg, dp2.workers, 0, {}) == disk / "checkpoints" / "step_00000"
        w0 = exported(dp2)
        for step, on_error in ((1, "stop"), (2, "skip")):
            dp2.call("train_step", batch, step)
            if on_error == "stop":
                with pytest.raises(OSError, match=r"checkpoint of step 1 could not be written .*No space left.* "
                                                  r"names step_00000, complete") as failed:
                    fleet.save_run_state(cfg, dp2.workers, 1, {})
                assert failed.value.errno == errno.ENOSPC
            else:
                assert fleet.save_run_state(dataclasses.replace(cfg, on_save_error="skip"), dp2.workers, 2, {}) is None
                assert "training goes on without it (on_save_error=skip)" in capsys.readouterr().out
            left = sorted(str(p.relative_to(disk)) for p in disk.rglob("*"))
            kept = sorted(os.listdir(disk / "checkpoints" / "step_00000"))
            assert left == ["checkpoints", "checkpoints/latest", "checkpoints/step_00000",
                            *[f"checkpoints/step_00000/{f}" for f in kept]]
            assert (disk / "checkpoints" / "latest").read_text() == "step_00000\n"
        saved = json.loads((disk / "checkpoints" / "step_00000" / "manifest.json").read_text())["files"]
        assert len(saved) == 6  # two ranks' model and optimizer files, the controller's JSON and config
        for name, want in saved.items():
            trainer.verify(disk / "checkpoints" / "step_00000" / name, want)
        dp2.call("load_hf", tiny_model_dir)
        assert fleet.load_run_state(cfg, dp2.workers) == (1, {"step": 0})
        assert_same_weights(list(exported(dp2).items()), w0)
        # one rank's write fails, the other's succeeds (a directory where rank 1's file goes): both raise at once
        (tmp_path / "one" / "rank_00001_model.pt" / "x").mkdir(parents=True)
        with pytest.raises(IsADirectoryError, match=r"rank 1 writing .*rank_00001_model.pt: Is a directory"):
            fleet.wait([w.save_checkpoint.remote(str(tmp_path / "one")) for w in dp2.workers], "the save", 120, "-")
        assert os.listdir(tmp_path / "one") == ["rank_00001_model.pt"]  # rank 0's files and rank 1's .tmp removed
    finally:
        dp2.close()
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
