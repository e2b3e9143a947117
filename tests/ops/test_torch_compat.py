"""What differs between the torch versions CI runs (2.7.1, the users' MindSpeed-LLM pin, to 2.13):
int32 targets, ``addmm``'s ``out_dtype`` (torch 2.8 on) and its exact fallback, the version floor."""

import re
import warnings

import pytest
import torch

from support.backends import backend_devices, backend_ids
from support import cross_entropy_zloss_float64, relative_error
from mindspeed_cez import linear_forward_grads as acc
from mindspeed_cez import LinearCrossEntropyOptions
from mindspeed_cez import linear_cross_entropy_zloss
from mindspeed_cez._requirements import TORCH_MIN, check_torch


@pytest.mark.parametrize("backend_device", backend_devices(), ids=backend_ids(backend_devices()))
def test_int32_targets_through_the_fused_output_layer(backend_device):
    name, device = backend_device
    gen = torch.Generator().manual_seed(21)
    hidden = torch.randn(11, 16, generator=gen)
    weight = torch.randn(40, 16, generator=gen) / 2
    target = torch.randint(0, 40, (11,), generator=gen)
    target[3] = -100
    upstream = torch.randn(11, generator=gen)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    loss64, _, _ = cross_entropy_zloss_float64(h64 @ w64.t(), target, z_loss_coeff=1e-3)
    (loss64 * upstream.double()).sum().backward()
    h, w = hidden.to(device).requires_grad_(), weight.to(device).requires_grad_()
    loss, _ = linear_cross_entropy_zloss(h, w, target.int().to(device), z_loss_coeff=1e-3,
                                         options=LinearCrossEntropyOptions(backend=name))
    (loss * upstream.to(device)).sum().backward()
    assert relative_error(loss.cpu(), loss64) < 1e-5
    assert relative_error(h.grad.cpu(), h64.grad) < 1e-5 and relative_error(w.grad.cpu(), w64.grad) < 1e-5


def test_addmm_out_dtype_is_detected_from_the_operator_schema():
    newer = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 8)
    assert acc.ADDMM_OUT_DTYPE == newer, (torch.__version__, acc.ADDMM_OUT_DTYPE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_out_dtype_branch_takes_its_arguments_on_this_torch(dtype):
    """Meta tensors (the CPU has no kernel for it; GPUs run it in tests/environments/gpu/test_linear_cross_entropy_gpu.py);
    on a torch without it (2.7.1), forcing it is an error naming the version it needs."""
    a, b = torch.empty(33, 20, dtype=dtype, device="meta"), torch.empty(20, 17, dtype=dtype, device="meta")
    meta = torch.empty(33, 17, device="meta")
    if not acc.ADDMM_OUT_DTYPE:
        with pytest.raises(ValueError, match="needs torch >= 2.8"):
            acc.check_accumulation("addmm_out_dtype")
        return
    acc.Accumulator(meta.device, "addmm_out_dtype")(meta, a, b)
    assert meta.dtype == torch.float32 and meta.shape == (33, 17)


def test_older_torch_gets_an_error_naming_the_version_needed():
    need = ".".join(map(str, TORCH_MIN))
    for old in ("2.1.0", "2.6.0+cu124", "2.7.0"):
        with pytest.raises(ImportError, match=re.escape(f"needs torch >= {need}") + ".*" + re.escape(f"found torch {old}")):
            check_torch(old)
    for ok in (need, "2.7.1+cpu", "2.8.0a0+git1234", "2.13.0"):
        check_torch(ok)


def test_the_direct_kernel_launcher_names_the_triton_versions_it_follows():
    launch = pytest.importorskip("mindspeed_cez.kernels.triton_cross_entropy")
    assert not launch.direct_launch_supported("3.3.1") and not launch.direct_launch_supported("3.2.0")
    assert not launch.direct_launch_supported("3.7.0")
    with pytest.warns(UserWarning, match=r"Triton 3\.3\.1 is outside 3\.4-3\.6"):
        launch.warn_triton_launch.cache_clear()
        launch.warn_triton_launch("3.3.1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        launch.warn_triton_launch("3.3.1")  # once per process
