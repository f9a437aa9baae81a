"""DeepSeek-V3 end to end: multi-latent attention (MLA), shared experts, grouped bias-corrected sigmoid routing and
dense first layers, through the conversion, the trainer (Megatron-Core in Ray actors), the CPU engine, R3 and a run.

The model is data.py's tiny DeepSeek-V3 (3 layers, the first dense; 16 routed experts in 4 groups, top-4 within the
best 2 groups, one shared expert; q and kv latents; v heads of another size than q/k heads), every norm and every
score-correction bias random, so a dropped or swapped one shows. What each test proves:
* the real DeepSeek-V3 and Moonlight-16B-A3B configs convert at the GPU recipe's parallel sizes into the Megatron
  MLA / MoE settings that compute transformers' model (YaRN, groups, dense layers), and the variants the conversion
  cannot reproduce are refused with the reason; the GPU recipe passes `--check`;
* SDPACoreAttention (the CPU shim) takes MLA's value heads of another size than its query/key heads;
* parity: the trainer's fp32 logprobs are transformers' (max abs diff <= 1e-5) at TP=1 (with q compression, without,
  and with YaRN RoPE, which really changes the logprobs) and at TP=2 (both ranks), and HF -> Megatron -> HF is exact
  (training MoE models at TP > 1 is refused at --check: Megatron needs sequence parallelism for it);
* the CPU engine serves it as transformers computes it (logprobs <= 1e-5, the same experts per token, 0 rows for the
  dense layer as SGLang reports them) and takes weight updates by HF names, the score-correction bias included;
* R3: the trainer replaying a bf16 engine's routing dispatches every token of every MoE layer to the engine's
  experts, some token differently without replay, and the train-inference gap is smaller with replay;
* a 3-step RL run (sync, fp32, router replay on) syncs the right weights every step (train-inference gap under the
  Qwen3 run's bounds), trains every weight but the frozen biases, and exports a model transformers loads.
"""
import base64
import dataclasses
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import ray
import torch

import config
import convert
import cpu
import cpu_engine
import data
import loongsage
import rollout
import trainer
import transfermesh
from test_moe import _hf_from, bf16_rollout
from test_trainer import Ranks, assert_same_weights, hf_logprobs, hf_state, make_batch, make_cfg, max_diff

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(900)

DS = dict(model_type="deepseek_v3", hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128,
          norm_std=0.2, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, n_group=4, topk_group=2,
          n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, q_lora_rank=48, kv_lora_rank=32,
          qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
LAYERS, TOPK, DENSE = 3, 4, 1


def _build(**over) -> str:
    s = {**DS, **over}
    return data.build_tiny_model(data.default_cache_dir() / f"tiny-deepseek-{data.settings_hash(s)}", **s)


@pytest.fixture(scope="module")
def ds_dir() -> str:
    return _build()


def _with_yarn(model_dir: str, out: Path) -> str:
    """The same weights under YaRN RoPE (the scaling DeepSeek-V3 ships, shrunk: 128 positions stretched 4 times to
    the tiny model's 512, both mscales set so cos/sin and the softmax scale both change)."""
    shutil.copytree(model_dir, out)
    hf = json.loads((out / "config.json").read_text())
    hf["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0, "beta_fast": 32,
                             "beta_slow": 1, "original_max_position_embeddings": 128, "mscale": 1.0,
                             "mscale_all_dim": 0.8}
    (out / "config.json").write_text(json.dumps(hf))
    return str(out)


def _decode(b64: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype="<i4").reshape(-1, LAYERS, TOPK)  # (n, L, K)


# ----------------------------------------------------------------------------------------------
# conversion: real configs, refusals, the recipe


# The shapes of the published config.json files (no weights needed to check the conversion of the architecture).
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
    qk_nope_head_dim=128, topk_method="noaux_tc", n_group=8, topk_group=4, num_experts_per_tok=8, moe_layer_freq=1,
    first_k_dense_replace=3, norm_topk_prob=True, scoring_func="sigmoid", hidden_act="silu",
    max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000, num_nextn_predict_layers=1,
    rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                  "original_max_position_embeddings": 4096, "type": "yarn"},
    attention_bias=False, tie_word_embeddings=False)
