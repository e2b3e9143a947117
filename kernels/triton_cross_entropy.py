"""Triton kernels: softmax statistics and loss (forward), the in-place gradient (backward).

One source for NVIDIA (``triton``) and Ascend (``triton-ascend``). The two streaming kernels
launch a persistent grid (``device_cores.num_programs``): program ``p`` takes the contiguous
rows ``[p*rows_per_program, (p+1)*rows_per_program)`` and walks each row's vocab slice in tiles
of ``BLOCK_V`` columns, asking for the next tile (across row ends too) before working on the
current one (on CUDA the many programs sharing an SM hide the rest of the load latency).
Row offsets are int64 (N*V may pass 2**31). Nothing here reads tensor values
on the host, so forward + backward capture in a CUDA graph.

Forward reads the logits once. A tile is viewed as ``[SLOTS, SLOT_WIDTH]``; each slot keeps
its own running max and sum-exp (online softmax), so the tile loop has no cross-thread
reduction: the slots are merged once per row. On CUDA a slot is 16 contiguous values held
by one thread; on Ascend there is one slot per tile (whole-tile vector reductions). The target
logit is a single load issued one row ahead, so no dependent load sits at the end of a row.
With one rank the same kernel finishes the loss; with several it writes this slice's partials
(its lse, target term and width, :mod:`.partials`), which the op all-gathers; one small kernel
then combines every rank's into the loss and checks that the widths agree. On CUDA the forward
also asserts each row's target is in range (a device-side assert, no host sync); elsewhere an
out-of-range target gives a NaN loss.

Backward reads the logits once more and writes the gradient, in place when the caller passes
the logits' own buffer as ``grad``; each row's lse, upstream gradient and target are loaded
one row ahead.

A logit scale or soft cap is a ``TRANSFORM`` constexpr (``LogitTransform.kind``,
:mod:`.logit_transform`; ``NO_TRANSFORM`` compiles to the kernels without one): forward transforms each fp32 tile in registers before the online softmax, the
smoothing sum and the target logit (the soft cap's padding columns put back to -inf); backward
recomputes z from x per element and multiplies by its slope. tanh is ``_tanh_and_slope``, from
exp2 (``tl.math.tanh`` does not lower on triton-ascend).

Launches go through ``triton_launcher.Launcher`` (the compiled kernel reused without Triton's per-call
specialization) with each shape's grid and settings computed once (:mod:`.triton_cross_entropy_plan`).
"""

import torch
import triton
import triton.language as tl

from . import logit_transform, partials, torch_reference
from .device_cores import launch_type
from .loss_spec import VocabShard
from .triton_launcher import Launcher
from .triton_cross_entropy_plan import (ASSERT_OPTIONS, LAUNCH_CONFIG,  # noqa: F401 (LAUNCH_CONFIG.. re-exported)
                                       _plan, launch_plans_changed, launch_settings)

# Rows per program of the small [N] kernel (loss from partials).
VECTOR_BLOCK = 1024

LOG2E = tl.constexpr(1.4426950408889634)

# The partials layout (:mod:`.partials`) and the TRANSFORM constexpr (:mod:`.logit_transform`),
# as constexprs the kernels can use.
LOCAL_LSE = tl.constexpr(partials.LOCAL_LSE)
TARGET_TERM = tl.constexpr(partials.TARGET_TERM)
WIDTH = tl.constexpr(partials.WIDTH)
NO_TRANSFORM = tl.constexpr(logit_transform.NO_TRANSFORM)
SCALE = tl.constexpr(logit_transform.SCALE)
SOFTCAP = tl.constexpr(logit_transform.SOFTCAP)


@triton.jit
def _tanh_and_slope(u):
    """(tanh(u), 1 - tanh(u)**2) from e = exp(-2|u|) in (0, 1]: tanh = sign(u) * (1 - e) / (1 + e)
    and 1 - tanh**2 = 4e / (1 + e)**2. exp2 never overflows, so large |u| give exactly +-1 and 0
    (NaN stays NaN); the slope has no cancellation where tanh nears +-1. Written with exp2 because
    ``tl.math.tanh`` does not lower on triton-ascend."""
    e = tl.exp2(tl.abs(u) * (-2.0 * LOG2E))
    r = 1.0 / (1.0 + e)
    t = (1.0 - e) * r
    return tl.where(u < 0, -t, t), 4.0 * e * r * r


