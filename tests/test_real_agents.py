"""Compatibility tier: the coding-agent programs people train (Codex CLI, Claude Code), installed at pinned versions
by scripts/agents_env.sh and run unmodified (recipes/agents.py) through the router on the CPU engine, each through a
multi-turn episode whose tool call is proven executed.

What each test proves, per program: the program exits 0 after at least two model requests, none answered 4xx/5xx;
its working copy holds a nonce file, and the request after its first tool call carries a tool result containing the
nonce under that call's id (the program ran the call the model made); the trajectory is token-exact: one segment,
whose prompt is the chat template's rendering of the program's first request, whose every trained token is an id
the engine sampled (in order, each engine input a prefix of the segment) and whose other tokens are the later
requests' new messages. The tiny random model cannot choose to call a tool: the first turn that offers tools is
constrained by a declared grammar (SGLang's `regex`, enforced by the engine's xgrammar) to one call of the program's
shell tool, `cat nonce.txt`, recorded in the trajectory's metadata; every later turn is sampled freely.

Run: `scripts/agents_env.sh && pytest -q -s tests/test_real_agents.py` (prints each program's version, requests,
segments and time). Without the programs installed the tests skip, unless LOONGSAGE_AGENTS_REQUIRED=1 (the tier).
"""
import asyncio
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

import agentflow
import chat
import cpu_engine
import data
import rollout
import wire

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
import agents  # noqa: E402  (recipes/agents.py: the launchers)

# the tiny test model with room for the programs' shrunk prompts (~1.4k tokens for Claude Code, ~4.1k for Codex)
SETTINGS = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=128, norm_std=0.2, max_position_embeddings=8192)
# each program's shell tool, its argument
TOOL = {"codex": ("exec_command", "cmd"), "claude": ("Bash", "command"), "opencode": ("bash", "command"),
        "mini": ("bash", "command")}
TASK = "Run `cat nonce.txt` with your shell tool and tell me what it prints."


@pytest.fixture(scope="module")
def agent_engine():
    model = data.build_tiny_model(data.default_cache_dir() / f"tiny-agents-{data.settings_hash(SETTINGS)}",
                                  **SETTINGS)
    url, handle = cpu_engine.serve(model, max_batch=4, max_len=SETTINGS["max_position_embeddings"], seed=0)
    yield model, url
    handle.shutdown()


