"""The model's context for its LM loss: what a model's forward with labels hands its own loss, and
the main head's output layer call.

* The loss context: a model's forward (``GPTModel._postprocess``, the other models of
  :data:`.patch_points.TARGETS`, MindSpeed-LLM's ``GPTModel.forward``) opens a :class:`LossContext` on
  the model object itself (:func:`loss_context_wrapper`); Megatron then calls
  ``self.compute_language_model_loss`` on that same object, whose patched version reads it (the labels
  tell the main head from an MTP head, the loss mask weights ``lm_z_loss``). The context lives on the
  model for the forward's duration (a nested forward of the same model restores the outer one after),
  so no module-level state carries it.
* The main head's call (``--lm-fused-output-layer``, MindSpeed-LLM's logit transform). The forward
  gets its :class:`MainHeadCall` from :func:`main_head_call`. It hands it to its output layer
  (:func:`handed`: an attribute of the layer while the forward runs). The patched
  ``ColumnParallelLinear.forward`` then serves the main head's call, the last one. (MTP heads,
  ``config.mtp_num_layers``, call it first and get real logits. A forward may run none:
  ``HybridModel.forward(compute_mtp_loss=False)``, or no ``mtp_process``.) For that call it returns
  :class:`DeferredLogits` (its input and weight) instead of logits, or :class:`TransformedLogits`
  around its result. The latter records MindSpeed-LLM's scaling and soft cap
  (``--output-multiplier-scale``, ``--output-logit-softcapping``: ``x * s``, then ``x / C``, ``tanh``,
  ``x * C``) for the loss kernels instead of computing them.
* The patched loss (:mod:`.loss_wrappers`) reads the context and checks what it got. Anything unexpected
  fails loudly, naming the flag: deferred logits reaching anything but the main loss, a main loss that
  got real logits, an output layer the op cannot stand in for (bias, gathered output, deferred
  embedding wgrad), any other op on the transformed logits.
"""

import contextlib
import functools
import inspect
import math
import numbers

import torch

from mindspeed_cez.kernels import LogitTransform
from mindspeed_cez.patches import mean_embedding, megatron_state
from mindspeed_cez.patches.runtime import while_active

FLAG = "--lm-fused-output-layer"
TRANSFORM_FLAGS = "--output-multiplier-scale / --output-logit-softcapping"


class FusedOutputLayerError(RuntimeError):
    pass


class LogitTransformError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------
# the loss context: a model's forward -> its compute_language_model_loss
# ---------------------------------------------------------------------------------------------

# The model's attribute holding its open context (a plain object: nn.Module keeps it in __dict__). It rides
# on the model: Megatron calls the model's own compute_language_model_loss, with no handle, inside that
# model's forward (one context per model, so nested or pipelined models keep theirs apart).
ATTRIBUTE = "_mindspeed_cez_loss_context"


class LossContext:
    """``labels`` and ``loss_mask`` the forward received (``[b, s]``, either may be None) and
    ``main_head_call`` (:class:`MainHeadCall`, or None: its output layer runs as is)."""

    __slots__ = ("labels", "loss_mask", "main_head_call")

    def __init__(self, labels, loss_mask, main_head_call):
        self.labels, self.loss_mask, self.main_head_call = labels, loss_mask, main_head_call


@contextlib.contextmanager
def attached(owner, attribute, value):
    """``owner.<attribute>`` is ``value`` while the block runs, then what it was (nested blocks of one
    owner restore the outer value). Kept in ``owner``'s ``__dict__``: nn.Module's own attribute hooks
    are not involved."""
    state = vars(owner)
    previous = state.get(attribute)
    state[attribute] = value
    try:
        yield value
    finally:
        if previous is None:
            state.pop(attribute, None)
        else:
            state[attribute] = previous


def opened_on(model, context):
    """``context`` is ``model``'s while the block runs."""
    return attached(model, ATTRIBUTE, context)


def loss_context_of(model):
    """The :class:`LossContext` open on ``model``, or None (no forward with labels of this model around)."""
    return getattr(model, "__dict__", {}).get(ATTRIBUTE)


def has_loss_context_args(fn):
    """Whether a model's ``fn`` takes both ``labels`` and ``loss_mask`` (a loss-context patch point)."""
    return {"labels", "loss_mask"} <= set(inspect.signature(fn).parameters)


def loss_context_wrapper(fn):
    """Open a :class:`LossContext` on the model for its forward: its labels and loss mask (the
    ``lm_z_loss`` metric, the main head told from MTP heads), and hand its output layer the main
    head's call."""
    signature = inspect.signature(fn)
    mtp_switch = "compute_mtp_loss" in signature.parameters  # Megatron main's HybridModel.forward

    def with_loss_context(runtime, self, *args, **kwargs):
        settings = runtime.settings
        bound = signature.bind(self, *args, **kwargs).arguments
        if settings.mu_centering and self.training:
            mean_embedding.mark_output_weights(self, megatron_state.module_tp_group(self))
        main_head = main_head_call(self, bound, settings, mtp_switch)
        context = LossContext(bound.get("labels"), bound.get("loss_mask"), main_head)
        with opened_on(self, context), handed(main_head):
            return fn(self, *args, **kwargs)

    return while_active(fn, with_loss_context)


