"""Megatron-Core's fast paths: the config rules, and on CPU what of them can run here, against the real parts.

What each test proves:
* the rules (`config.check_fast_paths`): each combination that cannot work fails at --check with the reason and
  what to set; CP counts in the layout (data_parallel = workers / (TP*PP*CP)); on CUDA, where TE imports, the fast
  paths validate and --check prints them (without TE: tests/test_gpu_refusals.py, with the GPU recipes);
* the TE spec's names: the two norms it fuses into linear layers are found and mapped back to the local-spec names
  the HF conversion speaks (`convert.fused_norm_names`);
* recomputation (`recompute: selective | full`, Megatron's checkpointing, on CPU through shim 6): the core attention
  runs again in the backward, and the step's loss, grad norm and updated weights equal those without it, bit for bit;
* sequence parallelism with TP=2 over gloo (the local spec's norms through shim 7): the same logprobs, loss, grad
  norm and updated weights as one rank, for a dense model, a Qwen3-MoE (which Megatron trains under TP only with
  SP) and the critic's value head;
* context parallelism: TE's attention cannot run here, so a stand-in does its part (tests/context_parallel.py:
  K/V all-gathered, each rank's queries at their global positions); what LoongSage writes around it (each rank's
  positions, which are Megatron's own layout, the padding, the gather of the outputs, the gradient sum over CP
  ranks, the HF export) gives with CP=2 the logprobs, loss, grad norm and weights of CP=1.
The TE spec, the distributed optimizer and CP with TE's attention need CUDA: scripts/gpu_check.sh runs them.
"""
from pathlib import Path

import pytest
import ray
import torch

import config
import convert
import trainer
from test_moe import moe_dir  # noqa: F401 (fixture)
from test_trainer import Ranks, assert_same_weights, make_batch, make_cfg, max_diff

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(600)


# ----------------------------------------------------------------------------------------------
# the rules, --check


@pytest.mark.parametrize("overrides, message", [
    (["use_distributed_optimizer=true"], "use_distributed_optimizer=true needs CUDA"),
    (["context_parallel=2", "trainer_workers=2"], "context_parallel=2 needs Transformer Engine's attention"),
    (["layer_spec=te"], "layer_spec='te' needs CUDA"),
    (["layer_spec=tee"], "did you mean 'te'"),
    (["recompute=partial"], "recompute='partial': choose from"),
    (["sequence_parallel=true"], "tensor_parallel=1 has none"),
    (["megatron.recompute_granularity=full"], "set recompute instead"),
    (["megatron.sequence_parallel=true"], "set sequence_parallel instead"),
    (["megatron.recompute_num_layers=2"], "refines recompute='full', but recompute='none'"),
    (["recompute=full", "megatron.recompute_modules=[core_attn]"], "refines recompute='selective'"),
    (["device=cuda", "layer_spec=local", "sequence_parallel=true", "tensor_parallel=2", "trainer_workers=2"],
     "torch norms refuse sequence parallelism; set layer_spec=auto with transformer_engine installed"),
    (["device=cuda", "layer_spec=local", "context_parallel=2", "trainer_workers=2"],
     "context_parallel=2 needs Transformer Engine's attention, and the local spec is built (layer_spec='local')"),
    (["device=cuda", "context_parallel=2", "trainer_workers=3"],
     "not a multiple of tensor_parallel*pipeline_parallel*context_parallel=2"),
    (["device=cuda", "context_parallel=2", "expert_parallel=2", "trainer_workers=4", "tiny_model.num_experts=4"],
     "not wired in"),
    (["sequence_parallel=true", "tensor_parallel=2", "trainer_workers=2", "router_replay=true",
      "tiny_model.num_experts=4"], "router_replay=true with sequence_parallel"),
    (["tensor_parallel=2", "trainer_workers=2", "tiny_model.num_experts=4"], "only with sequence parallelism"),
    (["max_tokens_per_micro_batch=-1"], "must be an integer >= 0"),
    (["max_tokens_per_micro_batch=512", "pipeline_parallel=2", "trainer_workers=2"], "set pipeline_parallel=1"),
    (["max_tokens_per_micro_batch=512", "router_replay=true", "tiny_model.num_experts=4"], "laid out per padded row"),
    (["max_tokens_per_micro_batch=512", "device=cuda", "layer_spec=local"], "takes no packed (THD) sequences"),
])
def test_rules_say_what_to_change(overrides, message, monkeypatch):
    monkeypatch.setattr(convert, "_te_import_error", lambda: None)  # CUDA rules as where TE imports: the rule decides
    if "device=cuda" in overrides:
        overrides = [*overrides, "dtype=bfloat16"]  # (SGLang serves no fp32)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")
                       .replace("[", r"\[")):
        config.load_config(None, overrides)


