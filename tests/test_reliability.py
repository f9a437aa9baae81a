"""Nothing lost (issue 10, input / agent / sandbox / validation half): failed and empty trajectories
never crash a step, options without a working path are rejected at --check, the router answers what
the OpenAI / Anthropic APIs reject with a 4xx in their error shape and keeps serving, and the sandboxes
contain what they claim to (and say what they do not).

Real parts throughout: the CPU engine over HTTP behind the router, the official openai / anthropic
clients, real processes in the sandboxes, Ray + Megatron-Core in the controller run. The one part that
cannot run here is a Docker daemon: the exact `docker run` command is checked without one, the real
run is skipped unless a daemon answers.
"""
import asyncio
import json
import math
import os
import subprocess
import tempfile
from pathlib import Path

import httpx
import pytest
import torch

import agentflow
import config
import loongsage
import sandbox
import trainer

ROOT = Path(__file__).resolve().parents[1]


def run(coro, timeout=120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


# ----------------------------------------------------------------------------------------------
# failed and empty trajectories: collate, rewards, groups


def _traj(prompt, response, mask, reward=0.0, group_id=0, status="ok"):
    return dict(prompt_ids=prompt, response_ids=response, loss_mask=mask, rollout_logprobs=[-0.5] * len(response),
                weight_versions=[0] * len(response), reward=reward, group_id=group_id, status=status,
                metadata={})


def test_collate_keeps_a_trajectory_that_failed_before_its_first_model_call():
    empty = _traj([5, 6], [], [], status="failed")
    mb = trainer.collate([_traj([4], [3, 2], [1, 1], reward=1.0), empty])
    assert mb["tokens"].tolist() == [[4, 3, 2], [5, 6, 0]]
    assert mb["loss_mask"].tolist() == [[1, 1], [0, 0]]       # the failed row adds nothing to the loss
    assert mb["rewards"].tolist() == [1.0, 0.0] and mb["resp_len"].tolist() == [2, 0]
    # a micro-batch of only failed rows still has one position to gather from a (B, T-1) logp row
    only = trainer.collate([empty, _traj([7], [], [], status="failed")])
    assert only["tokens"].shape == (2, 2) and only["resp_pos"].shape == (2, 1)
    assert only["loss_mask"].sum() == 0 and only["weight_versions"].tolist() == [[-1], [-1]]
    logp = torch.randn(2, only["tokens"].shape[1] - 1)       # what _forward_logp gathers from
    assert logp.gather(1, only["resp_pos"]).shape == (2, 1)
    with pytest.raises(ValueError, match="no prompt token"):
        trainer.collate([_traj([], [3], [1])])


def test_groups_with_no_trainable_token_are_left_out_and_counted():
    ok, failed = _traj([1], [2], [1], reward=1.0, group_id=0), _traj([1], [], [], group_id=0, status="failed")
    dead = [dict(_traj([1], [], [], group_id=1, status="failed"), metadata={"error": "agent x raised boom"})] * 2
    kept, n_empty, error = loongsage.drop_empty_groups([ok, failed] + dead)
    assert kept == [ok, failed] and n_empty == 1 and error == "agent x raised boom"  # partial group stays whole
    assert loongsage.drop_empty_groups(dead)[:2] == ([], 1)
    m = loongsage.rollout_metrics([ok, failed] + dead, 0)
    assert m["rollout/failed"] == 3 and m["rollout/failed_frac"] == 0.75


@pytest.mark.parametrize("value, reward, error", [
    (1, 1.0, None), (0.5, 0.5, None), (True, 1.0, None), (torch.tensor(0.25), 0.25, None),
    (float("nan"), None, "must be finite"), (float("inf"), None, "must be finite"),
    (None, None, "must return a number"), ("0.5", None, "must return a number"),
    ({"r": 1}, None, "must return a number"), ([1.0, 0.0], None, "turn_rewards"),
])
def test_rewards_must_be_finite_numbers(value, reward, error):
    got, err = agentflow._scalar_reward(value, "reward r")
    assert got == reward
    assert (err is None) if error is None else (error in err and "reward r" in err)


# ----------------------------------------------------------------------------------------------
# validation: options without a working path are rejected at --check, saying what exists instead


@pytest.mark.parametrize("overrides, message", [
    (["advantage=gae", "critic_lr=0"], "critic_lr=0.0 must be > 0"),
    (["transfer=carrier_pigeon"], "transfer='carrier_pigeon': choose one of"),
    (["transfer=cuda_ipc"], "transfer=cuda_ipc needs device=cuda"),
    (["sandbox=vm"], "sandbox='vm': choose 'local', 'docker', 'auto' or a dotted path"),
    (["num_engines=0"], "num_engines=0 must be a positive integer"),
    (["samples_per_prompt=0"], "samples_per_prompt=0 must be a positive integer"),
    (["micro_batch_size=0"], "micro_batch_size=0 must be a positive integer"),
    (["max_turns=0"], "max_turns=0 must be a positive integer"),
    (["agent_timeout=0"], "agent_timeout=0.0 must be > 0"),
    (["agent_retries=-1"], "agent_retries=-1 must be >= 0"),
    (["top_k=0"], "top_k=0: use -1 (off)"),
    (["top_p=0"], "top_p=0.0 must be in (0, 1]"),
    (["temperature=-1"], "temperature=-1.0 must be >= 0"),
    (["train_only=true", "rollout_only=true", "load_rollouts=x"], "would neither generate nor train"),
    (["tiny_model.hiden_size=8"], "did you mean 'hidden_size'"),
    (["agent=recipes.calc.agent", "agent_command=python x.py"], "not both"),
    (["agent_preload=[openai]"], "agent_command, which is empty"),
    (["agent_preload=[openai]", "agent_command=python x.py", "sandbox=docker"], "set sandbox=local"),
    (["agent_preload=[openai]", "agent_command=python x.py | tee log"], "Python agents only"),
])
def test_options_without_a_working_path_fail_check(overrides, message):
    with pytest.raises(ValueError) as e:
        config.load_config(str(ROOT / "recipes/arith_cpu.yaml"), overrides)
    assert message in str(e.value)


def test_cli_check_rejects_a_critic_knob_without_gae_with_exit_code_2(capsys):
    """loongsage.main, which the command line's exit code comes from (the script itself: test_loongsage.py's
    test_cli_check_and_bad_key_exit_codes)."""
    code = loongsage.main([str(ROOT / "recipes/arith_cpu.yaml"), "critic_warmup_steps=2", "--check"])
    err = capsys.readouterr().err
    assert code == 2 and "config error" in err and "advantage=gae" in err


# ----------------------------------------------------------------------------------------------
# sandbox containment: each case runs for real; where this machine cannot contain it, the sandbox
# says so in `contained` and the test checks that it says so (skips the containment assertion)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return False


# A bounded fork bomb: forks sleeping children until fork fails or 400 exist (400 short-lived sleepers
# are harmless even where nothing contains them), then reports how many it got.
FORK_BOMB = """
import os, time
n = 0
for _ in range(400):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(3)
        os._exit(0)
    n += 1
print(n)
"""

# A memory hog across processes: 6 children each touch 150 MB (each under the per-process cap of 300).
MEMORY_HOG = """
import os, time
for _ in range(6):
    if os.fork() == 0:
        x = bytearray(150 * 2 ** 20)
        for j in range(0, len(x), 4096):
            x[j] = 1
        time.sleep(1)
        os._exit(0)
kept = 0
for _ in range(6):
    _, status = os.wait()
    kept += os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
print(kept)
"""


def test_local_sandbox_contains_fork_bomb_memory_hog_outside_writes_sleep_and_network():
    import socket
    server = socket.socket()  # something on loopback to connect to
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    connect = f"python -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3); print('connected')\""
    tag = f"loongsage-escape-{os.getpid()}"  # unique: a stale file from another run cannot fail this one
    outside, in_repo = Path("/tmp") / tag, ROOT / tag

    async def body():
        # the bomb gets a sandbox of its own: the children it leaves count against its pids cap until
        # init reaps them, which on some machines (this one) takes seconds
        bomb_box = await sandbox.LocalSandbox(max_procs=32).create()
        bomb_box.write("bomb.py", FORK_BOMB)
        bomb = await bomb_box.execute("python bomb.py", timeout_s=30)
        await bomb_box.delete()
        box = await sandbox.LocalSandbox(cpu_s=20, memory_mb=300, max_procs=32, network=False).create()
        box.write("hog.py", MEMORY_HOG)
        hog = await box.execute("python hog.py", timeout_s=30)
        writes = await box.execute(f"echo x > inside.txt; cat inside.txt; echo x > {outside}; "
                                   f"echo x > {in_repo}; echo x > $HOME/../{tag}-home", timeout_s=10)
        t0 = asyncio.get_running_loop().time()
        sleep = await box.execute("setsid sleep 300 > /dev/null 2>&1 < /dev/null & echo $! > escaped.pid; sleep 300",
                                  timeout_s=1)
        escaped = int(Path(box.dir, "escaped.pid").read_text())  # (output read before a timeout is lost)
        escaped_alive = _alive(escaped)  # after the command, before delete()
        offline = await box.execute(connect, timeout_s=10)
        online_box = await sandbox.LocalSandbox(network=True).create()
        online = await online_box.execute(connect, timeout_s=10)
        contained, home = box.contained, box.dir
        await box.delete()
        await online_box.delete()
        return bomb, hog, writes, sleep, asyncio.get_running_loop().time() - t0, escaped_alive, offline, online, \
            contained, home
    try:
        bomb, hog, writes, sleep, waited, escaped_alive, offline, online, contained, home = run(body())
    finally:
        server.close()
        escapes = [outside, in_repo, Path(tempfile.gettempdir()) / f"{tag}-home"]  # $HOME/.. of the sandbox
        leaked = [p for p in escapes if p.exists()]
        for p in leaked:
            p.unlink()
    assert set(contained) == {"writes", "network", "procs", "total_memory"}
    # independent of the sandbox's own probe: where the OS lets util-linux make the namespaces and a pids
    # cgroup is writable, the sandbox must use them (a broken isolation must not pass as "not available")
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    if subprocess.run(["unshare", *user, "--mount", "--net", "true"], capture_output=True).returncode == 0:
        assert contained["writes"] and contained["network"]
    if os.geteuid() == 0 and os.access("/sys/fs/cgroup/pids", os.W_OK):
        assert contained["procs"]
    # the long sleep: killed at the wall clock, with a child that left the process group (setsid)
    assert sleep.timed_out and sleep.wall_s < 300 and waited < 300  # not left to run out its 300 s sleeps
    if contained["procs"]:  # a pids cgroup: 32 tasks in all, the bomb's python among them
        assert int(bomb.stdout) < 32 and not escaped_alive  # the setsid child died with its command
    if contained["total_memory"]:  # a memory cgroup: 300 MB for the whole sandbox, so at most one child keeps 150
        assert int(hog.stdout) <= 1
    assert writes.stdout.split("\n")[0] == "x"  # inside the sandbox dir: fine
    if contained["writes"]:
        assert writes.stderr.count("Read-only file system") == 3
        assert not leaked and Path(home).parent == Path(tempfile.gettempdir())
    assert "connected" in online.stdout  # network=True (black-box agents): loopback reaches the router
    if contained["network"]:
        assert "connected" not in offline.stdout and "Network is unreachable" in offline.stderr


def test_local_sandbox_states_what_it_cannot_contain(monkeypatch):
    """Where neither namespaces nor cgroups are available, `contained` says so (and the command still runs)."""
    monkeypatch.setattr(sandbox, "_ISOLATION", False)
    monkeypatch.setattr(sandbox, "_cgroup", lambda controller, name, limit_value: None)

    async def body():
        box = await sandbox.LocalSandbox(network=False).create()
        r = await box.execute("echo ran")
        await box.delete()
        return box.contained, r
    contained, r = run(body())
    assert contained == {"writes": False, "network": False, "procs": False, "total_memory": False}
    assert r.stdout == "ran\n"


def test_docker_sandbox_builds_the_exact_docker_run_command():
    """No daemon needed: the limits the issue lists are in the command, with docker's units."""
    box = sandbox.DockerSandbox(image="img:1", cpus=1.5, cpu_s=11, memory_mb=512,
                                                               file_mb=2, max_procs=64, network=False)
    box.name, box.dir = "loongsage-x", "/tmp/loongsage-sbx-x"
    assert box.run_args() == [
        "run", "-d", "--rm", "--name", "loongsage-x", "--network", "none",
        "--memory", "512m", "--memory-swap", "512m", "--cpus", "1.5", "--pids-limit", "64",
        "--ulimit", "cpu=11:11", "--ulimit", f"fsize={2 * 2 ** 20}:{2 * 2 ** 20}", "--read-only",
        "--tmpfs", "/tmp:rw,size=64m", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
        "-v", "/tmp/loongsage-sbx-x:/work", "-v", f"{ROOT}:/loongsage:ro", "-w", "/work", "img:1", "sleep", "infinity"]
    assert sandbox.DockerSandbox(network=True).run_args()[5:7] == ["--network", "host"]  # agents reach the router


def test_make_sandbox_passes_the_same_limits_to_both_kinds(monkeypatch):
    """The code-test reward and the code-repair tool call make_sandbox("auto", cpu_s=..., network=False):
    with a daemon answering that builds a DockerSandbox, which must take the same keywords."""
    monkeypatch.setattr(sandbox, "_DOCKER_OK", True)
    box = sandbox.make_sandbox("auto", cpu_s=11, network=False)
    assert isinstance(box, sandbox.DockerSandbox) and box.cpu_s == 11 and not box.network
    monkeypatch.setattr(sandbox, "_DOCKER_OK", False)
    box = sandbox.make_sandbox("auto", cpu_s=11, network=False)
    assert isinstance(box, sandbox.LocalSandbox) and box.cpu_s == 11 and not box.network


@pytest.mark.skipif(not sandbox.docker_available(), reason="no Docker engine answers `docker info` here")
def test_docker_sandbox_contains_the_same_cases():
    async def body():
        box = await sandbox.DockerSandbox(memory_mb=300, max_procs=32, network=False).create()
        box.write("bomb.py", FORK_BOMB)
        bomb = await box.execute("python bomb.py", timeout_s=30)
        writes = await box.execute("echo x > /work/in.txt && echo in; echo x > /usr/escape.txt", timeout_s=10)
        sleep = await box.execute("sleep 300", timeout_s=1)
        net = await box.execute("python -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=3)\"",
                                timeout_s=10)
        await box.delete()
        return bomb, writes, sleep, net
    bomb, writes, sleep, net = run(body())
    assert int(bomb.stdout) < 32 and writes.stdout.strip() == "in" and "Read-only" in writes.stderr
    assert sleep.timed_out and net.exit_code != 0


# ----------------------------------------------------------------------------------------------
# router input: what the OpenAI / Anthropic APIs refuse gets a 4xx in their error shape, and the
# router keeps serving after each (one real CPU engine behind it)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    import cpu_engine
    url, handle = cpu_engine.serve(tiny_model_dir, max_batch=16, max_len=512, seed=0)
    yield url
    handle.shutdown()


CALL = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1+1"}'}}
TOOL = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object", "properties": {}}}}
USER = {"role": "user", "content": "1+1"}
OPENAI_BAD = {  # each a body the OpenAI API answers with a 400, and the words the router's message must hold
    "user message without content": ({"messages": [{"role": "user"}]}, "needs 'content'"),
    "tool answers an unknown tool_call_id": ({"messages": [USER, {"role": "assistant", "content": None,
                                                                  "tool_calls": [CALL]},
                                                           {"role": "tool", "tool_call_id": "call_9", "content": "2"}]},
                                            "'call_9' answers no tool call"),
    "tool message with no assistant call before it": ({"messages": [USER, {"role": "tool", "tool_call_id": "call_1",
                                                                           "content": "2"}]}, "answers no tool call"),
    "tool call left unanswered": ({"messages": [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                                                USER]}, "were not answered"),
    "logprobs 'yes'": ({"messages": [USER], "logprobs": "yes"}, "'logprobs' must be a boolean"),
    "stream 'yes'": ({"messages": [USER], "stream": "yes"}, "'stream' must be a boolean"),
    "unknown field": ({"messages": [USER], "temprature": 0.5}, "did you mean 'temperature'"),
    "n=2": ({"messages": [USER], "n": 2}, "'n'=2 is not supported"),
    "frequency_penalty the engine cannot apply": ({"messages": [USER], "frequency_penalty": 0.5}, "not supported"),
    "response_format json_schema without its object": ({"messages": [USER], "response_format": {
        "type": "json_schema"}}, "grammar and structural_tag formats are not supported"),
    "top_logprobs": ({"messages": [USER], "logprobs": True, "top_logprobs": 3}, "'top_logprobs'=3"),
    "seed not an integer": ({"messages": [USER], "seed": "x"}, "'seed' must be of type int"),
    "model not a string": ({"messages": [USER], "model": 5}, "'model' must be a string"),
    "arguments as an object": ({"messages": [USER, {"role": "assistant", "tool_calls": [
        {**CALL, "function": {"name": "calculator", "arguments": {"expression": "1"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"}]}, "must be a JSON string"),
    "tool call without id": ({"messages": [USER, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": CALL["function"]}]}]}, "needs a string 'id'"),
    "assistant with neither content nor tool_calls": ({"messages": [USER, {"role": "assistant"}, USER]},
                                                      "needs 'content' (or 'tool_calls')"),
    "five stop sequences": ({"messages": [USER], "stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
    "stream_options without stream": ({"messages": [USER], "stream_options": {"include_usage": True}},
                                      "only allowed when 'stream' is true"),
    "tool_choice without tools": ({"messages": [USER], "tool_choice": "auto"}, "only allowed when 'tools'"),
    "tool_choice naming no tool": ({"messages": [USER], "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "search"}}}, "not among the tools"),
    "duplicate tool names": ({"messages": [USER], "tools": [TOOL, TOOL]}, "must be unique"),
    "tool name with a dot": ({"messages": [USER], "tools": [{"type": "function", "function": {"name": "a.b"}}]},
                             "must match"),
    "temperature above 2": ({"messages": [USER], "temperature": 2.5}, "temperature must be a number in [0.0, 2.0]"),
    "empty content array": ({"messages": [{"role": "user", "content": []}]}, "empty array"),
    "image part": ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
                   "only text parts"),
}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "2"}
USE = {"type": "tool_use", "id": "toolu_1", "name": "calculator", "input": {"expression": "1+1"}}
AUSER = {"role": "user", "content": "1+1"}
ANTHROPIC_BAD = {  # each a body the Anthropic API answers with a 400
    "temperature above 1": ({"messages": [AUSER], "temperature": 1.5}, "temperature must be a number in [0.0, 1.0]"),
    "stop_sequences as a string": ({"messages": [AUSER], "stop_sequences": "x"}, "must be a list of strings"),
    "tool_result for an unknown tool_use_id": ({"messages": [AUSER, {"role": "assistant", "content": [USE]},
                                                             {"role": "user", "content": [{**RESULT,
                                                                                           "tool_use_id": "toolu_9"}]}]},
                                               "'toolu_9' answers no tool call"),
    "tool_use without a tool_result after it": ({"messages": [AUSER, {"role": "assistant", "content": [USE]}, AUSER]},
                                                "were not answered"),
    "prefill": ({"messages": [AUSER, {"role": "assistant", "content": "The answer is"}]}, "does not support prefill"),
    "empty text block": ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
                         "text content blocks must be non-empty"),
    "empty content": ({"messages": [{"role": "user", "content": ""}]}, "non-empty content"),
    "tool_choice as a string": ({"messages": [AUSER], "tool_choice": "auto"}, "must be {'type'"),
    "unknown field": ({"messages": [AUSER], "stop_sequence": ["x"]}, "did you mean 'stop_sequences'"),
    "thinking, of a model without a reasoning parser": ({"messages": [AUSER], "thinking": {
        "type": "enabled", "budget_tokens": 1024}}, "no reasoning parser"),
    "thinking budget under 1024": ({"messages": [AUSER], "thinking": {"type": "enabled", "budget_tokens": 100}},
                                   "budget_tokens >= 1024"),
    "server tool": ({"messages": [AUSER], "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
                    "server tools are not supported"),
    "no max_tokens": ({"messages": [AUSER], "max_tokens": None}, "max_tokens must be a positive integer"),
    "missing max_tokens": ({"messages": [AUSER], "max_tokens": ...}, "missing required field 'max_tokens'"),
    # (a system message among them is taken: Claude Code sends one, tests/test_agent_fields.py)
    "tool role in messages": ({"messages": [{"role": "tool", "content": "x"}, AUSER]}, "'user', 'assistant' or"),
}


def test_router_refuses_what_the_apis_refuse_and_keeps_serving(engine, tiny_model_dir):
    async def body():
        flow = agentflow.AgentFlow(config.load_config(None, ["max_context_len=512"]), [engine], tiny_model_dir)
        await flow.start_router()
        s = flow.router.open_session(sampling={"max_new_tokens": 2}, max_context_len=512, max_turns=1000)
        base = flow.router.base_url(s)
        seen = []
        async with httpx.AsyncClient(timeout=30) as http:
            for name, (payload, words) in OPENAI_BAD.items():
                r = await http.post(f"{base}/chat/completions", json={"model": "m", **payload},
                                    headers={"Authorization": f"Bearer {s.api_key}"})
                ok = await http.post(f"{base}/chat/completions", json={"model": "m", "messages": [USER], "max_tokens": 1},
                                     headers={"Authorization": f"Bearer {s.api_key}"})
                seen.append(("openai", name, words, r.status_code, r.json(), ok.status_code))
            for name, (payload, words) in ANTHROPIC_BAD.items():
                sent = {k: v for k, v in {"model": "m", "max_tokens": 4, **payload}.items() if v is not ...}
                r = await http.post(f"{flow.router.url}/s/{s.id}/v1/messages", json=sent,
                                    headers={"x-api-key": s.api_key})
                ok = await http.post(f"{flow.router.url}/s/{s.id}/v1/messages", headers={"x-api-key": s.api_key},
                                     json={"model": "m", "max_tokens": 1, "messages": [AUSER]})
                seen.append(("anthropic", name, words, r.status_code, r.json(), ok.status_code))
        await flow.close()
        return seen
    for api, name, words, status, err, after in run(body()):
        assert status == 400, (api, name, err)
        if api == "openai":
            assert err["error"]["type"] == "invalid_request_error" and words in err["error"]["message"], (name, err)
        else:
            assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", (name, err)
            assert words in err["error"]["message"], (name, err)
        assert after == 200, (api, name)  # still serving


def test_official_clients_get_typed_errors_for_refused_requests(engine, tiny_model_dir):
    import anthropic
    import openai

    async def body():
        flow = agentflow.AgentFlow(config.load_config(None, ["max_context_len=512"]), [engine], tiny_model_dir)
        await flow.start_router()
        s = flow.router.open_session(sampling={"max_new_tokens": 2}, max_context_len=512, max_turns=1000)
        oa = openai.AsyncOpenAI(base_url=flow.router.base_url(s), api_key=s.api_key, max_retries=0)
        an = anthropic.AsyncAnthropic(base_url=f"{flow.router.url}/s/{s.id}", api_key=s.api_key, max_retries=0)
        errors = []
        for kw in (dict(messages=[{"role": "user"}]),                                       # no content
                   dict(messages=[USER, {"role": "tool", "tool_call_id": "call_9", "content": "2"}]),
                   dict(messages=[USER], logprobs="yes"),
                   dict(messages=[USER], extra_body={"temprature": 0.1})):
            try:
                await oa.chat.completions.create(model="m", **kw)
            except openai.BadRequestError as e:
                errors.append(("openai", e.status_code, e.body))
        for kw in (dict(messages=[AUSER], extra_body={"temperature": 1.5}),  # (this SDK has no temperature)
                   dict(messages=[AUSER, {"role": "assistant", "content": "The answer is"}]),
                   dict(messages=[AUSER, {"role": "assistant", "content": [USE]},
                                  {"role": "user", "content": [{**RESULT, "tool_use_id": "toolu_9"}]}])):
            try:
                await an.messages.create(model="m", max_tokens=4, **kw)
            except anthropic.BadRequestError as e:
                errors.append(("anthropic", e.status_code, e.body))
        ok = await oa.chat.completions.create(model="m", messages=[USER], max_tokens=1)
        ok2 = await an.messages.create(model="m", max_tokens=1, messages=[AUSER])
        await oa.close()
        await an.close()
        await flow.close()
        return errors, ok, ok2
    errors, ok, ok2 = run(body())
    assert [(api, status) for api, status, _ in errors] == [("openai", 400)] * 4 + [("anthropic", 400)] * 3
    assert all(b["type"] == "invalid_request_error" for api, _, b in errors if api == "openai")
    assert all(b["error"]["type"] == "invalid_request_error" for api, _, b in errors if api == "anthropic")
    assert ok.choices[0].message.role == "assistant" and ok2.role == "assistant"


# ----------------------------------------------------------------------------------------------
# through the real pipeline: Ray, Megatron-Core over gloo, the CPU engine, the router, AgentFlow


TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128)


@pytest.mark.slow
def test_failed_and_empty_trajectories_never_stop_a_run(tmp_path, run_cache, capsys, ray_session):
    """tests.agents.flaky_agent: step 0 fails entirely (skipped with a message); in step 1 three of
    each group's four samples fail three different ways (raise before the first model call, garbage
    return, NaN reward). The run finishes, the failed samples stay in their groups with reward 0 and an
    all-zero loss mask, and the update trains on the whole batch."""
    cfg = config.load_config(str(ROOT / "recipes/arith_cpu.yaml"), [
        f"output_dir={tmp_path}/run", "num_steps=2", "prompts_per_step=2", "samples_per_prompt=4",
        "global_batch_size=8", "micro_batch_size=4", "max_new_tokens=4", "eval_every=0", "warmstart_steps=0",
        "print_every=0", "agent=tests.agents.flaky_agent", "agent_retries=0", "max_turns=2",
        "reward=tests.agents.one", f"dump_rollouts={tmp_path}/dump", f"tiny_model={json.dumps(TINY)}"])
    history = loongsage.train(cfg)
    steps = {h["step"]: h for h in history if "rollout/failed_frac" in h}
    assert sorted(steps) == [0, 1]
    assert steps[0]["rollout/failed_frac"] == 1.0 and steps[0]["rollout/empty_groups"] == 2
    assert "train/loss" not in steps[0]
    assert "step 0: no group has a token to train on" in capsys.readouterr().out
    for step in (1,):
        h = steps[step]
        assert h["rollout/failed"] == 6 and h["rollout/empty_groups"] == 0 and h["train/samples"] == 8
        # finite, and it trained: the survivor (reward 1) is above its group's failed samples (reward 0)
        assert math.isfinite(h["train/loss"]) and h["train/grad_norm"] > 0
        trajs = [json.loads(line) for line in open(tmp_path / "dump" / f"step_{step:05d}.jsonl")]
        assert sorted((t["group_id"], t["sample_index"]) for t in trajs) == [(g, i) for g in (2 * step, 2 * step + 1)
                                                                              for i in range(4)]
        for t in trajs:
            if t["sample_index"] == 3:
                assert t["status"] in ("ok", "truncated") and any(t["loss_mask"])
                continue
            assert t["status"] == "failed" and t["reward"] == 0.0 and not any(t["loss_mask"])
            reason = {0: "before its first model call", 1: "returned int 42", 2: "must be finite"}[t["sample_index"]]
            assert reason in t["metadata"]["error"]
            assert (t["response_ids"] == []) == (t["sample_index"] == 0)  # the early crash has no response at all


def test_each_kind_of_failure_stays_in_its_group(engine, tiny_model_dir):
    """AgentFlow.generate with one kind of failure per run: the groups come back complete, the failed
    samples with reward 0, an all-zero loss mask and the reason. A turn budget overrun is not a failure:
    what was generated is kept, rewarded and trainable ("truncated")."""
    import data
    samples = data.arith_samples(2, seed=1)

    async def gen(**kw):
        cfg = config.load_config(None, ["max_context_len=512", "agent_retries=0", "max_turns=2",
                                        *[f"{k}={v}" for k, v in kw.items()]])
        flow = agentflow.AgentFlow(cfg, [engine], tiny_model_dir)
        out = await flow.generate(samples, 2, {"max_new_tokens": 2}, step=0)
        await flow.close()
        return out

    async def body():
        return await asyncio.gather(gen(agent="tests.agents.early_crash"), gen(agent="tests.agents.garbage"),
                                    gen(agent="tests.agents.turn_hog"), gen(reward="tests.agents.raising_reward"),
                                    gen(reward="tests.agents.per_turn_reward"))
    early, garbage, hog, raising, per_turn = run(body())
    for out, reason in ((early, "crashed before any model call"), (garbage, "returned list"),
                        (raising, "raised ValueError('reward bug')"), (per_turn, "turn_rewards")):
        assert [(t["group_id"], t["sample_index"]) for t in out] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        for t in out:
            assert t["status"] == "failed" and t["reward"] == 0.0 and not any(t["loss_mask"]), reason
            assert reason in t["metadata"]["error"]
    assert all(t["response_ids"] == [] for t in early)  # nothing generated: collate pads it (tested above)
    mb = trainer.collate(early + garbage)
    assert mb["loss_mask"].sum() == 0 and mb["tokens"].shape[0] == 8
    for t in hog:
        assert t["status"] == "truncated" and t["metadata"]["turns"] == 2 and any(t["loss_mask"])


@pytest.mark.skipif(sandbox.docker_available(), reason="a Docker engine answers here")
def test_docker_sandbox_without_a_daemon_is_refused_before_any_actor_starts():
    cfg = config.load_config(str(ROOT / "recipes/blackbox_cpu.yaml"), ["sandbox=docker", "agent_preload=[]"])
    with pytest.raises(ValueError, match="no Docker engine answers"):
        config.check_runtime(cfg)


def test_agent_preload_of_a_missing_module_is_refused_at_check():
    cfg = config.load_config(str(ROOT / "recipes/blackbox_cpu.yaml"), ["agent_preload=[openai,no_such_sdk_here]"])
    with pytest.raises(ValueError, match="agent_preload: no module 'no_such_sdk_here' here"):
        config.check_runtime(cfg)
