"""AgentFlow tests: the router with the official openai/anthropic clients against the real CPU engine,
token-in-token-out invariants, concurrency, bad input, agents (white-box, black-box, crashing), sandboxes.

Every client round trip goes to a real CPU engine (cpu_engine.serve) on the tiny random model. The only
test double is `crafted_engine`: the random model never writes a well-formed tool call, so the tests of
tool-call parsing and of exact calc transcripts feed crafted engine outputs. The calc agent's tool loop
against the real engine, with a model warm-started to call the tool, runs in tests/test_loongsage.py
(test_rollout_only_calc_agent_calls_the_tool_on_the_real_engine).
"""
import asyncio
import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

import agentflow
import chat
import config
import cpu_engine
import data
import rollout
import sandbox
import tests.rewards
import wire

SAMPLING = dict(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=6)
CALC_TOOL = {"type": "function", "function": {"name": "calculator", "description": "evaluate arithmetic",
                                              "parameters": {"type": "object",
                                                             "properties": {"expression": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """Two real CPU engines (load balancing needs more than one)."""
    started = [cpu_engine.serve(tiny_model_dir, max_batch=64, max_len=512, seed=i) for i in range(2)]
    yield [url for url, _ in started]
    for _, handle in started:
        handle.shutdown()


def make_cfg(**kw) -> config.Config:
    base = dict(reward="data.exact_match", agent="", agent_command="", sandbox="local", max_turns=8,
                agent_timeout=30.0, agent_retries=1, max_context_len=512, max_prompt_len=256)
    return dataclasses.replace(config.Config(), **{**base, **kw})


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 90))


async def started_flow(engines, model, **cfg_kw) -> agentflow.AgentFlow:
    flow = agentflow.AgentFlow(make_cfg(**cfg_kw), engines, model)
    await flow.start_router()
    return flow


def record_engine_calls(pool: rollout.EnginePool) -> list:
    """Observe (engine url, input ids, engine answer) of every /generate call; the engine stays real."""
    calls, real = [], pool.generate

    async def recording(input_ids, sampling_params, rid, prefer=None, batch="", **streaming):
        url, out = await real(input_ids, sampling_params, rid, prefer, batch, **streaming)
        calls.append((url, list(input_ids), out))
        return url, out
    pool.generate = recording
    return calls


def crafted_engine(pool: rollout.EnginePool, chat: chat.ChatFormat, replies: list[str]) -> list:
    """TEST DOUBLE (tool-call parsing only): answer /generate with the tokens of crafted replies, in order; a streamed
    call (on_chunk) gets SGLang's cumulative chunks first, one per token."""
    seen = []

    async def fake(input_ids, sampling_params, rid, prefer=None, batch="", on_chunk=None):
        text = replies[min(len(seen), len(replies) - 1)]
        ids = chat.encode(text) + [chat.eos_id]
        seen.append(list(input_ids))
        for n in range(1, len(ids)) if on_chunk else ():
            on_chunk({"output_ids": ids[:n], "meta_info": {"finish_reason": None, "prompt_tokens": len(input_ids)}})
            await asyncio.sleep(0)
        return "crafted", {"text": text, "output_ids": ids, "meta_info": {
            "finish_reason": {"type": "stop"}, "weight_version": "3",
            "output_token_logprobs": [[-0.5, t, None] for t in ids]}}
    pool.generate = fake
    return seen


def session_client(flow, s) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=flow.router.base_url(s), api_key=s.api_key, max_retries=0)


def open_session(flow, max_context_len=512, max_turns=8, sampling=SAMPLING):
    return flow.router.open_session(sampling=sampling, max_context_len=max_context_len, max_turns=max_turns)


# ----------------------------------------------------------------------------------------------
# tool calls: rendering through the chat template (the parsers: tests/test_chat.py)


def test_prompt_ids_are_rendered_once_per_distinct_chat(tiny_model_dir):
    """A group's N samples share one render of their first prompt; a different chat or tool list is its own."""
    fmt = chat.ChatFormat(tiny_model_dir)
    renders, real = [], fmt.render
    fmt.render = lambda *a, **kw: renders.append(a) or real(*a, **kw)
    msgs = [{"role": "user", "content": "3+4 e"}]
    want = fmt.encode(real(msgs, None, add_generation_prompt=True))
    with_tools = fmt.encode(real(msgs, wire.openai_tools([CALC_TOOL]), add_generation_prompt=True))
    assert [fmt.prompt_ids(msgs) for _ in range(8)] == [want] * 8 and len(renders) == 1
    assert fmt.prompt_ids(msgs, wire.openai_tools([CALC_TOOL])) == with_tools != want and len(renders) == 2
    assert fmt.prompt_ids([{"role": "user", "content": "3+4 f"}]) != want and len(renders) == 3
    fmt.prompt_ids(msgs).append(0)  # a caller's list is its own: the cached ids are unchanged
    assert fmt.prompt_ids(msgs) == want


def test_tool_history_renders_the_same_from_openai_and_anthropic(tiny_model_dir):
    fmt = chat.ChatFormat(tiny_model_dir)
    oa = wire.openai_messages([
        {"role": "system", "content": "be exact"}, {"role": "user", "content": "12+7"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "calculator", "arguments": '{"expression": "12+7"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "19"}])
    an = wire.anthropic_messages("be exact", [
        {"role": "user", "content": "12+7"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "calculator",
                                           "input": {"expression": "12+7"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "19"}]}])
    tools = wire.openai_tools([CALC_TOOL])
    an_tools = wire.anthropic_tools([{"name": "calculator", "description": "evaluate arithmetic",
                                      "input_schema": CALC_TOOL["function"]["parameters"]}])
    text = fmt.render(oa, tools, add_generation_prompt=True)
    assert text == fmt.render(an, an_tools, add_generation_prompt=True)
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+7"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n19\n</tool_response><|im_end|>" in text
    assert '"name": "calculator"' in text.split("<|im_end|>")[0]  # tools listed in the system turn


def test_an_idle_connection_outlives_every_clients_pool(tiny_model_dir):
    """A keep-alive connection idle for 6 s still serves the next request: the router keeps idle connections longer
    than the clients' pools keep them (the SDKs' 5 s). At uvicorn's default of 5 s the server closed a connection
    as a client reused it, and the official SDK reported that request as 'Request timed out' (a burst of new
    trajectories in an async run lost tens of them so). No engine is needed: /health answers from the router."""
    async def body():
        router = agentflow.Router(rollout.EnginePool(["http://127.0.0.1:9"]), chat.ChatFormat(tiny_model_dir))
        await router.start()
        try:
            reader, writer = await asyncio.open_connection(*router.url.removeprefix("http://").split(":"))
            answers = []
            for wait in (0, 6):
                await asyncio.sleep(wait)
                writer.write(b"GET /health HTTP/1.1\r\nHost: router\r\n\r\n")
                await writer.drain()
                answers.append(await reader.readline())
                while await reader.readline() not in (b"\r\n", b""):  # the headers
                    pass
                await reader.readuntil(b"}")  # the body
            writer.close()
            return answers
        finally:
            await router.stop()
    assert run(body()) == [b"HTTP/1.1 200 OK\r\n"] * 2


def test_crafted_tool_calls_reach_official_clients_plain_and_streaming(engines, tiny_model_dir):
    """Tool-call parsing end to end: crafted engine output -> router -> official SDK objects."""
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call>'

    async def body():
        flow = await started_flow(engines, tiny_model_dir)
        crafted_engine(flow.pool, flow.chat, ["ok " + call])
        s = open_session(flow)
        client = session_client(flow, s)
        msgs = [{"role": "user", "content": "3*4"}]
        r = await client.chat.completions.create(model="m", messages=msgs, tools=[CALC_TOOL])
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content == "ok"
        tc = r.choices[0].message.tool_calls[0]
        assert (tc.function.name, json.loads(tc.function.arguments)) == ("calculator", {"expression": "3*4"})
        stream = await client.chat.completions.create(model="m", messages=msgs, tools=[CALC_TOOL], stream=True)
        args, names, finish = "", [], None
        async for chunk in stream:
            for d in chunk.choices:
                for t in d.delta.tool_calls or []:
                    names += [t.function.name] if t.function.name else []
                    args += t.function.arguments or ""
                finish = d.finish_reason or finish
        assert names == ["calculator"] and json.loads(args) == {"expression": "3*4"} and finish == "tool_calls"

        an = anthropic.AsyncAnthropic(base_url=f"{flow.router.url}/s/{s.id}", api_key=s.api_key, max_retries=0)
        tool = {"name": "calculator", "input_schema": {"type": "object"}}
        m = await an.messages.create(model="m", max_tokens=8, messages=msgs, tools=[tool])
        assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["text", "tool_use"]
        assert m.content[1].input == {"expression": "3*4"}
        async with an.messages.stream(model="m", max_tokens=8, messages=msgs, tools=[tool]) as st:
            final = await st.get_final_message()
        assert final.stop_reason == "tool_use" and final.content[1].input == {"expression": "3*4"}

        # a stop string ends the turn at the token that completes it; the kept ids are a prefix of the sampled ones
        m = await an.messages.create(model="m", max_tokens=8, messages=msgs, tools=[tool],
                                     stop_sequences=["<tool_call>"])
        assert (m.stop_reason, m.stop_sequence, m.content[0].text) == ("stop_sequence", "<tool_call>", "ok")
        seg = s.segments[-1]
        assert flow.chat.decode(seg.response_ids, skip_special_tokens=False) == "ok <tool_call>"
        await flow.close()
    run(body())


# ----------------------------------------------------------------------------------------------
# official clients against the real engine


def test_openai_client_plain_streaming_tools_logprobs(engines, tiny_model_dir):
    async def body():
        flow = await started_flow(engines, tiny_model_dir)
        calls = record_engine_calls(flow.pool)
        s = open_session(flow)
        client = session_client(flow, s)
        assert [m.id async for m in client.models.list()] == [Path(tiny_model_dir).name]
        msgs = [{"role": "user", "content": "12+7"}]
        r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=5, logprobs=True,
                                                 temperature=0.7, top_p=0.9)
        out = calls[-1][2]
        assert r.usage.completion_tokens == len(out["output_ids"]) <= 5
        assert r.usage.prompt_tokens == len(calls[-1][1])
        engine_lps = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
        assert [lp.logprob for lp in r.choices[0].logprobs.content] == engine_lps
        assert r.choices[0].finish_reason in ("stop", "length")

        # streaming: a fresh history (the prompt is repeated, not extended: a second segment)
        stream = await client.chat.completions.create(model="m", messages=msgs, max_completion_tokens=5,
                                                      stream=True, stream_options={"include_usage": True})
        text, usage = "", None
        async for chunk in stream:
            text += "".join(c.delta.content or "" for c in chunk.choices)
            usage = chunk.usage or usage
        assert text == s.last_text and usage.completion_tokens == len(calls[-1][2]["output_ids"])

        # tools + a tool-call history, from the official client, rendered into the engine's input ids
        hist = msgs + [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                        "function": {"name": "calculator", "arguments": '{"expression": "12+7"}'}}]},
                       {"role": "tool", "tool_call_id": "c1", "content": "19"}]
        r = await client.chat.completions.create(model="m", messages=hist, tools=[CALC_TOOL], tool_choice="auto",
                                                 max_tokens=4, stop=["\n\n"])
        sent = flow.chat.decode(calls[-1][1], skip_special_tokens=False)
        assert "<tool_response>\n19\n</tool_response>" in sent and '"arguments": {"expression": "12+7"}' in sent
        await flow.close()
    run(body())


