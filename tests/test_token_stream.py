"""Token streaming, engine to client: the CPU engine's `/generate` with `stream: true` over real HTTP (SGLang's
Server-Sent Events: cumulative chunks as the scheduler samples, the finished answer, [DONE]; stream_interval; a batch;
abort; a client that leaves; an engine that dies mid-stream), and the router streaming each API to the official
`openai` and `anthropic` clients as the engine generates: the concatenated deltas equal the plain reply of the same
greedy request, the trajectory is the plain one's token for token, and the first delta reaches the client while the
engine is held before its last token (an event, not a clock: the engine's scheduler waits at a gate the test opens
only once the delta has arrived). `ChatFormat.settled`, what a stream may send before the turn ends, is checked on
every prefix of crafted replies of every model family."""
import asyncio
import json
import threading
import time

import anthropic
import httpx
import openai
import pytest

import agentflow
import chat
import cpu_engine
import data
import rollout
import wire
from test_agentflow import CALC_TOOL, crafted_engine, open_session, session_client, started_flow
from test_chat import FAMILIES, settings

GREEDY = dict(temperature=0.0, max_new_tokens=64)
ROUTER_SAMPLING = dict(temperature=0.0, max_new_tokens=48)  # the sessions' sampling: greedy, 48 tokens a turn at most


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """One CPU engine: (url, its ServerHandle, whose engine the gate holds). No prefix cache: a request and its
    repeat then run the very same computation, so their logprobs compare exactly."""
    url, handle = cpu_engine.serve(tiny_model_dir, max_batch=8, max_len=512, seed=0, disable_radix_cache=True)
    yield url, handle
    handle.shutdown()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def sse_chunks(lines: list[str]) -> list[dict]:
    """The JSON chunks of an SSE body, checking SGLang's framing: `data: ` lines, [DONE] last."""
    data_lines = [ln for ln in lines if ln]
    assert all(ln.startswith("data: ") for ln in data_lines), data_lines[:3]
    assert data_lines[-1] == "data: [DONE]"
    return [json.loads(ln[len("data: "):]) for ln in data_lines[:-1]]


class Gate:
    """Holds the engine's scheduler before the step after any running request has `k` output tokens, until `open()`
    (or 60 s, so a broken test fails rather than hangs). While it holds, no later token exists anywhere."""

    def __init__(self, engine: cpu_engine.CpuEngine, k: int):
        self.engine, self.k, self.opened, self.held = engine, k, threading.Event(), threading.Event()
        real = engine._step

        def step():
            if not self.opened.is_set() and any(len(r.output_ids) >= k for r in engine._running):
                self.held.set()
                self.opened.wait(60)
            real()
        engine._step = step

    def open(self) -> None:
        self.opened.set()

    def remove(self) -> None:
        self.opened.set()
        del self.engine._step  # the class's own method again


# ----------------------------------------------------------------------------------------------
# the engine: /generate with stream=true


