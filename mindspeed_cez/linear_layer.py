"""What both paths of the fused output layer (:mod:`mindspeed_cez.linear_cross_entropy`) share:
their options' base and Megatron's ``main_grad`` placeholder."""

from dataclasses import dataclass

import torch

from mindspeed_cez.cross_entropy_zloss import CrossEntropyOptions


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


@dataclass(frozen=True, eq=False)
class LinearLossOptions(CrossEntropyOptions):
    """What both paths' autograd Functions take besides their tensors: the loss's options and the
    projection's tensor parallelism, checked by :func:`linear_cross_entropy_zloss` before it is made."""

    sequence_parallel: bool = False
    gradient_accumulation_fusion: bool = False

