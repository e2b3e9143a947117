"""The tiny megatron-core MoE GPTModel the adaptor's and MindSpeed's CPU tests share: its configuration
(:func:`build`, in the package's CPU mode), its micro-batches with unequal loss masks (:func:`micro_batches`)
the full-vocabulary logits gathered over the TP shards (:func:`full_vocab`) and one training iteration
with the logits and their gradients captured (:func:`iteration`), and its float64 reference (:func:`reference`)."""

import torch

from mindspeed_cez.patches import cpu_mode, local_gpt

VOCAB, SEQ, BATCH, LAYERS, COEFF = 256, 16, 2, 2, 3e-2


def build(tp, share_embeddings=False):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    cpu_mode.apply()
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
    return local_gpt.build_tiny_gpt(config, VOCAB, SEQ, num_experts=4, share_embeddings=share_embeddings)


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


def iteration(model, batches, grad_of_logits=None):
    """Forward + backward of every micro-batch with the objective ``sum(loss*mask) / sum(mask)``.

    Returns per micro-batch ``(per-token loss, logits, logits grad)`` and the parameter grads.
    With ``grad_of_logits`` (a list, one per micro-batch), the model is run without labels and
    those gradients are fed into its logits instead (the float64 reference's backward).
    """
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    mask = local_gpt.causal_attention_mask(SEQ)
    tokens_total = sum(float(m.sum()) for _, _, m in batches)
    captured = []

    def keep_logits(module, inputs, output):
        logits = output[0] if isinstance(output, tuple) else output
        captured.append({"logits": logits.detach().clone(), "live": logits})
        logits.register_hook(lambda g: captured[-1].__setitem__("grad", g.detach().clone()))

    handle = model.output_layer.register_forward_hook(keep_logits)
    model.zero_grad(set_to_none=True)
    losses = []
    try:
        for i, (tokens, labels, loss_mask) in enumerate(batches):
            if grad_of_logits is None:
                loss = model(tokens, position_ids, mask, labels=labels, loss_mask=loss_mask)
                losses.append(loss.detach().clone())
                ((loss * loss_mask).sum() / tokens_total).backward()
            else:
                model(tokens, position_ids, mask)
                live = captured[-1]["live"]
                live.backward(grad_of_logits[i].to(live.dtype))
    finally:
        handle.remove()
    for cap in captured:
        del cap["live"]
    local_gpt.allreduce_sequence_parallel_grads(model)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return losses, captured, grads


def reference(captured, batches, tp_group, tp_rank):
    """float64: CE, lse and the logits gradient of sum((CE + c*lse^2)*mask)/sum(mask), per micro-batch."""
    tokens_total = sum(float(m.sum()) for _, _, m in batches)
    out = []
    for cap, (_, labels, loss_mask) in zip(captured, batches):
        full = full_vocab(cap["logits"], tp_group).double().requires_grad_()  # [s, b, V]
        lse = torch.logsumexp(full, dim=-1)
        target = labels.transpose(0, 1)
        ce = lse - full.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        m = loss_mask.transpose(0, 1).double()
        (((ce + COEFF * lse**2) * m).sum() / tokens_total).backward()
        v_local = cap["logits"].shape[-1]
        grad = full.grad[..., tp_rank * v_local:(tp_rank + 1) * v_local]
        out.append({"ce": ce.detach().transpose(0, 1), "lse": lse.detach().transpose(0, 1), "grad": grad})
    return out
