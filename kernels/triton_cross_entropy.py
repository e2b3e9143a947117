"""Triton kernels: per-shard softmax partials (forward) and the in-place gradient (backward).

One source for NVIDIA (``triton``) and Ascend (``triton-ascend``). Both kernels launch a
persistent grid (``device_cores.num_programs``): program ``p`` takes the contiguous rows
``[p*rows_per_program, (p+1)*rows_per_program)`` and walks each row's vocab slice in
``BLOCK_V`` columns, so a block's working set is a few ``BLOCK_V`` vectors (<= 64 KiB in fp32,
inside Ascend's ~192 KiB unified buffer). Row offsets are int64 (N*V may pass 2**31). Nothing
here reads tensor values on the host, so forward + backward capture in a CUDA graph.

Forward reads the logits once (online softmax: running max, sum-exp rescaled when the max
grows). Backward reads them once more and writes the gradient, in place when the caller
passes the logits' own buffer as ``grad``. Each program walks its rows as one stream of
(row, column-block) tiles and loads the next tile before working on the current one, so the
start of a row does not stall the memory pipe.
"""

import torch
import triton
import triton.language as tl

from .device_cores import num_programs

# Columns per block and warps per program, by device type. On Ascend a block's working set
# (the current and the prefetched bf16 tile plus a few fp32 temporaries of BLOCK_V) must stay
# well inside the ~192 KiB unified buffer: 4096 columns use about 64 KiB. CUDA prefers larger
# tiles (bench/NOTES.md has the sweep). EVICTION marks the logits as streamed once.
LAUNCH_CONFIG = {
    "cuda": {"max_block_v": 8192, "num_warps": 8},
    "npu": {"max_block_v": 4096, "num_warps": 4},
    "cpu": {"max_block_v": 4096, "num_warps": 4},  # the interpreter
}
EVICTION = {"cuda": "evict_first", "npu": "evict_first", "cpu": ""}


@triton.jit
def _tile_stream_start(logits_ptr, logits_row_stride, n_rows, n_cols, rows_per_program, other: tl.constexpr,
                       BLOCK_V: tl.constexpr, EVICT: tl.constexpr):
    """This program's rows as one stream of (row, column-block) tiles: its bounds and first tile."""
    row = tl.program_id(0).to(tl.int64) * rows_per_program  # int64 rows: int64 offsets
    row_end = tl.minimum(row + rows_per_program, n_rows)
    n_tiles = (row_end - row) * tl.cdiv(n_cols, BLOCK_V)
    cols = tl.arange(0, BLOCK_V)
    col = tl.full([], 0, tl.int32)
    first_mask = cols < tl.where(row < row_end, n_cols, 0)
    x = tl.load(logits_ptr + row * logits_row_stride + cols, mask=first_mask, other=other, eviction_policy=EVICT)
    return row, row_end, n_tiles, cols, col, x


@triton.jit
def _tile_stream_next(logits_ptr, logits_row_stride, row, col, row_end, n_cols, cols, other: tl.constexpr,
                      BLOCK_V: tl.constexpr, EVICT: tl.constexpr):
    """Whether (row, col) ends its row, the next tile's position, and the next tile's load."""
    row_done = col + BLOCK_V >= n_cols
    next_row = tl.where(row_done, row + 1, row)
    next_col = tl.where(row_done, 0, col + BLOCK_V)
    next_mask = cols < tl.where(next_row < row_end, n_cols - next_col, 0)  # columns left in the row
    next_ptr = logits_ptr + next_row * logits_row_stride + next_col
    x_next = tl.load(next_ptr + cols, mask=next_mask, other=other, eviction_policy=EVICT)
    return row_done, next_row, next_col, x_next


@triton.jit
def _shard_partials_kernel(
    logits_ptr,
    logits_row_stride,
    target_ptr,
    partials_ptr,  # fp32 [NUM_PARTIALS, n_rows], contiguous
    n_rows,
    n_cols,
    rows_per_program,
    vocab_start,
    global_vocab,
    ignore_index,
    BLOCK_V: tl.constexpr,
    WITH_LOGIT_SUM: tl.constexpr,
    EVICT: tl.constexpr,
):
    # The next tile is loaded before the current one is reduced, also across a row boundary.
    row, row_end, n_tiles, cols, col, x = _tile_stream_start(
        logits_ptr, logits_row_stride, n_rows, n_cols, rows_per_program, -float("inf"), BLOCK_V, EVICT
    )
    running_max = -float("inf")
    running_sum = 0.0
    logit_sum = 0.0
    for _ in range(0, n_tiles):
        row_done, next_row, next_col, x_next = _tile_stream_next(
            logits_ptr, logits_row_stride, row, col, row_end, n_cols, cols, -float("inf"), BLOCK_V, EVICT
        )

        xf = x.to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(xf, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(xf - new_max), axis=0)
        running_max = new_max
        if WITH_LOGIT_SUM:
            logit_sum += tl.sum(tl.where(col + cols < n_cols, xf, 0.0), axis=0)

        # Row finished: its target logit, then the partials (masked stores, no branch).
        target = tl.load(target_ptr + row, mask=row_done, other=ignore_index).to(tl.int64)
        local = target - vocab_start
        owned = (local >= 0) & (local < n_cols) & row_done
        picked = tl.load(logits_ptr + row * logits_row_stride + local, mask=owned, other=0.0).to(tl.float32)
        invalid = (target != ignore_index) & ((target < 0) | (target >= global_vocab))
        picked = tl.where(invalid, float("nan"), picked)
        tl.store(partials_ptr + row, running_max, mask=row_done)
        tl.store(partials_ptr + n_rows + row, running_sum, mask=row_done)
        tl.store(partials_ptr + 2 * n_rows + row, picked, mask=row_done)
        if WITH_LOGIT_SUM:
            tl.store(partials_ptr + 3 * n_rows + row, logit_sum, mask=row_done)
            logit_sum = tl.where(row_done, 0.0, logit_sum)
        running_max = tl.where(row_done, -float("inf"), running_max)
        running_sum = tl.where(row_done, 0.0, running_sum)
        row, col, x = next_row, next_col, x_next


