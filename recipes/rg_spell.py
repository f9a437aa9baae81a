"""Recipe `rg_spell`: reasoning-gym's spell_backward ("Spell this word backward (example: sun -> nus): splat" ->
"talps"), the generator at its default settings, learned by the tiny model; run with recipes/rg_spell_cpu.yaml.

The warm start (`sft_trajectory`) answers with the word reversed, or with probability `label_noise` with the word
as given (a near miss of this task: the model copies instead of reversing). The policy learns both, and RL with the
family's own score_answer has to choose the reversal. Tested by tests/test_reasoning_gym.py.
"""
from __future__ import annotations

import data


def sft_trajectory(tok, sample: dict, rng=None, label_noise: float = 0.0) -> dict:
    """data.sft_trajectory of the reversed word; with probability `label_noise` of the word itself."""
    if label_noise and rng is not None and rng.random() < label_noise:
        sample = {**sample, "answer": sample["reasoning_gym"]["entry"]["metadata"]["word"]}
    return data.sft_trajectory(tok, sample)
