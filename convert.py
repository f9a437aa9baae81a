"""HF <-> Megatron-Core: an HF model directory turned into a Megatron GPTModel and its weights, and back.

Top to bottom: `read_hf_config` and `megatron_config` (an HF `config.json` of Qwen3, Qwen2, Llama/Mistral,
Qwen3-MoE, Mixtral or DeepSeek-V3 as a Megatron `TransformerConfig`, an `MLATransformerConfig` for DeepSeek-V3, plus
the GPTModel arguments and Megatron's fast paths); `layer_spec` (Transformer Engine's or Megatron's local one);
`build_gpt_model` (one pipeline stage of a GPTModel, the LM head in fp32 on request: `fp32_output_layer`); the
weights, full (TP=1 layout, every expert, local-spec names, the name map written out above them): `load_hf_state`,
`hf_to_megatron`, `megatron_to_hf_tensor`, `fused_norm_names` (the TE spec's names of the norms it fuses), one
parameter's TP split / gather (`shard_for_rank`, `gather_full`), and `save_hf_dir`. Which shard a rank holds under
TP / EP / PP is the trainer's (`Model.load`, `Model.stream_full`).

Megatron-Core and transformers agree bit for bit on these conversions: a Qwen3 checkpoint loaded here gives
transformers' fp32 logprobs with max abs diff 0.0 on CPU (docs/CPU.md), so the tests that use them are strict.

Test: `.venv/bin/pytest tests/test_trainer.py -k "parity or tensor_parallel or save_hf"` (against transformers,
other families, TP=2, the HF round trip), tests/test_moe.py (experts and routers, EP=2), tests/test_pipeline.py,
tests/test_deepseek.py (DeepSeek-V3 at TP=1 and TP=2, YaRN, without q compression, real configs),
tests/test_fast_paths.py (the spec's names, recomputation on CPU; the TE spec itself needs CUDA:
scripts/gpu_check.sh).
Left out: sliding-window attention (exact below the window), biases other than Qwen2's qkv biases, activations
other than SwiGLU, rope scalings other than Llama-3.1's (and YaRN for DeepSeek-V3), Qwen3-MoE models that mix dense
and MoE layers, DeepSeek-V3's multi-token-prediction layers (dropped on load: RL trains the main model only),
DeepSeek-V3 with rope_interleave=false or norm_topk_prob=false, TE's grouped-GEMM experts (their weights are named
per GEMM, not per expert), FP8.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterable

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import cpu
# Megatron-Core is imported inside the functions that use it (`# Megatron: late`): it takes ~2 s to import, and the
# controller reads HF configs here without building a model.

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral", "qwen3_moe", "mixtral", "deepseek_v3")
# Files copied next to the weights by `save_hf_dir` so transformers (and the engines) can load the directory.
HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja",
                 "added_tokens.json", "tokenizer.model")

# ----------------------------------------------------------------------------------------------
# HF config -> Megatron TransformerConfig + GPTModel arguments


def read_hf_config(path: str | os.PathLike) -> dict:
    """config.json of an HF model directory as a dict, with the model family checked."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{cfg_path} does not exist; model_path must be an HF model directory")
    hf = json.loads(cfg_path.read_text())
    if hf.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type={hf.get('model_type')!r} in {cfg_path} is not supported; "
                         f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return hf