def test_anthropic_client_plain_streaming_tools(engines, tiny_model_dir):
    async def body():
        flow = await started_flow(engines, tiny_model_dir)
        calls = record_engine_calls(flow.pool)
        s = open_session(flow)
        client = anthropic.AsyncAnthropic(base_url=f"{flow.router.url}/s/{s.id}", api_key=s.api_key, max_retries=0)
        m = await client.messages.create(model="m", max_tokens=5, system="be brief",
                                         messages=[{"role": "user", "content": "12+7"}])
        assert m.role == "assistant" and m.stop_reason in ("end_turn", "max_tokens")
        assert m.usage.output_tokens == len(calls[-1][2]["output_ids"])
        assert flow.chat.decode(calls[-1][1], skip_special_tokens=False).startswith("<|im_start|>system\nbe brief")

        async with client.messages.stream(model="m", max_tokens=5, messages=[{"role": "user", "content": "3+4"}]) as st:
            streamed = "".join([t async for t in st.text_stream])
            final = await st.get_final_message()
        assert streamed == s.last_text and final.usage.output_tokens == len(calls[-1][2]["output_ids"])

        tools = [{"name": "calculator", "description": "evaluate arithmetic",
                  "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}}}]
        hist = [{"role": "user", "content": "12+7"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "calculator",
                                                   "input": {"expression": "12+7"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "19"}]}]
        m = await client.messages.create(model="m", max_tokens=4, messages=hist, tools=tools)
        sent = flow.chat.decode(calls[-1][1], skip_special_tokens=False)
        assert "<tool_response>\n19\n</tool_response>" in sent and m.type == "message"
        await flow.close()
    run(body())


# ----------------------------------------------------------------------------------------------
# token in, token out


def _assert_tito(traj: agentflow.Trajectory, calls: list) -> None:
    """Training ids == what the engine saw + sampled; mask 1 exactly on sampled ids with their logprobs."""
    (_, in1, out1), (_, in2, out2) = calls[-2:]
    ids1, ids2 = out1["output_ids"], out2["output_ids"]
    assert in2[:len(in1) + len(ids1)] == in1 + ids1                       # turn 1 reused verbatim
    assert traj.prompt_ids == in1
    assert traj.prompt_ids + traj.response_ids == in2 + ids2               # nothing re-tokenized
    glue = len(in2) - len(in1) - len(ids1)
    assert traj.loss_mask == [1] * len(ids1) + [0] * glue + [1] * len(ids2)
    lps = [x[0] for x in out1["meta_info"]["output_token_logprobs"]] + [0.0] * glue + \
          [x[0] for x in out2["meta_info"]["output_token_logprobs"]]
    assert traj.rollout_logprobs == lps
    assert traj.weight_versions == [0] * len(ids1) + [-1] * glue + [0] * len(ids2)


WORD_TOOL = {"type": "function", "function": {"name": "lookup", "strict": True, "parameters": {
    "type": "object", "properties": {"word": {"type": "string", "enum": ["cat", "dog"]}}, "required": ["word"],
    "additionalProperties": False}}}


def test_a_forced_tool_choice_makes_the_random_model_call_on_every_api(engines, tiny_model_dir):
    """tool_choice "required" / named on the three APIs, through the official clients to the real engine: the random
    model, which never writes a call unasked, answers with one call (parallel calls off) of an allowed tool, its
    arguments on the strict tool's schema; the call the client gets is the one the engine sampled (the trajectory's
    response ids are the template's rendering of it, up to the JSON's whitespace)."""
    async def body():
        flow = await started_flow(engines, tiny_model_dir)
        sent, engine_call = [], flow.pool.generate

        async def spy(input_ids, sampling_params, *args, **kw):
            sent.append(sampling_params)
            return await engine_call(input_ids, sampling_params, *args, **kw)
        flow.pool.generate = spy
        msgs, sampling = [{"role": "user", "content": "12+7"}], {**SAMPLING, "max_new_tokens": 96}
        # "auto": no grammar, or (a strict tool) one that lets the reply be text and holds a call to its schema
        for tools, kind in (([CALC_TOOL], None), ([CALC_TOOL, WORD_TOOL], "triggered_tags")):
            free = await flow.session_client(open_session(flow, sampling=sampling)).chat.completions.create(
                model="m", messages=msgs, tools=tools)
            assert free.choices[0].message.tool_calls is None and free.choices[0].message.content
            assert (json.loads(sent[-1]["structural_tag"])["format"]["type"] if kind else sent[-1].get(
                "structural_tag")) == kind
        # one call each (a random model, free to go on, writes calls until max_tokens: tests/test_chat.py has the
        # grammar's parallel calls)
        for choice in ({"type": "function", "function": {"name": "lookup"}}, "required"):
            s = open_session(flow, sampling=sampling)
            r = await flow.session_client(s).chat.completions.create(
                model="m", messages=msgs, tools=[WORD_TOOL], tool_choice=choice, parallel_tool_calls=False)
            [call] = r.choices[0].message.tool_calls
            assert call.function.name == "lookup" and json.loads(call.function.arguments)["word"] in ("cat", "dog")
            assert r.choices[0].finish_reason == "tool_calls"
            written = flow.chat.decode(s.segments[-1].response_ids, skip_special_tokens=False)
            assert re.fullmatch(r'<tool_call>\n\{"name": "lookup", "arguments": \{\s*"word"\s*:\s*"(cat|dog)"\s*\}\}'
                                r"\n</tool_call><\|im_end\|>", written), written
        s = open_session(flow, sampling=sampling)
        an = anthropic.AsyncAnthropic(base_url=f"{flow.router.url}/s/{s.id}", api_key=s.api_key, max_retries=0)
        m = await an.messages.create(model="m", max_tokens=96, messages=msgs, tool_choice={
            "type": "tool", "name": "lookup", "disable_parallel_tool_use": True}, tools=[{
                "name": "lookup", "strict": True, "input_schema": WORD_TOOL["function"]["parameters"]}])
        [use] = [b for b in m.content if b.type == "tool_use"]
        assert use.name == "lookup" and use.input["word"] in ("cat", "dog") and m.stop_reason == "tool_use"
        # (a custom tool's forced call is a free string, which a random model may not close within max tokens)
        r = await flow.session_client(open_session(flow, sampling=sampling)).responses.create(
            model="m", input="12+7", tool_choice={"type": "function", "name": "lookup"}, max_output_tokens=96,
            parallel_tool_calls=False, tools=[{"type": "custom", "name": "shell"},
                                              {"type": "function", **WORD_TOOL["function"]}])
        [item] = [o for o in r.output if o.type == "function_call"]
        assert item.name == "lookup" and json.loads(item.arguments)["word"] in ("cat", "dog")
        req = wire.responses_request({"input": "x", "tools": [{"type": "custom", "name": "shell"}],
                                      "tool_choice": {"type": "custom", "name": "shell"}}, {})
        call = json.loads(flow.chat.tool_grammar(req, {})["structural_tag"])["format"]["elements"][1]
        assert call["elements"][-1]["json_schema"]["properties"]["input"] == {  # a custom tool's input: a string
            "type": "string", "description": "the tool's whole input, as free-form text"}
        await flow.close()
    run(body())


def test_tito_multi_turn_reuses_prefix_and_masks_template_tokens(engines, tiny_model_dir):
    async def body():
        flow = await started_flow(engines, tiny_model_dir)
        calls = record_engine_calls(flow.pool)
        s = open_session(flow)
        client = session_client(flow, s)
        msgs = [{"role": "user", "content": "12+7"}]
        r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=6)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "sure?"}]
        await client.chat.completions.create(model="m", messages=msgs, max_tokens=6)
        await flow.router.close_session(s)
        traj = s.trajectory(1.0)
        _assert_tito(traj, calls)
        assert len(traj.segments) == 1 and calls[0][0] == calls[1][0]  # one segment; sticky engine
        glue_text = flow.chat.decode(calls[1][1][len(calls[0][1]) + len(calls[0][2]["output_ids"]):],
                                     skip_special_tokens=False)
        assert glue_text.endswith("<|im_start|>user\nsure?<|im_end|>\n<|im_start|>assistant\n")
        await flow.close()
    run(body())


