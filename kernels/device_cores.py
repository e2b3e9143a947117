"""How many programs a persistent grid launches on a device.

Triton's driver reports the core count: ``multiprocessor_count`` on CUDA, ``num_vectorcore``
(or ``num_aicore``) on Ascend through triton-ascend. The count is read once per device.
"""

import functools

import torch

_FALLBACK_CORES = 16  # interpreter on CPU, or a driver that reports nothing


def launch_type(device: torch.device) -> str:
    """The device type whose launch settings (``LAUNCH_CONFIG`` entries, eviction, dot precision) a kernel
    on ``device`` uses: its own. Every kernel asks here, through this module (a test runs the NPU's
    settings on CPU tensors under the interpreter by replacing it: ``tests/support/npu_launch.py``)."""
    return device.type


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
