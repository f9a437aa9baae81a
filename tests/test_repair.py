"""recipes/repair.py: the generated repair tasks, their reward (the package's own tests in a sandbox), the warm start's
transcript in mini-swe-agent's format, and (slow) mini-swe-agent itself, unmodified, as AgentFlow's black-box agent.

Run: `pytest -q tests/test_repair.py` (the slow case needs scripts/agents_env.sh; it skips without mini-swe-agent).
"""
import asyncio
import dataclasses
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import agentflow
import config
import cpu_engine
import data

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
import agents  # noqa: E402
import repair  # noqa: E402


def test_tasks_cover_templates_and_kinds_and_hold_out_pairs():
    """>= 3 packages x 5 bug kinds; the eval split holds exactly EVAL_PAIRS (one per kind, every package), the train
    split every other pair and none of those; both are deterministic by seed and differ across seeds."""
    assert len(repair.TEMPLATES) >= 3 and len(repair.KINDS) >= 5
    assert all(set(t["sites"]) == set(repair.KINDS) for t in repair.TEMPLATES.values())
    train, evals = data.load_dataset("recipes.repair.tasks:train:200:1"), repair.tasks("eval", 50, 2)
    seen = {(s["package"], s["kind"]) for s in train}
    assert seen == set(repair.pairs("train")) and len(seen) == 15 - len(repair.EVAL_PAIRS)
    assert {(s["package"], s["kind"]) for s in evals} == set(repair.EVAL_PAIRS) and not seen & set(repair.EVAL_PAIRS)
    assert {k for _, k in repair.EVAL_PAIRS} == set(repair.KINDS) and {p for p, _ in repair.EVAL_PAIRS} == set(
        repair.TEMPLATES)
    assert repair.tasks("train", 30, 1) == train[:30] and repair.tasks("train", 30, 7) != train[:30]
    assert len({s["line"] for s in train}) > 5  # the shuffled functions move the bug around
    with pytest.raises(ValueError, match="split 'test'"):
        repair.pairs("test")


def test_reward_runs_the_pristine_tests_on_the_edited_module(tmp_path):
    """For one task of every (package, kind): the buggy module scores 0; the warm start's `sed -i`, run by bash on
    the files, gives a module that scores 1; the neighbouring-line (label noise) command scores 0; an episode that
    also empties the test file still scores 0 on the buggy module (the reward uses the sample's tests)."""
    samples = {(s["package"], s["kind"]): s for s in repair.tasks("train", 60, 3) + repair.tasks("eval", 20, 4)}
    assert len(samples) == 15

    def after(sample, command):
        work = tmp_path / f"{sample['package']}-{sample['kind']}-{len(list(tmp_path.iterdir()))}"
        work.mkdir()
        for name, text in sample["files"].items():
            (work / name).write_text(text)
        subprocess.run(command, shell=True, cwd=work, check=True)
        return {name: (work / name).read_text() for name in sample["files"]}

    async def score(sample, files):
        return await repair.reward('{"files": %s}' % json.dumps(files), sample)

    for sample in samples.values():
        noisy = repair.fix_command(sample, random.Random(0), label_noise=1.0)
        fixed, wrong = after(sample, repair.fix_command(sample)), after(sample, noisy)
        hacked = {**sample["files"], sample["test"]: "print('ok')\n"}
        got = [asyncio.run(score(sample, files)) for files in (sample["files"], fixed, wrong, hacked)]
        assert got == [0.0, 1.0, 0.0, 0.0], (sample["package"], sample["kind"], got)
    assert asyncio.run(repair.reward("mini-swe-agent crashed", samples[("text", "constant")])) == 0.0


