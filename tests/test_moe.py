"""MoE: routed-expert replay (R3) end to end, and the expert/pipeline-parallel layouts, on the real parts.

What each test proves:
* the CPU engine runs the tiny Qwen3-MoE as transformers does (logprobs and each token's top-k experts per
  layer), answers `return_routed_experts` in SGLang 0.5.23's shape (base64 int32 (tokens, layers, top_k) over
  positions [routed_experts_start_len, prompt + output - 1)), and takes weight updates by per-expert HF names;
* R3: trajectories built by AgentFlow over HTTP carry the engine's routing; the trainer (a Ray actor running
  Megatron-Core) replaying it dispatches every token of every layer to exactly the engine's experts, routes some
  token differently without replay (a bf16 engine against an fp32 trainer), and has a smaller train-inference
  logprob gap with replay than without on the same rollout; a train step with replay is finite;
* a multi-turn trajectory (an agent through the router) carries the routing of every token it holds;
* EP=2 (two actors, 4 experts each) takes the same step and exports the same weights as one rank, also when one
  expert rank has a micro-batch more than the other;
* `--check` refuses router_replay on a dense model and an expert_parallel that does not fit; SGLang is launched
  with --enable-return-routed-experts under router_replay.
"""
import asyncio
import base64
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import ray
import torch

import agentflow
import config
import convert
import cpu_engine
import data
import rollout
import trainer
import transfermesh

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(600)

MOE_SETTINGS = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    intermediate_size=128, norm_std=0.2, num_experts=8, num_experts_per_tok=2,
                    moe_intermediate_size=64)
LAYERS, TOPK = 2, 2


@pytest.fixture(scope="module")
def moe_dir() -> str:
    """A random tiny Qwen3-MoE (8 experts, top-2, every norm random), cached by its settings."""
    return data.build_tiny_model(data.default_cache_dir() / f"tiny-moe-{data.settings_hash(MOE_SETTINGS)}",
                                 **MOE_SETTINGS)


def _decode(b64: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype="<i4").reshape(-1, LAYERS, TOPK)  # (n, L, K)


def hf_routing_and_logp(model, ids: list[int]) -> tuple[np.ndarray, torch.Tensor]:
    """transformers' experts per token and layer (T, L, K) and log-probs (T-1,) of ids[1:]: the reference."""
    caps = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda mod, inp, out: caps.append(out[2]))
             for layer in model.model.layers]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()  # (T, V)
    for h in hooks:
        h.remove()
    logp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]  # (T-1,)
    return torch.stack(caps, 1).numpy(), logp  # (T, L, K), (T-1,)


# ----------------------------------------------------------------------------------------------
# the CPU engine on a Qwen3-MoE


def test_agentflow_keeps_routing_of_the_kept_tokens_only():
    rows = np.arange(5 * LAYERS * TOPK, dtype="<i4").reshape(5, LAYERS, TOPK)
    b64 = base64.b64encode(rows.tobytes()).decode()
    assert agentflow._routed_prefix(b64, 5, 5) == b64
    assert (_decode(agentflow._routed_prefix(b64, 5, 3)) == rows[:3]).all()  # a stop string cut two tokens
    with pytest.raises(RuntimeError, match="not a whole number of rows for 3 tokens"):
        agentflow._routed_prefix(b64, 3, 2)


