"""The CPU engine's model runner (SGLang's ModelRunner, below the scheduler and HTTP app of cpu_engine.py): the
transformers model, its slot KV cache and attention, and the sampling kernels (`sample`, `mask_by_grammar`).

* `ModelRunner`: the transformers model and a preallocated slot KV cache of shape (layers, slots, kv_heads, max_len,
  head_dim). The forward pass reuses the model's own modules and parameters (embeddings, norms, q/k norms, rotary
  embedding, o/down projections, activation, lm_head), with q|k|v and gate|up each run as one matmul over fused
  weights that the modules' parameters are views of, and its own attention over the slot cache; Qwen3 (q/k norm),
  Qwen2 (qkv bias), Llama, Mistral, Qwen3-MoE and DeepSeek-V3 (multi-latent attention, its keys and values cached
  expanded per head; grouped sigmoid routing, shared experts, dense first layers) layouts work. Decode-step costs that
  need not recur are paid once: weight matrices are kept in oneDNN's blocked layout (re-blocked when a weight update
  touches them), RoPE cos/sin come from a table, K/V land in the cache with one index_copy_.

Long prompts (docs/CPU.md). A prefill runs in pieces of CHUNKED_PREFILL_SIZE tokens (SGLang's chunked prefill) and
computes the last position's logits only: its memory grows with the prompt, not its square. `--max-len` sizes the KV
cache, refused at start if the memory available cannot hold it; a longer prompt is a 400 naming it. Exactness: decode
steps and prefill steps of up to DENSE_ATTENTION_MAX_LEN (192) tokens a row run the written-out `_attention`, as
before and as the trainer for such sequences; longer ones torch's fused kernel, as the trainer past 192 tokens.

Test: tests/test_cpu_engine.py (the engine against transformers, chunked prefill and its memory), tests/test_moe.py,
tests/test_deepseek.py, tests/test_lora.py.
"""
import contextlib
import dataclasses
import difflib

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import lora
import transfermesh

# Long prompts (the module docstring): a prefill's piece (SGLang's --chunked-prefill-size); the written-out attention's
# reach (tokens a row: the trainer's cpu.EXPLICIT_ATTENTION_MAX_LEN) and its largest score tensor.
CHUNKED_PREFILL_SIZE = 1024
DENSE_ATTENTION_MAX_LEN, DENSE_ATTENTION_MAX_SCORES = 192, 2 ** 24
SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral", "qwen3_moe", "deepseek_v3")  # layouts forward handles


class BadRequest(ValueError):
    """A client error: the HTTP layer answers 400 with this message, and the engine keeps serving."""


