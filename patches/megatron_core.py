"""Wrappers that route Megatron-Core's language-model cross entropy through the fused op.

Every wrapper is a *decorator* (``xxx_wrapper(original) -> replacement``), the convention of
MindSpeed's patch manager (a new function whose name ends in ``wrapper`` decorates the current
one), so the same objects serve both the MindSpeed path and the direct megatron-core path.
Each replacement reads :data:`mindspeed_cez.patches.settings.ACTIVE` on every call; while it is
``None`` the original runs unchanged.

Patched (see ``PATCH_TARGETS`` in ``mindspeed_cez.patches``):

* ``LanguageModule.compute_language_model_loss`` -- every CE path of it (unfused, fused
  'native', fused 'te'): the fused op computes ``CE + c*lse^2`` per token, returned as Megatron's
  ``[b, s]`` so loss_mask / per-token-loss handling downstream is untouched. GPT's main loss and
  its MTP losses (0.16.1: inside ``GPTModel._postprocess``; 0.19.2: ``process_mtp_loss`` which is
  handed ``self.compute_language_model_loss``) both go through it.
* ``tensor_parallel.vocab_parallel_cross_entropy``, ``fused_vocab_parallel_cross_entropy`` and
  the language module's ``te_parallel_cross_entropy``, for code that calls them directly; every
  module that bound a copy (``from x import f``) is patched too.
* ``GPTModel.forward`` -- only to see the ``loss_mask`` the training script passes, so that
  ``lm_z_loss`` is the loss-mask-weighted mean (see :mod:`mindspeed_cez.metrics`).
"""

import functools

import torch

from mindspeed_cez.cross_entropy_zloss import cross_entropy_zloss_with_lse, group_rank_and_size, resolve_tp_group
from mindspeed_cez.patches import settings as _settings


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


def fused_loss(logits, target, tp_group, label_smoothing_megatron, settings):
    """Run the op on ``[s, b, v_local]`` logits; returns ``(loss, z_loss, lse)`` shaped like target."""
    tp_group = resolve_tp_group(tp_group)
    global_vocab = logits.shape[-1] * _tp_world_size(tp_group)
    smoothing = megatron_to_torch_smoothing(label_smoothing_megatron, global_vocab)
    return cross_entropy_zloss_with_lse(
        logits,
        target,
        z_loss_coeff=settings.z_loss_coeff,
        label_smoothing=smoothing,
        tp_group=tp_group,
    )


# ----------------------------------------------------------------------------------------------
# the loss-mask context: GPTModel.forward -> compute_language_model_loss
# ----------------------------------------------------------------------------------------------

_MASK_CONTEXT = []  # stack of (labels, loss_mask) for the GPTModel.forward calls in progress


def gpt_model_forward_wrapper(fn):
    """Remember ``(labels, loss_mask)`` of the forward in progress, for the ``lm_z_loss`` metric."""

    @functools.wraps(fn)
    def forward(self, *args, **kwargs):
        if _settings.ACTIVE is None:
            return fn(self, *args, **kwargs)
        labels = kwargs.get("labels", args[4] if len(args) > 4 else None)
        _MASK_CONTEXT.append((labels, kwargs.get("loss_mask")))
        try:
            return fn(self, *args, **kwargs)
        finally:
            _MASK_CONTEXT.pop()

    forward.__cez_wraps__ = fn
    return forward


def _maybe_record(module, labels, z_loss_bs, lse_sb, settings):
    """Record the main-model loss's metrics (not the MTP losses') while training."""
    if not settings.metric_names() or not module.training or not torch.is_grad_enabled():
        return
    if _MASK_CONTEXT:
        ctx_labels, loss_mask = _MASK_CONTEXT[-1]
        if ctx_labels is not labels:
            return  # an MTP loss (rolled labels): not part of `lm loss`
    else:
        loss_mask = None  # no GPTModel.forward around us: unmasked mean (documented)
    from mindspeed_cez import metrics

    config = getattr(module, "config", None)
    num_layers = getattr(config, "num_layers", None) or 1
    lse_bs = None if lse_sb is None else lse_sb.transpose(0, 1)
    metrics.record_lm_z_loss(
        z_loss_bs if settings.z_loss_coeff > 0 else None,
        loss_mask,
        lse_per_token=lse_bs,
        num_layers=num_layers + (getattr(config, "mtp_num_layers", None) or 0),
        settings=settings,
    )


