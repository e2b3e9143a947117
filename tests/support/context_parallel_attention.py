"""A stand-in for Transformer Engine's context-parallel attention, for tests only: Megatron's local
``DotProductAttention`` refuses context parallelism, and TE is not installed where the tests run.

Causal self-attention of this rank's share of the sequence (Megatron's split: ``2 x CP`` chunks, rank
``r`` holding chunks ``r`` and ``2 x CP - 1 - r``) against the keys and values of the whole sequence,
gathered from the context-parallel group (their gradients reduce-scattered back), in torch's
``scaled_dot_product_attention`` with the causal mask of the tokens' positions in the sequence. Not
fast (every rank holds every key and value); the loss path around it is what the tests exercise.
``tests/environments/megatron_loop/test_context_parallel_attention.py`` checks it against causal attention of the whole sequence.
"""

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule


def zigzag_positions(rank, cp_size, chunk, device=None):
    """Positions in the sequence of the tokens context-parallel rank ``rank`` holds, in its order."""
    offsets = torch.arange(chunk, device=device)
    return torch.cat([rank * chunk + offsets, (2 * cp_size - 1 - rank) * chunk + offsets])


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; backward: the summed gradient of this rank's slice
    (an all-reduce: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rows = group, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(group.size())]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        start = ctx.group.rank() * ctx.rows
        return grad[start:start + ctx.rows], None


def context_parallel_causal_attention(query, key, value, softmax_scale, cp_group):
    """``query`` / ``key`` / ``value`` ``[s_local, b, heads (or groups), d]`` of this rank's chunks ->
    ``[s_local, b, heads * d]``."""
    cp_size, rank = cp_group.size(), cp_group.rank()
    chunk = query.shape[0] // 2
    key, value = _GatherSequence.apply(key, cp_group), _GatherSequence.apply(value, cp_group)
    if key.shape[2] != query.shape[2]:  # query groups
        key, value = (t.repeat_interleave(query.shape[2] // t.shape[2], dim=2) for t in (key, value))
    q_pos = zigzag_positions(rank, cp_size, chunk, query.device)
    k_pos = torch.cat([zigzag_positions(r, cp_size, chunk, query.device) for r in range(cp_size)])
    allowed = k_pos[None, :] <= q_pos[:, None]  # [s_local, s]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=softmax_scale)
    return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


class ContextParallelAttention(MegatronModule):
    """Megatron's core-attention interface over :func:`context_parallel_causal_attention`."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **kwargs):
        super().__init__(config=config)
        if (config.attention_dropout if attention_dropout is None else attention_dropout) != 0:
            raise NotImplementedError("the context-parallel attention stand-in has no attention dropout")
        self.softmax_scale = softmax_scale
        self.attn_mask_type = attn_mask_type

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        from megatron.core.transformer.enums import AttnMaskType

        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if mask_type != AttnMaskType.causal or attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError(f"the context-parallel attention stand-in: causal only, got {mask_type}; "
                                      "no bias, no packed sequences")
        scale = self.softmax_scale or query.shape[-1] ** -0.5
        return context_parallel_causal_attention(query, key, value, scale,
                                                 parallel_state.get_context_parallel_group())


def use_in_local_specs():
    """Megatron's local layer specs (decoder and MTP layers) build the stand-in as core attention."""
    from megatron.core.models.backends import LocalSpecProvider

    LocalSpecProvider.core_attention = lambda self: ContextParallelAttention
