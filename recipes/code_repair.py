"""Recipe `code_repair`: an agent that fixes buggy Python by running the tests in a sandbox.

Each sample holds the buggy module (`code`), its tests (`tests`, Python that imports from `solution`
and exits non-zero on failure) and a user message asking for a fix. The agent offers the model one
tool, `run_tests(code)`, which runs the candidate against the tests in a sandbox (Docker where an
engine answers, else a local process group with CPU/memory/file limits) and returns the result.
The model may call it as often as it likes within `max_turns`; its last ```python block is the
answer, scored by `agentflow.code_tests` in a fresh sandbox. Tool output is in the trajectory with
loss_mask 0, like every tool result.

jsonl rows: {"messages": [{"role": "user", "content": "..."}], "code": "...", "tests": "...", "timeout": 10}
Used by recipes/code_repair_gpu.yaml. Left out: multi-file repositories and patch (diff) answers.
"""
from __future__ import annotations

import json
import re

import sandbox

RUN_TESTS_TOOL = {"type": "function", "function": {
    "name": "run_tests", "description": "Run the task's tests against a candidate solution.py; returns the output",
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "the whole module"}},
                   "required": ["code"]}}}
_BLOCK = re.compile(r"```(?:python)?\n(.*?)```", re.S)


async def run_tests(code: str, sample: dict) -> str:
    """The tool: write `code` as solution.py next to the tests, run them, report pass/fail and output."""
    box = await sandbox.make_sandbox("auto", cpu_s=int(sample.get("timeout", 10)) + 1, network=False).create()
    try:
        box.write("solution.py", code)
        test = box.write("test_solution.py", "from solution import *\n" + str(sample["tests"]))
        r = await box.execute(f"python {test}", timeout_s=float(sample.get("timeout", 10)))
        verdict = "PASSED" if r.exit_code == 0 and not r.timed_out else f"FAILED (exit {r.exit_code})"
        return f"{verdict}\n{(r.stdout + r.stderr)[-2000:]}"
    finally:
        await box.delete()


async def agent(client, sample: dict, max_turns: int = 6) -> str:
    """Ask for a fix, run every `run_tests` call the model makes, stop at a reply without tool calls
    (or when the tests pass); return the last code block seen."""
    messages = [{"role": "system", "content": "Fix the bug. Use run_tests to check a candidate. "
                                              "End with the full fixed module in a ```python block."},
                *sample["messages"]]
    answer = sample.get("code", "")
    for _ in range(max_turns):
        reply = (await client.chat.completions.create(model="policy", messages=messages,
                                                      tools=[RUN_TESTS_TOOL])).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        blocks = _BLOCK.findall(reply.content or "")
        answer = blocks[-1] if blocks else answer
        if not reply.tool_calls:
            break
        passed = False
        for call in reply.tool_calls:
            try:
                code = json.loads(call.function.arguments or "{}").get("code", "")
            except json.JSONDecodeError:
                code = ""
            result = await run_tests(code, sample) if code else "error: run_tests needs {\"code\": \"...\"}"
            passed |= result.startswith("PASSED")
            answer = code or answer
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        if passed:
            break
    return f"```python\n{answer}```"