def test_cpu_engine_moe_matches_transformers_and_reports_routed_experts(moe_dir, tiny_model_dir):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    url, handle = cpu_engine.serve(moe_dir, max_batch=8, max_len=128, seed=0)
    dense_url, dense = cpu_engine.serve(tiny_model_dir, max_batch=2, max_len=64, seed=0)
    try:
        prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [40, 41, 42, 43]]
        sp = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}
        outs = rollout.post(url, "/generate", {"input_ids": prompts, "sampling_params": sp, "return_logprob": True,
                                                "return_routed_experts": True})
        for ids, o in zip(prompts, outs):
            full = ids + o["output_ids"]
            routed = _decode(o["meta_info"]["routed_experts"])
            assert routed.shape == (len(full) - 1, LAYERS, TOPK)  # every position the model ran on, from 0
            ref_routing, ref_logp = hf_routing_and_logp(hf, full)
            assert (routed == ref_routing[:-1]).all()  # same experts, same order, per token per layer
            got = torch.tensor([x[0] for x in o["meta_info"]["output_token_logprobs"]])
            assert float((got - ref_logp[len(ids) - 1:]).abs().max()) <= 1e-5
        # routed_experts_start_len: rows from that position on, as SGLang slices them
        one = rollout.post(url, "/generate", {"input_ids": prompts[0], "sampling_params": dict(sp, sampling_seed=3),
                                               "return_routed_experts": True, "routed_experts_start_len": 3})
        full = prompts[0] + one["output_ids"]
        assert (_decode(one["meta_info"]["routed_experts"]) == hf_routing_and_logp(hf, full)[0][3:-1]).all()
        assert "routed_experts" not in rollout.post(url, "/generate", {"input_ids": prompts[0],
                                                                        "sampling_params": sp})["meta_info"]
        with pytest.raises(rollout.EngineError, match=r"routed_experts_start_len=9 must be an integer in \[0, 5\]"):
            rollout.post(url, "/generate", {"input_ids": prompts[0], "sampling_params": sp,
                                            "return_routed_experts": True, "routed_experts_start_len": 9})
        with pytest.raises(rollout.EngineError, match="HTTP 400: return_routed_experts=true but .* is a dense qwen3"):
            rollout.post(dense_url, "/generate", {"input_ids": prompts[0], "sampling_params": sp,
                                                  "return_routed_experts": True})
        # a weight update by per-expert checkpoint names (what TransferMesh sends) reaches the expert tensors
        torch.manual_seed(1)
        new = {n: p.detach().clone() for n, p in convert.load_hf_state(moe_dir).items()}
        for name in [n for n in new if ".experts." in n or ".mlp.gate." in n]:
            new[name] += 0.2 * torch.randn_like(new[name])
        handle.engine.load_weights(list(new.items()), version=1, flush_cache=True)  # no K/V of the old weights
        out = rollout.post(url, "/generate", {"input_ids": prompts[1], "sampling_params": sp, "return_logprob": True,
                                              "return_routed_experts": True})
        full = prompts[1] + out["output_ids"]
        ref_routing, ref_logp = hf_routing_and_logp(_hf_from(moe_dir, new), full)
        assert (_decode(out["meta_info"]["routed_experts"]) == ref_routing[:-1]).all()
        got = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])
        assert float((got - ref_logp[len(prompts[1]) - 1:]).abs().max()) <= 1e-5
    finally:
        handle.shutdown()
        dense.shutdown()


def _hf_from(model_dir: str, state: dict):
    """transformers' model with `state` (HF checkpoint names) loaded, through a saved directory."""
    import shutil
    import tempfile
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    tmp = Path(tempfile.mkdtemp())
    shutil.copy(Path(model_dir) / "config.json", tmp / "config.json")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32).eval()


async def two_turn_agent(client, sample):
    """Two model turns through the router (official openai client), a user turn in between."""
    msgs = list(sample["messages"])
    r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=5)
    msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "sure?"}]
    r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=5)
    return r.choices[0].message.content


def test_multi_turn_trajectory_carries_the_routing_of_every_token(moe_dir):
    """A 2-turn agent: the trajectory's routed_experts cover prompt + both turns + the template and user tokens
    between them (the second call ran on all of them), each row what transformers' router picks for that token."""
    from transformers import AutoModelForCausalLM
    url, handle = cpu_engine.serve(moe_dir, max_batch=8, max_len=256, seed=0)
    cfg = dataclasses.replace(config.Config(), reward="data.exact_match", agent="test_moe.two_turn_agent",
                              agent_command="", max_context_len=256, max_prompt_len=128, router_replay=True)

    async def body():
        flow = agentflow.AgentFlow(cfg, [url], moe_dir)
        out = await flow.generate(data.arith_samples(2, seed=3), 2, {"max_new_tokens": 5, "temperature": 1.0},
                                  step=0)
        await flow.close()
        return out
    try:
        trajs = asyncio.run(asyncio.wait_for(body(), 120))
    finally:
        handle.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    for t in trajs:
        assert t["status"] == "ok" and t["metadata"]["turns"] == 2 and 0 in t["loss_mask"]  # user turn inside
        ids = t["prompt_ids"] + t["response_ids"]
        routed = _decode(t["routed_experts"])
        assert routed.shape == (len(ids) - 1, LAYERS, TOPK)
        assert (routed == hf_routing_and_logp(hf, ids)[0][:-1]).all()
        assert t["segments"][-1]["routed_experts"] == t["routed_experts"]


# ----------------------------------------------------------------------------------------------
# R3: engine routing -> AgentFlow trajectory -> trainer collate -> Megatron's routers



def train_cfg(**over) -> config.Config:
    base = dict(device="cpu", dtype="float32", seed=0, tensor_parallel=1, pipeline_parallel=1, trainer_workers=1,
                prompts_per_step=8, samples_per_prompt=2, global_batch_size=16, micro_batch_size=8, num_steps=4,
                lr=1e-3, min_lr=1e-3, max_new_tokens=16, kl_coef=0.0, use_rollout_logprobs=False)
    base.update(over)
    return config.Config(**base)