def test_a_turn_is_rendered_once_and_only_when_the_next_turn_extends_it(engines, tiny_model_dir):
    """The router renders a chat with the template only where TITO needs it: the first prompt once, nothing after a
    turn is generated (a session's last turn is never rendered), and at the next turn the finished chat once (the
    prefix check) plus the new chat with its generation prompt once."""
    async def body():
        flow = await started_flow(engines, tiny_model_dir)
        renders, real = [], flow.chat.render
        flow.chat.render = lambda *a, **kw: renders.append(len(a[0])) or real(*a, **kw)
        s = open_session(flow)
        client = session_client(flow, s)
        msgs = [{"role": "user", "content": "render count 3+4"}]  # a chat no other test renders (prompt_ids cache)
        r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=4)
        assert renders == [1]  # the first prompt; the answered chat is not rendered yet
        msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "sure?"}]
        await client.chat.completions.create(model="m", messages=msgs, max_tokens=4)
        assert renders == [1, 2, 3]  # the chat the first turn ended with, then the extended chat
        await flow.router.close_session(s)
        assert len(s.trajectory(0.0).segments) == 1
        await flow.close()
    run(body())


def test_compacted_or_edited_history_starts_a_new_segment(engines, tiny_model_dir):
    async def body():
        flow = await started_flow(engines, tiny_model_dir)
        calls = record_engine_calls(flow.pool)
        s = open_session(flow)
        client = anthropic.AsyncAnthropic(base_url=f"{flow.router.url}/s/{s.id}", api_key=s.api_key, max_retries=0)
        msgs = [{"role": "user", "content": "12+7"}]
        m = await client.messages.create(model="m", max_tokens=5, messages=msgs)
        reply = m.content[0].text
        ext = msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": "sure?"}]
        await client.messages.create(model="m", max_tokens=5, messages=ext)        # extends: same segment
        edited = msgs + [{"role": "assistant", "content": reply + " (edited)"}, {"role": "user", "content": "x"}]
        await client.messages.create(model="m", max_tokens=5, messages=edited)     # edited: new segment
        compact = [{"role": "user", "content": "summary: 12+7 asked twice"}]
        await client.messages.create(model="m", max_tokens=5, messages=compact)    # compacted: new segment
        await flow.router.close_session(s)
        traj = s.trajectory(0.0)
        assert len(traj.segments) == 3
        first = traj.segments[0]
        assert first["prompt_ids"] + first["response_ids"] == calls[1][1] + calls[1][2]["output_ids"]
        assert traj.segments[1]["prompt_ids"] == calls[2][1] and traj.prompt_ids == calls[3][1]
        assert traj.response_ids == calls[3][2]["output_ids"] and set(traj.loss_mask) <= {1}
        await flow.close()
    run(body())


