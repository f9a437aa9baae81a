"""The request fields of the agent programs people train, and the router's rule for fields it does not know.

tests/agent_requests/ holds requests captured from the pinned programs through the router (tests/test_real_agents.py
runs them): Codex CLI 0.171's Responses requests (a compaction among them) and Claude Code 2.1's Messages requests,
at default settings and shrunk, long prompt texts trimmed (every field and message shape kept); opencode 1.18's and
mini-swe-agent 2.4's Chat Completions requests, shrunk (opencode's title side call among them). Each is accepted
with every top-level field known (honoured or inert: none lands in the unknown bucket), its developer/system
messages kept where they are and its hosted tools recorded. A mistyped sampling field (`temprature`, `max_token`,
`top-k`) is refused on all three APIs; any other unknown field is accepted and returned for the router to count and
record; `strict` refuses it. The captured side calls, compaction and count_tokens, replayed through the router, each
make a segment of their label that trains only when the recipe's train_labels name it."""
import asyncio
import json
from pathlib import Path

import httpx
import pytest

import agentflow
import chat
import rollout
import wire
from test_real_agents import agent_engine  # noqa: F401  the tier's engine fixture, reused

REQUESTS = Path(__file__).parent / "agent_requests"
CAPTURED = [(p.stem, i, r) for p in sorted(REQUESTS.glob("*.json"))
            for i, r in enumerate(json.loads(p.read_text())["requests"])]
MINIMAL = {"openai": {"messages": [{"role": "user", "content": "hi"}]},
           "anthropic": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
           "responses": {"input": "hi"}}


def parse(api: str, body: dict, strict: bool = False) -> wire.ChatRequest:
    if api == "openai":
        return wire.openai_request(body, strict)
    if api == "anthropic":
        return wire.anthropic_request(body, strict)
    return wire.responses_request(body, {}, strict)


@pytest.mark.parametrize("program, i, request_", CAPTURED, ids=[f"{p}-{i}" for p, i, _ in CAPTURED])
def test_every_captured_request_is_accepted_with_every_field_known(program, i, request_):
    api = {"/v1/responses": "responses", "/v1/messages": "anthropic"}.get(request_["path"], "openai")
    req = parse(api, request_["body"])
    assert [u for u in req.unknown if not u.startswith("tools:")] == []
    # system / developer messages are kept, in order; the first one leads, later ones stay where they were sent
    raw = request_["body"]["input"] if api == "responses" else request_["body"]["messages"]
    later = [m for m in raw if m.get("role") in ("system", "developer")][0 if api == "anthropic" else 1:]
    assert sum(m["role"] == "system" for m in req.messages[1:]) == len(later)
    if program == "codex" and i == 0:  # the default request: hosted web_search is recorded, namespaces flattened
        assert req.unknown == ("tools:web_search",) and "spawn_agent" in {t["function"]["name"] for t in req.tools}


@pytest.mark.parametrize("api", ["openai", "anthropic", "responses"])
@pytest.mark.parametrize("typo, meant", [("temprature", "temperature"), ("max_token", "max_tokens"),
                                         ("top-k", "top_k")])
def test_sampling_typos_are_refused_on_every_api(api, typo, meant):
    with pytest.raises(wire.ApiError, match=f"unrecognized request argument supplied: '{typo}'; did you mean "
                                            f"'{meant}'") as e:
        parse(api, {**MINIMAL[api], typo: 1})
    assert e.value.status == 400 and e.value.param == typo


@pytest.mark.parametrize("api", ["openai", "anthropic", "responses"])
def test_other_unknown_fields_pass_unless_strict(api):
    body = {**MINIMAL[api], "client_trace": {"id": 1}, "x_beta_flag": True}
    assert parse(api, body).unknown == ("client_trace", "x_beta_flag")
    with pytest.raises(wire.ApiError, match="unrecognized request argument supplied: 'client_trace'"):
        parse(api, body, strict=True)