MOONLIGHT = dict(
    model_type="deepseek_v3", vocab_size=163840, hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408,
    num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64,
    routed_scaling_factor=2.446, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128,
    qk_nope_head_dim=128, topk_method="noaux_tc", n_group=1, topk_group=1, num_experts_per_tok=6, moe_layer_freq=1,
    first_k_dense_replace=1, norm_topk_prob=True, scoring_func="sigmoid", hidden_act="silu",
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=50000.0, rope_scaling=None, attention_bias=False,
    tie_word_embeddings=False)


def test_real_configs_convert_and_the_gpu_recipe_checks():
    recipe = config.load_config(str(ROOT / "recipes/moonlight_16b_gpu.yaml"))  # --check's validation
    assert recipe.expert_parallel == 8 and recipe.router_replay and recipe.data_parallel == 8
    tcfg, kwargs = convert.megatron_config(MOONLIGHT, recipe, cpu=False)
    assert (tcfg.multi_latent_attention, tcfg.q_lora_rank, tcfg.kv_lora_rank, tcfg.qk_head_dim,
            tcfg.qk_pos_emb_head_dim, tcfg.v_head_dim) == (True, None, 512, 128, 64, 128)
    assert tcfg.rope_type == "rope" and tcfg.rotary_base == 50000.0 and kwargs["rotary_base"] == 50000.0
    assert tcfg.moe_layer_freq == [0] + [1] * 26 and tcfg.moe_shared_expert_intermediate_size == 2 * 1408
    assert tcfg.moe_router_num_groups is None and tcfg.moe_router_topk_scaling_factor == 2.446  # one group: plain top-k
    assert tcfg.moe_enable_routing_replay and tcfg.bf16 and tcfg.moe_router_score_function == "sigmoid"

    v3 = dataclasses.replace(recipe, tensor_parallel=8, trainer_workers=64, router_replay=False)
    tcfg, _ = convert.megatron_config(DEEPSEEK_V3, v3, cpu=False)
    assert (tcfg.moe_router_num_groups, tcfg.moe_router_group_topk, tcfg.moe_router_topk) == (8, 4, 8)
    assert tcfg.moe_layer_freq[:4] == [0, 0, 0, 1] and len(tcfg.moe_layer_freq) == 61
    assert (tcfg.rope_type, tcfg.rotary_scaling_factor, tcfg.original_max_position_embeddings, tcfg.mscale,
            tcfg.mscale_all_dim) == ("yarn", 40.0, 4096, 1.0, 1.0)


def test_multi_token_prediction_weights_are_dropped_and_nothing_else(ds_dir):
    """DeepSeek-V3 checkpoints carry their multi-token-prediction layer after the last layer: the conversion drops
    it (the model RL trains has none), and still refuses any other tensor it cannot map."""
    hf, state = convert.read_hf_config(ds_dir), convert.load_hf_state(ds_dir)
    mtp = {**state, f"model.layers.{LAYERS}.eh_proj.weight": torch.zeros(64, 128)}
    assert convert.hf_to_megatron(mtp, {**hf, "num_nextn_predict_layers": 1}).keys() == \
        convert.hf_to_megatron(state, hf).keys()
    with pytest.raises(ValueError, match=f"no Megatron counterpart: \\['model.layers.{LAYERS}.eh_proj.weight'\\]"):
        convert.hf_to_megatron(mtp, hf)