def _rope_theta(hf: dict, params: dict) -> float:
    """RoPE's base: in the rope parameters (transformers 5) or at the top level (transformers 4)."""
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _rope(hf: dict) -> tuple[float, bool, float]:
    """(rotary_base, rope_scaling, rope_scaling_factor) from either transformers 4 or 5 config keys."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = _rope_theta(hf, params)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "default":
        return theta, False, 1.0
    if rope_type == "llama3":
        # Megatron's llama3 scaling hard-codes low/high freq factors 1 and 4 and 8192 original positions.
        expect = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        got = {k: params.get(k) for k in expect}
        if any(got[k] != v for k, v in expect.items()):
            raise ValueError(f"llama3 rope scaling {got} differs from Megatron's built-in {expect}; "
                             "only the standard Llama-3.1 settings are supported")
        return theta, True, float(params.get("factor", 8.0))
    raise ValueError(f"rope_type={rope_type!r} is not supported; use a model with default or llama3 rope")


def _moe_settings(hf: dict) -> dict:
    """TransformerConfig MoE fields for Qwen3-MoE / Mixtral. Aux losses are off (RL fine-tuning of a
    trained router); turn them on through cfg.megatron (moe_router_load_balancing_type, moe_aux_loss_coeff)."""
    mt = hf["model_type"]
    if mt == "qwen3_moe":
        if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
            raise ValueError(f"qwen3_moe with mlp_only_layers={hf.get('mlp_only_layers')} / decoder_sparse_step="
                             f"{hf.get('decoder_sparse_step')} mixes dense and MoE layers; only all-MoE models "
                             "(mlp_only_layers=[] and decoder_sparse_step=1) are supported")
        n_exp, topk, ffn = _num_experts(hf), hf["num_experts_per_tok"], hf["moe_intermediate_size"]
        # norm_topk_prob: softmax over the top-k logits (= renormalised top-k probs); else top-k of the
        # softmax over all experts, which is Megatron's "pre_softmax" router.
        pre_softmax = not hf.get("norm_topk_prob", False)
    else:  # mixtral: softmax over the top-k logits
        n_exp, topk, ffn, pre_softmax = _num_experts(hf), hf["num_experts_per_tok"], hf["intermediate_size"], False
    return dict(num_moe_experts=n_exp, moe_router_topk=topk, moe_ffn_hidden_size=ffn,
                moe_router_pre_softmax=pre_softmax, **_MOE_COMMON)


# Every MoE model here: no aux losses, experts as plain per-expert MLPs (no grouped GEMM, which needs
# Transformer Engine), the allgather token dispatcher (gloo has no all-to-all), router math in fp32.
_MOE_COMMON = dict(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_grouped_gemm=False,
                   moe_token_dispatcher_type="allgather", moe_router_dtype="fp32")


def _yarn(hf: dict, params: dict) -> dict:
    """MLATransformerConfig's YaRN fields for a DeepSeek-V3 `rope_scaling` of type yarn, checked to give
    transformers' numbers: the same inverse frequencies (factor, original length, beta_fast/slow, truncated
    correction range), cos/sin scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim), and the softmax
    scale multiplied by mscale(factor, mscale_all_dim)^2 (mscale(s, m) = 0.1 m ln s + 1, arXiv 2309.00071)."""
    factor = params.get("factor") or hf["max_position_embeddings"] / params["original_max_position_embeddings"]
    if params.get("truncate", True) is not True or params.get("attention_factor") is not None:
        raise ValueError(f"yarn rope_scaling {params} sets truncate / attention_factor, which Megatron's MLA YaRN "
                         "does not take; only DeepSeek-V3's standard YaRN settings are supported")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if not mscale_all_dim and mscale not in (None, 1, 1.0):
        # transformers ignores mscale without mscale_all_dim; Megatron would scale cos/sin by it
        raise ValueError(f"yarn rope_scaling with mscale={mscale} but no mscale_all_dim is not supported; "
                         "give both (as DeepSeek-V3 does) or neither")
    return dict(rope_type="yarn", rotary_scaling_factor=float(factor),
                original_max_position_embeddings=int(params["original_max_position_embeddings"]),
                beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                mscale=float(mscale if mscale_all_dim else 1.0), mscale_all_dim=float(mscale_all_dim or 0.0))


def _deepseek_settings(hf: dict) -> dict:
    """MLATransformerConfig fields for a DeepSeek-V3-family config (DeepSeek-V3/R1, Moonlight, Kimi-K2 layouts).

    Attention is multi-latent (arXiv 2405.04434): q = W_qb RMSNorm(W_qa h) (or W_q h without q_lora_rank), a
    shared latent c = RMSNorm(W_kva h)[:kv_lora_rank] expanded per head by W_kvb into k_nope | v, one RoPE'd key
    part shared by all heads; transformers' rope_interleave=true is what Megatron's MLA RoPE computes (it
    de-interleaves the rotary half itself). MoE (arXiv 2412.19437): sigmoid scores s; experts chosen by s + b (b:
    the score-correction bias) among the topk_group groups of highest top-2 sums; gates = s of the chosen ones,
    normalised, times routed_scaling_factor; shared experts added; the first first_k_dense_replace layers dense.
    b is frozen (a pre-training load balancer; a trainer that moved it would route differently from the engines
    serving the same weights): build_gpt_model adds it to each router as a parameter without gradient."""
    n_exp, topk = hf["n_routed_experts"], hf["num_experts_per_tok"]
    n_group, topk_group = hf.get("n_group") or 1, hf.get("topk_group") or 1
    problems = []
    if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
        problems.append(f"scoring_func={hf.get('scoring_func')!r} / topk_method={hf.get('topk_method')!r} (only "
                        "sigmoid scores with noaux_tc bias-corrected selection, DeepSeek-V3's)")
    if not hf.get("norm_topk_prob", True) and topk > 1:
        problems.append("norm_topk_prob=false (Megatron normalises the top-k sigmoid gates)")
    if hf.get("rope_interleave", True) is False:
        problems.append("rope_interleave=false (Megatron's MLA RoPE is the interleaved one)")
    if hf.get("moe_layer_freq", 1) != 1:
        problems.append(f"moe_layer_freq={hf.get('moe_layer_freq')} (every layer after the dense ones must be MoE)")
    grouped = n_group > 1 and topk_group < n_group  # else every group is allowed: plain top-k
    if grouped and topk // topk_group != 2:
        # transformers scores a group by its top-2 sum; Megatron's group_limited_topk by its top-(topk/topk_group)
        problems.append(f"num_experts_per_tok={topk} / topk_group={topk_group} != 2 (Megatron scores a group by "
                        "the sum of its top topk/topk_group experts, transformers by its top 2)")
    if problems:
        raise ValueError("deepseek_v3 with " + "; ".join(problems) + " is not supported by the conversion")
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"deepseek_v3 with rope_type={rope_type!r} is not supported; use default or yarn rope")
    dense = int(hf.get("first_k_dense_replace") or 0)
    return dict(
        multi_latent_attention=True, q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
        qk_head_dim=hf["qk_nope_head_dim"], qk_pos_emb_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
        kv_channels=hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"],
        qk_layernorm=True,  # builds q_layernorm / kv_layernorm: the RMSNorms on the two latents
        rotary_base=_rope_theta(hf, params),
        **(_yarn(hf, params) if rope_type == "yarn" else dict(rope_type="rope")),
        num_moe_experts=n_exp, moe_router_topk=topk, moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_shared_expert_intermediate_size=hf["moe_intermediate_size"] * hf["n_shared_experts"]
        if hf.get("n_shared_experts") else None,
        moe_layer_freq=[0] * dense + [1] * (hf["num_hidden_layers"] - dense),
        moe_router_score_function="sigmoid",  # + the score-correction bias: build_gpt_model gives each router one
        moe_router_num_groups=n_group if grouped else None, moe_router_group_topk=topk_group if grouped else None,
        moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0), moe_router_pre_softmax=False,
        **_MOE_COMMON)


def _te_import_error() -> str | None:
    """Why `transformer_engine` does not import here, or None when it does."""
    try:
        import transformer_engine.pytorch  # noqa: F401  Transformer Engine: only probed, Megatron's spec uses it
    except (ImportError, OSError) as e:  # OSError: installed, but its CUDA libraries do not load
        return f"{type(e).__name__}: {e}"
    return None


def layer_spec(cfg, on_cpu: bool) -> str:
    """"te" (Transformer Engine's layer spec: fused norm+linear layers, TE's flash attention, sequence and context
    parallelism) or "local" (Megatron's own modules; on CPU with cpu.SDPACoreAttention and norms that take sequence
    parallelism, cpu.apply_cpu_shims): cfg.layer_spec with `auto` resolved on this machine, and what the spec cannot
    serve refused. `--check` runs it (config.check_fast_paths) where it is started, and every trainer again where
    the model is built."""
    if cfg.lora_rank and cfg.layer_spec == "te":
        raise ValueError(f"lora_rank={cfg.lora_rank} with layer_spec='te': TE's linear_qkv and linear_fc1 apply the "
                         "RMSNorm inside the layer, so the q/k/v/gate/up adapters, which read the layer's input, would "
                         "see un-normalised activations where SGLang and PEFT apply them after the norm (every step "
                         "after the first would diverge silently); set layer_spec=auto or local (auto builds the "
                         "local spec for LoRA)")
    if cfg.layer_spec == "local" or (cfg.layer_spec == "auto" and (on_cpu or cfg.lora_rank)):
        spec, why = "local", f"layer_spec={cfg.layer_spec!r}" + (" on CPU" if on_cpu else "") + (
            f" with lora_rank={cfg.lora_rank}" if cfg.lora_rank else "")
    elif on_cpu:
        raise ValueError("layer_spec='te' needs CUDA (Transformer Engine's kernels); set layer_spec=auto or local")
    else:
        error = _te_import_error()
        if error and cfg.layer_spec == "te":
            raise ValueError(f"layer_spec='te' but transformer_engine does not import here ({error}); install "
                             "Transformer Engine for this torch and CUDA (docs/GPU.md), or set layer_spec=auto")
        spec, why = ("local", f"transformer_engine does not import here ({error})") if error else ("te", "")
    todo = ""  # what gives the TE spec back (nothing does on CPU, nor with LoRA)
    if why.startswith("transformer_engine"):
        todo = "install Transformer Engine (docs/GPU.md), or "
    elif cfg.layer_spec == "local" and not on_cpu:
        todo = "set layer_spec=auto with transformer_engine installed, or "
    if spec == "local" and int(cfg.context_parallel) > 1:
        raise ValueError(f"context_parallel={cfg.context_parallel} needs Transformer Engine's attention, and the "
                         f"local spec is built ({why}); {todo}set context_parallel=1")
    if spec == "local" and cfg.sequence_parallel and not on_cpu:  # on CPU the shims mark the torch norms (cpu.py)
        raise ValueError(f"sequence_parallel=true needs Transformer Engine's layer spec on CUDA, and the local one is "
                         f"built ({why}), whose torch norms refuse sequence parallelism; {todo}set "
                         "sequence_parallel=false")
    if spec == "local" and cfg.max_tokens_per_micro_batch > 0 and not on_cpu:  # CPU: cpu.SDPACoreAttention takes THD
        raise ValueError(f"max_tokens_per_micro_batch={cfg.max_tokens_per_micro_batch} (packed sequences) needs "
                         f"Transformer Engine's attention on CUDA, and the local spec is built ({why}), whose "
                         f"attention takes no packed (THD) sequences; {todo}set max_tokens_per_micro_batch=0")
    return spec


def megatron_config(hf: dict, cfg, cpu: bool):
    """(TransformerConfig, GPTModel kwargs) for an HF config dict, with cfg's parallel sizes, dtype and fast paths
    (sequence / context parallelism, recomputation); the kwargs carry the layer spec (`layer_spec`).

    `cfg.megatron` (a dict) is passed through last, so any other TransformerConfig field can be overridden
    from a recipe (config.MEGATRON_OWNED lists those LoongSage sets from its own fields).
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig  # Megatron: late

    mt, tp = hf["model_type"], int(cfg.tensor_parallel)
    heads, kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads", hf["num_attention_heads"])
    split = [("num_attention_heads", heads), ("num_key_value_heads", kv_heads), ("vocab_size", hf["vocab_size"])]
    if mt == "deepseek_v3":  # the local spec's MLA down-projections are column-parallel: their outputs split too
        split += [("kv_lora_rank + qk_rope_head_dim", hf["kv_lora_rank"] + hf["qk_rope_head_dim"])]
        split += [("q_lora_rank", hf["q_lora_rank"])] if hf.get("q_lora_rank") else []
    for what, n in split:
        if n % tp:
            divisors = [d for d in range(1, n + 1) if n % d == 0 and d <= 16]
            raise ValueError(f"tensor_parallel={tp} does not divide {what}={n}; choose one of {divisors}")
    if hf.get("attention_bias") and mt != "qwen2" or hf.get("mlp_bias"):
        raise ValueError(f"{mt} with attention_bias={hf.get('attention_bias')} / mlp_bias={hf.get('mlp_bias')} has "
                         "biases on o_proj or the MLP, which the conversion does not map; only Qwen2-style qkv "
                         "biases are supported")
    # Sliding-window attention (Mistral v0.1, Qwen2 with use_sliding_window) is not applied: results are
    # exact for sequences shorter than the window, which RL rollouts on these models usually are.
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf.get('hidden_act')!r} is not supported; only SwiGLU (silu) MLPs are")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]  # bfloat16 on CUDA only: config.finalize
    base = dict(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_attention_heads=heads,
        num_query_groups=kv_heads, ffn_hidden_size=hf["intermediate_size"],
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        normalization="RMSNorm", layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=mt == "qwen2" or bool(hf.get("attention_bias", False)),
        qk_layernorm=mt in ("qwen3", "qwen3_moe"),
        hidden_dropout=0.0, attention_dropout=0.0,
        bias_dropout_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        # Each micro-batch loss is pre-divided by global counts: DDP must SUM gradients over DP ranks.
        calculate_per_token_loss=True,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=int(cfg.pipeline_parallel),
        expert_model_parallel_size=int(cfg.expert_parallel), sequence_parallel=bool(cfg.sequence_parallel),
        context_parallel_size=int(cfg.context_parallel),
        params_dtype=dtype, bf16=dtype == torch.bfloat16, pipeline_dtype=dtype,
        # perform_initialization stays on although the HF weights overwrite the init: it is also what marks
        # TP-sharded parameters (`tensor_model_parallel`), which grad-norm and clipping rely on.
        use_cpu_initialization=cpu,
        **_moe_settings(hf) if mt in ("qwen3_moe", "mixtral") else {},
    )
    if mt == "deepseek_v3":
        base.update(_deepseek_settings(hf))  # MLA heads, RoPE and MoE in place of the fields above
    if int(cfg.pipeline_parallel) > 1:  # the layouts it cannot split are refused by config.check_pipeline
        # Stages exchange activations of one fixed (T, B, H) shape per schedule run (trainer.Model._pipeline pads
        # every micro-batch to it), through plain isend/irecv pairs (gloo has no batched p2p). Not
        # variable_seq_lengths: Megatron refuses it with the allgather token dispatcher, and its alltoall dispatcher
        # makes a CUDA stream.
        base.update(batch_p2p_comm=False)
    if cfg.router_replay:  # an MoE model's (config.check_models): each TopKRouter gets a RouterReplay (replay_routing)
        base["moe_enable_routing_replay"] = True
    if cfg.recompute == "full":  # keep each layer's input, run the layer again in the backward
        base.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif cfg.recompute == "selective":  # recompute the core attention only (Megatron's default recompute_modules)
        base.update(recompute_granularity="selective")
    base.update(dict(cfg.megatron))
    tcfg = (MLATransformerConfig if mt == "deepseek_v3" else TransformerConfig)(**base)
    # MLA builds its own rotary embedding from tcfg (GPTModel's is not made then)
    rotary_base, rope_scaling, rope_factor = (tcfg.rotary_base, False, 1.0) if mt == "deepseek_v3" else _rope(hf)
    model_kwargs = dict(vocab_size=hf["vocab_size"], max_sequence_length=hf.get("max_position_embeddings", 4096),
                        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
                        position_embedding_type="rope", rotary_percent=1.0, rotary_base=rotary_base,
                        rope_scaling=rope_scaling, rope_scaling_factor=rope_factor, parallel_output=True,
                        transformer_layer_spec=_layer_spec_module(tcfg, layer_spec(cfg, cpu)))
    return tcfg, model_kwargs


