"""Recipe `retry`: an arithmetic agent that checks each answer with a slow tool and tries again when it fails.

The shape of most agentic RL (write code, run the tests, read the failure, fix it): the agent asks the model the
question, submits the answer to a checker tool, and, when the checker rejects it, asks again (the model sees its
earlier answer in the chat) until the checker accepts or `ATTEMPTS` answers were checked. The reward is the last
answer's (`data.exact_match`), so a first answer that is right and a corrected one both earn 1.0.

The checker is slow as real tools are (a test run, a sandbox, a web call): each check takes wall-clock time drawn
from a lognormal, median `tool_latency["median"]` seconds, log-space spread `tool_latency["sigma"]`, seeded
(`tool_seconds`), while the agent waits. Samples without `tool_latency` are checked at once.
It runs on the arithmetic warm start of recipes/arith_cpu.yaml (that model answers "3+4" with "7", and answers the
question again when asked again), so it needs no SFT of its own. `bench.py agentic` uses it to measure what async
training does with the time agents spend waiting.

Test: tests/test_retry_agent.py (the loop through the real router and CPU engine: checks, retries, the waits),
tests/test_bench.py (the latency distribution; the bench's smoke run trains with this agent in both modes).
Left out: what a checker would say about a wrong answer (the model is only asked again), tools the model calls.
"""
from __future__ import annotations

import asyncio
import json
import math
import random

import data

ATTEMPTS = 2  # answers checked per trajectory at most (a recipe's max_turns must allow as many model turns)

_draws: dict[str, int] = {}  # checks made so far per (seed, question) in this process: the next check's draw


def tool_seconds(latency: dict, key: str, draw: int) -> float:
    """Seconds the `draw`-th check of question `key` takes: median * exp(sigma * z), z ~ N(0, 1), so quantile q is
    median * exp(sigma * z_q) (p99 = median * exp(2.326 * sigma)). Each draw has its own seeded RNG: a run's
    delays depend on the seed and the questions asked, never on the order concurrent trajectories reach the tool,
    so sync and async runs of the same questions wait the same."""
    rng = random.Random(f"{latency.get('seed', 0)}/{key}/{draw}")
    return float(latency["median"]) * math.exp(float(latency["sigma"]) * rng.gauss(0.0, 1.0))


async def check(answer: str, sample: dict) -> tuple[bool, float]:
    """The checker tool: (is `answer` right, seconds it took). Takes its wall-clock time first when the sample has
    `tool_latency`."""
    latency, seconds = sample.get("tool_latency"), 0.0
    if latency:
        key = f"{latency.get('seed', 0)}/{json.dumps(sample['messages'])}"
        _draws[key] = _draws.get(key, 0) + 1
        seconds = tool_seconds(latency, key, _draws[key])
        await asyncio.sleep(seconds)
    return data.exact_match(answer, sample) == 1.0, seconds


async def agent(client, sample: dict) -> dict:
    """Answer, check, and on a rejection ask the same question again, up to ATTEMPTS checked answers. Returns the
    last answer and the seconds spent waiting on the checker (the trajectory's metadata keeps both; the reward is
    computed on the last model turn)."""
    messages, answer, waited = list(sample["messages"]), "", 0.0
    for _ in range(ATTEMPTS):
        r = await client.chat.completions.create(model="loongsage", messages=messages)
        answer = r.choices[0].message.content or ""
        right, seconds = await check(answer, sample)
        waited += seconds
        if right:
            break
        # rejected: the same question again, after the model's answer (the chat shows it what it said)
        messages += [{"role": "assistant", "content": answer}, sample["messages"][-1]]
    return {"answer": answer, "tool_s": waited}
