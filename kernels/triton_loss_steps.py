"""The steps of the loss that every Triton kernel shares, as ``@triton.jit`` helpers (they inline:
a kernel built from them compiles to what it would with the steps written out).

- The logit transform: ``z`` of fp32 logits under the ``TRANSFORM`` constexpr
  (``LogitTransform``'s kinds) and its slope. tanh comes from ``exp2``, and from its
  series near zero (:func:`tanh_and_slope`): ``tl.math.tanh`` does not lower on triton-ascend.
- The online softmax: a running max and a sum of ``exp(z - max)`` per row, rescaled when a tile
  (:func:`softmax_tile`) or another slice's lse (:func:`softmax_lse`) raises the max; exponentials
  are ``exp2`` of log2-scaled values, and a row that is -inf so far rescales by nothing (no
  ``-inf - -inf``).
- The partials (their layout: ``kernels/__init__.py``): a row's target term, the store of lse and target term, the
  slice's width words.
- The finish: (loss, z-loss, lse) rows from lse and target term.
- The gradient ``g * (softmax * (1 + 2c*lse) - (1-a)*onehot - a/V)`` of a tile, times the
  transform's slope.

Module-level values a kernel reads are ``tl.constexpr`` (Triton's compiler refuses other globals).
A helper's arguments are computed before its body, which moves them in the compiled order (and
can change the schedule ptxas picks): a helper takes the raw values a kernel used late (e.g.
:func:`grad_tile` compares the columns itself, :func:`store_loss` the target). ``mask=None``
stores without a mask.
"""

import triton
import triton.language as tl

from .. import kernels  # this package's interface: the loss and the partials layout

LOG2E = tl.constexpr(1.4426950408889634)

# The partials layout and the TRANSFORM constexpr (``kernels/__init__.py``).
LOCAL_LSE = tl.constexpr(kernels.LOCAL_LSE)
TARGET_TERM = tl.constexpr(kernels.TARGET_TERM)
WIDTH = tl.constexpr(kernels.WIDTH)
PARTIAL_ROWS = tl.constexpr(kernels.PARTIAL_ROWS)
NO_TRANSFORM = tl.constexpr(kernels.NO_TRANSFORM)
SCALE = tl.constexpr(kernels.SCALE)
SOFTCAP = tl.constexpr(kernels.SOFTCAP)


# --------------------------------------------------------------------------- the logit transform

# tanh's Taylor series below |u| < TANH_SERIES_BELOW, through u**9 (the next term, 1382/155925 u**11, is
# < 1e-8 of tanh there; stopping at u**7 left 3.6e-7 near 0.25): 1 - e loses u's digits when
# e = exp(-2|u|) nears 1, the series does not.
# The numbers are ``LogitTransform``'s, which the torch reference uses.
TANH_SERIES_BELOW = tl.constexpr(kernels.TANH_SERIES_BELOW)
TANH_C3 = tl.constexpr(kernels.TANH_SERIES[0])
TANH_C5 = tl.constexpr(kernels.TANH_SERIES[1])
TANH_C7 = tl.constexpr(kernels.TANH_SERIES[2])
TANH_C9 = tl.constexpr(kernels.TANH_SERIES[3])


@triton.jit
def tanh_and_slope(u, PRECISE: tl.constexpr):
    """(tanh(u), 1 - tanh(u)**2) from e = exp(-2|u|) in (0, 1]: tanh = sign(u) * (1 - e) / (1 + e)
    and 1 - tanh**2 = 4e / (1 + e)**2. exp2 never overflows, so large |u| give exactly +-1 and 0
    (NaN stays NaN); the slope has no cancellation where tanh nears +-1. Written with exp2 because
    ``tl.math.tanh`` does not lower on triton-ascend (``expm1`` is only in each backend's libdevice). With
    ``PRECISE`` (fp32 logits), below ``TANH_SERIES_BELOW`` tanh is its odd series ``u + u**3 (c3 + u**2 (c5
    + u**2 (c7 + u**2 c9)))`` (five FMAs and a select), within fp32's rounding of tanh where ``1 - e`` would cancel;
    16-bit logits skip it (the cancellation, ~6e-8 absolute, is far below their own rounding, and the
    series costs the memory-bound forward ~18 % on an H100)."""
    e = tl.exp2(tl.abs(u) * (-2.0 * LOG2E))
    r = 1.0 / (1.0 + e)
    t = (1.0 - e) * r
    t = tl.where(u < 0, -t, t)
    if PRECISE:
        u2 = u * u
        series = u + u * u2 * (TANH_C3 + u2 * (TANH_C5 + u2 * (TANH_C7 + u2 * TANH_C9)))
        t = tl.where(tl.abs(u) < TANH_SERIES_BELOW, series, t)
    return t, 4.0 * e * r * r