def bf16_rollout(moe_dir: str) -> list[dict]:
    """16 trajectories from AgentFlow's single-turn path against a bf16 CPU engine over HTTP, routing asked for."""
    url, handle = cpu_engine.serve(moe_dir, max_batch=16, max_len=128, seed=0, dtype="bfloat16")
    cfg = dataclasses.replace(config.Config(), reward="data.exact_match", agent="", agent_command="",
                              max_context_len=128, max_prompt_len=64, router_replay=True)

    async def body():
        flow = agentflow.AgentFlow(cfg, [url], moe_dir)
        out = await flow.generate(data.arith_samples(8, seed=5), 2,
                                  {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}, step=0)
        await flow.close()
        return out
    try:
        return asyncio.run(asyncio.wait_for(body(), 120))
    finally:
        handle.shutdown()


@pytest.mark.slow
def test_router_replay_routes_as_the_engine_and_narrows_the_gap(ray_session, moe_dir):
    # the two trainer ranks (each its own world of one) start while the engine generates
    workers = {replay: ray.remote(num_cpus=1)(trainer.TrainerWorker).remote(train_cfg(router_replay=replay), 0, 1,
                                                                           "127.0.0.1", transfermesh.free_port())
               for replay in (False, True)}
    batch = bf16_rollout(moe_dir)
    assert len(batch) == 16
    for t in batch:  # AgentFlow kept the engine's routing: one row per token the engine ran on
        assert _decode(t["routed_experts"]).shape == (len(t["prompt_ids"]) + len(t["response_ids"]) - 1, LAYERS, TOPK)
    engine = [torch.from_numpy(_decode(t["routed_experts"]).astype(np.int64)).sort(-1).values for t in batch]
    n_tokens = sum(len(e) for e in engine)
    results = {}
    for replay, worker in workers.items():
        ray.get(worker.load_hf.remote(moe_dir))
        used = ray.get(worker.routing_used.remote(batch))  # per sample (P+R, L, K), sorted per token
        same = sum(int((u[:len(e)] == e).all(-1).all(-1).sum()) for u, e in zip(used, engine))
        logp = ray.get(worker.compute_logprobs.remote(batch))
        gap = sum(abs(a - b) for lp, t in zip(logp, batch) for a, b in zip(lp, t["rollout_logprobs"]))
        results[replay] = (same, gap / sum(len(lp) for lp in logp))
        if replay:  # a whole RL step with replay in its old-logp and training forwards
            metrics = ray.get(worker.train_step.remote(batch, 0))
            assert all(np.isfinite(v) for v in metrics.values()) and metrics["train/optim_steps"] == 1.0
        ray.get(worker.shutdown.remote())
        ray.kill(worker)
    (same_free, gap_free), (same_replay, gap_replay) = results[False], results[True]
    assert same_replay == n_tokens  # replayed: every token of every layer went to the engine's experts
    assert same_free < n_tokens     # the fp32 trainer alone routes some token unlike the bf16 engine (else no test)
    assert gap_replay < gap_free, (gap_replay, gap_free)


def test_check_rejects_router_replay_without_moe(tmp_path):
    with pytest.raises(ValueError, match="router_replay=true needs an MoE model .* 'tiny' is 'qwen3'.*"
                                         "tiny_model.num_experts > 0"):
        config.finalize(config.Config(router_replay=True, device="cpu"))
    cfg = config.finalize(config.Config(router_replay=True, device="cpu", tiny_model={"num_experts": 4}))
    assert cfg.router_replay


# ----------------------------------------------------------------------------------------------
# expert parallelism: EP=2 over gloo against one rank


class Ranks:
    """`n` TrainerWorker actors forming one torch.distributed world; `call` runs a method on all of them."""

    def __init__(self, cfg: config.Config, n: int):
        actor = ray.remote(num_cpus=1)(trainer.TrainerWorker)
        port = transfermesh.free_port()
        self.workers = [actor.remote(cfg, r, n, "127.0.0.1", port) for r in range(n)]

    def call(self, method: str, *args):
        return ray.get([getattr(w, method).remote(*args) for w in self.workers])

    def close(self):
        self.call("shutdown")
        for w in self.workers:
            ray.kill(w)


def token_batch(n_groups=4, per_group=2, seed=0, vocab=384) -> list[dict]:
    """Random prompt/response ids with 0/1 rewards (a gradient on every group) and a masked tool span."""
    import random
    rng = random.Random(seed)
    batch = []
    for g in range(n_groups):
        prompt = [rng.randrange(10, vocab) for _ in range(rng.randint(3, 7))]
        for k in range(per_group):
            resp = [rng.randrange(10, vocab) for _ in range(rng.randint(3, 8))]
            mask = [1] * len(resp)
            mask[1] = 0
            batch.append(dict(prompt_ids=prompt, response_ids=resp, loss_mask=mask, rollout_logprobs=[0.0] * len(resp),
                              weight_versions=[0] * len(resp), reward=float(k % 2), status="ok", group_id=g,
                              sample_index=k))
    return batch


