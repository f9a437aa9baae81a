"""Recipe `think`: a reasoning model on a CPU. The tiny Qwen3-format model thinks before it answers: for "47+85"
it writes, in <think>, the column sums from the units up with their carries, then the answer:

    <think>
    7+5=12
    4+8+1=13
    </think>

    132

The agent is an ordinary OpenAI-client program; it reads the thinking from the response's `reasoning_content` (the
router's qwen3 reasoning parser splits it off, as SGLang does) and the answer from `content`. The thinking tokens
are trained as sampled, like every model token; the reward sees the answer only.

The warm start (`sft_trajectory`) writes the scratchpad right and the answer right with probability
1 - label_noise, otherwise off by one: the policy learns to think, and RL with the exact reward has to make the
answer follow from its own thinking. Run with recipes/think_cpu.yaml. Tested by tests/test_recipe_guard.py (the
warm start thinks in the format) and tests/test_chat.py (reasoning through the router).
Left out: thinking budgets and longer additions (three digits and more need a larger model or longer warm start).
"""
from __future__ import annotations

import data


def scratchpad(a: int, b: int) -> str:
    """The column sums of a + b from the units up, each with the carry it takes in: "7+5=12\\n4+8+1=13"."""
    lines, carry, i = [], 0, 0
    while a // 10 ** i or b // 10 ** i or i == 0:
        x, y = a // 10 ** i % 10, b // 10 ** i % 10
        s = x + y + carry
        lines.append(f"{x}+{y}{'+1' if carry else ''}={s}")
        carry, i = s // 10, i + 1
    return "\n".join(lines)


def sft_trajectory(tok, sample: dict, rng=None, label_noise: float = 0.0) -> dict:
    """The ideal turn (the scratchpad in the thinking, the sum as the answer) in the chat template's format, all of
    it in the loss; with probability `label_noise` the answer is the sum plus or minus one (the thinking stays
    right)."""
    a, b = map(int, sample["messages"][-1]["content"].split("+"))
    answer = a + b
    if label_noise and rng is not None and rng.random() < label_noise:
        answer = max(0, answer + rng.choice((-1, 1)))
    p, r = data.reply_ids(tok, sample["messages"], {"role": "assistant", "content": str(answer),
                                                    "reasoning_content": scratchpad(a, b)})
    return {"prompt_ids": p, "response_ids": r, "loss_mask": [1] * len(r), "rollout_logprobs": [0.0] * len(r),
            "weight_versions": [-1] * len(r), "reward": 0.0, "status": "ok", "group_id": 0, "sample_index": 0}


async def agent(client, sample: dict) -> dict:
    """One question, one answer. Returns the answer (what the reward reads) and the thinking, which is kept with
    the trajectory (metadata.agent_result) for the viewer."""
    r = await client.chat.completions.create(model="loongsage", messages=sample["messages"])
    msg = r.choices[0].message
    return {"answer": msg.content or "", "thinking": getattr(msg, "reasoning_content", None) or ""}
