"""Triton kernels: softmax statistics and loss (forward), the in-place gradient (backward).

One source for NVIDIA (``triton``) and Ascend (``triton-ascend``). The two streaming kernels
launch a persistent grid (``device_cores.num_programs``): program ``p`` takes the contiguous
rows ``[p*rows_per_program, (p+1)*rows_per_program)`` and walks them as one stream of
(row, tile) steps, a tile being ``BLOCK_V`` columns of one row. The stream is a
``tl.range(..., num_stages=NUM_STAGES)`` loop: on CUDA Triton's pipeliner then keeps
``NUM_STAGES - 1`` tiles in flight (asynchronous copies into shared memory) while the current
one is worked on. Row offsets are int64 (N*V may pass 2**31). Nothing here reads tensor values
on the host, so forward + backward capture in a CUDA graph.

Forward reads the logits once. A tile is viewed as ``[SLOTS, SLOT_WIDTH]``; each slot keeps
its own running max and sum-exp (online softmax), so a step has no cross-thread reduction:
the slots are merged once per row. On CUDA a slot is 8 contiguous values held by one thread;
on Ascend there is one slot per tile (whole-tile vector reductions). With one rank the same
kernel finishes the loss; with several it writes the partials that the op all-reduces, then
two small kernels rescale them and finish the loss.

Backward reads the logits once more and writes the gradient, in place when the caller passes
the logits' own buffer as ``grad``. It finds the target column through the same slot view
(one compare per slot and one per lane instead of one per element).
"""

import torch
import triton
import triton.language as tl

from .device_cores import num_programs

# Launch settings per device type, as (narrowest vocab slice they apply to, settings), widest
# first. Settings of the forward (fwd_*) and the backward (bwd_*) kernel: columns per tile,
# columns per slot (None: one slot per tile), warps, programs per core of the persistent grid,
# and pipeline stages. Ascend wants about one program per vector core, and a program's working
# set (a few copies of a tile in fp32) well inside the ~192 KiB unified buffer: 4096 columns use
# about 64 KiB. On CUDA several CTAs share an SM and the pipeliner keeps tiles in flight. The
# CUDA values are a first guess from the compiler's resource report (bench/kernel_resources.py),
# NOT measured: sweep them with bench/tune_kernels.py. CUDA-only tuning lives here, not in the
# kernel bodies.
LAUNCH_CONFIG = {
    "cuda": [
        (0, {"fwd_block_v": 8192, "slot_width": 8, "fwd_warps": 8, "fwd_per_core": 16, "fwd_stages": 3,
             "bwd_block_v": 8192, "bwd_warps": 8, "bwd_per_core": 16, "bwd_stages": 3}),
    ],
    "npu": [
        (0, {"fwd_block_v": 4096, "slot_width": None, "fwd_warps": 4, "fwd_per_core": 1, "fwd_stages": 1,
             "bwd_block_v": 4096, "bwd_warps": 4, "bwd_per_core": 1, "bwd_stages": 1}),
    ],
    "cpu": [  # the interpreter
        (0, {"fwd_block_v": 4096, "slot_width": 8, "fwd_warps": 4, "fwd_per_core": 1, "fwd_stages": 1,
             "bwd_block_v": 4096, "bwd_warps": 4, "bwd_per_core": 1, "bwd_stages": 1}),
    ],
}
EVICTION = {"cuda": "evict_first", "npu": "evict_first", "cpu": ""}
# Rows per program of the small [N] kernels (rescale, loss from partials, target check).
VECTOR_BLOCK = 1024

LOG2E = tl.constexpr(1.4426950408889634)

# Partials of one rank, rows of a fp32 [PARTIAL_ROWS, n] tensor. ROW_MAX becomes the global max
# after the MAX all-reduce; SUM_EXP (relative to ROW_MAX) and TARGET_TERM are then all-reduced
# together; LOCAL_MAX keeps this rank's max for the rescale in between.
ROW_MAX = tl.constexpr(0)
SUM_EXP = tl.constexpr(1)
TARGET_TERM = tl.constexpr(2)
LOCAL_MAX = tl.constexpr(3)
PARTIAL_ROWS = 4


@triton.jit
def _row_stream(rows_per_program, n_rows, n_cols, BLOCK_V: tl.constexpr):
    """This program's first row and its number of (row, tile) steps."""
    first = tl.program_id(0).to(tl.int64) * rows_per_program  # int64 rows: int64 offsets
    end = tl.minimum(first + rows_per_program, n_rows)
    steps = (tl.maximum(end - first, 0) * tl.cdiv(n_cols, BLOCK_V)).to(tl.int32)
    return first, steps


