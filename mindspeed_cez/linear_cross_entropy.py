"""Output projection + vocab-parallel cross entropy + z-loss, without the logits tensor.

``loss = CE(hidden @ weight.T) + c * lse**2`` per token, for the per-row partials of
``vocab_parallel_cross_entropy_zloss`` (merged across ranks by :mod:`mindspeed_cez.tensor_parallel`),
of the logits scaled and soft-capped as that op's ``logit_scale`` / ``logit_softcap`` say (by the
backends, per tile or chunk). Two paths:

- recompute (``LinearCrossEntropyZLoss``): the forward reduces the logits to the partials as
  they are made (Triton: ``tl.dot`` tiles in registers, kernels/triton_linear_cross_entropy.py;
  torch: GEMMs on chunks of the vocab); backward recomputes them one vocab chunk at a time into
  their gradient (a ``[tokens, chunk]`` buffer), then one GEMM adds that chunk's share into an
  fp32 ``dhidden`` and one writes its rows of ``dweight``: four GEMMs in all.
- gradients in forward (``LinearCrossEntropyZLossForwardGrads``, ``grads="forward"``): blocks
  of token rows with the whole vocab slice, three GEMMs; with ``grad_scale`` (the upstream
  gradient known in forward, Megatron's) ``dweight`` goes into ``main_grad`` during the forward,
  else an fp32 ``dweight`` is kept until backward.

docs/fused_linear_cross_entropy.md compares them with measurements.

Tensor parallelism as Megatron's ``ColumnParallelLinear`` feeding the loss: each rank holds the
vocab rows ``weight [v_local, h]``; with ``sequence_parallel`` the hidden states arrive as this
rank's sequence chunk, are all-gathered along the sequence in forward, and ``dhidden`` is
reduce-scattered back; without it every rank holds all of ``hidden`` and ``dhidden`` is all-reduced.
Either collective starts once ``dhidden`` is complete and runs beside the last weight-gradient GEMM,
as ``ColumnParallelLinear`` overlaps it.
"""

import math
import weakref
from dataclasses import dataclass
from types import ModuleType
from typing import Optional

import torch

from mindspeed_cez import kernels
from mindspeed_cez.first_order import first_order_only
from mindspeed_cez.fp32_accumulation import Accumulator
from mindspeed_cez.kernels import chunked_linear
from mindspeed_cez.cross_entropy_zloss import (CrossEntropyOptions, _check_target_range, check_coefficients,
                                               check_ignore_index, check_target)
from mindspeed_cez.kernels.logit_transform import transform_of
from mindspeed_cez.tensor_parallel import (gather_sequence, group_rank_and_size, merged_loss, reduce_dhidden,
                                           resolve_tp_group, start_reduce_dhidden)


def _check(hidden, weight, target, z_loss_coeff, label_smoothing, ignore_index, tp_size, sequence_parallel):
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
    check_coefficients(z_loss_coeff, label_smoothing)
    check_ignore_index(ignore_index)


def _check_targets(target, global_vocab, ignore_index):
    """CPU: a Python exception; CUDA: an asynchronous device-side assert (the linear kernels do not
    assert themselves); elsewhere an out-of-range target gives a NaN loss."""
    _check_target_range(target, global_vocab, ignore_index, kernels.torch_reference)


def _rows(hidden):
    """``[..., h]`` -> ``[n, h]`` with unit column stride (the kernels' layout)."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _main_grad_placeholder(weight):
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


@dataclass(frozen=True, eq=False)
class RecomputeOptions(LinearLossOptions):
    """:class:`LinearCrossEntropyZLoss`'s options: the projection's backend and its vocab chunk."""

    linear: Optional[ModuleType] = None  # kernels.linear_backend_for's module
    chunk_cols: Optional[int] = None


@dataclass(frozen=True, eq=False)
class ForwardGradsOptions(LinearLossOptions):
    """:class:`LinearCrossEntropyZLossForwardGrads`'s options: the token rows per block."""

    row_block: Optional[int] = None
    block_fraction: Optional[float] = None


