"""``--lm-fused-output-layer``: a GPT model's output layer and LM loss as one op, no logits tensor.

This module owns the fused output layer's whole path. A model's forward with labels
(:func:`.megatron_core.loss_context_wrapper`) gets its :class:`MainHeadCall` from :func:`main_head_call`
and hands it to its output layer (:func:`handed`: an attribute of the layer while the forward runs).
The patched ``ColumnParallelLinear.forward`` of that layer then returns, for the main head's call
(the last: MTP heads, ``config.mtp_num_layers``, call it first and get real logits),
:class:`DeferredLogits` (its input and weight) instead of logits; the patched
``compute_language_model_loss`` checks what it got (:func:`check_loss_input`) and, for deferred
logits, calls :func:`linear_loss`, which chooses the path (the flag's where the loss mask is known,
else recompute) and calls :func:`mindspeed_cez.linear_cross_entropy_zloss` (which alone takes the
recompute path where no backward will come). Anything unexpected fails loudly, naming the flag:
deferred logits reaching anything but the main loss, a main loss that got real logits, an output
layer the op cannot stand in for (bias, gathered output, deferred embedding wgrad).

With ``Settings.logit_transform`` (MindSpeed-LLM's scaled / soft-capped logits) the main head's
call returns :class:`~.logit_transform.TransformedLogits` around its logits (or around the deferred
call), which records the model's transform for the loss kernels instead of computing it.
"""

import contextlib
import functools

import torch

from mindspeed_cez.linear_cross_entropy import (RECOMPUTE, ForwardGradientError, check_forward_gradients,
                                               linear_cross_entropy_zloss)
from mindspeed_cez.patches import loss_context, megatron_features
from mindspeed_cez.patches.pass_through import while_active
from mindspeed_cez.patches.logit_transform import TransformedLogits

FLAG = "--lm-fused-output-layer"


class FusedOutputLayerError(RuntimeError):
    pass


def _naming_the_flag(error):
    """The op's :class:`ForwardGradientError`, its fix (the op's ``grads='recompute'``) named by the flag."""
    return ForwardGradientError(f"{error} With Megatron: {FLAG} recompute.")


class DeferredLogits:
    """The main head's output layer call, not yet made: ``hidden`` ``[s, b, h]`` (this rank's
    sequence chunk under sequence parallelism), ``weight`` ``[v_local, h]``, the layer."""

    __slots__ = ("hidden", "weight", "layer")

    def __init__(self, hidden, weight, layer):
        self.hidden, self.weight, self.layer = hidden, weight, layer

    def __getattr__(self, name):
        raise FusedOutputLayerError(
            f"{FLAG}: the model used the output layer's logits ('.{name}'), which this flag never "
            "makes; only the LM loss may take them. Run without the flag for this model.")


class MainHeadCall:
    """What the main head's output layer call does in one model forward: it is call number
    ``main_call`` (0-based) of ``layer`` (MTP heads call it first; ``calls`` counts them);
    ``defer``: return :class:`DeferredLogits` for the loss to make; ``transform``: wrap the result in
    :class:`TransformedLogits` to record the model's logit transform."""

    __slots__ = ("layer", "main_call", "calls", "defer", "transform")

    def __init__(self, layer, main_call, defer, transform):
        self.layer, self.main_call, self.calls, self.defer, self.transform = layer, main_call, 0, defer, transform


def main_head_call(model, bound_args, settings):
    """The :class:`MainHeadCall` of a model forward with ``bound_args``, or None (neither setting
    on, no labels, no output layer on this stage, inference)."""
    if settings is None or not (settings.fused_output_layer or settings.logit_transform is not None):
        return None
    if bound_args.get("labels") is None:
        return None
    if any(bound_args.get(k) is not None for k in ("inference_context", "inference_params")):
        return None
    layer = getattr(model, "output_layer", None)
    if layer is None or not getattr(model, "post_process", True):
        return None
    if settings.fused_output_layer and getattr(getattr(model, "config", None), "use_mup", False):
        raise FusedOutputLayerError(f"{FLAG} does not serve MuP's output scaling (--use-mup)")
    return MainHeadCall(layer, getattr(model.config, "mtp_num_layers", None) or 0, settings.fused_output_layer,
                        settings.logit_transform is not None)