@pytest.mark.parametrize("change, message", [
    (dict(topk_group=2), r"num_experts_per_tok=8 / topk_group=2 != 2 \(Megatron scores a group"),
    (dict(norm_topk_prob=False), "norm_topk_prob=false"),
    (dict(rope_interleave=False), "rope_interleave=false"),
    (dict(scoring_func="softmax"), "scoring_func='softmax'"),
    (dict(rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": 0.7}),
     "mscale=0.7 but no mscale_all_dim"),
    (dict(kv_lora_rank=510), r"tensor_parallel=8 does not divide kv_lora_rank \+ qk_rope_head_dim=574"),
])
def test_unsupported_variants_are_refused_with_the_reason(change, message):
    cfg = config.Config(tensor_parallel=8, trainer_workers=8)
    with pytest.raises(ValueError, match=message):
        convert.megatron_config({**DEEPSEEK_V3, **change}, cfg, cpu=False)


def test_core_attention_takes_value_heads_of_another_size(monkeypatch):
    """MLA gives the core attention q/k heads of qk_nope + qk_rope dims and v heads of v_head_dim: both paths of the
    CPU shim return (S, B, Nq * Dv) equal to softmax(q k^T * scale + causal) v computed directly."""
    import types
    torch.manual_seed(0)
    S, B, H, D, Dv, scale = 5, 2, 3, 24, 12, 0.3
    attn = cpu.SDPACoreAttention(types.SimpleNamespace(attention_dropout=0.0), 1, None, "self", softmax_scale=scale,
                                 k_channels=D, v_channels=Dv)
    q, k, v = torch.randn(S, B, H, D), torch.randn(S, B, H, D), torch.randn(S, B, H, Dv)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * scale + torch.full((S, S), float("-inf")).triu(1)
    ref = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v).reshape(S, B, H * Dv)
    for limit in (cpu.EXPLICIT_ATTENTION_MAX_SCORES, 0):  # the written-out path, then torch's fused kernel
        monkeypatch.setattr(cpu, "EXPLICIT_ATTENTION_MAX_SCORES", limit)
        torch.testing.assert_close(attn(q, k, v, attention_mask=None), ref, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# parity with transformers at TP=1 and TP=2


@pytest.fixture(scope="module")
def tp1(ray_session):
    ranks = Ranks(make_cfg(), 1)
    yield ranks
    ranks.close()


@pytest.mark.slow
def test_tp1_parity_and_round_trip(tp1, ds_dir, tmp_path):
    batch = make_batch()
    plain = None
    for model_dir in (ds_dir, _build(q_lora_rank=0), _with_yarn(ds_dir, tmp_path / "yarn")):
        tp1.call("load_hf", model_dir)
        [logp] = tp1.call("compute_logprobs", batch)
        ref = hf_logprobs(model_dir, batch)
        diff = max_diff(logp, ref)
        print(f"{Path(model_dir).name}: TP=1 max |logp - transformers| = {diff:.2e}")
        assert diff <= 1e-5
        [exported] = tp1.call("export_hf_weights")
        assert_same_weights(exported, hf_state(model_dir))  # bit-exact, score-correction biases included
        plain = ref if plain is None else plain
    assert max_diff(ref, plain) > 1e-4  # YaRN (the last one) moved the logprobs far beyond the bound: it is seen


@pytest.mark.slow
def test_tp2_parity_and_round_trip(ray_session, ds_dir):
    """Heads, the latents' down-projections (gathered back before use), shared experts and experts split in two."""
    batch = make_batch()
    tp2 = Ranks(make_cfg(tensor_parallel=2, trainer_workers=2), 2)
    try:
        tp2.call("load_hf", ds_dir)
        logp_a, logp_b = tp2.call("compute_logprobs", batch)
        diff = max_diff(logp_a, hf_logprobs(ds_dir, batch))
        print(f"TP=2 max |logp - transformers| = {diff:.2e}")
        assert diff <= 1e-5 and max_diff(logp_a, logp_b) == 0.0  # both TP ranks see the same gathered result
        exported, other = tp2.call("export_hf_weights")
        assert other == []  # only rank 0 holds the HF tensors
        assert_same_weights(exported, hf_state(ds_dir))
    finally:
        tp2.close()


# ----------------------------------------------------------------------------------------------
# the CPU engine


def _hf_routing_and_logp(model, ids: list[int]) -> tuple[np.ndarray, torch.Tensor]:
    """transformers' experts per token and MoE layer (T, L - DENSE, K), sorted per token, and logprobs of ids[1:]."""
    caps = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda mod, inp, out: caps.append(out[2]))
             for layer in model.model.layers[DENSE:]]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()  # (T, V)
    for h in hooks:
        h.remove()
    logp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]  # (T-1,)
    return np.sort(torch.stack(caps, 1).numpy(), -1), logp


