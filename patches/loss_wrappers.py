"""Wrappers that route Megatron-Core's language-model cross entropy through the fused op.

Every wrapper is a *decorator* (``xxx_wrapper(original) -> replacement``), the convention of
MindSpeed's patch manager (a new function whose name ends in ``wrapper`` decorates the current
one), so the same objects serve both the MindSpeed path and the direct megatron-core path.
Each replacement is made by :func:`.runtime.while_active`: it reads the runtime's settings
(:data:`mindspeed_cez.patches.runtime.RUNTIME`) on every call; while they are ``None`` the original
runs unchanged.

Patched (the table: :data:`.patch_points.TARGETS`):

* ``LanguageModule.compute_language_model_loss`` -- every CE path of it (unfused, fused
  'native', fused 'te') becomes the fused op. Megatron's convention for auxiliary losses holds:
  the per-token loss returned (Megatron's ``[b, s]``, so loss_mask handling downstream is
  untouched) has the value of the plain CE, so ``lm loss``, the validation loss and its PPL are
  CE, while its gradient is that of ``CE + c*lse^2``. MTP heads (0.12/0.13: inside the MTP block;
  0.14+: ``GPTModel`` / ``process_mtp_loss``, all through this method, told apart by their rolled
  labels) get the fused CE without z-loss.
* ``tensor_parallel.vocab_parallel_cross_entropy``, ``fused_vocab_parallel_cross_entropy`` and
  the language module's ``te_parallel_cross_entropy``, for code that calls them directly; every
  module that bound a copy (``from x import f``) is patched too.
* ``DistributedDataParallel.finish_grad_sync`` -- with ``--lm-fused-output-layer``: every forward
  that added the output weight's gradient into ``main_grad`` got its backward.

The models' forwards and ``ColumnParallelLinear.forward`` (the loss mask, the main head's call) are
:mod:`.model_context`'s: the loss reads what they hand it here (:func:`check_loss_input`, :func:`unwrap`);
the metrics go into the runtime's buffers (:class:`.reporting.IterationMetrics`). Models that pass no loss
mask (BERT, T5): their metric averages every token, with a one-time warning. Each replacement gets the
:class:`.runtime.Runtime` (:func:`.runtime.while_active`) and reads its settings as plain attributes.

With ``--lm-fused-output-layer`` the loss of the deferred output layer call (:func:`linear_loss`)
hands the flag's path and, where the loss mask is known, the token weights to
:func:`mindspeed_cez.linear_cross_entropy_zloss` (which alone takes the recompute path where no
backward will come).
"""

import functools
import warnings

import torch

from mindspeed_cez.cross_entropy_zloss import group_rank_and_size, vocab_parallel_cross_entropy_zloss
from mindspeed_cez.kernels import IDENTITY, LogitTransform
from mindspeed_cez.linear_cross_entropy import (ForwardGradientError, LinearCrossEntropyOptions, TrainerInputs,
                                               WeightGradTarget, linear_cross_entropy_zloss)
from mindspeed_cez.patches import mean_embedding, megatron_state, model_context
from mindspeed_cez.patches.model_context import (FLAG, TRANSFORM_FLAGS, DeferredLogits, FusedOutputLayerError,
                                                 LogitTransformError, TransformedLogits)
from mindspeed_cez.patches.runtime import while_active
from mindspeed_cez.patches.settings import LM_LSE, LM_MU_NORM, LM_Z_LOSS


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _tp_world_size(tp_group):
    return group_rank_and_size(tp_group)[1]


def megatron_to_torch_smoothing(label_smoothing, global_vocab):
    """Megatron's ``smoothing = a*V/(V-1)`` is torch's convention with ``a' = a*V/(V-1)``."""
    if not label_smoothing:
        return 0.0
    return float(label_smoothing) * global_vocab / (global_vocab - 1)


def call_loss_spec(spec, global_vocab, label_smoothing_megatron, main_head=True, transform=IDENTITY):
    """The ``LossSpec`` of one call, from the settings' ``spec`` (:meth:`LossSpec.replace`: no object per
    call): Megatron's label smoothing over ``global_vocab``, the z-loss for the main head only (MTP heads:
    plain CE), the transform the model applied to these logits."""
    return spec.replace(label_smoothing=megatron_to_torch_smoothing(label_smoothing_megatron, global_vocab),
                        z_loss_coeff=spec.z_loss_coeff if main_head else 0.0, logit_transform=transform)