def test_layouts_that_pass(monkeypatch):
    monkeypatch.setattr(convert, "_te_import_error", lambda: None)  # as on trainers where TE imports
    cfg = config.load_config(None, ["device=cuda", "dtype=bfloat16", "trainer_workers=8", "tensor_parallel=2",
                                    "context_parallel=2", "sequence_parallel=true", "use_distributed_optimizer=true",
                                    "recompute=selective", "global_batch_size=16", "micro_batch_size=1",
                                    "prompts_per_step=4", "samples_per_prompt=4"])
    assert cfg.data_parallel == 2  # 8 ranks = TP 2 x CP 2 x DP 2
    assert config.fast_paths(cfg) == ("layer spec auto -> te here; distributed optimizer on; sequence parallel on; "
                                      "context parallel 2; recompute selective")
    # on CPU: sequence parallelism (TP >= 2), MoE under TP with it, and recomputation validate
    cfg = config.load_config(None, ["tensor_parallel=2", "trainer_workers=2", "sequence_parallel=true",
                                    "tiny_model.num_experts=4", "recompute=full", "megatron.recompute_num_layers=2"])
    assert config.fast_paths(cfg) == ("layer spec auto -> local here; distributed optimizer off; sequence parallel "
                                      "on; context parallel 1; recompute full")


def test_fused_norm_names_map_the_te_spec_back_to_local_names():
    te = ["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", "decoder.layers.0.self_attention.linear_qkv"
          ".weight", "decoder.layers.0.mlp.linear_fc1.layer_norm_weight", "decoder.layers.1.self_attention.linear_qkv."
          "layer_norm_weight", "decoder.layers.1.pre_mlp_layernorm.weight", "decoder.final_layernorm.weight"]
    assert convert.fused_norm_names(te) == {  # layer 1: an MoE layer keeps its pre-MLP norm
        "decoder.layers.0.input_layernorm.weight": "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.0.pre_mlp_layernorm.weight": "decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
        "decoder.layers.1.input_layernorm.weight": "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"}
    assert convert.fused_norm_names(["decoder.layers.0.input_layernorm.weight"] + te[1:2]) == {}  # the local spec
    assert convert.tp_split_dim(te[0]) is None and convert.tp_split_dim(te[2]) is None  # norms: replicated under TP


def test_cp_positions_split_every_sequence_into_balanced_chunks():
    assert trainer.cp_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert trainer.cp_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    parts = [trainer.cp_positions(24, r, 3) for r in range(3)]
    assert sorted(torch.cat(parts).tolist()) == list(range(24))
    assert [int(p.sum()) for p in parts] == [92, 92, 92]  # equal causal work: position sums equal


# ----------------------------------------------------------------------------------------------
# recomputation on CPU


@pytest.mark.slow
def test_recompute_gives_equal_gradients(ray_session, tiny_model_dir):
    def count_core_attention(worker):  # in the actor (a local function travels by value): count attention forwards
        counts = [0]
        for m in worker.policy.gpt.modules():
            if type(m).__name__.endswith("CoreAttention"):
                m.register_forward_hook(lambda *_: counts.__setitem__(0, counts[0] + 1))
        worker.attention_calls = counts

    batch = make_batch()
    out = {}
    # the three ranks start at once (an actor's start-up is one core's work: they overlap); each is its own world of
    # one computing with one torch thread, so side by side changes none of their sums
    started = {mode: Ranks(make_cfg(recompute=mode, kl_coef=0.0), 1) for mode in ("none", "selective", "full")}
    try:
        for mode, ranks in started.items():
            [info] = ranks.call("load_hf", tiny_model_dir)
            assert info["megatron"].endswith(f"recompute {mode}")
            ray.get(ranks.workers[0].__ray_call__.remote(count_core_attention))
            [metrics] = ranks.call("train_step", batch, 0)
            calls = ray.get(ranks.workers[0].__ray_call__.remote(lambda w: w.attention_calls[0]))
            [weights] = ranks.call("export_hf_weights")
            out[mode] = metrics, calls, weights
    finally:
        for ranks in started.values():
            ranks.close()
    (m0, calls0, w0) = out["none"]
    for mode in ("selective", "full"):
        m, calls, w = out[mode]
        assert (m["train/loss"], m["train/grad_norm"]) == (m0["train/loss"], m0["train/grad_norm"]), mode
        assert_same_weights(w, dict(w0))  # exact
        # 8 samples in micro-batches of 2: 4 forwards with grad x 2 layers, each attention once more in the backward
        # (the step's no-grad forwards, in eval mode, recompute nothing)
        assert calls - calls0 == 4 * 2, (mode, calls, calls0)


