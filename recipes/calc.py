"""Recipe `calc`: a multi-turn calculator tool-use agent for the tiny model, and its reward.

The agent is an ordinary OpenAI-client program: it offers one tool, `calculator(expression)`, calls the
model, runs every tool call it gets back, feeds the results in as tool messages, and stops at the first
reply without a tool call (its final answer). LoongSage hands it an `openai.AsyncOpenAI` bound to a
session of the router, so every token it causes lands in the trajectory (model tokens trainable, tool
results masked out). The reward is 1.0 when the final answer's last number equals the sample's answer.

Run with a recipe YAML that sets `agent: recipes.calc.agent`, `reward: recipes.calc.reward` and a
`synthetic:calc:<n>:<seed>` dataset. Tested by tests/test_agentflow.py (calculator, agent loop).
Left out: parallel tool execution and tools other than arithmetic.
"""
from __future__ import annotations

import ast
import json
import operator

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


async def agent(client, sample: dict, max_turns: int = 8) -> str:
    """Tool loop: model -> tool calls -> tool results -> model ... until a reply without tool calls."""
    messages = list(sample["messages"])
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
            return reply  # a final answer
        for tc in msg.tool_calls:
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": _run_tool(tc.function.name,
                                                                                        tc.function.arguments)})
    return reply


def reward(response: str, sample: dict) -> float:
    """1.0 when the last number of the final answer equals the expected result."""
    return data.last_number_match(response, sample)