def start_ranks(n: int, **over) -> Ranks:
    """`n` ranks for one_step; they start in the background (the first call waits for them)."""
    return Ranks(train_cfg(trainer_workers=n, prompts_per_step=4, samples_per_prompt=2, global_batch_size=8,
                           micro_batch_size=2, lr=1e-2, min_lr=1e-2, adam_eps=1e-2, grad_clip=0.5, **over), n)


def one_step(ranks: Ranks, moe_dir: str, batch: list[dict]) -> tuple[dict, dict, list]:
    """load_hf, one train_step, export: (metrics, exported weights, logprobs before the step) on `ranks`; closes them."""
    try:
        ranks.call("load_hf", moe_dir)
        logp = ranks.call("compute_logprobs", batch)[0]
        metrics = ranks.call("train_step", batch, 0)[0]
        exported = dict(ranks.call("export_hf_weights")[0])
    finally:
        ranks.close()
    return metrics, exported, logp


@pytest.mark.slow
def test_expert_parallel_2_matches_one_rank(ray_session, moe_dir):
    """EP=2 (two ranks, 4 of the 8 experts each, the dense layers data-parallel) takes the same step as one rank
    (`--check` accepts it now):
    same logprobs, loss and grad norm (the clip at 0.5 is active, so the experts' share of the norm must be summed
    over EP ranks), and the export gathers all 8 experts of every layer to the same weights."""
    batch = token_batch()
    # one trajectory with an earlier segment (a compacted history): its rank trains one row more, so one micro-batch
    # more than the other expert rank, which must join that micro-batch's dispatch with a padding-only one
    first = batch[0]
    batch[0] = dict(first, segments=[dict(prompt_ids=first["prompt_ids"][:3], response_ids=[11, 12, 13, 14],
                                          loss_mask=[1, 1, 1, 1], rollout_logprobs=[0.0] * 4, weight_versions=[0] * 4),
                                     {k: first[k] for k in ("prompt_ids", "response_ids", "loss_mask",
                                                            "rollout_logprobs", "weight_versions")}])
    one, two = start_ranks(1), start_ranks(2, expert_parallel=2)  # both worlds start together (3 actors)
    m1, w1, lp1 = one_step(one, moe_dir, batch)
    m2, w2, lp2 = one_step(two, moe_dir, batch)
    assert max(abs(a - b) for x, y in zip(lp1, lp2) for a, b in zip(x, y)) <= 1e-5
    assert m1["train/grad_norm"] > 0.5  # the clip acts
    for key in ("train/loss", "train/grad_norm", "train/pg_loss"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
    assert set(w1) == set(w2) == set(convert.load_hf_state(moe_dir))
    before = convert.load_hf_state(moe_dir)
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=1e-5, msg=name)
    moved = [n for n in w1 if ".experts." in n and not torch.equal(w1[n], before[n])]
    assert any(".experts.7." in n for n in moved) and any(".experts.0." in n for n in moved)  # both EP ranks' experts
    assert m2["train/rows"] == m1["train/rows"] == 9.0


def test_check_expert_parallel(moe_dir, tiny_model_dir):
    ok = config.finalize(config.Config(device="cpu", model_path=moe_dir, expert_parallel=2, trainer_workers=2,
                                       global_batch_size=256))
    assert ok.expert_parallel == 2 and ok.data_parallel == 2
    with pytest.raises(ValueError, match="expert_parallel=2 needs an MoE model, but .* is 'qwen3'"):
        config.finalize(config.Config(device="cpu", model_path=tiny_model_dir, expert_parallel=2,
                                      trainer_workers=2))
    with pytest.raises(ValueError, match="expert_parallel=3 does not divide the model's 8 experts"):
        config.finalize(config.Config(device="cpu", model_path=moe_dir, expert_parallel=3, trainer_workers=3))
    with pytest.raises(ValueError, match=r"trainer_workers=1 is not a multiple of .*expert_parallel=2; use 2"):
        config.finalize(config.Config(device="cpu", model_path=moe_dir, expert_parallel=2))


def test_sglang_launch_asks_for_routed_experts_with_router_replay(moe_dir):
    cmd = rollout.sglang_command(config.Config(model_path=moe_dir, router_replay=True), "127.0.0.1", 30000, 0)
    assert "--enable-return-routed-experts" in cmd  # SGLang 0.5.23 captures routing only with this server flag
    assert "--enable-return-routed-experts" not in rollout.sglang_command(config.Config(model_path=moe_dir),
                                                                         "127.0.0.1", 30000, 0)
