"""Another device type's launch settings on CPU tensors (the interpreter): ``support.npu_launch.launched_as``
replaces ``triton_cross_entropy.launch_type``, which every kernel asks; its monkeypatch undoes it, and
accelerator tensors are refused. Runs with the CPU suite's Triton; the Ascend leg runs every variant with
it under triton-ascend (``test_ascend_interpreter.py``)."""

import types

import pytest
import torch

from mindspeed_cez.kernels import LossSpec, torch_reference
from support.npu_launch import launched_as

tce = pytest.importorskip("mindspeed_cez.kernels.triton_cross_entropy")


def test_each_setting_matches_the_reference_and_the_block_is_scoped():
    logits, target = torch.randn(6, 3000), torch.randint(0, 3000, (6,))
    spec = LossSpec(-100, 1e-3, 0.1)
    want = torch_reference.fused_loss(logits, target, spec)
    for kind in ("npu", "cpu"):
        with pytest.MonkeyPatch.context() as patch:
            launched_as(patch, kind)
            assert tce.launch_type(logits.device) == kind
            got = tce.fused_loss(logits, target, spec)
        assert (got - want).abs().max() < 1e-5, kind
    assert tce.launch_type(logits.device) == "cpu"
    plans = {key[-1]: tce._plan(logits.device, 6, 3000, "fwd", key[-1]) for key in [("npu",), ("cpu",)]}
    npu, cpu = plans["npu"][2], plans["cpu"][2]
    assert (npu["SLOTS"], npu["SLOT_WIDTH"], cpu["SLOT_WIDTH"]) == (1, 4096, 8)  # one 4096 slot / 8-wide slots


def test_bad_type_and_accelerator_tensors_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="device_type must be one of"):
        launched_as(monkeypatch, "cuda")
    launched_as(monkeypatch, "npu")
    with pytest.raises(RuntimeError, match="onto CPU tensors"):
        tce.launch_type(torch.device("cuda", 0))
    npu = types.SimpleNamespace(type="npu")  # torch.device("npu") needs torch_npu
    assert tce.launch_type(npu) == "npu"  # the device's own type: nothing forced


def test_every_kernel_module_asks_the_one_launch_type():
    """The fused layer's and the accumulation's kernels call ``triton_cross_entropy.launch_type`` through
    the module: a copy of their own would keep their settings when a test forces another device type's."""
    from mindspeed_cez.kernels import triton_linear_cross_entropy as tlce
    from mindspeed_cez.kernels import triton_matmul_accumulate as tma

    for module in (tlce, tma):
        assert not hasattr(module, "launch_type"), module.__name__
        assert module.triton_cross_entropy is tce