def test_64_concurrent_sessions_have_no_cross_talk(engines, tiny_model_dir):
    async def one(flow, calls, i):
        s = open_session(flow)
        client = session_client(flow, s)
        msgs = [{"role": "user", "content": f"task {i}: {i}+{i}"}]
        r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=3)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": f"again {i}"}]
        await client.chat.completions.create(model="m", messages=msgs, max_tokens=3)
        await flow.router.close_session(s)
        await client.close()
        return s.trajectory(0.0)

    async def body():
        flow = await started_flow(engines, tiny_model_dir)
        calls = record_engine_calls(flow.pool)
        trajs = await asyncio.gather(*(one(flow, calls, i) for i in range(64)))
        for i, t in enumerate(trajs):
            assert len(t.segments) == 1 and f"task {i}: {i}+{i}" in t.prompt_text
            glue = [tid for tid, m in zip(t.response_ids, t.loss_mask) if m == 0]
            assert f"again {i}<" in flow.chat.decode(glue, skip_special_tokens=False)
            # this session's ids are exactly one engine call's input + output: no other session's tokens
            assert any(inp + out["output_ids"] == t.prompt_ids + t.response_ids for _, inp, out in calls)
        assert len(calls) == 128 and len({u for u, _, _ in calls}) == 2  # both engines served
        await flow.close()
    run(body())


# ----------------------------------------------------------------------------------------------
# bad input: 4xx with the API's error shape, and the router keeps serving


def test_bad_requests_get_4xx_error_bodies_and_router_keeps_serving(engines, tiny_model_dir):
    async def body():
        flow = await started_flow(engines, tiny_model_dir)
        s = open_session(flow, max_context_len=64)
        base, hdr = flow.router.base_url(s), {"Authorization": f"Bearer {s.api_key}"}
        ok_msg = [{"role": "user", "content": "1+1"}]
        async with httpx.AsyncClient(timeout=30) as http:
            async def post(path, payload=None, raw=None, headers=hdr, url=base):
                return await http.post(url + path, content=raw if raw is not None else json.dumps(payload),
                                       headers=headers)
            cases = [
                (post("/chat/completions", raw=b"{not json"), 400, None),
                (post("/chat/completions", {"model": "m"}), 400, None),                               # no messages
                (post("/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}), 400, None),
                (post("/chat/completions", {"messages": [{"content": "x"}]}), 400, None),            # no role
                (post("/chat/completions", {"messages": ok_msg, "tools": [{"type": "function"}]}), 400, None),
                (post("/chat/completions", {"messages": ok_msg, "tools": [
                    {"type": "function", "function": {"name": "bad name!", "parameters": {}}}]}), 400, None),
                (post("/chat/completions", {"messages": ok_msg, "temperature": "hot"}), 400, None),
                (post("/chat/completions", {"messages": [{"role": "user", "content": "9 " * 200}]}), 400,
                 "context_length_exceeded"),
                (post("/chat/completions", {"messages": ok_msg}, headers={"Authorization": "Bearer nope"}), 401, None),
                (post("/chat/completions", {"messages": ok_msg}, url=f"{flow.router.url}/s/nosuchsession/v1"),
                 404, None),
                # a client given the router's root instead of its session URL: the same JSON 404, naming the fix
                (post("/chat/completions", {"messages": ok_msg}, url=f"{flow.router.url}/v1"), 404, "not_found"),
            ]
            for coro, status, code in cases:
                r = await coro
                assert r.status_code == status, r.text
                err = r.json()["error"]
                assert err["message"] and err["type"]
                assert code is None or err["code"] == code
            for payload in ({"messages": ok_msg}, {"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]},
                            {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]}):
                r = await post("/messages", payload, headers={"x-api-key": s.api_key})
                assert r.status_code == 400 and r.json()["type"] == "error"
                assert r.json()["error"]["type"] == "invalid_request_error"
            # the official client surfaces the same error as a typed exception
            with pytest.raises(openai.BadRequestError) as e:
                await session_client(flow, s).chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "9 " * 200}])
            assert e.value.code == "context_length_exceeded"
            # still serving
            r = await post("/chat/completions", {"messages": ok_msg, "max_tokens": 2})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
            await flow.router.close_session(s)
            r = await post("/chat/completions", {"messages": ok_msg})
            assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
        await flow.close()
    run(body())


# ----------------------------------------------------------------------------------------------
# AgentFlow.generate: single-turn fast path, white-box and black-box agents


async def async_exact_match(response: str, sample: dict) -> float:
    await asyncio.sleep(0)
    return float(response.strip() == sample["answer"])


def test_single_turn_generate_groups_ids_and_rewards(engines, tiny_model_dir):
    async def body():
        flow = agentflow.AgentFlow(make_cfg(reward="test_agentflow.async_exact_match"), engines, tiny_model_dir)
        calls = record_engine_calls(flow.pool)
        out = await flow.generate(samples, 4, SAMPLING, step=0)
        out2 = await flow.generate(samples[:1], 2, dict(SAMPLING, temperature=0.0), step=1)
        await flow.close()
        return out, out2, calls
    samples = data.arith_samples(3, seed=0)
    answers = [s["answer"] for s in samples] + [samples[0]["answer"]]  # group 3 = the second call's sample
    out, out2, calls = run(body())
    fmt = chat.ChatFormat(tiny_model_dir)
    assert [(t["group_id"], t["sample_index"]) for t in out] == [(g, i) for g in range(3) for i in range(4)]
    assert [t["group_id"] for t in out2] == [3, 3]                          # unique across calls
    assert out2[0]["response_ids"] == out2[1]["response_ids"]               # greedy is deterministic
    for t in out + out2:
        assert set(t) >= {f.name for f in dataclasses.fields(agentflow.Trajectory)}
        assert t["status"] in ("ok", "truncated") and 1 <= len(t["response_ids"]) <= 6
        n = len(t["response_ids"])
        assert t["loss_mask"] == [1] * n and len(t["rollout_logprobs"]) == n and t["weight_versions"] == [0] * n
        assert all(lp <= 0 for lp in t["rollout_logprobs"])
        # the prompt is the sample rendered with the template; the response is exactly one engine answer
        msgs = (samples + samples[:1])[t["group_id"]]["messages"]
        assert t["prompt_ids"] == fmt.encode(fmt.render(msgs, add_generation_prompt=True))
        assert any(o["output_ids"] == t["response_ids"] and inp == t["prompt_ids"] and
                   [x[0] for x in o["meta_info"]["output_token_logprobs"]] == t["rollout_logprobs"]
                   for _, inp, o in calls)
        assert (t["status"] == "truncated") == (n == 6 and t["response_ids"][-1] not in fmt.stop_ids)
        answer = answers[t["group_id"]]
        assert t["reward"] == float(t["response_text"].strip() == answer)  # the async reward ran on the response


