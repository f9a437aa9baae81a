"""FP32 LM head (`fp32_lm_head: true`) on both sides, with bf16 weights on CPU.

What it proves: with the flag the trainer's logits are fp32 (bf16 without) and the CPU engine's head is an fp32
matmul; the train-inference gap (mean |trainer logp - engine logp| over the engine's own greedy tokens) with the flag
on both sides is smaller than without it, and smaller than with the flag on one side only (an engine that ignored
it); with fp32 weights the flag changes nothing; SGLang gets --enable-fp32-lm-head.
"""

import pytest
import ray
import torch

import cpu_engine
import data
import rollout
import trainer
import transfermesh
from config import Config

pytestmark = pytest.mark.timeout(600)



def _bf16_trainers(model_dir: str, flags: tuple) -> list:
    """One trainer rank per fp32_lm_head flag, each running its model in bf16. The CPU trainer trains in fp32 only
    (its optimizer keeps no fp32 master weights), so the test casts the loaded model; the forward is the trainer's
    own. The ranks start together (an actor's start-up is one core's work: two overlap on two cores)."""
    workers = [ray.remote(num_cpus=1)(trainer.TrainerWorker).remote(
        Config(device="cpu", dtype="float32", seed=0, trainer_workers=1, micro_batch_size=8, trainer_threads=1,
               fp32_lm_head=flag), 0, 1, "127.0.0.1", transfermesh.free_port()) for flag in flags]
    ray.get([w.load_hf.remote(model_dir) for w in workers])
    ray.get([w.__ray_call__.remote(lambda self: self.policy.gpt.to(torch.bfloat16) and None) for w in workers])
    return workers


def _logits_dtype(w, batch):
    return ray.get(w.__ray_call__.remote(
        lambda self, b: self.policy.forward(trainer.collate(b), head="logits")["logits"].dtype, batch))


def _engine_rollouts(model_dir: str, prompts, fp32_lm_head: bool, dtype="bfloat16"):
    eng = cpu_engine.CpuEngine(model_dir, max_batch=16, max_len=128, dtype=dtype, fp32_lm_head=fp32_lm_head).start()
    try:
        outs = eng.generate(prompts, {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True})
    finally:
        eng.stop()
    return [dict(prompt_ids=p, response_ids=o["output_ids"], loss_mask=[1] * len(o["output_ids"]),
                 rollout_logprobs=[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]], reward=0.0,
                 group_id=i, sample_index=0) for i, (p, o) in enumerate(zip(prompts, outs))]


def _gap(w, batch) -> float:
    """Mean |trainer logp - engine logp| over every generated token."""
    got = ray.get(w.compute_logprobs.remote(batch))
    diffs = [abs(a - b) for s, lp in zip(batch, got) for a, b in zip(lp, s["rollout_logprobs"])]
    return sum(diffs) / len(diffs)


@pytest.mark.slow
def test_fp32_lm_head_narrows_the_bf16_train_inference_gap(ray_session, tiny_model_dir):
    prompts = [[(7 * i + 13 * j) % 300 + 10 for j in range(5 + i % 4)] for i in range(12)]
    plain = fp32 = None
    try:
        plain, fp32 = _bf16_trainers(tiny_model_dir, (False, True))
        off, on = _engine_rollouts(tiny_model_dir, prompts, False), _engine_rollouts(tiny_model_dir, prompts, True)
        assert _logits_dtype(plain, off[:2]) == torch.bfloat16 and _logits_dtype(fp32, on[:2]) == torch.float32
        gap_off, gap_on, gap_one_side = _gap(plain, off), _gap(fp32, on), _gap(fp32, off)
        print(f"bf16 train-inference gap: without {gap_off:.5f}, with {gap_on:.5f}, trainer only {gap_one_side:.5f}")
        assert gap_on <= gap_off and gap_on < gap_one_side, (gap_on, gap_off, gap_one_side)
    finally:
        for w in (plain, fp32):
            if w is not None:
                ray.kill(w)
    # fp32 weights: the casts are no-ops, the engine keeps its packed fp32 head (bit-identical logprobs)
    a, b = (_engine_rollouts(tiny_model_dir, prompts[:3], flag, dtype="float32") for flag in (False, True))
    assert [s["rollout_logprobs"] for s in a] == [s["rollout_logprobs"] for s in b]


def test_sglang_gets_the_fp32_lm_head_flag(tiny_model_dir):
    cfg = Config(model_path=tiny_model_dir, fp32_lm_head=True, sglang={"tp_size": 1})
    assert "--enable-fp32-lm-head" in rollout.sglang_command(cfg, "127.0.0.1", 30000, 0)
    assert "--enable-fp32-lm-head" not in rollout.sglang_command(Config(model_path=tiny_model_dir), "127.0.0.1", 1, 0)