# ----------------------------------------------------------------------------------------------
# sequence parallelism (TP=2, gloo) and context parallelism (CP=2, the stand-in attention) against one rank


def _step(ranks: Ranks, model_dir: str, batch: list[dict]) -> tuple[list, dict, list]:
    ranks.call("load_hf", model_dir)
    logp = ranks.call("compute_logprobs", batch)
    assert max_diff(logp[0], logp[-1]) == 0.0  # every rank holds the same gathered result
    metrics = ranks.call("train_step", batch, 0)
    return logp[0], metrics[0], ranks.call("export_hf_weights")[0]


def _assert_same_step(a, b):
    (logp_a, m_a, w_a), (logp_b, m_b, w_b) = a, b
    assert max_diff(logp_a, logp_b) <= 1e-5
    for key in ("train/loss", "train/grad_norm", "critic/value_loss", "critic/grad_norm"):
        if key in m_a:
            assert m_b[key] == pytest.approx(m_a[key], rel=1e-5, abs=1e-7), key
    assert_same_weights(w_b, dict(w_a), exact=False, atol=2e-6)


@pytest.mark.slow
def test_sequence_parallel_tp2_matches_one_rank(ray_session, tiny_model_dir, moe_dir):  # noqa: F811
    dense, moe = make_batch(), make_batch(seed=1)
    gae = dict(advantage="gae", critic_lr=1e-2)
    one = Ranks(make_cfg(kl_coef=0.0, **gae), 1)
    # starts meanwhile
    sp = Ranks(make_cfg(kl_coef=0.0, tensor_parallel=2, trainer_workers=2, sequence_parallel=True, **gae), 2)
    try:
        ref = [_step(one, d, b) for d, b in ((tiny_model_dir, dense), (moe_dir, moe))]
    finally:
        one.close()
    try:
        [info, _] = sp.call("load_hf", tiny_model_dir)
        assert "sequence parallel on" in info["megatron"]
        got = [_step(sp, d, b) for d, b in ((tiny_model_dir, dense), (moe_dir, moe))]
    finally:
        sp.close()
    for a, b in zip(ref, got):
        assert "critic/value_loss" in a[1]  # the value head's gathered positions were trained too
        _assert_same_step(a, b)


@pytest.mark.slow
def test_context_parallel_cp2_matches_one_rank(ray_session, tiny_model_dir):
    def megatron_layout(worker):  # in a CP actor: Megatron's own split of a batch against trainer.cp_positions
        from megatron.core.utils import get_batch_on_this_cp_rank
        T = 12 * worker.par.cp_size
        theirs = get_batch_on_this_cp_rank({"tokens": torch.arange(T).unsqueeze(0)})["tokens"][0]  # (T/cp,)
        return theirs.tolist() == trainer.cp_positions(T, worker.par.cp_rank, worker.par.cp_size).tolist()

    batch = make_batch()  # rows of 5 to 15 tokens: every micro-batch is padded to a multiple of 2*CP = 4
    one = Ranks(make_cfg(kl_coef=0.0), 1)
    cp = Ranks(make_cfg(kl_coef=0.0, trainer_workers=2, context_parallel=2), 2)  # starts meanwhile
    try:
        ref = _step(one, tiny_model_dir, batch)
    finally:
        one.close()
    try:
        from tests.context_parallel import use_all_gather_attention
        ray.get([w.__ray_call__.remote(lambda w: use_all_gather_attention()) for w in cp.workers])
        assert all(ray.get([w.__ray_call__.remote(megatron_layout) for w in cp.workers]))
        got = _step(cp, tiny_model_dir, batch)
    finally:
        cp.close()
    _assert_same_step(ref, got)
