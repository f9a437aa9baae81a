"""FP32 LM head (`fp32_lm_head: true`) on both sides, with bf16 weights on CPU, tested where its effect is exact.

What it proves: the same bf16 hidden states through the trainer's LM head (Megatron's output layer, wrapped by
convert.fp32_output_layer) and the CPU engine's (ModelRunner.lm_head) give fp32 logits equal to the fp32 product
within 1e-6 on both sides with the flag; without it each side's logits are the bf16 rounding of that product (off
by up to bf16's half-ulp, and visibly off: bf16 cannot hold them); a flag on the trainer only leaves the engine's
bf16 rounding in (the one-sided control). The head's share of the train-inference gap is then zero by construction;
the body's share (every layer in bf16) is untouched, so no assertion compares whole-model gaps, whose difference is
one CPU's bf16 rounding. With fp32 weights the flag changes nothing; SGLang gets --enable-fp32-lm-head.
"""

import json
from pathlib import Path

import pytest
import ray
import torch

import cpu_model
import rollout
import trainer
import transfermesh
from config import Config

pytestmark = pytest.mark.timeout(600)

BF16_REL = 2.0 ** -8  # bf16 keeps 8 significant bits: rounding to nearest is off by at most half of 2**-7, relative


def _trainer_heads(model_dir: str, h: torch.Tensor) -> dict:
    """{flag: the trainer's LM-head logits of hidden states `h` (S, B, H)}, one rank per fp32_lm_head flag, each model
    cast to bf16 as a bf16 run holds it. The CPU trainer trains in fp32 only (its optimizer keeps no fp32 master
    weights), so the test casts the loaded model; the head is the trainer's own output layer."""
    workers = [ray.remote(num_cpus=1)(trainer.TrainerWorker).remote(
        Config(device="cpu", dtype="float32", seed=0, trainer_workers=1, micro_batch_size=8, trainer_threads=1,
               fp32_lm_head=flag), 0, 1, "127.0.0.1", transfermesh.free_port()) for flag in (False, True)]
    try:
        ray.get([w.load_hf.remote(model_dir) for w in workers])
        ray.get([w.__ray_call__.remote(lambda self: self.policy.gpt.to(torch.bfloat16) and None) for w in workers])
        return dict(zip((False, True), ray.get([w.__ray_call__.remote(
            lambda self, x: self.policy.gpt.output_layer(x)[0].detach(), h) for w in workers])))
    finally:
        for w in workers:
            ray.kill(w)


def _hidden(model_dir: str, *shape: int, seed: int) -> torch.Tensor:
    size = json.loads((Path(model_dir) / "config.json").read_text())["hidden_size"]
    return torch.randn(*shape, size, generator=torch.Generator().manual_seed(seed))


def _engine_head(model_dir: str, h: torch.Tensor, flag: bool, dtype: str = "bfloat16") -> torch.Tensor:
    runner = cpu_model.ModelRunner(model_dir, max_batch=h.shape[0], max_len=64, dtype=dtype, fp32_lm_head=flag)
    return runner.lm_head(h.to(runner.dtype).contiguous()), runner.model.lm_head.weight


@pytest.mark.slow
def test_fp32_lm_head_gives_both_sides_the_fp32_logits(ray_session, tiny_model_dir):
    h = _hidden(tiny_model_dir, 12, 1, seed=0).to(torch.bfloat16)  # (S, B, H)
    engine_on, weight = _engine_head(tiny_model_dir, h[:, 0], True)
    engine_off, _ = _engine_head(tiny_model_dir, h[:, 0], False)
    assert weight.dtype == torch.bfloat16 and h.shape[-1] == weight.shape[1]
    exact = h[:, 0].double() @ weight.double().T  # (S, V) the product of the bf16 operands, in float64
    heads = _trainer_heads(tiny_model_dir, h)
    trainer_off, trainer_on = heads[False][:, 0], heads[True][:, 0]  # (S, V)
    assert trainer_on.dtype == torch.float32 and trainer_off.dtype == torch.bfloat16
    assert engine_on.dtype == engine_off.dtype == torch.float32  # the engine upcasts after the matmul without the flag
    scale = exact.abs().max().item()
    on = {"trainer": (trainer_on.double() - exact).abs().max().item(),
          "engine": (engine_on.double() - exact).abs().max().item()}
    off = {"trainer": (trainer_off.double() - exact).abs(), "engine": (engine_off.double() - exact).abs()}
    print(f"logits |x - exact| max: with the flag {on}; without "
          f"{ {k: v.max().item() for k, v in off.items()} } (max |exact| {scale:.3f})")
    # with the flag: fp32 on both sides, equal to the exact product (and so to each other) up to fp32 accumulation
    assert max(on.values()) <= 1e-6 * max(1.0, scale), on
    assert (trainer_on - engine_on).abs().max().item() <= 2e-6 * max(1.0, scale)
    # without it: each side is the bf16 rounding of that product, no more (plus the accumulation's own bit) ...
    for side, err in off.items():
        assert (err <= BF16_REL * exact.abs() + 1e-6).all(), (side, err.max().item())
    # ... and really rounded: bf16 cannot hold these values, so most logits move
    assert (off["trainer"] > 1e-6).float().mean() > 0.5 and (off["engine"] > 1e-6).float().mean() > 0.5
    # one side only: the engine's bf16 rounding stays in the gap, the flag must be on both sides
    one_side = (trainer_on - engine_off).abs().max().item()
    assert one_side > 100 * max(on.values()) and one_side > 1e-5, (one_side, on)


def test_fp32_lm_head_is_a_no_op_for_fp32_weights(tiny_model_dir):
    """fp32 weights: the casts are no-ops, the engine keeps its packed fp32 head (bit-identical logits)."""
    h = _hidden(tiny_model_dir, 5, seed=1)
    a, _ = _engine_head(tiny_model_dir, h, False, dtype="float32")
    b, _ = _engine_head(tiny_model_dir, h, True, dtype="float32")
    assert torch.equal(a, b)


def test_sglang_gets_the_fp32_lm_head_flag(tiny_model_dir):
    cfg = Config(model_path=tiny_model_dir, fp32_lm_head=True, sglang={"tp_size": 1})
    assert "--enable-fp32-lm-head" in rollout.sglang_command(cfg, "127.0.0.1", 30000, 0)
    assert "--enable-fp32-lm-head" not in rollout.sglang_command(Config(model_path=tiny_model_dir), "127.0.0.1", 1, 0)
