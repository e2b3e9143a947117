"""``c += a @ b`` with 16-bit ``a``, ``b`` and an fp32 ``c``: the product accumulated into fp32 in
the kernel's epilogue (no fp32 copies of the operands, no 16-bit rounding of the product).

What Megatron's gradient-accumulation fusion does for a weight's fp32 gradient buffer (apex's
``wgrad_gemm_accum_fp32``, MindSpeed's ``npu_matmul_add_fp32``), for CUDA where torch's
``addmm(out_dtype=)`` is missing (torch < 2.8: MindSpeed-LLM 26.x's torch 2.7.1).

A task is one ``[BLOCK_M, BLOCK_N]`` tile of ``c``: the fp32 dot over ``k`` in ``BLOCK_K`` steps,
then that tile of ``c`` read, added to and written back. A persistent grid (about
``per_core`` programs per core) walks the tasks ``GROUP_M`` row blocks at a time over the same
columns, so concurrent tasks share ``b``'s tiles in cache. ``a`` and ``b`` take any strides
(``a`` is often a transposed view: ``dlogits.t()``); ``c`` needs a unit column stride. Offsets
are int64; nothing reads tensor values on the host (CUDA-graph capturable).
"""

import functools
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from . import triton_cross_entropy
from .triton_cross_entropy import Launcher, num_programs

# Tiles per device type: BLOCK_M x BLOCK_N of c, BLOCK_K of the reduction per dot, GROUP_M row
# blocks per column sweep, warps, pipeline stages (CUDA), programs per core, and whether a task reads
# its c tile before the dots (its latency then hidden behind them; 64 more fp32 registers a thread
# at 128 x 128 over 8 warps). CUDA: the best of an H200 sweep (docs/performance.md).
# Ascend: the linear kernels' fp32 [64, 128] tile
# (32 KiB) plus 16-bit operands, well inside the on-chip buffers. CPU: the interpreter.
LAUNCH_CONFIG = {
    "cuda": {"block_m": 128, "block_n": 128, "block_k": 64, "group_m": 8, "warps": 8, "stages": 4, "per_core": 1,
             "preload_c": True},
    "npu": {"block_m": 64, "block_n": 128, "block_k": 64, "group_m": 4, "warps": 4, "stages": 1, "per_core": 1,
            "preload_c": False},
    "cpu": {"block_m": 16, "block_n": 32, "block_k": 16, "group_m": 2, "warps": 4, "stages": 1, "per_core": 1,
            "preload_c": True},
}


