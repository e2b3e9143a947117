"""Wrappers that route Megatron-Core's language-model cross entropy through the fused op.

Every wrapper is a *decorator* (``xxx_wrapper(original) -> replacement``), the convention of
MindSpeed's patch manager (a new function whose name ends in ``wrapper`` decorates the current
one), so the same objects serve both the MindSpeed path and the direct megatron-core path.
Each replacement is made by :func:`.pass_through.while_active`: it reads
:data:`mindspeed_cez.patches.settings.ACTIVE` on every call; while it is ``None`` the original runs
unchanged.

Patched (see ``patch_targets()`` in :mod:`.targets`):

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
* ``GPTModel._postprocess`` (``forward`` on 0.12), ``HybridModel.forward`` / ``MambaModel.forward``
  -- to see the ``loss_mask`` the training script passes, so that ``lm_z_loss`` is the
  loss-mask-weighted mean (see :mod:`mindspeed_cez.patches.metrics`), and, with
  ``--lm-fused-output-layer``, to defer the output layer's call (:mod:`.output_layer`). Other
  models (BERT, T5) pass no mask: their metric averages every token, with a one-time warning.
* ``ColumnParallelLinear.forward`` -- only for that deferral; every other call runs unchanged.
"""

import importlib
import inspect
import sys
import warnings

import torch

from mindspeed_cez.patches import loss_context, metrics
from mindspeed_cez.cross_entropy_zloss import vocab_parallel_cross_entropy_zloss
from mindspeed_cez.tensor_parallel import group_rank_and_size, resolve_tp_group
from mindspeed_cez.patches import output_layer as _output_layer
from mindspeed_cez.kernels.logit_transform import IDENTITY
from mindspeed_cez.kernels.loss_spec import loss_spec
from mindspeed_cez.patches.logit_transform import LogitTransformError, TransformedLogits
from mindspeed_cez.patches.pass_through import while_active
from mindspeed_cez.patches.settings import LM_LSE, LM_Z_LOSS


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


def _module_tp_group(module):
    group = getattr(module, "tp_group", None)
    if group is None:
        group = getattr(getattr(module, "pg_collection", None), "tp", None)
    return resolve_tp_group(group)


def in_megatron_convention(loss_fn, v_local, tp_group, label_smoothing_megatron, z_loss_coeff, transform=IDENTITY):
    """``loss_fn(loss)`` -- an op returning ``(loss, z_loss, lse)``, ``loss = CE + c*lse**2`` for the
    ``LossSpec`` ``loss`` it is handed -- in Megatron's conventions: its label smoothing over the global
    vocab (``v_local`` per rank of ``tp_group``), and for auxiliary losses: ``loss`` minus its detached
    ``z_loss``, so the value is the CE (what Megatron logs as ``lm loss``) and the gradient still that of
    ``CE + c*lse**2`` (what it trains on), as Megatron's router losses enter the gradient but not the
    logged loss. The spec is one object per set of values (the adaptor's settings checked them)."""
    global_vocab = v_local * _tp_world_size(tp_group)
    spec = loss_spec(z_loss_coeff=z_loss_coeff,
                     label_smoothing=megatron_to_torch_smoothing(label_smoothing_megatron, global_vocab),
                     logit_scale=transform.scale, logit_softcap=transform.cap)
    loss, z_loss, lse = loss_fn(spec)
    return (loss - z_loss if z_loss_coeff > 0 else loss), z_loss, lse


def loss_in_megatron_convention(logits, target, tp_group, label_smoothing_megatron, z_loss_coeff, backend=None,
                                transform=IDENTITY):
    """The op on ``[s, b, v_local]`` logits, :func:`in_megatron_convention`; ``(loss, z_loss, lse)``
    shaped like ``target``."""
    tp_group = resolve_tp_group(tp_group)

    def loss_fn(loss):
        return vocab_parallel_cross_entropy_zloss(logits, target, tp_group=tp_group, backend=backend, return_lse=True,
                                                  loss=loss)

    return in_megatron_convention(loss_fn, logits.shape[-1], tp_group, label_smoothing_megatron, z_loss_coeff,
                                  transform)


# ----------------------------------------------------------------------------------------------
# the loss-mask context: GPTModel._postprocess (or forward) -> compute_language_model_loss
# ----------------------------------------------------------------------------------------------