def _layer_spec_module(tcfg, spec: str):
    """Megatron's ModuleSpec of one transformer layer: TE's ("te") or the local one (CPU: its core attention is
    cpu.SDPACoreAttention via the shims). Experts stay one MLP each (no grouped GEMM): both specs name them alike."""
    from megatron.core.models.gpt import gpt_layer_specs  # Megatron: late
    if tcfg.multi_latent_attention:  # DeepSeek-V3: dense and MoE layers (moe_layer_freq), one spec per layer
        from megatron.core import parallel_state  # the layers of this pipeline stage; rank 0 outside a trainer
        pp_rank = parallel_state.get_pipeline_model_parallel_rank() if parallel_state.model_parallel_is_initialized() \
            else 0
        block = gpt_layer_specs.get_gpt_decoder_block_spec(tcfg, use_transformer_engine=spec == "te",
                                                           normalization="RMSNorm", pp_rank=pp_rank)
        if spec == "local":
            cpu.moe_router_without_te()
            cpu.mla_without_te()
            for layer in block.layer_specs:  # Megatron's DotProductAttention takes no k_channels / v_channels (MLA's
                # q/k and v head sizes differ): torch's SDPA takes them, on CUDA as on CPU
                layer.submodules.self_attention.submodules.core_attention = cpu.SDPACoreAttention
        return block
    if spec == "te":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=tcfg.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=tcfg.qk_layernorm)
    if tcfg.num_moe_experts:
        cpu.moe_router_without_te()
    return gpt_layer_specs.get_gpt_layer_local_spec(num_experts=tcfg.num_moe_experts, moe_grouped_gemm=False,
                                                    qk_layernorm=tcfg.qk_layernorm, normalization="RMSNorm")