def test_submit_routes_each_source_to_its_agent_and_reward(engines, tiny_model_dir):
    """data_sources without a top-level agent: submit() (the training producer, which never calls start_router()
    itself) still starts the router for the sources' agents; a source without an agent takes the fast path and
    the top-level reward. tests/test_loongsage.py runs the same through train()."""
    sources = [{"name": "add", "dataset": "unused", "agent": "tests.agents.add_agent",
                "reward": "tests.rewards.add_reward"},
               {"name": "plain", "dataset": "unused"}]
    add, plain = ({**s, "source": src} for s, src in zip(data.arith_samples(2, seed=3), ("add", "plain")))

    async def body():
        flow = agentflow.AgentFlow(make_cfg(data_sources=sources, reward="tests.rewards.digit_fraction",
                                            agent_retries=0), engines, tiny_model_dir)
        await flow.submit([(0, add), (1, plain)], 2, SAMPLING, 0)
        groups = []
        while len(groups) < 2:
            groups += await flow.completed()
        await flow.close()
        return {g["seq"]: g["trajs"] for g in groups}
    by = run(body())
    assert all(t["status"] != "failed" for ts in by.values() for t in ts), by
    assert [t["metadata"]["source"] for t in by[0] + by[1]] == ["add"] * 2 + ["plain"] * 2
    assert all(1 <= t["reward"] < 1.1 for t in by[0])  # the source's own reward, through its agent's session
    for t in by[1]:  # the fast path and cfg.reward
        assert t["reward"] == sum(c.isdigit() for c in t["response_text"]) / max(len(t["response_text"]), 1)


async def two_turn_agent(client, sample):
    msgs = list(sample["messages"])
    r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=4)
    msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "sure?"}]
    r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=4)
    return r.choices[0].message.content


async def crashing_agent(client, sample):
    await client.chat.completions.create(model="m", messages=sample["messages"], max_tokens=2)
    if sample["answer"] != "never":
        raise RuntimeError("agent bug")


async def self_rewarding_agent(client, sample):
    await client.chat.completions.create(model="m", messages=sample["messages"], max_tokens=2)
    return {"reward": 0.25, "note": "scored by the agent"}


async def context_hungry_agent(client, sample):
    msgs = list(sample["messages"])
    while True:  # grows the context until the router refuses with context_length_exceeded
        r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=8)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "more"}]


async def sleepy_agent(client, sample):
    await client.chat.completions.create(model="m", messages=sample["messages"], max_tokens=2)
    await asyncio.sleep(60)


