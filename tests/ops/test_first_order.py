"""What autograd may ask of both ops beyond one backward, with every backend and gradient path:
``create_graph=True`` (the first-order gradient right, a second-order one refused naming the op), a
second backward through the same graph (right where the op can serve it, else refused naming the op);
and the fused layer's forward path at 0 tokens and with a non-finite ``grad_scale``."""

import pytest
import torch

from support.backends import backend_devices, backend_ids
from mindspeed_cez import linear_cross_entropy_zloss, vocab_parallel_cross_entropy_zloss
from mindspeed_cez import GradientPath, LinearCrossEntropyOptions, TrainerInputs
from mindspeed_cez.patches.loss_wrappers import main_grad_target  # the adaptor's weight-gradient target
from mindspeed_cez import ForwardGradientLedger  # noqa: E402

LEDGER = ForwardGradientLedger()  # the forwards of these tests that owe a backward

PAIRS = backend_devices()
# the fused layer's paths: recompute (GEMM chunks or the Triton tl.dot kernels), gradients in forward with
# token weights alone, with a known upstream gradient, and with the weight's gradient into main_grad
LINEAR_PATHS = ["recompute", "recompute-triton", "forward", "scaled", "main_grad"]
SCALE = 0.5


def _logits_problem(device, seed=0, n=6, vocab=40):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, vocab, generator=gen) * 3).to(device).requires_grad_(True)
    target = torch.randint(0, vocab, (n,), generator=gen).to(device)
    return x, target


def _linear_problem(device, seed=0, n=6, h=8, vocab=40):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen).to(device).requires_grad_(True)
    weight = (torch.randn(vocab, h, generator=gen) / 2).to(device).requires_grad_(True)
    target = torch.randint(0, vocab, (n,), generator=gen).to(device)
    mask = (torch.rand(n, generator=gen) < 0.7).float().to(device)
    return hidden, weight, target, mask


def _linear_loss(hidden, weight, target, mask, backend, path):
    """(loss, the upstream gradient the path serves)."""
    if path.startswith("recompute"):
        options = LinearCrossEntropyOptions(path=GradientPath("recompute"), backend=backend,
                                            linear_backend="triton" if path == "recompute-triton" else "gemm")
        trainer = None
        upstream = torch.rand(target.shape, generator=torch.Generator().manual_seed(1)).to(target.device)
    else:
        options = LinearCrossEntropyOptions(path=GradientPath("forward"), backend=backend)
        trainer = TrainerInputs(token_weights=mask)
        upstream = SCALE * mask
        if path == "main_grad":
            weight.main_grad = torch.zeros(weight.shape, device=weight.device)
            trainer = TrainerInputs(token_weights=mask, grad_scale=torch.tensor(SCALE, device=target.device),
                                    weight_grad=main_grad_target(weight), ledger=LEDGER)
        elif path == "scaled":
            trainer = TrainerInputs(token_weights=mask, grad_scale=SCALE)
    loss, _ = linear_cross_entropy_zloss(hidden, weight, target, 1e-3, 0.1, options=options, trainer=trainer)
    return loss, upstream


def _skip_triton_linear(backend, path):
    if path == "recompute-triton" and backend != "triton":
        pytest.skip("the Triton linear kernels run with the Triton backend")


@pytest.mark.parametrize("backend,device", PAIRS, ids=backend_ids(PAIRS))
@pytest.mark.parametrize("leaf", [True, False], ids=["leaf", "intermediate"])
def test_op_is_first_order_only(backend, device, leaf):
    x, target = _logits_problem(device)
    (expected,) = torch.autograd.grad(vocab_parallel_cross_entropy_zloss(x * 1, target, 1e-3, backend=backend)[0].sum(), x)
    logits = x if leaf else x * 1
    loss, _ = vocab_parallel_cross_entropy_zloss(logits, target, 1e-3, backend=backend)
    (grad,) = torch.autograd.grad(loss.sum(), x, create_graph=True)
    assert torch.allclose(grad, expected)  # the first order is right
    with pytest.raises(RuntimeError, match="vocab_parallel_cross_entropy_zloss is first-order only"):
        (grad * grad).sum().backward()
    assert x.grad is None


