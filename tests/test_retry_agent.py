"""The retry agent of recipes/retry.py through the real router and a real CPU engine (the random tiny model): every
answer goes to the checker, which takes the wall-clock time its sample's `tool_latency` asks for; a rejected answer
is followed by the same question again, in the same trajectory (one segment: the router extends the chat), up to
two model turns. bench.py agentic runs it in both training modes (tests/test_bench.py)."""
import asyncio
import dataclasses

import pytest

import agentflow
import config
import cpu_engine
import data


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    url, handle = cpu_engine.serve(tiny_model_dir, max_batch=64, max_len=512, seed=0)
    yield url
    handle.shutdown()


def test_retry_agent_checks_every_answer_and_asks_again_when_rejected(engine, tiny_model_dir):
    """sigma 0: every check takes exactly 0.4 s. A trajectory the checker accepted at the first answer made one
    model turn and one check; a rejected one made two turns and two checks, its second prompt holding the first answer
    and the question again. Each trajectory's time outside generation covers its checks (>= 0.4 s each), and the
    reward is the last answer's exact match."""
    latency = {"median": 0.4, "sigma": 0.0, "seed": 0}
    samples = [{**s, "tool_latency": latency} for s in data.arith_samples(3, seed=5, max_operand=9)]
    cfg = dataclasses.replace(config.Config(), agent="recipes.retry.agent", reward="data.exact_match", max_turns=2,
                              agent_timeout=60.0, max_context_len=256)

    async def body():
        flow = agentflow.AgentFlow(cfg, [engine], tiny_model_dir)
        try:
            return await flow.generate(samples, 2, dict(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=6), 0)
        finally:
            await flow.close()
    trajs = asyncio.run(asyncio.wait_for(body(), 120))
    tok = data.load_tokenizer(tiny_model_dir)
    assert len(trajs) == 6 and all(t["status"] == "ok" for t in trajs)
    for t in trajs:
        sample = samples[t["group_id"]]
        turns = t["metadata"]["turns"]
        assert turns in (1, 2) and (turns == 2 or t["reward"] == 1.0)  # one turn only when accepted at once
        assert t["reward"] == data.exact_match(t["response_text"], sample)
        assert t["metadata"]["agent_result"] == {"answer": t["response_text"], "tool_s": pytest.approx(0.4 * turns)}
        waited = t["timings"]["total_s"] - t["timings"]["generate_s"]
        assert waited >= 0.4 * turns - 0.01, (waited, turns)  # the agent really waited on each check
        if turns == 2:
            assert len(t["segments"]) == 1  # one growing chat: the retry extends the first turn's tokens
            text = tok.decode(t["prompt_ids"] + t["response_ids"])
            assert text.count(sample["messages"][0]["content"]) == 2  # the question, then asked again