class LinearCrossEntropyZLoss(torch.autograd.Function):
    """``(loss, z_loss, lse)`` of ``hidden @ weight.T`` without the logits; backward recomputes
    them one vocab chunk at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, target, options):
        rank, tp_size = group_rank_and_size(options.tp_group)
        full = gather_sequence(hidden, options.tp_group, tp_size, options.sequence_parallel)
        rows = _rows(full)
        flat_target = target.reshape(-1)
        v_local = weight.shape[0]
        global_vocab, vocab_start = v_local * tp_size, rank * v_local
        stats = options.linear.linear_partials(rows, weight, flat_target, vocab_start, global_vocab, options.ignore_index,
                                         options.label_smoothing, ce_backend=options.backend, chunk_cols=options.chunk_cols,
                                         transform=options.transform)
        out = merged_loss(options.backend, stats, flat_target, options.ignore_index, options.z_loss_coeff, options.tp_group,
                          tp_size, shard_name="weight")
        _check_targets(flat_target, global_vocab, options.ignore_index)  # after the collective: see the op's forward
        loss, z_loss, lse = out.view(3, *target.shape).unbind(0)

        ctx.save_for_backward(hidden, weight, flat_target, lse)
        ctx.options, ctx.tp_size, ctx.vocab_start, ctx.global_vocab = options, tp_size, vocab_start, global_vocab
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(z_loss, lse)
        return loss, z_loss, lse

    @staticmethod
    @first_order_only("linear_cross_entropy_zloss")
    def backward(ctx, grad_loss, _grad_z_loss, _grad_lse):
        hidden, weight, flat_target, lse = ctx.saved_tensors
        options, tp_size = ctx.options, ctx.tp_size
        full = gather_sequence(hidden, options.tp_group, tp_size, options.sequence_parallel)
        rows = _rows(full)
        lse = lse.reshape(-1)
        grad_loss = torch.zeros_like(lse) if grad_loss is None else grad_loss.reshape(-1)
        into_main_grad = options.gradient_accumulation_fusion and hasattr(weight, "main_grad")
        dweight = None if into_main_grad else torch.empty_like(weight)
        drows = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
        n, v_local = rows.shape[0], weight.shape[0]
        step = chunked_linear.chunk_width(options.chunk_cols, n, v_local)
        chunk = rows.new_empty((rows.shape[0], step))
        accumulate = Accumulator(rows.device)
        for c in range(0, weight.shape[0], step):
            w = weight[c:c + step]
            dlogits = options.linear.linear_grad(rows, w, chunk[:, :w.shape[0]], flat_target, lse, grad_loss, options.ignore_index,
                                           ctx.vocab_start + c, options.z_loss_coeff, options.label_smoothing, ctx.global_vocab,
                                           ce_backend=options.backend, transform=options.transform)
            accumulate(drows, dlogits, w)  # fp32 sum over vocab chunks
            if c + step >= v_local:  # dhidden complete: its collective overlaps the last weight-gradient GEMM
                reduction = start_reduce_dhidden(drows.to(rows.dtype).view(full.shape), options.tp_group, tp_size,
                                                 options.sequence_parallel)
            if into_main_grad:
                accumulate(weight.main_grad[c:c + step], dlogits.t(), rows)
            else:
                torch.matmul(dlogits.t(), rows, out=dweight[c:c + step])
        dhidden = reduction.wait()
        if into_main_grad:
            dweight = _main_grad_placeholder(weight)
        return dhidden, dweight, None, None


RECOMPUTE_FIX = "grads='recompute'"


class ForwardGradientError(RuntimeError):
    """A weight gradient added into ``main_grad`` during a forward whose backward never came."""


class _OwedBackward:
    """Made by a forward that added ``weight``'s gradient into ``main_grad``; its backward marks it
    paid. Held by the autograd graph only: freed unpaid means the graph went without a backward."""

    __slots__ = ("what", "paid", "__weakref__")

    def __init__(self, what):
        self.what, self.paid = what, False
        _OWED.add(self)

    def __del__(self):
        if not self.paid:
            _DROPPED.append(self.what)


_OWED = weakref.WeakSet()  # forwards whose graph is alive and backward not yet run
_DROPPED = []  # forwards whose graph was freed without a backward


def check_forward_gradients(backward_pending_ok=False):
    """Raise :class:`ForwardGradientError` where a forward of ``grads="forward"`` added a weight
    gradient into ``main_grad`` whose backward never came: its graph freed without one (an extra
    forward with autograd on, output discarded), or, unless ``backward_pending_ok``, not run yet.
    Called by the op's forwards (pending backwards are fine there: pipelined micro-batches) and by
    the adaptor before Megatron's gradient sync (``finish_grad_sync``), so such a gradient never
    reaches the optimizer. No device work."""
    dropped, pending = list(_DROPPED), [] if backward_pending_ok else [t.what for t in _OWED if not t.paid]
    _DROPPED.clear()
    if dropped:
        raise ForwardGradientError(
            f"linear_cross_entropy_zloss(grads='forward') added the weight gradient of {dropped[0]} into main_grad "
            f"during a forward ({len(dropped)} such forward(s)) whose output was freed without a backward: main_grad "
            "now holds a gradient no loss asked for. An extra forward with autograd on (e.g. a metric computed in "
            "training mode) must run under torch.no_grad(); or run with " + RECOMPUTE_FIX + ", which adds nothing "
            "in forward.")
    if pending:
        for token in list(_OWED):
            token.paid = True  # reported once
        raise ForwardGradientError(
            f"linear_cross_entropy_zloss(grads='forward') added the weight gradient of {pending[0]} into main_grad "
            f"during a forward whose backward has not run ({len(pending)} such forward(s)) before the gradients are "
            "used (Megatron's gradient sync): every training forward of the loss needs its backward. Run other "
            "forwards under torch.no_grad(), or run with " + RECOMPUTE_FIX + ".")


ROW_BLOCK_MIN = 1024
BLOCK_FRACTION = 0.5  # the default: a block's logits are half the logits
LEAN_BLOCK_FRACTION = 0.125  # the lean setting: an eighth


def default_row_block(n_rows, v_local, block_fraction=None):
    """Token rows per block of the gradients-in-forward path: ``block_fraction`` of the tokens
    (None: ``BLOCK_FRACTION``, 1/2), rounded down to a power of two, at least ``ROW_BLOCK_MIN``
    (1024: GEMMs of fewer rows lose speed) and at most the tokens. A block's logits (then their
    gradient) are the path's working memory: ``block_fraction`` x the logits. Each block reads and
    writes the fp32 ``dweight`` once, ``8 V h`` bytes beside ``6 rows V h`` FLOPs of GEMMs: ~30 % of
    an H100's GEMM time at 1024 rows, ~8 % at 4096, ~4 % at 8192 (docs/weight_gradient.md)."""
    fraction = BLOCK_FRACTION if block_fraction is None else block_fraction
    rows = max(int(n_rows * fraction), 1)
    return max(1, min(n_rows, max(ROW_BLOCK_MIN, 1 << (rows.bit_length() - 1))))  # 1 for 0 tokens: no blocks


