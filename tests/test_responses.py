"""The OpenAI Responses API on the router, driven by the official `openai` client's `responses.create`: plain
(engine ids in and out, usage), streamed (the event sequence and its text), function tools with the tool
result sent back by `previous_response_id` (the next engine input extends the previous one token for token),
and what the API rejects (4xx, the router keeps serving)."""
import asyncio

import openai
import pytest

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
        with pytest.raises(openai.BadRequestError, match="only function tools"):
            await client.responses.create(model="m", input="x", tools=[{"type": "web_search"}])
        r3 = await client.responses.create(model="m", input="1+1", max_output_tokens=3)  # still serving
        assert r3.status in ("completed", "incomplete")
        await flow.close()
    run(body())