# Models whose forward takes the training script's labels and loss mask: (module, class, the
# method that receives both, in order of preference).
_LOSS_CONTEXT_METHODS = (
    # 0.13 on: _postprocess (the MoE schedule-plan path of --overlap-moe-expert-parallel-comm
    # calls it directly, not forward); 0.12: forward
    ("megatron.core.models.gpt.gpt_model", "GPTModel", ("_postprocess", "forward")),
    ("megatron.core.models.hybrid.hybrid_model", "HybridModel", ("forward",)),
    ("megatron.core.models.mamba.mamba_model", "MambaModel", ("forward",)),
)


def loss_context_paths(methods=_LOSS_CONTEXT_METHODS, loaded_only=False):
    """Dotted paths of the methods that see ``labels`` and ``loss_mask`` together (feature-detected).

    Each class is named by its own module and name, so a class registered over another (MindSpeed-LLM's
    ``GPTModel`` over Megatron's) gets one path whichever name found it. ``loaded_only``: look only in
    modules already imported (another framework's, which the adaptor never imports itself).
    """
    paths, seen = [], set()
    for module_name, class_name, method_names in methods:
        if loaded_only and module_name not in sys.modules:
            continue
        try:
            owner = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue
        for method in method_names:
            fn = vars(owner).get(method)
            if fn is not None and {"labels", "loss_mask"} <= set(inspect.signature(fn).parameters):
                if fn not in seen:  # one class may live under two names
                    seen.add(fn)
                    paths.append(f"{owner.__module__}.{owner.__qualname__}.{method}")
                break
    return paths


def loss_context_wrapper(fn):
    """Open a :class:`~.loss_context.LossContext` for the model forward: its labels and loss mask
    (the ``lm_z_loss`` metric, the main head told from MTP heads) and its main head's output layer
    call (:mod:`.output_layer`)."""
    signature = inspect.signature(fn)

    def with_loss_context(settings, self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs).arguments
        context = loss_context.LossContext(bound.get("labels"), bound.get("loss_mask"),
                                           _output_layer.main_head_call(self, bound, settings))
        with loss_context.opened(context):
            return fn(self, *args, **kwargs)

    return while_active(fn, with_loss_context)


_WARNED_NO_MASK = set()


def _record(module, z_loss_bs, lse_bs, loss_mask, settings, has_context):
    names = settings.metric_names()
    if not names or not module.training or not torch.is_grad_enabled():
        return
    name = type(module).__name__
    if not has_context and name not in _WARNED_NO_MASK:
        _WARNED_NO_MASK.add(name)
        warnings.warn(f"mindspeed_cez: {name} hands no loss mask to its LM loss; lm_z_loss and lm_lse "
                      "average over every token of its micro-batches", stacklevel=3)
    metrics.record_lm_z_loss(
        z_loss_bs if LM_Z_LOSS in names else None,
        loss_mask,
        lse_per_token=lse_bs if LM_LSE in names else None,
    )


def _logits_and_transform(module, logits, is_main, context, settings):
    """What the loss got: ``(logits, transform)``, ``logits`` a tensor or the deferred output layer
    call (:class:`~.output_layer.DeferredLogits`), ``transform`` the one the model applied to them
    (recorded by :class:`~.logit_transform.TransformedLogits`, checked against its flags)."""
    transform = IDENTITY
    if isinstance(logits, TransformedLogits):  # MindSpeed-LLM's scaling / soft cap, in the kernels
        if not is_main:
            raise LogitTransformError("mindspeed_cez: an MTP head's loss got the main head's transformed logits")
        transform, logits = logits.transform(), logits.logits
        if transform != settings.logit_transform:
            raise LogitTransformError(
                f"mindspeed_cez: the model applied {transform} to the logits, but its flags set "
                f"{settings.logit_transform} (--output-multiplier-scale / --output-logit-softcapping); the fused loss "
                "computes only the latter")
    elif (is_main and not isinstance(logits, _output_layer.DeferredLogits) and context is not None
          and context.main_head_call is not None):  # the forward was to hand the loss one of those two
        raise _output_layer.FusedOutputLayerError(
            f"mindspeed_cez ({_output_layer.FLAG} or the logit transform): the LM loss got a tensor, not the "
            f"output layer call the adaptor handed out (output layer {type(getattr(module, 'output_layer', None)).__name__}); "
            "this model's forward is not served")
    if isinstance(logits, _output_layer.DeferredLogits) and not is_main:
        raise _output_layer.FusedOutputLayerError(
            f"{_output_layer.FLAG}: an MTP head's loss got the main head's deferred output layer call")
    return logits, transform