# ----------------------------------------------------------------------------------------------
# LanguageModule.compute_language_model_loss
# ----------------------------------------------------------------------------------------------


def compute_language_model_loss_wrapper(fn):
    """Every CE path of ``compute_language_model_loss`` becomes the fused CE + z-loss op."""

    @functools.wraps(fn)
    def compute_language_model_loss(self, labels, logits):
        settings = _settings.ACTIVE
        if settings is None:
            return fn(self, labels, logits)
        smoothing = settings.label_smoothing
        if smoothing is None:
            smoothing = getattr(self.config, "label_smoothing", 0.0) or 0.0
        tp_group = _module_tp_group(self)
        # [b s] => [s b], as Megatron does
        target = labels.transpose(0, 1).contiguous()
        loss, z_loss, lse = fused_loss(logits, target, tp_group, smoothing, settings)
        lse = lse if settings.log_lse else None
        # [s b] => [b s]: Megatron's per-token layout, so loss_mask handling is unchanged
        loss = loss.transpose(0, 1).contiguous()
        _maybe_record(self, labels, z_loss.transpose(0, 1), lse, settings)
        return loss

    compute_language_model_loss.__cez_wraps__ = fn
    return compute_language_model_loss


# ----------------------------------------------------------------------------------------------
# the module-level CE functions (for direct callers; same semantics as the originals + z-loss)
# ----------------------------------------------------------------------------------------------


def vocab_parallel_cross_entropy_wrapper(fn):
    """``tensor_parallel.vocab_parallel_cross_entropy(logits, target, label_smoothing=0.0[, tp_group])``."""

    @functools.wraps(fn)
    def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0, tp_group=None):
        settings = _settings.ACTIVE
        if settings is None:
            if tp_group is None:
                return fn(vocab_parallel_logits, target, label_smoothing)
            return fn(vocab_parallel_logits, target, label_smoothing, tp_group=tp_group)
        return fused_loss(vocab_parallel_logits, target, tp_group, label_smoothing, settings)[0]

    vocab_parallel_cross_entropy.__cez_wraps__ = fn
    return vocab_parallel_cross_entropy


def fused_vocab_parallel_cross_entropy_wrapper(fn):
    """``fused_vocab_parallel_cross_entropy(logits, target, tp_group)`` (Megatron's 'native' impl)."""

    @functools.wraps(fn)
    def fused_vocab_parallel_cross_entropy(vocab_parallel_logits, target, tp_group=None):
        settings = _settings.ACTIVE
        if settings is None:
            return fn(vocab_parallel_logits, target, tp_group)
        return fused_loss(vocab_parallel_logits, target, tp_group, 0.0, settings)[0]

    fused_vocab_parallel_cross_entropy.__cez_wraps__ = fn
    return fused_vocab_parallel_cross_entropy


def te_parallel_cross_entropy_wrapper(fn):
    """``te_parallel_cross_entropy(logits, labels, tp_group, is_cg_capturable=False)``.

    The language module binds it as ``None`` when Transformer Engine is absent; the replacement
    then keeps Megatron's error while inactive and serves the 'te' selection while active.
    """

    def te_parallel_cross_entropy(logits, labels, tp_group=None, is_cg_capturable=False):
        settings = _settings.ACTIVE
        if settings is None:
            if fn is None:
                raise RuntimeError("Trying to use a TE block when it's not present.")
            return fn(logits, labels, tp_group, is_cg_capturable)
        return fused_loss(logits, labels, tp_group, 0.0, settings)[0]

    if fn is not None:
        te_parallel_cross_entropy = functools.wraps(fn)(te_parallel_cross_entropy)
    te_parallel_cross_entropy.__cez_wraps__ = fn
    return te_parallel_cross_entropy