def in_megatron_convention(loss, z_loss, spec):
    """The op's ``loss = CE + c*lse**2`` as Megatron takes auxiliary losses: minus its detached ``z_loss``,
    so the value is the CE (what Megatron logs as ``lm loss``) and the gradient still that of
    ``CE + c*lse**2`` (what it trains on), as Megatron's router losses enter the gradient but not the
    logged loss."""
    return loss - z_loss if spec.z_loss_coeff > 0 else loss


def megatron_cross_entropy(settings, logits, target, tp_group, label_smoothing_megatron, main_head=True,
                           transform=IDENTITY):
    """``(loss, z_loss, lse)`` of the op on ``[s, b, v_local]`` logits in Megatron's conventions
    (:func:`call_loss_spec`, :func:`in_megatron_convention`), shaped like ``target``."""
    if tp_group is None:
        tp_group = megatron_state.tensor_parallel_group()
    spec = call_loss_spec(settings.loss, logits.shape[-1] * _tp_world_size(tp_group), label_smoothing_megatron,
                     main_head, transform)
    loss, z_loss, lse = vocab_parallel_cross_entropy_zloss(
        logits, target, spec.z_loss_coeff, spec.label_smoothing, spec.ignore_index, tp_group,
        logit_transform=spec.logit_transform, backend=settings.backend, return_lse=True)
    return in_megatron_convention(loss, z_loss, spec), z_loss, lse


def with_mu_loss(loss, weight, tp_group, coeff, training):
    """``(loss, ||mu||)``: the per-token ``loss`` with the mu-loss ``coeff * ||mu||**2`` of the output
    ``weight``'s mean row in its gradient (each token's share: Megatron's weighting sums them to one per
    step), not in its value (as Megatron's auxiliary losses); ``coeff`` 0 or no training: ``loss`` as is."""
    train = training and coeff > 0 and torch.is_grad_enabled()
    mu = mean_embedding.mean_row(weight, tp_group, differentiable=train)
    if train:
        aux = mean_embedding.mu_loss(mu, coeff)
        loss = loss + (aux - aux.detach())
    return loss, mu.detach().norm()


def _record(runtime, module, z_loss_bs, lse_bs, loss_mask, has_context, mu_norm=None):
    """One micro-batch of the main head's loss into the runtime's metric buffers (training forwards only)."""
    names = runtime.settings.metrics
    if not names or not module.training or not torch.is_grad_enabled():
        return
    if not has_context and runtime.warn_once_for(module):
        warnings.warn(f"mindspeed_cez: {type(module).__name__} hands no loss mask to its LM loss; lm_z_loss and "
                      "lm_lse average over every token of its micro-batches", stacklevel=3)
    runtime.metrics.record(z_loss_bs if LM_Z_LOSS in names else None, loss_mask,
                           lse_bs if LM_LSE in names else None, mu_norm if LM_MU_NORM in names else None)


# ----------------------------------------------------------------------------------------------
# what the model's forward handed its loss (model_context), checked
# ----------------------------------------------------------------------------------------------


def loss_context_of(model):
    """The :class:`.model_context.LossContext` open on ``model``, or None (no forward with labels of this model
    around)."""
    return getattr(model, "__dict__", {}).get(model_context.ATTRIBUTE)


def check_loss_input(module, logits, is_main, context):
    """What a language-model loss of ``module`` got, as the model handed it over: the main head's loss
    gets what its forward's output layer call handed out (:class:`.model_context.DeferredLogits`, or the logits in
    :class:`.model_context.TransformedLogits`) wherever it handed one out; an MTP head's never gets deferred logits."""
    if is_main and context is not None and context.main_head_call is not None \
            and not isinstance(logits, (DeferredLogits, TransformedLogits)):
        raise FusedOutputLayerError(
            f"mindspeed_cez ({FLAG} or the logit transform): the LM loss got a tensor, not the output layer call "
            f"the adaptor handed out (output layer {type(getattr(module, 'output_layer', None)).__name__}); this "
            "model's forward is not served")
    if not is_main and isinstance(logits, DeferredLogits):
        raise FusedOutputLayerError(f"{FLAG}: an MTP head's loss got the main head's deferred output layer call")


