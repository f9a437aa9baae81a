"""The OpenAI Responses API on the router, driven by the official `openai` client's `responses.create`: plain
(engine ids in and out, usage), streamed (the event sequence and its text), function tools with the tool
result sent back by `previous_response_id` (the next engine input extends the previous one token for token),
and what the API rejects (4xx, the router keeps serving): every top-level field either honoured, inert (the engine
gets the bare request's prompt and sampling params) or refused with a 400 naming it and the value seen. Custom tools
(a one-string function, a custom_tool_call item back, its output continuing the same token sequence); structured
output (text.format / response_format as the engine's json_schema param, the greedy reply JSON of the schema);
reasoning.effort switching a thinking template, and structured output refused while the model thinks;
previous_response_id across a weight update (per-token versions 0, then 1)."""
import asyncio
import json

import openai
import pytest

import cpu_engine
import rollout

from test_agentflow import (CALC_TOOL, crafted_engine, engines, open_session, record_engine_calls,  # noqa: F401
                            session_client, started_flow)

TOOL = {"type": "function", "name": "calculator", "description": "evaluate arithmetic",
        "parameters": CALC_TOOL["function"]["parameters"]}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 90))


def test_responses_plain_and_streamed(engines, tiny_model_dir):  # noqa: F811
    async def body():
        flow = await started_flow(engines, tiny_model_dir)
        calls = record_engine_calls(flow.pool)
        s = open_session(flow)
        client = session_client(flow, s)
        r = await client.responses.create(model="m", input="12+7", instructions="Answer.", max_output_tokens=5)
        inp, out = calls[-1][1], calls[-1][2]
        assert inp == flow.chat.encode(flow.chat.render([{"role": "system", "content": "Answer."},
                                                         {"role": "user", "content": "12+7"}],
                                                        add_generation_prompt=True))
        assert r.object == "response" and r.status in ("completed", "incomplete")
        assert r.usage.output_tokens == len(out["output_ids"]) <= 5 and r.usage.input_tokens == len(inp)
        assert r.output_text == s.last_text and r.output[0].type == "message"
        # the trajectory holds exactly the engine's tokens (TITO)
        seg = s.segments[-1]
        assert seg.prompt_ids == inp and seg.response_ids[:len(out["output_ids"])] == out["output_ids"]

        stream = await client.responses.create(model="m", input=[{"role": "user", "content": "3+4"}],
                                               max_output_tokens=5, stream=True)
        kinds, text, final = [], "", None
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
            if event.type == "response.completed":
                final = event.response
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert "response.output_item.added" in kinds and "response.output_text.done" in kinds
        assert text == final.output_text == s.last_text
        await flow.close()
    run(body())


def test_responses_function_tools_and_previous_response(engines, tiny_model_dir):  # noqa: F811
    async def body():
        flow = await started_flow(engines, tiny_model_dir)
        seen = crafted_engine(flow.pool, flow.chat, [
            '<tool_call>{"name": "calculator", "arguments": {"expression": "12+7"}}</tool_call>', "19"])
        s = open_session(flow)
        client = session_client(flow, s)
        r1 = await client.responses.create(model="m", input="12+7", tools=[TOOL], max_output_tokens=40)
        [call] = [o for o in r1.output if o.type == "function_call"]
        assert call.name == "calculator" and call.arguments == '{"expression": "12+7"}'
        r2 = await client.responses.create(model="m", previous_response_id=r1.id, tools=[TOOL],
                                           input=[{"type": "function_call_output", "call_id": call.call_id,
                                                   "output": "19"}], max_output_tokens=40)
        assert r2.output_text == "19" and r2.previous_response_id == r1.id
        # TITO: the second engine input is the first input + the model's own ids + the tool result's ids
        first_in, second_in = seen
        assert second_in[:len(first_in)] == first_in and len(s.segments) == 1
        assert 0 in s.segments[-1].loss_mask  # the tool result is not trained on

        with pytest.raises(openai.BadRequestError, match="previous_response_id"):
            await client.responses.create(model="m", previous_response_id="resp_nope", input="x")
        with pytest.raises(openai.BadRequestError, match="no function_call with call_id"):
            await client.responses.create(model="m", input=[{"type": "function_call_output", "call_id": "c9",
                                                             "output": "1"}])
        with pytest.raises(openai.BadRequestError, match="supported: function, custom, namespace"):
            await client.responses.create(model="m", input="x", tools=[{"type": "local_shell"}])
        # a hosted tool (Codex offers web_search) is not shown to the model: accepted, recorded with the session
        await client.responses.create(model="m", input="x", tools=[{"type": "web_search"}], max_output_tokens=3)
        assert s.unknown_fields == {"tools:web_search"}
        r3 = await client.responses.create(model="m", input="1+1", max_output_tokens=3)  # still serving
        assert r3.status in ("completed", "incomplete")
        await flow.close()
    run(body())


