"""What both paths of the fused output layer (:mod:`mindspeed_cez.linear_cross_entropy`) share: their
options' base and the weight-gradient target."""

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from mindspeed_cez.cross_entropy_zloss import CallOptions


@dataclass(frozen=True, eq=False)
class WeightGradTarget:
    """Where the fused layer adds the weight's gradient, instead of returning it through autograd.

    Args:
        into: a tensor of the weight's shape, fp32 or the weight's 16-bit dtype; the gradient is added
            into it (a 16-bit one takes the GEMMs in its dtype).
        added: called once the gradient is in ``into``, in backward; returns what autograd gets for the
            weight (a placeholder tensor of its shape, or None). None: autograd gets None.
    """

    into: torch.Tensor
    added: Optional[Callable[[], Optional[torch.Tensor]]] = None

    def __post_init__(self):
        if not isinstance(self.into, torch.Tensor) or not self.into.is_floating_point():
            raise TypeError(f"WeightGradTarget.into must be a floating-point tensor, got {type(self.into).__name__}")
        if self.added is not None and not callable(self.added):
            raise TypeError(f"WeightGradTarget.added must be callable or None, got {self.added!r}")

    def check(self, weight):
        """The target fits ``weight``: same shape and device, else a ``ValueError``."""
        if tuple(self.into.shape) != tuple(weight.shape) or self.into.device != weight.device:
            raise ValueError(f"WeightGradTarget.into ({tuple(self.into.shape)}, {self.into.device}) must have the "
                             f"weight's shape and device ({tuple(weight.shape)}, {weight.device})")

    def finish(self):
        """What autograd gets for the weight once its gradient is in ``into``."""
        return None if self.added is None else self.added()


@dataclass(frozen=True, eq=False)
class LinearLossOptions(CallOptions):
    """What both paths' autograd Functions take besides their tensors: the loss's options and the
    projection's tensor parallelism, checked by :func:`linear_cross_entropy_zloss` before it is made."""

    sequence_parallel: bool = False
    weight_grad: Optional[WeightGradTarget] = None
    accumulation: Optional[str] = None  # the fp32 accumulation's kind (linear_forward_grads.KINDS), None: automatic