def test_whitebox_agents_ok_crash_reward_budget_timeout(engines, tiny_model_dir):
    samples = data.arith_samples(2, seed=3)

    async def gen(agent, **kw):
        flow = agentflow.AgentFlow(make_cfg(agent=f"test_agentflow.{agent}", **kw), engines, tiny_model_dir)
        out = await flow.generate(samples, 2, SAMPLING, step=5)
        await flow.close()
        return out

    async def body():
        return await asyncio.gather(gen("two_turn_agent"), gen("crashing_agent"), gen("self_rewarding_agent"),
                                    gen("context_hungry_agent", max_context_len=60),
                                    gen("sleepy_agent", agent_timeout=6.0))
    ok, crashed, rewarded, hungry, sleepy = run(body())
    assert [len(x) for x in (ok, crashed, rewarded, hungry, sleepy)] == [4] * 5  # 2 samples x 2, every group kept
    for t in ok:
        assert t["status"] == "ok" and t["metadata"]["turns"] == 2 and len(t["segments"]) == 1
        assert 0 in t["loss_mask"] and t["loss_mask"][0] == 1 and t["metadata"]["step"] == 5
    for t in crashed:  # kept in its group, reward 0, nothing trainable, retried once
        assert t["status"] == "failed" and t["reward"] == 0.0 and set(t["loss_mask"]) <= {0}
        assert "agent bug" in t["metadata"]["error"] and t["metadata"]["attempts"] == 2
    assert [t["reward"] for t in rewarded] == [0.25] * 4
    for t in hungry:  # generated tokens kept, status truncated, still rewarded
        assert t["status"] == "truncated" and 1 in t["loss_mask"]
        assert len(t["prompt_ids"]) + len(t["response_ids"]) <= 60
    for t in sleepy:
        assert t["status"] == "truncated" and "timed out" in t["metadata"]["error"]
    assert [(t["group_id"], t["sample_index"]) for t in crashed] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_the_flow_moves_its_start_up_objects_out_of_the_collectors_sight(tiny_model_dir):
    """A new AgentFlow (in a fresh interpreter, as the controller's actor is) freezes what start-up made: a full
    garbage collection, which would stop the router and every agent while it walks ~475k objects, then walks none
    of them."""
    code = ("import gc, agentflow, config; agentflow.AgentFlow(config.Config(), ['http://127.0.0.1:9'], "
            f"{tiny_model_dir!r}); print(gc.get_freeze_count(), len(gc.get_objects()))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                         text=True, timeout=120)
    frozen, tracked = map(int, out.stdout.split()[-2:])
    assert frozen > 100_000 and tracked < frozen // 100, (frozen, tracked, out.stderr[-500:])


def test_whitebox_trajectories_share_one_connection_pool(engines, tiny_model_dir):
    """Successive white-box trajectories reach the router over the flow's kept-alive connection (every session's
    client is on one pool), not over a new connection each; the pool closes with the flow."""
    async def body():
        flow = agentflow.AgentFlow(make_cfg(agent="test_agentflow.two_turn_agent"), engines, tiny_model_dir)
        peers, make_app = [], flow.router.app

        def app():
            inner = make_app()

            async def asgi(scope, receive, send):
                peers.append(scope["client"][1])  # the client's source port: one per TCP connection
                await inner(scope, receive, send)
            return asgi
        flow.router.app = app
        for step in range(3):
            out = await flow.generate(data.arith_samples(1, seed=step), 1, SAMPLING, step=step)
            assert [t["status"] for t in out] == ["ok"], out[0]["metadata"]
        pool = flow._sdk_http
        await flow.close()
        return peers, pool
    peers, pool = run(body())
    assert len(peers) == 6 and len(set(peers)) == 1, peers  # 3 trajectories x 2 turns, one connection
    assert pool.is_closed


@pytest.mark.parametrize("preload", [[], ["openai"]])  # a new interpreter per trajectory, or forked warm
def test_blackbox_agent_program_trains_through_env_vars(engines, tiny_model_dir, preload):
    async def body():
        cmd = "AGENT_MAX_TOKENS=3 python $LOONGSAGE_ROOT/recipes/blackbox_agent.py"
        flow = agentflow.AgentFlow(make_cfg(agent_command=cmd, agent_preload=preload), engines, tiny_model_dir)
        calls = record_engine_calls(flow.pool)
        out = await flow.generate(data.arith_samples(1, seed=4), 2, SAMPLING, step=0)
        await flow.close()
        return out, calls
    out, calls = run(body())
    assert len(out) == 2 and len(calls) == 4
    for t in out:
        assert t["status"] == "ok", t["metadata"].get("error")
        assert t["metadata"]["turns"] == 2 and len(t["segments"]) == 1  # the program's 2 turns, one context
        # the trajectory is exactly the program's last engine call: its input (turn 1 reused) + output
        assert any(inp + o["output_ids"] == t["prompt_ids"] + t["response_ids"] for _, inp, o in calls)
        assert 1 in t["loss_mask"]


def test_abort_drops_running_groups(engines, tiny_model_dir):
    """abort() drops the running groups and ends their requests on the engines, by rid, without waiting for them:
    once it returns, none of the four requests (400 tokens each) still runs on an engine, and the engines generated
    fewer tokens in all than finishing them would take. (A dropped HTTP connection does not abort a request, so an
    abort that only cancelled the client tasks would leave them generating.) Greedy: a sampled reply may end at a
    stop token (the chat family's, which ignore_eos does not lift) before all four run at once, and what it samples
    depends on the K/V the engines' prefix cache kept from earlier tests."""
    async def states(http) -> list[dict]:
        answers = await asyncio.gather(*(http.get(f"{url}/get_server_info") for url in engines))
        return [a.json()["internal_states"][0] for a in answers]

    async def body():
        async with httpx.AsyncClient(timeout=60) as http:
            tokens_before = sum(s["generated_tokens"] for s in await states(http))
            flow = agentflow.AgentFlow(make_cfg(max_context_len=512), engines, tiny_model_dir)
            task = asyncio.ensure_future(flow.generate(data.arith_samples(2, seed=5), 2,
                                                       dict(SAMPLING, temperature=0.0, max_new_tokens=400,
                                                            ignore_eos=True), step=0))
            rids = set()
            while len(rids) < 4:  # until all four requests run on the engines (not merely sent)
                rids = set(flow.pool.running) & {r["rid"] for s in await states(http) for r in s["running"]}
                await asyncio.sleep(0.01)
            await flow.abort()
            out = await task
            after = await states(http)
            await flow.close()
        return out, rids, tokens_before, after
    out, rids, tokens_before, after = run(body())
    assert out == [] and len(rids) == 4
    assert not rids & {r["rid"] for s in after for r in s["running"]}  # aborted on the engines
    assert sum(s["generated_tokens"] for s in after) - tokens_before < 4 * 400  # without running to their end


def test_engine_pool_least_loaded_and_skips_dead_engines(engines):
    dead = "http://127.0.0.1:9"  # nothing listens on the discard port: connection refused
    pool = rollout.EnginePool([dead] + engines, cooldown_s=30)
    pool.inflight[engines[0]] = 3
    assert pool.pick() in (dead, engines[1])
    assert pool.pick(prefer=engines[0]) == engines[0]  # sticky wins over load

    async def body():
        url, out = await pool.generate([1, 2, 3], {"max_new_tokens": 2}, "rid-x", prefer=dead)
        await pool.close()
        return url, out
    url, out = run(body())
    assert url in engines and len(out["output_ids"]) <= 2
    assert dead not in pool.healthy() and pool.pick() != dead


def test_engine_pool_coalesces_a_tick_into_one_request_and_isolates_a_bad_one(engines, tiny_model_dir):
    """Requests of one loop tick go to the engine as one batched /generate; when the engine refuses
    the batch for one bad request (an out-of-vocab id), only that request fails."""
    pool = rollout.EnginePool(engines[:1])
    posts = []
    real_post = pool.http.post

    async def counting_post(url, *a, **kw):
        posts.append(url)
        return await real_post(url, *a, **kw)
    pool.http.post = counting_post
    good = [[1, 2, 3], [4, 5], [6]]

    async def body():
        ok = await asyncio.gather(*(pool.generate(ids, {"max_new_tokens": 2, "temperature": 0}, f"r{i}")
                                    for i, ids in enumerate(good)))
        n_ok = len(posts)
        mixed = await asyncio.gather(*(pool.generate(ids, {"max_new_tokens": 2, "temperature": 0}, f"m{i}")
                                       for i, ids in enumerate(good + [[10**6]])), return_exceptions=True)
        await pool.close()
        return ok, n_ok, mixed
    ok, n_ok, mixed = run(body())
    assert n_ok == 1 and all(len(out["output_ids"]) <= 2 for _, out in ok)
    # the engine's own 400, which the router answers as a 400 `engine_rejected` (Router's api_error)
    assert isinstance(mixed[3], rollout.EngineRejected) and "answered HTTP 400" in str(mixed[3]), mixed[3]
    assert [m[1]["output_ids"] for m in mixed[:3]] == [out["output_ids"] for _, out in ok]  # greedy: same


# ----------------------------------------------------------------------------------------------
# sandboxes and the code-test reward


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return False


def test_local_sandbox_limits_and_cleanup():
    async def body():
        box = await sandbox.LocalSandbox(cpu_s=1, memory_mb=256, file_mb=1).create()
        root = box.dir
        wall = await box.execute("sleep 300 & echo $! > child.pid; sleep 300", timeout_s=1.0)
        child = int(Path(root, "child.pid").read_text())
        mem = await box.execute("python -c 'x = bytearray(512 * 2**20)'", timeout_s=20)
        fsize = await box.execute("python -c \"open('big', 'wb').write(b'x' * 2 * 2**20)\"", timeout_s=20)
        cpu = await box.execute("python -c 'while True: pass'", timeout_s=60)
        echo = await box.execute("cat; echo \" $GREETING\"; pwd", stdin="hi", env={"GREETING": "there"})
        await box.delete()
        return root, wall, child, mem, fsize, cpu, echo
    root, wall, child, mem, fsize, cpu, echo = run(body())
    # the whole group was killed at the timeout: the command did not run on to the end of its 300 s sleeps
    assert wall.timed_out and wall.wall_s < 300 and not _alive(child)
    assert mem.exit_code != 0 and "MemoryError" in mem.stderr
    assert fsize.exit_code != 0
    assert cpu.exit_code != 0 and not cpu.timed_out  # RLIMIT_CPU (1 s of CPU) ended it, not the 60 s wall clock
    assert echo.stdout.split("\n")[:2] == ["hi there", root]
    assert not os.path.exists(root)


@pytest.mark.skipif(not sandbox.docker_available(), reason="no Docker engine answers `docker info` here")
def test_docker_sandbox_runs_and_is_removed():
    async def body():
        image = os.environ.get("LOONGSAGE_SANDBOX_IMAGE", "python:3.11-slim")
        box = await sandbox.DockerSandbox(image=image).create()
        r = await box.execute("echo hi", timeout_s=30)
        slow = await box.execute("sleep 30", timeout_s=1)
        await box.delete()
        return r, slow
    r, slow = run(body())
    assert r.stdout.strip() == "hi" and slow.timed_out


def test_code_tests_reward_runs_tests_in_a_sandbox():
    sample = {"tests": "assert add(2, 3) == 5\n", "timeout": 10}
    good = "Here:\n```python\ndef add(a, b):\n    return a + b\n```"
    bad = "```python\ndef add(a, b):\n    return a - b\n```"
    hang = "```python\nwhile True: pass\n```"
    assert run(agentflow.code_tests(good, sample)) == 1.0
    assert run(agentflow.code_tests(bad, sample)) == 0.0
    assert run(agentflow.code_tests(hang, {**sample, "timeout": 1})) == 0.0


# ----------------------------------------------------------------------------------------------
# the calc recipe


def test_calculator_tool():
    from recipes.calc import calculator
    assert calculator("(12+7)*3") == "57" and calculator("7/2") == "3.5" and calculator("-(2**3)") == "-8"
    assert calculator("__import__('os')").startswith("error") and calculator("1/0").startswith("error")
    assert calculator("2**999").startswith("error")


def test_calc_agent_tool_loop_masks_tool_results(engines, tiny_model_dir):
    """The calc agent's loop with crafted model replies (a tool call, then an answer): the tool ran, its
    result went back through the template, tool tokens are masked, reward from the final answer."""
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "(10+11)*2"}}\n</tool_call>'

    async def body():
        flow = agentflow.AgentFlow(make_cfg(agent="recipes.calc.agent", reward="recipes.calc.reward"),
                                   engines, tiny_model_dir)
        seen = crafted_engine(flow.pool, flow.chat, [call, "the answer is 42"])
        out = await flow.generate([{"messages": [{"role": "user", "content": "(10+11)*2"}], "answer": "42"}], 1,
                                  SAMPLING, step=0)
        await flow.close()
        return out, seen
    (t,), seen = run(body())
    assert t["status"] == "ok" and t["reward"] == 1.0 and t["metadata"]["turns"] == 2
    assert "<tool_response>\n42\n</tool_response>" in data.load_tokenizer(tiny_model_dir).decode(seen[1])
    assert seen[1][:len(seen[0])] == seen[0]                        # turn 2 extends turn 1's ids
    masked = [tid for tid, m in zip(t["response_ids"], t["loss_mask"]) if m == 0]
    assert "<tool_response>" in data.load_tokenizer(tiny_model_dir).decode(masked)
    assert t["weight_versions"][0] == 3