@triton.jit
def _transform(x, logit_scale, logit_softcap, TRANSFORM: tl.constexpr):
    """fp32 z of fp32 logits x: ``scale * x`` (SCALE), ``cap * tanh(scale * x / cap)`` (SOFTCAP), x."""
    z = x
    if TRANSFORM == SCALE:
        z = x * logit_scale
    if TRANSFORM == SOFTCAP:
        z = logit_softcap * _tanh_and_slope(x * (logit_scale / logit_softcap))[0]
    return z


@triton.jit
def _transform_with_slope(x, logit_scale, logit_softcap, TRANSFORM: tl.constexpr):
    """(z, dz/dx): the slope is ``scale``, or ``scale * (1 - tanh**2)`` with a cap; 1 for no transform."""
    z = x
    slope = 1.0
    if TRANSFORM == SCALE:
        z = x * logit_scale
        slope = logit_scale
    if TRANSFORM == SOFTCAP:
        t, sech2 = _tanh_and_slope(x * (logit_scale / logit_softcap))
        z = logit_softcap * t
        slope = logit_scale * sech2
    return z, slope


@triton.jit
def _load_tile(logits_ptr, row_stride, row, col, n_cols, end, offs, other: tl.constexpr, EVICT: tl.constexpr):
    """Columns ``col + offs`` of ``row``: masked past the row's end, all masked when ``row >= end``."""
    limit = tl.where(row < end, n_cols - col, 0)
    return tl.load(logits_ptr + row * row_stride + col + offs, mask=offs < limit, other=other, eviction_policy=EVICT)


@triton.jit
def _load_target(target_ptr, row, end, ignore_index):
    return tl.load(target_ptr + row, mask=row < end, other=ignore_index).to(tl.int64)


@triton.jit
def _load_target_logit(logits_ptr, row_stride, row, end, local, n_cols):
    """x[row, local] when this rank owns column ``local`` of a row before ``end``, else 0."""
    owned = (row < end) & (local >= 0) & (local < n_cols)
    return tl.load(logits_ptr + row * row_stride + local, mask=owned, other=0.0).to(tl.float32)


