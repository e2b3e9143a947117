"""Launch plans of the cross-entropy kernels (:mod:`.triton_cross_entropy`): the settings per
device type and vocab width, each shape's grid, constexprs and options, computed once."""

import functools
from types import MappingProxyType

import triton

from .device_cores import num_programs

# Launch settings per device type, as (narrowest vocab slice they apply to, settings), widest
# first. Settings of the forward (fwd_*) and the backward (bwd_*) kernel: columns per tile,
# columns per slot of the forward (None: one slot per tile), warps, and programs per core of the
# persistent grid. Ascend wants about one program per vector core, and a program's working set
# (current and prefetched tile plus a few fp32 temporaries) well inside the ~192 KiB unified
# buffer: 4096 columns use about 64 KiB. On CUDA many short programs share each SM (how the values
# were chosen: docs/performance.md). CUDA-only settings live here, not in the kernel bodies.
LAUNCH_CONFIG = {
    "cuda": [
        (65536, {"fwd_block_v": 8192, "slot_width": 16, "fwd_warps": 4, "fwd_per_core": 64,
                 "bwd_block_v": 16384, "bwd_warps": 32, "bwd_per_core": 64}),
        # Narrow slices: up to 128 programs per SM, and 4096-column forward tiles (56 registers).
        (0, {"fwd_block_v": 4096, "slot_width": 8, "fwd_warps": 4, "fwd_per_core": 128,
             "bwd_block_v": 16384, "bwd_warps": 4, "bwd_per_core": 128}),
    ],
    "npu": [
        (0, {"fwd_block_v": 4096, "slot_width": None, "fwd_warps": 4, "fwd_per_core": 1,
             "bwd_block_v": 4096, "bwd_warps": 4, "bwd_per_core": 1}),
    ],
    "cpu": [  # the interpreter
        (0, {"fwd_block_v": 4096, "slot_width": 8, "fwd_warps": 4, "fwd_per_core": 1,
             "bwd_block_v": 4096, "bwd_warps": 4, "bwd_per_core": 1}),
    ],
}
EVICTION = {"cuda": "evict_first", "npu": "evict_first", "cpu": ""}


def launch_settings(device_type, n_cols):
    """The LAUNCH_CONFIG settings for a vocab slice of ``n_cols`` columns on this device type."""
    for narrowest, settings in LAUNCH_CONFIG.get(device_type, LAUNCH_CONFIG["npu"]):
        if n_cols >= narrowest:
            return settings
    raise ValueError(f"no launch settings for {n_cols} columns on {device_type}")


def _assert_options():
    """On CUDA the forward asserts on its targets: a debug compile, without the integer-overflow
    checks a debug compile adds where Triton has them (``sanitize_overflow``, Triton 3.2+)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        sanitizer = "sanitize_overflow" in CUDAOptions.__dataclass_fields__
    except Exception:  # noqa: BLE001 - no NVIDIA backend here (triton-ascend): never launched with it
        sanitizer = False
    return (("debug", True),) + ((("sanitize_overflow", False),) if sanitizer else ())


ASSERT_OPTIONS = _assert_options()


@functools.lru_cache(maxsize=256)
def _plan(device, n_rows, n_cols, kernel, kind):
    """(grid, rows per program, constexprs, launch options) of the ``"fwd"`` or ``"bwd"`` kernel for
    ``[n_rows, n_cols]`` logits on ``device``; the constexprs by the kernel's parameter names: SLOTS,
    SLOT_WIDTH, CHECK_TARGETS (the check, on CUDA, with its debug options) and EVICT for the
    forward, BLOCK_V and EVICT for the backward; ``kind``: the device type whose settings apply
    (``launch_type``). The loss's own constexprs come from ``LossSpec.kernel_args``."""
    config = launch_settings(kind, n_cols)
    programs = num_programs(device, n_rows, config[f"{kernel}_per_core"])
    block_v = min(config[f"{kernel}_block_v"], triton.next_power_of_2(n_cols))
    options = (("num_warps", config[f"{kernel}_warps"]),)
    constexprs = {"EVICT": EVICTION.get(kind, "")}
    if kernel == "bwd":
        constexprs["BLOCK_V"] = block_v
    else:
        slot_width = min(config["slot_width"] or block_v, block_v)
        check = kind == "cuda"
        constexprs.update(SLOTS=block_v // slot_width, SLOT_WIDTH=slot_width, CHECK_TARGETS=check)
        options += ASSERT_OPTIONS if check else ()
    return (programs,), triton.cdiv(n_rows, programs), MappingProxyType(constexprs), options


def launch_plans_changed():
    """Forget the plans computed so far; call after changing ``LAUNCH_CONFIG``."""
    _plan.cache_clear()