def fp32_output_layer(gpt) -> None:
    """Compute `gpt`'s LM head (output layer) in fp32: hidden states and weight upcast for the final matmul, fp32
    logits out. Megatron-Core 0.16 has no such option, so this wraps the output layer's matmul (Megatron's own
    `_forward_impl`, which keeps its tensor-parallel gradient handling) with the casts; the weight gradient flows
    back through the cast into the bf16 parameter. The engines do the same (SGLang's --enable-fp32-lm-head, the
    CPU engine's fp32_lm_head), so bf16 rounding of the logits no longer separates trainer and engine logprobs.
    With fp32 weights the casts are no-ops."""
    layer = gpt.output_layer
    matmul = layer._forward_impl

    def fp32_matmul(input, weight, *args, **kwargs):
        return matmul(input.float(), weight.float(), *args, **kwargs)  # (S, B, V/tp) fp32 logits

    layer._forward_impl = fp32_matmul


def build_gpt_model(tcfg, model_kwargs: dict, device: torch.device, pre_process: bool = True,
                    post_process: bool = True, fp32_lm_head: bool = False):
    """A GPTModel on the layer spec in `model_kwargs` (megatron_config). With pipeline parallelism: one stage, its
    share of the layers (+ embedding on the first, final norm and output layer on the last: `pre_process` /
    `post_process`). `fp32_lm_head`: logits computed in fp32 (`fp32_output_layer`)."""
    from megatron.core.models.gpt import GPTModel  # Megatron: late

    model = GPTModel(config=tcfg, pre_process=pre_process, post_process=post_process, **model_kwargs)
    if tcfg.multi_latent_attention and tcfg.num_moe_experts:
        from megatron.core.transformer.moe.router import TopKRouter  # Megatron: late
        for router in [m for m in model.modules() if isinstance(m, TopKRouter)]:
            # DeepSeek-V3's score-correction bias, added to the sigmoid scores to choose experts. A frozen parameter
            # (loaded, replicated over TP, exported with the weights), so trainer and engines route alike; Megatron's
            # own (moe_router_enable_expert_bias) is a buffer it moves by token counts, and 0.16 counts them with a
            # padding mask of the wrong shape.
            router.expert_bias = torch.nn.Parameter(torch.zeros(tcfg.num_moe_experts, dtype=torch.float32),
                                                    requires_grad=False)
    if fp32_lm_head and post_process:
        fp32_output_layer(model)
    return model.to(device)