def _check_layer(layer, runtime_gather_output):
    gather = layer.gather_output if runtime_gather_output is None else runtime_gather_output
    if gather:
        raise FusedOutputLayerError(f"{FLAG} needs vocab-parallel logits; the output layer gathers them "
                                    "(parallel_output=False or runtime_gather_output=True)")
    if getattr(layer, "bias", None) is not None:
        raise FusedOutputLayerError(f"{FLAG}: the output layer has a bias, which the fused op does not take")
    if getattr(layer.config, "defer_embedding_wgrad_compute", False):
        raise FusedOutputLayerError(f"{FLAG} does not serve --defer-embedding-wgrad-compute")


# The output layer's attribute holding its MainHeadCall during the model's forward.
MAIN_HEAD = "_mindspeed_cez_main_head"


def handed(main_head):
    """``main_head`` (a :class:`MainHeadCall`, or None: nothing to hand) is its layer's while the block runs."""
    if main_head is None:
        return contextlib.nullcontext()
    return loss_context.attached(main_head.layer, MAIN_HEAD, main_head)


def column_parallel_forward_wrapper(fn):
    """``ColumnParallelLinear.forward``: the main head's call returns ``(DeferredLogits, None)`` under a
    deferral, its logits (or that) wrapped in ``TransformedLogits`` under a transform; every other call
    runs unchanged."""

    @functools.wraps(fn)
    def forward(self, input_, weight=None, runtime_gather_output=None):
        main_head = vars(self).get(MAIN_HEAD)
        if main_head is None:
            return fn(self, input_, weight=weight, runtime_gather_output=runtime_gather_output)
        call, main_head.calls = main_head.calls, main_head.calls + 1
        if call != main_head.main_call:
            return fn(self, input_, weight=weight, runtime_gather_output=runtime_gather_output)
        if main_head.defer:
            _check_layer(self, runtime_gather_output)
            if weight is None:
                weight = self.weight
            if weight is None:
                raise RuntimeError("weight was not supplied to ColumnParallelLinear forward pass "
                                   "and skip_weight_param_allocation is True.")
            logits, bias = DeferredLogits(input_, weight, self), None
        else:
            logits, bias = fn(self, input_, weight=weight, runtime_gather_output=runtime_gather_output)
        return (TransformedLogits(logits) if main_head.transform else logits), bias

    forward.__cez_wraps__ = fn
    return forward


def check_loss_input(module, logits, is_main, context):
    """What a language-model loss of ``module`` got, as the model handed it over: the main head's loss
    gets what its forward's output layer call handed out (:class:`DeferredLogits`, or the logits in
    :class:`TransformedLogits`) wherever it handed one out; an MTP head's never gets deferred logits."""
    if is_main and context is not None and context.main_head_call is not None \
            and not isinstance(logits, (DeferredLogits, TransformedLogits)):
        raise FusedOutputLayerError(
            f"mindspeed_cez ({FLAG} or the logit transform): the LM loss got a tensor, not the output layer call "
            f"the adaptor handed out (output layer {type(getattr(module, 'output_layer', None)).__name__}); this "
            "model's forward is not served")
    if not is_main and isinstance(logits, DeferredLogits):
        raise FusedOutputLayerError(f"{FLAG}: an MTP head's loss got the main head's deferred output layer call")


def _num_microbatches():
    """Megatron's micro-batch count, None where no micro-batch calculator is set up (a model run
    outside Megatron's schedule). A megatron-core that keeps its calculator elsewhere fails loudly."""
    from megatron.core import num_microbatches_calculator as calculators

    if not hasattr(calculators, "_GLOBAL_NUM_MICROBATCHES_CALCULATOR"):
        raise FusedOutputLayerError(
            f"{FLAG} (forward, the default) reads Megatron's micro-batch count from "
            "megatron.core.num_microbatches_calculator, which this megatron-core does not keep there; "
            f"run with {FLAG} recompute")
    if calculators._GLOBAL_NUM_MICROBATCHES_CALCULATOR is None:
        return None
    return calculators.get_num_microbatches()


def _context_parallel_size():
    """Megatron's context-parallel size: 0 without torch.distributed, None where it runs but
    Megatron's groups are not set up (the token count's span is then unknown)."""
    from megatron.core import parallel_state

    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 0
    group = parallel_state.get_context_parallel_group(check_initialized=False)
    return None if group is None else group.size()


