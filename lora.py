"""LoRA (arXiv 2106.09685) on the trainer's Megatron-Core linear layers: the adapters, their tensor-parallel math,
the names they travel under (PEFT's), and the exports (a PEFT adapter directory, a merged HF model).

A LoRA on weight W (out, in) adds scale * B A with A (r, in), B (out, r), scale = alpha / r: y = x W^T + scale *
(x A^T) B^T. The base W is frozen and never reaches the optimizer; only A and B train. Conventions are PEFT's, so
the export loads with `peft` unchanged: A starts as torch.nn.Linear's init (kaiming_uniform_, a = sqrt(5)), B at
zero (so step 0 is the base model), no rsLoRA, no dropout.

The adapters are named by the HF projections they adapt (`lora_targets`: q_proj, k_proj, v_proj, o_proj, gate_proj,
up_proj, down_proj), while Megatron fuses some of them: `linear_qkv` holds q, k and v (rows interleaved per query
group: a group's q heads, its k head, its v head), `linear_fc1` holds [gate; up]. So a LoRA on q_proj is a LoRA on
a slice of linear_qkv's output rows: each projection keeps its own A and B in HF's row order (what PEFT and the
engines expect), and `Adapters.forward` lays the deltas out as the fused layer's rows.

Tensor parallelism (TP=2 computes what TP=1 does):
* column-parallel layers (linear_qkv, linear_fc1: output rows split): B is split by rows like the layer (each rank
  its query groups / its gate and up slices), A is whole on every rank. x A^T goes through Megatron's
  `copy_to_tensor_model_parallel_region` (identity forward, all-reduce backward), so A's gradient sums every
  rank's rows and is the same on all of them.
* row-parallel layers (linear_proj, linear_fc2: input columns split, output all-reduced): A is split by columns,
  B is whole; x_local A_local^T is summed over ranks (`reduce_from_tensor_model_parallel_region`) before B.
A and B start from the same full tensors on every layout (drawn from one seed per layer and projection, then
sharded), and split B / A carry Megatron's tensor-parallel attributes, so grad-norm clipping counts them once.

The reference model of a KL term is the base: `disabled(model)` switches every adapter off for a forward, so no
second copy of the weights is kept.

`lora_train_norm`: the final RMSNorm's gain trains too. The adapters can turn the last hidden state but not lengthen
it, so with the gain frozen the logits' scale (how sharp an answer can be) stays the base's. The gain goes to the
engines as a base weight beside each adapter (adapter-less requests see it too); the PEFT export holds it as
modules_to_save, which `peft` applies and SGLang's adapter loader skips: serve the merged export.

Test: `.venv/bin/pytest tests/test_lora.py` (TP=2 against TP=1, a frozen base outside the optimizer, the reference
by disabling, trainer -> CPU engine sync with equal logprobs, the PEFT round trip through `peft`, the merged export).
Left out: pipeline parallelism, MoE experts and DeepSeek-V3's multi-latent attention (rejected at --check), LoRA on
embeddings or the LM head, dropout on the adapter input, DoRA and rsLoRA, a LoRA sync over broadcast (SGLang 0.5.23
loads adapters from tensors or from disk only).
"""
from __future__ import annotations

import contextlib
import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# HF projection -> (Megatron linear under a decoder layer, "column" | "row" parallel, HF module under a layer)
LAYOUT = {"q_proj": ("self_attention.linear_qkv", "column", "self_attn.q_proj"),
          "k_proj": ("self_attention.linear_qkv", "column", "self_attn.k_proj"),
          "v_proj": ("self_attention.linear_qkv", "column", "self_attn.v_proj"),
          "o_proj": ("self_attention.linear_proj", "row", "self_attn.o_proj"),
          "gate_proj": ("mlp.linear_fc1", "column", "mlp.gate_proj"),
          "up_proj": ("mlp.linear_fc1", "column", "mlp.up_proj"),
          "down_proj": ("mlp.linear_fc2", "row", "mlp.down_proj")}
# the PEFT tensor name of an adapter matrix (what peft saves and SGLang's LoRA loader reads)
PEFT_NAME = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
NORM = "model.norm.weight"  # the final RMSNorm's gain (lora_train_norm): its HF name, a base weight of the engines


def adapter_name(version: int) -> str:
    """The engines' name of the adapter holding weight version `version` (SGLang's `lora_name`; requests pick it with
    `lora_path`). One name per version: SGLang loads a name once and keeps an adapter until no request uses it."""
    return f"policy-v{int(version)}"


def peft_name(layer: int, projection: str, matrix: str) -> str:
    """PEFT's name of adapter matrix "A" or "B" of `projection` (q_proj, ...) in decoder layer `layer`."""
    return f"base_model.model.model.layers.{layer}.{LAYOUT[projection][2]}.lora_{matrix}.weight"


