"""recipes/repair.py: the generated repair tasks, their reward (the package's own tests in a sandbox), the warm start's
transcript in mini-swe-agent's format, and (slow) mini-swe-agent itself, unmodified, as AgentFlow's black-box agent.

Run: `pytest -q tests/test_repair.py` (the slow case needs scripts/agents_env.sh; it skips without mini-swe-agent).
"""
import asyncio
import dataclasses
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import agentflow
import chat
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
    the files, gives a module that scores 1; the line-above (label noise) command scores 0; an episode that
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
    turn (all of it trained) is exactly one ```bash block holding the fix and the submit command, through the end of
    turn; with label noise the fix aims at the line above. It fits the tiny model's 512 positions."""
    tok = AutoTokenizer.from_pretrained(data.build_tiny_model(data.default_cache_dir() / "tiny-repair-test"))
    sample = repair.tasks("train", 1, 5)[0]
    t = repair.sft_trajectory(tok, sample)
    prompt = tok.decode(t["prompt_ids"])
    assert prompt.startswith(f"<|im_start|>system\n{repair.SYSTEM}") and sample["messages"][0]["content"] in prompt
    assert t["loss_mask"] == [1] * len(t["response_ids"])
    reported = sample["messages"][0]["content"].split("should be `")[1][:-2]  # the report's right code
    command = f'sed -i "{sample["line"]}s|.*|    {reported}|" {sample["module"]}'  # indented as a function's body
    assert tok.decode(t["response_ids"]) == f"```bash\n{repair.fix_command(sample)}\n```{data.turn_end(tok)}"
    assert repair.fix_command(sample).startswith(command) and repair.fix_command(sample).endswith(repair.SUBMIT)
    assert len(t["prompt_ids"]) + len(t["response_ids"]) <= 512
    noisy = repair.sft_trajectory(tok, sample, random.Random(1), label_noise=1.0)
    assert command not in tok.decode(noisy["response_ids"])


def mini_installed() -> None:
    if not agents.executable("mini").exists():
        if os.environ.get("LOONGSAGE_AGENTS_REQUIRED") == "1":  # the agent-programs tier of .ci/run
            pytest.fail(f"{agents.executable('mini')} is missing: run scripts/agents_env.sh")
        pytest.skip("mini-swe-agent is not installed (scripts/agents_env.sh)")


def constrained(reply: str) -> dict:
    """A first-turn constraint (SGLang's `regex`, enforced by the engine) that makes the model write `reply`."""
    return {"regex": "".join("\\" + c if c in ".^$*+?()[]{}|\\" else c for c in reply)}


@pytest.mark.slow
def test_mini_swe_agent_repairs_through_agentflow():
    """mini-swe-agent, unmodified, as `agent_command` forked from the warm interpreter (agent_preload), with the tiny
    random model. Sampled freely (two tasks): every trajectory is ok, its segments are the program's requests (label
    main, the prompt its system message and the task), its reward 0 or 1, the module it left in its output. With the
    first reply constrained to the warm start's fix: mini-swe-agent parsed the block, bash applied the sed and the
    submit ended the run, so the reward is 1.0, and the trajectory is the warm start's transcript (the same prompt
    tokens, the same reply text)."""
    mini_installed()
    model = data.build_tiny_model(data.default_cache_dir() / "tiny-repair-test")
    tok = AutoTokenizer.from_pretrained(model)
    url, handle = cpu_engine.serve(model, max_batch=4, max_len=512, seed=0)
    cfg = dataclasses.replace(config.Config(), agent_command="python $LOONGSAGE_ROOT/recipes/repair.py",
                              agent_preload=["recipes.repair_preload"], sandbox="local", max_turns=2,
                              max_context_len=512, agent_timeout=120.0, agent_retries=0,
                              reward="recipes.repair.reward")
    config.check_rollout(cfg)
    samples = repair.tasks("eval", 3, 1)
    ideal = repair.sft_trajectory(tok, samples[2])
    # every turn constrained (the recipe's first_turn_constraint is for tool turns; this program offers none)
    fixed = dict(temperature=1.0, max_new_tokens=128, **constrained(f"```bash\n{repair.fix_command(samples[2])}\n```"))

    async def run(sampling, samples):
        flow = agentflow.AgentFlow(cfg, [url], model)
        try:
            return await flow.generate(samples, 1, sampling, 0)
        finally:
            await flow.close()
    try:
        t0 = time.perf_counter()
        free = asyncio.run(run(dict(temperature=1.0, max_new_tokens=128), samples[:2]))
        t1 = time.perf_counter()
        [ideal_run] = asyncio.run(run(fixed, samples[2:]))
    finally:
        handle.shutdown()
    print(f"\nmini-swe-agent through AgentFlow: 2 free runs {t1 - t0:.1f} s (with the warm interpreter's start); "
          f"{[(t['status'], t['reward'], len(t['segments'])) for t in free]}; constrained: {ideal_run['reward']}")
    assert [t["status"] for t in free] == ["ok"] * 2, [t["metadata"].get("error") for t in free]
    for t, sample in zip(free, samples):
        assert t["reward"] in (0.0, 1.0) and t["segments"] and {g["label"] for g in t["segments"]} == {"main"}
        assert tok.decode(t["segments"][0]["prompt_ids"]).startswith(f"<|im_start|>system\n{repair.SYSTEM}")
        assert sample["module"] in repair.edited(t["response_text"])
    assert ideal_run["status"] == "ok" and ideal_run["reward"] == 1.0, ideal_run["metadata"].get("error")
    assert json.loads(ideal_run["response_text"])["exit_status"] == "Submitted"
    [seg] = ideal_run["segments"]
    # the engine's tokens under a regex need not be the tokenizer's own split of the same text, and once the regex
    # is done the random model may end with any stop token (<|endoftext|> as well as <|im_end|>): the text is the same
    assert seg["prompt_ids"] == ideal["prompt_ids"] and seg["loss_mask"] == [1] * len(seg["response_ids"])
    assert tok.decode(seg["response_ids"][:-1]) == tok.decode(ideal["response_ids"][:-1])
    assert seg["response_ids"][-1] in chat.ChatFormat(model).stop_ids
