"""reasoning-gym as a data source: `reasoning_gym:<task>:<n>:<seed>` specs give chat samples of the package's own
generators, `data.reasoning_gym_score` rewards them with each family's own score_answer, several families mix by
weight as data_sources, and load_data reports how many eval items the training data also holds.

The families span four of reasoning-gym's categories: number_sorting (algorithmic), knights_knaves (logic),
family_relationships (graphs), coin_flip (probability). Each family's scorer accepts answers that are not
character-equal to the reference (another spacing, case or rounding): a reward that scored them 1.0 cannot be an
exact-match re-implementation. Needs the `reasoning-gym` package (the dev extra).
"""
import dataclasses
import itertools
from pathlib import Path

import pytest

import config
import data
import loongsage

reasoning_gym = pytest.importorskip("reasoning_gym")

# family -> (a correct answer unlike the reference's characters, made from it; a wrong answer)
FAMILIES = {
    "number_sorting": (lambda a: a.replace(", ", ","), "['1']"),
    "knights_knaves": (lambda a: a.upper(), "Nobody is a hero."),
    "family_relationships": (lambda a: a.upper(), "cousin-twice-removed"),
    "coin_flip": (lambda a: f"{float(a):.8f}", "7"),
}


@pytest.mark.parametrize("task", sorted(FAMILIES))
def test_samples_are_the_generators_items_and_score_with_the_familys_scorer(task):
    """Each sample is the generator's item (its question as the user turn, its answer, its entry for the scorer);
    the reward is the family's score_answer: 1.0 for the reference, for the reference in <answer> tags and for a
    correct answer in another form; less for a wrong one."""
    samples = data.load_dataset(f"reasoning_gym:{task}:6:11")
    items = list(reasoning_gym.create_dataset(task, size=6, seed=11))
    assert len(samples) == 6
    reworded, wrong = FAMILIES[task]
    for s, item in zip(samples, items):
        assert s["messages"] == [{"role": "user", "content": item["question"]}] and s["answer"] == item["answer"]
        assert s["reasoning_gym"]["task"] == task and s["reasoning_gym"]["entry"] == item
        assert data.reasoning_gym_score(item["answer"], s) == 1.0
        assert data.reasoning_gym_score(f"Thinking.\n<answer> {item['answer']} </answer>", s) == 1.0
        other = reworded(item["answer"])
        if other != item["answer"]:
            assert data.reasoning_gym_score(other, s) == 1.0, (task, other)  # not exact match: the family's scorer
        assert data.reasoning_gym_score(wrong, s) < 1.0


def test_settings_reach_the_generator_and_bad_specs_say_what_to_do():
    """`:<key>=<value>,...` sets the task's config fields (values read as JSON); an unknown task, setting or a
    malformed spec raises an error naming what to give."""
    short = data.load_dataset("reasoning_gym:spell_backward:20:3:min_word_len=3,max_word_len=4")
    assert all(3 <= len(s["answer"]) <= 4 for s in short)
    assert data.reasoning_gym_score(short[0]["answer"], short[0]) == 1.0  # the scorer built with the same settings
    with pytest.raises(ValueError, match="spell_backward"):
        data.load_dataset("reasoning_gym:spell_backwards:4:1")  # the valid tasks are listed
    with pytest.raises(ValueError, match="config fields|settings"):
        data.load_dataset("reasoning_gym:spell_backward:4:1:no_such_field=1")
    with pytest.raises(ValueError, match="reasoning_gym:<task>:<n>:<seed>"):
        data.load_dataset("reasoning_gym:spell_backward:four:1")


def test_families_mix_by_weight_with_held_out_eval_seeds_and_the_overlap_is_reported(capsys):
    """Three families as data_sources (weights 2:1:1): the prompt stream holds each source's share, every sample
    carries its source, and load_data prints the train/eval overlap. reasoning-gym draws item i from seed + i, so an
    eval seed inside the training range repeats training items (reported as such); one past it shares none."""
    n = 40
    sources = [
        dict(name="sort", dataset=f"reasoning_gym:number_sorting:{n}:1", weight=2.0,
             eval_dataset=f"reasoning_gym:number_sorting:10:{1 + n}", reward="data.reasoning_gym_score"),
        dict(name="knights", dataset=f"reasoning_gym:knights_knaves:{n}:1",
             eval_dataset=f"reasoning_gym:knights_knaves:10:{1 + n}", reward="data.reasoning_gym_score"),
        dict(name="family", dataset=f"reasoning_gym:family_relationships:{n}:1",
             eval_dataset="reasoning_gym:family_relationships:10:31", reward="data.reasoning_gym_score"),
    ]
    cfg = dataclasses.replace(config.Config(), data_sources=sources)
    config.check_runtime(cfg)  # the specs load: what a run checks before it starts any actor
    samples, evals = loongsage.load_data(cfg)
    out = capsys.readouterr().out
    # family's eval seeds 31..40 lie inside training's 1..40: all 10 items are training items (sort, knights: none)
    assert "eval set eval_dataset: 10 of 30 items also in the training data" in out
    assert {s["source"] for s in samples} == {"sort", "knights", "family"} and len(samples) == 3 * n
    assert [s["source"] for s in evals[""]] == ["sort"] * 10 + ["knights"] * 10 + ["family"] * 10
    drawn = [s["source"] for _, s in itertools.islice(loongsage.prompt_stream(cfg, samples), 40)]
    assert (drawn.count("sort"), drawn.count("knights"), drawn.count("family")) == (20, 10, 10)
    # the reward of each sample is its own family's: a sort answer does not score a knights sample
    sort = next(s for s in samples if s["source"] == "sort")
    knights = next(s for s in samples if s["source"] == "knights")
    assert data.reasoning_gym_score(sort["answer"], sort) == 1.0
    assert data.reasoning_gym_score(sort["answer"], knights) < 1.0


def test_a_seed_past_the_training_range_holds_out_every_item(capsys):
    """eval seed = train seed + n: no eval item is a training item, reported as 0."""
    cfg = dataclasses.replace(config.Config(), dataset="reasoning_gym:number_sorting:50:5",
                              eval_dataset="reasoning_gym:number_sorting:20:55")
    loongsage.load_data(cfg)
    assert "eval set eval_dataset: 0 of 20 items also in the training data" in capsys.readouterr().out



def test_the_spell_backward_recipe_loads_holds_out_its_eval_set_and_scores_with_the_family(capsys):
    """recipes/rg_spell_cpu.yaml (reasoning-gym's spell_backward at the generator's defaults) loads and passes the
    runtime check; its eval items are not its training items but for the few words drawn twice (printed); the reward
    is the family's: 1.0 for the reversal, the share of letters in place for the word copied unreversed."""
    cfg = config.load_config(str(Path(__file__).resolve().parents[1] / "recipes" / "rg_spell_cpu.yaml"))
    config.check_runtime(cfg)
    assert cfg.dataset.startswith("reasoning_gym:spell_backward:") and cfg.reward == "data.reasoning_gym_score"
    samples, evals = loongsage.load_data(cfg)
    overlap = int(capsys.readouterr().out.split("eval set eval_dataset: ")[1].split()[0])
    assert overlap <= 5 and len(evals[""]) == 128
    s = samples[0]  # item 0 of seed 1: "ammonia"
    assert s["answer"] == "ainomma" and data.reasoning_gym_score("ainomma", s) == 1.0
    assert data.reasoning_gym_score("ammonia", s) == pytest.approx(3 / 7)  # a, o, a in place: 3 of 7