def _check_engine(out: dict, prompt: list[int], hf) -> float:
    """The engine's answer against transformers on prompt + output: same experts per token in every MoE layer, 0
    rows for the dense layer; returns the max logprob difference."""
    full = prompt + out["output_ids"]
    routed = _decode(out["meta_info"]["routed_experts"])
    assert routed.shape == (len(full) - 1, LAYERS, TOPK)
    ref_routing, ref_logp = _hf_routing_and_logp(hf, full)
    assert (routed[:, :DENSE] == 0).all() and (np.sort(routed[:, DENSE:], -1) == ref_routing[:-1]).all()
    got = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])
    return float((got - ref_logp[len(prompt) - 1:]).abs().max())


def test_cpu_engine_matches_transformers_and_takes_weight_updates(ds_dir):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(ds_dir, dtype=torch.float32).eval()
    url, handle = cpu_engine.serve(ds_dir, max_batch=8, max_len=128, seed=0)
    try:
        prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [40, 41, 42, 43]]
        sp = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}
        outs = rollout.post(url, "/generate", {"input_ids": prompts, "sampling_params": sp, "return_logprob": True,
                                                "return_routed_experts": True})
        diffs = [_check_engine(o, p, hf) for p, o in zip(prompts, outs)]
        print(f"CPU engine max |logp - transformers| = {max(diffs):.2e}")
        assert max(diffs) <= 1e-5
        # an update by HF names, the routers' weights and biases included, reaches what the engine computes
        torch.manual_seed(1)
        new = convert.load_hf_state(ds_dir)
        for name in [n for n in new if ".mlp." in n or "kv_b_proj" in n]:
            new[name] = new[name] + 0.2 * torch.randn_like(new[name])
        handle.engine.load_weights(list(new.items()), version=1)
        rollout.post(url, "/flush_cache", {})  # as the controller does after an update: no prefix K/V of old weights
        out = rollout.post(url, "/generate", {"input_ids": prompts[1], "sampling_params": sp, "return_logprob": True,
                                              "return_routed_experts": True})
        assert _check_engine(out, prompts[1], _hf_from(ds_dir, new)) <= 1e-5
    finally:
        handle.shutdown()


# ----------------------------------------------------------------------------------------------
# R3 and a run


@pytest.mark.slow
def test_router_replay_routes_as_the_bf16_engine(ray_session, ds_dir):
    # the two trainer ranks (each its own world of one) start while the engine generates
    workers = {replay: ray.remote(num_cpus=1)(trainer.TrainerWorker).remote(
        make_cfg(router_replay=replay, kl_coef=0.0, prompts_per_step=8, global_batch_size=16, micro_batch_size=8),
        0, 1, "127.0.0.1", transfermesh.free_port()) for replay in (False, True)}
    try:
        results, n_tokens = _replay_results(workers, ds_dir)
    finally:
        for worker in workers.values():
            ray.kill(worker)
    (same_free, gap_free), (same_replay, gap_replay) = results[False], results[True]
    print(f"R3 on DeepSeek-V3: tokens routed as the engine {same_free}/{n_tokens} without replay, {same_replay} with; "
          f"mean |train - rollout| logp gap {gap_free:.2e} without, {gap_replay:.2e} with")
    assert same_replay == n_tokens and same_free < n_tokens
    assert gap_replay < gap_free