@triton.jit
def _grad_kernel(
    logits_ptr,
    logits_row_stride,
    grad_ptr,  # may equal logits_ptr: every element is read before it is written, by one program
    grad_row_stride,
    target_ptr,
    lse_ptr,
    grad_scale_ptr,  # fp32 [n_rows]: upstream gradient, 0 on ignored rows
    n_rows,
    n_cols,
    rows_per_program,
    vocab_start,
    z_loss_coeff,
    target_weight,  # 1 - label_smoothing
    smoothing_per_col,  # label_smoothing / global_vocab
    BLOCK_V: tl.constexpr,
    EVICT: tl.constexpr,
):
    # Same tile stream as the forward kernel; the next tile's logits load before this tile's math.
    row, row_end, n_tiles, cols, col, x = _tile_stream_start(
        logits_ptr, logits_row_stride, n_rows, n_cols, rows_per_program, 0.0, BLOCK_V, EVICT
    )
    for _ in range(0, n_tiles):
        _, next_row, next_col, x_next = _tile_stream_next(
            logits_ptr, logits_row_stride, row, col, row_end, n_cols, cols, 0.0, BLOCK_V, EVICT
        )

        lse = tl.load(lse_ptr + row)
        g = tl.load(grad_scale_ptr + row)
        local = tl.load(target_ptr + row).to(tl.int64) - vocab_start
        offs = col + cols
        dx = g * (1.0 + 2.0 * z_loss_coeff * lse) * tl.exp(x.to(tl.float32) - lse) - g * smoothing_per_col
        dx = tl.where(offs == local, dx - g * target_weight, dx)
        grad_row = grad_ptr + row * grad_row_stride
        tl.store(grad_row + offs, dx.to(grad_ptr.dtype.element_ty), mask=offs < n_cols, eviction_policy=EVICT)
        row, col, x = next_row, next_col, x_next


def _launch(logits):
    """Grid size, rows per program and compile-time settings for this device and shape."""
    n_rows, n_cols = logits.shape
    config = LAUNCH_CONFIG.get(logits.device.type, LAUNCH_CONFIG["npu"])
    programs = num_programs(logits.device, n_rows)
    block_v = min(config["max_block_v"], triton.next_power_of_2(max(n_cols, 16)))
    settings = {"BLOCK_V": block_v, "EVICT": EVICTION.get(logits.device.type, ""), "num_warps": config["num_warps"]}
    return (programs,), triton.cdiv(n_rows, programs), settings


def shard_partials(logits, target, vocab_start, global_vocab, ignore_index, with_logit_sum):
    n_rows, n_cols = logits.shape
    partials = torch.empty(4 if with_logit_sum else 3, n_rows, dtype=torch.float32, device=logits.device)
    if n_rows == 0:
        return partials
    grid, rows_per_program, settings = _launch(logits)
    _shard_partials_kernel[grid](
        logits,
        logits.stride(0),
        target,
        partials,
        n_rows,
        n_cols,
        rows_per_program,
        vocab_start,
        global_vocab,
        ignore_index,
        WITH_LOGIT_SUM=with_logit_sum,
        **settings,
    )
    return partials


def write_grad(logits, grad, target, lse, grad_scale, vocab_start, z_loss_coeff, label_smoothing, global_vocab):
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return grad
    grid, rows_per_program, settings = _launch(logits)
    _grad_kernel[grid](
        logits,
        logits.stride(0),
        grad,
        grad.stride(0),
        target,
        lse,
        grad_scale,
        n_rows,
        n_cols,
        rows_per_program,
        vocab_start,
        float(z_loss_coeff),
        1.0 - float(label_smoothing),
        float(label_smoothing) / global_vocab,
        **settings,
    )
    return grad
