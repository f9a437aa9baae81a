"""Model families end to end: each chat format's parsers, template, end tokens, TITO through the router, the
official clients, thinking models, and a short RL run with a tool-calling agent.

Families (chat.FAMILIES, the tiny tokenizers data.py builds): chatml (the tiny recipes' compact Qwen-style
format), qwen3 (with thinking), llama3, mistral, deepseek_v3. What each test proves:
* parsers: on the text each family's model writes (as SGLang's detectors document it), the calls and content come
  out as SGLang's detect_and_parse gives them; malformed blocks come back as plain content; thinking splits as
  SGLang's qwen3 / deepseek-r1 detectors split it;
* templates: each renders the published layout of its family (the exact text, written out here by hand from the
  sources cited in chat.py), and the parser and reasoning parser are picked from it;
* end tokens: the engine stops at every end token of the generation config (Llama 3's three), and the turn's end
  token is the template's;
* TITO: a multi-turn tool conversation through the router, the model's turns being what the template renders,
  gives a trajectory equal to the template's rendering of the whole conversation token for token, the model's
  tokens (thinking included) in the loss and nothing else; the official OpenAI and Anthropic clients (plain and
  streaming) get the tool calls;
* thinking (qwen3): reasoning_content in Chat Completions (plain and stream), thinking blocks in Messages (the
  request's `thinking` switching the template), reasoning items in Responses; a template that drops past thinking
  starts a new segment, the keep-thinking template keeps one;
* a 3-step RL run per family: the calc agent, warm-started in the family's format, calls the tool on the real
  engine, the tool's result is masked out, and the trainer steps.
The model turns of the router tests are crafted (`crafted_engine`): a random model never writes a well-formed tool
call or thinking block. The RL runs use the real engine and trainer.
"""
import dataclasses
import itertools
import json
import math
from pathlib import Path

import anthropic
import openai
import pytest

import agentflow
import chat
import config
import data
import loongsage
import wire
from recipes.calc import CALCULATOR_TOOL
from test_agentflow import crafted_engine, make_cfg, open_session, run, session_client

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ["chatml", "qwen3", "llama3", "mistral", "deepseek_v3"]
PARSER = {"chatml": "hermes", "qwen3": "hermes", "llama3": "llama3", "mistral": "mistral", "deepseek_v3": "deepseekv3"}
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=128, max_position_embeddings=1024)
DS_SMALL = dict(model_type="deepseek_v3", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=128, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                first_k_dense_replace=1, q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=16, max_position_embeddings=1024)
TOOLS = [CALCULATOR_TOOL]
NOWHERE = ["http://127.0.0.1:9"]  # the router tests' engine answers are crafted: no engine is ever called


def settings(family: str) -> dict:
    return {**(DS_SMALL if family == "deepseek_v3" else SMALL), "chat_format": family}


@pytest.fixture(scope="module")
def models() -> dict:
    """A tiny model per family (the deepseek_v3 family on a DeepSeek-V3 model), cached across runs."""
    return {f: data.build_tiny_model(data.default_cache_dir() / f"tiny-chat-{data.settings_hash(settings(f))}",
                                     **settings(f)) for f in FAMILIES}


# ----------------------------------------------------------------------------------------------
# parsers, on the text each family's model writes


def test_hermes_and_qwen25_parse_qwen_calls():
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>'
    for parse in (chat.parse_hermes, chat.parse_qwen25):
        content, calls = parse("let me compute\n" + call + "\n" + call.replace("1+2", "3*4"), TOOLS)
        assert content == "let me compute"
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
            [("calculator", {"expression": "1+2"}), ("calculator", {"expression": "3*4"})]
        assert all(c["id"].startswith("call_") and len(c["id"]) == 29 for c in calls)
        assert parse("no call here", TOOLS) == ("no call here", [])
    # hermes: whitespace inside the tags is free, and an unclosed last block still counts; qwen25 needs the newlines
    tight = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2\\"}"}</tool_call>'
    assert chat.parse_hermes(tight, TOOLS)[1][0]["function"]["arguments"] == {"expression": "2"}
    assert chat.parse_qwen25(tight, TOOLS) == (tight, [])
    assert len(chat.parse_hermes('<tool_call>{"name": "calculator", "arguments": {}}', TOOLS)[1]) == 1
    # a call of a tool that was not offered is dropped (SGLang); a block that is no call leaves all text as content
    assert chat.parse_hermes('ok <tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', TOOLS) == ("ok", [])
    for bad in ['<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>',  # bad JSON
                '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>',            # args not an object
                '<tool_call>[1, 2]</tool_call>']:                                            # not a call object
        assert chat.parse_hermes(bad, TOOLS) == (bad, [])
    # qwen25 skips a block that is not JSON and keeps the others
    assert len(chat.parse_qwen25(call + "\n<tool_call>\n{oops\n</tool_call>", TOOLS)[1]) == 1


