"""The op on one rank, every backend, against the float64 oracle: loss, z-loss, gradients (also of
scaled and soft-capped logits)."""

import pytest
import torch

from support.backends import DTYPES, GRAD_TOLERANCE, LOSS_TOLERANCE, backend_devices, backend_ids, random_logits
from support import loss_and_grad_float64, relative_error, split_transform
from mindspeed_cez import LogitTransform, vocab_parallel_cross_entropy_zloss

PAIRS = backend_devices()


@pytest.fixture(params=PAIRS, ids=backend_ids(PAIRS))
def backend_device(request):
    return request.param  # (backend name, device): the tests pass the name as the op's backend


def _check(logits_shape, dtype, backend, device, z_loss_coeff, label_smoothing, ignore_fraction=0.2, seed=0,
           as_leaf=True, spread=4.0, **transform):
    gen = torch.Generator().manual_seed(seed)
    vocab = logits_shape[-1]
    base = random_logits(logits_shape, dtype, device, gen, scale=spread)
    target = torch.randint(0, vocab, logits_shape[:-1], generator=gen)
    target[torch.rand(target.shape, generator=gen) < ignore_fraction] = -100
    target = target.to(device)
    upstream = torch.randn(target.shape, generator=gen).to(device)

    exp_loss, exp_z, exp_grad = loss_and_grad_float64(
        base, target, upstream, z_loss_coeff=z_loss_coeff, label_smoothing=label_smoothing, **transform
    )
    leaf = base.clone().requires_grad_(True)
    logits = leaf if as_leaf else leaf * 1  # a non-leaf gets its gradient written in place
    loss, z_loss = vocab_parallel_cross_entropy_zloss(
        logits, target, z_loss_coeff=z_loss_coeff, label_smoothing=label_smoothing, backend=backend,
        logit_transform=split_transform(transform)[1],
    )
    assert loss.dtype == torch.float32 and z_loss.dtype == torch.float32
    assert loss.shape == target.shape and z_loss.shape == target.shape
    assert not z_loss.requires_grad
    assert relative_error(loss, exp_loss) < LOSS_TOLERANCE
    if z_loss_coeff:
        assert relative_error(z_loss, exp_z) < LOSS_TOLERANCE
    else:
        assert torch.count_nonzero(z_loss) == 0
    (grad,) = torch.autograd.grad(loss, logits, upstream)
    assert grad.dtype == dtype and grad.shape == base.shape
    assert relative_error(grad, exp_grad) < GRAD_TOLERANCE[dtype]
    ignored = target == -100
    assert torch.count_nonzero(grad[ignored]) == 0 and torch.count_nonzero(loss[ignored]) == 0
    return logits, grad


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("z_loss_coeff", [0.0, 1e-4, 0.05])
def test_matches_float64_reference(backend_device, dtype, z_loss_coeff):
    backend, device = backend_device
    _check((48, 1000), dtype, backend, device, z_loss_coeff, 0.0, seed=int(z_loss_coeff * 1e4))


@pytest.mark.parametrize("label_smoothing", [0.1, 0.5])
def test_label_smoothing_averages_over_the_vocab(backend_device, label_smoothing):
    backend, device = backend_device
    _check((32, 777), torch.float32, backend, device, 1e-3, label_smoothing, seed=3)


@pytest.mark.parametrize("vocab", [1, 17, 4095, 4097, 9000])
def test_vocab_not_a_multiple_of_the_block(backend_device, vocab):
    backend, device = backend_device
    _check((6, vocab), torch.bfloat16, backend, device, 1e-2, 0.1, seed=vocab)