# ----------------------------------------------------------------------------------------------
# HF <-> Megatron weights
#
# Megatron names (local spec, TP=1 layout; `L` is a layer index, `E` an expert index):
#   embedding.word_embeddings.weight            <- model.embed_tokens.weight
#   decoder.layers.L.input_layernorm.weight     <- model.layers.L.input_layernorm.weight (not fused with
#                                                  linear_qkv in the local spec)
#   decoder.layers.L.self_attention.linear_qkv.{weight,bias}
#                                               <- q/k/v_proj, interleaved per query group:
#                                                  [group 0: its q heads, its k head, its v head][group 1: ...]
#   decoder.layers.L.self_attention.{q,k}_layernorm.weight <- self_attn.{q,k}_norm.weight
#   decoder.layers.L.self_attention.linear_proj.weight     <- self_attn.o_proj.weight
#   decoder.layers.L.pre_mlp_layernorm.weight   <- post_attention_layernorm.weight
#   decoder.layers.L.mlp.linear_fc1.weight      <- [gate_proj; up_proj] (rows stacked)
#   decoder.layers.L.mlp.linear_fc2.weight      <- down_proj
#   decoder.layers.L.mlp.router.weight          <- mlp.gate.weight (Qwen3-MoE) / block_sparse_moe.gate (Mixtral)
#   decoder.layers.L.mlp.experts.local_experts.E.linear_fc{1,2}.weight <- experts.E.{gate,up,down}_proj
#                                                  (Mixtral: w1 = gate, w3 = up, w2 = down)
#   DeepSeek-V3 (multi-latent attention; rows keep their layouts):
#   decoder.layers.L.self_attention.linear_q_down_proj / linear_q_up_proj / linear_q_proj.weight
#                                               <- self_attn.q_a_proj / q_b_proj / q_proj (no q_lora_rank)
#   decoder.layers.L.self_attention.{q,kv}_layernorm.weight <- self_attn.{q,kv}_a_layernorm.weight
#   decoder.layers.L.self_attention.linear_kv_down_proj / linear_kv_up_proj.weight
#                                               <- self_attn.kv_a_proj_with_mqa / kv_b_proj
#   decoder.layers.L.mlp.router.expert_bias     <- mlp.gate.e_score_correction_bias
#   decoder.layers.L.mlp.shared_experts.linear_fc{1,2}.weight <- mlp.shared_experts.{gate,up,down}_proj
#   decoder.final_layernorm.weight              <- model.norm.weight
#   output_layer.weight                         <- lm_head.weight (absent when embeddings are tied)