def test_llama3_mistral_deepseekv3_parse_their_calls():
    c, calls = chat.parse_llama3('{"name": "calculator", "parameters": {"expression": "1+2"}}', TOOLS)
    assert (c, calls[0]["function"]) == ("", {"name": "calculator", "arguments": {"expression": "1+2"}})
    c, calls = chat.parse_llama3('sure<|python_tag|>{"name": "calculator", "parameters": {"expression": "1"}}; '
                                 "{'name': 'calculator', 'parameters': {'expression': '2'}} thanks", TOOLS)
    assert c == "surethanks" and [x["function"]["arguments"]["expression"] for x in calls] == ["1", "2"]
    assert chat.parse_llama3("the answer is 3", TOOLS) == ("the answer is 3", [])

    c, calls = chat.parse_mistral('ok [TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "1+2"}, '
                                  '"id": "a1b2c3d4e"}, {"name": "calculator", "arguments": {"expression": "5"}}] bye',
                                  TOOLS)
    assert c == "ok bye" and [x["id"] for x in calls][0] == "a1b2c3d4e"  # the model's own 9-character id is kept
    assert len(calls[1]["id"]) == 9 and calls[1]["id"].isalnum()
    assert calls[1]["function"]["arguments"] == {"expression": "5"}
    c, calls = chat.parse_mistral('[TOOL_CALLS]calculator[ARGS]{"expression": "7"}', TOOLS)  # the compact form
    assert c == "" and calls[0]["function"] == {"name": "calculator", "arguments": {"expression": "7"}}
    assert chat.parse_mistral("[TOOL_CALLS] [{oops}]", TOOLS) == ("", [])

    ds = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calculator\n```json\n"
          '{"expression": "1+2"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>calculator\n'
          '```json\n{"expression": "3"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    c, calls = chat.parse_deepseekv3("let me see" + ds, TOOLS)
    assert c == "let me see"
    assert [x["function"]["arguments"] for x in calls] == [{"expression": "1+2"}, {"expression": "3"}]
    broken = ds.replace("```json", "json", 1)
    assert chat.parse_deepseekv3(broken, TOOLS) == (broken, [])


def test_reasoning_parsers_split_thinking_as_sglang():
    assert chat.parse_reasoning("qwen3", "<think>\nadd\n</think>\n\n19") == ("\nadd\n", "\n\n19")
    assert chat.parse_reasoning("qwen3", "19") == ("", "19")  # no <think>: no thinking (enable_thinking=false)
    assert chat.parse_reasoning("qwen3", "<think>cut short") == ("cut short", "")  # unclosed: all thinking
    assert chat.parse_reasoning("qwen3", "<think>hm<tool_call>x") == ("hm", "<tool_call>x")  # a tool call ends it
    # deepseek-r1: the generation prompt opened <think>, so text before </think> is thinking, with or without a tag
    assert chat.parse_reasoning("deepseek-r1", "add</think>19") == ("add", "19")
    assert chat.parse_reasoning("deepseek-r1", "<think>add</think>19") == ("add", "19")
    assert chat.parse_reasoning("deepseek-r1", "still thinking") == ("still thinking", "")
    with pytest.raises(ValueError, match="reasoning_parser 'qwen4'"):
        chat.parse_reasoning("qwen4", "x")


# ----------------------------------------------------------------------------------------------
# templates: the published layouts, written out by hand


def _conversation(family: str) -> list[dict]:
    cid = "a1b2c3d4e" if family == "mistral" else "call_1"
    msgs = [{"role": "user", "content": "12+7"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": cid, "type": "function", "function": {
                "name": "calculator", "arguments": {"expression": "12+7"}}}]},
            {"role": "tool", "tool_call_id": cid, "content": "19"}, {"role": "assistant", "content": "19"}]
    if family == "qwen3":
        msgs[1]["reasoning_content"], msgs[3]["reasoning_content"] = "add them", "done"
    return msgs