def test_engine_streams_cumulative_chunks_that_end_in_the_plain_answer(served):
    url, handle = served
    prompt = [5, 9, 13, 200, 31]
    body = {"input_ids": prompt, "sampling_params": {**GREEDY, "max_new_tokens": 12, "ignore_eos": True},
            "return_logprob": True}
    plain = httpx.post(f"{url}/generate", json=body, timeout=60).json()
    gate = Gate(handle.engine, 3)
    try:
        with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True}, timeout=60) as resp:
            assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
            lines, first = [], None
            for line in resp.iter_lines():
                lines.append(line)
                if first is None and line.startswith("data: {"):
                    # the first chunk is here while the scheduler is held before its 4th token: it left as sampled
                    first = json.loads(line[len("data: "):])
                    assert not gate.opened.is_set() and len(first["output_ids"]) <= 3
                    gate.open()
    finally:
        gate.remove()
    chunks = sse_chunks(lines)
    final, partial = chunks[-1], chunks[:-1]
    assert final["output_ids"] == plain["output_ids"] and len(final["output_ids"]) == 12
    assert final["text"] == plain["text"] and final["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert final["meta_info"]["output_token_logprobs"] == plain["meta_info"]["output_token_logprobs"]
    assert partial and first == partial[0]
    sizes = [len(c["output_ids"]) for c in partial]
    assert sizes == sorted(set(sizes)) and sizes[-1] < 12  # growing, every chunk before the end unfinished
    for c in partial:  # cumulative, as SGLang streams by default: each chunk a prefix of the answer
        n = len(c["output_ids"])
        assert c["output_ids"] == plain["output_ids"][:n] and c["meta_info"]["finish_reason"] is None
        assert c["meta_info"]["output_token_logprobs"] == plain["meta_info"]["output_token_logprobs"][:n]
        assert c["meta_info"]["completion_tokens"] == n and c["meta_info"]["weight_versions"][-1]["end"] == n
        assert plain["text"].startswith(c["text"]) and "e2e_latency" not in c["meta_info"]


def test_engine_stream_interval_batch_and_bad_requests(served):
    url, _ = served
    sp = {**GREEDY, "max_new_tokens": 10, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/generate", timeout=60, json={
            "input_ids": [7, 8, 9], "sampling_params": {**sp, "stream_interval": 3}, "stream": True}) as resp:
        chunks = sse_chunks(list(resp.iter_lines()))
    # SGLang's rule: the first token at once, then whenever 3 are unsent (a slow reader may see fewer chunks)
    assert all((len(c["output_ids"]) - 1) % 3 == 0 for c in chunks[:-1]) and len(chunks[-1]["output_ids"]) == 10

    prompts = [[7, 8, 9], [11, 12, 13, 14]]
    plain = httpx.post(f"{url}/generate", json={"input_ids": prompts, "sampling_params": sp}, timeout=60).json()
    with httpx.stream("POST", f"{url}/generate", timeout=60,
                      json={"input_ids": prompts, "sampling_params": sp, "stream": True}) as resp:
        chunks = sse_chunks(list(resp.iter_lines()))
    assert {c["index"] for c in chunks} == {0, 1}  # a batch streams too, each chunk naming its prompt
    finals = {c["index"]: c for c in chunks if c["meta_info"]["finish_reason"] is not None}
    assert [finals[i]["output_ids"] for i in (0, 1)] == [p["output_ids"] for p in plain]

    # refused before any chunk, as a plain request is: unknown key (SGLang's contract check), bad stream_interval
    r = httpx.post(f"{url}/generate", json={"input_ids": [1, 2], "stream": True,
                                            "sampling_params": {"max_new_token": 4}}, timeout=30)
    assert r.status_code == 400 and "max_new_token" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/generate", json={"input_ids": [1, 2], "stream": True,
                                            "sampling_params": {"stream_interval": "often"}}, timeout=30)
    assert r.status_code == 400 and "wrong type" in r.json()["error"]["message"]


