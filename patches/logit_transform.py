"""MindSpeed-LLM's scaling and soft-capping of the logits, computed in the loss kernels.

MindSpeed-LLM's ``GPTModel`` forward transforms the main head's logits with torch ops before its
loss: ``logits * s`` (``--output-multiplier-scale``), then ``logits / C``, ``torch.tanh``, ``* C``
(``--output-logit-softcapping``). Each op makes a logits-sized tensor, and tanh's output is kept
for backward. With the fused loss on, the main head's output layer call returns
:class:`TransformedLogits` instead of a tensor: those ops are recorded, not computed, and the
patched loss (:func:`unwrap`) checks them against the flags, whose transform the loss's
``LossSpec`` carries into the kernels (``z = C * tanh(s * x / C)``, the same numbers). Anything
else done to the object fails loudly.
"""

import math
import numbers

import torch

from mindspeed_cez.kernels.logit_transform import IDENTITY, LogitTransform

FLAGS = "--output-multiplier-scale / --output-logit-softcapping"


class LogitTransformError(RuntimeError):
    pass


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
            f"computes only MindSpeed-LLM's transform ({FLAGS}: x * s, then x / C, tanh, x * C) in its kernels. "
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


def unwrap(logits, is_main, expected):
    """``(logits, transform)`` of what a language-model loss got: the tensor (or deferred output layer
    call) inside :class:`TransformedLogits` and the transform the model applied to it, checked against
    ``expected`` (the flags'); anything else as it is, with the identity."""
    if not isinstance(logits, TransformedLogits):
        return logits, IDENTITY
    if not is_main:
        raise LogitTransformError("mindspeed_cez: an MTP head's loss got the main head's transformed logits")
    transform = logits.transform()
    if transform != expected:
        raise LogitTransformError(
            f"mindspeed_cez: the model applied {transform} to the logits, but its flags set {expected} ({FLAGS}); "
            "the fused loss computes only the latter")
    return logits.logits, transform
