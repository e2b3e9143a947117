"""Output embedding centering (OEC; Stollenwerk et al., arXiv 2601.02031): the mean output embedding
``mu``, the mean row of the output weight over the whole vocabulary, and the two ways to hold it at 0.

* ``--lm-mu-loss-coeff L`` (mu-loss): training adds ``L * ||mu||**2`` once per step. Its gradient,
  ``2 L mu / V`` on every row, goes where the weight's other gradient goes (Megatron's ``main_grad``
  where the weight has one); its value stays out of ``lm loss``, as Megatron's auxiliary losses do.
* ``--lm-mu-centering`` (mu-centering): after every optimizer step the output weight's fp32 master copy
  becomes ``W - mu`` (no gradient, the optimizer's moments untouched), before the copy into the model's
  16-bit weight. With tied embeddings that weight is the input embedding too.

Under tensor parallelism each rank holds a vocabulary slice: ``mu`` is one all-reduce of a
hidden-size vector. The weights are found through the model's forward (:func:`mark_output_weights`);
the optimizers' hooks (:mod:`.optimizer_hooks`) center what was marked.
"""

import torch
import torch.distributed as dist

from mindspeed_cez.cross_entropy_zloss import group_rank_and_size

# The attribute a weight to center carries: its tensor-parallel group (None: not sharded). It rides on the
# weight: Megatron's optimizers (their copy of the main params, the distributed optimizer's step) meet the
# weight, not the model, when the patched hooks center it.
CENTERED = "_mindspeed_cez_centered_rows"


class MuCenteringError(RuntimeError):
    """An optimizer whose master weights mu-centering cannot reach."""


def output_weight(model):
    """The weight the main head's logits are made with: the shared embedding with tied weights, else
    the output layer's; None on a stage without one."""
    if getattr(model, "share_embeddings_and_output_weights", False):
        return model.shared_embedding_or_output_weight()
    layer = getattr(model, "output_layer", None)
    return getattr(layer, "weight", None) if getattr(model, "post_process", True) else None


def mark_output_weights(model, tp_group):
    """Mark the model's output weight (and, tied, its input embedding on this stage) for mu-centering."""
    weights = [output_weight(model)]
    if getattr(model, "share_embeddings_and_output_weights", False) and getattr(model, "pre_process", False):
        weights.append(model.embedding.word_embeddings.weight)
    for weight in weights:
        if weight is not None and not hasattr(weight, CENTERED):
            setattr(weight, CENTERED, tp_group)


def _row_sum(rows, tp_group):
    """The fp32 sum of ``rows`` ``[v_local, h]`` over the global vocabulary (one all-reduce)."""
    total = rows.detach().float().sum(dim=0)
    if group_rank_and_size(tp_group)[1] > 1:
        dist.all_reduce(total, group=tp_group)
    return total


def global_rows(weight, tp_group):
    return weight.shape[0] * group_rank_and_size(tp_group)[1]


class _MeanRow(torch.autograd.Function):
    """``mu``, the mean row over the global vocabulary: forward all-reduces, backward gives each rank's own
    rows ``dmu / V`` (each rank's copy of the loss differentiates its own slice). Where the weight has
    Megatron's ``main_grad``, backward adds into it and returns none, so a weight whose other gradient went
    to ``main_grad`` directly (``grad_added_to_main_grad``) still gets this one."""

    @staticmethod
    def forward(ctx, weight, tp_group):
        ctx.tp_group, ctx.shape = tp_group, weight.shape
        ctx.weight = weight
        return _row_sum(weight, tp_group) / global_rows(weight, tp_group)

    @staticmethod
    def backward(ctx, dmu):
        drow = (dmu / global_rows(ctx.weight, ctx.tp_group)).reshape(1, -1)
        main_grad = getattr(ctx.weight, "main_grad", None)
        if main_grad is not None and not getattr(ctx.weight, "__fsdp_param__", False):
            main_grad.add_(drow.to(main_grad.dtype).expand_as(main_grad))
            return None, None
        return drow.to(ctx.weight.dtype).expand(ctx.shape).contiguous(), None


def mean_row(weight, tp_group, differentiable=False):
    """``mu`` ``[h]`` (fp32) of ``weight`` ``[v_local, h]`` sharded over ``tp_group``."""
    if differentiable and torch.is_grad_enabled() and weight.requires_grad:
        return _MeanRow.apply(weight, tp_group)
    return _row_sum(weight, tp_group) / global_rows(weight, tp_group)