@triton.jit
def _accumulate_kernel(
    a_ptr, a_stride_m, a_stride_k,  # [m, k], 16-bit
    b_ptr, b_stride_k, b_stride_n,  # [k, n], 16-bit
    c_ptr, c_stride_m,  # [m, n] fp32, unit column stride
    m, n, k,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, WIDEN: tl.constexpr, PRELOAD_C: tl.constexpr,
):
    m_blocks = tl.cdiv(m, BLOCK_M)
    n_blocks = tl.cdiv(n, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    for task in range(tl.program_id(0), m_blocks * n_blocks, tl.num_programs(0)):
        band = GROUP_M * n_blocks
        first_m = (task // band) * GROUP_M
        rows_in_band = tl.minimum(m_blocks - first_m, GROUP_M)
        pm = first_m + (task % band) % rows_in_band
        pn = (task % band) // rows_in_band
        rows = pm.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pn.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < m
        col_ok = cols < n
        # masks, not clamped offsets: the loads stay vectorized (offsets provably contiguous)
        a_tile = a_ptr + rows[:, None] * a_stride_m + ks[None, :] * a_stride_k
        b_tile = b_ptr + ks[:, None] * b_stride_k + cols[None, :] * b_stride_n
        c_tile = c_ptr + rows[:, None] * c_stride_m + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        if PRELOAD_C:  # c's tile read before the dots: its latency hidden behind them
            c_old = tl.load(c_tile, mask=mask, other=0.0)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kk in range(0, k, BLOCK_K):
            if EVEN_K:
                x = tl.load(a_tile, mask=row_ok[:, None], other=0.0)
                y = tl.load(b_tile, mask=col_ok[None, :], other=0.0)
            else:
                x = tl.load(a_tile, mask=row_ok[:, None] & (ks[None, :] < k - kk), other=0.0)
                y = tl.load(b_tile, mask=(ks[:, None] < k - kk) & col_ok[None, :], other=0.0)
            if WIDEN:  # the CPU interpreter's dot multiplies bf16's raw bits: widen (exact) first
                acc = tl.dot(x.to(tl.float32), y.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, y, acc)
            a_tile += BLOCK_K * a_stride_k
            b_tile += BLOCK_K * b_stride_k
        if PRELOAD_C:
            tl.store(c_tile, c_old + acc, mask=mask)
        else:
            tl.store(c_tile, tl.load(c_tile, mask=mask, other=0.0) + acc, mask=mask)


_launch = Launcher(_accumulate_kernel)
LAUNCHERS = (_launch,)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


def launch_settings(device_type):
    return LAUNCH_CONFIG.get(device_type, LAUNCH_CONFIG["npu"])


@functools.lru_cache(maxsize=256)
def _plan(device, m, n, k, dtype, kind):
    """(grid, constexprs by parameter name, options) with ``kind``'s settings (``triton_cross_entropy.launch_type``)."""
    c = launch_settings(kind)
    tasks = triton.cdiv(m, c["block_m"]) * triton.cdiv(n, c["block_n"])
    grid = (num_programs(device, tasks, c["per_core"]),)
    # The CPU interpreter's dot multiplies bf16's raw bits: there bf16 operands are widened to fp32.
    widen = kind == "cpu" or (device.type == "cpu" and dtype == torch.bfloat16)
    constexprs = MappingProxyType({"BLOCK_M": c["block_m"], "BLOCK_N": c["block_n"], "BLOCK_K": c["block_k"],
                                   "GROUP_M": c["group_m"], "EVEN_K": k % c["block_k"] == 0, "WIDEN": widen,
                                   "PRELOAD_C": bool(c.get("preload_c"))})
    options = (("num_warps", c["warps"]),) + ((("num_stages", c["stages"]),) if kind == "cuda" else ())
    return grid, constexprs, options


def launch_plans_changed():
    """Forget the plans computed so far; call after changing ``LAUNCH_CONFIG``."""
    _plan.cache_clear()


def matmul_accumulate(c, a, b):
    """``c += a @ b``: ``a`` ``[m, k]`` and ``b`` ``[k, n]`` bf16 / fp16 (same dtype, any strides),
    ``c`` fp32 ``[m, n]`` with a unit column stride, all on one device. Returns ``c``."""
    if a.dim() != 2 or b.dim() != 2 or c.dim() != 2 or a.shape[1] != b.shape[0] or tuple(c.shape) != (a.shape[0],
                                                                                                    b.shape[1]):
        raise ValueError(f"matmul_accumulate: c {tuple(c.shape)} += a {tuple(a.shape)} @ b {tuple(b.shape)} do not fit")
    if a.dtype not in SUPPORTED_DTYPES or b.dtype != a.dtype or c.dtype != torch.float32:
        raise TypeError(f"matmul_accumulate takes 16-bit a, b of one dtype and an fp32 c, got {a.dtype}, {b.dtype}, "
                        f"{c.dtype}")
    if c.stride(1) != 1 and c.shape[1] > 1:
        raise ValueError("matmul_accumulate: c needs a unit column stride (a row-major [m, n] view)")
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0 or k == 0:
        return c
    grid, constexprs, options = _plan(c.device, m, n, k, a.dtype, triton_cross_entropy.launch_type(c.device))
    args = _launch.bind(constexprs, a_ptr=a, a_stride_m=a.stride(0), a_stride_k=a.stride(1), b_ptr=b,
                        b_stride_k=b.stride(0), b_stride_n=b.stride(1), c_ptr=c, c_stride_m=c.stride(0), m=m, n=n, k=k)
    _launch(grid, args, options)
    return c
