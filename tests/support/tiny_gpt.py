"""The tiny megatron-core MoE GPTModel the adaptor's and MindSpeed's CPU tests share: its configuration
(:func:`build`, after the CPU shims), its micro-batches with unequal loss masks (:func:`micro_batches`)
and the full-vocabulary logits gathered over the TP shards (:func:`full_vocab`)."""

import torch

from support import load_example

# the examples' CPU mode, one copy: megatron-core's hard-coded CUDA steered to the CPU, the tiny GPT's layer spec
shims = load_example("megatron_cpu_shims")

VOCAB, SEQ, BATCH, LAYERS, COEFF = 256, 16, 2, 2, 3e-2


def build(tp):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    shims.apply()
    # expert TP = TP: the 0.12 line's local experts fail with sequence parallelism otherwise
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_tensor_parallel_size=tp)
    torch.manual_seed(1234)  # same weights on every rank (CPU init of the full weights)
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
        moe_token_dispatcher_type="allgather",
        tensor_model_parallel_size=tp, expert_tensor_parallel_size=tp, sequence_parallel=tp > 1,
        add_bias_linear=False, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
    )
    return shims.build_tiny_gpt(config, VOCAB, SEQ, num_experts=4)


def micro_batches(dp_rank):
    """Two micro-batches per rank; masks keep different numbers of tokens per micro-batch and rank."""
    batches = []
    for mb, keep in enumerate((0.9 - 0.3 * dp_rank, 0.35)):
        g = torch.Generator().manual_seed(1000 + 10 * dp_rank + mb)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        loss_mask = (torch.rand(BATCH, SEQ, generator=g) < keep).float()
        loss_mask[:, 0] = 1.0
        batches.append((tokens, labels, loss_mask))
    return batches


def full_vocab(logits_shard, tp_group):
    import torch.distributed as dist

    parts = [torch.empty_like(logits_shard) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, logits_shard.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1)