def _published(family: str) -> str:
    """The conversation of _conversation() in the family's published format (sources: chat.py's comments)."""
    tool = json.dumps(CALCULATOR_TOOL)
    args = '{"expression": "12+7"}'
    if family == "qwen3":
        return ("<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n" + tool +
                "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                "<args-json-object>}\n</tool_call><|im_end|>\n<|im_start|>user\n12+7<|im_end|>\n"
                "<|im_start|>assistant\n<think>\nadd them\n</think>\n\n<tool_call>\n{\"name\": \"calculator\", "
                "\"arguments\": " + args + "}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n19\n"
                "</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\ndone\n</think>\n\n19<|im_end|>\n")
    if family == "llama3":
        return ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
                "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
                "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a JSON "
                "for a function call with its proper arguments that best answers the given prompt.\n\nRespond in the "
                'format {"name": function name, "parameters": dictionary of argument name and its value}.Do not use '
                "variables.\n\n" + json.dumps(CALCULATOR_TOOL, indent=4) + "\n\n12+7<|eot_id|>"
                '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "calculator", "parameters": ' + args +
                '}<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n"19"<|eot_id|>'
                "<|start_header_id|>assistant<|end_header_id|>\n\n19<|eot_id|>")
    if family == "mistral":
        fn = CALCULATOR_TOOL["function"]
        return ('<s>[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "calculator", "description": "'
                + fn["description"] + '", "parameters": ' + json.dumps(fn["parameters"]) + '}}][/AVAILABLE_TOOLS]'
                '[INST] 12+7[/INST][TOOL_CALLS] [{"name": "calculator", "arguments": ' + args + ', "id": "a1b2c3d4e"}]'
                '</s>[TOOL_RESULTS] {"content": 19, "call_id": "a1b2c3d4e"}[/TOOL_RESULTS] 19</s>')
    if family == "deepseek_v3":
        return ("<｜begin▁of▁sentence｜>\n\nYou are a helpful assistant with tool calling capabilities. When a tool call "
                "is needed, you MUST use the following format to issue the call:\n<｜tool▁calls▁begin｜>"
                "<｜tool▁call▁begin｜>function<｜tool▁sep｜>FUNCTION_NAME\n```json\n{\"param1\": \"value1\", \"param2\": "
                "\"value2\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>\n\nMake sure the JSON is valid.## Tools\n\n"
                "### Function\n\nYou have the following functions available:\n\n\n```json\n" + tool + "\n```\n"
                "<｜User｜>12+7<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calculator\n"
                "```json\n" + args + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>Use the results "
                "below to formulate an answer to the user question unless additional information is needed."
                "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>19<｜tool▁output▁end｜><｜tool▁outputs▁end｜>19"
                "<｜end▁of▁sentence｜>")
    return ("<|im_start|>system\n# Tools\nCall a tool with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>. "
            "Tools:\n" + tool + "<|im_end|>\n<|im_start|>user\n12+7<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
            "{\"name\": \"calculator\", \"arguments\": " + args + "}\n</tool_call><|im_end|>\n<|im_start|>user\n"
            "<tool_response>\n19\n</tool_response><|im_end|>\n<|im_start|>assistant\n19<|im_end|>\n")


@pytest.mark.parametrize("family", FAMILIES)
def test_template_renders_the_published_format_and_picks_its_parsers(family, models):
    fmt = chat.ChatFormat(models[family])
    assert fmt.render(_conversation(family), TOOLS) == _published(family)
    assert fmt.tool_parser == PARSER[family]
    assert fmt.reasoning_parser == ("qwen3" if family == "qwen3" else "")
    for t in chat.FAMILIES[family]["special"]:  # each special token is one token
        assert len(fmt.encode(t)) == 1, t


def test_thinking_template_switch_and_pickers():
    assert chat.pick_tool_parser(chat.QWEN3_TEMPLATE + chat.MISTRAL_TEMPLATE) == ""  # two formats: no guess
    assert chat.pick_reasoning_parser("", "<｜Assistant｜><think>\n") == "deepseek-r1"
    assert chat.pick_reasoning_parser(chat.CHATML_TEMPLATE, "<|im_start|>assistant\n") == ""


@pytest.mark.parametrize("family", FAMILIES)
def test_end_tokens_come_from_the_generation_config(family, models):
    fmt = chat.ChatFormat(models[family])
    stops = {fmt.tok.convert_ids_to_tokens(i) for i in fmt.stop_ids}
    assert stops == set(chat.FAMILIES[family]["stop"])  # Llama 3: <|end_of_text|>, <|eom_id|> and <|eot_id|>
    assert fmt.eos_text == chat.FAMILIES[family]["eos"] and fmt.eos_id in fmt.stop_ids
    assert data.turn_end(fmt.tok) == fmt.eos_text
    cfg = json.loads((Path(models[family]) / "generation_config.json").read_text())
    assert sorted(cfg["eos_token_id"]) == fmt.stop_ids  # what the CPU engine (and SGLang) stop at


# ----------------------------------------------------------------------------------------------
# TITO through the router, and the official clients


