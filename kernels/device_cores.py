"""How many programs a persistent grid launches on a device.

Triton's driver reports the core count: ``multiprocessor_count`` on CUDA, ``num_vectorcore``
(or ``num_aicore``) on Ascend through triton-ascend. The count is read once per device.

``launch_as(device_type)`` makes the Triton kernels launch CPU tensors (the interpreter) with
another device type's ``LAUNCH_CONFIG`` entry, dot precision and eviction: how the Ascend leg
executes the NPU launch without an NPU.
"""

import contextlib
import contextvars
import functools

import torch

_FALLBACK_CORES = 16  # interpreter on CPU, or a driver that reports nothing
LAUNCH_TYPES = ("npu", "cpu")  # what launch_as may force (CUDA's settings compile its target assert)
# Global: (context-local) the kernels launch from the ops with no handle through which a test could pass it.
_LAUNCH_AS = contextvars.ContextVar("mindspeed_cez_launch_as", default=None)


@contextlib.contextmanager
def launch_as(device_type):
    """Within the block, kernels on CPU tensors (Triton's interpreter) launch with ``device_type``'s
    settings (``"npu"``: Ascend's tiles, block sizes, warps, dot precision); for tests, not training."""
    if device_type not in LAUNCH_TYPES:
        raise ValueError(f"launch_as: device_type must be one of {LAUNCH_TYPES}, got {device_type!r}")
    token = _LAUNCH_AS.set(device_type)
    try:
        yield
    finally:
        _LAUNCH_AS.reset(token)


def launch_type(device: torch.device) -> str:
    """The device type whose launch settings a kernel on ``device`` uses: its own, or on the CPU
    the one :func:`launch_as` names. Forcing settings onto an accelerator is refused."""
    forced = _LAUNCH_AS.get()
    if forced is None or forced == device.type:
        return device.type
    if device.type != "cpu":
        raise RuntimeError(f"launch_as({forced!r}) forces launch settings onto CPU tensors (Triton's "
                           f"interpreter) only; these tensors are on {device}: leave the launch_as block")
    return forced


@functools.lru_cache(maxsize=None)
def core_count(device_type: str, device_index: int) -> int:
    if device_type == "cpu":
        return _FALLBACK_CORES
    try:
        import triton

        props = triton.runtime.driver.active.utils.get_device_properties(device_index)
    except Exception:  # noqa: BLE001 - any driver without the query falls back
        props = {}
    for key in ("multiprocessor_count", "num_vectorcore", "num_aicore"):
        if props.get(key):
            return int(props[key])
    if device_type == "cuda":
        return torch.cuda.get_device_properties(device_index).multi_processor_count
    return _FALLBACK_CORES


def num_programs(device: torch.device, n_rows: int, programs_per_core: int) -> int:
    """A persistent grid: ``programs_per_core`` programs per core (Ascend: 1, each taking a
    contiguous chunk of rows; CUDA: several CTAs share an SM), never more than the rows."""
    index = device.index if device.index is not None else 0
    if device.type == "cuda" and device.index is None:
        index = torch.cuda.current_device()
    cores = core_count(device.type, index)
    return max(1, min(n_rows, cores * programs_per_core))