# The TE spec fuses norms into the linear layer after them (TELayerNormColumnParallelLinear), whose parameter then
# holds the norm's weight: {fused name: local-spec name}. In MoE layers the pre-MLP norm stays a norm of its own; under
# MLA the input norm does, and the q / kv latents' norms go into the up-projections.
TE_FUSED_NORMS = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
                  "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
                  "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
                  "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight"}


def fused_norm_names(param_names) -> dict[str, str]:
    """{local-spec name: the model's own name} for every norm the model's layer spec fused into a linear layer;
    empty for the local spec. The conversions here speak local-spec names; trainer.Model translates with this."""
    out = {}
    for name in param_names:
        for fused, local in TE_FUSED_NORMS.items():
            if name.endswith("." + fused):
                out[name[:-len(fused)] + local] = name
    return out


def load_hf_state(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of an HF safetensors checkpoint (single file or sharded with an index)."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}; save the HF model with safe_serialization=True")
    return {name: t for f in files for name, t in load_file(str(f)).items()}


def _dims(hf: dict) -> tuple[int, int, int]:
    heads = hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads", heads)
    return heads, kv, hf.get("head_dim") or hf["hidden_size"] // heads


def _expert_names(hf: dict, layer: int, e: int) -> tuple[str, str, str]:
    """HF (gate, up, down) weight names of expert `e` in `layer`."""
    if hf["model_type"] == "mixtral":
        p = f"model.layers.{layer}.block_sparse_moe.experts.{e}"
        return f"{p}.w1.weight", f"{p}.w3.weight", f"{p}.w2.weight"
    p = f"model.layers.{layer}.mlp.experts.{e}"
    return f"{p}.gate_proj.weight", f"{p}.up_proj.weight", f"{p}.down_proj.weight"


def _router_name(hf: dict, layer: int) -> str:
    if hf["model_type"] == "mixtral":
        return f"model.layers.{layer}.block_sparse_moe.gate.weight"
    return f"model.layers.{layer}.mlp.gate.weight"


def _moe_layer(hf: dict, layer: int) -> bool:
    """Whether `layer` routes over experts (DeepSeek-V3's first first_k_dense_replace layers are dense)."""
    dense = int(hf.get("first_k_dense_replace") or 0)
    return hf["model_type"] in ("qwen3_moe", "mixtral", "deepseek_v3") and layer >= dense


def _num_experts(hf: dict) -> int:
    return hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts") or 0


# DeepSeek-V3 multi-latent attention, HF name -> Megatron name under a layer (one of q_proj or q_a/q_b is present:
# q_lora_rank null or set); o_proj -> linear_proj as for every model
_MLA_NAMES = (("self_attn.q_proj.weight", "self_attention.linear_q_proj.weight"),
              ("self_attn.q_a_proj.weight", "self_attention.linear_q_down_proj.weight"),
              ("self_attn.q_a_layernorm.weight", "self_attention.q_layernorm.weight"),
              ("self_attn.q_b_proj.weight", "self_attention.linear_q_up_proj.weight"),
              ("self_attn.kv_a_proj_with_mqa.weight", "self_attention.linear_kv_down_proj.weight"),
              ("self_attn.kv_a_layernorm.weight", "self_attention.kv_layernorm.weight"),
              ("self_attn.kv_b_proj.weight", "self_attention.linear_kv_up_proj.weight"))