def capture_sampling(pool) -> list:
    """Observe the sampling_params of every engine call (the engine stays real, or crafted)."""
    seen, real = [], pool.generate

    async def capturing(input_ids, sampling_params, rid, prefer=None, batch="", **streaming):
        seen.append(dict(sampling_params))
        return await real(input_ids, sampling_params, rid, prefer, batch, **streaming)
    pool.generate = capturing
    return seen


INERT = dict(metadata={"run": "a"}, store=False, user="u1", safety_identifier="s1", prompt_cache_key="k",
             service_tier="auto", parallel_tool_calls=False, max_tool_calls=3, top_logprobs=0, truncation="disabled",
             background=False, include=["reasoning.encrypted_content"], reasoning={"effort": "none", "summary": "auto"},
             text={"format": {"type": "text"}, "verbosity": "low"})


@pytest.mark.parametrize("kw, needle", [
    (dict(extra_body={"temprature": 0.5}), "unrecognized request argument supplied: 'temprature'; did you mean "
                                           "'temperature'?"),
    (dict(top_logprobs=5), "'top_logprobs'=5 is not supported"),
    (dict(truncation="auto"), "'truncation'='auto' is not supported"),
    (dict(background=True), "'background'=True is not supported"),
    (dict(conversation="conv_1"), "'conversation'='conv_1' is not supported"),
    (dict(prompt={"id": "pmpt_1"}), "'prompt'={'id': 'pmpt_1'} is not supported"),
    (dict(metadata="run a"), "'metadata' must be of type dict, got 'run a'"),
    (dict(extra_body={"min_p": 0.1}), "unrecognized request argument supplied: 'min_p'"),
    (dict(reasoning={"effort": "high"}), "thinking was requested (reasoning), but this model has no reasoning parser"),
    (dict(reasoning={"effort": "huge"}), "reasoning {'effort': 'huge'}"),
    (dict(reasoning={"mode": "pro"}), "mode 'standard'"),
    (dict(include=["message.output_text.everything"]), "include ['message.output_text.everything']"),
    (dict(tool_choice={"type": "allowed_tools", "mode": "auto", "tools": []}, tools=[TOOL]), "tool_choice {'type': "
                                                                                            "'allowed_tools'"),
    (dict(tool_choice={"type": "function", "name": "search"}, tools=[TOOL]), "function tool 'search'"),
    (dict(stream_options={"include_obfuscation": False}), "only allowed when 'stream' is true"),
    (dict(text={"format": {"type": "json_schema", "name": "a"}}), "text.format needs a 'schema'"),
    (dict(text={"format": {"type": "grammar", "grammar": "x"}}), "grammar and structural_tag formats are not"),
    (dict(text={"verbosity": "loud"}), "verbosity (low, medium, high)"),
    (dict(text={"format": {"type": "json_object"}}, tools=[TOOL]), "text.format (structured output) cannot be "
                                                                   "combined with tools"),
    (dict(text={"format": {"type": "json_schema", "name": "a", "schema": {"type": "nope"}}}),
     "Failed to compile json grammar"),  # the engine's 400, passed on
    (dict(tools=[{"type": "custom", "name": "sh", "format": {"type": "grammar", "syntax": "lark", "definition": "x"}}]),
     "a grammar format is not supported"),
    (dict(tools=[{**TOOL, "defer_loading": True}]), "tools[0].defer_loading=True is not supported"),
])
def test_responses_refuse_what_they_cannot_honour(kw, needle, engines, tiny_model_dir):  # noqa: F811
    """Each refused field is a 400 naming the field and the value seen (Chat Completions' rule: accepted, accepted
    only at a neutral value, refused); the session keeps serving."""
    async def body():
        flow = await started_flow(engines, tiny_model_dir)
        s = open_session(flow)
        client = session_client(flow, s)
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.create(model="m", input="1+1", max_output_tokens=3, **kw)
        r = await client.responses.create(model="m", input="1+1", max_output_tokens=3)
        await flow.close()
        return e.value, r
    error, r = run(body())
    assert error.status_code == 400 and needle in error.message, error.message
    assert r.status in ("completed", "incomplete")


