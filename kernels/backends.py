"""The backends' interfaces, one ``typing.Protocol`` per kind (``tests/kernels/test_backends_protocol.py``
checks every backend against its kind).

Tensors: logits ``[n, v_local]`` with a contiguous last dim, target ``[n]`` int64 global ids, results
fp32. ``spec``: the :class:`.LossSpec`; ``shard``: the :class:`.VocabShard` the columns are of. Partials: the
flat layout that ``kernels/__init__.py`` describes.
"""

from typing import Optional, Protocol, runtime_checkable

import torch

from . import LossSpec, VocabShard


@runtime_checkable
class CrossEntropyBackend(Protocol):
    """The loss of logits that exist: ``"triton"`` (``triton_cross_entropy``), ``"torch"`` (``torch_reference``)."""

    def fused_loss(self, logits: torch.Tensor, target: torch.Tensor, spec: LossSpec) -> torch.Tensor:
        """One rank holds the whole vocab: ``[3, n]`` rows loss, z-loss, lse, in one pass."""

    def shard_partials(self, logits: torch.Tensor, target: torch.Tensor, spec: LossSpec,
                       shard: VocabShard) -> torch.Tensor:
        """This vocab slice's partials: per row its lse and target term (NaN for an out-of-range target), its width."""

    def loss_from_partials(self, gathered: torch.Tensor, target: torch.Tensor, spec: LossSpec,
                           out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``gathered``: every rank's partials ``[ranks, numel]`` -> ``[3, n]`` loss, z-loss, lse (into ``out``); unequal widths: NaN
        (on CUDA also a device-side assert)."""

    def write_grad(self, logits: torch.Tensor, grad: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                   grad_loss: torch.Tensor, spec: LossSpec, shard: VocabShard) -> torch.Tensor:
        """``g * (softmax * (1 + 2c*lse) - (1-a)*onehot - a/V)`` (times ``dz/dx``) into ``grad`` (may be ``logits``)."""

    def check_targets(self, target: torch.Tensor, spec: LossSpec, shard: VocabShard) -> None:
        """Off the CPU: an asynchronous device-side check of the targets' range (no host sync), or
        nothing where the forward kernel checks them itself."""


@runtime_checkable
class LinearBackend(Protocol):
    """The loss of ``rows @ weight.T`` without its logits: ``"triton"`` (``triton_linear_cross_entropy``,
    ``tl.dot`` tiles) and ``"gemm"`` (``chunked_linear.ChunkedLinear``: GEMMs on vocab chunks reduced
    by a :class:`CrossEntropyBackend`)."""

    def linear_partials(self, rows: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, spec: LossSpec,
                        shard: VocabShard) -> torch.Tensor:
        """The partials of ``rows @ weight.T`` (``weight``'s rows: the vocab slice ``shard``)."""

    def linear_grad(self, rows: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, target: torch.Tensor,
                    lse: torch.Tensor, grad_loss: torch.Tensor, spec: LossSpec, shard: VocabShard) -> torch.Tensor:
        """The gradient of the loss of ``rows @ weight.T`` w.r.t. those logits, into ``grad`` ``[n, weight rows]``."""

    def check_targets(self, target: torch.Tensor, spec: LossSpec, shard: VocabShard) -> None:
        """As :meth:`CrossEntropyBackend.check_targets`."""


@runtime_checkable
class WholeLossBackend(Protocol):
    """A vendor's whole op with its own autograd, one rank holding the whole vocab: ``"cann"``
    (``cann``, torch_npu's ``npu_cross_entropy_loss``)."""

    def available(self) -> bool:
        """Whether the vendor's op imports here."""

    def check_applies(self, tp_size: int, transform) -> None:
        """Refuse what the vendor op cannot compute, naming the argument and the fix."""

    def cross_entropy_zloss(self, logits: torch.Tensor, target: torch.Tensor, spec: LossSpec):
        """``(loss, z_loss, lse)``, fp32, shape of ``target``."""