# Every family, HF name -> Megatron name under a layer, same layout on both sides, each where the model has it (the
# q/k norms: Qwen3's; the score-correction bias: DeepSeek-V3's MoE layers')
_LAYER_NAMES = (("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
                ("self_attn.q_norm.weight", "self_attention.q_layernorm.weight"),
                ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight"),
                ("input_layernorm.weight", "input_layernorm.weight"),
                ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
                ("mlp.gate.e_score_correction_bias", "mlp.router.expert_bias"))


class _Tracked(dict):
    """A dict view of an HF state dict that records which names were read (to catch unmapped weights)."""

    def __init__(self, state: dict, unused: set):
        super().__init__(state)
        self.unused = unused

    def __getitem__(self, name):
        self.unused.discard(name)
        return super().__getitem__(name)


def _mtp_weight(name: str, hf: dict) -> bool:
    """A weight of DeepSeek-V3's multi-token-prediction layers, stored after the last layer (model.layers.61.* in
    V3): a draft head for speculative decoding, not part of the model RL trains (transformers skips it too)."""
    n, extra = hf["num_hidden_layers"], int(hf.get("num_nextn_predict_layers") or 0)
    return name.startswith("model.layers.") and n <= int(name.split(".")[2]) < n + extra


def hf_to_megatron(hf_state: dict[str, torch.Tensor], hf: dict) -> dict[str, torch.Tensor]:
    """Full (unsharded, TP=1 layout) Megatron state dict from an HF state dict; all experts included."""
    _, kv, d = _dims(hf)
    unused = set(hf_state)
    hf_state = _Tracked(hf_state, unused)
    out = {"embedding.word_embeddings.weight": hf_state["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf_state["model.norm.weight"]}
    if not hf.get("tie_word_embeddings", False):
        out["output_layer.weight"] = hf_state["lm_head.weight"]
    for L in range(hf["num_hidden_layers"]):
        h, m = f"model.layers.{L}.", f"decoder.layers.{L}."
        if hf["model_type"] == "deepseek_v3":  # multi-latent attention: the projections keep their row layouts
            out.update({m + mn: hf_state[h + hn] for hn, mn in _MLA_NAMES if h + hn in hf_state})
        else:
            for kind in ["weight"] + (["bias"] if h + "self_attn.q_proj.bias" in hf_state else []):  # bias: Qwen2
                q, k, v = (hf_state[h + f"self_attn.{p}_proj.{kind}"] for p in "qkv")  # (N*D[, H]), N = Nq, G, G
                rest = q.shape[1:]  # (H,) for the weight, () for the bias
                # (G, Nq/G + 2, D[, H]): per query group its q heads, its k head, its v head
                qkv = torch.cat([x.view(kv, -1, d, *rest) for x in (q, k, v)], 1)
                out[m + f"self_attention.linear_qkv.{kind}"] = qkv.reshape(-1, *rest)  # (G*(Nq/G+2)*D[, H])
        out.update({m + mn: hf_state[h + hn] for hn, mn in _LAYER_NAMES if h + hn in hf_state})
        if _moe_layer(hf, L):
            out[m + "mlp.router.weight"] = hf_state[_router_name(hf, L)]
            for e in range(_num_experts(hf)):
                g, u, dn = _expert_names(hf, L, e)
                x = f"{m}mlp.experts.local_experts.{e}."
                out[x + "linear_fc1.weight"] = torch.cat([hf_state[g], hf_state[u]], 0)  # (2F, H)
                out[x + "linear_fc2.weight"] = hf_state[dn]  # (H, F)
        # the dense MLP, or an MoE layer's shared experts (DeepSeek-V3: one MLP of n_shared_experts * F)
        mlp = "mlp.shared_experts." if _moe_layer(hf, L) else "mlp."  # the same names on both sides
        if h + mlp + "gate_proj.weight" in hf_state:
            out[m + mlp + "linear_fc1.weight"] = torch.cat([hf_state[h + mlp + "gate_proj.weight"],
                                                            hf_state[h + mlp + "up_proj.weight"]], 0)  # (2F, H)
            out[m + mlp + "linear_fc2.weight"] = hf_state[h + mlp + "down_proj.weight"]
    if hf.get("tie_word_embeddings", False):
        unused.discard("lm_head.weight")  # some tied checkpoints still store the shared matrix twice
    unused = {n for n in unused if not n.endswith("rotary_emb.inv_freq") and not _mtp_weight(n, hf)}
    if unused:
        raise ValueError(f"HF weights with no Megatron counterpart: {sorted(unused)[:8]} ({len(unused)} in all); "
                         "this architecture variant is not supported by the conversion")
    return out


def megatron_to_hf_tensor(name: str, t: torch.Tensor, hf: dict) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors one full Megatron tensor (TP=1 layout, local-spec name, global layer number) becomes, the
    inverse of hf_to_megatron tensor by tensor: one for most, q/k/v for linear_qkv, gate/up for linear_fc1. Views of
    `t` where the layout allows (a weight sync streams); raises ValueError on a name with no HF counterpart."""
    top = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
           "decoder.final_layernorm.weight": "model.norm.weight", "output_layer.weight": "lm_head.weight"}
    if name in top:
        return [(top[name], t)]
    if not name.startswith("decoder.layers."):
        raise ValueError(f"Megatron tensor {name!r} has no HF counterpart in the conversion")
    _, _, layer, rest = name.split(".", 3)
    L, h = int(layer), f"model.layers.{layer}."
    heads, kv, d = _dims(hf)
    q_per_group = heads // kv
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind, tail = rest.rsplit(".", 1)[1], t.shape[1:]  # tail: (H,) for the weight, () for the bias
        qkv = t.view(kv, q_per_group + 2, d, *tail)  # (G, Nq/G+2, D[, H])
        return [(h + f"self_attn.q_proj.{kind}", qkv[:, :q_per_group].reshape(heads * d, *tail)),
                (h + f"self_attn.k_proj.{kind}", qkv[:, q_per_group].reshape(kv * d, *tail)),
                (h + f"self_attn.v_proj.{kind}", qkv[:, q_per_group + 1].reshape(kv * d, *tail))]
    mla = _MLA_NAMES if hf["model_type"] == "deepseek_v3" else ()  # its q_layernorm is HF's q_a_layernorm
    simple = {mn: hn for hn, mn in _LAYER_NAMES + mla}
    if rest in simple:
        return [(h + simple[rest], t)]
    if rest == "mlp.router.weight":
        return [(_router_name(hf, L), t)]
    if rest.startswith("mlp.experts.local_experts."):
        e, tail = rest.removeprefix("mlp.experts.local_experts.").split(".", 1)
        g, u, dn = _expert_names(hf, L, int(e))
        if tail == "linear_fc1.weight":
            gate, up = t.chunk(2, 0)
            return [(g, gate), (u, up)]
        if tail == "linear_fc2.weight":
            return [(dn, t)]
    for mlp in ("mlp.shared_experts.", "mlp."):  # a MoE layer's shared experts, or a dense layer's MLP
        if rest == mlp + "linear_fc1.weight":
            gate, up = t.chunk(2, 0)  # (F, H) each of the (2F, H) [gate; up]
            return [(h + mlp + "gate_proj.weight", gate), (h + mlp + "up_proj.weight", up)]
        if rest == mlp + "linear_fc2.weight":
            return [(h + mlp + "down_proj.weight", t)]
    raise ValueError(f"Megatron tensor {name!r} has no HF counterpart in the conversion")


def tp_split_dim(name: str) -> int | None:
    """The dim a parameter is split on across tensor-parallel ranks (None: replicated)."""
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "word_embeddings.weight",
                      "output_layer.weight", "linear_q_proj.weight", "linear_q_up_proj.weight",
                      "linear_kv_up_proj.weight", "linear_q_down_proj.weight", "linear_kv_down_proj.weight")):
        # column-parallel (and vocab-parallel) layers: output rows split. MLA's up-projections are head-major, so
        # a row split keeps whole heads; its down-projections' rows are gathered back before use (the latents
        # are needed whole on every rank)
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1  # row-parallel layers: input columns split
    return None  # norms, router, its expert bias


def shard_for_rank(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This TP rank's slice of a full Megatron tensor.

    linear_fc1 holds [gate; up]; each rank holds [its gate slice; its up slice], so split the halves
    separately. linear_qkv is interleaved per query group, so a plain row split keeps whole groups.
    """
    dim = tp_split_dim(name)
    if dim is None or size == 1:
        return full
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2, 0)
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]], 0)
    return full.chunk(size, dim)[rank]


