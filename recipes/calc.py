"""Recipe `calc`: a multi-turn calculator tool-use agent for the tiny model, and its reward.

The agent is an ordinary OpenAI-client program: it offers one tool, `calculator(expression)`, calls the
model, runs every tool call it gets back, feeds the results in as tool messages, and stops at the first
reply without a tool call (its final answer). LoongSage hands it an `openai.AsyncOpenAI` bound to a
session of the router, so every token it causes lands in the trajectory (model tokens trainable, tool
results masked out). The reward is 1.0 when the final answer's last number equals the sample's answer.

Run with a recipe YAML that sets `agent: recipes.calc.agent`, `reward: recipes.calc.reward` and a
`synthetic:calc:<n>:<seed>` dataset. A random tiny model never writes a tool call, so warm-start it on
`sft_trajectory` (the ideal episode in trajectory form, same tokens and masks the router records), half of the
episodes without the tool list (`warm_start`, the recipe's warm start).
A slow tool, as real ones are (a test run, a sandbox, a web call): a sample with `tool_latency` ({"median": s,
"sigma": log-space spread, "seed": n}) makes each calculator call wait a seeded lognormal draw first
(`tool_seconds`), and the agent then returns {"answer", "tool_s"}; `bench.py agentic` trains with it.
Tested by tests/test_agentflow.py (calculator, agent loop, SFT transcript == router trajectory, warm_start),
tests/test_bench.py (the latency's distribution; the agentic bench's smoke run).
Left out: parallel tool execution and tools other than arithmetic.
"""
from __future__ import annotations

import ast
import asyncio
import json
import math
import operator
import random

import data

CALCULATOR_TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """Evaluate + - * / // % ** and parentheses on numbers. Never `eval`: the model writes the input.

    Returns the result as text, or "error: ..." (which the model then sees as the tool result).
    """
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:  # 9**9**9 would hang the rollout
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported syntax {type(node).__name__}")

    try:
        value = ev(ast.parse(str(expression), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError) as e:
        return f"error: {e}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _run_tool(name: str, arguments: str) -> str:
    if name != "calculator":
        return f"error: unknown tool {name!r}; the only tool is calculator"
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError as e:
        return f"error: arguments are not JSON ({e})"
    if not isinstance(args, dict) or "expression" not in args:
        return "error: calculator needs {\"expression\": \"...\"}"
    return calculator(args["expression"])


_draws: dict[str, int] = {}  # tool calls made so far per (seed, question) in this process: the next call's draw


def tool_seconds(latency: dict, key: str, draw: int) -> float:
    """Seconds the `draw`-th tool call on question `key` takes: median * exp(sigma * z), z ~ N(0, 1), so quantile q
    is median * exp(sigma * z_q) (p99 = median * exp(2.326 * sigma)). Each draw has its own seeded RNG: a run's
    delays depend on the seed and the questions asked, never on the order concurrent trajectories reach the tool,
    so sync and async runs of the same questions wait the same."""
    rng = random.Random(f"{latency.get('seed', 0)}/{key}/{draw}")
    return float(latency["median"]) * math.exp(float(latency["sigma"]) * rng.gauss(0.0, 1.0))


async def agent(client, sample: dict, max_turns: int = 8) -> str | dict:
    """Tool loop: model -> tool calls -> tool results -> model ... until a reply without tool calls. Returns the
    final reply, or with `tool_latency` {"answer": it, "tool_s": seconds waited on the tool}."""
    messages, latency, waited = list(sample["messages"]), sample.get("tool_latency"), 0.0
    reply = ""
    for _ in range(max_turns):
        r = await client.chat.completions.create(model="loongsage", messages=messages, tools=[CALCULATOR_TOOL])
        msg = r.choices[0].message
        reply = msg.content or ""
        # Echo the assistant turn exactly as received, so the router sees the history extend (token reuse).
        turn = {"role": "assistant", "content": msg.content}
        if msg.tool_calls:
            turn["tool_calls"] = [{"id": tc.id, "type": "function",
                                   "function": {"name": tc.function.name, "arguments": tc.function.arguments}}
                                  for tc in msg.tool_calls]
        messages.append(turn)
        if not msg.tool_calls:
            break  # a final answer
        for tc in msg.tool_calls:
            if latency:
                key = f"{latency.get('seed', 0)}/{json.dumps(sample['messages'])}"
                _draws[key] = _draws.get(key, 0) + 1
                waited += (seconds := tool_seconds(latency, key, _draws[key]))
                await asyncio.sleep(seconds)
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": _run_tool(tc.function.name,
                                                                                        tc.function.arguments)})
    return {"answer": reply, "tool_s": waited} if latency else reply