@triton.jit
def transform_logits(x, logit_scale, logit_softcap, TRANSFORM: tl.constexpr, PRECISE: tl.constexpr):
    """fp32 z of fp32 logits x: ``scale * x`` (SCALE), ``cap * tanh(scale * x / cap)`` (SOFTCAP), x.
    ``PRECISE``: the logits came in fp32 (:func:`tanh_and_slope`)."""
    z = x
    if TRANSFORM == SCALE:
        z = x * logit_scale
    if TRANSFORM == SOFTCAP:
        z = logit_softcap * tanh_and_slope(x * (logit_scale / logit_softcap), PRECISE)[0]
    return z


@triton.jit
def transform_logits_with_slope(x, logit_scale, logit_softcap, TRANSFORM: tl.constexpr, PRECISE: tl.constexpr):
    """(z, dz/dx): the slope is ``scale``, or ``scale * (1 - tanh**2)`` with a cap; 1 for no transform."""
    z = x
    slope = 1.0
    if TRANSFORM == SCALE:
        z = x * logit_scale
        slope = logit_scale
    if TRANSFORM == SOFTCAP:
        t, sech2 = tanh_and_slope(x * (logit_scale / logit_softcap), PRECISE)
        z = logit_softcap * t
        slope = logit_scale * sech2
    return z, slope


# --------------------------------------------------------------------------- the online softmax

@triton.jit
def softmax_tile(run_max, run_sum, z):
    """(max, sum of exp(z - max)) per row of ``z [R, C]`` (axis 1) merged into the running
    ``run_max``, ``run_sum [R]``; -inf entries (padding) add nothing."""
    new_max = tl.maximum(run_max, tl.max(z, axis=1))
    ref = tl.where(new_max == -float("inf"), 0.0, new_max) * LOG2E  # all -inf so far: no rescale
    tile_sum = tl.sum(tl.exp2(z * LOG2E - ref[:, None]), axis=1)
    return new_max, run_sum * tl.exp2(run_max * LOG2E - ref) + tile_sum


@triton.jit
def softmax_lse(run_max, run_sum, lse):
    """The running (max, sum) with one more slice's ``lse`` per row (log-sum-exp of lse values)."""
    new_max = tl.maximum(run_max, lse)
    ref = tl.where(new_max == -float("inf"), 0.0, new_max) * LOG2E  # -inf so far: no rescale
    return new_max, run_sum * tl.exp2(run_max * LOG2E - ref) + tl.exp2(lse * LOG2E - ref)


@triton.jit
def lse_of(run_max, run_sum):
    """A row's log-sum-exp from its running (max, sum); -inf for a row that is -inf throughout."""
    return run_max + tl.log(run_sum)


@triton.jit
def softmax_slots(slot_max, slot_sum):
    """A row's (max, sum) from the running (max, sum) of its slots, ``[SLOTS]`` each (axis 0)."""
    row_max = tl.max(slot_max, axis=0)
    ref = tl.where(row_max == -float("inf"), 0.0, row_max)
    return row_max, tl.sum(slot_sum * tl.exp2((slot_max - ref) * LOG2E), axis=0)


# --------------------------------------------------------------------------- the partials

@triton.jit
def target_term(picked, logit_sum, target, ignore_index, global_vocab, target_weight, smoothing_per_col,
                WITH_LOGIT_SUM: tl.constexpr, CHECK_TARGETS: tl.constexpr):
    """``(1-a)*z[target] + (a/V)*sum(z)`` of a row from its picked z and its sum of z (read only
    WITH_LOGIT_SUM); NaN for a target outside ``[0, global_vocab)`` that is not ``ignore_index``,
    and with CHECK_TARGETS a device-side assert there (a debug compile)."""
    term = target_weight * picked
    if WITH_LOGIT_SUM:
        term += smoothing_per_col * logit_sum
    invalid = (target != ignore_index) & ((target < 0) | (target >= global_vocab))
    if CHECK_TARGETS:
        tl.device_assert(~invalid, "target outside [0, vocab) and not ignore_index")
    return tl.where(invalid, float("nan"), term)