def unwrap(logits, is_main, expected):
    """``(logits, transform)`` of what a language-model loss got: the tensor (or deferred output layer
    call) inside :class:`.model_context.TransformedLogits` and the transform the model applied to it, checked against
    ``expected`` (the flags'); anything else as it is, with the identity."""
    if not isinstance(logits, TransformedLogits):
        return logits, IDENTITY
    if not is_main:
        raise LogitTransformError("mindspeed_cez: an MTP head's loss got the main head's transformed logits")
    transform = logits.transform()
    if transform != expected:
        raise LogitTransformError(
            f"mindspeed_cez: the model applied {transform} to the logits, but its flags set {expected} ({TRANSFORM_FLAGS}); "
            "the fused loss computes only the latter")
    return logits.logits, transform


def main_head_transform(model_transform, logit_softcap):
    """The transform the main head's loss is of: the model's own (``model_transform``, recorded from its
    forward) with this run's soft cap (``--lm-logit-softcap``, 0: none) where the model applies none."""
    if not logit_softcap or model_transform.cap:
        return model_transform
    return LogitTransform(model_transform.scale, logit_softcap)


# ----------------------------------------------------------------------------------------------
# LanguageModule.compute_language_model_loss
# ----------------------------------------------------------------------------------------------


def compute_language_model_loss_wrapper(fn):
    """Every CE path of ``compute_language_model_loss`` becomes the fused CE + z-loss op."""

    def compute_language_model_loss(runtime, self, labels, logits):
        settings = runtime.settings
        context = loss_context_of(self)  # None: no model forward that passes a loss mask around us
        is_main = context is None or context.labels is labels  # an MTP head's labels are rolled copies
        loss_mask = context.loss_mask if context is not None else None
        smoothing = settings.label_smoothing
        if smoothing is None:
            smoothing = getattr(self.config, "label_smoothing", 0.0) or 0.0
        check_loss_input(self, logits, is_main, context)
        logits, transform = unwrap(logits, is_main, settings.logit_transform)
        if is_main:
            transform = main_head_transform(transform, settings.logit_softcap)
        target = labels.transpose(0, 1).contiguous()  # [b s] => [s b], as Megatron does
        tp_group = megatron_state.module_tp_group(self)
        if isinstance(logits, DeferredLogits):
            spec = call_loss_spec(settings.loss, logits.weight.shape[0] * _tp_world_size(tp_group), smoothing, is_main,
                                  transform)
            loss, z_loss, lse = linear_loss(logits, target, spec, tp_group, runtime, loss_mask, self.config)
            loss = in_megatron_convention(loss, z_loss, spec)
        else:
            loss, z_loss, lse = megatron_cross_entropy(settings, logits, target, tp_group, smoothing, is_main, transform)
        mu_norm = None
        if is_main and settings.mean_embedding_metrics:
            weight = logits.weight if isinstance(logits, DeferredLogits) else mean_embedding.output_weight(self)
            loss, mu_norm = with_mu_loss(loss, weight, tp_group, settings.mu_loss_coeff, self.training)
        if is_main:
            _record(runtime, self, z_loss.transpose(0, 1), lse.transpose(0, 1), loss_mask, context is not None,
                    mu_norm)
        # [s b] => [b s]: Megatron's per-token layout, so loss_mask handling is unchanged
        return loss.transpose(0, 1).contiguous()

    return while_active(fn, compute_language_model_loss)


# ----------------------------------------------------------------------------------------------
# the module-level CE functions (for direct callers: the value of the originals, the gradient with the z-loss)
# ----------------------------------------------------------------------------------------------


def vocab_parallel_cross_entropy_wrapper(fn):
    """``tensor_parallel.vocab_parallel_cross_entropy(logits, target, label_smoothing=0.0[, tp_group])``."""

    def vocab_parallel_cross_entropy(runtime, vocab_parallel_logits, target, label_smoothing=0.0, tp_group=None):
        return megatron_cross_entropy(runtime.settings, vocab_parallel_logits, target, tp_group, label_smoothing)[0]

    return while_active(fn, vocab_parallel_cross_entropy)