def megatron_grad_scale(config, loss_mask):
    """The gradient Megatron's schedule sends into each unmasked token's LM loss of this micro-batch,
    per unit of ``loss_mask``, as a device scalar: its loss scale (``config.grad_scale_func``),
    over the micro-batch's token count (``loss_mask.sum()``, what GPT's ``loss_func`` returns) and
    the number of micro-batches (``calculate_per_token_loss``: the loss scale alone). None where it
    is not known in forward: no micro-batch calculator set up (a model run outside Megatron's
    schedule), context parallelism (the count spans the CP group) or Megatron's groups not set up.
    The op checks it in backward."""
    num_microbatches = _num_microbatches()
    if num_microbatches is None or _context_parallel_size() not in (0, 1):
        return None
    one = torch.ones((), dtype=torch.float32, device=loss_mask.device)
    scale_func = getattr(config, "grad_scale_func", None)
    loss_scale = scale_func(one).float().reshape(()) if scale_func is not None else one
    if getattr(config, "calculate_per_token_loss", False):
        return loss_scale
    # clamped as Megatron's schedule clamps its token count: an all-masked micro-batch gets gradient 0
    return loss_scale / (loss_mask.float().sum().clamp(min=1) * num_microbatches)


def linear_loss(deferred, target, loss, tp_group, settings, loss_mask, config):
    """``(loss, z_loss, lse)`` of the deferred output layer call, ``[s, b]``, as the op returns them
    (``loss = CE + c*lse**2``) for the ``LossSpec`` ``loss``, with the backends of ``settings``.
    The path: ``settings.gradient_path`` where the ``loss_mask`` ``[b, s]`` is known (``"forward"``
    makes the gradients for the upstream gradient Megatron's schedule sends: the mask as token
    weights, scaled by :func:`megatron_grad_scale` of ``config``, the weight gradient into
    ``main_grad`` during the forward), else recompute; where no backward will come the op itself
    takes the recompute path."""
    layer, weight = deferred.layer, deferred.weight
    path = settings.gradient_path if loss_mask is not None else RECOMPUTE
    forward = path.grads == "forward"
    # Megatron's DDP gives the weight an fp32 main_grad and reads grad_added_to_main_grad: the op adds
    # into it as the layer would with --gradient-accumulation-fusion (which needs apex / TE, the op not)
    into_main_grad = bool(getattr(layer, "gradient_accumulation_fusion", False)) or (
        hasattr(weight, "main_grad") and hasattr(weight, "grad_added_to_main_grad"))
    into_main_grad = into_main_grad and not megatron_features.megatron_fsdp_param(weight)  # Megatron-FSDP: autograd
    # no scale to read where no gradient is made (validation: the op computes the loss alone)
    grad_scale = megatron_grad_scale(config, loss_mask) if forward and torch.is_grad_enabled() else None
    try:
        return linear_cross_entropy_zloss(
            deferred.hidden, weight, target, loss=loss, tp_group=tp_group,
            sequence_parallel=bool(getattr(layer, "sequence_parallel", False)),
            gradient_accumulation_fusion=into_main_grad,
            token_weights=loss_mask.transpose(0, 1).to(torch.float32) if forward else None,  # [b s] => [s b]
            grad_scale=grad_scale, path=path, backend=settings.backend, linear_backend=settings.linear_backend,
            remedy=f"{FLAG} recompute", return_lse=True)
    except ForwardGradientError as error:  # a dropped forward's gradient, found at this one
        raise _naming_the_flag(error) from error


def finish_grad_sync_wrapper(fn):
    """``DistributedDataParallel.finish_grad_sync`` (``finalize_model_grads``, before the optimizer
    reads ``main_grad``): with the flag on, first checks that every forward that added the output
    weight's gradient into ``main_grad`` got its backward (:func:`check_forward_gradients`)."""

    def finish_grad_sync(settings, *args, **kwargs):
        if settings.fused_output_layer:
            try:
                check_forward_gradients()
            except ForwardGradientError as error:
                raise _naming_the_flag(error) from error
        return fn(*args, **kwargs)

    return while_active(fn, finish_grad_sync)
