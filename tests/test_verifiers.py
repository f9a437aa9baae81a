"""verifiers' environments, unmodified, as black-box agents through the router: ReasoningGymEnv (its own dataset
construction, XMLParser and rubric) and ToolEnv (its multi-turn tool loop) on a calculator task defined in
tests/verifiers_agents.py.

verifiers' pins clash with LoongSage's venv (it wants another openai and datasets), so it lives in .venv-verifiers
(scripts/verifiers_env.sh) and runs only as a program: `agent_command` starts tests/verifiers_agents.py with that
venv's Python in a sandbox pointed at a router session, verifiers builds its own OpenAI client from
OPENAI_BASE_URL / OPENAI_API_KEY, and the program prints the rubric's reward, which `tests.rewards.program_reward`
hands to LoongSage. Without the venv the tier skips (LOONGSAGE_VERIFIERS=1: fails instead).

The engine is the real CPU engine on the tiny random model; where a test needs a right answer or a well-formed tool
call (which a random model does not write), `crafted_engine` answers instead, as in tests/test_agentflow.py. The
router, the sandbox and verifiers are real throughout.
"""
import asyncio
import dataclasses
import os
from pathlib import Path

import pytest

import agentflow
import chat
import config
import cpu_engine
import data
from tests.test_agentflow import crafted_engine

ROOT = Path(__file__).resolve().parents[1]
VENV_PY = ROOT / ".venv-verifiers" / "bin" / "python"
if not VENV_PY.exists():
    if os.environ.get("LOONGSAGE_VERIFIERS") == "1":
        raise RuntimeError(f"{VENV_PY} is missing; build it with scripts/verifiers_env.sh")
    pytest.skip("no .venv-verifiers (scripts/verifiers_env.sh builds it)", allow_module_level=True)
pytest.importorskip("reasoning_gym")
pytestmark = pytest.mark.slow  # every trajectory starts a Python that imports verifiers (~5-15 s)

SAMPLING = dict(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=8)
RG_SYSTEM = "provide the answer in the following format:\n<answer>answer here</answer>"  # verifiers' rg prompt


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    url, handle = cpu_engine.serve(tiny_model_dir, max_batch=16, max_len=512, seed=0)
    yield url
    handle.shutdown()


def flow_for(kind: str, engine: str, model: str) -> agentflow.AgentFlow:
    # `-P` and an empty PYTHONPATH: the program sees its venv only. Its own directory would put tests/agents.py in
    # front of openai-agents' `agents` package (which verifiers' ToolEnv imports), and the sandbox's PYTHONPATH (the
    # repo root) LoongSage's flat modules (config, data, chat, ...) in front of any library's of the same name.
    cmd = f"PYTHONPATH= {VENV_PY} -P {ROOT}/tests/verifiers_agents.py {kind}"
    cfg = dataclasses.replace(config.Config(), agent_command=cmd,
                              reward="tests.rewards.program_reward", sandbox="local", max_turns=4, agent_timeout=240.0,
                              agent_retries=0, max_context_len=512, max_prompt_len=448, max_new_tokens=8)
    return agentflow.AgentFlow(cfg, [engine], model)


def rg_sample(gym: str, seed: int, index: int) -> dict:
    """LoongSage's sample of the item ReasoningGymEnv(gym, seed) puts at `index` of its train split (reasoning-gym
    draws item i from seed + i), with what the program needs to build that environment."""
    s = data.load_dataset(f"reasoning_gym:{gym}:1:{seed + index}")[0]
    return {**s, "verifiers": {"gym": gym, "seed": seed, "index": index}}


def generate(flow, samples, n, crafted=None) -> list[dict]:
    async def body():
        if crafted is not None:
            crafted_engine(flow.pool, flow.chat, crafted)
        out = await flow.generate(samples, n, SAMPLING, step=0)
        await flow.close()
        return out
    return asyncio.run(asyncio.wait_for(body(), 600))


def test_reasoning_gym_env_rubric_scores_a_right_and_a_wrong_answer(engine, tiny_model_dir):
    """ReasoningGymEnv's row reaches the model with its own system prompt; its XMLParser and rubric score the reply,
    and that reward is the trajectory's: 1.0 for the reference in <answer> tags, less for another word. LoongSage's
    own reward (data.reasoning_gym_score, the same family scorer) agrees on both replies."""
    s = rg_sample("spell_backward", seed=5, index=2)
    for reply, want in ((f"<answer>{s['answer']}</answer>", 1.0), ("<answer>zzzq</answer>", 0.0)):
        [t] = generate(flow_for("rg", engine, tiny_model_dir), [s], 1, crafted=[reply])
        assert t["status"] == "ok", t["metadata"].get("error")
        prompt = chat.ChatFormat(tiny_model_dir).decode(t["prompt_ids"], skip_special_tokens=False)
        assert RG_SYSTEM in prompt and s["messages"][0]["content"] in prompt  # verifiers' row, as verifiers built it
        assert t["reward"] == want == data.reasoning_gym_score(reply, s)
        assert t["metadata"]["turns"] == 1 and 1 in t["loss_mask"]


def test_reasoning_gym_env_runs_on_the_real_engine(engine, tiny_model_dir):
    """Two rollouts of one ReasoningGymEnv item on the real engine (the random model): both complete through
    verifiers' own client and rubric, their tokens are the engine's sampled ones, the reward is the rubric's."""
    s = rg_sample("spell_backward", seed=5, index=0)
    out = generate(flow_for("rg", engine, tiny_model_dir), [s], 2)
    assert len(out) == 2
    for t in out:
        assert t["status"] in ("ok", "truncated"), t["metadata"].get("error")
        assert t["metadata"]["turns"] == 1 and 1 <= sum(t["loss_mask"]) <= 8 and 0.0 <= t["reward"] <= 1.0
        assert all(lp <= 0 for lp in t["rollout_logprobs"])


def test_tool_env_multi_turn_rollout_calls_the_tool_and_is_rewarded(engine, tiny_model_dir):
    """ToolEnv's loop through the router: the model's tool call reaches verifiers as an OpenAI tool call, verifiers
    runs the tool and sends its result back, the model answers; the trajectory holds both model turns (trained) and
    the tool result between them (masked), and the rubric's 1.0 for the right number is its reward."""
    s = data.calc_samples(1, seed=3)[0]
    expr = s["messages"][0]["content"]
    call = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}\n</tool_call>'
    [t] = generate(flow_for("tool", engine, tiny_model_dir), [s], 1, crafted=[call, s["answer"]])
    assert t["status"] == "ok", t["metadata"].get("error")
    assert t["metadata"]["turns"] == 2 and t["reward"] == 1.0
    fmt = chat.ChatFormat(tiny_model_dir)
    text = fmt.decode(t["response_ids"], skip_special_tokens=False)
    assert '"calculator"' in text and s["answer"] in text  # the call, the tool's result and the final answer
    masked = fmt.decode([i for i, m in zip(t["response_ids"], t["loss_mask"]) if m == 0])
    assert s["answer"] in masked  # the tool result (the answer, computed by the tool) is not trained on
    trained = fmt.decode([i for i, m in zip(t["response_ids"], t["loss_mask"]) if m == 1], skip_special_tokens=False)
    assert trained == call + fmt.eos_text + s["answer"] + fmt.eos_text  # exactly the two model turns