def test_calc_sft_transcript_matches_what_the_router_records(engines, tiny_model_dir):
    """Warm-start data and RL data agree token for token: replaying the SFT transcript's model turns
    through the router (crafted engine replies) yields the same ids and the same mask."""
    from recipes.calc import sft_trajectory
    tok = data.load_tokenizer(tiny_model_dir)
    sample = data.calc_samples(1, seed=11)[0]
    sft = sft_trajectory(tok, sample)
    spans, cur = [], []  # the model-written spans (mask 1), each ending in <|im_end|>
    for tid, m in zip(sft["response_ids"], sft["loss_mask"]):
        if m:
            cur.append(tid)
        elif cur:
            spans.append(cur)
            cur = []
    spans.append(cur)
    replies = [tok.decode(span[:-1], skip_special_tokens=False) for span in spans]
    assert replies[1] == sample["answer"] and "<tool_call>" in replies[0]

    async def body():
        flow = agentflow.AgentFlow(make_cfg(agent="recipes.calc.agent", reward="recipes.calc.reward"),
                                   engines, tiny_model_dir)
        crafted_engine(flow.pool, flow.chat, replies)
        out = await flow.generate([sample], 1, SAMPLING, step=0)
        await flow.close()
        return out
    (t,) = run(body())
    assert t["reward"] == 1.0 and t["status"] == "ok"
    assert (t["prompt_ids"], t["response_ids"], t["loss_mask"]) == \
        (sft["prompt_ids"], sft["response_ids"], sft["loss_mask"])


def test_calc_warm_start_leaves_the_tool_list_out_of_half_its_episodes(tiny_model_dir):
    """recipes.calc.warm_start: about half the episodes (drawn from the warm start's rng) have no tool list in the
    prompt; the model's turns, the tool result and the masks are the router's tokens either way, and the prompt
    without the list is the end of the prompt with it (the user turn on)."""
    import random
    from recipes.calc import sft_trajectory, warm_start
    tok = data.load_tokenizer(tiny_model_dir)
    rng, samples = random.Random(3), data.calc_samples(200, seed=5)
    full = [sft_trajectory(tok, s) for s in samples]
    short = 0
    for s, f in zip(samples, full):
        t = warm_start(tok, s, rng)
        assert (t["response_ids"], t["loss_mask"]) == (f["response_ids"], f["loss_mask"])
        if t["prompt_ids"] != f["prompt_ids"]:
            short += 1
            assert f["prompt_ids"][-len(t["prompt_ids"]):] == t["prompt_ids"]
            assert "calculator" in tok.decode(f["prompt_ids"]) and "calculator" not in tok.decode(t["prompt_ids"])
    assert 80 <= short <= 120, short  # Binomial(200, 0.5): outside 80-120 with p < 0.005
    assert warm_start(tok, samples[0])["prompt_ids"] == full[0]["prompt_ids"]  # no rng: the router's episode


# ----------------------------------------------------------------------------------------------
# what goes wrong in users' runs: a reward that raises, an agent past its turns, every engine down


def raising_reward(response: str, sample: dict) -> float:
    raise KeyError("solution")  # e.g. a reward reading a field the dataset does not have


async def endless_agent(client, sample):
    msgs = list(sample["messages"])
    while True:  # never ends on its own: the router's max_turns budget must stop it
        r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=3)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "go on"}]


def test_reward_error_max_turns_and_all_engines_down(engines, tiny_model_dir):
    """A reward that raises fails its trajectories (kept in their group, reward 0, nothing trainable, the
    error named, retried) without failing the step; an agent past max_turns gets the router's
    max_turns_exceeded and its trajectory is truncated with exactly max_turns turns, still rewarded; with
    every engine down the trajectories fail with a message that says so, and generate still returns."""
    samples = data.arith_samples(2, seed=6)
    dead = ["http://127.0.0.1:9", "http://127.0.0.1:19"]  # nothing listens: connection refused

    async def gen(urls, **kw):
        flow = agentflow.AgentFlow(make_cfg(**kw), urls, tiny_model_dir)
        out = await flow.generate(samples, 2, SAMPLING, step=1)
        await flow.close()
        return out, flow

    async def body():
        return await asyncio.gather(gen(engines, reward="test_agentflow.raising_reward"),
                                    gen(engines, agent="test_agentflow.endless_agent", max_turns=3,
                                        reward="tests.rewards.digit_fraction"),
                                    gen(dead, engine_wait=1.0))  # no replacement comes: give up after 1 s
    (bad_reward, _), (endless, _), (down, down_flow) = run(body())
    assert len(bad_reward) == len(endless) == len(down) == 4
    for t in bad_reward:
        assert t["status"] == "failed" and t["reward"] == 0.0 and set(t["loss_mask"]) == {0}
        assert "raising_reward raised KeyError('solution')" in t["metadata"]["error"]
        assert t["metadata"]["attempts"] == 2 and len(t["response_ids"]) >= 1  # generated, then the reward failed
    for t in endless:
        assert t["status"] == "truncated" and t["metadata"]["turns"] == 3 and 1 in t["loss_mask"]
        assert t["reward"] == data.import_object("tests.rewards.digit_fraction")(t["response_text"], {})  # rewarded
    for t in down:
        assert t["status"] == "failed" and t["reward"] == 0.0 and t["metadata"]["attempts"] == 2
        assert "no engine could serve" in t["metadata"]["error"] or "is up (dead:" in t["metadata"]["error"]
    assert down_flow.pool.healthy() == []


# ---------------------------------------------------------------------------------------- reward: judge

JUDGE_TEMPLATE = "Question: {prompt}\nAnswer: {response}\nReference: {answer}\nScore:"


def judge_cfg(url: str, model: str, parse: str, **kw) -> dict:
    return {**dict(model_path=model, url=url, prompt_template=JUDGE_TEMPLATE, parse=parse, max_new_tokens=6,
                   timeout=60.0, max_context_len=512), **kw}