def _turn_texts(fmt: chat.ChatFormat, msgs: list[dict], replies: list[dict]) -> list[str]:
    """What the model writes for each reply (the template's rendering after the generation prompt), end token off."""
    texts, history = [], list(msgs)
    for reply, nxt in replies:
        _, text = chat.reply_text(lambda m, g: fmt.render(m, TOOLS, add_generation_prompt=g), history, reply,
                                  fmt.eos_text)
        texts.append(text[:-len(fmt.eos_text)])
        history += [reply] + nxt
    return texts


@pytest.mark.parametrize("family", FAMILIES)
def test_tito_tool_conversation_is_the_templates_rendering_token_for_token(family, models):
    """The calc conversation through the router with the official OpenAI client (the model's turns crafted as the
    template renders them): the trajectory is the template's rendering of the whole conversation, token for
    token, one segment; the loss mask covers exactly the model's tokens, thinking included."""
    fmt = chat.ChatFormat(models[family])
    conv = _conversation(family)
    replies = _turn_texts(fmt, conv[:1], [(conv[1], conv[2:3]), (conv[3], [])])

    async def body():
        flow = agentflow.AgentFlow(make_cfg(), NOWHERE, models[family])
        await flow.start_router()
        crafted_engine(flow.pool, flow.chat, replies)
        s = open_session(flow)
        client = session_client(flow, s)
        msgs = [dict(conv[0])]
        r = await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
        [call] = r.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("calculator", {"expression": "12+7"})
        assert r.choices[0].finish_reason == "tool_calls"
        echo = {"id": call.id, "type": "function", "function": {"name": "calculator",
                                                                 "arguments": call.function.arguments}}
        msgs += [{"role": "assistant", "content": r.choices[0].message.content, "tool_calls": [echo]},
                 {"role": "tool", "tool_call_id": call.id, "content": "19"}]
        r = await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
        assert r.choices[0].message.content == "19" and r.choices[0].finish_reason == "stop"
        await flow.router.close_session(s)
        await flow.close()
        return s.trajectory(1.0), call.id
    traj, call_id = run(body())
    final = [dict(m) for m in conv]
    for m in final:  # the ids the router handed out (Mistral's template renders them)
        for c in m.get("tool_calls") or ():
            c["id"] = call_id
        if m["role"] == "tool":
            m["tool_call_id"] = call_id
    text = fmt.render(final, TOOLS)
    text = text[:text.rindex(fmt.eos_text) + len(fmt.eos_text)]  # through the model's last token
    assert traj.prompt_ids + traj.response_ids == fmt.encode(text)
    assert len(traj.segments) == 1
    model_ids = [fmt.encode(t) + [fmt.eos_id] for t in replies]
    n1, n2 = len(model_ids[0]), len(model_ids[1])
    glue = len(traj.response_ids) - n1 - n2
    assert traj.loss_mask == [1] * n1 + [0] * glue + [1] * n2
    assert traj.response_ids[:n1] == model_ids[0] and traj.response_ids[-n2:] == model_ids[1]


LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "look a word up", "parameters": {
    "type": "object", "properties": {"word": {"type": "string", "enum": ["cat", "dog"]}}, "required": ["word"],
    "additionalProperties": False}}}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_forced_tool_choice_holds_the_reply_to_the_templates_call_syntax(family, models):
    """tool_choice "required" / named: the structural tag the router sends the engine (ChatFormat.tool_grammar),
    compiled by xgrammar as both engines compile it, takes exactly the template's own rendering of calls of the
    allowed tools, token for token up to the turn's end token (two calls where the template writes several and
    parallel calls are on; Mistral's ids any 9 characters), and refuses text, a tool not allowed, a second call when
    parallel calls are off, and arguments off a strict tool's schema. tool_choice "auto" with a strict tool, in the
    templates that mark each call (Hermes / Qwen): text, and text then calls, pass; a strict call off its schema
    does not; elsewhere no grammar is sent."""
    import xgrammar
    fmt = chat.ChatFormat(models[family])
    kwargs = {fmt.thinking_switch: False} if fmt.thinking_switch else {}
    tools = [*TOOLS, LOOKUP]
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(
        fmt.tok, vocab_size=fmt.vocab_size, stop_token_ids=fmt.stop_ids))

    def takes(forced, calls, parallel=True, content="") -> bool:
        req = wire.ChatRequest([], tools, True, None, {}, None, False, template_kwargs=kwargs, forced=forced,
                               parallel_calls=parallel, strict=frozenset({"lookup"}))
        tag = fmt.tool_grammar(req, kwargs)["structural_tag"]
        if isinstance(calls, str):  # a plain-text reply
            text = calls
        else:
            reply = {"role": "assistant", "content": content, "tool_calls": [
                {"id": f"Call{i}abcd", "type": "function", "function": {"name": n, "arguments": a}}
                for i, (n, a) in enumerate(calls)]}
            _, text = chat.reply_text(lambda m, g: fmt.render(m, tools, add_generation_prompt=g, kwargs=kwargs),
                                      [{"role": "user", "content": "12+7"}], reply, fmt.eos_text)
            text = text[:-len(fmt.eos_text)]
        matcher = xgrammar.GrammarMatcher(compiler.compile_structural_tag(tag))
        return all(matcher.accept_token(t) for t in fmt.encode(text) + [fmt.eos_id]) and matcher.is_terminated()

    calc, cat, emu = ("calculator", {"expression": "12+7"}), ("lookup", {"word": "cat"}), ("lookup", {"word": "emu"})
    everything = ("calculator", "lookup")
    assert takes(everything, [calc]) and takes(everything, [cat]) and takes(("calculator",), [calc])
    assert not takes(everything, "The answer is 19.") and not takes(("lookup",), [calc])
    assert not takes(("lookup",), [emu])  # lookup is strict: its word is one of the enum
    assert takes(("calculator",), [("calculator", {"anything": [1, 2]})])  # not strict: any JSON object
    if fmt.call_syntax(tools, kwargs)[3] is None:  # Llama 3's template writes one call per turn
        assert family == "llama3"
    else:
        assert takes(everything, [calc, cat]) and takes(("lookup",), [cat, cat])
        assert not takes(everything, [calc, cat], parallel=False)
    auto = wire.ChatRequest([], tools, True, None, {}, None, False, strict=frozenset({"lookup"}))
    if PARSER[family] == "hermes":
        assert takes((), "The answer is 19.") and takes((), [cat], content="Let me look.")
        assert takes((), [calc, cat]) and takes((), [("calculator", {"anything": [1]})])
        assert not takes((), [emu]) and not takes((), [cat, cat], parallel=False)
    else:
        assert fmt.tool_grammar(auto, kwargs) == {}
    assert fmt.tool_grammar(dataclasses.replace(auto, strict=frozenset()), kwargs) == {}  # nothing strict: free
    if fmt.thinking_switch:  # a thinking model that thinks would be made to skip it: refused, saying how to turn it off
        req = wire.ChatRequest([], tools, True, None, {}, None, False, forced=everything)
        with pytest.raises(wire.ApiError, match="needs thinking off.*enable_thinking"):
            fmt.tool_grammar(req, {})


@pytest.mark.parametrize("family", FAMILIES)
def test_official_clients_get_each_familys_tool_calls(family, models):
    """OpenAI (plain, streaming) and Anthropic (plain, streaming) clients get the call the model wrote in its
    family's syntax, with the id the template shows (Mistral: the model's 9 characters)."""
    fmt = chat.ChatFormat(models[family])
    conv = _conversation(family)
    [reply] = _turn_texts(fmt, conv[:1], [(conv[1], [])])

    async def body():
        flow = agentflow.AgentFlow(make_cfg(), NOWHERE, models[family])
        await flow.start_router()
        crafted_engine(flow.pool, flow.chat, [reply])
        s = open_session(flow)
        client = session_client(flow, s)
        msgs = conv[:1]
        r = await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
        [tc] = r.choices[0].message.tool_calls
        assert (tc.function.name, json.loads(tc.function.arguments)) == ("calculator", {"expression": "12+7"})
        if family == "mistral":
            assert tc.id == "a1b2c3d4e"
        stream = await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, stream=True)
        args, names = "", []
        async for chunk in stream:
            for t in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                names += [t.function.name] if t.function.name else []
                args += t.function.arguments or ""
        assert names == ["calculator"] and json.loads(args) == {"expression": "12+7"}
        an = anthropic.AsyncAnthropic(base_url=f"{flow.router.url}/s/{s.id}", api_key=s.api_key, max_retries=0)
        tool = {"name": "calculator", "input_schema": CALCULATOR_TOOL["function"]["parameters"]}
        m = await an.messages.create(model="m", max_tokens=64, messages=msgs, tools=[tool])
        uses = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use"
        assert [(u.name, u.input) for u in uses] == [("calculator", {"expression": "12+7"})]
        async with an.messages.stream(model="m", max_tokens=64, messages=msgs, tools=[tool]) as st:
            final = await st.get_final_message()
        assert [b.input for b in final.content if b.type == "tool_use"] == [{"expression": "12+7"}]
        # the tool_use id comes back in tool_result unchanged, so the template renders the same id
        m2 = await an.messages.create(model="m", max_tokens=64, tools=[tool], messages=[
            *msgs, {"role": "assistant", "content": [u.model_dump() for u in uses]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "19"}]}])
        await flow.close()
        return m2
    m2 = run(body())
    assert m2.type == "message"


# ----------------------------------------------------------------------------------------------
# thinking models (the qwen3 family)