def test_responses_inert_fields_leave_the_sampling_unchanged(engines, tiny_model_dir):  # noqa: F811
    """Fields that do not change what is generated (metadata, store, user, caching and billing hints, effort none on a
    model that does not think, plain text format, encrypted reasoning) are accepted, and the engine gets the very
    prompt and sampling parameters of the bare request; the response echoes them."""
    async def body():
        flow = await started_flow(engines, tiny_model_dir)
        calls, sampling = record_engine_calls(flow.pool), capture_sampling(flow.pool)
        s1, s2 = open_session(flow), open_session(flow)
        bare = await session_client(flow, s1).responses.create(model="m", input="1+1", max_output_tokens=3)
        full = await session_client(flow, s2).responses.create(model="m", input="1+1", max_output_tokens=3, **INERT)
        await flow.close()
        return calls, sampling, bare, full
    calls, sampling, bare, full = run(body())
    assert calls[0][1] == calls[1][1] and sampling[0] == sampling[1]
    assert full.metadata == {"run": "a"} and full.parallel_tool_calls is False and full.text.verbosity == "low"
    assert full.reasoning.effort == "none" and bare.text.format.type == "text"


def test_responses_custom_tools_round_trip(engines, tiny_model_dir):  # noqa: F811
    """A custom tool is rendered as a function of one string parameter; the model's call of it comes back as a
    custom_tool_call item with that string as its input; the client's custom_tool_call_output (by
    previous_response_id, or the whole history sent back) continues the same token sequence; arguments other than
    the one string come back whole as JSON text."""
    shell = {"type": "custom", "name": "shell", "description": "run a shell command"}
    call = '<tool_call>\n{"name": "shell", "arguments": {"input": "ls -la /tmp"}}\n</tool_call>'
    odd = '<tool_call>\n{"name": "shell", "arguments": {"cmd": "pwd"}}\n</tool_call>'

    async def body():
        flow = await started_flow(engines, tiny_model_dir)
        seen = crafted_engine(flow.pool, flow.chat, ["ok " + call, "2 files", "ok " + call, "done", odd])
        s = open_session(flow)
        client = session_client(flow, s)
        r1 = await client.responses.create(model="m", input="list /tmp", tools=[shell, TOOL],
                                           tool_choice={"type": "custom", "name": "shell"})
        [item] = [o for o in r1.output if o.type == "custom_tool_call"]
        r2 = await client.responses.create(model="m", previous_response_id=r1.id, tools=[shell, TOOL], input=[
            {"type": "custom_tool_call_output", "call_id": item.call_id, "output": "a\nb"}])
        # stateless: the whole history sent back, the call as the client got it
        s2 = open_session(flow)
        c2 = session_client(flow, s2)
        r3 = await c2.responses.create(model="m", input="list /tmp", tools=[shell, TOOL])
        [item3] = [o for o in r3.output if o.type == "custom_tool_call"]
        r4 = await c2.responses.create(model="m", tools=[shell, TOOL], input=[
            {"role": "user", "content": "list /tmp"}, *[o.model_dump(exclude_none=True) for o in r3.output],
            {"type": "custom_tool_call_output", "call_id": item3.call_id, "output": "a\nb"}])
        r5 = await session_client(flow, open_session(flow)).responses.create(model="m", input="again", tools=[shell])
        with pytest.raises(openai.BadRequestError, match="function tool 'shell'"):
            await client.responses.create(model="m", input="x", tools=[shell],
                                          tool_choice={"type": "function", "name": "shell"})
        with pytest.raises(openai.BadRequestError, match="no custom_tool_call with call_id"):
            await client.responses.create(model="m", input=[{"type": "custom_tool_call_output", "call_id": "c7",
                                                             "output": "1"}])
        await flow.close()
        return flow.chat, seen, s, s2, r1, item, r2, item3, r4, r5
    chat, seen, s, s2, r1, item, r2, item3, r4, r5 = run(body())
    assert [o.type for o in r1.output] == ["message", "custom_tool_call"] and r1.output_text == "ok"
    assert (item.name, item.input) == ("shell", "ls -la /tmp") and item.id.startswith("ctc_")
    prompt = chat.decode(seen[0], skip_special_tokens=False)
    assert '"name": "shell"' in prompt and '"input": {"type": "string"' in prompt  # the one-string function
    assert r2.output_text == "2 files"
    for segment, (first, second) in ((s.segments, seen[:2]), (s2.segments, seen[2:4])):
        assert second[:len(first)] == first and len(segment) == 1  # TITO: one token sequence
    assert "<tool_response>\na\nb\n</tool_response>" in chat.decode(seen[1], skip_special_tokens=False)
    assert seen[3] == seen[1] and item3.input == item.input and r4.output_text == "done"
    [odd_item] = [o for o in r5.output if o.type == "custom_tool_call"]
    assert odd_item.input == '{"cmd": "pwd"}'