def sft_trajectory(tok, sample: dict, rng=None, label_noise: float = 0.0, tools: bool = True) -> dict:
    """A supervised transcript of the ideal episode, in trajectory form, to warm-start the tiny model:
    call the calculator on the question, read the result, answer with it.

    Token for token what the router records for the same episode (tests/test_agentflow.py checks it), in the
    tokenizer's chat format: the prompt is the chat with the tool list; the model's turns (tool call, final
    answer, each through the template's end-of-turn token) have loss_mask 1; the template
    glue and the tool result have 0. With probability `label_noise` the final answer is off by one, so RL has
    something left to fix. `tools=False` leaves the tool list (the system turn) out of the prompt (warm_start).
    """
    expr = sample["messages"][-1]["content"]
    answer = calculator(expr)
    if label_noise and rng is not None and rng.random() < label_noise and answer.lstrip("-").isdigit():
        answer = str(int(answer) + rng.choice((-1, 1)))
    # 9 alphanumeric characters: Mistral's templates render call ids and take only that shape (the others ignore ids)
    call = {"id": "call00000", "type": "function",
            "function": {"name": "calculator", "arguments": {"expression": expr}}}

    def render(messages, gen=False):
        return tok.apply_chat_template(messages, tools=[CALCULATOR_TOOL] if tools else None, tokenize=False,
                                       add_generation_prompt=gen)

    def enc(text):
        return tok.encode(text, add_special_tokens=False)

    eos = data.turn_end(tok)
    # A template that renders thinking (Qwen3's) shows an earlier turn's thinking only if it has some, so the call
    # turn thinks (the expression): the rendered chat then grows turn by turn, as the router's trajectory does.
    probe = tok.apply_chat_template([{"role": "user", "content": "x"},
                                     {"role": "assistant", "content": "y", "reasoning_content": "\x00R\x00"}],
                                    tokenize=False)
    if "\x00R\x00" in probe:
        call_turn = {"role": "assistant", "content": "", "reasoning_content": expr, "tool_calls": [call]}
    else:
        call_turn = {"role": "assistant", "content": "", "tool_calls": [call]}
    history = list(sample["messages"])
    prev = render(history, gen=True)
    prompt_ids, response_ids, loss_mask = enc(prev), [], []
    for reply in (call_turn, {"role": "assistant", "content": answer}):
        history.append(reply)
        full = render(history)
        model_text = full[len(prev):full.rindex(eos) + len(eos)]  # what the model writes, its end token included
        ids = enc(model_text)
        response_ids += ids
        loss_mask += [1] * len(ids)
        if "tool_calls" not in reply:
            break
        history.append({"role": "tool", "tool_call_id": call["id"], "content": calculator(expr)})
        nxt = render(history, gen=True)
        if not nxt.startswith(prev + model_text):
            raise ValueError("the chat template renders the call turn differently once the tool result follows; "
                             "the calc transcript needs a template whose chat grows turn by turn")
        glue = enc(nxt[len(prev) + len(model_text):])  # turn end, the tool result, the next assistant header
        response_ids += glue
        loss_mask += [0] * len(glue)
        prev = nxt
    return {"prompt_ids": prompt_ids, "response_ids": response_ids, "loss_mask": loss_mask,
            "rollout_logprobs": [0.0] * len(response_ids), "weight_versions": [-1] * len(response_ids),
            "reward": 0.0, "status": "ok", "group_id": 0, "sample_index": 0}


def warm_start(tok, sample: dict, rng=None, label_noise: float = 0.0) -> dict:
    """calc's warm-start examples: `sft_trajectory`, half of them (drawn from `rng`) without the tool list. The
    copy of the question's digits into the call sits at the same distance either way, but without the ~130 tokens of
    tool list attention has ~25 tokens to search instead of ~160, and the copy is learned in fewer steps (seeds
    1-3: the question's digits learned by SFT step ~130-331 instead of 407-690; docs/RECIPES.md)."""
    short = rng is not None and rng.random() < 0.5
    return sft_trajectory(tok, sample, rng, label_noise, tools=not short)


def reward(response: str, sample: dict) -> float:
    """1.0 when the last number of the final answer equals the expected result."""
    return data.last_number_match(response, sample)