THOUGHT = "<think>\n12 plus 7\n</think>\n\n19"


def test_reasoning_content_in_chat_completions_plain_and_stream(models):
    async def body():
        flow = agentflow.AgentFlow(make_cfg(), NOWHERE, models["qwen3"])
        await flow.start_router()
        seen = crafted_engine(flow.pool, flow.chat, [THOUGHT])
        s = open_session(flow)
        client = session_client(flow, s)
        msgs = [{"role": "user", "content": "12+7"}]
        r = await client.chat.completions.create(model="m", messages=msgs)
        stream = await client.chat.completions.create(model="m", messages=msgs, stream=True,
                                                      stream_options={"include_usage": True})
        parts, usage = [], None
        async for chunk in stream:
            for c in chunk.choices:
                parts.append(("reasoning", c.delta.reasoning_content) if getattr(c.delta, "reasoning_content", None)
                             else ("content", c.delta.content))
            usage = chunk.usage or usage
        off = await client.chat.completions.create(model="m", messages=msgs, extra_body={
            "separate_reasoning": False, "chat_template_kwargs": {"enable_thinking": False}})
        await flow.close()
        return r, parts, usage, off, seen, flow.chat
    r, parts, usage, off, seen, fmt = run(body())
    msg = r.choices[0].message
    assert (msg.reasoning_content, msg.content) == ("12 plus 7", "19")
    n_think = len(fmt.encode("<think>\n12 plus 7\n</think>"))
    assert r.usage.completion_tokens_details.reasoning_tokens == n_think
    joined = [(kind, "".join(p[1] for p in group)) for kind, group in itertools.groupby(
        [p for p in parts if p[1]], key=lambda p: p[0])]
    assert joined == [("reasoning", "12 plus 7"), ("content", "19")]  # thinking streams first, token by token
    assert usage.completion_tokens_details.reasoning_tokens == n_think
    assert off.choices[0].message.content == THOUGHT  # not separated: all of it is content
    # enable_thinking=false reaches the template: the generation prompt closes an empty thinking block
    assert fmt.decode(seen[2], skip_special_tokens=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert fmt.decode(seen[0], skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_thinking_blocks_in_messages_and_reasoning_items_in_responses(models):
    async def body():
        flow = agentflow.AgentFlow(make_cfg(), NOWHERE, models["qwen3"])
        await flow.start_router()
        seen = crafted_engine(flow.pool, flow.chat, [THOUGHT])
        s = open_session(flow)
        an = anthropic.AsyncAnthropic(base_url=f"{flow.router.url}/s/{s.id}", api_key=s.api_key, max_retries=0)
        msgs = [{"role": "user", "content": "12+7"}]
        m = await an.messages.create(model="m", max_tokens=64, messages=msgs,
                                     thinking={"type": "enabled", "budget_tokens": 1024})
        async with an.messages.stream(model="m", max_tokens=64, messages=msgs) as st:
            final = await st.get_final_message()
        await an.messages.create(model="m", max_tokens=64, messages=msgs, thinking={"type": "disabled"})
        with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
            await an.messages.create(model="m", max_tokens=64, messages=msgs,
                                     thinking={"type": "enabled", "budget_tokens": 10})
        # a history with the thinking block sent back: the template shows it (the turn is after the last query)
        await an.messages.create(model="m", max_tokens=64, messages=[
            *msgs, {"role": "assistant", "content": [{"type": "thinking", "thinking": "12 plus 7", "signature": ""},
                                                     {"type": "text", "text": "19"}]},
            {"role": "user", "content": "sure?"}])
        client = session_client(flow, s)
        resp = await client.responses.create(model="m", input="12+7")
        events = [e async for e in await client.responses.create(model="m", input="12+7", stream=True)]
        await client.responses.create(model="m", input=[
            {"role": "user", "content": "12+7"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "r1"}]},
            {"role": "assistant", "content": "19"}, {"role": "user", "content": "ok"}])
        await flow.close()
        return m, final, resp, events, seen, flow.chat
    m, final, resp, events, seen, fmt = run(body())
    for msg in (m, final):
        assert [b.type for b in msg.content] == ["thinking", "text"]
        assert (msg.content[0].thinking, msg.content[1].text) == ("12 plus 7", "19")
    assert fmt.decode(seen[2], skip_special_tokens=False).endswith("assistant\n<think>\n\n</think>\n\n")  # disabled
    history = fmt.decode(seen[3], skip_special_tokens=False)  # the refused budget never reached the engine
    assert "<|im_start|>assistant\n19<|im_end|>" in history  # before the last query: Qwen3 drops that thinking
    assert [o.type for o in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == "12 plus 7" and resp.output_text == "19"
    assert resp.usage.output_tokens_details.reasoning_tokens == len(fmt.encode("<think>\n12 plus 7\n</think>"))
    kinds = [e.type for e in events]
    assert "response.reasoning_text.delta" in kinds and kinds.index("response.reasoning_text.done") < \
        kinds.index("response.output_text.delta")
    assert events[-1].response.output[0].type == "reasoning"
    assert "<think>\nr1\n</think>" not in fmt.decode(seen[-1], skip_special_tokens=False)  # before the last query
    assert len(seen) == 7
    # the thinking sent back becomes the turn's reasoning_content, whichever API carried it
    assert wire.responses_messages(None, [
        {"role": "user", "content": "q"}, {"type": "reasoning", "summary": [], "content": [
            {"type": "reasoning_text", "text": "r1"}]},
        {"type": "function_call", "call_id": "c1", "name": "calculator", "arguments": "{}"}], None)[1] == \
        {"role": "assistant", "content": "", "reasoning_content": "r1", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": {}}}]}
    assert wire.anthropic_messages(None, [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "r2", "signature": ""}, {"type": "text", "text": "a"}]},
        {"role": "user", "content": "more"}])[1] == {"role": "assistant", "content": "a", "reasoning_content": "r2"}
    echoed = wire.openai_messages([{"role": "user", "content": "q"},
                                   {"role": "assistant", "content": "a", "reasoning_content": "r3"}])
    assert echoed[1]["reasoning_content"] == "r3"


