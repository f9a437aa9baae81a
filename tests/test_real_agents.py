"""Compatibility tier: the coding-agent programs people train (Codex CLI, Claude Code, opencode, mini-swe-agent),
installed at pinned versions by scripts/agents_env.sh and run unmodified (recipes/agents.py) through the router on the
CPU engine, each through a multi-turn episode whose tool call is proven executed.

What each test proves, per program: the program exits 0 after at least two model requests of its loop, none answered
4xx/5xx; its working copy holds a nonce file, and the loop's request after its first tool call carries a tool result
containing the nonce under that call's id (the program ran the call the model made); the trajectory is token-exact:
the first main segment's prompt is the chat template's rendering of the program's first request, the request that
answers its tool call extends that segment, and every engine call ran on a prefix of a segment whose next tokens,
trained, are exactly the ids it sampled (no other token is trained). A side call (opencode's title request to its
small model) is a segment of its own label. The tiny random model cannot choose to call a tool: the first turn that
offers tools is constrained by a declared grammar (SGLang's `regex`, enforced by the engine's xgrammar) to one call
of the program's shell tool, `cat nonce.txt`, recorded in the trajectory's metadata; every later turn is sampled
freely. The last case runs Codex as a recipe's agent_command through AgentFlow's black-box runner (its docstring).

Run: `scripts/agents_env.sh && pytest -q -s tests/test_real_agents.py` (prints each program's version, requests,
segments and time). Without the programs installed the tests skip, unless LOONGSAGE_AGENTS_REQUIRED=1 (the tier).
"""
import asyncio
import dataclasses
import json
import os
import secrets
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

import agentflow
import chat
import config
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
SAMPLING = dict(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=96)  # room for the constrained call
TASK = "Run `cat nonce.txt` with your shell tool and tell me what it prints."


@pytest.fixture(scope="module")
def agent_engine():
    model = data.build_tiny_model(data.default_cache_dir() / f"tiny-agents-{data.settings_hash(SETTINGS)}",
                                  **SETTINGS)
    url, handle = cpu_engine.serve(model, max_batch=4, max_len=SETTINGS["max_position_embeddings"], seed=0)
    yield model, url
    handle.shutdown()


def first_call(program: str) -> dict:
    """The declared first-turn constraint: one call of the program's shell tool running `cat nonce.txt`, in the
    template's tool-call syntax (Hermes), as a regex."""
    name, arg = TOOL[program]
    call = "<tool_call>\n" + json.dumps({"name": name, "arguments": {arg: "cat nonce.txt"}}) + "\n</tool_call>"
    return {"regex": "".join("\\" + c if c in ".^$*+?()[]{}|\\" else c for c in call)}