@triton.jit
def _next_step(row, tile, n_cols, BLOCK_V: tl.constexpr):
    """Whether (row, tile) ends its row, and the step after it."""
    row_done = (tile + 1) * BLOCK_V >= n_cols
    return row_done, tl.where(row_done, row + 1, row), tl.where(row_done, 0, tile + 1)


@triton.jit
def _forward_kernel(
    logits_ptr,
    row_stride,
    target_ptr,
    out_ptr,  # fp32 [3, n_rows] (loss, z-loss, lse) when FINISH, else [PARTIAL_ROWS, n_rows]
    n_rows,
    n_cols,
    rows_per_program,
    vocab_start,
    global_vocab,
    ignore_index,
    z_loss_coeff,
    target_weight,  # 1 - label_smoothing
    smoothing_per_col,  # label_smoothing / global_vocab
    SLOTS: tl.constexpr,
    SLOT_WIDTH: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    FINISH: tl.constexpr,
    WITH_LOGIT_SUM: tl.constexpr,
    EVICT: tl.constexpr,
):
    BLOCK_V: tl.constexpr = SLOTS * SLOT_WIDTH
    offs = tl.arange(0, SLOTS)[:, None] * SLOT_WIDTH + tl.arange(0, SLOT_WIDTH)[None, :]
    row, steps = _row_stream(rows_per_program, n_rows, n_cols, BLOCK_V)
    tile = 0
    slot_max = tl.full([SLOTS], -float("inf"), tl.float32)
    slot_sum = tl.zeros([SLOTS], tl.float32)  # sum of exp(x - slot_max)
    slot_logits = tl.zeros([SLOTS], tl.float32)
    for _ in tl.range(0, steps, num_stages=NUM_STAGES):
        col = tile * BLOCK_V
        x = tl.load(logits_ptr + row * row_stride + col + offs, mask=offs < n_cols - col, other=-float("inf"),
                    eviction_policy=EVICT)
        xf = x.to(tl.float32)
        new_max = tl.maximum(slot_max, tl.max(xf, axis=1))
        ref = tl.where(new_max == -float("inf"), 0.0, new_max) * LOG2E  # all -inf so far: no rescale
        tile_sum = tl.sum(tl.exp2(xf * LOG2E - ref[:, None]), axis=1)
        slot_sum = slot_sum * tl.exp2(slot_max * LOG2E - ref) + tile_sum
        slot_max = new_max
        if WITH_LOGIT_SUM:
            slot_logits += tl.sum(tl.where(offs < n_cols - col, xf, 0.0), axis=1)

        row_done, next_row, next_tile = _next_step(row, tile, n_cols, BLOCK_V)
        if row_done:  # merge the slots, then the loss (one rank) or this rank's partials
            target = tl.load(target_ptr + row).to(tl.int64)
            local = target - vocab_start
            owned = (local >= 0) & (local < n_cols)
            picked = tl.load(logits_ptr + row * row_stride + local, mask=owned, other=0.0).to(tl.float32)
            row_max = tl.max(slot_max, axis=0)
            row_ref = tl.where(row_max == -float("inf"), 0.0, row_max)
            sum_exp = tl.sum(slot_sum * tl.exp2((slot_max - row_ref) * LOG2E), axis=0)
            target_term = target_weight * picked
            if WITH_LOGIT_SUM:
                target_term += smoothing_per_col * tl.sum(slot_logits, axis=0)
            invalid = (target != ignore_index) & ((target < 0) | (target >= global_vocab))
            target_term = tl.where(invalid, float("nan"), target_term)
            if FINISH:
                lse = row_max + tl.log(sum_exp)
                z_loss = z_loss_coeff * lse * lse
                ignored = target == ignore_index
                tl.store(out_ptr + row, tl.where(ignored, 0.0, lse - target_term + z_loss))
                tl.store(out_ptr + n_rows + row, tl.where(ignored, 0.0, z_loss))
                tl.store(out_ptr + 2 * n_rows + row, lse)
            else:
                tl.store(out_ptr + ROW_MAX * n_rows + row, row_max)
                tl.store(out_ptr + SUM_EXP * n_rows + row, sum_exp)
                tl.store(out_ptr + TARGET_TERM * n_rows + row, target_term)
                tl.store(out_ptr + LOCAL_MAX * n_rows + row, row_max)
            slot_max = tl.full([SLOTS], -float("inf"), tl.float32)
            slot_sum = tl.zeros([SLOTS], tl.float32)
            slot_logits = tl.zeros([SLOTS], tl.float32)
        row = next_row
        tile = next_tile


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
    SLOTS: tl.constexpr,
    SLOT_WIDTH: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    EVICT: tl.constexpr,
):
    BLOCK_V: tl.constexpr = SLOTS * SLOT_WIDTH
    slot_ids = tl.arange(0, SLOTS)
    lane_ids = tl.arange(0, SLOT_WIDTH)
    offs = slot_ids[:, None] * SLOT_WIDTH + lane_ids[None, :]
    row, steps = _row_stream(rows_per_program, n_rows, n_cols, BLOCK_V)
    tile = 0
    for _ in tl.range(0, steps, num_stages=NUM_STAGES):
        col = tile * BLOCK_V
        x = tl.load(logits_ptr + row * logits_row_stride + col + offs, mask=offs < n_cols - col, other=0.0,
                    eviction_policy=EVICT)
        target = tl.load(target_ptr + row).to(tl.int64)
        lse = tl.load(lse_ptr + row)
        g = tl.load(grad_loss_ptr + row * grad_loss_stride).to(tl.float32)
        g = tl.where(target == ignore_index, 0.0, g)
        # dx = g * (softmax * (1 + 2c*lse) - (1-a)*onehot - a/V), softmax = exp2(x*log2e - lse*log2e)
        dx = tl.exp2(x.to(tl.float32) * LOG2E - lse * LOG2E) * (g * (1.0 + 2.0 * z_loss_coeff * lse))
        dx -= g * smoothing_per_col
        # The target column as (slot, lane) of this tile.
        hit = tl.minimum(tl.maximum(target - vocab_start - col, -1), BLOCK_V).to(tl.int32)
        lane = tl.where(hit >= 0, hit % SLOT_WIDTH, -1)
        onehot = (slot_ids[:, None] == hit // SLOT_WIDTH) & (lane_ids[None, :] == lane)
        dx = tl.where(onehot, dx - g * target_weight, dx)
        tl.store(grad_ptr + row * grad_row_stride + col + offs, dx.to(grad_ptr.dtype.element_ty),
                 mask=offs < n_cols - col, eviction_policy=EVICT)
        _, row, tile = _next_step(row, tile, n_cols, BLOCK_V)


@triton.jit
def _rescale_kernel(partials_ptr, n_rows, BLOCK: tl.constexpr):
    """SUM_EXP *= exp(LOCAL_MAX - ROW_MAX), ROW_MAX being the global max by now."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < n_rows
    global_max = tl.load(partials_ptr + ROW_MAX * n_rows + rows, mask=mask, other=0.0)
    local_max = tl.load(partials_ptr + LOCAL_MAX * n_rows + rows, mask=mask, other=0.0)
    sum_exp = tl.load(partials_ptr + SUM_EXP * n_rows + rows, mask=mask, other=0.0)
    ref = tl.where(global_max == -float("inf"), 0.0, global_max)
    tl.store(partials_ptr + SUM_EXP * n_rows + rows, sum_exp * tl.exp2((local_max - ref) * LOG2E), mask=mask)


@triton.jit
def _loss_from_partials_kernel(partials_ptr, target_ptr, n_rows, ignore_index, z_loss_coeff, BLOCK: tl.constexpr):
    """(loss, z-loss, lse) from the reduced partials, written over rows 0-2 of the partials."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < n_rows
    row_max = tl.load(partials_ptr + ROW_MAX * n_rows + rows, mask=mask, other=0.0)
    sum_exp = tl.load(partials_ptr + SUM_EXP * n_rows + rows, mask=mask, other=1.0)
    target_term = tl.load(partials_ptr + TARGET_TERM * n_rows + rows, mask=mask, other=0.0)
    ignored = tl.load(target_ptr + rows, mask=mask, other=ignore_index) == ignore_index
    lse = row_max + tl.log(sum_exp)
    z_loss = z_loss_coeff * lse * lse
    tl.store(partials_ptr + rows, tl.where(ignored, 0.0, lse - target_term + z_loss), mask=mask)
    tl.store(partials_ptr + n_rows + rows, tl.where(ignored, 0.0, z_loss), mask=mask)
    tl.store(partials_ptr + 2 * n_rows + rows, lse, mask=mask)


@triton.jit(debug=True)
def _check_target_kernel(target_ptr, n_rows, global_vocab, ignore_index, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    target = tl.load(target_ptr + rows, mask=rows < n_rows, other=ignore_index)
    valid = (target == ignore_index) | ((target >= 0) & (target < global_vocab))
    tl.device_assert(valid, "target outside [0, vocab) and not ignore_index")


# --------------------------------------------------------------------------- launchers


def launch_settings(device_type, n_cols):
    """The LAUNCH_CONFIG settings for a vocab slice of ``n_cols`` columns on this device type."""
    for narrowest, settings in LAUNCH_CONFIG.get(device_type, LAUNCH_CONFIG["npu"]):
        if n_cols >= narrowest:
            return settings
    raise ValueError(f"no launch settings for {n_cols} columns on {device_type}")


def _settings(logits, kernel):
    """Compile-time settings of the ``"fwd"`` or ``"bwd"`` kernel for these logits."""
    config = launch_settings(logits.device.type, logits.shape[1])
    block_v = min(config[f"{kernel}_block_v"], triton.next_power_of_2(logits.shape[1]))
    slot_width = min(config["slot_width"] or block_v, block_v)
    return {
        "SLOTS": block_v // slot_width,
        "SLOT_WIDTH": slot_width,
        "NUM_STAGES": config[f"{kernel}_stages"],
        "EVICT": EVICTION.get(logits.device.type, ""),
        "num_warps": config[f"{kernel}_warps"],
    }


def _grid(logits, kernel):
    config = launch_settings(logits.device.type, logits.shape[1])
    programs = num_programs(logits.device, logits.shape[0], config[f"{kernel}_per_core"])
    return (programs,), triton.cdiv(logits.shape[0], programs)


def _loss_constants(z_loss_coeff, label_smoothing, global_vocab):
    """The kernels' (z_loss_coeff, target_weight, smoothing_per_col) arguments."""
    return float(z_loss_coeff), 1.0 - float(label_smoothing), float(label_smoothing) / global_vocab


def _forward(logits, target, out, vocab_start, global_vocab, ignore_index, z_loss_coeff, label_smoothing, finish):
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return out
    grid, rows_per_program = _grid(logits, "fwd")
    _forward_kernel[grid](
        logits,
        logits.stride(0),
        target,
        out,
        n_rows,
        n_cols,
        rows_per_program,
        vocab_start,
        global_vocab,
        ignore_index,
        *_loss_constants(z_loss_coeff, label_smoothing, global_vocab),
        FINISH=finish,
        WITH_LOGIT_SUM=label_smoothing > 0,
        **_settings(logits, "fwd"),
    )
    return out


def fused_loss(logits, target, ignore_index, z_loss_coeff, label_smoothing):
    """One rank holds the whole vocab: fp32 [3, n] rows (loss, z-loss, lse) in one pass."""
    out = torch.empty(3, logits.shape[0], dtype=torch.float32, device=logits.device)
    n_cols = logits.shape[1]
    return _forward(logits, target, out, 0, n_cols, ignore_index, z_loss_coeff, label_smoothing, finish=True)


def shard_partials(logits, target, vocab_start, global_vocab, ignore_index, label_smoothing=0.0):
    """fp32 [PARTIAL_ROWS, n]: row max, sum-exp, target term, row max again (see the constants)."""
    out = torch.empty(PARTIAL_ROWS, logits.shape[0], dtype=torch.float32, device=logits.device)
    return _forward(logits, target, out, vocab_start, global_vocab, ignore_index, 0.0, label_smoothing, finish=False)


def _vector_grid(n_rows):
    return (triton.cdiv(n_rows, VECTOR_BLOCK),)


def rescale_sum_exp(partials):
    n_rows = partials.shape[1]
    if n_rows:
        _rescale_kernel[_vector_grid(n_rows)](partials, n_rows, BLOCK=VECTOR_BLOCK)
    return partials


def loss_from_partials(partials, target, ignore_index, z_loss_coeff):
    n_rows = partials.shape[1]
    if n_rows:
        _loss_from_partials_kernel[_vector_grid(n_rows)](
            partials, target, n_rows, ignore_index, float(z_loss_coeff), BLOCK=VECTOR_BLOCK
        )
    return partials[:3]


def write_grad(logits, grad, target, lse, grad_loss, ignore_index, vocab_start, z_loss_coeff, label_smoothing,
               global_vocab):
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return grad
    grid, rows_per_program = _grid(logits, "bwd")
    _grad_kernel[grid](
        logits,
        logits.stride(0),
        grad,
        grad.stride(0),
        target,
        lse,
        grad_loss,
        grad_loss.stride(0),
        n_rows,
        n_cols,
        rows_per_program,
        vocab_start,
        ignore_index,
        *_loss_constants(z_loss_coeff, label_smoothing, global_vocab),
        **_settings(logits, "bwd"),
    )
    return grad


def check_targets(target, global_vocab, ignore_index):
    """CUDA: an asynchronous device-side assert on out-of-range targets (no host sync). Other
    accelerators rely on the NaN the forward kernel writes for such a target."""
    n_rows = target.numel()
    if target.device.type == "cuda" and n_rows:
        _check_target_kernel[_vector_grid(n_rows)](target, n_rows, global_vocab, ignore_index, BLOCK=VECTOR_BLOCK)
