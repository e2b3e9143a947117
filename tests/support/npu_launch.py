"""Another device type's launch settings on CPU tensors (Triton's interpreter): how the tests execute the
NPU's launch without an NPU. Every Triton kernel asks ``triton_cross_entropy.launch_type`` (through that
module) which device type's settings it launches with; :func:`launched_as` replaces that function."""

LAUNCH_TYPES = ("npu", "cpu")  # what may be forced (CUDA's settings compile its target assert)


def launched_as(monkeypatch, device_type):
    """Until ``monkeypatch`` undoes it, the Triton kernels on CPU tensors launch with ``device_type``'s
    settings (``"npu"``: Ascend's tiles, block sizes, warps, dot precision); tensors on an accelerator
    are refused (a RuntimeError at launch)."""
    if device_type not in LAUNCH_TYPES:
        raise ValueError(f"launched_as: device_type must be one of {LAUNCH_TYPES}, got {device_type!r}")
    from mindspeed_cez.kernels import triton_cross_entropy

    def launch_type(device):
        if device.type == device_type:
            return device.type
        if device.type != "cpu":
            raise RuntimeError(f"launched_as({device_type!r}) forces launch settings onto CPU tensors (Triton's "
                               f"interpreter) only; these tensors are on {device}")
        return device_type

    monkeypatch.setattr(triton_cross_entropy, "launch_type", launch_type)
