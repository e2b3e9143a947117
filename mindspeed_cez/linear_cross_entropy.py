"""Output projection + vocab-parallel cross entropy + z-loss, without the logits tensor.

``loss = CE(hidden @ weight.T) + c * lse**2`` per token, for the per-row partials of
``vocab_parallel_cross_entropy_zloss`` (merged across ranks by the tensor-parallel steps of :mod:`mindspeed_cez.cross_entropy_zloss`),
of the logits scaled and soft-capped as the options' ``logit_transform`` says (by the backends, per
tile or chunk). Two paths (:class:`GradientPath`):

- recompute (``LinearCrossEntropyZLoss``, ``grads="recompute"``, :mod:`mindspeed_cez.linear_recompute`): the forward
  reduces the logits to the partials as they are made (Triton: ``tl.dot`` tiles in registers,
  kernels/triton_linear_cross_entropy.py; torch: GEMMs on chunks of the vocab); backward
  recomputes them one vocab chunk at a time into their gradient (a ``[tokens, chunk]`` buffer),
  then one GEMM adds that chunk's share into an fp32 ``dhidden`` and one writes its rows of
  ``dweight``: four GEMMs in all.
- gradients in forward (``LinearCrossEntropyZLossForwardGrads``, ``grads="forward"``, the default
  where the call has token weights; :mod:`mindspeed_cez.linear_forward_grads`): blocks of token rows
  with the whole vocab slice, three GEMMs; with ``grad_scale`` (the upstream gradient known in forward)
  ``dweight`` goes into the ``weight_grad`` target during the forward, else an fp32 ``dweight`` is kept
  until backward. A call without token weights takes the recompute path.

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
from typing import Mapping, Optional, Union

import torch

from mindspeed_cez import kernels
from mindspeed_cez.cross_entropy_zloss import check_target, refusing_removed
from mindspeed_cez.kernels import IDENTITY, LogitTransform, loss_spec
from mindspeed_cez.kernels.chunked_linear import LOGITS_BUDGET_BYTES
from mindspeed_cez.cross_entropy_zloss import group_rank_and_size
from mindspeed_cez.linear_forward_grads import (LEAN_BLOCK_FRACTION, ForwardGradsOptions,
                                                LinearCrossEntropyZLossForwardGrads, check_accumulation)
# Re-exported: the adaptor and the tests import them from here (WeightGradTarget too).
from mindspeed_cez.linear_forward_grads import (ForwardGradientError, ForwardGradientLedger,  # noqa: F401
                                                default_row_block)
from mindspeed_cez.linear_options import WeightGradTarget
from mindspeed_cez.linear_recompute import LinearCrossEntropyZLoss, RecomputeOptions


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


GRADS = ("forward", "recompute")

_CHANGED = "options=LinearCrossEntropyOptions({})"
REMOVED = {
    **{name: "trainer=TrainerInputs(" + name + "=...)" for name in ("weight_grad", "token_weights", "grad_scale",
                                                                    "remedy")},
    **{name: _CHANGED.format("path=GradientPath(" + name + "=...)")
       for name in ("grads", "block_fraction", "block_bytes", "row_block")},
    "path": _CHANGED.format("path=GradientPath(...)"),
    **{name: _CHANGED.format(name + "=...") for name in ("backend", "linear_backend", "chunk_cols", "return_lse")},
    "logit_scale": _CHANGED.format("logit_transform=LogitTransform(scale=..., cap=...)"),
    "logit_softcap": _CHANGED.format("logit_transform=LogitTransform(scale=..., cap=...)"),
    "loss": "its fields as z_loss_coeff=, label_smoothing=, ignore_index= and " + _CHANGED.format("logit_transform=..."),
    "gradient_accumulation_fusion": "trainer=TrainerInputs(weight_grad=WeightGradTarget(into=..., added=...))",
}
POSITIONAL_HINT = ("weight_grad and token_weights, positional after sequence_parallel before, now go in "
                   "trainer=TrainerInputs(weight_grad=..., token_weights=...)")


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


def _check_count(value, name, default):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be None ({default}) or an int >= 1, got {value!r}")


@dataclass(frozen=True)
class GradientPath:
    """How the fused layer makes its gradients, checked once where its values enter (the op's options,
    the adaptor's settings, the flags).

    Args:
        grads: ``"forward"`` (default, as the flag, ``Settings`` and ``patches.apply()``): the gradients are
            made during the forward, a block of token rows at a time (three GEMMs); it needs the upstream
            gradient's token weights (:class:`TrainerInputs`), and where a call has none it takes the recompute
            path. ``"recompute"``: backward recomputes the logits one vocab chunk at a time (four GEMMs; any
            upstream gradient).
        block_fraction: ``grads="forward"``'s memory/time dial as the share of the tokens one block takes, so
            its working memory is ``block_fraction`` x the logits (0.125 the lean setting):
            ``ceil(1 / block_fraction)`` equal blocks.
        block_bytes: the same dial in bytes: the most one block's logits (then their gradient) take, whatever
            the token count (None and no ``block_fraction``: 4 GiB, ``kernels.chunked_linear.LOGITS_BUDGET_BYTES``);
            logits within it are one block. Either way blocks hold at least 1024 rows (:func:`default_row_block`),
            and each block beyond the first adds one read-modify-write of the fp32 ``dweight`` (8 V h bytes):
            docs/weight_gradient.md.
        row_block: token rows per block set by hand (an int >= 1; None: from ``block_bytes`` / ``block_fraction``).
        names: the caller's name per field for errors (e.g. the flags').
    """

    grads: str = "forward"
    block_fraction: Optional[float] = None
    block_bytes: Optional[int] = None
    row_block: Optional[int] = None
    names: InitVar[Optional[Mapping[str, str]]] = None

    def __post_init__(self, names):
        name = (lambda field: names.get(field, field)) if names else (lambda field: field)
        check_grads(self.grads, name("grads"))
        check_block_fraction(self.block_fraction, name("block_fraction"))
        check_block_bytes(self.block_bytes, name("block_bytes"))
        _check_count(self.row_block, name("row_block"), "from block_bytes / block_fraction")
        if self.block_fraction is not None and self.block_bytes is not None:
            raise ValueError(f"{name('block_fraction')} and {name('block_bytes')} both size the blocks: pass one of them")
        if self.row_block is not None and (self.block_fraction is not None or self.block_bytes is not None):
            other = name("block_fraction") if self.block_fraction is not None else name("block_bytes")
            raise ValueError(f"{name('row_block')} and {other} both set the rows per block: pass one of them")
        if self.block_fraction is not None:
            object.__setattr__(self, "block_fraction", float(self.block_fraction))


RECOMPUTE = GradientPath("recompute")


@dataclass(frozen=True)
class LinearCrossEntropyOptions:
    """How :func:`linear_cross_entropy_zloss` computes, besides the loss's keywords: one frozen value, checked
    once when made (the adaptor makes it from its settings).

    Args:
        logit_transform: the loss is of ``cap * tanh(scale * logits / cap)`` (a
            :class:`~mindspeed_cez.kernels.LogitTransform`), as
            :func:`vocab_parallel_cross_entropy_zloss`'s ``logit_transform``, made inside the projection's
            tiles / chunks, gradients through it. ``IDENTITY`` (default): no transform.
        path: the :class:`GradientPath` (default: ``grads="forward"``, which a call without token weights
            serves by the recompute path).
        backend: the cross-entropy backend, ``"triton"`` / ``"torch"``; ``None`` (default): automatic per
            device, as :func:`vocab_parallel_cross_entropy_zloss`.
        linear_backend: the recompute path's projection, ``"gemm"`` (``torch.matmul`` on vocab chunks) or
            ``"triton"`` (``tl.dot`` kernels, no logits even per chunk); ``None`` (default): GEMMs on CUDA and
            with the torch backend, Triton on other accelerators.
        chunk_cols: vocab rows per chunk of the recompute path (None: 4096, fewer where a chunk's logits would
            pass 2**26, not under 1024 unless a chunk would pass 4 GiB; ``kernels.chunked_linear.default_chunk_cols``).
        return_lse: also return the detached per-token log-sum-exp, as
            :func:`vocab_parallel_cross_entropy_zloss`'s ``return_lse``.
        accumulation: how 16-bit GEMMs are added into fp32 (``dweight`` into its target, ``dhidden``'s sums):
            one of ``linear_forward_grads.KINDS`` (``"addmm_out_dtype"``, ``"npu_matmul_add"``, ``"triton"``,
            ``"gemm_add"``) where this process can run it; ``None`` (default): chosen per device type and torch
            (docs/weight_gradient.md).
    """

    logit_transform: LogitTransform = IDENTITY
    path: GradientPath = GradientPath()
    backend: Optional[str] = None
    linear_backend: Optional[str] = None
    chunk_cols: Optional[int] = None
    return_lse: bool = False
    accumulation: Optional[str] = None

    def __post_init__(self):
        if not isinstance(self.logit_transform, LogitTransform):
            raise TypeError(f"logit_transform must be a mindspeed_cez.kernels.LogitTransform, got "
                            f"{type(self.logit_transform).__name__}")
        if not isinstance(self.path, GradientPath):
            raise TypeError(f"path must be a mindspeed_cez.linear_cross_entropy.GradientPath, got "
                            f"{type(self.path).__name__}")
        if self.backend is not None and self.backend not in kernels.BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; backend must be one of {kernels.BACKENDS} or None "
                             "(automatic)")
        if self.linear_backend is not None and self.linear_backend not in kernels.LINEAR_BACKENDS:
            raise ValueError(f"unknown linear backend {self.linear_backend!r}; linear_backend must be one of "
                             f"{tuple(kernels.LINEAR_BACKENDS)} or None (automatic)")
        _check_count(self.chunk_cols, "chunk_cols", "the default width")
        if not isinstance(self.return_lse, bool):
            raise TypeError(f"return_lse must be True or False, got {self.return_lse!r}")
        check_accumulation(self.accumulation)


DEFAULT_OPTIONS = LinearCrossEntropyOptions()


@dataclass(frozen=True, eq=False)
class TrainerInputs:
    """What the training loop knows in the forward about the backward it will run: under the adaptor the patch
    layer hands it in (Megatron's loss mask, gradient scale, gradient buffer and its flag's name).

    Args:
        token_weights: a tensor of ``target``'s shape (Megatron: the loss mask) weighting the tokens'
            ``dweight`` for ``grads="forward"``: the upstream gradient must be ``k * token_weights`` with one
            scalar ``k`` (checked on the device in backward, without a host sync). None (default): the call
            takes the recompute path. With ``GradientPath("recompute")`` passing them is an error.
        grad_scale: with ``token_weights``: the upstream gradient is ``grad_scale * token_weights`` exactly (a
            float or a one-element tensor; Megatron: its loss scale over the micro-batch's token count and the
            number of micro-batches). Each block's gradient is then made for it: ``dhidden`` as the unfused
            path makes it, ``dweight`` added into ``weight_grad``'s target during the forward (no buffer; the
            forward must be followed by its backward: ``ledger`` records it; under ``torch.no_grad()`` nothing
            is added). Backward checks the gradient on the device.
        weight_grad: a :class:`WeightGradTarget`: add ``dweight`` into ``weight_grad.into`` (fp32, or 16-bit,
            which takes the GEMMs in its dtype) instead of returning it; autograd gets what
            ``weight_grad.added()`` returns for ``weight``. None (default): ``dweight`` through autograd.
        remedy: the fix that errors of ``grads="forward"`` raised after the forward (in backward, or on the
            device, where no caller can re-word them) name; None: ``"GradientPath('recompute')"``. The adaptor
            passes its flag's.
        ledger: a :class:`ForwardGradientLedger`, one per training loop, needed with ``grad_scale`` and
            ``weight_grad``: a forward that adds into the target records there the backward it owes; the op checks
            it at each such forward, the loop with ``ledger.check()`` before it uses the gradients (the adaptor:
            before Megatron's gradient sync).
    """

    token_weights: Optional[torch.Tensor] = None
    grad_scale: Optional[Union[float, torch.Tensor]] = None
    weight_grad: Optional[WeightGradTarget] = None
    remedy: Optional[str] = None
    ledger: Optional[ForwardGradientLedger] = None

    def __post_init__(self):
        if self.weight_grad is not None and not isinstance(self.weight_grad, WeightGradTarget):
            raise TypeError(f"weight_grad must be a mindspeed_cez.linear_cross_entropy.WeightGradTarget or None, "
                            f"got {type(self.weight_grad).__name__}")
        if self.token_weights is not None and not isinstance(self.token_weights, torch.Tensor):
            raise ValueError(f"token_weights must be a tensor of target's shape, got {type(self.token_weights).__name__}")
        if self.grad_scale is not None and self.token_weights is None:
            raise ValueError("grad_scale: the upstream gradient per unit of token_weights: pass token_weights with it "
                             "(the gradients made during the forward), or neither for the recompute path")
        if self.remedy is not None and not isinstance(self.remedy, str):
            raise TypeError(f"remedy must be a str or None, got {self.remedy!r}")
        if self.ledger is not None and not isinstance(self.ledger, ForwardGradientLedger):
            raise TypeError(f"ledger must be a mindspeed_cez.ForwardGradientLedger or None, got "
                            f"{type(self.ledger).__name__}")
        if self.grad_scale is not None and self.weight_grad is not None and self.ledger is None:
            raise ValueError("grad_scale with weight_grad adds the weight gradient into its target during the forward: "
                             "pass ledger=mindspeed_cez.ForwardGradientLedger() (one per training loop; call its "
                             "check() before the gradients are used), so a forward without its backward is found")


NO_TRAINER_INPUTS = TrainerInputs()


def _check_trainer_inputs(trainer, target, path, weight):
    if trainer.weight_grad is not None:
        trainer.weight_grad.check(weight)
    token_weights, grad_scale = trainer.token_weights, trainer.grad_scale
    if token_weights is None:
        return
    if path.grads == "recompute":
        raise ValueError("token_weights (and grad_scale) are the weights of the gradients made during the forward: "
                         "pass them with GradientPath('forward') (the default), or leave them out for "
                         "GradientPath('recompute')")
    if tuple(token_weights.shape) != tuple(target.shape):
        raise ValueError(f"token_weights must be a tensor of target's shape {tuple(target.shape)}, got "
                         f"{tuple(token_weights.shape)}")
    if token_weights.device != target.device:
        raise ValueError(f"token_weights ({token_weights.device}) and target ({target.device}) are on "
                         "different devices")
    _check_grad_scale(grad_scale, target)


@refusing_removed(REMOVED, POSITIONAL_HINT)
def linear_cross_entropy_zloss(hidden, weight, target, z_loss_coeff=0.0, label_smoothing=0.0, ignore_index=-100,
                               tp_group=None, sequence_parallel=False, *, options=DEFAULT_OPTIONS, trainer=None):
    """Fused output projection + cross entropy + z-loss on this rank's vocab rows, no logits tensor.

    Args:
        hidden: ``[s, b, h]`` (or ``[n, h]``), bf16 / fp16 / fp32; with ``sequence_parallel`` this
            rank's ``[s/tp, b, h]`` sequence chunk, as Megatron's output layer receives it.
        weight: ``[v_local, h]``, this rank's rows of the output projection (no bias); same dtype.
        target: ``[s, b]`` (``[n]``) global vocab ids, the whole sequence; may hold ``ignore_index``.
        z_loss_coeff, label_smoothing, ignore_index: as :func:`vocab_parallel_cross_entropy_zloss`.
        tp_group: the tensor-parallel group; ``None``: a single rank (no collective).
        sequence_parallel: hidden is sequence-sharded over ``tp_group`` (all-gathered here).
        options: a :class:`LinearCrossEntropyOptions`: the logit transform, the :class:`GradientPath`
            and its memory dial, the backends, ``return_lse``. Default: no transform, ``grads="forward"``,
            automatic backends, ``(loss, z_loss)`` returned.
        trainer: a :class:`TrainerInputs`: the token weights and gradient scale the forward path makes the
            gradients for, the weight-gradient target, the fix errors name. None (default): none of them.

    The path: ``options.path.grads="forward"`` (the default) with ``trainer.token_weights`` makes the gradients
    during the forward; without token weights (or with ``GradientPath("recompute")``) the call takes the
    recompute path, which serves any upstream gradient. Where no backward will come (``torch.no_grad()``, no
    input needing a gradient) the op takes the recompute path's forward whatever the path says: the loss alone.

    Returns:
        ``(loss, z_loss)``, fp32, shape of ``target``: ``CE + c*lse**2`` per token and the detached
        ``c*lse**2``, 0 where ignored; ``(loss, z_loss, lse)`` with ``options.return_lse``. ``dhidden``
        comes back as ``ColumnParallelLinear`` gives it: this rank's chunk with ``sequence_parallel``,
        else the full gradient on every rank.

    Raises:
        TypeError: for a keyword the op no longer takes (``grads``, ``backend``, ``token_weights``, ...) or
            positional arguments past ``sequence_parallel``, naming what replaced them.
    """
    _check(hidden, weight, target, group_rank_and_size(tp_group)[1], sequence_parallel)
    if not isinstance(options, LinearCrossEntropyOptions):
        raise TypeError(f"options must be a mindspeed_cez.linear_cross_entropy.LinearCrossEntropyOptions, got "
                        f"{type(options).__name__}")
    if trainer is None:
        trainer = NO_TRAINER_INPUTS
    elif not isinstance(trainer, TrainerInputs):
        raise TypeError(f"trainer must be a mindspeed_cez.linear_cross_entropy.TrainerInputs or None, got "
                        f"{type(trainer).__name__}")
    path = options.path
    _check_trainer_inputs(trainer, target, path, weight)
    spec = loss_spec(ignore_index, z_loss_coeff, label_smoothing, options.logit_transform)
    common = dict(spec=spec, tp_group=tp_group, sequence_parallel=bool(sequence_parallel),
                  weight_grad=trainer.weight_grad, backend=kernels.backend_for(hidden.device, options.backend),
                  accumulation=options.accumulation)
    forward = (path.grads == "forward" and trainer.token_weights is not None and torch.is_grad_enabled()
               and (hidden.requires_grad or weight.requires_grad))  # else the loss alone, or any upstream gradient
    if not forward:
        recompute = RecomputeOptions(**common, chunk_cols=options.chunk_cols, linear=kernels.linear_backend_for(
            hidden.device, options.linear_backend, options.backend, options.chunk_cols))
        total, z_loss, lse = LinearCrossEntropyZLoss.apply(hidden, weight, target, recompute)
    else:
        grad_scale = trainer.grad_scale
        if isinstance(grad_scale, torch.Tensor):
            grad_scale = grad_scale.detach().reshape(()).float()
        forward_grads = ForwardGradsOptions(**common, row_block=path.row_block, block_fraction=path.block_fraction,
                                            block_bytes=path.block_bytes, ledger=trainer.ledger,
                                            **({} if trainer.remedy is None else {"remedy": trainer.remedy}))
        total, z_loss, lse = LinearCrossEntropyZLossForwardGrads.apply(
            hidden, weight, target, trainer.token_weights.detach(), grad_scale, forward_grads)
    return (total, z_loss, lse) if options.return_lse else (total, z_loss)