def test_context_management_and_encrypted_reasoning():
    """clear_thinking keeps the last n turns' thinking; clear_tool_uses is refused in the words Claude Code matches
    (it then stops sending it); a reasoning item's encrypted_content reads back as its thinking."""
    said = [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "t1", "signature": ""}, {"type": "text", "text": "a"}]},
        {"role": "user", "content": "q2"}, {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "t2", "signature": ""}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": "q3"}]
    keep1 = {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}}]}
    req = wire.anthropic_request({"messages": said, "max_tokens": 4, "context_management": keep1})
    assert [m.get("reasoning_content") for m in req.messages if m["role"] == "assistant"] == [None, "t2"]
    with pytest.raises(wire.ApiError, match=r"^\S+ does not support the clear_tool_uses_20250919 context management"):
        wire.anthropic_request({"messages": said, "max_tokens": 4, "context_management": {"edits": [
            {"type": "clear_tool_uses_20250919"}]}})
    item = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": wire._encrypt("thought")}
    msgs = wire.responses_messages(None, [{"role": "user", "content": "q"}, item,
                                          {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}],
                                   None)
    assert msgs[1] == {"role": "assistant", "content": "a", "reasoning_content": "thought"}


def captured(program: str, *indices: int) -> list[dict]:
    requests = json.loads((REQUESTS / f"{program}.json").read_text())["requests"]
    return [requests[i] for i in indices]


async def replay(engine_url: str, model: str, requests: list[dict], train_labels: tuple) -> agentflow.Trajectory:
    """POST the captured requests, as sent, to one session of a router on the CPU engine; its trajectory."""
    pool = rollout.EnginePool([engine_url])
    router = agentflow.Router(pool, chat.ChatFormat(model), model_name="loongsage")
    await router.start()
    s = router.open_session(sampling=dict(temperature=1.0, max_new_tokens=4), max_context_len=8192, max_turns=8,
                            train_labels=train_labels)
    try:
        async with httpx.AsyncClient(timeout=300) as client:
            for r in requests:
                answer = await client.post(router.base_url(s).removesuffix("/v1") + r["path"], json=r["body"],
                                           headers={"authorization": f"Bearer {s.api_key}"})
                assert answer.status_code == 200, answer.text
        return s.trajectory(1.0)
    finally:
        await router.close_session(s)
        await router.stop()
        await pool.close()


def test_side_calls_compaction_and_count_tokens_are_labelled_segments(agent_engine):
    """Through the router: opencode's title call (its small_model, named agentflow.SIDE_MODEL) is a `side` segment,
    Codex's compaction request a `compaction` segment, Claude Code's count_tokens a prompt-only `count_tokens` segment;
    by default only `main` segments train (the others keep loss mask 0) and the last main segment is the trajectory's
    top level, last in `segments`; train_labels naming `side` trains the side call too."""
    model, url = agent_engine
    requests = captured("opencode", 0, 1) + captured("codex", 4) + [
        {**r, "path": "/v1/messages/count_tokens"} for r in captured("claude", 1)]
    assert requests[0]["body"]["model"] == agentflow.SIDE_MODEL
    traj = asyncio.run(replay(url, model, requests, ("main",)))
    assert traj.metadata["segment_labels"] == ["side", "compaction", "count_tokens", "main"]
    side, compaction, counted, main = traj.segments
    assert (counted["response_ids"], counted["loss_mask"]) == ([], [])
    assert not any(side["loss_mask"]) and not any(compaction["loss_mask"]) and len(side["response_ids"]) == 4
    assert main["loss_mask"] == traj.loss_mask == [1] * 4 and main["prompt_ids"] == traj.prompt_ids
    both = asyncio.run(replay(url, model, requests[:2], ("main", "side")))
    assert both.metadata["segment_labels"] == ["side", "main"] and both.segments[0]["loss_mask"] == [1] * 4


def test_unknown_train_labels_are_refused_at_check():
    import config
    cfg = config.Config(train_labels=["main", "titles"])
    with pytest.raises(ValueError, match=r"train_labels=\['main', 'titles'\]: choose one or more of \['main', 'side'"):
        config.check_rollout(cfg)
    config.check_rollout(config.Config(train_labels=["main", "side", "compaction"]))