def recorded(router: agentflow.Router) -> list[dict]:
    """Observe every HTTP request the router answers (method, path, JSON body, status): the app stays the router's."""
    log, app = [], router.app()

    async def recording(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        entry, chunks = {"method": scope["method"], "path": scope["path"]}, []

        async def rcv():
            message = await receive()
            chunks.append(message.get("body", b""))
            return message

        async def snd(message):
            if message["type"] == "http.response.start":
                entry["status"] = message["status"]
            await send(message)
        await app(scope, rcv, snd)
        entry["body"] = json.loads(b"".join(chunks) or b"null")
        log.append(entry)
    router.app = lambda: recording
    return log


def tool_results(program: str, body: dict) -> dict:
    """call id -> tool result text, of one request body in the program's API."""
    if program == "codex":
        return {i["call_id"]: i["output"] for i in body["input"] if i.get("type") == "function_call_output"}
    if program in ("opencode", "mini"):
        return {m["tool_call_id"]: wire._text_of(m["content"], "tool") for m in body["messages"] if m["role"] == "tool"}
    return {b["tool_use_id"]: wire._text_of(b["content"], "tool_result") for m in body["messages"]
            if isinstance(m["content"], list) for b in m["content"] if b.get("type") == "tool_result"}


def first_call_id(program: str, body: dict) -> str:
    if program == "codex":
        return next(i["call_id"] for i in body["input"] if i.get("type") == "function_call")
    if program in ("opencode", "mini"):
        return next(m["tool_calls"][0]["id"] for m in body["messages"] if m.get("tool_calls"))
    return next(b["id"] for m in body["messages"] if m["role"] == "assistant" and isinstance(m["content"], list)
                for b in m["content"] if b.get("type") == "tool_use")


async def episode(program: str, model: str, engine_url: str, work: Path) -> dict:
    pool = rollout.EnginePool([engine_url])
    fmt = chat.ChatFormat(model)
    router = agentflow.Router(pool, fmt, model_name="loongsage")
    log = recorded(router)
    calls, real = [], pool.generate

    async def generate(input_ids, sampling_params, rid, prefer=None, batch="", **streaming):
        url, out = await real(input_ids, sampling_params, rid, prefer, batch, **streaming)
        calls.append((list(input_ids), list(out["output_ids"])))
        return url, out
    pool.generate = generate
    await router.start()
    name, arg = TOOL[program]
    # the declared first-turn constraint: one call of the shell tool, in the template's tool-call syntax (Hermes)
    call = "<tool_call>\n" + json.dumps({"name": name, "arguments": {arg: "cat nonce.txt"}}) + "\n</tool_call>"
    s = router.open_session(sampling=dict(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=96),
                            max_context_len=SETTINGS["max_position_embeddings"], max_turns=6,
                            constraint={"regex": "".join("\\" + c if c in ".^$*+?()[]{}|\\" else c for c in call)})
    argv, env = agents.launch(program, TASK, router.base_url(s), s.api_key)
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(*argv, cwd=work, env=env, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 240)
    finally:
        if proc.returncode is None:
            proc.kill()
        traj = s.trajectory(0.0)
        await router.close_session(s)
        await router.stop()
        await pool.close()
    return dict(rc=proc.returncode, out=out.decode(errors="replace"), err=err.decode(errors="replace"), log=log,
                calls=calls, segments=s.segments, traj=traj, chat=fmt, router=router,
                seconds=time.perf_counter() - t0)


@pytest.mark.slow
@pytest.mark.parametrize("program", list(agents.PINNED))
def test_program_runs_unmodified_through_a_tool_episode(program, agent_engine, tmp_path):
    argv0 = agents.executable(program)
    if not argv0.exists():
        if os.environ.get("LOONGSAGE_AGENTS_REQUIRED") == "1":
            pytest.fail(f"{argv0} is missing: run scripts/agents_env.sh")
        pytest.skip(f"{program} is not installed (scripts/agents_env.sh)")
    version = subprocess.run([str(argv0), "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    model, url = agent_engine
    nonce = secrets.token_hex(8)
    (tmp_path / "nonce.txt").write_text(nonce + "\n")
    r = asyncio.run(episode(program, model, url, tmp_path))
    posts = [e for e in r["log"] if e["method"] == "POST"]
    print(f"\n{program} {version}: exit {r['rc']} in {r['seconds']:.1f} s; requests "
          f"{[(e['method'], e['path'].split('/v1')[-1], e['status']) for e in r['log']]}; segments "
          f"{[(len(g.prompt_ids), len(g.response_ids)) for g in r['segments']]}; unknown fields "
          f"{r['traj'].metadata['unknown_fields']}")
    assert r["rc"] == 0, f"{program} exited {r['rc']}: {r['err'][-2000:]}"
    assert [e for e in r["log"] if e["status"] >= 400] == []
    assert len(posts) >= 2 and len(r["calls"]) == len(posts)
    # the tool call ran: the second request answers the first call's id with the nonce the file holds
    assert nonce in tool_results(program, posts[1]["body"])[first_call_id(program, posts[1]["body"])]
    assert r["traj"].metadata["constrained_turns"] == [0] and r["traj"].metadata["constraint"]
    # token-exact: one segment; its prompt is the template's rendering of the first request as sent ...
    [seg] = r["segments"]
    first = posts[0]["body"]
    req = wire.responses_request(first, {}) if program == "codex" else wire.anthropic_request(first)
    r["router"]._admit(r["router"].open_session(sampling={}, max_context_len=1, max_turns=1), req)
    assert seg.prompt_ids == r["calls"][0][0] == r["chat"].prompt_ids(req.messages, req.tools)
    # ... each engine input is a prefix of it, and its trained tokens are exactly the engine's output ids, in order
    ids = seg.ids()
    assert all(ids[:len(inp)] == inp for inp, _ in r["calls"])
    trained = [t for t, m in zip(seg.response_ids, seg.loss_mask) if m == 1]
    assert trained == [t for _, out in r["calls"] for t in out]
    assert len(seg.loss_mask) == len(seg.response_ids) == len(seg.rollout_logprobs)