def test_thinking_requests_refused_where_the_model_cannot(models):
    """Thinking asked of a model without a reasoning parser is refused, not ignored (SGLang's rule); adaptive thinking
    (the model's own choice, as Claude Code asks of any model) is a reply without thinking there."""
    async def body():
        flow = agentflow.AgentFlow(make_cfg(), NOWHERE, models["chatml"])
        await flow.start_router()
        crafted_engine(flow.pool, flow.chat, ["19"])
        s = open_session(flow)
        an = anthropic.AsyncAnthropic(base_url=f"{flow.router.url}/s/{s.id}", api_key=s.api_key, max_retries=0)
        msgs = [{"role": "user", "content": "12+7"}]
        with pytest.raises(anthropic.BadRequestError, match="no reasoning parser"):
            await an.messages.create(model="m", max_tokens=8, messages=msgs, thinking={"type": "enabled",
                                                                                        "budget_tokens": 1024})
        await an.messages.create(model="m", max_tokens=8, messages=msgs, thinking={"type": "adaptive"})
        ok = await an.messages.create(model="m", max_tokens=8, messages=msgs, thinking={"type": "disabled"})
        with pytest.raises(openai.BadRequestError, match="chat_template_kwargs may not set"):
            await session_client(flow, s).chat.completions.create(
                model="m", messages=msgs, extra_body={"chat_template_kwargs": {"tokenize": True}})
        await flow.close()
        return ok
    assert [b.type for b in run(body()).content] == ["text"]


@pytest.mark.parametrize("keep", [False, True])
def test_dropped_thinking_starts_a_new_segment_kept_thinking_one(models, keep):
    """Qwen3's template drops a turn's thinking once a new user query follows: the rendered prompt no longer
    extends the history, so a new segment starts, and the first keeps the thinking tokens as sampled, in the loss.
    With the keep-thinking template the chat only grows: one segment, the thinking in the second prompt."""
    async def body():
        cfg = make_cfg(chat_template="chat.QWEN3_KEEP_THINKING_TEMPLATE" if keep else "")
        flow = agentflow.AgentFlow(cfg, NOWHERE, models["qwen3"])
        await flow.start_router()
        seen = crafted_engine(flow.pool, flow.chat, [THOUGHT, "<think>\nyes\n</think>\n\nyes"])
        s = open_session(flow)
        client = session_client(flow, s)
        msgs = [{"role": "user", "content": "12+7"}]
        r = await client.chat.completions.create(model="m", messages=msgs)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content},  # its thinking not echoed back
                 {"role": "user", "content": "sure?"}]
        await client.chat.completions.create(model="m", messages=msgs)
        await flow.router.close_session(s)
        await flow.close()
        return s.trajectory(1.0), seen, flow.chat
    traj, seen, fmt = run(body())
    first = fmt.encode(THOUGHT) + [fmt.eos_id]
    second_prompt = fmt.decode(seen[1], skip_special_tokens=False)
    if keep:
        assert len(traj.segments) == 1 and seen[1][:len(seen[0]) + len(first)] == seen[0] + first
        assert "<|im_start|>assistant\n<think>\n12 plus 7\n</think>\n\n19<|im_end|>" in second_prompt
    else:
        assert len(traj.segments) == 2
        seg = traj.segments[0]
        assert seg["prompt_ids"] == seen[0] and seg["response_ids"] == first and seg["loss_mask"] == [1] * len(first)
        assert "<|im_start|>assistant\n19<|im_end|>" in second_prompt and traj.prompt_ids == seen[1]