def _replay_results(workers: dict, ds_dir: str) -> tuple[dict, int]:
    """Per replay setting: (tokens routed as the engine routed them, mean |train - rollout| logp gap); and how many
    tokens there are."""
    batch = bf16_rollout(ds_dir)  # 16 trajectories through AgentFlow, routing asked for
    # the engine's experts of the MoE layers, sorted per token: what routing_used reports
    engine = [torch.from_numpy(np.sort(_decode(t["routed_experts"])[:, DENSE:], -1).astype(np.int64)) for t in batch]
    n_tokens = sum(len(e) for e in engine)
    results = {}
    for replay, worker in workers.items():
        ray.get(worker.load_hf.remote(ds_dir))
        used = ray.get(worker.routing_used.remote(batch))  # per sample (P+R, L - DENSE, K)
        same = sum(int((u[:len(e)] == e).all(-1).all(-1).sum()) for u, e in zip(used, engine))
        logp = ray.get(worker.compute_logprobs.remote(batch))
        gap = sum(abs(a - b) for lp, t in zip(logp, batch) for a, b in zip(lp, t["rollout_logprobs"]))
        results[replay] = (same, gap / sum(len(lp) for lp in logp))
        if replay:
            metrics = ray.get(worker.train_step.remote(batch, 0))
            assert all(np.isfinite(v) for v in metrics.values()) and metrics["train/optim_steps"] == 1.0
        ray.get(worker.shutdown.remote())
    return results, n_tokens


@pytest.mark.slow
def test_three_step_rl_run(ray_session, tmp_path, monkeypatch):
    """Sync fp32 with router replay: step k trains on rollouts of weight version k; the gap bounds are the Qwen3
    run's (tests/test_loongsage.py), which a stale or wrong sync of any weight, bias included, would break."""
    monkeypatch.setenv("LOONGSAGE_CACHE", str(tmp_path / "cache"))
    cfg = config.load_config(str(ROOT / "recipes/arith_cpu.yaml"), [
        f"output_dir={tmp_path}/run", "num_steps=3", "prompts_per_step=4", "samples_per_prompt=4",
        "global_batch_size=8", "micro_batch_size=4", "max_new_tokens=6", "eval_every=0", "warmstart_steps=2",
        "warmstart_batch_size=8", "lr=1e-3", "print_every=1", "router_replay=true",
        "reward=tests.rewards.text_hash", f"tiny_model={json.dumps(DS)}"])
    history = loongsage.train(cfg)  # on the module's Ray (ray_session)
    steps = [h for h in history if "train/loss" in h]
    for h in steps:
        print({k: round(h[k], 8) for k in ("train/loss", "train/grad_norm", "train/gap_k3", "train/gap_abs",
                                          "train/gap_max", "rollout/reward_mean")})
    assert len(steps) == 3 and all(math.isfinite(h["train/loss"]) and h["train/grad_norm"] > 0 for h in steps)
    for i, h in enumerate(steps):
        assert h["train/gap_k3"] < 1e-6 and h["train/gap_max"] < 1e-4 and h["train/gap_abs"] < 1e-5, (i, h)
    assert [h["rollout/weight_version_max"] for h in steps] == [0, 1, 2]
    from safetensors.torch import load_file
    import fleet
    start = load_file(str(Path(fleet.warm_start_dir(cfg, fleet.base_model(cfg))) / "model.safetensors"))
    final = load_file(str(tmp_path / "run" / "final_hf" / "model.safetensors"))
    assert start.keys() == final.keys()
    unchanged = {k for k in start if torch.equal(start[k], final[k])}
    # every tensor trained but the frozen score-correction biases and the routed experts no token went to (with
    # weight decay 0 an expert moves only where tokens were dispatched to it: at least top_k per layer and step)
    biases = [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in range(DENSE, LAYERS)]
    assert sorted(k for k in unchanged if ".mlp.experts." not in k) == biases
    for i in range(DENSE, LAYERS):
        trained = {k.split(".")[5] for k in start if f"layers.{i}.mlp.experts." in k and k not in unchanged}
        print(f"layer {i}: {len(trained)} of {DS['num_experts']} experts trained")
        assert len(trained) >= TOPK
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final_hf")


def test_check_takes_router_replay_and_refuses_moe_training_under_tensor_parallel():
    cfg = config.finalize(config.Config(device="cpu", router_replay=True, tiny_model=DS))
    assert config._hf_config(cfg.model_path, cfg.tiny_model)["model_type"] == "deepseek_v3" and cfg.router_replay
    with pytest.raises(ValueError, match=r"tensor_parallel=2 with an MoE model \(deepseek_v3\).*use tensor_parallel=1 "
                                         "and split the experts with expert_parallel"):
        config.finalize(config.Config(device="cpu", tiny_model=DS, tensor_parallel=2, trainer_workers=2))
