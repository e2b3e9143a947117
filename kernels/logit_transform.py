"""The element-wise transform of the logits that the loss is computed on: one value, flag to kernel.

``LogitTransform(scale, cap)``: the loss is of ``z = cap * tanh(scale * x / cap)``, or of
``z = scale * x`` when ``cap`` is 0 (a multiplier on the output logits, then a soft cap, as
MindSpeed-LLM's GPT model applies them). ``IDENTITY`` (``scale=1, cap=0``) is the loss of ``x`` itself.

Where it goes: the ops take one as their ``logit_transform`` (the fused layer: in its options), checked
here, once, and put it into the loss's :class:`.loss_spec.LossSpec`; the adaptor's settings carry one; the
Triton kernels get its two fp32 numbers and the ``TRANSFORM`` constexpr
:attr:`kind` from ``LossSpec.kernel_args``, the torch reference calls :meth:`apply` / :meth:`slope`.

A new transform touches this module (fields, :attr:`kind`, :meth:`apply`, :meth:`slope`), the
kernels that switch on ``TRANSFORM`` (``triton_loss_steps.transform_logits`` /
``transform_logits_with_slope``, used by both Triton kernel files), ``tests/support/kernel_variants.py``'s compiled
list, and the tests (``tests/ops/test_cross_entropy_zloss.py``'s transforms, ``tests/kernels/test_kernels_logit_transform.py``).
"""

import math
import numbers
from dataclasses import dataclass

import torch

# The kernels' TRANSFORM constexpr: the loss of x itself, of z = scale * x, of z = cap * tanh(scale * x / cap).
NO_TRANSFORM, SCALE, SOFTCAP = 0, 1, 2
KIND_NAMES = {NO_TRANSFORM: "none", SCALE: "scale", SOFTCAP: "softcap"}
# tanh(u) for |u| < TANH_SERIES_BELOW: u + u**3 (c3 + u**2 (c5 + u**2 (c7 + u**2 c9))), Taylor's coefficients
# (the kernels' ``triton_loss_steps.tanh_and_slope`` has the same numbers).
TANH_SERIES_BELOW = 0.25
TANH_SERIES = (-1.0 / 3.0, 2.0 / 15.0, -17.0 / 315.0, 62.0 / 2835.0)


def _finite(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class LogitTransform:
    """``z = cap * tanh(scale * x / cap)`` (``cap > 0``), ``z = scale * x`` (``cap == 0``).

    Args:
        scale: ``s > 0``, finite: the logit scale (MindSpeed-LLM's ``output_multiplier_scale``).
        cap: ``C >= 0``, finite: the soft cap; 0 (default): no cap.
    """

    scale: float = 1.0
    cap: float = 0.0

    def __post_init__(self):
        if not (_finite(self.scale) and self.scale > 0):
            raise ValueError(f"logit_scale must be a finite number > 0 (LogitTransform.scale), got {self.scale!r}")
        if not (_finite(self.cap) and self.cap >= 0):
            raise ValueError(f"logit_softcap must be a finite number >= 0 (0: no cap) (LogitTransform.cap), got {self.cap!r}")
        object.__setattr__(self, "scale", float(self.scale))
        object.__setattr__(self, "cap", float(self.cap))

    @property
    def kind(self):
        """The kernels' ``TRANSFORM`` constexpr (an int): ``NO_TRANSFORM`` compiles the kernels without one."""
        return SOFTCAP if self.cap else (SCALE if self.scale != 1.0 else NO_TRANSFORM)

    @property
    def is_identity(self):
        return self.kind == NO_TRANSFORM

    def apply(self, x):
        """z of a (fp32) tensor ``x``."""
        return self.apply_with_slope(x)[0]

    def apply_with_slope(self, x):
        """``(z, dz/dx)`` of a (fp32) tensor ``x``, as the Triton kernels compute them: with a cap,
        from ``e = exp(-2|u|)``, ``u = scale * x / cap``: ``tanh(u) = sign(u) (1 - e) / (1 + e)`` and
        ``1 - tanh(u)**2 = 4e / (1 + e)**2``, which has no cancellation where ``tanh`` nears +-1; below
        ``|u| < TANH_SERIES_BELOW``, where ``1 - e`` cancels, tanh is its series through ``u**9``."""
        if self.cap:
            u = x * (self.scale / self.cap)
            e = torch.exp(-2.0 * u.abs())
            r = 1.0 / (1.0 + e)
            t = (1.0 - e) * r
            u2 = u * u
            c3, c5, c7, c9 = TANH_SERIES
            series = u + u * u2 * (c3 + u2 * (c5 + u2 * (c7 + u2 * c9)))
            t = torch.where(u.abs() < TANH_SERIES_BELOW, series, torch.where(u < 0, -t, t))
            return self.cap * t, self.scale * 4.0 * e * r * r
        if self.scale != 1.0:
            return x * self.scale, self.scale
        return x, 1.0


IDENTITY = LogitTransform()
