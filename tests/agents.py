"""White-box agents for the controller drills of tests/test_reliability.py (imported by the AgentFlow actor)."""

_calls = 0  # trajectories started in this process, in dispatch order


async def flaky_agent(client, sample):
    """The first 8 trajectories (one whole step of 2 groups x 4) raise before any model call. After
    that, sample i of each group of 4: 0 raises before its first model call, 1 returns garbage (an
    int) after one, 2 returns a NaN reward after one, 3 behaves and returns the model's text."""
    global _calls
    k, _calls = _calls, _calls + 1
    if k < 8 or k % 4 == 0:
        raise RuntimeError(f"agent crashed before its first model call (trajectory {k})")
    r = await client.chat.completions.create(model="m", messages=sample["messages"], max_tokens=4)
    if k % 4 == 1:
        return 42
    if k % 4 == 2:
        return {"reward": float("nan")}
    return r.choices[0].message.content


def one(response: str, sample: dict) -> float:
    """Reward 1 for any trajectory that gets rewarded at all: next to failed samples (reward 0) in its
    group, a surviving sample then has a positive advantage, so the step has a gradient."""
    return 1.0


async def early_crash(client, sample):
    raise RuntimeError("crashed before any model call")


async def garbage(client, sample):
    await client.chat.completions.create(model="m", messages=sample["messages"], max_tokens=2)
    return ["not", "an", "answer"]


async def turn_hog(client, sample):
    """Keeps calling the model past cfg.max_turns; the router's 400 max_turns_exceeded ends it."""
    msgs = list(sample["messages"])
    while True:
        r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=2)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "again"}]


def raising_reward(response: str, sample: dict) -> float:
    raise ValueError("reward bug")


def per_turn_reward(response: str, sample: dict) -> list:
    return [0.5, 1.0]


# data_sources drill (tests/test_loongsage.py test_two_sources_keep_their_own_agent_and_reward): each source's agent
# refuses the other source's samples, and makes its own number of model calls, which the dumped rollouts record

async def add_agent(client, sample):
    """One model call; only for samples of the source `add`."""
    if sample.get("source") != "add":
        raise RuntimeError(f"add_agent got a sample of source {sample.get('source')!r}")
    r = await client.chat.completions.create(model="m", messages=sample["messages"], max_tokens=3)
    return r.choices[0].message.content


async def sub_agent(client, sample):
    """Two model calls (the second after a user 'again'); only for samples of the source `sub`."""
    if sample.get("source") != "sub":
        raise RuntimeError(f"sub_agent got a sample of source {sample.get('source')!r}")
    msgs = list(sample["messages"])
    r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=3)
    msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "again"}]
    r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=3)
    return r.choices[0].message.content
