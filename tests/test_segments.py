"""Every trainable segment trained, and per-turn rewards: the row expansion and the token rewards by hand; a
compacted three-turn trajectory trained end to end through a real trainer actor (its early segment moves the
weights); a two-turn agent's per-turn rewards reach the trajectory through AgentFlow."""
import asyncio
import dataclasses

import pytest
import torch

import agentflow
import config
import cpu_engine
import trainer


def seg(p, r, mask, v=0):
    return {"prompt_ids": p, "response_ids": r, "loss_mask": mask, "rollout_logprobs": [-1.0 * m for m in mask],
            "weight_versions": [v if m else -1 for m in mask]}


def compacted(group_id, reward, sample_index=0):
    """Three turns: turn 1 in a first context; the agent then compacted its history, so turns 2 and 3 (with a
    tool result between them) form a second context (segment), which is the trajectory's top level."""
    first = seg([11, 12, 13], [21, 22, 23], [1, 1, 1])
    last = seg([11, 14], [31, 32, 40, 41, 33, 34], [1, 1, 0, 0, 1, 1])
    return {**last, "segments": [first, last], "reward": reward, "status": "ok", "group_id": group_id,
            "sample_index": sample_index}


def test_segment_rows_and_shared_advantage():
    plain = {**seg([1, 2], [3, 4], [1, 1]), "segments": [seg([1, 2], [3, 4], [1, 1])], "reward": 1.0, "group_id": 0}
    rows = trainer.segment_rows([plain, compacted(1, 0.0)])
    assert [(r["traj"], r["last"], r["response_ids"]) for r in rows] == [
        (0, True, [3, 4]), (1, False, [21, 22, 23]), (1, True, [31, 32, 40, 41, 33, 34])]
    assert rows[1]["group_id"] == 1 and rows[1]["reward"] == 0.0 and rows[1]["segments"] == []
    # a failed trajectory trains no earlier segment (its last one arrives masked from agentflow)
    failed = {**compacted(2, 0.0), "status": "failed"}
    assert [(r["traj"], r["last"]) for r in trainer.segment_rows([plain, failed])] == [(0, True), (1, True)]
    adv = torch.tensor([0.0, 0.5, 0.0, 0.0, 0.5, 0.5])  # the trajectory's advantage on its last segment
    assert trainer.shared_advantage(adv, [1, 0, 1]).tolist() == [0.5, 0.0, 0.5]


def test_turn_rewards_become_token_rewards():
    cfg = config.load_config(None, ["advantage=returns"])
    rows = [{"turn_rewards": [0.25, 1.0]}, {}]
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.float)
    tok = trainer.turn_token_rewards(cfg, rows, torch.tensor([9.0, 0.5]), mask)
    # row 0: each turn's reward on its last token (the scalar 9.0 is not used); row 1: its outcome on its last
    assert tok.tolist() == [[0, 0.25, 0, 0, 1.0, 0], [0, 0, 0.5, 0, 0, 0]]
    grpo = config.load_config(None, ["advantage=grpo"])
    assert trainer.turn_token_rewards(grpo, rows, torch.tensor([9.0, 0.5]), mask) is None


@pytest.mark.slow
def test_compacted_trajectory_trains_every_segment(ray_session, tiny_model_dir):
    """Two groups of two trajectories, one compacted into two segments: 5 rows train. Dropping the early
    segment changes the update (so it was trained), and denominators count its tokens."""
    from test_trainer import Ranks, make_cfg
    batch = [compacted(0, 1.0, 0), {**compacted(0, 0.0, 1), "segments": []},
             {**seg([5, 6], [7, 8, 9], [1, 1, 1]), "reward": 1.0, "group_id": 1, "sample_index": 0, "segments": []},
             {**seg([5, 6], [7, 9, 9], [1, 1, 1]), "reward": 0.0, "group_id": 1, "sample_index": 1, "segments": []}]
    without = [dict(batch[0], segments=[])] + batch[1:]
    out = []
    ranks = Ranks(make_cfg(kl_coef=0.0, global_batch_size=4, micro_batch_size=2), 1)
    try:
        for b in (batch, without):  # one rank for both: each load_hf starts a fresh model and optimizer
            ranks.call("load_hf", tiny_model_dir)
            [m] = ranks.call("train_step", b, 0)
            [w] = ranks.call("export_hf_weights")
            out.append((m, dict(w)))
    finally:
        ranks.close()
    (m, w), (m0, w0) = out
    assert m["train/samples"] == 4 == m0["train/samples"] and m["train/rows"] == 5 and m0["train/rows"] == 4
    assert m["train/loss"] != m0["train/loss"]
    assert any(not torch.equal(w[k], w0[k]) for k in w)


async def turn_rewarding_agent(client, sample):
    msgs = list(sample["messages"])
    for _ in range(2):
        r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=3)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "go on"}]
    return {"turn_rewards": [0.5, 1.0]}


def test_agent_turn_rewards_reach_the_trajectory(tiny_model_dir):
    url, handle = cpu_engine.serve(tiny_model_dir, max_batch=8, max_len=512, seed=1)
    cfg = dataclasses.replace(config.Config(), agent="test_segments.turn_rewarding_agent", max_context_len=512)

    async def body():
        flow = agentflow.AgentFlow(cfg, [url], tiny_model_dir)
        out = await flow.generate([{"messages": [{"role": "user", "content": "1+2"}], "answer": "3"}], 2,
                                  dict(temperature=1.0, max_new_tokens=3), 0)
        await flow.close()
        return out
    try:
        out = asyncio.run(body())
    finally:
        handle.shutdown()
    assert len(out) == 2
    for t in out:
        assert t["status"] == "ok" and t["turn_rewards"] == [0.5, 1.0] and t["metadata"]["turns"] == 2
        ends = [i for i, m in enumerate(t["loss_mask"]) if m and (i + 1 == len(t["loss_mask"]) or not t["loss_mask"][i + 1])]
        assert len(ends) == 2  # two model turns in the trajectory, one reward each
