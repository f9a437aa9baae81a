#!/usr/bin/env python
"""Scale on paper: Qwen3-30B-A3B and Qwen3-235B-A22B on 64 and 512 GPUs, computed from the models' configs.

    .venv/bin/python scripts/scaling.py          # the tables of docs/SCALING.md, as Markdown
    .venv/bin/python scripts/scaling.py --json   # the same numbers as JSON

For each (model, GPU count) one layout LoongSage accepts (each is validated by config.load_config, the rules
`--check` runs), and from the HF config.json numbers below:
* parameters (total / active per token) and the trainer's memory per GPU: bf16 weights, fp32 gradients (DDP's
  grad_reduce_in_fp32), Adam's fp32 master + two moments sharded by the distributed optimizer over the ranks that
  hold the same shard (data-parallel ranks for dense weights, expert-data-parallel ranks for experts);
* one weight sync: its bytes (bf16, every parameter once) and what one engine GPU takes in (SGLang's weight loaders
  receive whole HF tensors and keep their own shard, so every engine GPU takes in all of them), as a time at the
  NVLink rate (colocated: the bytes come from a GPU of the same node) and at the InfiniBand rate (engines on their
  own nodes: an NCCL broadcast reaches every engine GPU through its own NIC);
* the train phase of one RL step at an assumed MFU, and what it implies: colocated, the sync's share of the
  trainer's time (phases alternate, nothing hides it; engines off rank 0's node get the broadcast, so the
  InfiniBand time applies once the layout spans nodes); on separate nodes, the staleness that hides the sync if it
  ran beside the next train step, ceil(t_sync / t_train) weight versions (LoongSage's trainer today waits for its
  push instead: there the sync adds t_sync to every step);
* host memory per node: colocated trainers park their weights and optimizer shards in pinned host memory between
  phases (the grads are freed, not copied); the node of trainer rank 0 also stages the sync: the whole model
  when the sync gathered it there, two buckets now that it streams (bucket_mb).

Every number is a lower bound of time or memory under the stated rates: no latency, no overlap lost, no allocator
slack, no activations beyond the layer inputs that full recomputation keeps.

Test: tests/test_scaling.py (runs this file; the parameter counts against the models' published sizes).
Left out: measured throughput (nothing here ran on a GPU), SGLang's KV cache sizing, pipeline bubbles, FP8.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import unittest.mock
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import config  # noqa: E402  (the layouts are checked by the rules --check runs)
import convert  # noqa: E402

# The published HF config.json values (huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json and
# huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json): every layer is MoE (decoder_sparse_step 1,
# mlp_only_layers []), untied embeddings, no attention biases, q/k RMSNorm over head_dim.
MODELS = {
    "Qwen3-30B-A3B": dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, tie_word_embeddings=False),
    "Qwen3-235B-A22B": dict(vocab_size=151936, hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
                            num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                            moe_intermediate_size=1536, tie_word_embeddings=False),
}
PUBLISHED_SIZE = {"Qwen3-30B-A3B": (30.5e9, 3.3e9), "Qwen3-235B-A22B": (235e9, 22e9)}  # the model cards' totals

# --- assumptions (change them here; SCALING.md states them) ---
GPUS_PER_NODE = 8
GPU_MEMORY_GB = {"H100 80GB": 80, "H200 141GB": 141}
BF16_PEAK_FLOPS = 989e12  # H100/H200 SXM dense bf16
MFU = 0.25  # of that peak in the train phase (an assumption for MoE RL training, not a measurement)
NVLINK_BYTES_S = 450e9  # NVLink 4: 900 GB/s per GPU counting both directions
IB_BYTES_S = 50e9  # one 400 Gb/s NDR NIC per GPU
STEP_SAMPLES, SEQ_LEN = 1024, 8192  # one RL step: 128 prompts x 8 samples of 8K tokens (prompt + response)
MICRO_TOKENS = 16384  # tokens in one micro-batch (activation estimate)
BUCKET_MB = 512  # the GPU recipes' bucket_mb

# One layout per (model, GPU count), in LoongSage's knobs. Colocated: every GPU trains and samples. Otherwise the
# trainers and the engines have nodes of their own (fully async). TP <= 4: Megatron splits the 4 KV heads over TP.
LAYOUTS = [
    dict(model="Qwen3-30B-A3B", gpus=64, colocate=True, trainer_gpus=64, tp=2, pp=1, cp=1, ep=8,
         engines=16, gpus_per_engine=4),
    dict(model="Qwen3-30B-A3B", gpus=512, colocate=False, trainer_gpus=256, tp=2, pp=1, cp=1, ep=8,
         engines=64, gpus_per_engine=4),
    dict(model="Qwen3-235B-A22B", gpus=64, colocate=True, trainer_gpus=64, tp=4, pp=1, cp=1, ep=16,
         engines=8, gpus_per_engine=8),
    dict(model="Qwen3-235B-A22B", gpus=512, colocate=False, trainer_gpus=256, tp=4, pp=1, cp=1, ep=16,
         engines=32, gpus_per_engine=8),
]


def param_counts(hf: dict) -> dict[str, float]:
    """Parameters of a Qwen3-MoE config: the dense part (embedding, LM head, attention, norms, routers), the
    experts, the total, and those one token uses (its top-k experts)."""
    H, L, d = hf["hidden_size"], hf["num_hidden_layers"], hf["head_dim"]
    q, kv = hf["num_attention_heads"] * d, hf["num_key_value_heads"] * d
    attention = H * q + 2 * H * kv + q * H + 2 * d  # q, k, v, o projections; q_norm, k_norm
    expert = 3 * H * hf["moe_intermediate_size"]  # gate, up, down
    per_layer_dense = attention + 2 * H + hf["num_experts"] * H  # + input/post-attention norms + router
    embeddings = hf["vocab_size"] * H * (1 if hf["tie_word_embeddings"] else 2) + H  # + final norm
    dense = L * per_layer_dense + embeddings
    experts = L * hf["num_experts"] * expert
    return {"dense": dense, "experts": experts, "total": dense + experts,
            "active": dense + L * hf["num_experts_per_tok"] * expert, "attention_width": q}


def check_layout(lay: dict) -> config.Config:
    """The layout as LoongSage config overrides, through the rules `--check` runs (an unsupported one raises). The
    model is a directory holding only its config.json, which is what those rules read of it. They are read as on
    trainers with Transformer Engine (sequence parallelism needs it on CUDA), wherever this script runs."""
    n = lay["trainer_gpus"]
    model_dir = Path(tempfile.mkdtemp(prefix="scaling-"))
    (model_dir / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", **MODELS[lay["model"]]}))
    with unittest.mock.patch.object(convert, "_te_import_error", lambda: None):
        return config.load_config(None, [
            f"model_path={model_dir}", "device=cuda", f"trainer_workers={n}", f"tensor_parallel={lay['tp']}",
            f"pipeline_parallel={lay['pp']}", f"context_parallel={lay['cp']}", f"expert_parallel={lay['ep']}",
            f"colocate={str(lay['colocate']).lower()}",
            f"num_engines={lay['engines']}", f"gpus_per_engine={lay['gpus_per_engine']}",
            f"sglang.tp_size={lay['gpus_per_engine']}", "sequence_parallel=true", "use_distributed_optimizer=true",
            "recompute=full", "dtype=bfloat16", "prompts_per_step=128", "samples_per_prompt=8",
            f"global_batch_size={STEP_SAMPLES}", "micro_batch_size=1", f"bucket_mb={BUCKET_MB}"])


def trainer_memory(p: dict, hf: dict, lay: dict, dp: int) -> dict[str, float]:
    """GB per trainer GPU. Dense weights split over TP x PP; experts over EP x expert-TP (= TP) x PP; the optimizer's
    fp32 master + moments (12 bytes/param) sharded over the ranks holding the same shard."""
    tp, pp, cp, ep, n = lay["tp"], lay["pp"], lay["cp"], lay["ep"], lay["trainer_gpus"]
    dense, experts = p["dense"] / (tp * pp), p["experts"] / (ep * tp * pp)  # params on one GPU
    expert_dp = n // (ep * tp * pp)
    weights, grads = 2 * (dense + experts), 4 * (dense + experts)
    optimizer = 12 * (dense / (dp * cp) + experts / expert_dp)  # dense grads reduce over DP x CP
    # full recomputation keeps each layer's input: (tokens, H) bf16 per local layer, split by SP and CP
    layer_inputs = MICRO_TOKENS * hf["hidden_size"] * 2 * hf["num_hidden_layers"] / (pp * tp * cp)
    gb = 1e9
    return {"params_per_gpu": dense + experts, "weights_gb": weights / gb, "grads_gb": grads / gb,
            "optimizer_gb": optimizer / gb, "layer_inputs_gb": layer_inputs / gb,
            "total_gb": (weights + grads + optimizer + layer_inputs) / gb}


def train_seconds(p: dict, hf: dict, lay: dict) -> float:
    """The train phase of one RL step: 8 FLOPs per active parameter and token (forward 2, backward 4, the full
    recomputation's second forward 2) plus causal attention's 8 * S * width per layer and token, at MFU."""
    per_token = 8 * p["active"] + 8 * hf["num_hidden_layers"] * SEQ_LEN * p["attention_width"] / 2
    return STEP_SAMPLES * SEQ_LEN * per_token / (lay["trainer_gpus"] * BF16_PEAK_FLOPS * MFU)


def row(lay: dict) -> dict:
    """Every number of one layout."""
    hf = MODELS[lay["model"]]
    cfg = check_layout(lay)
    p = param_counts(hf)
    mem = trainer_memory(p, hf, lay, cfg.data_parallel)
    sync_bytes = 2 * p["total"]  # bf16, each parameter once; also what each engine GPU takes in
    t_nvlink, t_ib = sync_bytes / NVLINK_BYTES_S, sync_bytes / IB_BYTES_S
    t_train = train_seconds(p, hf, lay)
    # colocated on one node the engines read the trainers' GPUs (CUDA IPC, NVLink); engines on other nodes, and
    # every engine when they have nodes of their own, get an NCCL broadcast through their NICs (transfer: auto)
    t_sync = t_nvlink if lay["colocate"] and lay["gpus"] <= GPUS_PER_NODE else t_ib
    per_node_offload = GPUS_PER_NODE * (mem["weights_gb"] + mem["optimizer_gb"]) if lay["colocate"] else 0.0
    return {
        **lay, "data_parallel": cfg.data_parallel, "params_total": p["total"], "params_active": p["active"],
        **mem, "fits": {name: mem["total_gb"] <= gb for name, gb in GPU_MEMORY_GB.items()},
        "sync_gb": sync_bytes / 1e9, "sync_s_nvlink": t_nvlink, "sync_s_ib": t_ib, "train_s": t_train,
        "sync_share": t_sync / (t_train + t_sync) if lay["colocate"] else None,
        "staleness_to_hide": None if lay["colocate"] else math.ceil(t_sync / t_train),
        "host_gb_per_node": per_node_offload,
        "host_gb_rank0_node_gathered": per_node_offload + sync_bytes / 1e9,
        "host_gb_rank0_node_streaming": per_node_offload + 2 * BUCKET_MB / 1e3,
    }


def markdown(rows: list[dict]) -> str:
    """The tables of docs/SCALING.md."""
    out = ["| model | GPUs | placement | trainer layout | engines | params total / active | trainer GB/GPU "
           "(weights + grads + optimizer + layer inputs) | fits 80 GB / 141 GB |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        where = ("colocated" if r["colocate"]
                 else f"{r['trainer_gpus']} trainer + {r['gpus'] - r['trainer_gpus']} engine GPUs")
        out.append(
            f"| {r['model']} | {r['gpus']} | {where} | {r['trainer_gpus']} ranks: TP {r['tp']} (SP) x EP {r['ep']}, "
            f"PP {r['pp']}, CP {r['cp']}, DP {r['data_parallel']} | {r['engines']} x {r['gpus_per_engine']} GPUs | "
            f"{r['params_total'] / 1e9:.1f}B / {r['params_active'] / 1e9:.2f}B | {r['weights_gb']:.1f} + "
            f"{r['grads_gb']:.1f} + {r['optimizer_gb']:.1f} + {r['layer_inputs_gb']:.1f} = {r['total_gb']:.1f} | "
            + " / ".join("yes" if ok else "no" for ok in r["fits"].values()) + " |")
    out += ["", "| model | GPUs | bytes per sync | at NVLink (450 GB/s) | at InfiniBand (50 GB/s) | train phase "
            "(MFU 0.25) | sync's share of the trainer's time (colocated) / staleness to hide it (separate nodes) | "
            "host GB per node: trainers' offload; rank 0's node gathering the model / streaming (now) |",
            "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        link = "NVLink" if r["colocate"] and r["gpus"] <= GPUS_PER_NODE else "InfiniBand"
        hide = (f"{100 * r['sync_share']:.1f}% ({link})" if r["colocate"]
                else f"{r['staleness_to_hide']} version(s) ({link})")
        out.append(f"| {r['model']} | {r['gpus']} | {r['sync_gb']:.1f} GB | {r['sync_s_nvlink']:.2f} s | "
                   f"{r['sync_s_ib']:.2f} s | {r['train_s']:.1f} s | {hide} | {r['host_gb_per_node']:.0f}; "
                   f"{r['host_gb_rank0_node_gathered']:.0f} / {r['host_gb_rank0_node_streaming']:.0f} |")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON instead of Markdown")
    args = parser.parse_args(argv)
    rows = [row(lay) for lay in LAYOUTS]
    print(json.dumps(rows, indent=1) if args.json else markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