# (logit_scale, logit_softcap, spread of the logits): a scale alone, a cap alone, both; a cap of 2,
# where a padding column left at -cap would add a measurable exp(-2 - 2) to the sum; logits of
# +-1e4, where tanh is +-1 and its slope 0.
TRANSFORMS = [(0.5, 0.0, 4.0), (1.0, 15.0, 4.0), (2.0, 10.0, 4.0), (1.0, 2.0, 4.0), (1.3, 30.0, 1e4)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("logit_scale,logit_softcap,spread", TRANSFORMS)
def test_scaled_and_soft_capped_logits(backend_device, dtype, logit_scale, logit_softcap, spread):
    """Loss, z-loss and the gradient through the transform, with smoothing and ignored tokens; the
    vocab (1000) leaves the last tile part empty: its padding must stay out of the softmax."""
    backend, device = backend_device
    _check((24, 1000), dtype, backend, device, 1e-3, 0.1, seed=21, as_leaf=False, spread=spread,
           logit_scale=logit_scale, logit_softcap=logit_softcap)


def test_transform_lse_and_custom_ignore_index(backend_device):
    """The lse returned for logging is the transformed logits' lse; a custom ignore_index holds."""
    from support import cross_entropy_zloss_float64
    backend, device = backend_device
    gen = torch.Generator().manual_seed(22)
    base = random_logits((5, 3, 4097), torch.bfloat16, device, gen)
    target = torch.randint(0, 4097, (5, 3), generator=gen)
    target[::2, 0] = 4
    target = target.to(device)
    transform = {"logit_scale": 0.8, "logit_softcap": 12.0}
    loss, z_loss, lse = vocab_parallel_cross_entropy_zloss(base, target, 1e-3, 0.1, 4, backend=backend, return_lse=True,
                                                           logit_transform=LogitTransform(0.8, 12.0))
    exp_loss, exp_z, exp_lse = cross_entropy_zloss_float64(base, target, 1e-3, 0.1, 4, **transform)
    assert relative_error(lse, exp_lse) < LOSS_TOLERANCE and relative_error(loss, exp_loss) < LOSS_TOLERANCE
    assert relative_error(z_loss, exp_z) < LOSS_TOLERANCE and torch.count_nonzero(loss[::2, 0]) == 0
    assert (lse < 12.0 + torch.log(torch.tensor(4097.0))).all()  # capped logits bound the lse


def test_sequence_batch_layout(backend_device):
    backend, device = backend_device
    _check((8, 3, 300), torch.bfloat16, backend, device, 1e-3, 0.0, seed=5)


def test_gradient_reuses_the_buffer_of_non_leaf_logits(backend_device):
    backend, device = backend_device
    logits, grad = _check((16, 257), torch.float32, backend, device, 1e-3, 0.0, seed=7, as_leaf=False)
    assert grad.data_ptr() == logits.data_ptr()


def test_leaf_logits_keep_their_values(backend_device):
    backend, device = backend_device
    gen = torch.Generator().manual_seed(11)
    leaf = random_logits((10, 99), torch.float32, device, gen).requires_grad_(True)
    before = leaf.detach().clone()
    target = torch.randint(0, 99, (10,), generator=gen).to(device)
    loss, _ = vocab_parallel_cross_entropy_zloss(leaf, target, z_loss_coeff=1e-2, backend=backend)
    loss.sum().backward()
    assert torch.equal(leaf.detach(), before)
    assert leaf.grad.data_ptr() != leaf.data_ptr()


def test_second_backward_through_overwritten_logits_fails_loudly(backend_device):
    backend, device = backend_device
    gen = torch.Generator().manual_seed(12)
    leaf = random_logits((4, 50), torch.float32, device, gen).requires_grad_(True)
    target = torch.randint(0, 50, (4,), generator=gen).to(device)
    loss, _ = vocab_parallel_cross_entropy_zloss(leaf * 1, target, backend=backend)
    loss.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="a second backward through the same graph"):
        loss.sum().backward()


def test_all_ignored_gives_zeros_not_nan(backend_device):
    backend, device = backend_device
    leaf = random_logits((5, 64), torch.bfloat16, device).requires_grad_(True)
    target = torch.full((5,), -100, device=device)
    loss, z_loss = vocab_parallel_cross_entropy_zloss(leaf, target, z_loss_coeff=1e-3, label_smoothing=0.1, backend=backend)
    loss.sum().backward()
    assert torch.count_nonzero(loss) == 0 and torch.count_nonzero(z_loss) == 0
    assert torch.count_nonzero(leaf.grad) == 0 and torch.isfinite(leaf.grad.float()).all()