def peft_config(cfg, base_model: str) -> dict:
    """adapter_config.json of PEFT's LoraConfig for cfg's adapters (also SGLang's `config_dict`)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_model),
            "r": int(cfg.lora_rank), "lora_alpha": float(cfg.lora_alpha), "target_modules": sorted(cfg.lora_targets),
            "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "modules_to_save": None, "inference_mode": True}


# ----------------------------------------------------------------------------------------------
# the adapters of one Megatron linear layer


class Adapters(torch.nn.Module):
    """The LoRA adapters on one Megatron linear layer: for each HF projection it holds, A (r, in) and B (out, r) in
    HF's row order, this TP rank's shard of each. Attached to the layer as its child `lora` (parameter names
    `<layer>.lora.A.<projection>`), with a forward hook on the layer that adds `forward(x)` to its output."""

    def __init__(self, projections: list[str], kind: str, fused: list[tuple[str, int]], in_features: int,
                 rank: int, alpha: float, tp_group, layer: int, seed: int, dtype: torch.dtype, device,
                 head_dim: int = 0):
        """`fused`: the layer's full output as [(projection, its rows)], in order (linear_qkv: q, k, v; linear_fc1:
        gate, up); `in_features`: the full input size; `head_dim`: linear_qkv's head size. `layer` and `seed` draw A
        (the same on every TP layout)."""
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes  # Megatron: late
        super().__init__()
        self.kind, self.scale, self.enabled, self.head_dim = kind, alpha / rank, True, head_dim
        self.tp_group = tp_group
        tp = torch.distributed.get_world_size(tp_group) if tp_group is not None else 1
        tp_rank = torch.distributed.get_rank(tp_group) if tp_group is not None else 0
        self.rows = {p: n // tp for p, n in fused}  # each projection's output rows on this rank
        self.order = [p for p, _ in fused]
        self.A, self.B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        for p in projections:
            g = torch.Generator().manual_seed(seed * 1_000_003 + layer * 101 + TARGETS.index(p))
            a = torch.empty(rank, in_features)  # (r, in) PEFT's init: torch.nn.Linear's kaiming_uniform_
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=g)
            if kind == "row":  # input columns split: A by columns, B whole
                a = a.chunk(tp, 1)[tp_rank]
            b = torch.zeros(self.rows[p] if kind == "column" else dict(fused)[p], rank)  # (out[/tp], r) B = 0
            self.A[p] = torch.nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
            self.B[p] = torch.nn.Parameter(b.to(device=device, dtype=dtype))
            split = self.B[p] if kind == "column" else self.A[p]
            set_tensor_model_parallel_attributes(split, True, 0 if kind == "column" else 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """scale * (x A^T) B^T of every adapted projection, laid out as this rank's share of the layer's output.
        x (S, B, in[/tp]); returns (S, B, out/tp) for a column-parallel layer, (S, B, out) for a row-parallel one."""
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,  # Megatron: late
                                                            reduce_from_tensor_model_parallel_region)
        deltas = {}
        for p in self.A:
            h = x @ self.A[p].T  # (S, B, r), partial sums over this rank's columns for a row-parallel layer
            if self.tp_group is not None:  # TP > 1: the collective that makes this rank's share exact (docstring)
                h = (copy_to_tensor_model_parallel_region(h, group=self.tp_group) if self.kind == "column" else
                     reduce_from_tensor_model_parallel_region(h, group=self.tp_group))
            deltas[p] = self.scale * (h @ self.B[p].T)  # (S, B, rows of p here)
        if self.kind == "row":
            return next(iter(deltas.values()))  # one projection per row-parallel layer (o_proj, down_proj)
        S, B = x.shape[:2]
        parts = [deltas.get(p, x.new_zeros(S, B, self.rows[p])) for p in self.order]
        if self.order[0] == "q_proj":  # linear_qkv: per query group its q heads, its k head, its v head
            groups = self.rows["k_proj"] // self.head_dim  # query groups on this rank
            parts = [d.reshape(S, B, groups, -1) for d in parts]  # (S, B, G, heads of the group * D)
            return torch.cat(parts, -1).reshape(S, B, -1)  # (S, B, G*(Nq/G + 2)*D)
        return torch.cat(parts, -1)  # linear_fc1: [gate; up] -> (S, B, 2F/tp)


def _add_delta(module, args, kwargs, output):
    """Forward hook on an adapted Megatron linear: its output (y, bias) becomes (y + its adapters' delta, bias)."""
    if not module.lora.enabled:
        return output
    y, bias = output
    return y + module.lora(args[0] if args else kwargs["input_"]), bias


def add_adapters(gpt, cfg, hf: dict, tp_group) -> int:
    """Freeze every parameter of the GPTModel `gpt` and attach cfg's adapters (lora_rank, lora_alpha, lora_targets)
    to its decoder layers; call before Megatron's DDP wraps it (DDP keeps gradient buffers for what trains only).
    Returns the number of adapter parameters on this rank."""
    gpt.requires_grad_(False)
    if cfg.lora_train_norm:  # (the gain that trains, the base's copy for `disabled`)
        norm = gpt.decoder.final_layernorm.weight
        gpt.lora_norm = (norm.requires_grad_(True), norm.detach().clone())
    heads, kv = hf["num_attention_heads"], hf.get("num_key_value_heads", hf["num_attention_heads"])
    d = hf.get("head_dim") or hf["hidden_size"] // heads
    H, F = hf["hidden_size"], hf["intermediate_size"]
    fused = {"self_attention.linear_qkv": ([("q_proj", heads * d), ("k_proj", kv * d), ("v_proj", kv * d)], H),
             "self_attention.linear_proj": ([("o_proj", H)], heads * d),
             "mlp.linear_fc1": ([("gate_proj", F), ("up_proj", F)], H),
             "mlp.linear_fc2": ([("down_proj", H)], F)}
    dtype = next(gpt.parameters()).dtype
    if cfg.recompute != "none" and getattr(gpt, "embedding", None) is not None:
        # Megatron's recomputation checkpoints each layer with a reentrant autograd Function, whose output needs
        # grad only if an input does: with the embedding frozen none would, and the adapters would get no grads
        gpt.embedding.register_forward_hook(lambda module, args, out: out.requires_grad_(True))
    n = 0
    for L, layer in enumerate(gpt.decoder.layers):
        for where, (rows, in_features) in fused.items():
            mine = [p for p, _ in rows if p in cfg.lora_targets]
            if not mine:
                continue
            linear = layer.get_submodule(where)
            linear.lora = Adapters(mine, LAYOUT[mine[0]][1], rows, in_features, int(cfg.lora_rank),
                                   float(cfg.lora_alpha), tp_group, L, int(cfg.seed), dtype, linear.weight.device, d)
            linear.register_forward_hook(_add_delta, with_kwargs=True)
            n += sum(p.numel() for p in linear.lora.parameters())
    return n


def is_adapter(name: str) -> bool:
    """Whether a parameter name of the GPTModel is an adapter matrix (the full-weight paths skip them)."""
    return ".lora.A." in name or ".lora.B." in name


@contextlib.contextmanager
def disabled(gpt):
    """Every adapter of `gpt` off inside the block, and a trained final norm's gain at the base's: the base model
    (the reference of a KL term)."""
    adapters = [m for m in gpt.modules() if isinstance(m, Adapters)]
    norm, base = getattr(gpt, "lora_norm", (torch.zeros(0), torch.zeros(0)))  # lora_train_norm's; else empty
    trained = norm.detach().clone()
    for m in adapters:
        m.enabled = False
    norm.data.copy_(base)
    try:
        yield
    finally:
        for m in adapters:
            m.enabled = True
        norm.data.copy_(trained)


def trained_base(gpt) -> list[tuple[str, torch.Tensor]]:
    """The base weights that train beside the adapters, HF-named: [(NORM, gain)] with lora_train_norm, else []."""
    return [(NORM, gpt.lora_norm[0].detach())] if hasattr(gpt, "lora_norm") else []


def gather(gpt, tp_group, keep: bool) -> dict[str, torch.Tensor]:
    """Every adapter matrix as a full CPU tensor (TP shards gathered), under its PEFT name. Every rank of the TP group
    must call it; the dict is filled where `keep` (the rank that exports), empty elsewhere."""
    out = {}
    tp = torch.distributed.get_world_size(tp_group) if tp_group is not None else 1
    with torch.no_grad():
        for L, layer in enumerate(gpt.decoder.layers):
            for m in [m for m in layer.modules() if isinstance(m, Adapters)]:
                for p in m.A:
                    for matrix, t, dim in (("A", m.A[p], 1), ("B", m.B[p], 0)):
                        if getattr(t, "tensor_model_parallel", False) and tp > 1:
                            parts = [torch.empty_like(t) for _ in range(tp)]
                            torch.distributed.all_gather(parts, t.contiguous(), group=tp_group)
                            t = torch.cat(parts, dim)
                        if keep:
                            out[peft_name(L, p, matrix)] = t.detach().cpu().contiguous()
    return out


# ----------------------------------------------------------------------------------------------
# exports: PEFT adapter directory, merged HF weights


def merge(named, adapters: dict[str, torch.Tensor], scale: float):
    """HF-named base weights (any iterable of (name, tensor), read once) with every adapter folded in, tensor by
    tensor as they come: W + scale * B A (computed in fp32, stored in W's dtype)."""
    pairs = {}  # base weight name -> (A, B)
    for name, a in adapters.items():
        m = PEFT_NAME.match(name)
        if m is not None and m.group(4) == "A":
            pairs[f"model.layers.{m.group(1)}.{m.group(2)}.{m.group(3)}.weight"] = \
                (a, adapters[name.replace(".lora_A.", ".lora_B.")])
    for name, w in named:
        if name in pairs:
            a, b = pairs[name]
            w = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
        yield name, w


def save_peft(adapters: dict[str, torch.Tensor], config: dict, path: str | Path, base=()) -> str:
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) that `peft.PeftModel.from_pretrained`
    and SGLang's /load_lora_adapter load; `base` (trained_base) goes in as PEFT's modules_to_save."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {**adapters, **{f"base_model.model.{n}": t.cpu() for n, t in base}}
    config = {**config, "modules_to_save": [n.rsplit(".", 1)[0] for n, _ in base]} if base else config
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(out / PEFT_WEIGHTS), metadata={"format": "pt"})
    (out / PEFT_CONFIG).write_text(json.dumps(config, indent=1))
    return str(out)