@triton.jit
def _forward_kernel(
    logits_ptr,
    row_stride,
    target_ptr,
    out_ptr,  # fp32 [3, n_rows] (loss, z-loss, lse) when FINISH, else the partials layout (.partials)
    n_rows,
    n_cols,
    rows_per_program,
    vocab_start,
    global_vocab,
    ignore_index,
    z_loss_coeff,
    target_weight,  # 1 - label_smoothing
    smoothing_per_col,  # label_smoothing / global_vocab
    logit_scale,
    logit_softcap,
    width_hi,  # this slice's width words (partials.width_words), written when not FINISH
    width_lo,
    SLOTS: tl.constexpr,
    SLOT_WIDTH: tl.constexpr,
    FINISH: tl.constexpr,
    WITH_LOGIT_SUM: tl.constexpr,
    CHECK_TARGETS: tl.constexpr,  # a device-side assert (compiled with debug=True)
    EVICT: tl.constexpr,
    TRANSFORM: tl.constexpr,  # the loss of x (NO_TRANSFORM) or of its transform z (SCALE, SOFTCAP)
):
    BLOCK_V: tl.constexpr = SLOTS * SLOT_WIDTH
    offs = tl.arange(0, SLOTS)[:, None] * SLOT_WIDTH + tl.arange(0, SLOT_WIDTH)[None, :]
    first = tl.program_id(0).to(tl.int64) * rows_per_program  # int64 rows: int64 offsets
    end = tl.minimum(first + rows_per_program, n_rows)
    tiles = tl.cdiv(n_cols, BLOCK_V)
    if not FINISH:
        if tl.program_id(0) == 0:
            tl.store(out_ptr + WIDTH * n_rows, width_hi)
            tl.store(out_ptr + WIDTH * n_rows + 1, width_lo)

    x = _load_tile(logits_ptr, row_stride, first, 0, n_cols, end, offs, -float("inf"), EVICT)
    target = _load_target(target_ptr, first, end, ignore_index)
    picked = _load_target_logit(logits_ptr, row_stride, first, end, target - vocab_start, n_cols)
    next_target = _load_target(target_ptr, first + 1, end, ignore_index)
    for row in range(first, end):
        # Issued a row ahead: the next row's target logit and the target of the row after it.
        next_picked = _load_target_logit(logits_ptr, row_stride, row + 1, end, next_target - vocab_start, n_cols)
        after_target = _load_target(target_ptr, row + 2, end, ignore_index)

        slot_max = tl.full([SLOTS], -float("inf"), tl.float32)
        slot_sum = tl.zeros([SLOTS], tl.float32)  # sum of exp(x - slot_max)
        slot_logits = tl.zeros([SLOTS], tl.float32)
        for tile in range(0, tiles):
            col = tile * BLOCK_V
            row_ends = tile == tiles - 1
            x_next = _load_tile(
                logits_ptr, row_stride, tl.where(row_ends, row + 1, row), tl.where(row_ends, 0, col + BLOCK_V),
                n_cols, end, offs, -float("inf"), EVICT,
            )
            xf = _transform(x.to(tl.float32), logit_scale, logit_softcap, TRANSFORM)
            if TRANSFORM == SOFTCAP:  # the padding's -inf became -cap: keep it out of the softmax
                xf = tl.where(offs < n_cols - col, xf, -float("inf"))
            new_max = tl.maximum(slot_max, tl.max(xf, axis=1))
            ref = tl.where(new_max == -float("inf"), 0.0, new_max) * LOG2E  # all -inf so far: no rescale
            tile_sum = tl.sum(tl.exp2(xf * LOG2E - ref[:, None]), axis=1)
            slot_sum = slot_sum * tl.exp2(slot_max * LOG2E - ref) + tile_sum
            slot_max = new_max
            if WITH_LOGIT_SUM:
                slot_logits += tl.sum(tl.where(offs < n_cols - col, xf, 0.0), axis=1)
            x = x_next

        row_max = tl.max(slot_max, axis=0)
        ref = tl.where(row_max == -float("inf"), 0.0, row_max)
        sum_exp = tl.sum(slot_sum * tl.exp2((slot_max - ref) * LOG2E), axis=0)
        # z(0) = 0: a target on another rank still adds nothing
        target_term = target_weight * _transform(picked, logit_scale, logit_softcap, TRANSFORM)
        if WITH_LOGIT_SUM:
            target_term += smoothing_per_col * tl.sum(slot_logits, axis=0)
        invalid = (target != ignore_index) & ((target < 0) | (target >= global_vocab))
        if CHECK_TARGETS:
            tl.device_assert(~invalid, "target outside [0, vocab) and not ignore_index")
        target_term = tl.where(invalid, float("nan"), target_term)
        lse = row_max + tl.log(sum_exp)  # -inf for a slice that is -inf across the row
        if FINISH:
            z_loss = z_loss_coeff * lse * lse
            ignored = target == ignore_index
            tl.store(out_ptr + row, tl.where(ignored, 0.0, lse - target_term + z_loss))
            tl.store(out_ptr + n_rows + row, tl.where(ignored, 0.0, z_loss))
            tl.store(out_ptr + 2 * n_rows + row, lse)
        else:
            tl.store(out_ptr + LOCAL_LSE * n_rows + row, lse)
            tl.store(out_ptr + TARGET_TERM * n_rows + row, target_term)
        target = next_target
        picked = next_picked
        next_target = after_target


