"""Triton kernels of the fused output projection + cross entropy + z-loss (``tl.dot`` tiles).

One source for NVIDIA and Ascend (``tl.dot`` lowers to wgmma on Hopper, to the cube unit on
Ascend). Neither kernel writes logits: each computes ``[BLOCK_M, BLOCK_N]`` tiles of
``hidden @ weight.T`` in registers (fp32 accumulation over ``h`` in ``BLOCK_K`` steps) and
turns them into what the op needs; with a logit scale or soft cap (``TRANSFORM``, as in
``triton_cross_entropy``) each tile is transformed in registers first, and the gradient tile is
multiplied by the transform's slope. The transform, the online softmax, the partials' stores and
the gradient of a tile are ``triton_cross_entropy``'s shared jit steps, as its kernels use them.

``partials``: the forward. A task is a block of ``BLOCK_M`` token rows and a group of
``GROUP_N`` consecutive vocab tiles; it keeps the online softmax (row max, sum-exp) and the
target term over its tiles and writes the group's lse and target term into an fp32
``[groups, 2, n]`` tensor, which ``merge`` folds into the partials of the vocab slice (the layout
in ``kernels/__init__.py``, as ``triton_cross_entropy.shard_partials`` writes it).

``grad``: the backward, one vocab chunk at a time. A task is one ``[BLOCK_M, BLOCK_N]`` tile:
the logits are recomputed and replaced by their gradient
``g * (softmax * (1 + 2c*lse) - (1-a)*onehot - a/V)``, written in the inputs' dtype into the
chunk's ``[n, chunk]`` buffer, which two GEMMs then turn into ``dhidden`` and ``dweight``.

Both launch a persistent grid (``triton_cross_entropy.num_programs``); program ``p`` takes tasks
``p, p + programs, ...`` in an order that keeps ``SWIZZLE_M`` row blocks on the same vocab
columns, so concurrently running tasks share their ``hidden`` and ``weight`` tiles in cache.
Offsets are int64; nothing reads tensor values on the host (CUDA-graph capturable).
"""

import functools
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from .. import kernels  # this package's interface: the loss, the partials layout, as_rows
from . import torch_reference, triton_cross_entropy
from .triton_cross_entropy import (PARTIAL_ROWS, Launcher, grad_coefficients, grad_tile, load_grad_row_inputs,
                                   load_partials, lse_of, num_programs, softmax_lse, softmax_tile, store_partials,
                                   store_width, target_term, transform_logits, transform_logits_with_slope)

# Tiles per device type: BLOCK_M token rows x BLOCK_N vocab columns, BLOCK_K of h per dot (16-bit
# inputs; fp32 takes a quarter so the pipeline's buffers fit in shared memory), a forward task of
# GROUP_N vocab tiles, SWIZZLE_M row blocks sweeping the same columns, warps, pipeline stages
# (CUDA), programs per core. CUDA: the best of two H100 sweeps (docs/performance.md).
# Ascend: one program per cube core, an fp32 [64, 128] tile (32 KiB) plus
# operands well inside the on-chip buffers.
LAUNCH_CONFIG = {
    "cuda": {"block_m": 128, "block_n": 128, "block_k": 128, "group_n": 16, "swizzle_m": 16, "warps": 8,
             "stages": 3, "per_core": 2},
    "npu": {"block_m": 64, "block_n": 128, "block_k": 64, "group_n": 16, "swizzle_m": 4, "warps": 4,
            "stages": 1, "per_core": 1},
    "cpu": {"block_m": 16, "block_n": 32, "block_k": 16, "group_n": 2, "swizzle_m": 2, "warps": 4,
            "stages": 1, "per_core": 1},  # the interpreter
}
# fp32 inputs: exact fp32 products (torch.matmul's default), not TF32.
DOT_PRECISION = {torch.float32: "ieee", torch.bfloat16: "", torch.float16: ""}