def mu_loss(mu, coeff):
    """``coeff * ||mu||**2``."""
    return coeff * (mu * mu).sum()


# ---------------------------------------------------------------------------------------------
# mu-centering: the optimizers' master weights after their step
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def center_(rows, tp_group):
    """``rows`` ``[v_local, h]`` minus their mean row over the global vocabulary, in place."""
    rows.sub_((_row_sum(rows, tp_group) / global_rows(rows, tp_group)).to(rows.dtype))


def _marked(param):
    return hasattr(param, CENTERED)


def center_float16_main_params(optimizer):
    """Megatron's ``Float16OptimizerWithFloat16Params``: each marked model weight's fp32 master copy,
    and each marked fp32 weight (its own master)."""
    for model_group, main_group in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups):
        for model_param, main_param in zip(model_group, main_group):
            if _marked(model_param):
                center_(main_param.data, getattr(model_param, CENTERED))
    for group in getattr(optimizer, "fp32_from_fp32_groups", []):
        for param in group:
            if _marked(param):
                center_(param.data, getattr(param, CENTERED))


def center_fp32_params(optimizer):
    """Megatron's ``FP32Optimizer``: the marked weights are their own masters."""
    for group in optimizer.optimizer.param_groups:
        for param in group["params"]:
            if _marked(param):
                center_(param.data, getattr(param, CENTERED))


def _check_distributed(optimizer):
    if getattr(optimizer.config, "use_precision_aware_optimizer", False):
        raise MuCenteringError("--lm-mu-centering: the precision-aware optimizer keeps the master weights inside "
                               "its inner optimizer, out of reach: drop --use-precision-aware-optimizer or use "
                               "--lm-mu-loss-coeff")
    ddp_config = getattr(optimizer, "ddp_config", None)
    if getattr(ddp_config, "use_custom_fsdp", False) or getattr(ddp_config, "use_megatron_fsdp", False):
        raise MuCenteringError("--lm-mu-centering does not serve Megatron-FSDP: use --lm-mu-loss-coeff")


@torch.no_grad()
def center_distributed_main_params(optimizer):
    """Megatron's ``DistributedOptimizer``: each data-parallel rank holds a contiguous range of a weight's
    elements (rows cut anywhere). Per marked weight, every rank adds the column sums of its range, one
    all-reduce over the data-parallel group and one over the tensor-parallel group give the sum over the
    vocabulary, and each rank subtracts the mean from its range. Ranks that hold none still join."""
    _check_distributed(optimizer)
    shards = {}
    for model_groups, main_groups in ((optimizer.model_float16_groups, optimizer.shard_fp32_from_float16_groups),
                                      (optimizer.model_fp32_groups, optimizer.shard_fp32_groups)):
        for model_group, main_group in zip(model_groups, main_groups):
            for model_param, main_param in zip(model_group, main_group):
                if _marked(model_param):
                    shards[model_param] = main_param
    for param in (p for buffer in optimizer.buffers for p in buffer.params):  # every rank's, in one order
        if not _marked(param):
            continue
        width = param.shape[-1]
        sums = torch.zeros(width, dtype=torch.float32, device=param.device)
        owned = shards.get(param)
        if owned is not None:
            start = optimizer._get_model_param_range_map(param)["param"].start
            columns = (torch.arange(owned.numel(), device=owned.device) + start) % width
            sums.index_add_(0, columns, owned.view(-1))
        dist.all_reduce(sums, group=optimizer.data_parallel_group)
        tp_group = getattr(param, CENTERED)
        if group_rank_and_size(tp_group)[1] > 1:
            dist.all_reduce(sums, group=tp_group)
        if owned is not None:
            mu = sums / global_rows(param, tp_group)
            owned.view(-1).sub_(mu[columns])


def center_main_params(optimizer):
    """Center the marked weights' master copies of ``optimizer`` (one of Megatron's three kinds)."""
    if hasattr(optimizer, "shard_fp32_from_float16_groups"):
        center_distributed_main_params(optimizer)
    elif hasattr(optimizer, "fp32_from_float16_groups"):
        center_float16_main_params(optimizer)
    else:
        raise MuCenteringError(f"--lm-mu-centering does not know the master weights of {type(optimizer).__name__}")