def test_engine_stream_abort_and_a_client_that_leaves(served):
    url, handle = served
    body = {"input_ids": [3, 4, 5], "sampling_params": {**GREEDY, "max_new_tokens": 400, "ignore_eos": True},
            "stream": True, "rid": "stream-abort"}
    gate = Gate(handle.engine, 2)
    try:
        with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            assert gate.held.wait(60)  # the scheduler is held: abort lands between two steps, mid-generation
            handle.engine.call(handle.engine._abort, "stream-abort", False, "aborted by request")
            gate.open()
            chunks = sse_chunks(["data: {}"] + list(lines))[1:]
    finally:
        gate.remove()
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort" and len(chunks[-1]["output_ids"]) < 400

    before = handle.engine.stats["generated_tokens"]
    gate = Gate(handle.engine, 2)
    try:
        with httpx.stream("POST", f"{url}/generate", json={**body, "rid": "stream-leaves"}, timeout=60) as resp:
            lines = resp.iter_lines()  # kept: a line iterator that is dropped closes the response
            assert next(line for line in lines if line.startswith("data: {"))
            assert gate.held.wait(60)
        # the client closed its stream while the scheduler is held: the server's abort reaches the scheduler's inbox
        # (nothing else talks to it here), and lands right after the held step, as SGLang's abort task does
        deadline = time.monotonic() + 60
        while handle.engine._inbox.empty() and time.monotonic() < deadline:
            time.sleep(0.01)
        gate.open()
        deadline = time.monotonic() + 60
        while handle.engine.state()["num_running_reqs"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert handle.engine.state()["num_running_reqs"] == 0
        assert handle.engine.stats["generated_tokens"] - before == 3  # 2 sampled, 1 in the held step: then aborted
    finally:
        gate.remove()


def test_engine_death_mid_stream_is_sglangs_error_event(tiny_model_dir):
    """An engine that dies while a request streams ends the stream with SGLang's error event, which
    rollout.generate_stream raises as an EngineError with its code (an engine of its own: this one dies)."""
    url, handle = cpu_engine.serve(tiny_model_dir, max_batch=2, max_len=256, seed=0)
    gate, chunks = Gate(handle.engine, 2), []

    async def body():
        async with httpx.AsyncClient(timeout=60) as client:
            task = asyncio.ensure_future(rollout.generate_stream(
                client, url, [3, 4, 5], {"temperature": 0.0, "max_new_tokens": 200, "ignore_eos": True},
                on_chunk=chunks.append))
            while not gate.held.is_set():
                await asyncio.sleep(0.01)
            # SGLang's scheduler dies on a resume of a tag never released (SGLANG_BEHAVIOURS), mid-request here
            handle.engine.call(handle.engine._resume_memory, ["weights"])
            gate.open()
            with pytest.raises(rollout.EngineError, match="HTTP 500 in its stream: the engine died: KeyError"):
                await task
    try:
        run(body())
    finally:
        gate.remove()
        handle.shutdown()
    # tokens reached the client before the death, and far fewer than asked: the gate held the scheduler at 2 output
    # tokens; once opened, one more decode step may run before the scheduler takes the fatal call from its inbox
    # (and a cumulative chunk written late holds every token so far)
    assert handle.engine.died and chunks and all(1 <= len(c["output_ids"]) <= 3 for c in chunks)


# ----------------------------------------------------------------------------------------------
# what a stream may send before the turn ends


REPLIES = ["The answer is 19.  ", "  <think>\n12 plus 7\n</think>\n\nso 19", "<think>\nhalf a thought",
           'ok <tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call>',
           "<tool_call>\n{oops\n</tool_call> never a call", "sure<|python_tag|>{\"name\": \"calculator\", "
           "\"parameters\": {\"expression\": \"1\"}} thanks", '{"name": "calculator", "parameters": {}}',
           'ok [TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "1+2"}}] bye',
           "x <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calculator\n```json\n{}\n```"
           "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "héllo wörld ✓ 漢字"]


@pytest.mark.parametrize("family", FAMILIES)
def test_settled_text_is_always_a_prefix_of_the_parsed_turn(family):
    """On every prefix of every reply, with and without tools: what `settled` gives is a prefix of the parse of the
    whole reply (so the deltas add up to it), and a plain reply settles text before its last token."""
    fmt = chat.ChatFormat(data.build_tiny_model(
        data.default_cache_dir() / f"tiny-chat-{data.settings_hash(settings(family))}", **settings(family)))
    tools = wire.openai_tools([CALC_TOOL])
    for reply in REPLIES:
        ids = fmt.encode(reply) + [fmt.eos_id]
        for use_tools in (None, tools):
            reasoning, content, _ = fmt.parse(fmt.assistant_text(ids), use_tools)
            for n in range(len(ids) + 1):
                r, c = fmt.settled(ids[:n], use_tools)
                assert reasoning.startswith(r) and content.startswith(c), (family, reply, n, r, c)
                assert not (r and c) or "</think>" in fmt.assistant_text(ids[:n])
    ids = fmt.encode("The answer is 19.") + [fmt.eos_id]
    assert fmt.settled(ids[:-2], tools)[1].startswith("The answer")


# ----------------------------------------------------------------------------------------------
# the router: every API streams as the engine generates


def settling_point(fmt: chat.ChatFormat, ids: list[int]) -> int:
    """How many of a reply's tokens the engine must have sampled before the router can send its first delta."""
    return next(n for n in range(1, len(ids) + 1) if any(fmt.settled(ids[:n], None)))


async def openai_stream(client, msgs, on_first):
    stream = await client.chat.completions.create(model="m", messages=msgs, max_tokens=48, temperature=0,
                                                  stream=True, stream_options={"include_usage": True})
    text, reasoning, usage, finish = "", "", None, None
    async for chunk in stream:
        for c in chunk.choices:
            piece = (c.delta.content or "") + (getattr(c.delta, "reasoning_content", None) or "")
            if piece:
                on_first()
            text += c.delta.content or ""
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            finish = c.finish_reason or finish
        usage = chunk.usage or usage
    return text, usage.completion_tokens, finish


async def anthropic_stream(client, msgs, on_first):
    async with client.messages.stream(model="m", max_tokens=48, messages=msgs) as st:
        text = ""
        async for t in st.text_stream:
            if t:
                on_first()
            text += t
        final = await st.get_final_message()
    return text, final.usage.output_tokens, final.stop_reason


async def responses_stream(client, msgs, on_first):
    stream = await client.responses.create(model="m", input=msgs, max_output_tokens=48, temperature=0, stream=True)
    text, final = "", None
    async for event in stream:
        if event.type == "response.output_text.delta":
            on_first()
            text += event.delta
        if event.type == "response.completed":
            final = event.response
    assert text == final.output_text
    return text, final.usage.output_tokens, final.status


@pytest.mark.parametrize("api", ["openai", "anthropic", "responses"])
def test_router_streams_each_api_as_the_engine_generates(api, served, tiny_model_dir):
    url, handle = served

    async def plain(flow, s, msgs):
        if api == "anthropic":
            m = await anthropic.AsyncAnthropic(base_url=f"{flow.router.url}/s/{s.id}", api_key=s.api_key,
                                               max_retries=0).messages.create(model="m", max_tokens=48, messages=msgs)
            return m.content[0].text
        client = session_client(flow, s)
        if api == "openai":
            r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=48, temperature=0)
            return r.choices[0].message.content
        return (await client.responses.create(model="m", input=msgs, max_output_tokens=48, temperature=0)).output_text

    async def body():
        flow = await started_flow([url], tiny_model_dir)
        msgs = [{"role": "user", "content": "write 12+7 and explain"}]
        s1 = open_session(flow, sampling=ROUTER_SAMPLING)
        want = await plain(flow, s1, msgs)
        ids = s1.segments[-1].response_ids
        k = settling_point(flow.chat, ids)
        assert k < len(ids), "the greedy reply settles no text before its last token: pick another prompt"
        s2 = open_session(flow, sampling=ROUTER_SAMPLING)
        # the stream goes over a white-box agent's client (the SDK's aiohttp backend), the plain reply above over
        # the SDK's default transport: the same reply, and deltas that leave mid-generation, on both
        client = (anthropic.AsyncAnthropic(base_url=f"{flow.router.url}/s/{s2.id}", api_key=s2.api_key,
                                           max_retries=0) if api == "anthropic" else flow.session_client(s2))
        seen = {}
        gate = Gate(handle.engine, k)

        def on_first():
            if "held" not in seen:
                # the engine is held before token k+1 and the reply has more: this delta left mid-generation
                seen["held"] = not gate.opened.is_set()
                seen["ttft"] = time.perf_counter() - t0
                gate.open()
        t0 = time.perf_counter()
        try:
            got = await {"openai": openai_stream, "anthropic": anthropic_stream,
                         "responses": responses_stream}[api](client, msgs, on_first)
        finally:
            gate.remove()
        await flow.close()
        return want, got, seen, k, s1, s2
    want, (text, completion_tokens, finish), seen, k, s1, s2 = run(body())
    print(f"{api}: time to first token {seen['ttft'] * 1000:.1f} ms, first delta after {k} of {completion_tokens} "
          f"tokens, finish {finish}")
    assert text == want and seen["held"] and k < completion_tokens
    # the trajectory is the plain one's, token for token
    a, b = s1.segments[-1], s2.segments[-1]
    assert (b.prompt_ids, b.response_ids, b.loss_mask, b.rollout_logprobs, b.weight_versions) == \
        (a.prompt_ids, a.response_ids, a.loss_mask, a.rollout_logprobs, a.weight_versions)
    assert completion_tokens == len(a.response_ids)


def test_streamed_tool_calls_stop_strings_and_malformed_streams(served, tiny_model_dir):
    """Text before a tool call streams, the call goes out whole at the end; a stop string's text is never sent; a
    malformed stream request is a 4xx before any event, on each API."""
    url, _ = served
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call>'

    async def body():
        flow = await started_flow([url], tiny_model_dir)
        crafted_engine(flow.pool, flow.chat, ["ok so " + call, "one two STOP three"])
        s = open_session(flow)
        client = session_client(flow, s)
        msgs = [{"role": "user", "content": "3*4"}]
        stream = await client.chat.completions.create(model="m", messages=msgs, tools=[CALC_TOOL], stream=True)
        deltas, args = [], ""
        async for chunk in stream:
            for c in chunk.choices:
                deltas += [c.delta.content] if c.delta.content else []
                args += "".join(t.function.arguments or "" for t in c.delta.tool_calls or [])
        stream = await client.chat.completions.create(model="m", messages=msgs, stop=["STOP"], stream=True)
        stopped = "".join([c.delta.content or "" async for chunk in stream for c in chunk.choices])

        an = anthropic.AsyncAnthropic(base_url=f"{flow.router.url}/s/{s.id}", api_key=s.api_key, max_retries=0)
        errors = []
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model="m", messages=msgs, stream=True, temperature=5)
        errors.append(e.value.status_code)
        with pytest.raises(anthropic.BadRequestError) as e:
            await an.messages.create(model="m", max_tokens=0, messages=msgs, stream=True)
        errors.append(e.value.status_code)
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.create(model="m", input="x", previous_response_id="resp_nope", stream=True)
        errors.append(e.value.status_code)
        await flow.close()
        return deltas, args, stopped, errors
    deltas, args, stopped, errors = run(body())
    assert len(deltas) > 1 and "".join(deltas) == "ok so"  # token by token, none of the call's text
    assert json.loads(args) == {"expression": "3*4"}
    assert stopped == "one two" and errors == [400, 400, 400]