def test_custom_ignore_index(backend_device):
    backend, device = backend_device
    gen = torch.Generator().manual_seed(13)
    base = random_logits((12, 40), torch.float32, device, gen)
    target = torch.randint(0, 40, (12,), generator=gen)
    target[::3] = 7  # a valid id used as the ignore index: those tokens must be ignored
    target = target.to(device)
    upstream = torch.rand(12, generator=gen).to(device) + 0.5
    _, _, exp_grad = loss_and_grad_float64(base, target, upstream, z_loss_coeff=1e-2, ignore_index=7)
    leaf = base.clone().requires_grad_(True)
    loss, _ = vocab_parallel_cross_entropy_zloss(leaf, target, z_loss_coeff=1e-2, ignore_index=7, backend=backend)
    (grad,) = torch.autograd.grad(loss, leaf, upstream)
    assert torch.count_nonzero(loss[::3]) == 0 and torch.count_nonzero(loss[1::3]) == 4
    assert relative_error(grad, exp_grad) < 2e-6


def test_empty_batch(backend_device):
    backend, device = backend_device
    leaf = torch.randn(0, 32, device=device, requires_grad=True)
    target = torch.zeros(0, dtype=torch.long, device=device)
    loss, z_loss = vocab_parallel_cross_entropy_zloss(leaf, target, z_loss_coeff=1e-3, backend=backend)
    loss.sum().backward()
    assert loss.shape == (0,) and z_loss.shape == (0,) and leaf.grad.shape == (0, 32)


def test_transposed_logits_are_copied(backend_device):
    backend, device = backend_device
    gen = torch.Generator().manual_seed(14)
    base_t = random_logits((130, 9), torch.float32, device, gen)
    target = torch.randint(0, 130, (9,), generator=gen).to(device)
    upstream = torch.randn(9, generator=gen).to(device)
    exp_loss, _, exp_grad = loss_and_grad_float64(base_t.t(), target, upstream, z_loss_coeff=1e-3)
    leaf = base_t.clone().requires_grad_(True)
    loss, _ = vocab_parallel_cross_entropy_zloss(leaf.t(), target, z_loss_coeff=1e-3, backend=backend)
    (grad,) = torch.autograd.grad(loss, leaf, upstream)
    assert relative_error(loss, exp_loss) < LOSS_TOLERANCE
    assert relative_error(grad.t(), exp_grad) < 2e-6
    assert torch.equal(leaf.detach(), base_t)


def test_strided_rows_of_a_leaf_are_read_in_place_and_left_intact(backend_device):
    backend, device = backend_device
    gen = torch.Generator().manual_seed(16)
    wide = random_logits((9, 2, 130), torch.float32, device, gen)
    target = torch.randint(0, 130, (9,), generator=gen).to(device)
    upstream = torch.randn(9, generator=gen).to(device)
    exp_loss, _, exp_grad = loss_and_grad_float64(wide[:, 0, :], target, upstream, z_loss_coeff=1e-3)
    leaf = wide.clone().requires_grad_(True)
    loss, _ = vocab_parallel_cross_entropy_zloss(leaf[:, 0, :], target, z_loss_coeff=1e-3, backend=backend)  # row stride 260
    (grad,) = torch.autograd.grad(loss, leaf, upstream)
    assert relative_error(loss, exp_loss) < LOSS_TOLERANCE
    assert relative_error(grad[:, 0, :], exp_grad) < 2e-6 and torch.count_nonzero(grad[:, 1, :]) == 0
    assert torch.equal(leaf.detach(), wide)  # a view of a leaf is not a buffer to overwrite


def test_int32_targets(backend_device):
    backend, device = backend_device
    gen = torch.Generator().manual_seed(15)
    base = random_logits((7, 33), torch.float32, device, gen)
    target = torch.randint(0, 33, (7,), generator=gen).to(device)
    upstream = torch.randn(7, generator=gen).to(device)
    leaf = base.clone().requires_grad_(True)
    loss64, _ = vocab_parallel_cross_entropy_zloss(base, target, z_loss_coeff=1e-3, backend=backend)
    loss32, _ = vocab_parallel_cross_entropy_zloss(leaf, target.int(), z_loss_coeff=1e-3, backend=backend)
    (grad32,) = torch.autograd.grad(loss32, leaf, upstream)
    exp_loss, _, exp_grad = loss_and_grad_float64(base, target, upstream, z_loss_coeff=1e-3)
    assert torch.equal(loss64, loss32) and relative_error(loss32, exp_loss) < LOSS_TOLERANCE
    assert relative_error(grad32, exp_grad) < 2e-6


