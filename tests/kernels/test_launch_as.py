"""``kernels.launch_as``: another device type's launch settings on CPU tensors (the interpreter),
scoped to the block and refused on accelerator tensors. Runs with the CPU suite's Triton; the
Ascend leg runs every variant with it under triton-ascend (``test_ascend_interpreter.py``)."""

import types

import pytest
import torch

from mindspeed_cez import kernels
from mindspeed_cez.kernels import torch_reference
from mindspeed_cez.kernels.device_cores import launch_type
from mindspeed_cez.kernels import LossSpec

tce = pytest.importorskip("mindspeed_cez.kernels.triton_cross_entropy")


def test_each_setting_matches_the_reference_and_the_block_is_scoped():
    logits, target = torch.randn(6, 3000), torch.randint(0, 3000, (6,))
    spec = LossSpec(-100, 1e-3, 0.1)
    want = torch_reference.fused_loss(logits, target, spec)
    for kind in ("npu", "cpu"):
        with kernels.launch_as(kind):
            assert launch_type(logits.device) == kind
            got = tce.fused_loss(logits, target, spec)
        assert (got - want).abs().max() < 1e-5, kind
    assert launch_type(logits.device) == "cpu"
    plans = {key[-1]: tce._plan(logits.device, 6, 3000, "fwd", key[-1]) for key in [("npu",), ("cpu",)]}
    npu, cpu = plans["npu"][2], plans["cpu"][2]
    assert (npu["SLOTS"], npu["SLOT_WIDTH"], cpu["SLOT_WIDTH"]) == (1, 4096, 8)  # one 4096 slot / 8-wide slots


def test_bad_type_and_accelerator_tensors_are_refused():
    with pytest.raises(ValueError, match="device_type must be one of"):
        with kernels.launch_as("cuda"):
            pass
    with kernels.launch_as("npu"):
        with pytest.raises(RuntimeError, match="onto CPU tensors"):
            launch_type(torch.device("cuda", 0))
        npu = types.SimpleNamespace(type="npu")  # torch.device("npu") needs torch_npu
        assert launch_type(npu) == "npu"  # the device's own type: nothing forced