@triton.jit
def _task_tile(task, m_blocks, n_tasks, SWIZZLE_M: tl.constexpr):
    """(row block, column task) of ``task``: SWIZZLE_M row blocks per column task before the next."""
    band = SWIZZLE_M * n_tasks
    first_m = (task // band) * SWIZZLE_M
    rows_in_band = tl.minimum(m_blocks - first_m, SWIZZLE_M)
    return first_m + (task % band) % rows_in_band, (task % band) // rows_in_band


@triton.jit
def _logits_tile(x_ptr, x_row_stride, w_ptr, w_row_stride, rows, cols, n_rows, n_cols, h,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 ``[BLOCK_M, BLOCK_N]`` of ``x[rows] @ w[cols].T`` (0 outside the rows / columns).
    ``PRECISION`` "fp32" (Triton's CPU interpreter, whose dot multiplies bf16's raw bits): the
    operands are widened to fp32 first, the same products (exact in fp32) and accumulation."""
    ks = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + rows[:, None] * x_row_stride + ks[None, :]
    w_tile = w_ptr + cols[None, :] * w_row_stride + ks[:, None]  # [BLOCK_K, BLOCK_N]: w.T
    row_ok = rows[:, None] < n_rows
    col_ok = cols[None, :] < n_cols
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, h, BLOCK_K):
        a = tl.load(x_tile, mask=row_ok & (ks[None, :] < h - k), other=0.0)
        b = tl.load(w_tile, mask=col_ok & (ks[:, None] < h - k), other=0.0)
        if PRECISION == "fp32":
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        elif PRECISION == "ieee":
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:  # 16-bit operands: the dot's only mode (Ascend rejects naming tf32)
            acc = tl.dot(a, b, acc)
        x_tile += BLOCK_K
        w_tile += BLOCK_K
    return acc


@triton.jit
def _partials_kernel(
    x_ptr, x_row_stride,  # [n, h]
    w_ptr, w_row_stride,  # [n_cols, h]: this rank's vocab rows
    target_ptr,  # [n] global ids
    out_ptr,  # fp32 [groups, 2, n]: (LOCAL_LSE, TARGET_TERM) rows per group
    n_rows, n_cols, h, vocab_start, global_vocab, ignore_index,
    target_weight,  # 1 - label_smoothing
    smoothing_per_col,  # label_smoothing / global_vocab
    logit_scale, logit_softcap,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
    SWIZZLE_M: tl.constexpr, WITH_LOGIT_SUM: tl.constexpr, PRECISION: tl.constexpr, TRANSFORM: tl.constexpr,
):
    m_blocks = tl.cdiv(n_rows, BLOCK_M)
    groups = tl.cdiv(n_cols, BLOCK_N * GROUP_N)
    for task in range(tl.program_id(0), m_blocks * groups, tl.num_programs(0)):
        m, group = _task_tile(task, m_blocks, groups, SWIZZLE_M)
        rows = m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        target = tl.load(target_ptr + rows, mask=row_ok, other=ignore_index).to(tl.int64)
        local = target - vocab_start
        row_max = tl.full([BLOCK_M], -float("inf"), tl.float32)
        sum_exp = tl.zeros([BLOCK_M], tl.float32)
        picked = tl.zeros([BLOCK_M], tl.float32)
        logit_sum = tl.zeros([BLOCK_M], tl.float32)
        first_col = group.to(tl.int64) * (BLOCK_N * GROUP_N)
        for j in range(0, GROUP_N):
            cols = first_col + j * BLOCK_N + tl.arange(0, BLOCK_N)
            logits = _logits_tile(x_ptr, x_row_stride, w_ptr, w_row_stride, rows, cols, n_rows, n_cols, h,
                                  BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
            logits = transform_logits(logits, logit_scale, logit_softcap, TRANSFORM,  # columns past the end: masked
                                      x_ptr.dtype.element_ty == tl.float32)
            col_ok = cols[None, :] < n_cols
            row_max, sum_exp = softmax_tile(row_max, sum_exp, tl.where(col_ok, logits, -float("inf")))
            picked += tl.sum(tl.where(cols[None, :] == local[:, None], logits, 0.0), axis=1)
            if WITH_LOGIT_SUM:
                logit_sum += tl.sum(tl.where(col_ok, logits, 0.0), axis=1)
        term = target_term(picked, logit_sum, target, ignore_index, global_vocab, target_weight, smoothing_per_col,
                           WITH_LOGIT_SUM, False)
        out = out_ptr + group.to(tl.int64) * (PARTIAL_ROWS * n_rows) + rows
        store_partials(out, n_rows, 0, lse_of(row_max, sum_exp), term, row_ok)


@triton.jit
def _merge_kernel(groups_ptr, out_ptr, n_rows, n_groups, width_hi, width_lo, BLOCK: tl.constexpr):
    """``[groups, 2, n]`` -> the slice's partials: the log-sum-exp of the groups' lse, their target
    terms summed, the slice's width words (program 0)."""
    store_width(out_ptr, n_rows, width_hi, width_lo)
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < n_rows
    lse_max = tl.full([BLOCK], -float("inf"), tl.float32)
    sum_exp = tl.zeros([BLOCK], tl.float32)  # sum of exp(group lse - lse_max)
    term = tl.zeros([BLOCK], tl.float32)
    part = groups_ptr + rows  # int64 rows: the pointer walks the groups in 64 bits
    for _ in range(0, n_groups):
        g_lse, g_term = load_partials(part, n_rows, 0, mask)
        lse_max, sum_exp = softmax_lse(lse_max, sum_exp, g_lse)
        term += g_term
        part += PARTIAL_ROWS * n_rows
    store_partials(out_ptr, n_rows, rows, lse_of(lse_max, sum_exp), term, mask)


@triton.jit
def _grad_kernel(
    x_ptr, x_row_stride,  # [n, h]
    w_ptr, w_row_stride,  # [n_cols, h]: this chunk's vocab rows
    grad_ptr, grad_row_stride,  # [n, n_cols] in the inputs' dtype
    target_ptr, lse_ptr, grad_loss_ptr, grad_loss_stride,
    n_rows, n_cols, h, vocab_start,  # global id of the chunk's first column
    ignore_index, z_loss_coeff, target_weight, smoothing_per_col, logit_scale, logit_softcap,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWIZZLE_M: tl.constexpr,
    PRECISION: tl.constexpr, TRANSFORM: tl.constexpr,
):
    m_blocks = tl.cdiv(n_rows, BLOCK_M)
    n_blocks = tl.cdiv(n_cols, BLOCK_N)
    for task in range(tl.program_id(0), m_blocks * n_blocks, tl.num_programs(0)):
        m, n = _task_tile(task, m_blocks, n_blocks, SWIZZLE_M)
        rows = m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < n_rows
        target, lse, g = load_grad_row_inputs(target_ptr, lse_ptr, grad_loss_ptr, grad_loss_stride, rows, row_ok,
                                              ignore_index)
        logits = _logits_tile(x_ptr, x_row_stride, w_ptr, w_row_stride, rows, cols, n_rows, n_cols, h,
                              BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        z, slope = transform_logits_with_slope(logits, logit_scale, logit_softcap, TRANSFORM,
                                               x_ptr.dtype.element_ty == tl.float32)
        scale, lse2, smooth, onehot = grad_coefficients(g, lse, z_loss_coeff, target_weight, smoothing_per_col)
        dx = grad_tile(z, slope, cols[None, :], (target - vocab_start)[:, None], scale[:, None], lse2[:, None],
                       smooth[:, None], onehot[:, None], TRANSFORM)
        tl.store(grad_ptr + rows[:, None] * grad_row_stride + cols[None, :], dx.to(grad_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (cols[None, :] < n_cols))


_launch_partials = Launcher(_partials_kernel)
_launch_merge = Launcher(_merge_kernel)
_launch_grad = Launcher(_grad_kernel)
LAUNCHERS = (_launch_partials, _launch_merge, _launch_grad)
MERGE_BLOCK = 1024


def launch_settings(device_type):
    return LAUNCH_CONFIG.get(device_type, LAUNCH_CONFIG["npu"])


@functools.lru_cache(maxsize=256)
def _plan(device, n_rows, n_cols, dtype, kernel, kind):
    """(grid, constexprs by parameter name, options) of the ``"partials"`` or ``"grad"`` kernel with
    ``kind``'s settings; the loss's constexprs come from ``LossSpec.kernel_args``."""
    c = launch_settings(kind)
    tasks = triton.cdiv(n_rows, c["block_m"]) * triton.cdiv(n_cols, c["block_n"] * (c["group_n"] if kernel == "partials"
                                                                                    else 1))
    grid = (num_programs(device, tasks, c["per_core"]),)
    block_k = c["block_k"] // 4 if dtype == torch.float32 else c["block_k"]
    # The CPU interpreter's dot multiplies bf16's raw bits: there bf16 operands are widened to fp32.
    interpreter_widens = kind == "cpu" or (device.type == "cpu" and dtype == torch.bfloat16)
    constexprs = {"BLOCK_M": c["block_m"], "BLOCK_N": c["block_n"], "BLOCK_K": max(16, block_k),
                  "SWIZZLE_M": c["swizzle_m"], "PRECISION": "fp32" if interpreter_widens else DOT_PRECISION[dtype]}
    if kernel == "partials":
        constexprs["GROUP_N"] = c["group_n"]
    options = (("num_warps", c["warps"]),) + ((("num_stages", c["stages"]),) if kind == "cuda" else ())
    return grid, MappingProxyType(constexprs), options


def launch_plans_changed():
    """Forget the plans computed so far; call after changing ``LAUNCH_CONFIG``."""
    _plan.cache_clear()


def groups(n_cols, device_type):
    """How many groups' ``[2, n]`` ``linear_partials`` makes for a slice of ``n_cols`` columns."""
    c = launch_settings(device_type)
    return triton.cdiv(n_cols, c["block_n"] * c["group_n"])


def linear_partials(rows, weight, target, spec, shard):
    """fp32 partials (the layout in ``kernels/__init__.py``) of ``rows @ weight.T``, the vocab slice
    ``shard``, no logits."""
    rows, weight = kernels.as_rows(rows), kernels.as_rows(weight)
    n_rows, h = rows.shape
    n_cols = weight.shape[0]
    out = torch.empty(kernels.partials_numel(n_rows), dtype=torch.float32, device=rows.device)
    if n_rows == 0:
        torch_reference.write_width(out, 0, n_cols)
        return out
    kind = triton_cross_entropy.launch_type(rows.device)
    grid, constexprs, options = _plan(rows.device, n_rows, n_cols, rows.dtype, "partials", kind)
    n_groups = groups(n_cols, kind)
    per_group = torch.empty(n_groups, kernels.PARTIAL_ROWS, n_rows, dtype=torch.float32, device=rows.device)
    args = _launch_partials.bind(
        spec.kernel_args(shard.global_vocab), **constexprs, x_ptr=rows, x_row_stride=rows.stride(0), w_ptr=weight,
        w_row_stride=weight.stride(0), target_ptr=target, out_ptr=per_group, n_rows=n_rows, n_cols=n_cols, h=h,
        vocab_start=shard.vocab_start)
    _launch_partials(grid, args, options)
    width_hi, width_lo = kernels.width_words(n_cols)
    _launch_merge((triton.cdiv(n_rows, MERGE_BLOCK),),
                  _launch_merge.bind(groups_ptr=per_group, out_ptr=out, n_rows=n_rows, n_groups=n_groups,
                                     width_hi=width_hi, width_lo=width_lo, BLOCK=MERGE_BLOCK), ())
    return out


def linear_grad(rows, weight, grad, target, lse, grad_loss, spec, shard):
    """Writes the gradient of ``rows @ weight.T``'s loss (the vocab slice ``shard``) into ``grad``
    ``[n, weight rows]``."""
    rows, weight = kernels.as_rows(rows), kernels.as_rows(weight)
    n_rows, h = rows.shape
    n_cols = weight.shape[0]
    if n_rows == 0:
        return grad
    grid, constexprs, options = _plan(rows.device, n_rows, n_cols, rows.dtype, "grad",
                                      triton_cross_entropy.launch_type(rows.device))
    args = _launch_grad.bind(
        spec.kernel_args(shard.global_vocab), **constexprs, x_ptr=rows, x_row_stride=rows.stride(0), w_ptr=weight,
        w_row_stride=weight.stride(0), grad_ptr=grad, grad_row_stride=grad.stride(0), target_ptr=target, lse_ptr=lse,
        grad_loss_ptr=grad_loss, grad_loss_stride=grad_loss.stride(0), n_rows=n_rows, n_cols=n_cols, h=h,
        vocab_start=shard.vocab_start)
    _launch_grad(grid, args, options)
    return grad


# The kernels above check no target: CUDA's device-side assert comes from the torch reference's check.
check_targets = torch_reference.check_targets