def test_lse_output_for_logging(backend_device):
    from support import cross_entropy_zloss_float64
    backend, device = backend_device
    gen = torch.Generator().manual_seed(17)
    base = random_logits((6, 5, 300), torch.bfloat16, device, gen)
    target = torch.randint(0, 300, (6, 5), generator=gen).to(device)
    loss, z_loss, lse = vocab_parallel_cross_entropy_zloss(base, target, z_loss_coeff=1e-3, backend=backend, return_lse=True)
    _, _, exp_lse = cross_entropy_zloss_float64(base, target, z_loss_coeff=1e-3)
    assert lse.shape == target.shape and not lse.requires_grad
    assert relative_error(lse, exp_lse) < LOSS_TOLERANCE
    assert torch.allclose(z_loss, 1e-3 * lse * lse)


def test_backward_gets_no_zero_tensors_for_the_logging_outputs(backend_device, monkeypatch):
    """z_loss and lse are not differentiable: autograd must not allocate zero gradients for them
    (8 bytes per token of peak memory, two fill launches)."""
    from mindspeed_cez.cross_entropy_zloss import VocabParallelCrossEntropyZLoss

    backend, device = backend_device
    seen = []
    backward = VocabParallelCrossEntropyZLoss.backward

    def recording_backward(ctx, grad_loss, grad_z_loss, grad_lse):
        seen.append((grad_loss, grad_z_loss, grad_lse))
        return backward(ctx, grad_loss, grad_z_loss, grad_lse)

    monkeypatch.setattr(VocabParallelCrossEntropyZLoss, "backward", staticmethod(recording_backward))
    leaf = random_logits((4, 3, 50), torch.float32, device).requires_grad_(True)
    target = torch.randint(0, 50, (4, 3)).to(device)
    loss, z_loss = vocab_parallel_cross_entropy_zloss(leaf, target, z_loss_coeff=1e-2, backend=backend)
    (loss.sum() + z_loss.sum()).backward()
    ((grad_loss, grad_z_loss, grad_lse),) = seen
    assert grad_loss is not None and grad_z_loss is None and grad_lse is None
    assert torch.isfinite(leaf.grad).all() and torch.count_nonzero(leaf.grad) > 0


@pytest.mark.parametrize("logit_softcap", [30.0, 100.0])
def test_soft_cap_gradient_within_liger_tolerance(backend_device, logit_softcap):
    """Liger-Kernel's soft-cap check, element-wise against float64: fp32 logits near zero (tanh's
    argument ~1e-5..1e-2, where ``1 - exp(-2|u|)`` cancels: an absolute error of ~cap * 3e-8 in z,
    hundreds of elements off before tanh's series), of order one, and large (tanh at +-1), every
    gradient element within rtol 1e-6 / atol 1e-8 (3 x 31 x 47 = 4371 elements, as Liger's)."""
    backend, device = backend_device
    gen = torch.Generator().manual_seed(int(logit_softcap) + 63)
    # 16 rows each: |x| ~ 1e-3 .. 1 (|z| < ~4, where fp32's softmax itself holds 1e-6) and 30 * cap
    # (tanh at +-1 for most, a tiny slope for the rest)
    spreads = torch.tensor([1e-3, 1e-2, 0.1, 0.3, 1.0, 30 * logit_softcap]).repeat_interleave(16)[:93, None]
    base = (torch.randn(93, 47, generator=gen) * spreads).reshape(3, 31, 47).to(device)
    target = torch.randint(0, 47, (3, 31), generator=gen).to(device)
    upstream = torch.randn(3, 31, generator=gen).to(device)
    transform = {"logit_softcap": logit_softcap, "logit_scale": 1.0}
    exp_loss, _, exp_grad = loss_and_grad_float64(base, target, upstream, z_loss_coeff=1e-4, **transform)
    logits = base.clone().requires_grad_(True)
    loss, _ = vocab_parallel_cross_entropy_zloss(logits, target, z_loss_coeff=1e-4, backend=backend,
                                                 logit_transform=LogitTransform(cap=logit_softcap))
    (grad,) = torch.autograd.grad(loss, logits, upstream)
    assert relative_error(loss, exp_loss) < LOSS_TOLERANCE
    torch.testing.assert_close(grad.double(), exp_grad, rtol=1e-6, atol=1e-8)