def test_responses_structured_output_constrains_the_engine(engines, tiny_model_dir):  # noqa: F811
    """text.format json_schema reaches the engine as SGLang's json_schema sampling param (the schema as a JSON
    string) and the greedy reply of the random model is JSON of that schema; json_object is the schema {"type":
    "object"}; Chat Completions' response_format takes the same path; the trajectory keeps the engine's (masked)
    logprobs."""
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}

    async def body():
        flow = await started_flow(engines, tiny_model_dir)
        calls, sampling = record_engine_calls(flow.pool), capture_sampling(flow.pool)
        s = open_session(flow, sampling=dict(temperature=0.0, max_new_tokens=120))
        client = session_client(flow, s)
        r = await client.responses.create(model="m", input="12+7", text={"format": {
            "type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
        lps = list(s.segments[-1].rollout_logprobs)
        r2 = await session_client(flow, open_session(flow)).responses.create(
            model="m", input="12+7", max_output_tokens=8, text={"format": {"type": "json_object"}})
        c = await session_client(flow, open_session(flow, sampling=dict(temperature=0.0, max_new_tokens=120))) \
            .chat.completions.create(model="m", messages=[{"role": "user", "content": "12+7"}], response_format={
                "type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
        await flow.close()
        return calls, sampling, r, lps, r2, c
    calls, sampling, r, lps, r2, c = run(body())
    assert sampling[0]["json_schema"] == json.dumps(schema) and sampling[1]["json_schema"] == '{"type": "object"}'
    assert sampling[2]["json_schema"] == json.dumps(schema)
    assert r.status == "completed" and isinstance(json.loads(r.output_text)["answer"], int)
    assert r.text.format.type == "json_schema" and r2.text.format.type == "json_object"
    assert r2.output_text.startswith("{")
    assert json.loads(c.choices[0].message.content) == json.loads(r.output_text)  # same greedy constrained reply
    out = calls[0][2]
    assert lps[:len(out["output_ids"])] == [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def test_responses_previous_response_id_across_a_weight_update(tiny_model_dir):
    """A response, a weight update on the engine (from disk, version 1), then a response continuing it by
    previous_response_id: one token sequence, the first turn's tokens stamped version 0 and the second's version 1
    (the template's glue, not trained on, -1)."""
    url, handle = cpu_engine.serve(tiny_model_dir, max_batch=8, max_len=512, seed=0)

    async def body():
        flow = await started_flow([url], tiny_model_dir)
        calls = record_engine_calls(flow.pool)
        s = open_session(flow)
        client = session_client(flow, s)
        r1 = await client.responses.create(model="m", input="12+7", max_output_tokens=4)
        await asyncio.to_thread(rollout.post, url, "/update_weights_from_disk",
                                {"model_path": tiny_model_dir, "weight_version": "1"})
        r2 = await client.responses.create(model="m", previous_response_id=r1.id, input="and 3+4?",
                                           max_output_tokens=4)
        await flow.close()
        return calls, s, r1, r2
    try:
        calls, s, r1, r2 = run(body())
    finally:
        handle.shutdown()
    (_, in1, out1), (_, in2, out2) = calls
    assert in2[:len(in1) + len(out1["output_ids"])] == in1 + out1["output_ids"]  # the conversation continued
    assert out1["meta_info"]["weight_version"] == "0" and out2["meta_info"]["weight_version"] == "1"
    assert r2.previous_response_id == r1.id and len(s.segments) == 1
    seg = s.segments[-1]
    n1, n2 = len(out1["output_ids"]), len(out2["output_ids"])
    glue = len(in2) - len(in1) - n1
    assert seg.weight_versions == [0] * n1 + [-1] * glue + [1] * n2
    assert seg.loss_mask == [1] * n1 + [0] * glue + [1] * n2


def test_responses_reasoning_switches_thinking_and_structured_output_needs_it_off():
    """On a thinking model (the qwen3 family's template, crafted replies): reasoning.effort "none" renders the prompt
    with thinking off and any other level with it on (a reasoning item comes back); structured output is refused
    while the model would think (the grammar would hold from its first token) and accepted with effort "none";
    effort and chat_template_kwargs that disagree are refused; Chat Completions' response_format with tools is too."""
    import data
    from test_chat import NOWHERE, settings
    model = str(data.build_tiny_model(data.default_cache_dir() / f"tiny-chat-{data.settings_hash(settings('qwen3'))}",
                                      **settings("qwen3")))
    fmt = {"format": {"type": "json_object"}}

    async def body():
        flow = await started_flow(NOWHERE, model)
        seen = crafted_engine(flow.pool, flow.chat, ["<think>\n12 plus 7\n</think>\n\n19", '{"a": 1}'])
        sampling = capture_sampling(flow.pool)
        client = session_client(flow, open_session(flow))
        thought = await client.responses.create(model="m", input="12+7", reasoning={"effort": "low"})
        with pytest.raises(openai.BadRequestError) as thinking_on:
            await client.responses.create(model="m", input="12+7", text=fmt)
        structured = await session_client(flow, open_session(flow)).responses.create(
            model="m", input="12+7", text=fmt, reasoning={"effort": "none"})
        with pytest.raises(openai.BadRequestError, match="set \\['enable_thinking'\\] differently"):
            await client.responses.create(model="m", input="x", reasoning={"effort": "none"},
                                          extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        with pytest.raises(openai.BadRequestError, match="response_format \\(structured output\\) cannot be combined"):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], tools=[
                CALC_TOOL], response_format={"type": "json_object"}, extra_body={
                "chat_template_kwargs": {"enable_thinking": False}})
        await flow.close()
        return flow.chat, seen, sampling, thought, thinking_on.value, structured
    chat_format, seen, sampling, thought, thinking_on, structured = run(body())
    user = [{"role": "user", "content": "12+7"}]
    assert seen[0] == chat_format.prompt_ids(user, None, {"enable_thinking": True})
    assert seen[1] == chat_format.prompt_ids(user, None, {"enable_thinking": False}) != seen[0]
    assert [o.type for o in thought.output] == ["reasoning", "message"] and thought.output_text == "19"
    assert "needs thinking off" in thinking_on.message and "reasoning.effort 'none'" in thinking_on.message
    assert json.loads(structured.output_text) == {"a": 1} and sampling[1]["json_schema"] == '{"type": "object"}'


def test_chat_completions_reasoning_effort_switches_thinking_as_responses_does(tiny_model_dir):
    """Chat Completions' reasoning_effort works as the Responses reasoning.effort does: on a thinking model (the qwen3
    family's template, crafted replies) "none" renders the prompt with thinking off and any other level with it on
    (the thinking comes back as reasoning_content), structured output passes with "none"; an unknown level, an
    effort that disagrees with chat_template_kwargs, and thinking asked of a model that cannot think are refused."""
    import data
    from test_chat import NOWHERE, settings
    model = str(data.build_tiny_model(data.default_cache_dir() / f"tiny-chat-{data.settings_hash(settings('qwen3'))}",
                                      **settings("qwen3")))
    msgs = [{"role": "user", "content": "12+7"}]

    async def body():
        flow = await started_flow(NOWHERE, model)
        seen = crafted_engine(flow.pool, flow.chat, ["<think>\n12 plus 7\n</think>\n\n19", '{"a": 1}'])
        client = session_client(flow, open_session(flow))
        thought = await client.chat.completions.create(model="m", messages=msgs, reasoning_effort="low")
        structured = await session_client(flow, open_session(flow)).chat.completions.create(
            model="m", messages=msgs, reasoning_effort="none", response_format={"type": "json_object"})
        plain = await started_flow(NOWHERE, tiny_model_dir)  # ChatML, no reasoning parser
        errors = []
        for c, kw in ((client, dict(reasoning_effort="huge")),
                      (client, dict(reasoning_effort="none", extra_body={"chat_template_kwargs": {
                          "enable_thinking": True}})),
                      (session_client(plain, open_session(plain)), dict(reasoning_effort="low"))):
            with pytest.raises(openai.BadRequestError) as e:
                await c.chat.completions.create(model="m", messages=msgs, **kw)
            errors.append(e.value.message)
        await plain.close()
        await flow.close()
        return flow.chat, seen, thought, structured, errors
    chat_format, seen, thought, structured, errors = run(body())
    assert seen[0] == chat_format.prompt_ids(msgs, None, {"enable_thinking": True})
    assert seen[1] == chat_format.prompt_ids(msgs, None, {"enable_thinking": False}) != seen[0]
    reply = thought.choices[0].message
    assert reply.reasoning_content == "12 plus 7" and reply.content == "19"
    assert json.loads(structured.choices[0].message.content) == {"a": 1}
    assert "reasoning_effort 'huge' must be one of" in errors[0]
    assert "reasoning_effort 'none' and chat_template_kwargs set ['enable_thinking'] differently" in errors[1]
    assert "thinking was requested (reasoning_effort), but this model has no reasoning parser" in errors[2]
