"""trainer.py against the real parts: Megatron-Core over gloo inside Ray actors, transformers as the reference.

What each test proves:
* parity: the converted HF checkpoint gives transformers' fp32 logprobs (max abs diff <= 1e-4) with
  TP=1 and TP=2, for Qwen3 (qk-norm), Qwen2 (qkv bias), Llama (tied embeddings), Qwen3-MoE and Mixtral
  (TP=2: Qwen3 and Qwen3-MoE);
* round trip: HF -> Megatron -> HF returns identical tensors (TP=1 and TP=2);
* gradient algebra: one train_step on a fixed batch gives the same loss, grad norm and updated
  weights with DP=2 (two actors) and TP=2 as with one rank (so DP gradients are summed, not averaged);
* learning: a few steps on a fixed batch move the loss and keep it finite;
* save_hf loads in transformers and reproduces the trainer's logprobs; a checkpoint resumes bit-exactly;
* use_rollout_logprobs: the train-inference gap is measured before the update (~0 for exact engine logprobs);
* pure helpers: response alignment in `collate`, DP-invariant mini-batch plans, the lr schedule.
"""
import math
import random
from pathlib import Path

import pytest
import ray
import torch

ROOT = Path(__file__).resolve().parents[1]

import convert  # noqa: E402
import cpu  # noqa: E402
import trainer  # noqa: E402
import transfermesh as tm  # noqa: E402
from config import Config  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def _free_port() -> int:
    return tm.free_port("127.0.0.1")


def make_cfg(**over) -> Config:
    """Small batches (8 samples in 2 mini-batches); lr and adam_eps large enough that one step moves
    weights measurably and smoothly (a large eps keeps Adam's first step proportional to the gradient,
    so the DP/TP comparisons are strict)."""
    base = dict(device="cpu", dtype="float32", seed=0, tensor_parallel=1, pipeline_parallel=1, trainer_workers=1,
                prompts_per_step=4, samples_per_prompt=2, global_batch_size=4, micro_batch_size=2, num_steps=10,
                lr=1e-2, min_lr=1e-2, adam_eps=1e-2, grad_clip=1.0, max_new_tokens=8,
                kl_coef=0.05)  # a KL term: every test also runs the frozen reference model
    base.update(over)
    return Config(**base)


class Ranks:
    """`n` TrainerWorker actors forming one torch.distributed world; `call` runs a method on all of them."""

    def __init__(self, cfg: Config, n: int):
        actor = ray.remote(num_cpus=1)(trainer.TrainerWorker)
        port = _free_port()
        self.workers = [actor.remote(cfg, r, n, "127.0.0.1", port) for r in range(n)]

    def call(self, method: str, *args):
        return ray.get([getattr(w, method).remote(*args) for w in self.workers])

    def close(self):
        self.call("shutdown")
        for w in self.workers:
            ray.kill(w)


@pytest.fixture(scope="module")
def tp1(ray_session):
    """One rank (TP=1, DP=1), reused by every test: each test starts with a fresh load_hf."""
    ranks = Ranks(make_cfg(), 1)
    yield ranks
    ranks.close()


def step_numbers(m: dict) -> dict:
    """A train step's metrics less its costs (timing/trainer_*, perf/trainer_*_core_s: seconds, never equal twice)."""
    return {k: v for k, v in m.items() if not (k.startswith("timing/") or k.endswith("_core_s"))}


def make_batch(n_groups=4, per_group=2, seed=0, vocab=384) -> list[dict]:
    """Trajectories with varied prompt/response lengths, a tool-token span (mask 0) and 0/1 rewards."""
    rng = random.Random(seed)
    batch = []
    for g in range(n_groups):
        prompt = [rng.randrange(10, vocab) for _ in range(rng.randint(3, 7))]
        for k in range(per_group):
            resp = [rng.randrange(10, vocab) for _ in range(rng.randint(2, 8))]
            mask = [1] * len(resp)
            if len(resp) > 4:
                mask[2:4] = [0, 0]  # tool tokens inside the response: never trained on
            batch.append(dict(prompt_ids=prompt, response_ids=resp, loss_mask=mask,
                              rollout_logprobs=[-6.0 * m for m in mask], weight_versions=[0 if m else -1 for m in mask],
                              reward=float((g + k) % 2), status="ok", group_id=g, sample_index=k))
    return batch