def fused_vocab_parallel_cross_entropy_wrapper(fn):
    """``fused_vocab_parallel_cross_entropy(logits, target, tp_group)`` (Megatron's 'native' impl)."""

    def fused_vocab_parallel_cross_entropy(runtime, vocab_parallel_logits, target, tp_group=None):
        return megatron_cross_entropy(runtime.settings, vocab_parallel_logits, target, tp_group, 0.0)[0]

    return while_active(fn, fused_vocab_parallel_cross_entropy)


def _transformer_engine_absent(*args, **kwargs):
    raise RuntimeError("Trying to use a TE block when it's not present.")  # Megatron's error


def te_parallel_cross_entropy_wrapper(fn):
    """``te_parallel_cross_entropy(logits, labels, tp_group, is_cg_capturable=False)``.

    The language module binds it as ``None`` when Transformer Engine is absent; the replacement
    then keeps Megatron's error while inactive and serves the 'te' selection while active.
    """

    def te_parallel_cross_entropy(runtime, logits, labels, tp_group=None, is_cg_capturable=False):
        return megatron_cross_entropy(runtime.settings, logits, labels, tp_group, 0.0)[0]

    return while_active(fn, te_parallel_cross_entropy, inactive=fn or _transformer_engine_absent)


# ----------------------------------------------------------------------------------------------
# --lm-fused-output-layer: the loss of the deferred output layer call
# ----------------------------------------------------------------------------------------------


def _naming_the_flag(error):
    """The op's :class:`ForwardGradientError`, its fix (the op's ``GradientPath('recompute')``) named by the flag."""
    return ForwardGradientError(f"{error} With Megatron: {FLAG} recompute.")


def megatron_fsdp_param(weight):
    """Whether Megatron-FSDP manages ``weight`` (its ``__fsdp_param__``, which Transformer Engine reads too). Its
    ``main_grad`` is a view of a gradient bucket that Megatron-FSDP fetches in backward, overwrites and
    reduce-scatters: one seen in forward is the last iteration's, released. The fused output layer hands such a
    weight's gradient back through autograd (into the bucket by Megatron-FSDP's own hook), as Megatron's
    unfused layer without gradient-accumulation fusion does."""
    return bool(getattr(weight, "__fsdp_param__", False))


def _num_microbatches():
    """Megatron's micro-batch count (:func:`.megatron_state.num_microbatches`); a megatron-core that keeps its
    calculator elsewhere fails loudly, naming the flag's other path."""
    try:
        return megatron_state.num_microbatches()
    except megatron_state.MegatronStateMissing as error:
        raise FusedOutputLayerError(
            f"{FLAG} (forward, the default) reads Megatron's micro-batch count from "
            "megatron.core.num_microbatches_calculator, which this megatron-core does not keep there; "
            f"run with {FLAG} recompute") from error


def main_grad_placeholder(weight):
    """What Megatron's linear layers return for a weight whose gradient went into ``main_grad``: a
    dummy gradient where the weight carries ``grad_added_to_main_grad`` (so its DDP hook runs and
    skips the add), else None."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)
    return torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)


def main_grad_target(weight):
    """The op's :class:`WeightGradTarget` for a weight with Megatron's ``main_grad``: the gradient added
    into it, and autograd given :func:`main_grad_placeholder`, as Megatron's linear layers do with
    gradient-accumulation fusion. None for a weight without ``main_grad``: the gradient through autograd."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        return None
    return WeightGradTarget(main_grad, functools.partial(main_grad_placeholder, weight))