class LinearCrossEntropyZLossForwardGrads(torch.autograd.Function):
    """Gradients made during the forward, three GEMMs in all (no recomputation): blocks of token
    rows with their whole vocab slice, each turned into its gradient in place.

    With ``grad_scale`` the upstream gradient is known in forward: ``grad_scale * token_weights``
    (Megatron's loss scale over its token count); each block's gradient is made for it, ``dhidden``
    in the input's dtype exactly as the unfused path makes it (its reduction over the TP ranks
    started in forward, overlapped with the last block's weight-gradient GEMM as
    ``ColumnParallelLinear`` overlaps it; backward waits for it), and ``dweight`` added straight into
    ``weight.main_grad`` (``gradient_accumulation_fusion``; else an fp32 buffer until backward).
    Backward checks on the device that the gradient that came is that one.

    Without it, the upstream gradient must be ``k * token_weights`` with one unknown scalar ``k``:
    blocks are made for a unit gradient, ``dhidden`` kept in fp32 and scaled per token in backward,
    ``dweight`` summed in fp32 with ``token_weights`` and scaled by
    ``k = sum(g*w) / sum(w*w)`` in backward.

    Either way anything else trips a device-side assert in backward (no host sync), never a silent
    number; and a forward that adds into ``main_grad`` must be followed by its backward (checked:
    :func:`check_forward_gradients`). Under ``torch.no_grad()`` the op takes the recompute path's
    forward instead: the loss alone, nothing into ``main_grad``."""

    @staticmethod
    def forward(ctx, hidden, weight, target, token_weights, grad_scale, options):
        ignore_index, backend, transform = options.ignore_index, options.backend, options.transform
        z_loss_coeff, label_smoothing = options.z_loss_coeff, options.label_smoothing
        tp_group, sequence_parallel = options.tp_group, options.sequence_parallel
        rank, tp_size = group_rank_and_size(tp_group)
        full = gather_sequence(hidden, tp_group, tp_size, sequence_parallel)
        rows = full.reshape(-1, full.shape[-1])
        flat_target = target.reshape(-1)
        weights = torch.where(flat_target == ignore_index, 0.0, token_weights.reshape(-1).float())
        n, v_local = rows.shape[0], weight.shape[0]
        global_vocab, vocab_start = v_local * tp_size, rank * v_local
        upstream_known = grad_scale is not None  # the upstream gradient is grad_scale * weights
        upstream = weights * grad_scale if upstream_known else torch.ones(n, dtype=torch.float32, device=rows.device)
        into_main_grad = upstream_known and options.gradient_accumulation_fusion and hasattr(weight, "main_grad")
        check_forward_gradients(backward_pending_ok=True)
        out = torch.empty((3, n), dtype=torch.float32, device=rows.device)
        drows = torch.empty(rows.shape, dtype=rows.dtype if upstream_known else torch.float32, device=rows.device)
        dweight = weight.main_grad if into_main_grad else torch.zeros(weight.shape, dtype=torch.float32,
                                                                      device=rows.device)
        step = options.row_block or default_row_block(n, v_local, options.block_fraction)
        block = rows.new_empty((min(step, n), v_local))  # one block's logits, then their gradient
        accumulate = Accumulator(rows.device)
        reduction = None  # dhidden's collective, started in forward where the upstream gradient is known
        for r in range(0, n, step):
            x, t = rows[r:r + step], flat_target[r:r + step]
            logits = block[:x.shape[0]]
            torch.matmul(x, weight.t(), out=logits)
            stats = backend.shard_partials(logits, t, vocab_start, global_vocab, ignore_index, label_smoothing,
                                           transform=transform)
            merged_loss(backend, stats, t, ignore_index, z_loss_coeff, tp_group, tp_size, "weight", out[:, r:r + step])
            if r == 0:  # after the first collective (see the op's forward), before anything is written
                _check_target_range(flat_target, global_vocab, ignore_index, backend)
            backend.write_grad(logits, logits, t, out[2, r:r + step], upstream[r:r + step], ignore_index, vocab_start,
                               z_loss_coeff, label_smoothing, global_vocab, transform=transform)
            if upstream_known:  # the unfused path's dhidden: dlogits @ W in the input's dtype
                torch.matmul(logits, weight, out=drows[r:r + step])
                if r + step >= n:  # dhidden complete: its collective overlaps the last weight-gradient GEMM
                    reduction = start_reduce_dhidden(drows.view(full.shape), tp_group, tp_size, sequence_parallel)
                accumulate(dweight, logits.t(), x)
            else:
                drows[r:r + step] = 0
                accumulate(drows[r:r + step], logits, weight)
                accumulate(dweight, logits.t(), x * weights[r:r + step, None].to(x.dtype))
        loss, z_loss, lse = out.view(3, *target.shape).unbind(0)
        ctx.save_for_backward(None if reduction is not None else drows, None if into_main_grad else dweight, weights, upstream,
                              weight, flat_target != ignore_index)
        ctx.reduction = reduction  # holds this rank's dhidden (its sequence chunk with SP), not all of drows
        ctx.options, ctx.tp_size, ctx.upstream_known, ctx.into_main_grad = options, tp_size, upstream_known, into_main_grad
        ctx.full_shape, ctx.input_dtype = full.shape, hidden.dtype
        ctx.owed = _OwedBackward(f"weight {tuple(weight.shape)}") if into_main_grad else None
        ctx.backward_done = False
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(z_loss, lse)
        return loss, z_loss, lse

    @staticmethod
    @first_order_only("linear_cross_entropy_zloss")
    def backward(ctx, grad_loss, _grad_z_loss, _grad_lse):
        if ctx.backward_done:
            raise RuntimeError(
                "linear_cross_entropy_zloss(grads='forward') made its gradients during the forward for one backward: "
                "a second backward through the same graph (retain_graph=True) is not served; run the forward again, "
                "or use " + RECOMPUTE_FIX)
        ctx.backward_done = True
        if ctx.owed is not None:
            ctx.owed.paid = True
            if grad_loss is None:
                raise ForwardGradientError(
                    "linear_cross_entropy_zloss(grads='forward'): the loss got no gradient, but its forward added the "
                    "weight gradient into main_grad for grad_scale * token_weights: backpropagate the loss, or run "
                    "with " + RECOMPUTE_FIX + ".")
        no_grads = (None,) * 4  # target, token_weights, grad_scale, options
        if grad_loss is None:
            return None, None, *no_grads
        drows, dweight_sum, weights, upstream, weight, counted = ctx.saved_tensors
        options = ctx.options
        g = grad_loss.reshape(-1).float()
        if ctx.upstream_known:
            expected = upstream
            message = ("linear_cross_entropy_zloss(grad_scale=s): the upstream gradient must be s * token_weights "
                       "as the forward assumed; the loss was weighted otherwise. For custom loss weighting run with "
                       + RECOMPUTE_FIX)
        else:
            k = (g * weights).sum() / (weights * weights).sum().clamp_min(torch.finfo(torch.float32).tiny)
            expected = k * weights
            message = ("linear_cross_entropy_zloss(token_weights=w): the upstream gradient must be k * w (one "
                       "scalar k) as the forward assumed; the loss was weighted otherwise. For custom loss weighting "
                       "run with " + RECOMPUTE_FIX)
        matches = ((g - expected).abs() <= 1e-3 * expected.abs() + 1e-30) | ~counted  # ignored: any g
        # (CUDA takes assert messages under 255 characters: tests/test_linear_cross_entropy.py checks)
        torch._assert_async(matches.all(), message)
        if ctx.reduction is not None:
            dhidden = ctx.reduction.wait()
        else:
            if not ctx.upstream_known:
                drows = drows * g[:, None]
            drows = drows.to(ctx.input_dtype).view(ctx.full_shape)
            dhidden = reduce_dhidden(drows, options.tp_group, ctx.tp_size, options.sequence_parallel)
        if ctx.into_main_grad:
            return dhidden, _main_grad_placeholder(weight), *no_grads
        if not ctx.upstream_known:
            dweight_sum.mul_(k)
        if options.gradient_accumulation_fusion and hasattr(weight, "main_grad"):
            weight.main_grad.add_(dweight_sum)
            dweight = _main_grad_placeholder(weight)
        else:
            dweight = dweight_sum.to(weight.dtype)
        return dhidden, dweight, *no_grads