def test_warm_start_transcript_is_mini_swe_agents_episode():
    """The warm start's example: the prompt is the chat of mini-swe-agent's system message and the task; the model's
    turns (loss_mask 1) are exactly the fix's ```bash block and the submit command's, each through the end of turn;
    between them (loss_mask 0) the observation of a command that printed nothing, rendered by the config's template."""
    tok = AutoTokenizer.from_pretrained(data.build_tiny_model(data.default_cache_dir() / "tiny-repair-test"))
    sample = repair.tasks("train", 1, 5)[0]
    t = repair.sft_trajectory(tok, sample)
    prompt = tok.decode(t["prompt_ids"])
    assert repair.SYSTEM in prompt and sample["messages"][0]["content"] in prompt
    trained = [i for i, m in zip(t["response_ids"], t["loss_mask"]) if m]
    eos = data.turn_end(tok)
    assert tok.decode(trained) == f"```bash\n{repair.fix_command(sample)}\n```{eos}```bash\n{repair.SUBMIT}\n```{eos}"
    glue = tok.decode([i for i, m in zip(t["response_ids"], t["loss_mask"]) if not m])
    assert "<returncode>0</returncode>\n<output>\n</output>" in glue
    assert len(t["prompt_ids"]) + len(t["response_ids"]) <= 512
    noisy = repair.sft_trajectory(tok, sample, random.Random(1), label_noise=1.0)
    assert tok.decode(noisy["response_ids"]) != tok.decode(t["response_ids"])


def mini_installed() -> None:
    if not agents.executable("mini").exists():
        pytest.skip("mini-swe-agent is not installed (scripts/agents_env.sh)")


@pytest.mark.slow
def test_mini_swe_agent_repairs_through_agentflow():
    """mini-swe-agent, unmodified, as `agent_command` forked from the warm interpreter (agent_preload), on two repair
    tasks of the tiny random model: every trajectory is ok, its segments are the program's requests (label main,
    the first one's prompt starting with the recipe's system message), its reward is 0 or 1, and the agent's output
    carries the module it left; one forked run costs far less than importing litellm."""
    mini_installed()
    model = data.build_tiny_model(data.default_cache_dir() / "tiny-repair-test")
    tok = AutoTokenizer.from_pretrained(model)
    url, handle = cpu_engine.serve(model, max_batch=4, max_len=512, seed=0)
    cfg = dataclasses.replace(config.Config(), agent_command="python $LOONGSAGE_ROOT/recipes/repair.py",
                              agent_preload=["recipes.repair_preload"], sandbox="local", max_turns=3,
                              max_context_len=512, agent_timeout=120.0, agent_retries=0,
                              reward="recipes.repair.reward")
    config.check_rollout(cfg)
    samples = repair.tasks("eval", 2, 1)

    async def run():
        flow = agentflow.AgentFlow(cfg, [url], model)
        try:
            t0 = time.perf_counter()
            trajs = await flow.generate(samples[:1], 1, dict(temperature=1.0, max_new_tokens=32), 0)
            t1 = time.perf_counter()
            trajs += await flow.generate(samples[1:], 2, dict(temperature=1.0, max_new_tokens=32), 1)
            return trajs, t1 - t0, time.perf_counter() - t1
        finally:
            await flow.close()
    try:
        trajs, first, rest = asyncio.run(run())
    finally:
        handle.shutdown()
    print(f"\nmini-swe-agent through AgentFlow: first group {first:.1f} s (starts the warm interpreter), "
          f"next group of 2 {rest:.1f} s; {[(t['status'], t['reward'], len(t['segments'])) for t in trajs]}")
    assert [t["status"] for t in trajs] == ["ok"] * 3, [t["metadata"].get("error") for t in trajs]
    for t, sample in zip(trajs, samples[:1] + samples[1:] * 2):
        assert t["reward"] in (0.0, 1.0) and t["segments"] and {g["label"] for g in t["segments"]} == {"main"}
        assert tok.decode(t["segments"][0]["prompt_ids"]).startswith(f"<|im_start|>system\n{repair.SYSTEM}")
        assert sample["module"] in repair.edited(t["response_text"])