def sample(logits: torch.Tensor, params: list, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row by inverse-CDF sampling with the pre-drawn uniforms `u`; greedy where temperature == 0.
    `params`: each row's cpu_engine.SamplingParams (temperature, top_k, top_p, min_p).

    Returns (tokens, logp): logp is log_softmax of the RAW logits (temperature 1, no filtering) at the sampled token,
    i.e. the policy's logprob (docs/ENGINES.md says why).
    """
    B, V = logits.shape
    logp_all = torch.log_softmax(logits, dim=-1)                                          # (B, V) policy logprobs
    temps = torch.tensor([p.temperature for p in params])                                 # (B,)
    greedy = temps == 0
    tokens = logits.argmax(dim=-1)                                                        # (B,)
    if not bool(greedy.all()):
        probs = torch.softmax(logits / temps.clamp_min(1e-6)[:, None], dim=-1)            # (B, V)
        filtered = any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params)
        if filtered:
            probs, order = probs.sort(dim=-1, descending=True)                            # (B, V) largest first
            rank = torch.arange(V)[None, :]
            top_k = torch.tensor([p.top_k if p.top_k > 0 else V for p in params])[:, None]
            top_p = torch.tensor([p.top_p for p in params])[:, None]
            min_p = torch.tensor([p.min_p for p in params])[:, None]
            drop = (rank >= top_k) | (probs.cumsum(-1) - probs > top_p) | (probs < min_p * probs[:, :1])
            drop[:, 0] = False  # the most likely token always survives
            probs = probs.masked_fill(drop, 0.0)
        cdf = probs.cumsum(dim=-1)                                                        # (B, V)
        idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp_max(V - 1)[:, 0]  # (B,)
        sampled = order.gather(1, idx[:, None])[:, 0] if filtered else idx
        tokens = torch.where(greedy, tokens, sampled)
    logp = logp_all.gather(1, tokens[:, None])[:, 0]                                      # (B,)
    return tokens, logp


def mask_by_grammar(logits: torch.Tensor, grammars: list) -> torch.Tensor:
    """The logits with every token a row's grammar refuses next set to -inf (rows without a grammar unchanged), as
    SGLang applies xgrammar's token bitmask to the logits in place before its sampler. So the token is drawn from the
    masked distribution, and its logprob (`sample`: log_softmax at temperature 1) is that of the masked distribution,
    renormalized over the allowed tokens: what SGLang 0.5.23 returns with SGLANG_RETURN_ORIGINAL_LOGPROB (its
    original_logprobs are taken from the logits after the mask, layers/sampler.py; model_runner._preprocess_logits
    applies the mask first). The trainer's recomputed logprob is of the unmasked policy: the two differ by the log of
    the probability mass the grammar allowed."""
    import xgrammar  # here: only a batch with a constrained request needs it (its import takes ~1.4 s)
    B, V = logits.shape
    bitmask = xgrammar.allocate_token_bitmask(B, V)                                      # (B, ceil(V/32)) int32, all 1
    for i, g in enumerate(grammars):
        if g is not None and not g.is_terminated():
            g.fill_next_token_bitmask(bitmask, i)
    masked = logits.clone()  # the caller's logits may be the forward's own output
    xgrammar.apply_token_bitmask_inplace(masked, bitmask)                                # SGLang's call, its CPU kernel
    return masked                                                                        # (B, V)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (Qwen3RMSNorm, LlamaRMSNorm, ...) written as it computes, so bit-identical to it: in
    fp32, then the weight times the result in x's dtype. `weight` broadcasts over x's last dim ((D,) or (heads, D)).
    Six ops; torch's fused rms_norm decomposes into ~10 on CPU."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """RoPE's sin (..., D) as (-sin1 | sin2), its halves' signs set so that rotate_half(x) * sin == roll(x, D/2) *
    _signed_sin(sin) exactly (a sign moved between two factors)."""
    h = sin.shape[-1] // 2
    return torch.cat((-sin[..., :h], sin[..., h:]), dim=-1)


def _attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask_add: torch.Tensor,
               scale: float) -> torch.Tensor:
    """Grouped-query attention of q (B, T, Hq, D) over keys (B, KV, S, D) and values (B, KV, S, Dv); mask_add
    (B*KV, G*T, S) holds 0 where a key is visible and -inf elsewhere. Dv differs from D under multi-latent
    attention (DeepSeek-V3).

    Written out instead of calling scaled_dot_product_attention: it reads the slot cache's strided views without
    copies, folds the mask and scale into one baddbmm, and measured ~20% faster than the CPU SDPA kernel for the
    one-query decode shape. Query head h reads key/value head h // G (G = Hq // KV), as transformers' repeat_kv
    lays them out. Its scores and mask are B*Hq*T*S floats each: longer prefills go to `_fused_attention`.
    """
    B, T, Hq, D = q.shape
    KV, S, Dv = keys.shape[1], keys.shape[2], values.shape[3]
    G = Hq // KV
    q = q.reshape(B, T, KV, G, D).permute(0, 2, 3, 1, 4).reshape(B * KV, G * T, D)       # (B*KV, G*T, D)
    scores = torch.baddbmm(mask_add, q, keys.reshape(B * KV, S, D).transpose(1, 2), alpha=scale)  # (B*KV, G*T, S)
    out = torch.softmax(scores, dim=-1) @ values.reshape(B * KV, S, Dv)                  # (B*KV, G*T, Dv)
    return out.view(B, KV, G, T, Dv).permute(0, 3, 1, 2, 4).reshape(B, T, Hq, Dv)        # (B, T, Hq, Dv)


def _fused_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: torch.Tensor,
                     lens: torch.Tensor, scale: float) -> torch.Tensor:
    """`_attention` by torch's fused kernel (CPU flash attention: no scores in memory), row by row: row b's lens[b]
    queries at positions start[b]... over its first start[b] + lens[b] keys, causal by the kernel's own flag from
    position 0, by a boolean (lens, start + lens) mask past cached K/V. The kernel takes one head size: multi-latent
    attention's values (Dv < D) are zero-padded to D, the padding sliced off. Padding queries give 0."""
    (B, T, Hq, D), Dv = q.shape, values.shape[-1]
    out = q.new_zeros(B, T, Hq, Dv)                                                      # (B, T, Hq, Dv)
    for b, (s, n) in enumerate(zip(start.tolist(), lens.tolist())):
        k, v = keys[b:b + 1, :, :s + n], F.pad(values[b:b + 1, :, :s + n], (0, D - Dv))  # (1, KV, s+n, D)
        mask = None if s == 0 else torch.arange(s + n) <= torch.arange(s, s + n)[:, None]  # (n, s+n) visible
        o = F.scaled_dot_product_attention(q[b:b + 1, :n].transpose(1, 2), k, v, attn_mask=mask, is_causal=s == 0,
                                           scale=scale, enable_gqa=True)                  # (1, Hq, n, D)
        out[b, :n] = o[0, :, :, :Dv].transpose(0, 1)                                      # (n, Hq, Dv)
    return out


def _fuse_rows(params: list) -> torch.Tensor:
    """Concatenate parameters along dim 0 and turn each into a view of the result, so a later in-place copy into
    any of them (a weight update) also updates the fused tensor."""
    fused = torch.cat([p.data for p in params])
    offset = 0
    for p in params:
        p.data = fused[offset:offset + p.shape[0]]
        offset += p.shape[0]
    return fused


@dataclasses.dataclass(eq=False)
class LoraAdapter:
    """A loaded LoRA adapter (SGLang's LoRAAdapter): per layer, for each fused weight the forward pass multiplies
    by ("qkv", "o", "gate_up", "down"), the (column offset in its output, A (r, in), B (rows, r)) of every projection
    it adapts there."""
    name: str
    path: str                 # where it came from (SGLang's lora_path; "__tensor__" for tensors)
    scale: float              # lora_alpha / r
    layers: list              # [{fused key: [(offset, A, B), ...]}] per layer


class ModelRunner:
    """The model side of the CPU engine (the module docstring): it knows slots and token ids, not requests. `forward`
    runs chunks of ids into given slots at given offsets, the scheduler (CpuEngine) decides which, on its thread."""

    def __init__(self, model_path: str, *, max_batch: int, max_len: int | None, dtype: str, fp32_lm_head: bool):
        self.model_path = str(model_path)
        self.dtype = getattr(torch, dtype)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype).eval()
        self.model.requires_grad_(False)
        cfg = self.model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"CPU engine supports model types {SUPPORTED_MODEL_TYPES}, got {cfg.model_type!r} "
                             f"from {self.model_path}; use engine=sglang for other architectures")
        self.vocab_size = self.model.get_input_embeddings().weight.shape[0]
        eos = [getattr(source, "eos_token_id", None) for source in (self.model.generation_config, cfg)]
        self.eos_ids = frozenset(i for e in eos for i in ([e] if isinstance(e, int) else e or []))
        self.max_batch = int(max_batch)
        self.max_len = int(min(max_len or cfg.max_position_embeddings, cfg.max_position_embeddings))
        self.fp32_lm_head = bool(fp32_lm_head)  # logits from an fp32 matmul (no-op for fp32 weights), SGLang's flag

        attn = self.model.model.layers[0].self_attn
        # DeepSeek-V3's multi-latent attention: every head has its own key (a no-RoPE part expanded from the shared
        # latent, then the RoPE part all heads share) and its own value, of another size. The cache holds those
        # expanded keys and values, as transformers' attention reads them (SGLang's MLA keeps the latent instead).
        self.mla = cfg.model_type == "deepseek_v3"
        if self.mla:
            if cfg.attention_bias or not cfg.rope_interleave:
                raise ValueError(f"{self.model_path}: deepseek_v3 with attention_bias={cfg.attention_bias} / "
                                 f"rope_interleave={cfg.rope_interleave} is not supported by the CPU engine (it runs "
                                 "DeepSeek-V3's layout: no attention biases, interleaved RoPE)")
            self.head_dim, self.v_head_dim = attn.qk_head_dim, attn.v_head_dim
            self.n_heads = self.n_kv_heads = cfg.num_attention_heads
        else:
            self.head_dim = self.v_head_dim = attn.head_dim
            self.n_heads, self.n_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        # One q|k|v and one gate|up matmul per layer instead of five: fewer, larger matmuls and fewer ops per step.
        # The transformers modules' parameters become views of the fused tensors, so loading weights into the
        # model by name (load_weights) updates what the forward pass reads.
        self.qkv_w, self.qkv_b, self.gate_up_w = [], [], []
        self.moe = cfg.model_type in ("qwen3_moe", "deepseek_v3")
        if cfg.model_type == "qwen3_moe":
            hf = cfg.to_dict()  # the HF config: older ones lack these keys
            if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
                raise ValueError(f"{self.model_path}: the CPU engine runs all-MoE Qwen3-MoE models only "
                                 f"(mlp_only_layers={hf.get('mlp_only_layers')}, "
                                 f"decoder_sparse_step={hf.get('decoder_sparse_step')})")
        if self.moe:
            self.num_experts, self.topk = cfg.num_local_experts, cfg.num_experts_per_tok
            self.norm_topk_prob = bool(cfg.norm_topk_prob)
        for p in self.model.parameters():  # weights mmap'd from the checkpoint: own them, so a release can free them
            if not p.untyped_storage().resizable():
                p.data = p.data.clone()
        # transformers keeps each layer's experts as two 3-D parameters (gate|up and down, expert-major); checkpoints
        # and weight updates name every expert's matrix on its own, so map those names onto views of the 3-D tensors
        self.expert_views = {}
        for li, layer in enumerate(self.model.model.layers):
            if not hasattr(layer.mlp, "experts"):  # a dense model, or DeepSeek-V3's first dense layers
                continue
            ex, F_ = layer.mlp.experts, cfg.moe_intermediate_size
            for e in range(self.num_experts):
                p = f"model.layers.{li}.mlp.experts.{e}."
                self.expert_views.update({p + "gate_proj.weight": ex.gate_up_proj.data[e, :F_],
                                          p + "up_proj.weight": ex.gate_up_proj.data[e, F_:],
                                          p + "down_proj.weight": ex.down_proj.data[e]})
        # per layer, the SwiGLU MLP run as gate|up and down matmuls: the dense MLP, DeepSeek-V3's shared experts in
        # an MoE layer (every token goes through them), None for a Qwen3-MoE layer
        self.dense_mlp = [layer.mlp if not hasattr(layer.mlp, "experts") else getattr(layer.mlp, "shared_experts", None)
                          for layer in self.model.model.layers]
        for layer, mlp in zip(self.model.model.layers, self.dense_mlp):
            a = layer.self_attn
            if mlp is not None and getattr(mlp.gate_proj, "bias", None) is not None:
                raise ValueError(f"{self.model_path}: MLP biases are not supported by the CPU engine")
            if self.mla:  # the two projections of h: q's latent (or q itself without q_lora_rank) | the kv latent
                self.qkv_w.append(_fuse_rows([(a.q_a_proj if a.q_lora_rank else a.q_proj).weight,
                                              a.kv_a_proj_with_mqa.weight]))
                self.qkv_b.append(None)
            else:
                self.qkv_w.append(_fuse_rows([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
                self.qkv_b.append(_fuse_rows([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
                                  if a.q_proj.bias is not None else None)  # Qwen2 has q/k/v biases
            self.gate_up_w.append(_fuse_rows([mlp.gate_proj.weight, mlp.up_proj.weight]) if mlp is not None else None)
        # RoPE cos/sin for every position, computed once by the model's own rotary module (elementwise per
        # position, so a table lookup gives the very same values); rope types that rescale with the sequence
        # length ("dynamic", "longrope") are computed per step instead.
        rope = self.model.model.rotary_emb
        self.rope_table = None
        if "dynamic" not in str(getattr(rope, "rope_type", "")) and getattr(rope, "rope_type", "") != "longrope":
            probe = torch.zeros(1, dtype=self.dtype)
            cos, sin = rope(probe, torch.arange(self.max_len)[None])                     # (1, max_len, D) each
            self.rope_table = (cos[0], _signed_sin(sin[0]))                               # (max_len, D) each
        self._pack_weights()
        # kv heads before positions: a slot's keys for one head are one (S, D) block, so attention reads a
        # batch of slots as a strided view and the matmuls need no copy
        cache_shape = (cfg.num_hidden_layers, self.max_batch, self.n_kv_heads, self.max_len)
        need = cfg.num_hidden_layers * self.max_batch * self.n_kv_heads * self.max_len * self.dtype.itemsize \
            * (self.head_dim + self.v_head_dim)                                           # bytes of k_cache + v_cache
        free = float("inf")  # MemAvailable: what Linux can give without swapping (unknown without /proc: macOS)
        with contextlib.suppress(OSError), open("/proc/meminfo") as f:
            free = next((int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:")), free)
        if need > free:  # refused here, not killed by the kernel in the allocation
            raise ValueError(f"the CPU engine's KV cache for --max-batch {self.max_batch} x --max-len {self.max_len} "
                             f"tokens needs {need / 2 ** 30:.1f} GiB, and {free / 2 ** 30:.1f} GiB are available: "
                             f"start it with a smaller --max-len (or --max-batch)")
        self.k_cache = torch.zeros(cache_shape + (self.head_dim,), dtype=self.dtype)    # (L, slots, KV, max_len, D)
        self.v_cache = torch.zeros(cache_shape + (self.v_head_dim,), dtype=self.dtype)  # (L, slots, KV, max_len, Dv)
        self.released: dict[str, list] = {}  # tag -> [(storage, nbytes)] handed back by release()
        self.step_adapters: list = []  # LoRA: the adapters of the rows of the forward pass running (see _lora)

    def _pack_weights(self, names: list[str] | None = None) -> None:
        """oneDNN's blocked copy of every weight matrix the forward pass multiplies by: F.linear (MKL's sgemm) lays the
        weight out into GEMM panels on every call, and at decode shapes oneDNN's kernel on a pre-blocked weight ran
        1.2-2x faster (docs/CPU.md); fp32 results differ in rounding only. Re-run after every weight load with the
        loaded names (the blocked copy does not follow in-place updates). Without oneDNN (or for non-fp32 weights)
        the forward pass uses F.linear."""
        dnn = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise") and \
            self.dtype == torch.float32
        weights = {"lm_head": self.model.lm_head.weight}
        for li, layer in enumerate(self.model.model.layers):
            a = layer.self_attn
            weights.update({("qkv", li): self.qkv_w[li], ("o", li): a.o_proj.weight})
            if self.mla:  # the latents' up-projections
                weights[("kv_b", li)] = a.kv_b_proj.weight
                if a.q_lora_rank:
                    weights[("q_b", li)] = a.q_b_proj.weight
            if self.dense_mlp[li] is not None:  # experts run as small per-expert matmuls (_moe_mlp): not packed
                weights.update({("gate_up", li): self.gate_up_w[li], ("down", li): self.dense_mlp[li].down_proj.weight})
        if names is None:
            self.packed = {}
            # HF parameter name -> the packed weights it lives in (by storage: fused views and tied embeddings too)
            by_storage = {w.untyped_storage().data_ptr(): key for key, w in weights.items()}
            self._packed_keys = {name: by_storage[p.untyped_storage().data_ptr()]
                                 for name, p in self.model.named_parameters(remove_duplicate=False)
                                 if p.untyped_storage().data_ptr() in by_storage}
        # per layer, the (weight, eps) of its norms: input, q|k (Qwen3: q_norm's weight on every query head and
        # k_norm's on every key head, one (Hq+KV, D) tensor, so one norm serves both; None without), post-attention
        self.norms = []
        for layer in self.model.model.layers:
            a, qk = layer.self_attn, None
            if hasattr(a, "q_norm"):
                assert a.q_norm.variance_epsilon == a.k_norm.variance_epsilon, "q_norm and k_norm eps differ"
                heads = [a.q_norm.weight.expand(self.n_heads, -1), a.k_norm.weight.expand(self.n_kv_heads, -1)]
                qk = (torch.cat(heads), a.q_norm.variance_epsilon)                    # (Hq+KV, D), eps
            pre, post = layer.input_layernorm, layer.post_attention_layernorm
            self.norms.append(((pre.weight, pre.variance_epsilon), qk, (post.weight, post.variance_epsilon)))
        keys = weights if names is None else {self._packed_keys[n] for n in names if n in self._packed_keys}
        for key in keys:  # a weight update repacks only what it touched
            w = weights[key]
            self.packed[key] = (w, torch.ops.mkldnn._reorder_linear_weight(w, self.max_batch) if dnn else None)

    def _linear(self, x: torch.Tensor, key, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T (+ bias) for the weight named `key` in `self.packed` (see _pack_weights)."""
        w, packed = self.packed[key]
        if packed is None or x.numel() == x.shape[-1]:  # one row: sgemm's vector path is the faster one
            return F.linear(x, w, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    def forward(self, slot_ids: list[int], kv_lens: list[int], chunks: list[list[int]],
                return_routed: bool = False, adapters: list | None = None) -> tuple[torch.Tensor, list | None]:
        """Run the transformer over right-padded chunks, chunk b's K/V written into slot `slot_ids[b]` from
        position `kv_lens[b]` on (the tokens already there), each chunk attending over everything in its slot, chunk b
        through LoRA adapter `adapters[b]` (None: the base model). Returns (logits at each chunk's last token (B, V),
        and with `return_routed` on an MoE model the (len(chunk), layers, top_k) int32 experts each chunk's tokens were
        routed to, else None).

        Chunks longer than CHUNKED_PREFILL_SIZE run as pieces of that many tokens (SGLang's chunked prefill), each
        over the K/V the pieces before it wrote, so a prefill's memory is one piece's whatever the prompt's length."""
        C, adapters = CHUNKED_PREFILL_SIZE, adapters or [None] * len(chunks)
        if max(len(c) for c in chunks) <= C:
            return self._forward(slot_ids, kv_lens, chunks, return_routed, adapters)
        logits, routed = [None] * len(chunks), [[] for _ in chunks]
        for t0 in range(0, max(len(c) for c in chunks), C):
            rows = [b for b, c in enumerate(chunks) if len(c) > t0]  # the chunks that reach this piece
            out, r = self._forward([slot_ids[b] for b in rows], [kv_lens[b] + t0 for b in rows],
                                   [chunks[b][t0:t0 + C] for b in rows], return_routed, [adapters[b] for b in rows])
            for i, b in enumerate(rows):
                logits[b] = out[i]  # the last piece a chunk reaches holds its last token
                routed[b] += [] if r is None else [r[i]]
        return torch.stack(logits), [torch.cat(r) for r in routed] if routed[0] else None

    def _forward(self, slot_ids: list[int], kv_lens: list[int], chunks: list[list[int]], return_routed: bool,
                 adapters: list) -> tuple[torch.Tensor, list | None]:
        """`forward` over chunks of at most CHUNKED_PREFILL_SIZE tokens."""
        m = self.model.model
        B, T, D, Dv = len(chunks), max(len(c) for c in chunks), self.head_dim, self.v_head_dim
        # LoRA: [(adapter, its rows as an index tensor, or None when every row has it)], read by _lora
        groups: dict = {}
        for b, a in enumerate(adapters):
            if a is not None:
                groups.setdefault(a, []).append(b)
        self.step_adapters = [(a, None if len(rows) == B else torch.tensor(rows)) for a, rows in groups.items()]
        Hq, KV = self.n_heads, self.n_kv_heads
        lens = torch.tensor([len(c) for c in chunks])                                     # (B,)
        start = torch.tensor(kv_lens)                                                     # (B,) cache offset
        slots = torch.tensor(slot_ids)                                                    # (B,)
        ids = torch.tensor([c + [0] * (T - len(c)) for c in chunks])                     # (B, T) right-padded
        pos = start[:, None] + torch.arange(T)                                            # (B, T) absolute positions
        S = int((start + lens).max())                                                     # keys to attend over
        key_pos = torch.arange(S)
        G = Hq // KV
        # key j is visible to query i of row b iff j <= pos[b, i] (causal) and j < start[b] + lens[b] (written);
        # built once per step as an additive mask in the (B*KV, G*T, S) layout _attention uses, for a step that
        # takes the written-out attention (the module docstring: where it and the fused kernel agree bit for bit)
        dense = T == 1 or T <= DENSE_ATTENTION_MAX_LEN and B * Hq * T * S <= DENSE_ATTENTION_MAX_SCORES
        if T == 1:  # decode: one query per row, so the mask is per row only and baddbmm broadcasts it over G
            visible = (key_pos[None, :] < (start + lens)[:, None])[:, None, None, :]     # (B, 1, 1, S)
            visible = visible.expand(B, KV, 1, S).reshape(B * KV, 1, S)                  # (B*KV, 1, S)
        elif dense:
            visible = (key_pos <= pos[:, :, None]) & (key_pos < (start + lens)[:, None, None])  # (B, T, S)
            visible = visible[:, None, None].expand(B, KV, G, T, S).reshape(B * KV, G * T, S)
        mask_add = torch.zeros(visible.shape, dtype=self.dtype).masked_fill_(~visible, float("-inf")) if dense else None
        valid = torch.arange(T)[None, :] < lens[:, None]                                  # (B, T) real tokens
        all_valid = bool(valid.all())  # decode steps: every row holds exactly one real token
        write_slots = slots[:, None].expand(B, T)[valid]                                  # (n_valid,)
        write_pos = pos[valid]                                                            # (n_valid,)
        # rows of a layer's cache viewed as (slots*KV*max_len, D) that the new K/V go to: one index_copy_ per
        # layer instead of a scattered two-index assignment
        write_rows = ((write_slots[:, None] * KV + torch.arange(KV)) * self.max_len + write_pos[:, None]).view(-1)
        s0 = int(slots.min())
        contiguous = bool((slots == torch.arange(s0, s0 + B)).all())  # then read the cache as a view, no gather

        routed = []  # MoE: per layer, (n_valid, top_k) experts chosen for each real token (0s in a dense layer)
        x = m.embed_tokens(ids)                                                           # (B, T, H)
        if self.rope_table is not None:
            cos, sin = self.rope_table[0][pos], self.rope_table[1][pos]                  # (B, T, D) each, sin signed
        else:
            cos, sin = m.rotary_emb(x, pos)                                               # (B, T, D) each
            sin = _signed_sin(sin)                                                        # (B, T, D)
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]                                 # (B, T, 1, D)
        for li, layer in enumerate(m.layers):
            attn, mlp = layer.self_attn, layer.mlp
            h = _rms_norm(x, *self.norms[li][0])                                          # (B, T, H)
            if self.mla:
                q, k, v = self._mla_qkv(h, li, attn, cos, sin)                            # (B, T, Hq, D|D|Dv)
            else:
                qkv = self._lora(self._linear(h, ("qkv", li), self.qkv_b[li]), h, li, "qkv").view(B, T, Hq + 2 * KV, D)
                qk, v = qkv[:, :, :Hq + KV], qkv[:, :, Hq + KV:]                          # (B, T, Hq+KV|KV, D)
                if self.norms[li][1]:  # Qwen3: RMSNorm over each head before RoPE (q_norm's weight on q, k_norm's on k)
                    qk = _rms_norm(qk, *self.norms[li][1])                                # (B, T, Hq+KV, D)
                # RoPE on q and k at once, as transformers computes it: x * cos + rotate_half(x) * sin (_signed_sin)
                qk = qk * cos + qk.roll(D // 2, dims=-1) * sin                           # (B, T, Hq+KV, D)
                q, k = qk[:, :, :Hq], qk[:, :, Hq:]                                       # (B, T, Hq|KV, D)
            if all_valid:
                k_new, v_new = k.reshape(B * T, KV, D), v.reshape(B * T, KV, Dv)         # (n_valid, KV, D|Dv)
            else:
                k_new, v_new = k[valid], v[valid]                                         # (n_valid, KV, D|Dv)
            self.k_cache[li].view(-1, D).index_copy_(0, write_rows, k_new.reshape(-1, D))  # into the slots
            self.v_cache[li].view(-1, Dv).index_copy_(0, write_rows, v_new.reshape(-1, Dv))
            if contiguous:
                keys, values = self.k_cache[li, s0:s0 + B, :, :S], self.v_cache[li, s0:s0 + B, :, :S]
            else:
                keys, values = self.k_cache[li, slots, :, :S], self.v_cache[li, slots, :, :S]  # (B, KV, S, D)
            if dense:
                out = _attention(q, keys, values, mask_add, attn.scaling)                 # (B, T, Hq, Dv)
            else:
                out = _fused_attention(q, keys, values, start, lens, attn.scaling)        # (B, T, Hq, Dv)
            out = out.reshape(B, T, Hq * Dv)                                              # (B, T, Hq*Dv)
            x = x + self._lora(self._linear(out, ("o", li), attn.o_proj.bias), out, li, "o")  # (B, T, H)
            h = _rms_norm(x, *self.norms[li][2])                                          # (B, T, H)
            if hasattr(mlp, "experts"):
                x = x + self._moe_mlp(h, li, mlp, valid, routed)                          # (B, T, H)
                continue
            if self.moe:  # DeepSeek-V3's dense first layers route nothing: SGLang reports 0s for them
                routed.append(torch.zeros(int(valid.sum()), self.topk, dtype=torch.long))
            x = x + self._dense_mlp(h, li)                                                # (B, T, H)
        last = x[torch.arange(B), lens - 1]                                               # (B, H) last real token
        per_chunk = None
        if routed and return_routed:
            per_token = torch.stack(routed, dim=1).to(torch.int32)                        # (n_valid, L, top_k)
            per_chunk = list(per_token.split(lens.tolist()))                              # row-major order of `valid`
        h = _rms_norm(last, m.norm.weight, m.norm.variance_epsilon)                       # (B, H)
        return self.lm_head(h), per_chunk                                                 # (B, V) fp32

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        """(B, H) final hidden states -> (B, V) fp32 logits: the model dtype's matmul, upcast after it; with
        fp32_lm_head (SGLang's --enable-fp32-lm-head) upcast before it, so the logits carry no bf16 rounding."""
        if self.fp32_lm_head and self.dtype != torch.float32:
            return F.linear(h.float(), self.model.lm_head.weight.float())
        return self._linear(h, "lm_head").float()

    def _mla_qkv(self, h: torch.Tensor, li: int, attn, cos: torch.Tensor, sin: torch.Tensor):
        """DeepSeek-V3's multi-latent attention up to per-head q, k (B, T, Hq, D) and v (B, T, Hq, Dv), as
        transformers computes it: q = W_qb RMSNorm(W_qa h) (or W_q h), the latent c = RMSNorm(W_kva h)[:kv_lora_rank]
        expanded by W_kvb into each head's k_nope | v, and RoPE on q's rotary part and on the one rotary key part
        all heads share (its last qk_rope_head_dim columns of W_kva h). D = qk_nope_head_dim + qk_rope_head_dim.

        RoPE here is the interleaved one (transformers' rope_interleave=true): pairs (x0, x1), (x2, x3), ... each
        turned by one frequency, written out de-interleaved, [x_even cos - x_odd sin | x_odd cos + x_even sin]."""
        B, T, _ = h.shape
        Hq, Dn, Dr, Dv = self.n_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim, self.v_head_dim
        down = self._linear(h, ("qkv", li))                               # (B, T, q_lora_rank or Hq*D, + kv_lora + Dr)
        q, latent, k_rot = down.split([down.shape[-1] - attn.kv_lora_rank - Dr, attn.kv_lora_rank, Dr], dim=-1)
        if attn.q_lora_rank:
            qn = attn.q_a_layernorm
            q = self._linear(_rms_norm(q, qn.weight, qn.variance_epsilon), ("q_b", li))  # (B, T, Hq*D)
        q = q.view(B, T, Hq, Dn + Dr)                                                     # (B, T, Hq, D)
        kvn = attn.kv_a_layernorm
        kv = self._linear(_rms_norm(latent, kvn.weight, kvn.variance_epsilon), ("kv_b", li)).view(B, T, Hq, Dn + Dv)
        # the table's cos/sin repeat their first half (cat(freqs, freqs)); sin's second half carries its own sign
        c, s = cos[..., :Dr // 2], sin[..., Dr // 2:]                                      # (B, T, 1, Dr/2) each

        def rope(x):  # (B, T, heads, Dr)
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
        q = torch.cat([q[..., :Dn], rope(q[..., Dn:])], dim=-1)                         # (B, T, Hq, D)
        k_rot = rope(k_rot.view(B, T, 1, Dr)).expand(B, T, Hq, Dr)                        # (B, T, Hq, Dr) shared
        return q, torch.cat([kv[..., :Dn], k_rot], dim=-1), kv[..., Dn:]

    def _dense_mlp(self, h: torch.Tensor, li: int) -> torch.Tensor:
        """Layer li's SwiGLU MLP (the dense one, or DeepSeek-V3's shared experts): down(act(gate h) * up h)."""
        gate, up = self._lora(self._linear(h, ("gate_up", li)), h, li, "gate_up").chunk(2, dim=-1)  # (B, T, F) each
        act = self.dense_mlp[li].act_fn(gate) * up                                        # (B, T, F)
        return self._lora(self._linear(act, ("down", li)), act, li, "down")              # (B, T, H)

    def _route(self, tokens: torch.Tensor, gate) -> tuple[torch.Tensor, torch.Tensor]:
        """(gates, experts), each (N, top_k), of the tokens (N, H), as transformers' routers compute them.

        Qwen3-MoE: softmax over the router logits, top-k, the k probabilities renormalised when norm_topk_prob; the
        gates in the tokens' dtype. DeepSeek-V3 (arXiv 2412.19437, noaux_tc): sigmoid scores s in fp32; the experts
        with the highest s + e_score_correction_bias among the topk_group groups whose top-2 sums of it are highest;
        gates s of those, normalised (norm_topk_prob, + 1e-20), times routed_scaling_factor, kept in fp32."""
        if not self.mla:
            probs = torch.softmax(F.linear(tokens, gate.weight), dim=-1, dtype=torch.float)  # (N, E)
            top_p, top_i = torch.topk(probs, self.topk, dim=-1)                           # (N, K) each
            if self.norm_topk_prob:
                top_p = top_p / top_p.sum(dim=-1, keepdim=True)                           # (N, K)
            return top_p.to(tokens.dtype), top_i
        N, E, G = tokens.shape[0], self.num_experts, gate.num_group
        scores = F.linear(tokens.float(), gate.weight.float()).sigmoid()                  # (N, E)
        choice = scores + gate.e_score_correction_bias                                    # (N, E)
        group_scores = choice.view(N, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)           # (N, G)
        kept = torch.zeros_like(group_scores).scatter_(
            1, torch.topk(group_scores, k=gate.topk_group, dim=-1, sorted=False)[1], 1)   # (N, G) 1 = group allowed
        choice = choice.masked_fill(~kept.bool().repeat_interleave(E // G, dim=1), float("-inf"))  # (N, E)
        top_i = torch.topk(choice, k=self.topk, dim=-1, sorted=False)[1]                 # (N, K)
        top_w = scores.gather(1, top_i)                                                   # (N, K)
        if self.norm_topk_prob:
            top_w = top_w / (top_w.sum(dim=-1, keepdim=True) + 1e-20)
        return top_w * gate.routed_scaling_factor, top_i

    def _moe_mlp(self, h: torch.Tensor, li: int, mlp, valid: torch.Tensor, routed: list) -> torch.Tensor:
        """Layer li's sparse block on the real tokens of h (B, T, H), as transformers computes it: the router's top-k
        experts and gates (`_route`), each expert a SwiGLU MLP over the tokens routed to it, outputs summed with
        those gates; plus DeepSeek-V3's shared experts over every token. Appends this layer's (n_valid, top_k)
        expert ids to `routed` (what `return_routed_experts` reports)."""
        B, T, H = h.shape
        tokens = h[valid]                                                                  # (N, H) real tokens only
        top_w, top_i = self._route(tokens, mlp.gate)                                       # (N, K) each
        routed.append(top_i)
        ex = mlp.experts
        out = torch.zeros_like(tokens)                                                     # (N, H)
        for e in top_i.unique().tolist():
            tok, slot = torch.where(top_i == e)                                            # tokens routed to e
            gate, up = F.linear(tokens[tok], ex.gate_up_proj[e]).chunk(2, dim=-1)         # (n_e, F) each
            y = F.linear(ex.act_fn(gate) * up, ex.down_proj[e])                            # (n_e, H)
            out.index_add_(0, tok, (y * top_w[tok, slot, None]).to(h.dtype))
        full = torch.zeros(B, T, H, dtype=h.dtype)                                         # (B, T, H) 0 on padding
        full[valid] = out
        if self.dense_mlp[li] is not None:  # DeepSeek-V3: + the shared experts' output
            full = full + self._dense_mlp(h, li)                                           # (B, T, H)
        return full

    def make_adapter(self, name: str, path: str, config: dict, named: list, max_rank: int,
                     server_targets: list[str]) -> LoraAdapter:
        """A LoraAdapter from PEFT-named tensors and their adapter_config, checked as SGLang checks an adapter (its
        rank within --max-lora-rank, its targets within --lora-target-modules, no DoRA) and against this model's
        shapes; the tensors are copied. Raises BadRequest naming what does not fit."""
        try:
            r, alpha, targets = int(config["r"]), float(config["lora_alpha"]), config["target_modules"]
        except (KeyError, TypeError, ValueError) as e:
            raise BadRequest(f"LoRA adapter {name}: its config needs r, lora_alpha and target_modules ({e!r})") \
                from None
        targets = [targets] if isinstance(targets, str) else list(targets)
        if config.get("use_dora"):
            raise BadRequest(f"Failed to load {name} because LoRA serving currently doesn't support DoRA adapters")
        if r > max_rank or not set(targets) <= set(server_targets):
            raise BadRequest(f"LoRA adapter {name} with rank {r} is incompatible with the current LoRA memory pool "
                             f"configuration. Please ensure that the LoRA adapter's rank is within the configured "
                             f"`--max-lora-rank` ({max_rank}) and that the target modules ({sorted(targets)}) are "
                             f"included in `--lora-target-modules` ({sorted(server_targets)}).")
        if self.mla or self.moe:
            raise BadRequest(f"LoRA adapter {name}: the CPU engine serves adapters on dense models only, and "
                             f"{self.model_path} is {self.model.config.model_type}; use engine=sglang")
        cfg = self.model.config
        H, D, F_ = cfg.hidden_size, self.head_dim, cfg.intermediate_size
        Hq, KV = self.n_heads * D, self.n_kv_heads * D
        # projection -> (fused key, column offset, rows, input size), as forward lays the fused weights out
        where = {"q_proj": ("qkv", 0, Hq, H), "k_proj": ("qkv", Hq, KV, H), "v_proj": ("qkv", Hq + KV, KV, H),
                 "o_proj": ("o", 0, H, Hq), "gate_proj": ("gate_up", 0, F_, H), "up_proj": ("gate_up", F_, F_, H),
                 "down_proj": ("down", 0, H, F_)}
        mats: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for full_name, t in named:
            m = lora.PEFT_NAME.match(full_name)
            if m is None or int(m.group(1)) >= cfg.num_hidden_layers or m.group(3) not in where:
                raise BadRequest(f"LoRA adapter {name}: tensor {full_name!r} is not a PEFT adapter matrix of this "
                                 f"model's q/k/v/o/gate/up/down projections (base_model.model.model.layers.<L>."
                                 f"self_attn.q_proj.lora_A.weight, ...)")
            if m.group(3) not in targets:
                raise BadRequest(f"LoRA adapter {name}: tensor {full_name!r} adapts {m.group(3)}, which is not in its "
                                 f"target_modules {targets}")
            mats.setdefault((int(m.group(1)), m.group(3)), {})[m.group(4)] = t
        layers = [dict() for _ in range(cfg.num_hidden_layers)]
        for (li, proj), ab in sorted(mats.items()):
            key, offset, rows, n_in = where[proj]
            a, b = ab.get("A"), ab.get("B")
            if a is None or b is None or tuple(a.shape) != (r, n_in) or tuple(b.shape) != (rows, r):
                raise BadRequest(f"LoRA adapter {name}: layer {li} {proj} needs lora_A ({r}, {n_in}) and lora_B "
                                 f"({rows}, {r}); got {None if a is None else tuple(a.shape)} and "
                                 f"{None if b is None else tuple(b.shape)}")
            layers[li].setdefault(key, []).append((offset, a.to(self.dtype).clone(), b.to(self.dtype).clone()))
        return LoraAdapter(name=name, path=path, scale=alpha / r, layers=layers)

    def _lora(self, y: torch.Tensor, x: torch.Tensor, li: int, key: str) -> torch.Tensor:
        """y (B, T, N), the output of fused weight `key` of layer li for input x (B, T, K), plus each row's adapter:
        scale * (x A^T) B^T in the projection's columns, computed apart from the base matmul as the trainer does
        (lora.Adapters). Rows group by adapter (`self.step_adapters`, set by forward); rows without one are left."""
        for adapter, rows in self.step_adapters:
            for offset, A, B in adapter.layers[li].get(key, ()):
                xs = x if rows is None else x[rows]                                       # (b, T, K)
                delta = adapter.scale * ((xs @ A.T) @ B.T)                                  # (b, T, rows of the proj)
                if rows is None:
                    y[..., offset:offset + B.shape[0]] += delta
                else:
                    y[rows, :, offset:offset + B.shape[0]] += delta
        return y

    def copy_kv(self, src: int, dst: int, n: int) -> None:
        """K/V rows [0, n) of slot `src` into slot `dst`, every layer at once (a prefill shared by equal contexts)."""
        self.k_cache[:, dst, :, :n] = self.k_cache[:, src, :, :n]
        self.v_cache[:, dst, :, :n] = self.v_cache[:, src, :, :n]

    def load_weights(self, named_tensors: list) -> int:
        """Copy (hf_name, tensor) pairs into the live parameters, then re-block what they touched; all checked
        before any is copied, so a bad name or shape (BadRequest) leaves the weights as they were."""
        if "weights" in self.released:
            raise BadRequest("the engine's weights are released (release_memory_occupation); resume them with "
                             "resume_memory_occupation tags=['weights'] before a weight update")
        # HF names -> tensors sharing storage with the live parameters (per-expert checkpoint names: views)
        params = {**self.model.state_dict(), **self.expert_views}
        for name, tensor in named_tensors:
            if name not in params:
                close = difflib.get_close_matches(name, list(params), n=3)
                raise BadRequest(f"weight {name!r} is not a parameter of {self.model_path} "
                                 f"(closest: {close}); send HF parameter names")
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise BadRequest(f"weight {name!r} has shape {tuple(tensor.shape)}, the model expects "
                                 f"{tuple(params[name].shape)}")
        with torch.no_grad():
            for name, tensor in named_tensors:
                params[name].copy_(tensor.to(dtype=params[name].dtype, device="cpu"))
        self._pack_weights([name for name, _ in named_tensors])
        return len(named_tensors)

    def release(self, tags: list[str]) -> None:
        """Free the KV cache and/or the weights, as SGLang's memory saver does for a colocated trainer: the storages
        are resized to zero (every view of them, e.g. the fused q|k|v rows, stays valid and is refilled on resume).
        Weights are dropped, not copied out (SGLang's default, without --enable-weights-cpu-backup): resume gives
        zeroed weights back and the next weight update fills them."""
        for tag in tags:
            if tag in self.released or tag == "cuda_graph":
                continue  # already released: SGLang's memory saver pauses a region once; no CUDA graphs on CPU
            tensors = [self.k_cache, self.v_cache] if tag == "kv_cache" else list(self.model.parameters())
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors}
            self.released[tag] = [(st, st.nbytes()) for st in storages.values()]
            for st, _ in self.released[tag]:
                st.resize_(0)
            if tag == "weights":
                self.packed.clear()  # the blocked copies are a second copy of the weights
        if "weights" in tags:
            transfermesh.release_shm()  # the mapping of the trainer's staging segment: a third copy
        transfermesh.trim_freed_memory()

    def resume(self, tags: list[str]) -> None:
        """Re-allocate what `release` freed, zero-filled; weights are garbage until the next weight update (the
        colocated sequence resumes weights, syncs, then resumes the KV cache)."""
        for tag in tags:
            for st, nbytes in self.released.pop(tag, []):
                st.resize_(nbytes)
                torch.empty(0, dtype=torch.uint8).set_(st, 0, (nbytes,), (1,)).zero_()
            if tag == "weights":
                self._pack_weights()
