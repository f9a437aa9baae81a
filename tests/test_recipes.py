"""Recipes: every YAML validates here (GPU ones included), and the code-repair tool runs real tests
in a real sandbox."""
import asyncio
import os
from pathlib import Path

import pytest

import config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("recipe", sorted(p.name for p in (ROOT / "recipes").glob("*.yaml")))
def test_every_recipe_passes_validation_and_its_reward_knows_the_answer(recipe, tiny_model_dir):
    """Every YAML loads (load_config raises on a bad key, a bad batch algebra or an unloadable dotted path).
    Where its data is synthetic (the CPU recipes): the reward gives 1 to the sample's own answer and 0 to a
    wrong one, and the warm-start example trains on that answer (a recipe whose reward and data disagree
    would train on noise), with prompts that fit max_prompt_len."""
    import data
    cfg = config.load_config(str(ROOT / "recipes" / recipe))
    assert set(cfg.tiny_model) <= set(data.TINY_DEFAULTS)
    if data.is_dotted(cfg.dataset.partition(":")[0]) and not cfg.dataset.endswith((".jsonl", ".parquet")):
        assert data.load_dataset(cfg.dataset) and data.load_dataset(cfg.eval_dataset)  # a recipe's own generator:
        return  # its reward and warm start are tested with it (recipes/repair.py: tests/test_repair.py)
    if not cfg.dataset.startswith(("synthetic:", "reasoning_gym:")):
        assert cfg.device == "cuda" and cfg.model_path.startswith("/")  # GPU recipes: real data and model on disk
        return
    reward = data.import_object(cfg.reward)
    tok = data.load_tokenizer(tiny_model_dir)
    for spec in (cfg.dataset, cfg.eval_dataset):
        for s in data.load_dataset(spec)[:20]:
            if s["answer"].lstrip("-").isdigit():  # a number: one more is wrong
                assert reward(s["answer"], s) == 1.0 and reward(str(int(s["answer"]) + 1), s) == 0.0, s
            else:  # a reasoning-gym answer, scored with partial credit by its family: a wrong first letter is not
                #     whole (spell_backward's scorer gives 1.0000000000000002 to the answer with a letter appended)
                wrong = ("b" if s["answer"][:1] == "a" else "a") + s["answer"][1:]
                assert reward(s["answer"], s) == 1.0 and reward(wrong, s) < 1.0, s
            assert len(data.prompt_ids(tok, s)) <= cfg.max_prompt_len
    if cfg.warmstart_steps:
        example = data.import_object(cfg.warmstart_example)
        s = data.load_dataset(cfg.warmstart_dataset)[0]
        t = example(tok, s)
        trained = tok.decode([i for i, m in zip(t["response_ids"], t["loss_mask"]) if m])
        assert trained.endswith(s["answer"] + "<|im_end|>")


def test_describe_states_the_derived_sizes():
    cfg = config.load_config(str(ROOT / "recipes/arith_cpu.yaml"), ["device=cpu", "trainer_workers=2"])
    # 64 prompts x 8 samples = 512 = 4 mini-batches of 128; 128 / 2 DP ranks = 64 = 1 micro-batch of 64
    # sync on CPU: the phase running shares the node's cores among its actors (2 trainer ranks, 1 engine)
    cores = os.cpu_count() or 1
    assert config.describe(cfg) == ("data_parallel=2, rollout batch=512 samples, 4 optimizer step(s) per RL "
                                    "step, 1 micro-batch(es) per rank per optimizer step, device=cpu, engine=cpu, "
                                    f"torch threads trainer/engine={max(1, cores // 2)}/{cores}")


def test_code_repair_tool_runs_the_tests_in_a_sandbox():
    from recipes import code_repair
    sample = {"tests": "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n", "timeout": 10}
    good = asyncio.run(code_repair.run_tests("def add(a, b):\n    return a + b\n", sample))
    bad = asyncio.run(code_repair.run_tests("def add(a, b):\n    return a - b\n", sample))
    assert good.startswith("PASSED")
    assert bad.startswith("FAILED") and "AssertionError" in bad