@pytest.mark.parametrize("backend,device", PAIRS, ids=backend_ids(PAIRS))
@pytest.mark.parametrize("path", LINEAR_PATHS)
def test_linear_op_is_first_order_only(backend, device, path):
    _skip_triton_linear(backend, path)
    hidden, weight, target, mask = _linear_problem(device)
    loss, upstream = _linear_loss(hidden, weight, target, mask, backend, path)
    expected = torch.autograd.grad(loss, hidden, upstream)[0]
    loss, upstream = _linear_loss(hidden, weight, target, mask, backend, path)
    (grad,) = torch.autograd.grad(loss, hidden, upstream, create_graph=True)
    assert torch.allclose(grad, expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="linear_cross_entropy_zloss is first-order only"):
        grad.square().sum().backward()
    assert hidden.grad is None and weight.grad is None


@pytest.mark.parametrize("backend,device", PAIRS, ids=backend_ids(PAIRS))
def test_op_second_backward_right_on_a_leaf_refused_in_place(backend, device):
    x, target = _logits_problem(device)
    loss, _ = vocab_parallel_cross_entropy_zloss(x, target, 1e-3, backend=backend)  # a fresh gradient tensor
    loss.sum().backward(retain_graph=True)
    once = x.grad.clone()
    loss.sum().backward()
    assert torch.allclose(x.grad, 2 * once)
    x.grad = None
    loss, _ = vocab_parallel_cross_entropy_zloss(x * 1, target, 1e-3, backend=backend)  # into the logits' buffer
    loss.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="vocab_parallel_cross_entropy_zloss: a second backward .* is not served"):
        loss.sum().backward()
    assert torch.equal(x.grad, once)


@pytest.mark.parametrize("backend,device", PAIRS, ids=backend_ids(PAIRS))
@pytest.mark.parametrize("path", LINEAR_PATHS)
def test_linear_op_second_backward_right_or_refused(backend, device, path):
    """``recompute`` recomputes, so a second backward adds the same gradients again; the forward path
    made its gradients in the forward for one backward (``main_grad`` got the weight's during the
    forward): a second backward raises and leaves every gradient as the first left it."""
    _skip_triton_linear(backend, path)
    hidden, weight, target, mask = _linear_problem(device)
    loss, upstream = _linear_loss(hidden, weight, target, mask, backend, path)
    loss.backward(upstream, retain_graph=True)
    grads = [t.clone() for t in (hidden.grad, weight.main_grad if path == "main_grad" else weight.grad)]
    if path.startswith("recompute"):
        loss.backward(upstream)
        assert torch.allclose(hidden.grad, 2 * grads[0]) and torch.allclose(weight.grad, 2 * grads[1])
        return
    with pytest.raises(RuntimeError, match="GradientPath\\('forward'\\)\\) made its gradients during the forward for one "
                                           "backward.*GradientPath\\('recompute'\\)"):
        loss.backward(upstream)
    assert torch.equal(hidden.grad, grads[0])
    assert torch.equal(weight.main_grad if path == "main_grad" else weight.grad, grads[1])


@pytest.mark.parametrize("backend,device", PAIRS, ids=backend_ids(PAIRS))
@pytest.mark.parametrize("path", ["forward", "scaled", "main_grad"])
def test_forward_path_takes_zero_tokens(backend, device, path):
    """As the op and ``recompute`` do: an empty loss, zero gradients."""
    hidden, weight, target, mask = _linear_problem(device, n=0)
    loss, upstream = _linear_loss(hidden, weight, target, mask, backend, path)
    assert loss.shape == (0,)
    loss.backward(upstream)
    assert hidden.grad.shape == (0, 8) and not hidden.grad.any()
    assert not (weight.main_grad if path == "main_grad" else weight.grad).any()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_grad_scale_tensor_is_refused(bad):
    """Like a non-finite float: a ValueError naming grad_scale before anything goes into main_grad (CUDA: a
    device-side assert, tests/environments/gpu/test_linear_cross_entropy_gpu.py)."""
    hidden, weight, target, mask = _linear_problem("cpu")
    weight.main_grad = torch.zeros(weight.shape)
    for grad_scale in (torch.tensor(bad), torch.tensor([bad], dtype=torch.float64), bad):
        with pytest.raises(ValueError, match="grad_scale must be (a )?finite"):
            linear_cross_entropy_zloss(hidden, weight, target,
                                       options=LinearCrossEntropyOptions(path=GradientPath("forward")),
                                       trainer=TrainerInputs(token_weights=mask, grad_scale=grad_scale, weight_grad=main_grad_target(weight), ledger=LEDGER))
    assert not weight.main_grad.any()
