"""``backend="cann"`` (torch_npu's ``npu_cross_entropy_loss``) against its documented contract,
on CPU through the stand-in ``tests/support/stand_ins/cann/torch_npu.py`` (recording calls, refusing what
the documentation says the op does not take, computing the documented outputs and gradients):
the package's conventions on top of it (z-loss returned, lse, ignore_index, label smoothing,
fp32 results) against float64, what it sends the op, and the loud refusals.
"""

import importlib.util
import os

import pytest
import torch

from support import STAND_INS, cross_entropy_zloss_float64, loss_and_grad_float64, relative_error

import mindspeed_cez.cross_entropy_zloss as op_module
from mindspeed_cez import linear_cross_entropy_zloss, vocab_parallel_cross_entropy_zloss
from mindspeed_cez import LinearCrossEntropyOptions
from mindspeed_cez.kernels import cann
from mindspeed_cez.kernels import LogitTransform
from mindspeed_cez.patches import settings

STAND_IN = os.path.join(STAND_INS, "cann", "torch_npu.py")
IGNORE = -100


@pytest.fixture
def torch_npu(monkeypatch):
    spec = importlib.util.spec_from_file_location("torch_npu", STAND_IN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(__import__("sys").modules, "torch_npu", module)
    return module


def _inputs(dtype, seed, shape=(6, 5), vocab=257):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=gen) * 2).to(dtype)
    target = torch.randint(0, vocab, shape, generator=gen)
    target.view(-1)[::4] = IGNORE
    upstream = torch.rand(shape, generator=gen) + 0.5
    return logits, target, upstream


@pytest.mark.parametrize("dtype, tol", [(torch.float32, (1e-6, 1e-6)), (torch.bfloat16, (1e-2, 1e-2))])
@pytest.mark.parametrize("coeff, smoothing", [(0.0, 0.0), (1e-3, 0.0), (1e-3, 0.1), (0.0, 0.2)])
def test_matches_float64_with_the_packages_conventions(torch_npu, dtype, tol, coeff, smoothing):
    logits, target, upstream = _inputs(dtype, seed=int(1e4 * coeff + 10 * smoothing) + (dtype == torch.bfloat16))
    x = logits.clone().requires_grad_(True)
    loss, z_loss = vocab_parallel_cross_entropy_zloss(x, target, coeff, smoothing, backend="cann")
    (loss * upstream).sum().backward()
    loss64, z64, grad64 = loss_and_grad_float64(logits, target, upstream, z_loss_coeff=coeff,
                                                label_smoothing=smoothing)
    assert loss.dtype == z_loss.dtype == torch.float32 and loss.shape == target.shape
    assert relative_error(loss, loss64) < tol[0]
    assert relative_error(z_loss, z64) < tol[0] if coeff else not z_loss.any()
    assert relative_error(x.grad, grad64) < tol[1]
    assert not loss[target == IGNORE].any() and not x.grad[target == IGNORE].any()
    assert not z_loss.requires_grad

    _, _, lse = vocab_parallel_cross_entropy_zloss(logits, target, coeff, smoothing, backend="cann", return_lse=True)
    lse64 = cross_entropy_zloss_float64(logits, target)[2]
    assert relative_error(lse, lse64) < tol[0]


def test_what_it_sends_the_op(torch_npu):
    logits, target, _ = _inputs(torch.bfloat16, seed=3)
    vocab_parallel_cross_entropy_zloss(logits.requires_grad_(True), target, 1e-4, 0.1, backend="cann")
    call = torch_npu.CALLS[-1]
    assert call["input"] == ((30, 257), torch.bfloat16, True)  # [N, C] rows of the [s, b, V] logits
    assert call["reduction"] == "none" and call["weight"] is None
    assert call["label_smoothing"] == 0.0, "with a gradient the op takes no smoothing: the package adds it"
    assert call["ignore_index"] == -100 and bool((call["target"] >= 0).all()), "ignored tokens masked, not sent"
    assert call["lse_square_scale_for_zloss"] == 0.0 and call["return_zloss"] is False, \
        "CANN's z-loss arguments have no effect: the z-loss is made from the lse"


def test_stand_in_refuses_what_the_documentation_rules_out(torch_npu):
    """The stand-in's own contract, so that the backend is tested against a strict op."""
    logits, target, _ = _inputs(torch.float32, seed=4, shape=(8,))
    x = logits.requires_grad_(True)
    with pytest.raises(RuntimeError, match="no label_smoothing"):
        torch_npu.npu_cross_entropy_loss(x, target.clamp_min(0), reduction="none", label_smoothing=0.1)
    with pytest.raises(RuntimeError, match="only the defaults"):
        torch_npu.npu_cross_entropy_loss(x, target.clamp_min(0), ignore_index=3)
    with pytest.raises(RuntimeError, match="int64"):
        torch_npu.npu_cross_entropy_loss(x, target.int(), reduction="none")


def test_refused_where_it_does_not_apply(torch_npu, monkeypatch):
    logits, target, _ = _inputs(torch.float32, seed=5)
    with pytest.raises(ValueError, match="LogitTransform\\(scale=1.0, cap=30.0\\) needs backend='triton'"):
        vocab_parallel_cross_entropy_zloss(logits, target, backend="cann", logit_transform=LogitTransform(cap=30.0))
    with pytest.raises(ValueError, match="LogitTransform\\(scale=0.5, cap=0.0\\) needs"):
        vocab_parallel_cross_entropy_zloss(logits, target, backend="cann", logit_transform=LogitTransform(scale=0.5))
    # vocab shards: the op asks the group's size (here: a group of two, without collectives)
    with monkeypatch.context() as m:
        m.setattr(op_module, "group_rank_and_size", lambda group: (0, 2))
        with pytest.raises(ValueError, match="tensor-parallel group has 2 ranks.*backend='triton'"):
            vocab_parallel_cross_entropy_zloss(logits, target, backend="cann")
    assert not torch_npu.CALLS, "refused before the op was called"
    hidden, weight = torch.randn(4, 8), torch.randn(16, 8)
    with pytest.raises(ValueError, match="backend='cann'.*fused output layer"):
        linear_cross_entropy_zloss(hidden, weight, torch.zeros(4, dtype=torch.long),
                                   options=LinearCrossEntropyOptions(backend="cann"))
    with pytest.raises(ValueError, match="target holds 999"):
        vocab_parallel_cross_entropy_zloss(logits, target.clamp_min(0) + 999, backend="cann")