@triton.jit
def _loss_from_partials_kernel(partials_ptr, rank_stride, n_ranks, target_ptr, out_ptr, out_stride, n_rows,
                               ignore_index, z_loss_coeff, BLOCK: tl.constexpr, CHECK_WIDTHS: tl.constexpr):
    """(loss, z-loss, lse) rows of ``out`` (row stride ``out_stride``) from ``n_ranks`` ranks' partials
    (``rank_stride`` apart): lse the log-sum-exp of their lse, target terms summed. Widths unequal
    to the first rank's: a NaN loss, and with CHECK_WIDTHS a device-side assert (a debug compile)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < n_rows
    width_hi = tl.load(partials_ptr + WIDTH * n_rows)
    width_lo = tl.load(partials_ptr + WIDTH * n_rows + 1)
    lse_max = tl.full([BLOCK], -float("inf"), tl.float32)
    sum_exp = tl.zeros([BLOCK], tl.float32)  # sum of exp(rank lse - lse_max)
    target_term = tl.zeros([BLOCK], tl.float32)
    unequal = tl.zeros([BLOCK], tl.float32)
    for rank in range(0, n_ranks):
        part = partials_ptr + rank * rank_stride
        local = tl.load(part + LOCAL_LSE * n_rows + rows, mask=mask, other=0.0)  # rows past the end: finite
        new_max = tl.maximum(lse_max, local)
        ref = tl.where(new_max == -float("inf"), 0.0, new_max) * LOG2E  # -inf so far: no rescale
        sum_exp = sum_exp * tl.exp2(lse_max * LOG2E - ref) + tl.exp2(local * LOG2E - ref)
        lse_max = new_max
        target_term += tl.load(part + TARGET_TERM * n_rows + rows, mask=mask, other=0.0)
        words = part + WIDTH * n_rows
        unequal += tl.abs(tl.load(words) - width_hi) + tl.abs(tl.load(words + 1) - width_lo)
    if CHECK_WIDTHS:  # partials.UNEQUAL_WIDTHS
        tl.device_assert(unequal == 0, "vocab shards of unequal width across tensor-parallel ranks: "
                                       "pad the vocab to a multiple of the TP size")
    lse = tl.where(lse_max == -float("inf"), 0.0, lse_max) + tl.log(sum_exp)
    z_loss = z_loss_coeff * lse * lse
    loss = tl.where(unequal == 0, lse - target_term + z_loss, float("nan"))
    ignored = tl.load(target_ptr + rows, mask=mask, other=ignore_index) == ignore_index
    tl.store(out_ptr + rows, tl.where(ignored, 0.0, loss), mask=mask)
    tl.store(out_ptr + out_stride + rows, tl.where(ignored, 0.0, z_loss), mask=mask)
    tl.store(out_ptr + 2 * out_stride + rows, lse, mask=mask)


@triton.jit
def _load_grad_row_inputs(target_ptr, lse_ptr, grad_loss_ptr, grad_loss_stride, row, end, ignore_index):
    """(target, lse, upstream gradient) of a row; the gradient is 0 for ignored rows and past ``end``."""
    live = row < end
    target = _load_target(target_ptr, row, end, ignore_index)
    lse = tl.load(lse_ptr + row, mask=live, other=0.0)
    g = tl.load(grad_loss_ptr + row * grad_loss_stride, mask=live, other=0.0).to(tl.float32)
    return target, lse, tl.where(target == ignore_index, 0.0, g)


@triton.jit
def _grad_kernel(
    logits_ptr,
    logits_row_stride,
    grad_ptr,  # may equal logits_ptr: every element is read before it is written, by one program
    grad_row_stride,
    target_ptr,
    lse_ptr,
    grad_loss_ptr,  # upstream gradient of the per-token loss, any float dtype, row stride grad_loss_stride
    grad_loss_stride,
    n_rows,
    n_cols,
    rows_per_program,
    vocab_start,
    ignore_index,
    z_loss_coeff,
    target_weight,  # 1 - label_smoothing
    smoothing_per_col,  # label_smoothing / global_vocab
    logit_scale,
    logit_softcap,
    BLOCK_V: tl.constexpr,
    EVICT: tl.constexpr,
    TRANSFORM: tl.constexpr,
):
    offs = tl.arange(0, BLOCK_V)
    first = tl.program_id(0).to(tl.int64) * rows_per_program
    end = tl.minimum(first + rows_per_program, n_rows)
    tiles = tl.cdiv(n_cols, BLOCK_V)

    x = _load_tile(logits_ptr, logits_row_stride, first, 0, n_cols, end, offs, 0.0, EVICT)
    target, lse, g = _load_grad_row_inputs(target_ptr, lse_ptr, grad_loss_ptr, grad_loss_stride, first, end, ignore_index)
    for row in range(first, end):
        next_target, next_lse, next_g = _load_grad_row_inputs(
            target_ptr, lse_ptr, grad_loss_ptr, grad_loss_stride, row + 1, end, ignore_index
        )
        # dz = g * (softmax * (1 + 2c*lse) - (1-a)*onehot - a/V), softmax = exp2(z*log2e - lse*log2e);
        # dx = dz * dz/dx (z = x without a transform)
        scale = g * (1.0 + 2.0 * z_loss_coeff * lse)
        lse2 = lse * LOG2E
        smooth = g * smoothing_per_col
        onehot = g * target_weight
        local = target - vocab_start
        grad_row = grad_ptr + row * grad_row_stride
        for tile in range(0, tiles):
            col = tile * BLOCK_V
            row_ends = tile == tiles - 1
            x_next = _load_tile(
                logits_ptr, logits_row_stride, tl.where(row_ends, row + 1, row), tl.where(row_ends, 0, col + BLOCK_V),
                n_cols, end, offs, 0.0, EVICT,
            )
            z, slope = _transform_with_slope(x.to(tl.float32), logit_scale, logit_softcap, TRANSFORM)
            dx = tl.exp2(z * LOG2E - lse2) * scale - smooth
            dx = tl.where(offs == local - col, dx - onehot, dx)
            if TRANSFORM != NO_TRANSFORM:
                dx *= slope
            tl.store(grad_row + col + offs, dx.to(grad_ptr.dtype.element_ty), mask=offs < n_cols - col,
                     eviction_policy=EVICT)
            x = x_next
        target = next_target
        lse = next_lse
        g = next_g


# --------------------------------------------------------------------------- launchers

_launch_forward = Launcher(_forward_kernel)
_launch_grad = Launcher(_grad_kernel)
_launch_loss_from_partials = Launcher(_loss_from_partials_kernel)
LAUNCHERS = (_launch_forward, _launch_grad, _launch_loss_from_partials)


def _forward(logits, target, out, loss, shard, finish):
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        if not finish:
            torch_reference.write_width(out, 0, n_cols)
        return out
    grid, rows_per_program, constexprs, options = _plan(logits.device, n_rows, n_cols, "fwd",
                                                        launch_type(logits.device))
    width_hi, width_lo = partials.width_words(n_cols)
    args = _launch_forward.bind(
        loss.kernel_args(shard.global_vocab), **constexprs, logits_ptr=logits, row_stride=logits.stride(0),
        target_ptr=target, out_ptr=out, n_rows=n_rows, n_cols=n_cols, rows_per_program=rows_per_program,
        vocab_start=shard.vocab_start, width_hi=width_hi, width_lo=width_lo, FINISH=finish)
    _launch_forward(grid, args, options)
    return out


def fused_loss(logits, target, loss):
    """One rank holds the whole vocab: fp32 [3, n] rows (loss, z-loss, lse) in one pass, of the loss
    ``loss`` (a :class:`.loss_spec.LossSpec`)."""
    out = torch.empty(3, logits.shape[0], dtype=torch.float32, device=logits.device)
    return _forward(logits, target, out, loss, VocabShard.whole(logits.shape[1]), True)


def shard_partials(logits, target, loss, shard):
    """fp32 ``[partials_numel(n)]``, the layout of :mod:`.partials`, of the logits of ``shard``."""
    out = torch.empty(partials.partials_numel(logits.shape[0]), dtype=torch.float32, device=logits.device)
    return _forward(logits, target, out, loss, shard, False)


def loss_from_partials(gathered, target, loss, out=None):
    """fp32 ``[3, n]`` (loss, z-loss, lse), into ``out`` when given (unit column stride), from
    ``[ranks, numel]`` partials; on CUDA several ranks' widths are asserted equal on the device."""
    ranks, n_rows = gathered.shape[0], partials.rows_of(gathered.shape[1])
    if out is None:
        out = torch.empty(3, n_rows, dtype=torch.float32, device=gathered.device)
    if n_rows or ranks > 1:  # no tokens: the widths are still checked
        check = ranks > 1 and launch_type(gathered.device) == "cuda"
        args = _launch_loss_from_partials.bind(
            ignore_index=loss.ignore_index, z_loss_coeff=loss.z_loss_coeff, partials_ptr=gathered,
            rank_stride=gathered.stride(0), n_ranks=ranks, target_ptr=target, out_ptr=out, out_stride=out.stride(0),
            n_rows=n_rows, BLOCK=VECTOR_BLOCK, CHECK_WIDTHS=check)
        _launch_loss_from_partials((max(1, triton.cdiv(n_rows, VECTOR_BLOCK)),), args, ASSERT_OPTIONS if check else ())
    return out


def write_grad(logits, grad, target, lse, grad_loss, loss, shard):
    """Writes the gradient of the loss of ``logits`` (the slice ``shard``) into ``grad`` (may be ``logits``)."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return grad
    grid, rows_per_program, constexprs, options = _plan(logits.device, n_rows, n_cols, "bwd",
                                                        launch_type(logits.device))
    args = _launch_grad.bind(
        loss.kernel_args(shard.global_vocab), **constexprs, logits_ptr=logits, logits_row_stride=logits.stride(0),
        grad_ptr=grad, grad_row_stride=grad.stride(0), target_ptr=target, lse_ptr=lse, grad_loss_ptr=grad_loss,
        grad_loss_stride=grad_loss.stride(0), n_rows=n_rows, n_cols=n_cols, rows_per_program=rows_per_program,
        vocab_start=shard.vocab_start)
    _launch_grad(grid, args, options)
    return grad


def check_targets(target, loss, shard):
    """Nothing to launch: on CUDA the forward kernel asserts on out-of-range targets (no host
    sync); other accelerators get the NaN loss the forward kernel writes for such a target."""
