"""What exists only because there is no GPU: the code that makes a laptop CPU run the same actors, and fast.
On GPUs none of it runs (every function here answers "nothing to do" there, and `apply_cpu_shims` returns False), so
a GPU reader can skip this file, but for what a GPU without Transformer Engine borrows from it (section 2). Two
sections:

1. Cores (controller side). Ray reserves CPUs as a count and pins nothing, and torch sizes its thread pool from the
   whole machine, so on a 2-core node a trainer and an engine computing at once fight over both cores. In async mode
   on a local CPU node each actor is pinned to cores of its own (`actor_cores`, `pin_process`), a trainer rank also
   computes on an engine's cores while that engine has nothing to generate (`lent_cores`, `engine_busy_file`), and
   every actor gets a torch thread count that fits its share of the machine (`torch_threads`). Where the OS has no
   `os.sched_getaffinity` (macOS) nothing is pinned (`usable_cores`).
2. Megatron on CPU (trainer side):
   * `apply_cpu_shims`: the changes that let Megatron-Core's GPTModel, its DistributedDataParallel, its
     tensor-parallel layers, its 1F1B pipeline schedule and its activation recomputation run on CPU over gloo
     (`SDPACoreAttention`, `_TorchOnCpu`); `moe_router_without_te` and `mla_without_te`, which any machine
     without Transformer Engine needs (every CPU machine is one), as multi-latent attention on the local spec
     needs `SDPACoreAttention` on CUDA too;
   * `adamw`, `clip_grad_norm`: the optimizer and its TP/EP/PP-aware gradient clipping, because Megatron's
     optimizer wrappers allocate CUDA tensors;
   * `BorrowedCores`: a trainer rank computing on the cores of CPU engines while they have nothing to generate
     (the thread count adapted before every transformer layer, forward and backward);
   * `offload_to_file`, `onload_from_file`: the colocated memory hand-off's CPU path (bytes to a file, out of the
     process, where CUDA would use pinned host memory).

Test: `.venv/bin/pytest tests/test_async.py -k "cores or pinned or idle_engine or busy_file" -q` (the core plan on an
8-core node, real pinning of a trainer and an engine, a trainer computing on an idle engine's core),
`tests/test_loongsage.py -k no_affinity` (no `os.sched_getaffinity`: --check and a run, unpinned), and
`tests/test_trainer.py -k "core_attention or parity"` (the attention against torch's kernel and the whole model
against transformers), `tests/test_fast_paths.py -k recompute` (equal gradients with recomputation); every trainer
test on CPU runs through the shims.
Left out: NUMA placement and hyper-thread siblings (cores are taken in the order the OS lists them), pinning on a
Ray cluster (its nodes' cores are not this process's to plan), Megatron's fused kernels and Transformer Engine on
CPU (the fusions are switched off in convert.megatron_config), mixed precision on CPU (bf16 is rejected there), and
with TE what needs it: sequence and context parallelism; Megatron's distributed optimizer (config.check_fast_paths
rejects them on CPU).
"""
from __future__ import annotations

import contextlib
import copy
import mmap
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

# --- cores: placing CPU actors on cores (controller side) ---

_NOTED = False  # the "no affinity call here" note is printed once per process


def usable_cores() -> list[int]:
    """The cores this process may run on (`os.sched_getaffinity`, which Linux has). Where the OS has no such call
    (macOS, Windows) nothing is pinned: [] and a one-line note, once."""
    global _NOTED
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    if not _NOTED:
        print("note: no os.sched_getaffinity on this OS (Linux only): CPU actors run unpinned, placed by Ray's "
              "CPU counts alone", file=sys.stderr)
        _NOTED = True
    return []


