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

from mindspeed_cez.cross_entropy_zloss import vocab_parallel_cross_entropy_zloss
from mindspeed_cez.kernels.logit_transform import IDENTITY
from mindspeed_cez.patches import logit_transform, loss_context, metrics, output_layer
from mindspeed_cez.patches.pass_through import while_active
from mindspeed_cez.patches.settings import LM_LSE, LM_Z_LOSS
from mindspeed_cez.tensor_parallel import group_rank_and_size, resolve_tp_group


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


def call_loss(spec, global_vocab, label_smoothing_megatron, main_head=True, transform=IDENTITY):
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
    (:func:`call_loss`, :func:`in_megatron_convention`), shaped like ``target``."""
    tp_group = resolve_tp_group(tp_group)
    spec = call_loss(settings.loss, logits.shape[-1] * _tp_world_size(tp_group), label_smoothing_megatron,
                     main_head, transform)
    loss, z_loss, lse = vocab_parallel_cross_entropy_zloss(logits, target, tp_group=tp_group, backend=settings.backend,
                                                           return_lse=True, loss=spec)
    return in_megatron_convention(loss, z_loss, spec), z_loss, lse


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
    """Open a :class:`~.loss_context.LossContext` on the model for its forward: its labels and loss mask
    (the ``lm_z_loss`` metric, the main head told from MTP heads), and hand its output layer the main
    head's call (:mod:`.output_layer`)."""
    signature = inspect.signature(fn)

    def with_loss_context(settings, self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs).arguments
        main_head = output_layer.main_head_call(self, bound, settings)
        context = loss_context.LossContext(bound.get("labels"), bound.get("loss_mask"), main_head)
        with loss_context.opened(self, context), output_layer.handed(main_head):
            return fn(self, *args, **kwargs)

    return while_active(fn, with_loss_context)


_NO_MASK_WARNED = "_mindspeed_cez_no_mask_warned"  # the model's flag: its warning given


def _record(module, z_loss_bs, lse_bs, loss_mask, settings, has_context):
    names = settings.metric_names()
    if not names or not module.training or not torch.is_grad_enabled():
        return
    if not has_context and not vars(module).get(_NO_MASK_WARNED):
        vars(module)[_NO_MASK_WARNED] = True
        warnings.warn(f"mindspeed_cez: {type(module).__name__} hands no loss mask to its LM loss; lm_z_loss and "
                      "lm_lse average over every token of its micro-batches", stacklevel=3)
    metrics.record_lm_z_loss(
        z_loss_bs if LM_Z_LOSS in names else None,
        loss_mask,
        lse_per_token=lse_bs if LM_LSE in names else None,
    )


# ----------------------------------------------------------------------------------------------
# LanguageModule.compute_language_model_loss
# ----------------------------------------------------------------------------------------------


def compute_language_model_loss_wrapper(fn):
    """Every CE path of ``compute_language_model_loss`` becomes the fused CE + z-loss op."""

    def compute_language_model_loss(settings, self, labels, logits):
        context = loss_context.of(self)  # None: no model forward that passes a loss mask around us
        is_main = context is None or context.labels is labels  # an MTP head's labels are rolled copies
        loss_mask = context.loss_mask if context is not None else None
        smoothing = settings.label_smoothing
        if smoothing is None:
            smoothing = getattr(self.config, "label_smoothing", 0.0) or 0.0
        output_layer.check_loss_input(self, logits, is_main, context)
        logits, transform = logit_transform.unwrap(logits, is_main, settings.logit_transform)
        target = labels.transpose(0, 1).contiguous()  # [b s] => [s b], as Megatron does
        tp_group = _module_tp_group(self)
        if isinstance(logits, output_layer.DeferredLogits):
            spec = call_loss(settings.loss, logits.weight.shape[0] * _tp_world_size(tp_group), smoothing, is_main,
                             transform)
            loss, z_loss, lse = output_layer.linear_loss(logits, target, spec, tp_group, settings, loss_mask,
                                                         self.config)
            loss = in_megatron_convention(loss, z_loss, spec)
        else:
            loss, z_loss, lse = megatron_cross_entropy(settings, logits, target, tp_group, smoothing, is_main, transform)
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
        return megatron_cross_entropy(settings, vocab_parallel_logits, target, tp_group, label_smoothing)[0]

    return while_active(fn, vocab_parallel_cross_entropy)


def fused_vocab_parallel_cross_entropy_wrapper(fn):
    """``fused_vocab_parallel_cross_entropy(logits, target, tp_group)`` (Megatron's 'native' impl)."""

    def fused_vocab_parallel_cross_entropy(settings, vocab_parallel_logits, target, tp_group=None):
        return megatron_cross_entropy(settings, vocab_parallel_logits, target, tp_group, 0.0)[0]

    return while_active(fn, fused_vocab_parallel_cross_entropy)


def _transformer_engine_absent(*args, **kwargs):
    raise RuntimeError("Trying to use a TE block when it's not present.")  # Megatron's error


def te_parallel_cross_entropy_wrapper(fn):
    """``te_parallel_cross_entropy(logits, labels, tp_group, is_cg_capturable=False)``.

    The language module binds it as ``None`` when Transformer Engine is absent; the replacement
    then keeps Megatron's error while inactive and serves the 'te' selection while active.
    """

    def te_parallel_cross_entropy(settings, logits, labels, tp_group=None, is_cg_capturable=False):
        return megatron_cross_entropy(settings, logits, labels, tp_group, 0.0)[0]

    return while_active(fn, te_parallel_cross_entropy, inactive=fn or _transformer_engine_absent)
