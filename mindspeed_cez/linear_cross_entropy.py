"""Output projection + vocab-parallel cross entropy + z-loss, without the logits tensor.

``loss = CE(hidden @ weight.T) + c * lse**2`` per token, for the per-row partials of
``vocab_parallel_cross_entropy_zloss`` (merged across ranks by :mod:`mindspeed_cez.tensor_parallel`),
of the logits scaled and soft-capped as that op's ``logit_scale`` / ``logit_softcap`` say (by the
backends, per tile or chunk). Two paths:

- recompute (``LinearCrossEntropyZLoss``, :mod:`mindspeed_cez.linear_recompute`): the forward
  reduces the logits to the partials as they are made (Triton: ``tl.dot`` tiles in registers,
  kernels/triton_linear_cross_entropy.py; torch: GEMMs on chunks of the vocab); backward
  recomputes them one vocab chunk at a time into their gradient (a ``[tokens, chunk]`` buffer),
  then one GEMM adds that chunk's share into an fp32 ``dhidden`` and one writes its rows of
  ``dweight``: four GEMMs in all.
- gradients in forward (``LinearCrossEntropyZLossForwardGrads``, ``grads="forward"``,
  :mod:`mindspeed_cez.linear_forward_grads`): blocks of token rows with the whole vocab slice,
  three GEMMs; with ``grad_scale`` (the upstream gradient known in forward) ``dweight`` goes into
  the ``weight_grad`` target during the forward, else an fp32 ``dweight`` is kept until backward.

docs/fused_linear_cross_entropy.md compares them with measurements.

Tensor parallelism as Megatron's ``ColumnParallelLinear`` feeding the loss: each rank holds the
vocab rows ``weight [v_local, h]``; with ``sequence_parallel`` the hidden states arrive as this
rank's sequence chunk, are all-gathered along the sequence in forward, and ``dhidden`` is
reduce-scattered back; without it every rank holds all of ``hidden`` and ``dhidden`` is all-reduced.
Either collective starts once ``dhidden`` is complete and runs beside the last weight-gradient GEMM,
as ``ColumnParallelLinear`` overlaps it.
"""

import math
from dataclasses import InitVar, dataclass
from typing import Mapping, Optional

import torch

from mindspeed_cez import kernels
from mindspeed_cez.cross_entropy_zloss import check_target, loss_spec_of
from mindspeed_cez.kernels.chunked_linear import LOGITS_BUDGET_BYTES
from mindspeed_cez.linear_forward_grads import (LEAN_BLOCK_FRACTION, ForwardGradsOptions,
                                                LinearCrossEntropyZLossForwardGrads)
# Re-exported: the adaptor and the tests import them from here (WeightGradTarget too).
from mindspeed_cez.linear_forward_grads import (ForwardGradientError, check_forward_gradients,  # noqa: F401
                                                default_row_block)
from mindspeed_cez.linear_layer import WeightGradTarget
from mindspeed_cez.linear_recompute import LinearCrossEntropyZLoss, RecomputeOptions
from mindspeed_cez.tensor_parallel import group_rank_and_size


def _check(hidden, weight, target, tp_size, sequence_parallel):
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point() or hidden.dim() not in (2, 3):
        raise TypeError(f"hidden must be a floating-point [s, b, h] or [n, h] tensor, got "
                        f"{getattr(hidden, 'dtype', type(hidden))} {tuple(getattr(hidden, 'shape', ()))}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TypeError(f"weight must be a [v_local, h] tensor, got {tuple(getattr(weight, 'shape', ()))}")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise TypeError(f"weight ({weight.dtype}, {weight.device}) and hidden ({hidden.dtype}, {hidden.device}) "
                        "must share dtype and device")
    if weight.shape[0] == 0:
        raise ValueError("weight has no vocab rows: [v_local, h] needs v_local >= 1")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"hidden width {hidden.shape[-1]} does not match weight [v_local, h] {tuple(weight.shape)}")
    check_target(target)
    rows = hidden.shape[0] * (tp_size if sequence_parallel else 1)
    expected = (rows, *hidden.shape[1:-1])
    if tuple(target.shape) != expected:
        sp = f" (sequence_parallel: hidden holds 1/{tp_size} of the sequence)" if sequence_parallel else ""
        raise ValueError(f"target {tuple(target.shape)} must be hidden's shape without h, {expected}{sp}")
    if target.device != hidden.device:
        raise ValueError(f"target ({target.device}) and hidden ({hidden.device}) are on different devices")