def torch_threads(cfg) -> tuple[int, int]:
    """(trainer_threads, engine_threads), each as configured or, where 0, derived: async runs trainers and engines
    at once, each on its own Ray CPUs; sync on a CPU runs one phase at a time, so the phase running may use the
    node's cores (split among the actors of that phase)."""
    sync_cpu, cores = cfg.mode == "sync" and cfg.device == "cpu", os.cpu_count() or 1
    trainer = cfg.trainer_threads if cfg.trainer_threads > 0 else \
        max(1, cores // cfg.trainer_workers if sync_cpu else int(cfg.cpus_per_trainer))
    engine = cfg.engine_threads if cfg.engine_threads > 0 else \
        max(1, cores // cfg.num_engines if sync_cpu else int(cfg.cpus_per_engine))
    return trainer, engine


def actor_cores(cfg, kind: str, i: int) -> list[int]:
    """The cores trainer rank i (kind "trainer") or engine i ("engine") is pinned to: in async mode on a local CPU
    node, trainers take trainer_threads cores each from the first, engines engine_threads each after them, so a
    training step and the engine's decoding never share a core (Ray reserves CPUs as a count; it pins nothing).
    The controller and AgentFlow stay unpinned (mostly waiting). [] = no pinning: sync (each phase may use every
    core), GPUs, a Ray cluster, colocated actors, more threads asked for than this machine has cores, or an OS
    without an affinity call (see usable_cores)."""
    if cfg.mode != "async" or cfg.device != "cpu" or cfg.ray_address or cfg.colocate:
        return []
    cores = usable_cores()
    T, E, tt, te = cfg.trainer_workers, cfg.num_engines, int(cfg.trainer_threads), int(cfg.engine_threads)
    if T * tt + E * te > len(cores):
        return []
    first, n = (i * tt, tt) if kind == "trainer" else (T * tt + i * te, te)
    return cores[first:first + n]


def lent_cores(cfg, r: int) -> list[tuple[int, list[int]]]:
    """(engine i, its cores) for every engine whose cores trainer rank r also computes on while that engine is idle
    (`borrow_engine_cores`): engine i lends to rank i % trainer_workers. Only where actors are pinned (async on a
    local CPU node, see actor_cores): elsewhere [] (in sync mode the running phase has every core anyway)."""
    if not cfg.borrow_engine_cores or not actor_cores(cfg, "trainer", r):
        return []
    return [(i, actor_cores(cfg, "engine", i)) for i in range(cfg.num_engines) if i % cfg.trainer_workers == r]


def engine_busy_file(cfg) -> str:
    """A fresh file of one byte per engine (in /dev/shm where there is one: memory, never written back), where CPU
    engine i keeps byte i at 1 while it has requests to compute and the trainer ranks that borrow its cores read it;
    "" where no trainer borrows (see lent_cores). The run removes it at the end (fleet.Fleet.busy_file)."""
    if not any(lent_cores(cfg, r) for r in range(cfg.trainer_workers)):
        return ""
    fd, path = tempfile.mkstemp(prefix="loongsage-busy-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.write(fd, bytes(cfg.num_engines))
    os.close(fd)
    return path


def thread_ids() -> list[int]:
    """This process's thread ids, from Linux's /proc/self/task; where it cannot be read, [0] (the calling thread,
    as sched_setaffinity takes it). Only the pinning below needs them, which runs only where usable_cores pins."""
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except (OSError, ValueError):
        return [0]


def pin_process(cores: list[int]) -> list[int]:
    """Pin every thread of this process to `cores` (threads started later inherit it); runs inside an actor
    (`actor.__ray_call__`). Best effort: a thread that ended meanwhile is skipped. Returns the cores it has."""
    for tid in thread_ids():
        with contextlib.suppress(OSError):  # the thread ended meanwhile, or may not be moved
            os.sched_setaffinity(tid, cores)
    return sorted(os.sched_getaffinity(0))


# --- Megatron on CPU ---

# Micro-batches of sequences up to EXPLICIT_ATTENTION_MAX_LEN tokens whose scores have at most
# EXPLICIT_ATTENTION_MAX_SCORES elements (B * heads * T * T) take the explicit path of SDPACoreAttention; the rest go
# through torch's fused kernel, which never materialises them (2**24 fp32 scores: 64 MB). Forward + backward of one
# layer's attention, tiny models' heads (4 query, 2 kv, 16 dims), ~6k tokens a micro-batch, explicit / fused time:
# T 48-96 0.66-0.84 on 2 threads (1.06-1.41 on 1), T 128-160 1.01-1.54, T 256 1.54-1.66, T 403 1.9-3.7: past ~192
# tokens the fused kernel wins on any thread count (a chat family's tool-calling prompts run ~400: tests/test_chat.py).
EXPLICIT_ATTENTION_MAX_SCORES = 2 ** 24
EXPLICIT_ATTENTION_MAX_LEN = 192


class SDPACoreAttention(torch.nn.Module):
    """Core attention (softmax(QK^T/sqrt(d)) V, causal, GQA) on CPU, in place of Megatron's DotProductAttention; on
    CUDA too for multi-latent attention on the local spec (convert._layer_spec_module), whose q/k and v head sizes
    DotProductAttention cannot take.

    Megatron's own `DotProductAttention` preallocates its score buffer on the CUDA device; this module takes the
    same constructor and forward arguments as the layer spec passes to it. Two ways to the same math:
    * short sequences in small micro-batches (the RL case on CPU): written out as the CPU engine computes it
      (cpu_model._attention),
      the query heads of each kv head stacked into one matrix, the causal mask and the scale folded into one
      baddbmm, a softmax and a bmm. No kv-head copies for GQA, and at the tiny recipes' shapes (64 rows of ~50
      tokens) forward + backward took 0.54x the time of torch's CPU flash kernel (1 thread; 0.53x on 2);
      logprobs differ from the fused kernel's by float rounding (~1e-7).
    * longer ones: kv heads repeated, then torch's scaled_dot_product_attention (its CPU flash kernel keeps
      memory linear in T), which is what transformers' "sdpa" attention does.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, k_channels: int | None = None,
                 v_channels: int | None = None):
        # k_channels / v_channels: the head sizes multi-latent attention passes; forward reads them off the tensors
        super().__init__()
        self.config = config
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale  # None: 1/sqrt(head_dim), as Megatron and HF use
        self._causal: dict[int, torch.Tensor] = {}  # T -> (G*T, T) additive causal mask (0 / -inf), per query head

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention takes no attention bias (causal attention of each sequence only)")
        if packed_seq_params is not None:  # packed sequences (THD): query/key (N, heads, D), cumulative lengths
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"SDPACoreAttention: packed sequences in qkv_format "
                                 f"{packed_seq_params.qkv_format!r}; only 'thd' (trainer.Model._packed_output)")
            # each sequence alone, as a batch of one: exactly the attention its padded row gets
            cu = packed_seq_params.cu_seqlens_q.tolist()
            return torch.cat([self.forward(*(t[a:b].unsqueeze(1) for t in (query, key, value)), None)
                              for a, b in zip(cu[:-1], cu[1:])])  # (N, 1, Nq*Dv)
        # query/key (S, B, Nq|Nkv, D); value (S, B, Nkv, Dv), Megatron's sequence-first layout. Dv differs from D
        # under multi-latent attention (DeepSeek-V3: q/k carry a RoPE part on top of the v head size).
        S, B, Hq, D = query.shape
        KV, Dv = key.size(2), value.size(-1)
        G = Hq // KV  # GQA: query head h reads kv head h // G
        dropout = self.dropout_p if self.training else 0.0
        if dropout == 0.0 and S <= EXPLICIT_ATTENTION_MAX_LEN and B * Hq * S * S <= EXPLICIT_ATTENTION_MAX_SCORES \
                and key.size(0) == S and query.is_cpu:  # (CUDA, MLA on the local spec: SDPA's kernels, fp32 softmax)
            scale = self.softmax_scale if self.softmax_scale is not None else D ** -0.5
            if S not in self._causal:  # the G query heads of a kv head are stacked: the mask repeats per head
                causal = torch.full((S, S), float("-inf"), dtype=query.dtype, device=query.device).triu(1)
                self._causal[S] = causal.repeat(G, 1)                                        # (G*S, S)
            mask = self._causal[S]                                                           # (G*S, S)
            q = query.view(S, B, KV, G, D).permute(1, 2, 3, 0, 4).reshape(B * KV, G * S, D)  # (B*KV, G*S, D)
            k = key.permute(1, 2, 0, 3).reshape(B * KV, S, D)                                  # (B*KV, S, D)
            v = value.permute(1, 2, 0, 3).reshape(B * KV, S, Dv)                               # (B*KV, S, Dv)
            scores = torch.baddbmm(mask, q, k.transpose(1, 2), alpha=scale)                 # (B*KV, G*S, S)
            out = torch.bmm(torch.softmax(scores, dim=-1), v)                                 # (B*KV, G*S, Dv)
            return out.view(B, KV, G, S, Dv).permute(3, 0, 1, 2, 4).reshape(S, B, Hq * Dv)    # (S, B, Nq*Dv)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # (B, N, S, D)
        if G > 1:  # GQA: each kv head serves G consecutive query heads
            k = k.repeat_interleave(G, dim=1)  # (B, Nq, Sk, D)
            v = v.repeat_interleave(G, dim=1)  # (B, Nq, Sk, D)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                             dropout_p=dropout)  # (B, Nq, Sq, Dv)
        return out.permute(2, 0, 1, 3).reshape(S, B, -1)  # (Sq, B, Nq * Dv)


class _TorchOnCpu:
    """`torch` as Megatron's schedules module sees it after shim 4: everything delegates to torch, except that
    `zeros(..., device="cuda")` allocates on the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, **kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return torch.zeros(*args, **kwargs)


_SHIMS_APPLIED = False


def apply_cpu_shims() -> bool:
    """Make Megatron-Core run on CPU; a no-op (returning False) when CUDA is present.

    The shims (measured necessary and sufficient here, see docs/CPU.md):
    1. `torch.cuda.current_device()` yields the CPU device: Megatron places its grad buffers, rotary
       tables and a few scratch tensors on "the current CUDA device".
    2. the local layer spec's core attention becomes `SDPACoreAttention` (Megatron's
       DotProductAttention allocates a CUDA buffer).
    3. the optimizer is `torch.optim.AdamW` (`adamw`) with a small TP-aware grad-norm clip (`clip_grad_norm`),
       because Megatron's optimizer wrappers and grad clipping allocate CUDA tensors. This function only reports
       that the shims are on; the trainer reads it.
    4. (pipeline parallelism) the 1F1B schedule's token counter, `torch.zeros([], dtype=torch.int,
       device="cuda")` in `forward_backward_pipelining_without_interleaving` (schedules.py of Megatron-Core
       0.16), is made on the CPU: the schedules module sees a `torch` whose `zeros` maps device="cuda" to the
       CPU. Harmless elsewhere; the rest of the schedule (gloo isend/irecv between stages) runs as it is.
    5. (start-up time) Megatron-Core is imported with `torch.compile` as a plain decorator. As it imports, it wraps
       ~30 fusion helpers in torch.compile, which imports dynamo and inductor: ~2.3 s of every trainer actor's
       start on these cores. On CPU the helpers then run as plain functions, like the rest of the CPU path (the
       fusions are off in convert.megatron_config, so the model calls none of them). Where Megatron was already
       imported, this shim changes nothing.
    6. (activation recomputation, sequence parallelism) Megatron's checkpoint function saves and restores the CUDA
       RNG state around each recomputed block (`_get_cuda_rng_state` / `_set_cuda_rng_state` in
       tensor_parallel/random.py), and under sequence parallelism the embedding's dropout runs inside a fork of the
       model-parallel CUDA RNG state (`CudaRNGStatesTracker.fork`, whose state only model_parallel_cuda_manual_seed
       adds), which all fail without CUDA. On CPU there is no CUDA RNG: the three become no-ops, and every draw
       (dropout, off in convert.megatron_config) is the CPU generator's, which the checkpoint function still saves
       and restores.
    7. (sequence parallelism, cfg.sequence_parallel) the local spec's norms are Megatron's WrappedTorchNorm (torch's
       RMSNorm / LayerNorm), which refuses sequence parallelism: under it each TP rank normalises its own share of
       the positions, so a norm weight's gradient is partial there and must be summed over TP ranks, which
       finalize_model_grads does for weights marked `sequence_parallel` (Megatron's Apex and TE norms mark theirs).
       Here the torch norm is built as usual and its weights are marked the same way.
    Also: models are built with `use_cpu_initialization=True` (convert.megatron_config), which avoids
    `model_parallel_cuda_manual_seed`, another CUDA-only call.
    Returns True when the shims are active.
    """
    global _SHIMS_APPLIED
    if torch.cuda.is_available():
        return False
    if not _SHIMS_APPLIED:
        compile_ = torch.compile  # shim 5
        torch.compile = lambda model=None, **_: model if model is not None else (lambda fn: fn)
        try:
            import megatron.core  # noqa: F401  Megatron: late, and only under shim 5
        finally:
            torch.compile = compile_
        torch.cuda.current_device = lambda: torch.device("cpu")  # shim 1
        from megatron.core.models.backends import LocalSpecProvider  # Megatron: late
        LocalSpecProvider.core_attention = lambda self: SDPACoreAttention  # shim 2
        from megatron.core.pipeline_parallel import schedules  # Megatron: late
        schedules.torch = _TorchOnCpu()  # shim 4
        from megatron.core.tensor_parallel import random as megatron_random  # Megatron: late
        megatron_random._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)  # shim 6
        megatron_random._set_cuda_rng_state = lambda *args, **kwargs: None
        megatron_random.CudaRNGStatesTracker.fork = lambda self, *args, **kwargs: contextlib.nullcontext()
        from megatron.core.transformer.torch_norm import WrappedTorchNorm  # Megatron: late
        WrappedTorchNorm.__new__ = _norm_taking_sequence_parallel(WrappedTorchNorm.__new__)  # shim 7
        _SHIMS_APPLIED = True
    return True


def _norm_taking_sequence_parallel(plain):
    """Shim 7: WrappedTorchNorm's constructor (`plain`) for a config with sequence parallelism: the same torch norm,
    its weights marked `sequence_parallel` (their gradients then summed over TP ranks by finalize_model_grads)."""
    def new(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return plain(cls, config, hidden_size, *args, **kwargs)
        whole = copy.copy(config)  # what the norm reads of the config, with the flag it refuses off
        whole.sequence_parallel = False
        norm = plain(cls, whole, hidden_size, *args, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm
    return new


def moe_router_without_te() -> None:
    """Megatron-Core 0.16's MoE router gating refers to Transformer Engine's GEMM by name even when TE
    is not installed (a NameError at the first MoE forward). Define the name as None so the plain
    torch matmul branch runs. Needed wherever TE is absent, CPU or GPU; a no-op when TE is there."""
    from megatron.core.transformer.moe import moe_utils  # Megatron: late
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def mla_without_te() -> None:
    """Megatron-Core 0.16's multi-latent attention takes Transformer Engine's layer classes from a module that puts
    MagicMocks in their place when TE is not installed, so its own HAVE_TE reads True and its isinstance check on
    TELinear raises a TypeError while the layer is built. Mark TE absent there so the plain torch path runs. Needed
    wherever TE is absent, CPU or GPU; a no-op when TE is there."""
    from megatron.core.extensions import transformer_engine as te_extension  # Megatron: late
    from megatron.core.transformer import multi_latent_attention  # Megatron: late
    if not te_extension.HAVE_TE:
        multi_latent_attention.HAVE_TE = False


def adamw(model, cfg, lr: float) -> torch.optim.AdamW:
    """Shim 3: torch's AdamW over `model` at `lr`, with cfg's betas, eps and weight decay; norms and biases get no
    decay (as Megatron's optimizer has it). Clipping is `clip_grad_norm`'s."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)


def clip_grad_norm(model, clip: float, tp_group=None, pp_group=None, experts: bool = False) -> float:
    """Shim 3: total L2 norm of `model`'s (DP-summed) gradients across TP shards, EP ranks and pipeline stages,
    then clip in place when `clip` > 0. Groups are None where their size is 1; `experts`: the model has MoE layers.

    Replicated parameters (norms, router) are counted once: only TP rank 0's copy, via Megatron's
    `param_is_not_tensor_parallel_duplicate`. Gradients are equal on every DP rank after the
    all-reduce, so no DP reduction is needed.
    """
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate  # Megatron: late

    params = [p for p in model.parameters() if p.grad is not None]
    sq = torch.zeros((), dtype=torch.float64)
    sq_experts = torch.zeros((), dtype=torch.float64)  # expert weights: each EP rank holds other experts
    for p in params:
        if not getattr(p, "allreduce", True):  # Megatron marks expert parameters allreduce=False
            sq_experts += p.grad.double().pow(2).sum()  # expert TP shards are split, never duplicated
        elif param_is_not_tensor_parallel_duplicate(p):
            sq += p.grad.double().pow(2).sum()
    if tp_group is not None:
        torch.distributed.all_reduce(sq, group=tp_group)
    if experts:  # over every rank holding a different expert shard (EP x expert TP)
        from megatron.core import parallel_state  # Megatron: late
        group = parallel_state.get_expert_tensor_and_model_parallel_group()
        if torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(sq_experts, group=group)
    sq = sq + sq_experts
    if pp_group is not None:  # each stage holds other layers (embeddings are never tied under PP: megatron_config)
        torch.distributed.all_reduce(sq, group=pp_group)
    norm = float(sq.sqrt())
    if clip > 0 and norm > clip:
        for p in params:
            p.grad.mul_(clip / (norm + 1e-6))
    return norm


class _CallInBackward(torch.autograd.Function):
    """The identity, whose backward first calls `fn()`: a hook at one point of the backward pass (BorrowedCores
    puts one at every transformer layer's input)."""

    @staticmethod
    def forward(ctx, x, fn):
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.fn()
        return grad, None


class BorrowedCores:
    """A trainer rank that also computes on the cores of the engines in `lent` ((engine, its cores), from the
    controller's core placement) while they have nothing to generate (async on a local CPU node:
    cfg.borrow_engine_cores). Every thread of this process may then run on them, and before each transformer
    layer, in the forward and the backward pass, the torch thread count becomes the rank's own (`own_threads`)
    plus the cores of the lending engines whose byte in `busy_file` is 0 (cpu_engine.CpuEngine keeps its byte at 1
    while it has requests). A layer is the grain: an engine that gets work waits at most one layer's pass for
    its core."""

    def __init__(self, busy_file: str, lent: list[tuple[int, list[int]]], own_threads: int):
        with open(busy_file, "rb") as f:
            self.flags = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)  # byte i: engine i is computing
        self.lent = [(i, len(cores)) for i, cores in lent]  # (engine, its core count)
        self.own = int(own_threads)
        self.seconds, self._last = [0.0, 0.0], None  # a train step's seconds: [own threads, borrowing]
        self.cores = os.sched_getaffinity(0) | {c for _, cs in lent for c in cs}
        for tid in thread_ids():  # threads started later (torch's pool) inherit it
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                os.sched_setaffinity(tid, self.cores)

    def new_step(self) -> None:
        """Count a train step's layer passes from its first one."""
        self.seconds, self._last = [0.0, 0.0], None

    def adapt_threads(self) -> None:
        """torch threads = the rank's own + the cores of its lending engines that are idle now. Also adds the
        seconds since the last call to `seconds` under the thread count they ran with."""
        now, was = time.perf_counter(), torch.get_num_threads()
        if self._last is not None:  # None: the first layer of a train step
            self.seconds[was > self.own] += now - self._last
        self._last = now
        n = self.own + sum(k for i, k in self.lent if not self.flags[i])
        if n != was:
            torch.set_num_threads(n)

    def metrics(self) -> dict[str, float]:
        """The share of this train step's layer passes that ran on borrowed cores."""
        own, borrowed = self.seconds
        return {"perf/trainer_borrowed_frac": borrowed / max(own + borrowed, 1e-9)}

    def hook_layers(self, gpt) -> None:
        """`adapt_threads` before every transformer layer of the GPTModel `gpt`, forward and backward (once)."""
        if getattr(gpt, "_adapts_threads", False):
            return

        def before_layer(layer, args, kwargs):
            self.adapt_threads()
            if torch.is_grad_enabled() and "hidden_states" in kwargs and kwargs["hidden_states"].requires_grad:
                kwargs["hidden_states"] = _CallInBackward.apply(kwargs["hidden_states"], self.adapt_threads)
            return args, kwargs
        for layer in gpt.decoder.layers:
            layer.register_forward_pre_hook(before_layer, with_kwargs=True)
        gpt._adapts_threads = True


def offload_to_file(tensors: list[torch.Tensor], path) -> list[tuple]:
    """The colocated hand-off's offload on CPU: every tensor's bytes into one file at `path` (a Path), its storage
    freed (`.data` becomes empty), so the bytes really leave this process (on CUDA they go to pinned host memory,
    which is what a GPU frees). Returns the entries `onload_from_file` reads them back with."""
    path.parent.mkdir(parents=True, exist_ok=True)
    total = sum(t.numel() * t.element_size() for t in tensors)
    dst = torch.from_file(str(path), shared=True, size=max(total, 1), dtype=torch.uint8)  # (total,) the file
    entries, off = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        dst[off:off + n].copy_(t.data.contiguous().view(-1).view(torch.uint8))
        entries.append((t, off, t.shape))
        off += n
        t.data = torch.empty(0, dtype=t.dtype)
    del dst  # unmapped: the bytes live in the file only
    return entries


def onload_from_file(entries: list[tuple], path) -> None:
    """Inverse of offload_to_file: each tensor gets fresh storage with its bytes from the file, which is removed."""
    src = torch.from_file(str(path), shared=False, size=max(path.stat().st_size, 1), dtype=torch.uint8)
    for t, off, shape in entries:
        fresh = torch.empty(shape, dtype=t.dtype)
        n = fresh.numel() * fresh.element_size()
        fresh.view(-1).view(torch.uint8).copy_(src[off:off + n])
        t.data = fresh
    del src
    path.unlink(missing_ok=True)