def test_template_that_never_shows_thinking_starts_a_new_segment(models):
    """A template that does not render a turn's thinking at all (here the compact ChatML one, with the qwen3
    reasoning parser): the prompt of the next turn would not hold the thinking the model sampled, so the next turn
    starts a new segment even though the rendered text extends."""
    async def body():
        flow = agentflow.AgentFlow(make_cfg(reasoning_parser="qwen3"), NOWHERE, models["chatml"])
        await flow.start_router()
        seen = crafted_engine(flow.pool, flow.chat, [THOUGHT, "ok"])
        s = open_session(flow)
        client = session_client(flow, s)
        msgs = [{"role": "user", "content": "12+7"}]
        r = await client.chat.completions.create(model="m", messages=msgs)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "sure?"}]
        await client.chat.completions.create(model="m", messages=msgs)
        await flow.router.close_session(s)
        await flow.close()
        return s.trajectory(1.0), r
    traj, r = run(body())
    assert r.choices[0].message.reasoning_content == "12 plus 7" and len(traj.segments) == 2


# ----------------------------------------------------------------------------------------------
# a 3-step RL run per family with the tool-calling calc agent


@pytest.mark.slow
@pytest.mark.timeout(1800)  # each builds its model, warm-starts it and trains: ~1-2 min on a quiet machine
@pytest.mark.parametrize("family", FAMILIES)
def test_three_rl_steps_with_a_tool_calling_agent(family, tmp_path, monkeypatch, ray_session):
    """The calc recipe in the family's format, shrunk: warm-started on the family's transcripts, the agent's first
    turns call the calculator on the real engine (parsed by the family's parser), the tool's result comes back
    through the template with loss_mask 0, and three RL steps train."""
    monkeypatch.setenv("LOONGSAGE_CACHE", str(tmp_path / "cache"))
    dump = tmp_path / "dump"
    # The warm start is ~90% of the test's time. It must teach the protocol's fixed tokens (not the copying of
    # digits), which takes optimizer steps more than samples: with 80 steps of 16 the loss reached its plateau by
    # step 45-60 in every family; 60 steps of 8 follow the same loss per step, and the trajectories that called the
    # tool went from 22/20/23/21/19 of 24 to 22/12/22/20/19 (chatml/qwen3/llama3/mistral/deepseek_v3).
    cfg = config.load_config(str(ROOT / "recipes/calc_cpu.yaml"), [
        f"output_dir={tmp_path}/run", f"tiny_model={json.dumps(settings(family))}", "warmstart_steps=60",
        "warmstart_stop_loss=0", "warmstart_batch_size=8", "warmstart_lr=5e-3", "warmstart_label_noise=0.0",
        "num_steps=3", "eval_every=0", "prompts_per_step=4", "samples_per_prompt=2", "global_batch_size=8",
        "micro_batch_size=8", "max_context_len=640", "max_prompt_len=512", "print_every=0",
        f"dump_rollouts={dump}"])
    history = loongsage.train(cfg)  # on the session's Ray (ray_session)
    steps = [h for h in history if "train/loss" in h]
    assert len(steps) == 3 and all(math.isfinite(h["train/loss"]) for h in steps)
    trajs = [json.loads(line) for f in sorted(dump.glob("step_*.jsonl")) for line in f.read_text().splitlines()]
    for h, f in zip(steps, sorted(dump.glob("step_*.jsonl"))):  # a group whose rewards differ moves the policy
        groups = {}
        for t in map(json.loads, f.read_text().splitlines()):
            groups.setdefault(t["group_id"], set()).add(t["reward"])
        assert (h["train/grad_norm"] > 0) == any(len(r) > 1 for r in groups.values()), (h, groups)
    tok = data.load_tokenizer(str(Path(cfg.output_dir) / "final_hf"))
    called = [t for t in trajs if t["metadata"]["turns"] >= 2]
    print(f"{family}: {len(called)} of {len(trajs)} trajectories called the calculator")
    assert called, [t["response_text"] for t in trajs]
    for t in called:  # the calculator's answer came back in the family's tool-result syntax, masked out
        masked = tok.decode([i for i, m in zip(t["response_ids"], t["loss_mask"]) if not m], skip_special_tokens=False)
        # the calculator answers a number, or "error: ..." for an expression it cannot read
        assert (any(ch.isdigit() for ch in masked) or "error:" in masked) and 1 in t["loss_mask"], masked
