"""The request fields of the agent programs people train, and the router's rule for fields it does not know.

tests/agent_requests/ holds requests captured from the pinned programs through the router (tests/test_real_agents.py
runs them): Codex CLI 0.171's Responses requests and Claude Code 2.1's Messages requests, at default settings and
shrunk, long prompt texts trimmed (every field and message shape kept). Each is accepted with every top-level field
known (honoured or inert: none lands in the unknown bucket), its developer/system messages kept where they are and
its hosted tools recorded. A mistyped sampling field (`temprature`, `max_token`, `top-k`) is refused on all three
APIs; any other unknown field is accepted and returned for the router to count and record; `strict` refuses it."""
import json
from pathlib import Path

import pytest

import wire

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
    api = "responses" if request_["path"].endswith("/responses") else "anthropic"
    req = parse(api, request_["body"])
    assert [u for u in req.unknown if not u.startswith("tools:")] == []
    # system / developer messages are kept, in order; the first one leads, later ones stay where they were sent
    raw = request_["body"]["input"] if api == "responses" else request_["body"]["messages"]
    later = [m for m in raw if m.get("role") in ("system", "developer")][1 if api == "responses" else 0:]
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
