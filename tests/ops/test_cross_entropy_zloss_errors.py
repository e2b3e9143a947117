"""Bad input gets a clear error naming the argument, never a silent wrong loss."""

import math

import pytest
import torch

from mindspeed_cez import linear_cross_entropy_zloss, vocab_parallel_cross_entropy_zloss
from mindspeed_cez import LogitTransform


def _inputs(n=6, vocab=20):
    return torch.randn(n, vocab), torch.randint(0, vocab, (n,))


@pytest.mark.parametrize("bad", [20, 25, -1, -101])
def test_target_out_of_range(bad):
    logits, target = _inputs()
    target[2] = bad
    with pytest.raises(ValueError, match=rf"target holds {bad}, outside \[0, 20\)"):
        vocab_parallel_cross_entropy_zloss(logits, target)


def test_shape_mismatch_names_both():
    logits, target = _inputs()
    with pytest.raises(ValueError, match="logits must be target's shape plus a vocab dimension"):
        vocab_parallel_cross_entropy_zloss(logits, target[:-1])
    with pytest.raises(ValueError, match="logits"):
        vocab_parallel_cross_entropy_zloss(logits[0], target[0])


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64])
def test_logits_must_be_floating_point(dtype):
    logits, target = _inputs()
    with pytest.raises(TypeError, match="logits must be a floating-point tensor"):
        vocab_parallel_cross_entropy_zloss(logits.to(dtype), target)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_target_must_be_integer(dtype):
    logits, target = _inputs()
    with pytest.raises(TypeError, match="target must be an integer tensor"):
        vocab_parallel_cross_entropy_zloss(logits, target.to(dtype))


@pytest.mark.parametrize("coeff", [-1e-4, math.nan, math.inf, "1e-4"])
def test_bad_z_loss_coeff(coeff):
    logits, target = _inputs()
    with pytest.raises(ValueError, match="z_loss_coeff must be a finite number >= 0"):
        vocab_parallel_cross_entropy_zloss(logits, target, z_loss_coeff=coeff)


@pytest.mark.parametrize("alpha", [-0.1, 1.0, 1.5, math.nan])
def test_bad_label_smoothing(alpha):
    logits, target = _inputs()
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\)"):
        vocab_parallel_cross_entropy_zloss(logits, target, label_smoothing=alpha)


def test_empty_vocab():
    with pytest.raises(ValueError, match="empty vocab"):
        vocab_parallel_cross_entropy_zloss(torch.randn(3, 0), torch.zeros(3, dtype=torch.long))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kernels_turn_an_out_of_range_target_into_nan(backend):
    """Accelerators have no Python range check on the hot path: the partials poison the loss."""
    from support.backends import triton_runs_on_cpu
    from mindspeed_cez import kernels
    from mindspeed_cez.kernels import TARGET_TERM, LossSpec, VocabShard, row

    if backend == "triton" and not triton_runs_on_cpu():
        pytest.skip("the Triton kernels take CPU tensors only under TRITON_INTERPRET=1")
    logits = torch.randn(4, 30)
    target = torch.tensor([3, 30, -5, -100])
    partials = kernels.get_backend(backend).shard_partials(logits, target, LossSpec(), VocabShard.whole(30))
    terms = row(partials, TARGET_TERM, 4)
    assert torch.isnan(terms[1]) and torch.isnan(terms[2])
    assert torch.isfinite(terms[[0, 3]]).all() and terms[0] == logits[0, 3]


@pytest.mark.parametrize("scale", [0.0, -1.0, math.nan, math.inf, "2", True])
def test_bad_logit_scale(scale):
    logits, target = _inputs()
    with pytest.raises(ValueError, match="logit_scale must be a finite number > 0"):
        vocab_parallel_cross_entropy_zloss(logits, target, logit_transform=LogitTransform(scale=scale))


@pytest.mark.parametrize("cap", [-1.0, math.nan, math.inf, -math.inf, None])
def test_bad_logit_softcap(cap):
    logits, target = _inputs()
    with pytest.raises(ValueError, match=r"logit_softcap must be a finite number >= 0 \(0: no cap\)"):
        vocab_parallel_cross_entropy_zloss(logits, target, return_lse=True, logit_transform=LogitTransform(cap=cap))


@pytest.mark.parametrize("value", [None, 1.5, "-100", True])
def test_ignore_index_must_be_an_int(value):
    """Both ops name ``ignore_index`` (not torch's ``where()`` overloads)."""
    logits, target = _inputs()
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        vocab_parallel_cross_entropy_zloss(logits, target, ignore_index=value)
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        linear_cross_entropy_zloss(torch.randn(6, 4), torch.randn(20, 4), target, ignore_index=value)
    with pytest.raises(ValueError, match="ignore_index must fit in int64"):
        vocab_parallel_cross_entropy_zloss(logits, target, ignore_index=1 << 63)