@triton.jit
def store_partials(out_ptr, n_rows, rows, lse, term, mask):
    """Rows ``rows`` of the partials' lse and target-term rows (``n_rows`` each) at ``out_ptr``."""
    tl.store(out_ptr + LOCAL_LSE * n_rows + rows, lse, mask=mask)
    tl.store(out_ptr + TARGET_TERM * n_rows + rows, term, mask=mask)


@triton.jit
def load_partials(ptr, n_rows, rows, mask):
    """(lse, target term) of ``rows`` from partials at ``ptr``; 0 where masked (finite: no NaN)."""
    lse = tl.load(ptr + LOCAL_LSE * n_rows + rows, mask=mask, other=0.0)
    term = tl.load(ptr + TARGET_TERM * n_rows + rows, mask=mask, other=0.0)
    return lse, term


@triton.jit
def load_width(ptr, n_rows):
    """A slice's width words from its partials at ``ptr``."""
    return tl.load(ptr + WIDTH * n_rows), tl.load(ptr + WIDTH * n_rows + 1)


@triton.jit
def store_width(out_ptr, n_rows, width_hi, width_lo):
    """The slice's width words (``kernels.width_words``), by program 0."""
    if tl.program_id(0) == 0:
        tl.store(out_ptr + WIDTH * n_rows, width_hi)
        tl.store(out_ptr + WIDTH * n_rows + 1, width_lo)


# --------------------------------------------------------------------------- the finish

@triton.jit
def store_loss(out_ptr, out_stride, rows, lse, term, z_loss_coeff, target, ignore_index, mask):
    """The (loss, z-loss, lse) rows, ``out_stride`` apart: ``lse - term + c*lse**2`` and
    ``c*lse**2``, both 0 where ``target == ignore_index``."""
    z_loss = z_loss_coeff * lse * lse
    ignored = target == ignore_index
    tl.store(out_ptr + rows, tl.where(ignored, 0.0, lse - term + z_loss), mask=mask)
    tl.store(out_ptr + out_stride + rows, tl.where(ignored, 0.0, z_loss), mask=mask)
    tl.store(out_ptr + 2 * out_stride + rows, lse, mask=mask)


# --------------------------------------------------------------------------- the gradient

@triton.jit
def load_grad_row_inputs(target_ptr, lse_ptr, grad_loss_ptr, grad_loss_stride, rows, live, ignore_index):
    """(target, lse, upstream gradient) of ``rows``; the gradient is 0 for ignored rows and where
    not ``live``."""
    target = tl.load(target_ptr + rows, mask=live, other=ignore_index).to(tl.int64)
    lse = tl.load(lse_ptr + rows, mask=live, other=0.0)
    g = tl.load(grad_loss_ptr + rows * grad_loss_stride, mask=live, other=0.0).to(tl.float32)
    return target, lse, tl.where(target == ignore_index, 0.0, g)


@triton.jit
def grad_coefficients(g, lse, z_loss_coeff, target_weight, smoothing_per_col):
    """Per row: (softmax factor ``g * (1 + 2c*lse)``, ``lse * log2e``, ``g * a/V``, ``g * (1-a)``)."""
    return g * (1.0 + 2.0 * z_loss_coeff * lse), lse * LOG2E, g * smoothing_per_col, g * target_weight


@triton.jit
def grad_tile(z, slope, cols, target_col, scale, lse2, smooth, onehot, TRANSFORM: tl.constexpr):
    """dx of a tile of z: ``softmax * scale - smooth``, ``- onehot`` where ``cols == target_col``, times the slope."""
    dx = tl.exp2(z * LOG2E - lse2) * scale - smooth
    dx = tl.where(cols == target_col, dx - onehot, dx)
    if TRANSFORM != NO_TRANSFORM:
        dx *= slope
    return dx