GRADS = ("recompute", "forward")


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
        raise ValueError(f"{name} takes the share of the tokens (and of the logits' memory) one block takes, None "
                         f"(the default, {BLOCK_FRACTION}) or a number in (0, 1] ({LEAN_BLOCK_FRACTION}: lean), "
                         f"got {value!r}")


def check_grads(value, name="grads"):
    """The one check of the path's name (the op's ``grads``, the adaptor's settings, the flag: ``name``)."""
    if value not in GRADS:
        raise ValueError(f"{name} must be one of {GRADS}, got {value!r}")


def _check_settings(target, token_weights, grad_scale, grads, chunk_cols, row_block, block_fraction=None):
    check_grads(grads)
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
    check_block_fraction(block_fraction)
    if block_fraction is not None and row_block is not None:
        raise ValueError("row_block and block_fraction both set the rows per block: pass one of them")
    for name, value in (("chunk_cols", chunk_cols), ("row_block", row_block)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be None (the default width) or an int >= 1, got {value!r}")


def linear_cross_entropy_zloss(hidden, weight, target, z_loss_coeff=0.0, label_smoothing=0.0, ignore_index=-100,
                               tp_group=None, sequence_parallel=False, gradient_accumulation_fusion=False,
                               token_weights=None, *, grad_scale=None, logit_scale=1.0, logit_softcap=0.0,
                               grads="recompute", backend=None, linear_backend=None, chunk_cols=None, row_block=None,
                               block_fraction=None, return_lse=False):
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
        tp_group: the tensor-parallel group; ``None`` takes Megatron's when initialized.
        sequence_parallel: hidden is sequence-sharded over ``tp_group`` (all-gathered here).
        gradient_accumulation_fusion: add ``dweight`` (fp32) into ``weight.main_grad`` as Megatron's
            linear layers do; the gradient returned for ``weight`` is then Megatron's placeholder
            (a dummy where ``weight.grad_added_to_main_grad`` exists, else None). A 16-bit
            ``main_grad`` takes the GEMMs in its dtype, as Megatron's own accumulation does.
        token_weights: with ``grads="forward"`` only (required there): a tensor of ``target``'s shape
            (Megatron: the loss mask) weighting the tokens' ``dweight``; the upstream gradient must be
            ``k * token_weights`` with one scalar ``k`` (checked on the device in backward, without a
            host sync). With ``grads="recompute"`` passing them is an error.
        grad_scale: with ``grads="forward"``: the upstream gradient is ``grad_scale * token_weights``
            exactly (a float or a one-element tensor; Megatron: its loss scale over the micro-batch's
            token count and the number of micro-batches). Each block's gradient is then made for it:
            ``dhidden`` as the unfused path makes it, ``dweight`` added into ``weight.main_grad`` during
            the forward with ``gradient_accumulation_fusion`` (no buffer; the forward must be followed by
            its backward: :func:`check_forward_gradients` raises otherwise; under ``torch.no_grad()``
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
            logits would pass 2**26, never under 1024; ``kernels.chunked_linear.default_chunk_cols``).
        row_block: token rows per block of ``grads="forward"`` (None: from ``block_fraction``).
        block_fraction: the memory/time dial of ``grads="forward"``: the share of the tokens one block
            takes, so its working memory is ``block_fraction`` x the logits (None: 0.5; 0.125 the lean
            setting); rounded down to a power of two of rows, at least 1024 (:func:`default_row_block`).
            Fewer blocks, fewer read-modify-writes of the fp32 ``dweight``: docs/weight_gradient.md.
        return_lse: also return the detached per-token log-sum-exp, as
            :func:`vocab_parallel_cross_entropy_zloss`.

    Returns:
        ``(loss, z_loss)``, fp32, shape of ``target``: ``CE + c*lse**2`` per token and the detached
        ``c*lse**2``, 0 where ignored; ``(loss, z_loss, lse)`` with ``return_lse=True``. ``dhidden``
        comes back as ``ColumnParallelLinear`` gives it: this rank's chunk with ``sequence_parallel``,
        else the full gradient on every rank.
    """
    tp_group = resolve_tp_group(tp_group)
    _check(hidden, weight, target, z_loss_coeff, label_smoothing, ignore_index, group_rank_and_size(tp_group)[1],
           sequence_parallel)
    _check_settings(target, token_weights, grad_scale, grads, chunk_cols, row_block, block_fraction)
    common = dict(z_loss_coeff=float(z_loss_coeff), label_smoothing=float(label_smoothing), ignore_index=int(ignore_index),
                  tp_group=tp_group, sequence_parallel=bool(sequence_parallel),
                  gradient_accumulation_fusion=bool(gradient_accumulation_fusion),
                  backend=kernels.backend_for(hidden.device, backend),
                  transform=transform_of(logit_scale, logit_softcap))
    if grads == "forward" and not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        grads = "recompute"  # no backward will come (torch.no_grad(), no input needing it): the loss alone
    if grads == "recompute":
        options = RecomputeOptions(**common, linear=kernels.linear_backend_for(hidden.device, linear_backend, backend),
                                   chunk_cols=chunk_cols)
        loss, z_loss, lse = LinearCrossEntropyZLoss.apply(hidden, weight, target, options)
    else:
        if isinstance(grad_scale, torch.Tensor):
            grad_scale = grad_scale.detach().reshape(()).float()
        options = ForwardGradsOptions(**common, row_block=row_block, block_fraction=block_fraction)
        loss, z_loss, lse = LinearCrossEntropyZLossForwardGrads.apply(hidden, weight, target, token_weights.detach(),
                                                                      grad_scale, options)
    return (loss, z_loss, lse) if return_lse else (loss, z_loss)
