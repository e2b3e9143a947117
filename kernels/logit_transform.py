"""The element-wise transform of the logits that the loss is computed on: one value, flag to kernel.

``LogitTransform(scale, cap)``: the loss is of ``z = cap * tanh(scale * x / cap)``, or of
``z = scale * x`` when ``cap`` is 0 (MindSpeed-LLM's ``--output-multiplier-scale`` then
``--output-logit-softcapping``). ``IDENTITY`` (``scale=1, cap=0``) is the loss of ``x`` itself.

Where it goes: the ops build one from their ``logit_scale`` / ``logit_softcap`` arguments (checked
here, once); the adaptor's settings carry one from MindSpeed-LLM's flags; every backend takes it as
``transform=``; the Triton kernels get :meth:`LogitTransform.kernel_args` (two fp32 numbers and the
``TRANSFORM`` constexpr :attr:`kind`), the torch reference calls :meth:`apply` / :meth:`slope`.

A new transform touches this module (fields, :attr:`kind`, :meth:`apply`, :meth:`slope`), the
kernels that switch on ``TRANSFORM`` (``triton_cross_entropy._transform`` /
``_transform_with_slope``, used by ``triton_linear_cross_entropy`` too), ``variants.py``'s compiled
list, and the tests (``tests/test_op.py``'s transforms, ``tests/test_logit_transform.py``).
"""

import math
import numbers
from dataclasses import dataclass

# The kernels' TRANSFORM constexpr: the loss of x itself, of z = scale * x, of z = cap * tanh(scale * x / cap).
NO_TRANSFORM, SCALE, SOFTCAP = 0, 1, 2
KIND_NAMES = {NO_TRANSFORM: "none", SCALE: "scale", SOFTCAP: "softcap"}


def _finite(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class LogitTransform:
    """``z = cap * tanh(scale * x / cap)`` (``cap > 0``), ``z = scale * x`` (``cap == 0``)."""

    scale: float = 1.0
    cap: float = 0.0

    def __post_init__(self):
        if not (_finite(self.scale) and self.scale > 0):
            raise ValueError(f"logit_scale must be a finite number > 0, got {self.scale!r}")
        if not (_finite(self.cap) and self.cap >= 0):
            raise ValueError(f"logit_softcap must be a finite number >= 0 (0: no cap), got {self.cap!r}")
        object.__setattr__(self, "scale", float(self.scale))
        object.__setattr__(self, "cap", float(self.cap))

    @property
    def kind(self):
        """The kernels' ``TRANSFORM`` constexpr (an int): ``NO_TRANSFORM`` compiles the kernels without one."""
        return SOFTCAP if self.cap else (SCALE if self.scale != 1.0 else NO_TRANSFORM)

    @property
    def is_identity(self):
        return self.kind == NO_TRANSFORM

    def kernel_args(self):
        """``(scale, cap, TRANSFORM)``: the Triton kernels' two fp32 arguments and constexpr."""
        return self.scale, self.cap, self.kind

    def apply(self, x):
        """z of a (fp32) tensor ``x``."""
        if self.scale != 1.0:
            x = x * self.scale
        if self.cap:
            x = (x / self.cap).tanh() * self.cap
        return x

    def slope(self, z):
        """dz/dx from z: ``scale * (1 - (z/cap)**2)``, ``scale`` without a cap."""
        if self.cap:
            return self.scale * (1.0 - (z / self.cap).square())
        return self.scale


IDENTITY = LogitTransform()