GRADS = ("recompute", "forward")

REMOVED = {"gradient_accumulation_fusion": "weight_grad=WeightGradTarget(into=..., added=...)"}


def _refuse_removed(removed):
    """A ``TypeError`` for keywords the op no longer takes, naming what replaced them."""
    name = next(iter(removed))
    if name in REMOVED:
        raise TypeError(f"linear_cross_entropy_zloss() no longer takes {name}=: pass {REMOVED[name]}")
    raise TypeError(f"linear_cross_entropy_zloss() got an unexpected keyword argument {name!r}")


def _check_grad_scale(grad_scale, target):
    if grad_scale is None:
        return
    if isinstance(grad_scale, torch.Tensor):
        if grad_scale.numel() != 1 or grad_scale.is_complex() or grad_scale.dtype == torch.bool:
            raise ValueError(f"grad_scale must be a real scalar (a float or a one-element tensor), got a "
                             f"{grad_scale.dtype} tensor of shape {tuple(grad_scale.shape)}")
        if grad_scale.device != target.device:
            raise ValueError(f"grad_scale ({grad_scale.device}) and target ({target.device}) are on different devices")
        _check_finite_grad_scale(grad_scale)
    elif isinstance(grad_scale, bool) or not isinstance(grad_scale, (int, float)) or not math.isfinite(grad_scale):
        raise ValueError(f"grad_scale must be a finite float or a one-element tensor, got {grad_scale!r}")


GRAD_SCALE_NOT_FINITE = "grad_scale must be finite: the upstream gradient per unit of token_weights"


def _check_finite_grad_scale(grad_scale):
    """A one-element ``grad_scale`` tensor holds a finite number: on the CPU a ``ValueError``, on CUDA an
    asynchronous device-side assert (no host sync); elsewhere not checked (the gradients turn NaN)."""
    finite = torch.isfinite(grad_scale.detach()).all()
    if grad_scale.device.type == "cpu":
        if not bool(finite):
            raise ValueError(f"{GRAD_SCALE_NOT_FINITE} (Megatron: loss scale / tokens), got {grad_scale.item()}")
    elif grad_scale.device.type == "cuda":
        torch._assert_async(finite, GRAD_SCALE_NOT_FINITE)