def hf_logprobs(model_dir: str, batch: list[dict]) -> list[torch.Tensor]:
    """transformers' fp32 logprob of every response token, one unpadded sequence at a time."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for s in batch:
        ids = torch.tensor([s["prompt_ids"] + s["response_ids"]])  # (1, T)
        with torch.no_grad():
            logits = model(ids).logits.float()  # (1, T, V)
        logp = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]  # (T-1,)
        out.append(logp[len(s["prompt_ids"]) - 1:])  # (R,) response tokens
    return out


def max_diff(a: list, b: list) -> float:
    return max(float((torch.as_tensor(x) - torch.as_tensor(y)).abs().max()) for x, y in zip(a, b))


def hf_state(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(Path(model_dir) / "model.safetensors"))


def assert_same_weights(exported: list, expected: dict, exact: bool = True, atol: float = 0.0):
    got = dict(exported)
    assert set(got) == set(expected), set(got) ^ set(expected)
    for name, t in expected.items():
        if exact:
            assert torch.equal(got[name], t), name
        else:
            torch.testing.assert_close(got[name], t, rtol=0, atol=atol, msg=name)


# ----------------------------------------------------------------------------------------------
# pure helpers: batching, mini-batch planning, lr schedule


def test_collate_aligns_response_tokens():
    batch = [dict(prompt_ids=[5, 6, 7], response_ids=[8, 9], loss_mask=[1, 0], rollout_logprobs=[-1.0, -2.0]),
             dict(prompt_ids=[4], response_ids=[3, 2, 1], loss_mask=[1, 1, 1], rollout_logprobs=[-1.0] * 3)]
    mb = trainer.collate(batch)
    assert mb["tokens"].tolist() == [[5, 6, 7, 8, 9], [4, 3, 2, 1, 0]]
    # the logits at position p-1+j predict response token j
    assert mb["resp_pos"].tolist() == [[2, 3, 0], [0, 1, 2]]
    assert mb["loss_mask"].tolist() == [[1, 0, 0], [1, 1, 1]]
    assert mb["rollout_logp"].tolist() == [[-1.0, 0.0, 0.0], [-1.0, -1.0, -1.0]]  # 0 off the loss mask


def test_minibatch_plan_keeps_groups_whole_and_ignores_dp_size():
    batch = [dict(group_id=g) for g in (7, 7, 3, 3, 9, 9, 1, 1, 5, 5)]
    whole = trainer.plan_minibatches(batch, 2, 0, 1, by_group=True)
    assert whole == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9]]
    ranks = [trainer.plan_minibatches(batch, 2, r, 2, by_group=True) for r in range(2)]
    assert ranks[0] == [[0, 1, 4, 5], [6, 7]] and ranks[1] == [[2, 3], [8, 9]]
    for i in range(2):  # every mini-batch is the same set of samples however many DP ranks share it
        assert sorted(ranks[0][i] + ranks[1][i]) == whole[i]
    # each share in order of length (prompt + response), ties in batch order: micro-batches of similar lengths
    lengths = [(1, 9), (1, 2), (2, 2), (1, 1), (3, 0), (1, 5)]
    batch = [dict(group_id=i // 2, prompt_ids=[0] * p, response_ids=[0] * r) for i, (p, r) in enumerate(lengths)]
    assert trainer.plan_minibatches(batch, 1, 0, 1, by_group=True) == [[3, 1, 4, 2, 5, 0]]
    assert trainer.plan_minibatches(batch, 1, 0, 2, by_group=True) == [[1, 4, 5, 0]]  # groups 0 and 2


def test_long_sequences_take_the_fused_attention_kernel():
    """Past EXPLICIT_ATTENTION_MAX_LEN tokens a micro-batch goes to torch's fused kernel however few its scores (it is
    faster there: cpu.py); up to it a small one takes the written-out path, which caches its causal mask by length."""
    import types
    attn = cpu.SDPACoreAttention(types.SimpleNamespace(attention_dropout=0.0), 1, None, "self")
    for S in (cpu.EXPLICIT_ATTENTION_MAX_LEN, cpu.EXPLICIT_ATTENTION_MAX_LEN + 1):
        out = attn(*(torch.randn(S, 1, n, 16) for n in (4, 2, 2)), attention_mask=None)
        assert out.shape == (S, 1, 4 * 16)
    assert list(attn._causal) == [cpu.EXPLICIT_ATTENTION_MAX_LEN]


def test_core_attention_written_out_equals_the_fused_kernel(monkeypatch):
    """SDPACoreAttention's two paths (the written-out one for short micro-batches, torch's fused kernel for long
    ones) compute the same causal GQA attention: outputs and the gradients of q, k and v agree to float rounding."""
    import types
    torch.manual_seed(0)
    S, B, Hq, KV, D = 7, 3, 4, 2, 16
    attn = cpu.SDPACoreAttention(types.SimpleNamespace(attention_dropout=0.0), 1, None, "self")
    inputs = [torch.randn(S, B, n, D, requires_grad=True) for n in (Hq, KV, KV)]  # Megatron's (S, B, N, D)
    grad_out = torch.randn(S, B, Hq * D)
    results = []
    for limit in (cpu.EXPLICIT_ATTENTION_MAX_SCORES, 0):  # 0: every micro-batch takes the fused kernel
        monkeypatch.setattr(cpu, "EXPLICIT_ATTENTION_MAX_SCORES", limit)
        out = attn(*inputs, attention_mask=None)
        grads = torch.autograd.grad(out, inputs, grad_out)
        results.append((out, grads))
    (out_a, grads_a), (out_b, grads_b) = results
    assert out_a.shape == (S, B, Hq * D)
    torch.testing.assert_close(out_a, out_b, rtol=0, atol=1e-6)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(ga, gb, rtol=0, atol=1e-5)
    monkeypatch.setattr(cpu, "EXPLICIT_ATTENTION_MAX_SCORES", 2 ** 24)
    q, k, v = (t.detach().clone() for t in inputs)
    k[-1] += 1.0  # a later key moves no earlier position's output (causal), and does move the last one's
    moved = attn(q, k, v, attention_mask=None)
    assert torch.equal(moved[:-1], out_a[:-1].detach()) and not torch.allclose(moved[-1], out_a[-1].detach())


def test_lr_schedule():
    cfg = make_cfg(lr=1.0, min_lr=0.1, lr_warmup_steps=2, num_steps=3, prompts_per_step=4, samples_per_prompt=2,
                   global_batch_size=4)  # 2 optimizer steps per RL step: 6 in all
    lrs = [trainer.lr_at(cfg, i) for i in range(7)]
    assert lrs[:2] == [0.5, 1.0] and lrs[2] == 1.0 and lrs[6] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(lrs[2:6], lrs[3:7]))  # cosine decay after warmup
    assert trainer.lr_at(make_cfg(lr=0.3, min_lr=0.3), 5) == 0.3  # min_lr == lr: constant


# ----------------------------------------------------------------------------------------------
# conversion: parity with transformers and the HF round trip


def test_bad_tensor_parallel_is_explained(tiny_model_dir):
    hf = convert.read_hf_config(tiny_model_dir)
    msg = r"tensor_parallel=3 does not divide num_attention_heads=4; choose one of \[1, 2, 4\]"
    with pytest.raises(ValueError, match=msg):
        convert.megatron_config(hf, make_cfg(tensor_parallel=3), cpu=True)


def _tiny_family(kind: str, out: Path) -> str:
    """A random 2-layer model of another family, with non-trivial norms and biases, saved as HF."""
    import transformers as tf
    common = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    cls, config = {
        "qwen2": (tf.Qwen2ForCausalLM, lambda: tf.Qwen2Config(**common)),
        "llama_tied": (tf.LlamaForCausalLM, lambda: tf.LlamaConfig(**common, tie_word_embeddings=True)),
        "qwen3_moe": (tf.Qwen3MoeForCausalLM, lambda: tf.Qwen3MoeConfig(
            **common, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)),
        "mixtral": (tf.MixtralForCausalLM,
                    lambda: tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)),
    }[kind]
    torch.manual_seed(0)
    model = cls(config()).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))  # ones/zeros at init would hide a mis-mapped norm or bias
    model.save_pretrained(str(out / kind))
    return str(out / kind)


def test_tp1_parity_and_round_trip(tp1, tiny_model_dir):
    tp1.call("load_hf", tiny_model_dir)
    batch = make_batch()
    [logp] = tp1.call("compute_logprobs", batch)
    assert [len(x) for x in logp] == [len(s["response_ids"]) for s in batch]
    assert max_diff(logp, hf_logprobs(tiny_model_dir, batch)) <= 1e-4
    [exported] = tp1.call("export_hf_weights")
    assert_same_weights(exported, hf_state(tiny_model_dir))


@pytest.mark.parametrize("kind", ["qwen2", "llama_tied", "qwen3_moe", "mixtral"])
def test_other_families_parity_and_round_trip(tp1, tmp_path, kind):
    model_dir = _tiny_family(kind, tmp_path)
    tp1.call("load_hf", model_dir)
    batch = make_batch(2, 2, seed=1, vocab=128)
    [logp] = tp1.call("compute_logprobs", batch)
    assert max_diff(logp, hf_logprobs(model_dir, batch)) <= 1e-4
    [exported] = tp1.call("export_hf_weights")
    assert_same_weights(exported, hf_state(model_dir))


@pytest.mark.slow
def test_tp2_parity_round_trip_and_step_matches_tp1(tp1, tiny_model_dir, tmp_path):
    batch = make_batch()
    moe_dir = _tiny_family("qwen3_moe", tmp_path)  # experts split over TP too (expert TP = TP)
    moe_batch = make_batch(2, 2, seed=1, vocab=128)
    tp1.call("load_hf", tiny_model_dir)
    [m1] = tp1.call("train_step", batch, 0)
    [w1] = tp1.call("export_hf_weights")

    tp2 = Ranks(make_cfg(tensor_parallel=2, trainer_workers=2), 2)
    try:
        tp2.call("load_hf", tiny_model_dir)
        logp_a, logp_b = tp2.call("compute_logprobs", batch)
        assert max_diff(logp_a, hf_logprobs(tiny_model_dir, batch)) <= 1e-4
        assert max_diff(logp_a, logp_b) == 0.0  # both TP ranks see the same gathered result
        exported, other = tp2.call("export_hf_weights")
        assert other == []  # only rank 0 holds the HF tensors
        assert_same_weights(exported, hf_state(tiny_model_dir))
        m2, _ = tp2.call("train_step", batch, 0)
        w2, _ = tp2.call("export_hf_weights")

        tp2.call("load_hf", moe_dir)
        moe_logp, _ = tp2.call("compute_logprobs", moe_batch)
        assert max_diff(moe_logp, hf_logprobs(moe_dir, moe_batch)) <= 1e-4
        moe_exported, _ = tp2.call("export_hf_weights")
        assert_same_weights(moe_exported, hf_state(moe_dir))
    finally:
        tp2.close()
    for key in ("train/loss", "train/grad_norm", "train/gap_k3"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
    assert_same_weights(w2, dict(w1), exact=False, atol=2e-6)


# ----------------------------------------------------------------------------------------------
# data parallelism: summed gradients with global denominators


@pytest.mark.slow
def test_dp2_step_matches_dp1(tp1, tiny_model_dir):
    # 8 samples, global_batch_size 4: two mini-batches (two optimizer steps) of two groups; with DP=2
    # each rank gets one group of each, with DP=1 the lone rank runs two micro-batches per mini-batch
    batch = make_batch()
    tp1.call("load_hf", tiny_model_dir)
    [m1] = tp1.call("train_step", batch, 0)
    [w1] = tp1.call("export_hf_weights")
    dp2 = Ranks(make_cfg(trainer_workers=2), 2)
    try:
        dp2.call("load_hf", tiny_model_dir)
        m2a, m2b = dp2.call("train_step", batch, 0)
        w2, empty = dp2.call("export_hf_weights")
    finally:
        dp2.close()
    assert m1["train/num_minibatches"] == 2 and m2a == m2b and empty == []
    for key in ("train/loss", "train/grad_norm", "train/entropy", "train/gap_abs", "train/gap_max"):
        assert m2a[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key  # a DP average would halve grad_norm
    assert_same_weights(w2, dict(w1), exact=False, atol=2e-6)


# ----------------------------------------------------------------------------------------------
# packed sequences: the same numbers as padded rows, none of the padding


@pytest.mark.slow
def test_packed_sequences_equal_padded_rows(tp1, tiny_model_dir):
    """max_tokens_per_micro_batch packs consecutive samples into one row (THD, each sequence attending to itself,
    positions from 0). Against padded micro-batches of 2 rows: logprobs within fp32 rounding of each other and of
    transformers', one RL step's loss, grad norm and updated weights the same, and no padding computed (pad_frac 0
    against the padded rows' ~13%). A trajectory that failed before any model call (no response token) rides
    along. Then TP=2 with sequence parallelism, where a pack of odd length gets a padding sequence of its own
    (N a multiple of TP): the same as TP=1 to the tolerance TP itself costs."""
    batch = make_batch()
    batch[3] = {**batch[3], "response_ids": [], "loss_mask": [], "rollout_logprobs": [], "weight_versions": []}
    tp1.call("load_hf", tiny_model_dir)
    [want_logp] = tp1.call("compute_logprobs", batch)
    [m1] = tp1.call("train_step", batch, 0)
    [w1] = tp1.call("export_hf_weights")
    assert m1["train/pad_frac"] > 0.05
    for layout, n in (({}, 1), ({"tensor_parallel": 2, "trainer_workers": 2, "sequence_parallel": True}, 2)):
        packed = Ranks(make_cfg(max_tokens_per_micro_batch=31, **layout), n)
        try:
            packed.call("load_hf", tiny_model_dir)
            logp = packed.call("compute_logprobs", batch)[0]
            m2 = packed.call("train_step", batch, 0)[0]
            w2 = packed.call("export_hf_weights")[0]
        finally:
            packed.close()
        assert len(logp[3]) == len(want_logp[3]) == 0  # the failed trajectory: no response token, no logprob
        real = lambda rows: rows[:3] + rows[4:]  # noqa: E731
        assert max_diff(real(logp), real(want_logp)) <= 1e-6, layout
        assert max_diff(real(logp), hf_logprobs(tiny_model_dir, real(batch))) <= 1e-4
        # TP=1: none; SP: at most one token of each pack of ~31 (its length made even)
        assert m2["train/pad_frac"] == 0.0 if n == 1 else 0.0 <= m2["train/pad_frac"] < 0.05, (layout, m2)
        for key in ("train/loss", "train/grad_norm", "train/gap_k3", "train/entropy"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), (layout, key)
        assert_same_weights(w2, dict(w1), exact=False, atol=2e-6)


# ----------------------------------------------------------------------------------------------
# training, HF export, checkpoints


def test_steps_move_the_loss(tp1, tiny_model_dir):
    tp1.call("load_hf", tiny_model_dir)
    batch = make_batch()
    sft = [tp1.call("sft_step", batch)[0]["train/sft_loss"] for _ in range(4)]
    assert all(math.isfinite(x) for x in sft) and sft[-1] < sft[0] - 0.1, sft

    tp1.call("load_hf", tiny_model_dir)
    rewarded = [i for i, s in enumerate(batch) if s["reward"] > 0]

    def rewarded_logp():  # mean logp of the model tokens of reward-1 samples
        [lp] = tp1.call("compute_logprobs", batch)
        vals = [x for i in rewarded for x, m in zip(lp[i], batch[i]["loss_mask"]) if m]
        return sum(vals) / len(vals)

    before = rewarded_logp()
    metrics = [tp1.call("train_step", batch, step)[0] for step in range(3)]
    assert all(math.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0 for m in metrics)
    assert 0 <= metrics[0]["train/kl"] < metrics[-1]["train/kl"]  # the reference stays put, the policy leaves it
    # the policy moved away from the rollout: the batch (sampled by version 0) is off-policy at steps 1 and 2,
    # so the numerics-only gap is measured at step 0 alone and the off-policy k3 grows
    assert "train/gap_abs" in metrics[0] and "train/gap_abs" not in metrics[-1]
    assert metrics[-1]["train/offpolicy_k3"] > metrics[0]["train/offpolicy_k3"]
    assert rewarded_logp() > before + 0.05  # GRPO pushes up the rewarded samples


def test_moe_train_step_updates_experts_and_router_and_exports_them(tp1, tmp_path):
    """MoE (Qwen3-MoE, 4 experts, top-2) through train_step: finite metrics, the router and the experts that
    received tokens move, and the exported HF weights are the trained ones (transformers on them reproduces
    the trainer's logprobs of the same batch)."""
    import shutil
    from safetensors.torch import save_file
    moe_dir = _tiny_family("qwen3_moe", tmp_path)
    tp1.call("load_hf", moe_dir)
    batch = make_batch(4, 2, seed=1, vocab=128)  # 8 samples: two mini-batches, two optimizer steps
    [m] = tp1.call("train_step", batch, 0)
    assert all(math.isfinite(v) for v in m.values()) and m["train/grad_norm"] > 0 and m["train/num_minibatches"] == 2
    [exported] = tp1.call("export_hf_weights")
    before = hf_state(moe_dir)
    changed = {name for name, t in exported if not torch.equal(t, before[name])}
    assert {f"model.layers.{i}.mlp.gate.weight" for i in range(2)} <= changed  # the routers learn
    assert any(".mlp.experts." in name for name in changed)
    out = tmp_path / "trained"
    shutil.copytree(moe_dir, out)
    save_file({n: t.contiguous() for n, t in exported}, str(out / "model.safetensors"), metadata={"format": "pt"})
    [logp] = tp1.call("compute_logprobs", batch)
    assert max_diff(logp, hf_logprobs(str(out), batch)) <= 1e-4
    assert max_diff(logp, hf_logprobs(moe_dir, batch)) > 1e-3


def test_save_hf_loads_in_transformers(tp1, tiny_model_dir, tmp_path):
    tp1.call("load_hf", tiny_model_dir)
    batch = make_batch()
    tp1.call("train_step", batch, 0)
    tp1.call("save_hf", str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "tokenizer.json").exists()
    [logp] = tp1.call("compute_logprobs", batch)
    assert max_diff(logp, hf_logprobs(str(tmp_path / "hf"), batch)) <= 1e-4
    assert max_diff(logp, hf_logprobs(tiny_model_dir, batch)) > 1e-3  # the saved weights are the trained ones


def test_checkpoint_resumes_bit_exactly(tp1, tiny_model_dir, tmp_path):
    tp1.call("load_hf", tiny_model_dir)
    batch_a, batch_b = make_batch(seed=2), make_batch(seed=3)
    [m0] = tp1.call("train_step", batch_a, 0)
    [sums] = tp1.call("save_checkpoint", str(tmp_path / "ckpt"))
    [m_first] = tp1.call("train_step", batch_b, 1)
    [w_first] = tp1.call("export_hf_weights")
    tp1.call("load_hf", tiny_model_dir)  # a fresh model, as after a restart
    assert tp1.call("load_checkpoint", str(tmp_path / "ckpt"), sums) == [m0["train/optim_steps"]] == [2]
    [m_again] = tp1.call("train_step", batch_b, 1)
    [w_again] = tp1.call("export_hf_weights")
    assert step_numbers(m_again) == step_numbers(m_first)
    assert_same_weights(w_again, dict(w_first))


@pytest.mark.slow
def test_rollout_logprobs_as_behaviour_policy(ray_session, tiny_model_dir):
    # use_rollout_logprobs skips the old-logprob forward; the gap then comes from the first mini-batch's
    # forward, still before any update: with engine logprobs equal to the model's own, it is ~0
    batch = make_batch()
    for s, lp in zip(batch, hf_logprobs(tiny_model_dir, batch)):
        s["rollout_logprobs"] = [float(x) * m for x, m in zip(lp, s["loss_mask"])]
    one = Ranks(make_cfg(use_rollout_logprobs=True, is_correction="token"), 1)
    try:
        one.call("load_hf", tiny_model_dir)
        [m] = one.call("train_step", batch, 0)
    finally:
        one.close()
    assert m["train/gap_max"] < 1e-4 and m["train/gap_abs"] < 1e-5
    assert math.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0