def gather_full(name: str, local: torch.Tensor, group) -> torch.Tensor:
    """The full tensor from every TP rank's slice (all ranks of `group` must call this); inverse of shard_for_rank.
    The ranks' slices land in one buffer on the slices' device (one collective, no list of parts for the backend to
    flatten and copy out again): a split along dim 0 is then the full tensor itself, any other costs one reorder."""
    size = torch.distributed.get_world_size(group) if group is not None else 1
    dim = tp_split_dim(name)
    if dim is None or size == 1:
        return local
    out = local.new_empty((size * local.size(0), *local.shape[1:]))  # the slices stacked along dim 0, rank order
    # all_gather_single is torch >= 2.13's name for all_gather_into_tensor (which GPU images may still need)
    (getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor)(
        out, local.contiguous(), group=group)
    if name.endswith("linear_fc1.weight"):  # each slice is [its gate rows; its up rows]: every gate first, then up
        return out.view(size, 2, -1, *local.shape[1:]).transpose(0, 1).reshape(-1, *local.shape[1:])
    if dim == 0:
        return out
    return out.view(size, *local.shape).movedim(0, dim).reshape(*local.shape[:dim], -1, *local.shape[dim + 1:])


def save_hf_dir(named: Iterable[tuple[str, torch.Tensor]], path: str | os.PathLike, source: str | os.PathLike,
                shard_bytes: int = 5 * 2**30) -> tuple[int, int]:
    """An HF model directory at `path`: `named` (HF names, full tensors; any iterable, read once) written shard by
    shard as it arrives, so only one shard is ever held: `model.safetensors` when it fits one shard, else
    `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`, as transformers writes them; then the
    config and tokenizer files of the HF directory `source` the model was loaded from. Returns (shards, bytes)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)  # a previous save's shards would load beside these
    shards, weight_map, total = [], {}, 0
    shard, size = {}, 0

    def flush():
        shards.append(out / f"model-{len(shards) + 1:05d}.safetensors")
        save_file(shard, str(shards[-1]), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, len(shards) - 1))

    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > shard_bytes:
            flush()
            shard, size = {}, 0
        shard[name] = t.detach().contiguous().cpu()
        size, total = size + nbytes, total + nbytes
    if shard or not shards:
        flush()
    if len(shards) == 1:
        shards[0].rename(out / "model.safetensors")
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for f, new in zip(shards, names):
            f.rename(out / new)
        index = {"metadata": {"total_size": total}, "weight_map": {n: names[i] for n, i in weight_map.items()}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    for f in HF_SIDE_FILES:
        if (Path(source) / f).exists():
            shutil.copy(Path(source) / f, out / f)
    return len(shards), total