def installed(program: str) -> str:
    """The program's version; skips (fails in the tier) where it is not installed."""
    argv0 = agents.executable(program)
    if not argv0.exists():
        if os.environ.get("LOONGSAGE_AGENTS_REQUIRED") == "1":
            pytest.fail(f"{argv0} is missing: run scripts/agents_env.sh")
        pytest.skip(f"{program} is not installed (scripts/agents_env.sh)")
    version = [str(argv0.parent / "python"), "-c", "import minisweagent as m; print('mini-swe-agent', m.__version__)"] \
        if program == "mini" else [str(argv0), "--version"]
    return subprocess.run(version, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MSWEA_SILENT_STARTUP": "1"}).stdout.strip()


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
    s = router.open_session(sampling=SAMPLING, max_context_len=SETTINGS["max_position_embeddings"], max_turns=6,
                            constraint=first_call(program))
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
    version = installed(program)
    model, url = agent_engine
    nonce = secrets.token_hex(8)
    (tmp_path / "nonce.txt").write_text(nonce + "\n")
    r = asyncio.run(episode(program, model, url, tmp_path))
    posts = [e for e in r["log"] if e["method"] == "POST"]
    print(f"\n{program} {version}: exit {r['rc']} in {r['seconds']:.1f} s; requests "
          f"{[(e['method'], e['path'].split('/v1')[-1], e['status']) for e in r['log']]}; segments "
          f"{[(g.label, len(g.prompt_ids), len(g.response_ids)) for g in r['segments']]}; unknown fields "
          f"{r['traj'].metadata['unknown_fields']}")
    assert r["rc"] == 0, f"{program} exited {r['rc']}: {r['err'][-2000:]}"
    assert [e for e in r["log"] if e["status"] >= 400] == []
    assert len(r["calls"]) == len(posts)
    check_episode(program, nonce, posts, r["calls"], r["segments"], r["traj"], r["router"])


def check_episode(program: str, nonce: str, posts: list[dict], calls: list, segments: list, traj, router) -> None:
    """The tool call ran, and the trajectory is token-exact (the module's docstring)."""
    main = [e for e in posts if e["body"].get("model") != agents.SIDE_MODEL]  # opencode's title call is a side call
    assert len(main) >= 2 and agents.SIDE_MODEL == agentflow.SIDE_MODEL
    # the tool call ran: the second request answers the first call's id with the nonce the file holds
    assert nonce in tool_results(program, main[1]["body"])[first_call_id(program, main[1]["body"])]
    assert len(traj.metadata["constrained_turns"]) == 1 and traj.metadata["constraint"]
    # the first main segment's prompt is the template's rendering of the first main request as sent ...
    seg = next(g for g in segments if g.label == "main")
    first = main[0]["body"]
    req = wire.responses_request(first, {}) if program == "codex" else wire.anthropic_request(first) \
        if program == "claude" else wire.openai_request(first)
    router._admit(router.open_session(sampling={}, max_context_len=1, max_turns=1), req)
    assert seg.prompt_ids == router.chat.prompt_ids(req.messages, req.tools)
    # ... and the request answering its tool call extended it (one main segment, unless the program drops a turn:
    # mini-swe-agent does not send back a reply without a call, and the next request then starts a new one)
    assert any(seg.ids()[:len(inp)] == inp and len(inp) > len(seg.prompt_ids) for inp, _ in calls)
    assert [g.label for g in segments].count("main") == 1 or program == "mini"
    # every engine call ran on a prefix of a segment, whose next tokens, trained, are exactly the ids it sampled
    for inp, out in calls:
        g = next(g for g in segments if g.ids()[:len(inp) + len(out)] == inp + out)
        k = len(inp) - len(g.prompt_ids)
        assert g.loss_mask[k:k + len(out)] == [1] * len(out)
    assert sum(sum(g.loss_mask) for g in segments) == sum(len(out) for _, out in calls)
    assert all(len(g.loss_mask) == len(g.response_ids) == len(g.rollout_logprobs) for g in segments)


@pytest.mark.slow
def test_codex_as_a_recipe_agent_command_through_agentflow(agent_engine):
    """The black-box path end to end: AgentFlow runs `agent_command: python $LOONGSAGE_ROOT/recipes/agents.py codex` in
    its sandbox for one group; the task's working copy (the nonce file) comes from the sample's `files`, the first-turn
    constraint from the recipe (cfg.first_turn_constraint). The trajectory is ok and passes the tier's checks: the
    tool call ran (the nonce came back under its id) and every trained token is one the engine sampled."""
    installed("codex")
    model, url = agent_engine
    nonce = secrets.token_hex(8)
    cfg = dataclasses.replace(config.Config(), agent_command="python $LOONGSAGE_ROOT/recipes/agents.py codex",
                              sandbox="local", first_turn_constraint=first_call("codex"), max_turns=6,
                              max_context_len=SETTINGS["max_position_embeddings"], agent_timeout=240.0,
                              agent_retries=0, reward="data.exact_match")
    config.check_rollout(cfg)
    sample = {"messages": [{"role": "user", "content": TASK}], "files": {"nonce.txt": nonce + "\n"}, "answer": nonce}

    async def one_group():
        flow = agentflow.AgentFlow(cfg, [url], model)
        log, calls, real = recorded(flow.router), [], flow.pool.generate

        async def generate(input_ids, sampling_params, rid, prefer=None, batch="", **streaming):
            out = await real(input_ids, sampling_params, rid, prefer, batch, **streaming)
            calls.append((list(input_ids), list(out[1]["output_ids"])))
            return out
        flow.pool.generate = generate
        try:
            return await flow.generate([sample], 1, SAMPLING, 0), log, calls, flow.router
        finally:
            await flow.close()
    t0 = time.perf_counter()
    [traj], log, calls, router = asyncio.run(one_group())
    segments = [agentflow.Segment([], None, "", g["prompt_ids"], g["response_ids"], g["loss_mask"],
                                  g["rollout_logprobs"], g["weight_versions"], label=g["label"])
                for g in traj["segments"]]
    print(f"\ncodex through AgentFlow: {traj['status']} in {time.perf_counter() - t0:.1f} s; requests "
          f"{[(e['path'].split('/v1')[-1], e['status']) for e in log]}; segments "
          f"{[(g.label, len(g.prompt_ids), len(g.response_ids)) for g in segments]}")
    assert traj["status"] == "ok", traj["metadata"].get("error")
    assert [e for e in log if e["status"] >= 400] == [] and traj["metadata"]["constraint"] == cfg.first_turn_constraint
    check_episode("codex", nonce, [e for e in log if e["method"] == "POST"], calls, segments,
                  types.SimpleNamespace(metadata=traj["metadata"]), router)
