"""Pipeline parallelism: PP=2 over gloo (two Ray actors, Megatron-Core's 1F1B schedule) against PP=1.

What each test proves:
* one RL step (with the frozen reference of a KL term) on two pipeline stages gives the logprobs, loss, grad norm
  (all metrics) and exported HF weights of one rank, within fp32 rounding; the export gathers both stages' layers
  (and the first stage's embedding, the last stage's norm and LM head) under the full model's names;
* an SFT step (the warm start) on two stages matches one rank;
* a Qwen3-MoE (its MoE layers on both stages) takes the same step on two stages as on one;
* `--check` accepts pipeline_parallel=2 and refuses what is not wired in, naming the value.
"""
from pathlib import Path

import pytest
import torch

import config
import convert
from test_moe import Ranks, moe_dir, token_batch, train_cfg  # noqa: F401 (moe_dir: fixture)

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def stages(ray_session):
    """{1: one rank, 2: two pipeline stages}, started together and reused by both tests (each run_steps begins with a
    fresh load_hf: model, reference, optimizer and step rebuilt from the directory it names). Two mini-batches of
    two micro-batches; a reference model for the KL term."""
    worlds = {pp: Ranks(train_cfg(trainer_workers=pp, pipeline_parallel=pp, prompts_per_step=4, samples_per_prompt=2,
                                  global_batch_size=4, micro_batch_size=2, lr=1e-2, min_lr=1e-2, adam_eps=1e-2,
                                  grad_clip=1.0, kl_coef=0.05), pp) for pp in (1, 2)}
    yield worlds
    for ranks in worlds.values():
        ranks.close()


def run_steps(ranks, model_dir: str, batch: list[dict], sft: bool = False) -> tuple[list, dict, dict]:
    """(logprobs before, metrics of one RL step [and one SFT step], exported weights) on the stages of `ranks`."""
    ranks.call("load_hf", model_dir)
    logp = ranks.call("compute_logprobs", batch)
    assert all(lp == logp[0] for lp in logp)  # every stage returns the last stage's numbers
    metrics = ranks.call("train_step", batch, 0)
    assert all(m == metrics[0] for m in metrics)
    metrics = dict(metrics[0])
    if sft:
        metrics.update({f"sft/{k}": v for k, v in ranks.call("sft_step", batch)[0].items()})
    exported = dict(ranks.call("export_hf_weights")[0])
    return logp[0], metrics, exported


def assert_same_step(one, two):
    (lp1, m1, w1), (lp2, m2, w2) = one, two
    assert max(abs(a - b) for x, y in zip(lp1, lp2) for a, b in zip(x, y)) <= 1e-5
    assert set(m1) == set(m2)
    for key in m1:
        if key == "train/pad_frac":  # a cost, not a number of the step: PP pads every micro-batch to one shape
            assert m2[key] >= m1[key]
            continue
        if key.startswith("timing/") or key.endswith("_core_s"):  # seconds the step took: costs too
            continue
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-6), key
    assert set(w1) == set(w2)
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow
def test_pipeline_2_matches_one_rank(stages, tiny_model_dir):
    batch = token_batch()
    one = run_steps(stages[1], tiny_model_dir, batch, sft=True)
    two = run_steps(stages[2], tiny_model_dir, batch, sft=True)
    assert one[1]["train/grad_norm"] > 0 and one[1]["train/kl"] > 0  # a real step, with its KL term
    assert_same_step(one, two)
    before = convert.load_hf_state(tiny_model_dir)
    assert set(two[2]) == set(before)  # both stages' layers, the embedding, the final norm and the LM head
    for name in ("model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight",
                 "model.layers.1.self_attn.o_proj.weight", "lm_head.weight"):
        assert not torch.equal(two[2][name], before[name]), name  # each stage's weights moved and came back


@pytest.mark.slow
def test_pipeline_2_moe_matches_one_rank(stages, moe_dir):  # noqa: F811
    batch = token_batch(seed=1)
    assert_same_step(run_steps(stages[1], moe_dir, batch), run_steps(stages[2], moe_dir, batch))


def test_check_pipeline_parallel(tiny_model_dir, moe_dir):  # noqa: F811
    ok = config.finalize(config.Config(device="cpu", pipeline_parallel=2, trainer_workers=2,
                                       tiny_model={"num_hidden_layers": 4}))
    assert ok.pipeline_parallel == 2 and ok.data_parallel == 1
    with pytest.raises(ValueError, match="pipeline_parallel=3 does not divide the model's 4 layers"):
        config.finalize(config.Config(device="cpu", pipeline_parallel=3, trainer_workers=3))
    with pytest.raises(ValueError, match="pipeline_parallel=2 with tied input/output embeddings"):
        config.finalize(config.Config(device="cpu", pipeline_parallel=2, trainer_workers=2,
                                      tiny_model={"tie_word_embeddings": True}))
    with pytest.raises(ValueError, match="pipeline_parallel=2 with expert_parallel=2 is not wired in"):
        config.finalize(config.Config(device="cpu", model_path=moe_dir, pipeline_parallel=2,
                                      expert_parallel=2, trainer_workers=4))