def test_the_z_loss_is_not_the_ops(torch_npu):
    """The stand-in returns zeros for its z-loss outputs (CANN's page: the z-loss arguments have no
    effect): the z-loss and its gradient are still there, made from the lse."""
    logits, target, upstream = _inputs(torch.float32, seed=6)
    x = logits.clone().requires_grad_(True)
    loss, z_loss = vocab_parallel_cross_entropy_zloss(x, target, 1e-2, backend="cann")
    (loss * upstream).sum().backward()
    loss64, z64, grad64 = loss_and_grad_float64(logits, target, upstream, z_loss_coeff=1e-2)
    ce64 = cross_entropy_zloss_float64(logits, target)[0]
    assert z_loss[target != IGNORE].min() > 0 and relative_error(z_loss, z64) < 1e-6
    assert relative_error(loss, loss64) < 1e-6 and relative_error(loss - z_loss, ce64) < 1e-6
    assert relative_error(x.grad, grad64) < 1e-6


def test_without_torch_npu(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "torch_npu", None)  # import fails
    assert not cann.available()
    logits, target, _ = _inputs(torch.float32, seed=7)
    with pytest.raises(RuntimeError, match="backend='cann' needs torch_npu"):
        vocab_parallel_cross_entropy_zloss(logits, target, backend="cann")


def test_flag_path_takes_it_where_the_vocab_is_not_sharded(torch_npu, monkeypatch):
    assert settings.backends_from_environment({"MINDSPEED_CEZ_BACKEND": "cann"}) == {"backend": "cann",
                                                                                      "linear_backend": None}
    monkeypatch.setitem(__import__("sys").modules, "torch_npu", None)  # a machine without torch_npu: at startup
    with pytest.raises(ValueError, match="MINDSPEED_CEZ_BACKEND=cann needs torch_npu"):
        settings.backends_from_environment({"MINDSPEED_CEZ_BACKEND": "cann"})
    assert settings.Settings(z_loss_coeff=1e-4, backend="cann").backend == "cann"
    with pytest.raises(ValueError, match="--lm-fused-output-layer"):
        settings.Settings(backend="cann", fused_output_layer=True)
    with pytest.raises(ValueError, match="--output-logit-softcapping need MINDSPEED_CEZ_BACKEND=triton"):
        settings.Settings(backend="cann", logit_transform=LogitTransform(0.5, 0.0))
    with pytest.raises(ValueError, match="MINDSPEED_CEZ_BACKEND='nccl'"):
        settings.backends_from_environment({"MINDSPEED_CEZ_BACKEND": "nccl"})


def test_flag_paths_loss_is_the_ce_value_with_the_z_loss_gradient(torch_npu):
    """What the patched Megatron loss calls with MINDSPEED_CEZ_BACKEND=cann: the value of ``lm loss`` is
    the CE, the gradient that of CE + z-loss (Megatron's convention for auxiliary losses)."""
    from mindspeed_cez.patches import loss_wrappers
    from mindspeed_cez.patches.settings import Settings

    logits, target, upstream = _inputs(torch.float32, seed=8)
    x = logits.clone().requires_grad_(True)
    loss, z_loss, lse = loss_wrappers.megatron_cross_entropy(Settings(z_loss_coeff=1e-3, backend="cann"), x, target,
                                                             None, 0.0)
    (loss * upstream).sum().backward()
    ce64, _, _ = cross_entropy_zloss_float64(logits, target)
    _, z64, grad64 = loss_and_grad_float64(logits, target, upstream, z_loss_coeff=1e-3)
    assert relative_error(loss, ce64) < 1e-6 and relative_error(z_loss, z64) < 1e-6
    assert relative_error(x.grad, grad64) < 1e-6
    assert torch_npu.CALLS[-1]["lse_square_scale_for_zloss"] == 0.0


def test_first_order_only_and_a_second_backward(torch_npu):
    """As the other backends: under ``create_graph=True`` the gradient is right and differentiating it
    again raises naming the op, whatever torch_npu's backward records; the gradient is not written in
    place, so a second backward is right."""
    logits, target, upstream = _inputs(torch.float32, seed=9)
    x = logits.clone().requires_grad_(True)
    loss, _ = vocab_parallel_cross_entropy_zloss(x * 1, target, 1e-3, backend="cann")
    (grad,) = torch.autograd.grad(loss, x, upstream, create_graph=True)
    assert relative_error(grad, loss_and_grad_float64(logits, target, upstream, z_loss_coeff=1e-3)[2]) < 1e-6
    with pytest.raises(RuntimeError, match="vocab_parallel_cross_entropy_zloss is first-order only"):
        grad.square().sum().backward()
    loss, _ = vocab_parallel_cross_entropy_zloss(x * 1, target, 1e-3, backend="cann")
    loss.backward(upstream, retain_graph=True)
    once = x.grad.clone()
    loss.backward(upstream)
    assert torch.allclose(x.grad, 2 * once)