def greedy_verdict(model_dir: str, sample: dict, response: str, max_new_tokens: int = 6) -> str:
    """What the judge must answer, computed here with transformers: the template filled in, rendered as one user
    message with the judge's chat template, decoded greedily, the text without special tokens."""
    import torch  # here: transformers' model classes cost seconds to import, and only the judge tests need them
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    question = [m["content"] for m in sample["messages"] if m["role"] == "user"][-1]
    text = JUDGE_TEMPLATE.format(prompt=question, response=response, answer=sample["answer"])
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok.encode(rendered, add_special_tokens=False)])
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_judge_rewards_are_its_parsed_greedy_verdicts_one_batch_per_group(engines, tiny_model_dir, monkeypatch):
    """reward: judge with engines[1] as the judge (a real CPU engine on the tiny model): each trajectory's reward is
    judge.parse of the verdict transformers decodes greedily for the same prompt, and each group's judge requests
    travel as ONE batched /generate. A regex parse reads the number, and a verdict it cannot read fails that
    trajectory (reward 0, nothing trained) with the verdict in the error."""
    judge_calls, real = [], rollout.generate

    async def recording(client, url, input_ids, *a, **kw):
        if url == engines[1]:
            judge_calls.append(input_ids)
        return await real(client, url, input_ids, *a, **kw)
    monkeypatch.setattr(rollout, "generate", recording)
    samples = data.arith_samples(3, seed=5)

    async def body(parse):
        flow = agentflow.AgentFlow(make_cfg(reward="judge", judge=judge_cfg(engines[1], tiny_model_dir, parse)),
                                   engines[:1], tiny_model_dir)
        out = await flow.generate(samples, 2, SAMPLING, step=0)
        await flow.close()
        return out
    out = run(body("tests.rewards.verdict_hash"))
    assert [len(c) for c in judge_calls] == [2, 2, 2]  # one batch per group of 2
    for t in out:
        expected = greedy_verdict(tiny_model_dir, samples[t["group_id"]], t["response_text"])
        assert t["status"] in ("ok", "truncated") and t["metadata"]["judge_verdict"] == expected
        assert t["reward"] == tests.rewards.verdict_hash(expected)
    judge_calls.clear()
    out = run(body(r"([0-9]+)"))
    assert len(judge_calls) == 3
    for t in out:
        verdict = greedy_verdict(tiny_model_dir, samples[t["group_id"]], t["response_text"])
        m = re.search(r"([0-9]+)", verdict)
        if m:
            assert t["status"] != "failed" and t["reward"] == float(m.group(1))
        else:
            assert t["status"] == "failed" and t["reward"] == 0.0 and not any(t["loss_mask"])
            assert f"verdict {verdict[:200]!r} does not match judge.parse='([0-9]+)'" in t["metadata"]["error"]


def test_judge_that_does_not_answer_fails_its_trajectories_not_the_step(engines, tiny_model_dir):
    """A judge that accepts the connection and never answers: past judge.timeout the judged source's trajectories
    fail with a status and an error that say so (reward 0, loss_mask all 0); the other source's, rewarded by a
    function, are untouched, and generate() returns."""
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)  # the kernel completes connections into the backlog; nothing ever reads or answers them
    url = f"http://127.0.0.1:{hung.getsockname()[1]}"
    sources = [{"name": "judged", "dataset": "unused", "reward": "judge"},
               {"name": "plain", "dataset": "unused", "reward": "tests.rewards.digit_fraction"}]
    samples = [{**s, "source": src} for s, src in zip(data.arith_samples(2, seed=7), ("judged", "plain"))]

    async def body():
        flow = agentflow.AgentFlow(make_cfg(data_sources=sources, judge=judge_cfg(
            url, tiny_model_dir, "tests.rewards.verdict_hash", timeout=0.5)), engines[:1], tiny_model_dir)
        out = await flow.generate(samples, 2, SAMPLING, step=0)
        await flow.close()
        return out
    try:
        out = run(body())
    finally:
        hung.close()
    judged = [t for t in out if t["metadata"]["source"] == "judged"]
    plain = [t for t in out if t["metadata"]["source"] == "plain"]
    assert len(judged) == len(plain) == 2
    for t in judged:
        assert t["status"] == "failed" and t["reward"] == 0.0 and not any(t["loss_mask"]) and t["response_ids"]
        assert f"the judge at {url} did not answer within judge.timeout=0.5s" in t["metadata"]["error"]
    for t in plain:
        assert t["status"] != "failed" and "judge_verdict" not in t["metadata"]
        assert t["reward"] == sum(c.isdigit() for c in t["response_text"]) / max(len(t["response_text"]), 1)


@pytest.mark.parametrize("judge, message", [
    ({}, "reward: judge needs a `judge:` section"),
    ({"prompt_template": "{response}", "parse": "x"}, "judge.model_path is required"),
    ({"model_path": "/nowhere", "prompt_template": "{response}", "parse": "x"}, "judge.model_path='/nowhere' is not a"),
    ({"prompt_template": "{respons}", "parse": "x"}, "names {respons}; .* did you mean 'response'"),
    ({"prompt_template": "{prompt}", "parse": "x"}, "has no {response}"),
    ({"prompt_template": "{response}", "parse": "tests.rewards.nope"}, "judge.parse: cannot load 'tests.rewards.nope'"),
    ({"prompt_template": "{response}", "parse": "(a)(b)"}, "has 2 groups"),
    ({"prompt_template": "{response}", "parse": "([0-9]"}, "neither a dotted path .* nor a valid regex"),
    ({"prompt_template": "{response}", "parse": "x", "timout": 3}, "judge.timout is not a judge setting; did you mean 'timeout'"),
    ({"prompt_template": "{response}", "parse": "x", "timeout": 0}, "judge.timeout=0 must be > 0"),
    ({"prompt_template": "{response}", "parse": "x", "max_new_tokens": 0}, "judge.max_new_tokens=0 must be a positive"),
    ({"prompt_template": "{response}", "parse": "x", "url": "localhost:1"}, "must be an http"),
])
def test_judge_config_errors_say_what_to_change(judge, message, tiny_model_dir):
    if judge and "model_path" not in judge and "model_path is required" not in message:
        judge = {"model_path": tiny_model_dir, **judge}
    with pytest.raises(ValueError, match=".*".join(map(re.escape, message.split(".*")))):
        config.load_config(None, ["reward=judge", f"judge={json.dumps(judge)}"])
    with pytest.raises(ValueError, match="judge: is set but no reward is 'judge'"):
        config.load_config(None, [f"judge={json.dumps({'model_path': tiny_model_dir})}"])


@pytest.mark.slow
def test_judge_is_checked_by_the_check_option(tiny_model_dir):
    """`loongsage.py RECIPE --check` validates the judge: a sound one passes (its defaults filled in the printed
    config), a template field that does not exist exits 2 naming it."""
    ok = dict(model_path=tiny_model_dir, prompt_template=JUDGE_TEMPLATE, parse="Score: ([0-9.]+)")
    root = Path(__file__).resolve().parents[1]
    runs = [subprocess.run([sys.executable, "loongsage.py", "recipes/arith_cpu.yaml", "reward=judge",
                            f"judge={json.dumps(j)}", "--check"], cwd=root, capture_output=True, text=True, timeout=120)
            for j in (ok, {**ok, "prompt_template": "{reply}"})]
    assert runs[0].returncode == 0 and "config OK" in runs[0].stdout and "timeout: 60.0" in runs[0].stdout
    assert runs[1].returncode == 2 and "judge.prompt_template names {reply}" in runs[1].stderr