# ---------------------------------------------------------------------------------------------
# the main head's output layer call
# ---------------------------------------------------------------------------------------------


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


def main_head_call(model, bound_args, settings, mtp_switch=False):
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
    return MainHeadCall(layer, mtp_heads_before(model, bound_args, mtp_switch), settings.fused_output_layer,
                        settings.logit_transform is not None)


def mtp_heads_before(model, bound_args, mtp_switch=False):
    """How many MTP heads call the output layer before the main head in a forward with ``bound_args``:
    ``config.mtp_num_layers`` (GPTModel's ``process_mtp_loss`` runs on that alone). A forward with the
    switch (``mtp_switch``: Megatron main's ``HybridModel.forward(compute_mtp_loss=...)``) runs them only
    where ``mtp_process`` and ``compute_mtp_loss`` (default True) are both on: else none."""
    heads = getattr(model.config, "mtp_num_layers", None) or 0
    if mtp_switch and not (getattr(model, "mtp_process", True) and bound_args.get("compute_mtp_loss", True)):
        return 0
    return heads


def _check_layer(layer, runtime_gather_output, hidden):
    gather = layer.gather_output if runtime_gather_output is None else runtime_gather_output
    if gather:
        raise FusedOutputLayerError(f"{FLAG} needs vocab-parallel logits; the output layer gathers them "
                                    "(parallel_output=False or runtime_gather_output=True)")
    if getattr(layer, "bias", None) is not None:
        raise FusedOutputLayerError(f"{FLAG}: the output layer has a bias, which the fused op does not take")
    if getattr(layer.config, "defer_embedding_wgrad_compute", False):
        raise FusedOutputLayerError(f"{FLAG} does not serve --defer-embedding-wgrad-compute")
    output_dtype = getattr(layer, "output_dtype", None)  # Megatron main's --output-logit-dtype
    if output_dtype is not None and output_dtype != getattr(hidden, "dtype", output_dtype):
        raise FusedOutputLayerError(f"{FLAG} makes no logits tensor, so the output layer's output_dtype "
                                    f"{output_dtype} (--output-logit-dtype) for {hidden.dtype} hidden states is not "
                                    f"served: drop --output-logit-dtype or {FLAG}")


# The output layer's attribute holding its MainHeadCall during the model's forward. It rides on the layer:
# Megatron calls that layer (with no handle) from its forward, and only the main head's call is deferred.
MAIN_HEAD = "_mindspeed_cez_main_head"


def handed(main_head):
    """``main_head`` (a :class:`MainHeadCall`, or None: nothing to hand) is its layer's while the block runs."""
    if main_head is None:
        return contextlib.nullcontext()
    return attached(main_head.layer, MAIN_HEAD, main_head)


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
            _check_layer(self, runtime_gather_output, input_)
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


# ---------------------------------------------------------------------------------------------
# MindSpeed-LLM's scaling and soft cap of the logits, recorded for the loss kernels
# ---------------------------------------------------------------------------------------------


def _number(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


class TransformedLogits:
    """The main head's logits (a tensor, or the output layer call deferred by
    ``--lm-fused-output-layer``) with the element-wise transform applied to them so far:
    ``scale`` (products by numbers), then optionally ``/ C``, ``tanh``, ``* C`` (the soft cap)."""

    __slots__ = ("logits", "scale", "cap", "_divisor", "_tanh")

    def __init__(self, logits):
        self.logits, self.scale, self.cap, self._divisor, self._tanh = logits, 1.0, 0.0, None, False

    def _refuse(self, what):
        raise LogitTransformError(
            f"mindspeed_cez: the model applied {what} to the logits it hands to the LM loss; the fused loss "
            f"computes only MindSpeed-LLM's transform ({TRANSFORM_FLAGS}: x * s, then x / C, tanh, x * C) in its kernels. "
            "Run without those flags or without the fused loss for this model.")

    def __mul__(self, other):
        if not _number(other):
            self._refuse(f"'* {type(other).__name__}'")
        if self._tanh:  # the '* C' closing tanh(x / C)
            if other != self._divisor:
                self._refuse(f"'* {other}' after tanh(x / {self._divisor})")
            self.cap, self._tanh, self._divisor = float(other), False, None
        elif self._divisor is not None or self.cap:
            self._refuse(f"'* {other}' after the soft cap began")
        else:
            self.scale *= float(other)
        return self

    __rmul__ = __mul__

    def __truediv__(self, other):
        if not _number(other) or other <= 0 or self._divisor is not None or self._tanh or self.cap:
            self._refuse(f"'/ {other!r}'")
        self._divisor = float(other)
        return self

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.tanh and len(args) == 1 and not kwargs and isinstance(args[0], cls):
            logits = args[0]
            if logits._divisor is None or logits._tanh:
                logits._refuse("tanh without a division by the cap before it")
            logits._tanh = True
            return logits
        cls(None)._refuse(f"torch.{getattr(func, '__name__', func)}")

    def __getattr__(self, name):
        self._refuse(f"'.{name}'")

    def transform(self):
        """The recorded :class:`LogitTransform`, once the model's forward is done with the logits."""
        if self._divisor is not None or self._tanh:
            self._refuse("an unfinished soft cap")
        return LogitTransform(self.scale, self.cap)