# ----------------------------------------------------------------------------------------------
# LanguageModule.compute_language_model_loss
# ----------------------------------------------------------------------------------------------


def compute_language_model_loss_wrapper(fn):
    """Every CE path of ``compute_language_model_loss`` becomes the fused CE + z-loss op."""

    def compute_language_model_loss(settings, self, labels, logits):
        context = loss_context.innermost()  # None: no model that passes a loss mask around us
        is_main = context is None or context.labels is labels  # an MTP head's labels are rolled copies
        loss_mask = context.loss_mask if context is not None else None
        coeff = settings.z_loss_coeff if is_main else 0.0  # MTP heads: plain CE
        smoothing = settings.label_smoothing
        if smoothing is None:
            smoothing = getattr(self.config, "label_smoothing", 0.0) or 0.0
        logits, transform = _logits_and_transform(self, logits, is_main, context, settings)
        target = labels.transpose(0, 1).contiguous()  # [b s] => [s b], as Megatron does
        tp_group = _module_tp_group(self)
        if not isinstance(logits, _output_layer.DeferredLogits):
            loss, z_loss, lse = loss_in_megatron_convention(logits, target, tp_group, smoothing, coeff, settings.backend,
                                                            transform)
        else:
            if settings.grads == "forward" and loss_mask is not None and torch.is_grad_enabled():
                path = "forward"  # gradients made in forward, for the upstream gradient of Megatron's schedule
            else:
                path = "recompute"

            def loss_fn(loss):
                return _output_layer.linear_loss(logits, target, tp_group, loss, settings, path, loss_mask,
                                                 self.config)

            loss, z_loss, lse = in_megatron_convention(loss_fn, logits.weight.shape[0], tp_group, smoothing, coeff,
                                                       transform)
        if is_main:
            _record(self, z_loss.transpose(0, 1), lse.transpose(0, 1), loss_mask, settings, context is not None)
        # [s b] => [b s]: Megatron's per-token layout, so loss_mask handling is unchanged
        return loss.transpose(0, 1).contiguous()

    return while_active(fn, compute_language_model_loss)


# ----------------------------------------------------------------------------------------------
# the module-level CE functions (for direct callers: the value of the originals, the gradient with the z-loss)
# ----------------------------------------------------------------------------------------------


def vocab_parallel_cross_entropy_wrapper(fn):
    """``tensor_parallel.vocab_parallel_cross_entropy(logits, target, label_smoothing=0.0[, tp_group])``."""

    def vocab_parallel_cross_entropy(settings, vocab_parallel_logits, target, label_smoothing=0.0, tp_group=None):
        return loss_in_megatron_convention(vocab_parallel_logits, target, tp_group, label_smoothing,
                                           settings.z_loss_coeff, settings.backend)[0]

    return while_active(fn, vocab_parallel_cross_entropy)


def fused_vocab_parallel_cross_entropy_wrapper(fn):
    """``fused_vocab_parallel_cross_entropy(logits, target, tp_group)`` (Megatron's 'native' impl)."""

    def fused_vocab_parallel_cross_entropy(settings, vocab_parallel_logits, target, tp_group=None):
        return loss_in_megatron_convention(vocab_parallel_logits, target, tp_group, 0.0, settings.z_loss_coeff,
                                           settings.backend)[0]

    return while_active(fn, fused_vocab_parallel_cross_entropy)


def _transformer_engine_absent(*args, **kwargs):
    raise RuntimeError("Trying to use a TE block when it's not present.")  # Megatron's error


def te_parallel_cross_entropy_wrapper(fn):
    """``te_parallel_cross_entropy(logits, labels, tp_group, is_cg_capturable=False)``.

    The language module binds it as ``None`` when Transformer Engine is absent; the replacement
    then keeps Megatron's error while inactive and serves the 'te' selection while active.
    """

    def te_parallel_cross_entropy(settings, logits, labels, tp_group=None, is_cg_capturable=False):
        return loss_in_megatron_convention(logits, labels, tp_group, 0.0, settings.z_loss_coeff, settings.backend)[0]

    return while_active(fn, te_parallel_cross_entropy, inactive=fn or _transformer_engine_absent)
