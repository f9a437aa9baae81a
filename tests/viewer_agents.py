"""The agent of tests/test_viewer.py's real run (imported by the AgentFlow actor by dotted path)."""
import zlib


async def two_turns(client, sample):
    """Two model turns with a user follow-up between them (template + user tokens, loss mask 0), so the viewer
    has turns to split. About a third of the trajectories raise after their turns, chosen by a hash of the
    first reply (a retry samples the same reply, so they stay failed: tokens kept, loss mask zeroed); the
    others report per-turn rewards. The follow-up and the error carry markup, which the page must show as text."""
    msgs = list(sample["messages"])
    r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=6)
    reply = r.choices[0].message.content or "?"
    msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "<b>check</b> & again"}]
    await client.chat.completions.create(model="m", messages=msgs, max_tokens=6)
    if zlib.crc32(reply.encode()) % 3 == 0:
        raise RuntimeError('<img src=x onerror="document.body.dataset.pwned=1"> this trajectory fails on purpose')
    return {"turn_rewards": [0.25, 0.75]}