def test_responses_stream_custom_tool_calls_whole_and_logprobs_at_the_end(served, tiny_model_dir):
    """A custom tool's call streams as the function calls do, whole at the end: output_item.added (input ""), one
    custom_tool_call_input delta with the whole input, its done event, output_item.done; the completed response holds
    the same item, same id. With include message.output_text.logprobs the message's done events carry one logprob per
    output token (known at the end only), as the plain reply's item does."""
    url, _ = served
    call = '<tool_call>\n{"name": "shell", "arguments": {"input": "echo hi > /tmp/x"}}\n</tool_call>'
    shell = {"type": "custom", "name": "shell", "description": "run a shell command"}

    async def body():
        flow = await started_flow([url], tiny_model_dir)
        crafted_engine(flow.pool, flow.chat, ["ok " + call])
        s = open_session(flow)
        stream = await session_client(flow, s).responses.create(
            model="m", input="write hi", tools=[shell], stream=True, include=["message.output_text.logprobs"])
        events = [e async for e in stream]
        plain = await session_client(flow, open_session(flow)).responses.create(
            model="m", input="write hi", tools=[shell], include=["message.output_text.logprobs"])
        await flow.close()
        return events, plain, s
    events, plain, s = run(body())
    kinds = [e.type for e in events]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    i = kinds.index("response.custom_tool_call_input.delta")
    added, delta, done, item_done = events[i - 1], events[i], events[i + 1], events[i + 2]
    assert text == "ok" and kinds.index("response.output_text.done") < i  # the text went out before the call
    assert (added.type, added.item.type, added.item.input) == ("response.output_item.added", "custom_tool_call", "")
    assert delta.delta == done.input == item_done.item.input == "echo hi > /tmp/x"
    assert done.type == "response.custom_tool_call_input.done" and item_done.type == "response.output_item.done"
    final = events[-1].response
    assert events[-1].type == "response.completed" and final.output[-1].id == delta.item_id == added.item.id
    n = len(s.segments[-1].response_ids)
    [text_done] = [e for e in events if e.type == "response.output_text.done"]
    assert len(text_done.logprobs) == n == len(final.output[0].content[0].logprobs)
    assert [lp.logprob for lp in text_done.logprobs] == s.segments[-1].rollout_logprobs == [-0.5] * n
    assert [o.type for o in plain.output] == ["message", "custom_tool_call"]
    assert [lp.logprob for lp in plain.output[0].content[0].logprobs] == [-0.5] * n