def check_block_fraction(value, name="block_fraction"):
    """The one check of the memory/time dial (the op, the adaptor's settings, the flag: ``name``)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1):
        default = ("leave it out for the default" if name.startswith("--")  # a flag: no None
                   else "None: the default")
        raise ValueError(f"{name} takes the share of the tokens (and of the logits' memory) one block takes: a number "
                         f"in (0, 1] ({LEAN_BLOCK_FRACTION}: lean; {default}: blocks of at most "
                         f"{LOGITS_BUDGET_BYTES >> 30} GiB of logits), got {value!r}")


def check_block_bytes(value, name="block_bytes"):
    """The one check of the memory bound of a block (the op, the adaptor's settings, the flag: ``name``)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        if name.startswith("--"):  # a flag: in GiB, converted to bytes where valid
            raise ValueError(f"{name} takes the most memory one block of logits may take, in GiB: a number > 0 "
                             f"(leave it out for the default, {LOGITS_BUDGET_BYTES >> 30}), got {value!r}")
        raise ValueError(f"{name} takes the most memory one block of logits may take, in bytes: an int >= 1 "
                         f"(None: {LOGITS_BUDGET_BYTES >> 30} GiB), got {value!r}")


def check_grads(value, name="grads"):
    """The one check of the path's name (the op's ``grads``, the adaptor's settings, the flag: ``name``)."""
    if value not in GRADS:
        raise ValueError(f"{name} must be one of {GRADS}, got {value!r}")


@dataclass(frozen=True)
class GradientPath:
    """The fused layer's gradient path, checked once where its values enter (the op's ``grads`` and
    ``block_fraction``, the adaptor's settings, the flags); ``names``: the caller's name per field for errors."""

    grads: str = "recompute"
    block_fraction: Optional[float] = None  # grads="forward"'s memory/time dial as a share of the tokens
    block_bytes: Optional[int] = None  # ... or as the bytes of one block's logits (both None: default_row_block's)
    names: InitVar[Optional[Mapping[str, str]]] = None

    def __post_init__(self, names):
        name = (lambda field: names.get(field, field)) if names else (lambda field: field)
        check_grads(self.grads, name("grads"))
        check_block_fraction(self.block_fraction, name("block_fraction"))
        check_block_bytes(self.block_bytes, name("block_bytes"))
        if self.block_fraction is not None and self.block_bytes is not None:
            raise ValueError(f"{name('block_fraction')} and {name('block_bytes')} both size the blocks: pass one of them")
        if self.block_fraction is not None:
            object.__setattr__(self, "block_fraction", float(self.block_fraction))


RECOMPUTE = GradientPath("recompute")


def _path_of(path, grads, block_fraction, block_bytes):
    """The op's :class:`GradientPath`: ``path`` as given (checked where its values entered), or the
    thin shim of ``grads`` / ``block_fraction`` / ``block_bytes``: the path they describe (checked
    here, once). Passing both is an error."""
    if path is None:
        return GradientPath(grads, block_fraction, block_bytes)
    if not isinstance(path, GradientPath):
        raise TypeError(f"path must be a mindspeed_cez.linear_cross_entropy.GradientPath or None, got "
                        f"{type(path).__name__}")
    if grads != "recompute" or block_fraction is not None or block_bytes is not None:
        raise ValueError("path= describes the gradient path: pass it without grads, block_fraction or block_bytes, or "
                         "pass those without path=")
    return path


def _check_settings(target, token_weights, grad_scale, grads, chunk_cols, row_block, block_fraction=None,
                    block_bytes=None):
    if grads == "recompute" and (token_weights is not None or grad_scale is not None):
        name = "token_weights" if token_weights is not None else "grad_scale"
        raise ValueError(f"{name}: token_weights (and grad_scale) are the weights of the gradients made during the "
                         "forward: pass grads='forward' with them, or leave them out for grads='recompute'")
    _check_grad_scale(grad_scale, target)
    if grads == "forward":
        if token_weights is None:
            raise ValueError("grads='forward' needs token_weights (Megatron: the loss mask), a tensor of "
                             f"target's shape {tuple(target.shape)}")
        if not isinstance(token_weights, torch.Tensor) or tuple(token_weights.shape) != tuple(target.shape):
            raise ValueError(f"token_weights must be a tensor of target's shape {tuple(target.shape)}, got "
                             f"{tuple(getattr(token_weights, 'shape', ())) or type(token_weights).__name__}")
        if token_weights.device != target.device:
            raise ValueError(f"token_weights ({token_weights.device}) and target ({target.device}) are on "
                             "different devices")
    if row_block is not None and (block_fraction is not None or block_bytes is not None):
        other = "block_fraction" if block_fraction is not None else "block_bytes"
        raise ValueError(f"row_block and {other} both set the rows per block: pass one of them")
    for name, value in (("chunk_cols", chunk_cols), ("row_block", row_block)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be None (the default width) or an int >= 1, got {value!r}")


def linear_cross_entropy_zloss(hidden, weight, target, z_loss_coeff=0.0, label_smoothing=0.0, ignore_index=-100,
                               tp_group=None, sequence_parallel=False, weight_grad=None,
                               token_weights=None, *, grad_scale=None, logit_scale=1.0, logit_softcap=0.0,
                               grads="recompute", backend=None, linear_backend=None, chunk_cols=None, row_block=None,
                               block_fraction=None, block_bytes=None, return_lse=False, loss=None, remedy=None,
                               path=None, **removed):
    """Fused output projection + cross entropy + z-loss on this rank's vocab rows, no logits tensor.

    Args:
        hidden: ``[s, b, h]`` (or ``[n, h]``), bf16 / fp16 / fp32; with ``sequence_parallel`` this
            rank's ``[s/tp, b, h]`` sequence chunk, as Megatron's output layer receives it.
        weight: ``[v_local, h]``, this rank's rows of the output projection (no bias); same dtype.
        target: ``[s, b]`` (``[n]``) global vocab ids, the whole sequence; may hold ``ignore_index``.
        z_loss_coeff, label_smoothing, ignore_index: as :func:`vocab_parallel_cross_entropy_zloss`.
        logit_scale, logit_softcap: as :func:`vocab_parallel_cross_entropy_zloss`: the loss is of
            ``cap * tanh(scale * logits / cap)`` (``scale * logits`` for cap 0), made inside the
            projection's tiles / chunks, gradients through it.
        tp_group: the tensor-parallel group; ``None``: a single rank (no collective).
        sequence_parallel: hidden is sequence-sharded over ``tp_group`` (all-gathered here).
        weight_grad: a :class:`WeightGradTarget`: add ``dweight`` into ``weight_grad.into`` (fp32, or
            16-bit, which takes the GEMMs in its dtype) instead of returning it; autograd gets what
            ``weight_grad.added()`` returns for ``weight``. None (default): ``dweight`` through autograd.
            The adaptor passes Megatron's gradient buffer and its DDP placeholder this way.
        token_weights: with ``grads="forward"`` only (required there): a tensor of ``target``'s shape
            (Megatron: the loss mask) weighting the tokens' ``dweight``; the upstream gradient must be
            ``k * token_weights`` with one scalar ``k`` (checked on the device in backward, without a
            host sync). With ``grads="recompute"`` passing them is an error.
        grad_scale: with ``grads="forward"``: the upstream gradient is ``grad_scale * token_weights``
            exactly (a float or a one-element tensor; Megatron: its loss scale over the micro-batch's
            token count and the number of micro-batches). Each block's gradient is then made for it:
            ``dhidden`` as the unfused path makes it, ``dweight`` added into ``weight_grad``'s target during
            the forward (no buffer; the forward must be followed by its backward: :func:`check_forward_gradients` raises otherwise; under ``torch.no_grad()``
            nothing is added). Backward checks the gradient on the device, as for ``token_weights``.
        grads: ``"recompute"`` (default): backward recomputes the logits one vocab chunk at a time
            (four GEMMs; any upstream gradient). ``"forward"``: the gradients are made during the
            forward, ``row_block`` tokens at a time (three GEMMs, ``dweight`` held in fp32 until backward).
        backend: the cross-entropy backend, ``"triton"`` / ``"torch"``; ``None`` (default): automatic per
            device, as :func:`vocab_parallel_cross_entropy_zloss`.
        linear_backend: ``grads="recompute"``'s projection, ``"gemm"`` (``torch.matmul`` on vocab chunks)
            or ``"triton"`` (``tl.dot`` kernels, no logits even per chunk); ``None`` (default): GEMMs on
            CUDA and with the torch backend, Triton on other accelerators.
        chunk_cols: vocab rows per chunk of ``grads="recompute"`` (None: 4096, fewer where a chunk's
            logits would pass 2**26, not under 1024 unless a chunk would pass 4 GiB;
            ``kernels.chunked_linear.default_chunk_cols``).
        row_block: token rows per block of ``grads="forward"`` (None: from ``block_bytes`` /
            ``block_fraction``).
        block_bytes: the memory/time dial of ``grads="forward"`` in bytes: the most one block's logits
            (then their gradient) take, whatever the token count (None and no ``block_fraction``:
            4 GiB, ``kernels.chunked_linear.LOGITS_BUDGET_BYTES``); logits within it are one block.
        block_fraction: the same dial as the share of the tokens one block takes, so its working
            memory is ``block_fraction`` x the logits (0.125 the lean setting): ``ceil(1 / block_fraction)``
            equal blocks. Either way blocks hold at least 1024 rows (:func:`default_row_block`), and each
            block beyond the first adds one read-modify-write of the fp32 ``dweight`` (8 V h bytes):
            docs/weight_gradient.md.
        return_lse: also return the detached per-token log-sum-exp, as
            :func:`vocab_parallel_cross_entropy_zloss`.
        loss: the whole loss as one ``LossSpec``; the loose ``ignore_index``, ``z_loss_coeff``,
            ``label_smoothing``, ``logit_scale`` and ``logit_softcap`` are a shim for it, as in
            :func:`vocab_parallel_cross_entropy_zloss`.
        path: the gradient path as one :class:`GradientPath` (made and checked where its values
            entered, e.g. a config); ``grads``, ``block_fraction`` and ``block_bytes`` are a shim for it (without
            ``path`` the op builds the one they describe; with it they must stay at their defaults).
            Where no backward will come (``torch.no_grad()``, no input needing a gradient) the op
            takes the recompute path's forward whatever the path says: the loss alone.
        remedy: with ``grads="forward"``, the fix that errors raised after the forward (in backward,
            or on the device, where no caller can re-word them) name; None: ``"grads='recompute'"``.
            The adaptor passes its flag's.

    Returns:
        ``(loss, z_loss)``, fp32, shape of ``target``: ``CE + c*lse**2`` per token and the detached
        ``c*lse**2``, 0 where ignored; ``(loss, z_loss, lse)`` with ``return_lse=True``. ``dhidden``
        comes back as ``ColumnParallelLinear`` gives it: this rank's chunk with ``sequence_parallel``,
        else the full gradient on every rank.
    """
    if removed:
        _refuse_removed(removed)
    _check(hidden, weight, target, group_rank_and_size(tp_group)[1], sequence_parallel)
    if weight_grad is not None:
        if not isinstance(weight_grad, WeightGradTarget):
            raise TypeError(f"weight_grad must be a mindspeed_cez.linear_cross_entropy.WeightGradTarget or None, "
                            f"got {type(weight_grad).__name__}")
        weight_grad.check(weight)
    loss = loss_spec_of(loss, ignore_index, z_loss_coeff, label_smoothing, logit_scale, logit_softcap)
    path = _path_of(path, grads, block_fraction, block_bytes)
    grads, block_fraction, block_bytes = path.grads, path.block_fraction, path.block_bytes
    _check_settings(target, token_weights, grad_scale, grads, chunk_cols, row_block, block_fraction, block_bytes)
    common = dict(loss=loss, tp_group=tp_group, sequence_parallel=bool(sequence_parallel), weight_grad=weight_grad,
                  backend=kernels.backend_for(hidden.device, backend))
    if grads == "forward" and not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        grads = "recompute"  # no backward will come (torch.no_grad(), no input needing it): the loss alone
    if grads == "recompute":
        options = RecomputeOptions(**common, linear=kernels.linear_backend_for(hidden.device, linear_backend, backend,
                                                                               chunk_cols), chunk_cols=chunk_cols)
        total, z_loss, lse = LinearCrossEntropyZLoss.apply(hidden, weight, target, options)
    else:
        if isinstance(grad_scale, torch.Tensor):
            grad_scale = grad_scale.detach().reshape(()).float()
        options = ForwardGradsOptions(**common, row_block=row_block, block_fraction=block_fraction,
                                      block_bytes=block_bytes,
                                      **({} if remedy is None else {"remedy": str(remedy)}))
        total, z_loss, lse = LinearCrossEntropyZLossForwardGrads.apply(hidden, weight, target, token_weights.detach(),
                                                                       grad_scale, options)
    return (total, z_loss, lse) if return_lse else (total, z_loss)