def megatron_grad_scale(config, loss_mask):
    """The gradient Megatron's schedule sends into each unmasked token's LM loss of this micro-batch,
    per unit of ``loss_mask``, as a device scalar: its loss scale (``config.grad_scale_func``),
    over the micro-batch's token count (``loss_mask.sum()``, what GPT's ``loss_func`` returns) and
    the number of micro-batches (``calculate_per_token_loss``: the loss scale alone). None where it
    is not known in forward: no micro-batch calculator set up (a model run outside Megatron's
    schedule), context parallelism (the count spans the CP group) or Megatron's groups not set up.
    The op checks it in backward."""
    num_microbatches = _num_microbatches()
    if num_microbatches is None or megatron_state.context_parallel_size() not in (0, 1):
        return None
    one = torch.ones((), dtype=torch.float32, device=loss_mask.device)
    scale_func = getattr(config, "grad_scale_func", None)
    loss_scale = scale_func(one).float().reshape(()) if scale_func is not None else one
    if getattr(config, "calculate_per_token_loss", False):
        return loss_scale
    # clamped as Megatron's schedule clamps its token count: an all-masked micro-batch gets gradient 0
    return loss_scale / (loss_mask.float().sum().clamp(min=1) * num_microbatches)


@functools.lru_cache(maxsize=64)
def linear_options_cache(logit_transform, path, backend, linear_backend):
    """The fused layer's options for one call (a cache: one object per set of the settings' values and the
    call's transform)."""
    return LinearCrossEntropyOptions(logit_transform=logit_transform, path=path, backend=backend,
                                     linear_backend=linear_backend, return_lse=True)


def linear_loss(deferred, target, loss, tp_group, runtime, loss_mask, config):
    """``(loss, z_loss, lse)`` of the deferred output layer call, ``[s, b]``, as the op returns them
    (``loss = CE + c*lse**2``) for the ``LossSpec`` ``loss``, with the backends of the ``runtime``'s settings
    and its ledger.
    The path: ``settings.gradient_path``; ``"forward"`` where the ``loss_mask`` ``[b, s]`` is known makes
    the gradients for the upstream gradient Megatron's schedule sends (the mask as token weights, scaled by
    :func:`megatron_grad_scale` of ``config``, the weight gradient into ``main_grad`` during the forward);
    without a loss mask the op gets no token weights and takes the recompute path, as it does where no
    backward will come."""
    layer, weight, settings = deferred.layer, deferred.weight, runtime.settings
    path = settings.gradient_path
    forward = path.grads == "forward" and loss_mask is not None
    # Megatron's DDP gives the weight an fp32 main_grad and reads grad_added_to_main_grad: the op adds
    # into it as the layer would with --gradient-accumulation-fusion (which needs apex / TE, the op not)
    into_main_grad = bool(getattr(layer, "gradient_accumulation_fusion", False)) or (
        hasattr(weight, "main_grad") and hasattr(weight, "grad_added_to_main_grad"))
    into_main_grad = into_main_grad and not megatron_fsdp_param(weight)  # Megatron-FSDP: autograd
    # no scale to read where no gradient is made (validation: the op computes the loss alone)
    grad_scale = megatron_grad_scale(config, loss_mask) if forward and torch.is_grad_enabled() else None
    trainer = TrainerInputs(
        token_weights=loss_mask.transpose(0, 1).to(torch.float32) if forward else None,  # [b s] => [s b]
        grad_scale=grad_scale, weight_grad=main_grad_target(weight) if into_main_grad else None,
        remedy=f"{FLAG} recompute", ledger=runtime.ledger)
    options = linear_options_cache(loss.logit_transform, path, settings.backend, settings.linear_backend)
    try:
        return linear_cross_entropy_zloss(
            deferred.hidden, weight, target, loss.z_loss_coeff, loss.label_smoothing, loss.ignore_index, tp_group,
            bool(getattr(layer, "sequence_parallel", False)), options=options, trainer=trainer)
    except ForwardGradientError as error:  # a dropped forward's gradient, found at this one
        raise _naming_the_flag(error) from error


def finish_grad_sync_wrapper(fn):
    """``DistributedDataParallel.finish_grad_sync`` (``finalize_model_grads``, before the optimizer
    reads ``main_grad``): with the flag on, first checks that every forward that added the output
    weight's gradient into ``main_grad`` got its backward (the runtime's ledger)."""

    def finish_grad_sync(runtime, *args, **kwargs):
        if runtime.settings.fused_output_layer:
            try:
                runtime.ledger.check()
            except ForwardGradientError as error:
                raise _naming_the_flag(error) from error
        return fn(*args, **kwargs)

    return while_active(fn, finish_grad_sync)
