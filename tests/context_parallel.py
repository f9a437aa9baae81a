"""A stand-in for Transformer Engine's context-parallel attention on CPU, for tests/test_fast_paths.py only.

Context parallelism needs TE's attention, which needs CUDA (config.check_fast_paths rejects it on CPU). What
LoongSage itself writes for it is the rest: the layout of each rank's share of the sequence (trainer.cp_positions),
the gather of the last stage's outputs (trainer.GatherSequence), the padding, the gradient sum over CP ranks. To
test that on CPU, `use_all_gather_attention` (called inside a trainer actor) makes the CPU core attention
context-parallel in the simplest correct way: every rank all-gathers K and V over the CP group and attends its own
queries, at their global positions, to all of them under the causal mask (the backward of the gather sums every
rank's K/V gradient back to the rank that owns the tokens). TE's ring exchange computes the same numbers.
"""
import torch
import torch.nn.functional as F

import convert
import cpu
import trainer


class _GatherAll(torch.autograd.Function):
    """Every CP rank's (S, ...) stacked in rank order; backward: the ranks' gradients summed, this rank's rows."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rank, ctx.S = group, torch.distributed.get_rank(group), x.size(0)
        parts = [torch.empty_like(x) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.S:(ctx.rank + 1) * ctx.S], None


class AllGatherAttention(cpu.SDPACoreAttention):
    """Core attention over a context-parallel share: query (S, B, Nq, D), key/value (S, B, Nkv, D) hold the
    positions trainer.cp_positions gives this rank; out (S, B, Nq*D)."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        from megatron.core import parallel_state
        group = parallel_state.get_context_parallel_group()
        size, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
        S, B, Hq, D = query.shape
        T = S * size
        order = torch.cat([trainer.cp_positions(T, r, size) for r in range(size)])  # the gathered rows' positions
        back = torch.argsort(order)
        k = _GatherAll.apply(key, group)[back]  # (T, B, Nkv, D) in sequence order
        v = _GatherAll.apply(value, group)[back]  # (T, B, Nkv, D)
        mine = trainer.cp_positions(T, rank, size)  # (S,) global positions of this rank's queries
        allowed = mine[:, None] >= torch.arange(T)[None, :]  # (S, T) causal, by global position
        G = Hq // key.size(2)
        q = query.permute(1, 2, 0, 3)  # (B, Nq, S, D)
        k = k.permute(1, 2, 0, 3).repeat_interleave(G, dim=1)  # (B, Nq, T, D)
        v = v.permute(1, 2, 0, 3).repeat_interleave(G, dim=1)  # (B, Nq, T, D)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.softmax_scale)  # (B, Nq, S, D)
        return out.permute(2, 0, 1, 3).reshape(S, B, Hq * D)


def pos_emb_on_this_cp_rank(pos_emb, seq_dim: int, cp_group):
    """Megatron-Core 0.16's get_pos_emb_on_this_cp_rank (rope_utils.py) without its pinned-memory copy to CUDA:
    the RoPE table cut into 2*cp chunks, chunks r and 2*cp-1-r kept."""
    size, rank = cp_group.size(), cp_group.rank()
    idx = torch.tensor([rank, 2 * size - rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * size, -1, *pos_emb.shape[seq_dim + 1:])
    pos_emb = pos_emb.index_select(seq_dim, idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])


def use_all_gather_attention(worker=None) -> None:
    """In a trainer process (e.g. `actor.__ray_call__`): build models with AllGatherAttention as the core attention,
    let the local spec take context_parallel > 1 (convert.layer_spec refuses it, rightly, everywhere else), and
    slice the RoPE table on the CPU."""
    cpu.apply_cpu_shims()
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    LocalSpecProvider.core_attention = lambda self: AllGatherAttention
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = pos_emb_on_this_cp_rank
    convert.layer_spec = lambda cfg, on_cpu: "local"
