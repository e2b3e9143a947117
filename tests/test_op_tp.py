"""Tensor parallel over real gloo processes: each rank's vocab shard gives the unsharded result."""

import re

import pytest
import torch
import torch.distributed as dist

from backends import GRAD_TOLERANCE, LOSS_TOLERANCE, random_logits, triton_runs_on_cpu
from support import loss_and_grad_float64, relative_error, run_on_ranks
from mindspeed_cez import vocab_parallel_cross_entropy_zloss


def _sharded_matches_unsharded(rank, world_size, backend, dtype, z_loss_coeff, label_smoothing, vocab, transform=None):
    transform = transform or {}
    gen = torch.Generator().manual_seed(1234)  # every rank draws the same full problem
    full = random_logits((5, 7, vocab), dtype, "cpu", gen)
    target = torch.randint(0, vocab, (5, 7), generator=gen)
    target[torch.rand(target.shape, generator=gen) < 0.15] = -100
    target[0, 0], target[0, 1] = 0, vocab - 1  # first and last id: owned by the first and last rank
    upstream = torch.randn(target.shape, generator=gen)
    exp_loss, exp_z, exp_grad = loss_and_grad_float64(
        full, target, upstream, z_loss_coeff=z_loss_coeff, label_smoothing=label_smoothing, **transform
    )
    v_local = vocab // world_size
    shard = slice(rank * v_local, (rank + 1) * v_local)
    leaf = full[..., shard].clone().requires_grad_(True)
    loss, z_loss = vocab_parallel_cross_entropy_zloss(
        leaf * 1,
        target,
        z_loss_coeff=z_loss_coeff,
        label_smoothing=label_smoothing,
        tp_group=dist.group.WORLD,
        backend=backend,
        **transform,
    )
    loss.backward(upstream)
    assert relative_error(loss, exp_loss) < LOSS_TOLERANCE
    assert relative_error(z_loss, exp_z) < LOSS_TOLERANCE
    assert relative_error(leaf.grad, exp_grad[..., shard]) < GRAD_TOLERANCE[dtype]


CASES = [
    ("torch", 2, torch.float32, 1e-3, 0.0),
    ("torch", 2, torch.bfloat16, 1e-2, 0.1),
    ("torch", 4, torch.float32, 1e-4, 0.2),
    ("torch", 4, torch.bfloat16, 1e-3, 0.0),
    ("torch", 1, torch.float16, 1e-3, 0.1),
    ("triton", 2, torch.bfloat16, 1e-3, 0.1),
    ("triton", 4, torch.float32, 1e-2, 0.0),
]


@pytest.mark.parametrize("backend,world_size,dtype,z_loss_coeff,label_smoothing", CASES)
def test_tensor_parallel_shards(backend, world_size, dtype, z_loss_coeff, label_smoothing):
    if backend == "triton" and not triton_runs_on_cpu():
        pytest.skip("the Triton kernels take CPU tensors only under TRITON_INTERPRET=1")
    vocab = 4 * 257  # shards of 1028 / 514 / 257 columns: none a multiple of the block
    run_on_ranks(world_size, _sharded_matches_unsharded, backend, dtype, z_loss_coeff, label_smoothing, vocab)


# (backend, world size, dtype, z-loss, smoothing, logit_scale, logit_softcap): per element on each
# shard, merged by the same all-reduces.
TRANSFORM_CASES = [
    ("torch", 2, torch.bfloat16, 1e-3, 0.1, 1.0, 20.0),
    ("torch", 4, torch.float32, 1e-2, 0.0, 0.7, 0.0),
    ("torch", 4, torch.float16, 1e-3, 0.2, 1.5, 8.0),
    ("triton", 2, torch.float32, 1e-3, 0.1, 2.0, 10.0),
    ("triton", 4, torch.bfloat16, 1e-2, 0.1, 1.0, 30.0),
]


@pytest.mark.parametrize("backend,world_size,dtype,z_loss_coeff,label_smoothing,logit_scale,logit_softcap",
                         TRANSFORM_CASES)
def test_tensor_parallel_shards_with_transform(backend, world_size, dtype, z_loss_coeff, label_smoothing, logit_scale,
                                               logit_softcap):
    if backend == "triton" and not triton_runs_on_cpu():
        pytest.skip("the Triton kernels take CPU tensors only under TRITON_INTERPRET=1")
    run_on_ranks(world_size, _sharded_matches_unsharded, backend, dtype, z_loss_coeff, label_smoothing, 4 * 257,
                 {"logit_scale": logit_scale, "logit_softcap": logit_softcap})


def _unequal_shards(rank, world_size):
    logits = torch.randn(4, 10 + 2 * rank)
    target = torch.randint(0, 10, (4,))
    with pytest.raises(ValueError, match=re.escape("logits: tensor-parallel ranks hold vocab shards of unequal width (from 10 to 12)")):
        vocab_parallel_cross_entropy_zloss(logits, target, tp_group=dist.group.WORLD)


def test_unequal_shards_are_refused():
    run_on_ranks(2, _unequal_shards)


def _target_beyond_global_vocab(rank, world_size):
    logits = torch.randn(3, 8)
    target = torch.tensor([0, 15, 16])  # 16 is outside the global vocab of 2 * 8
    with pytest.raises(ValueError, match=re.escape("target holds 16, outside [0, 16)")):
        vocab_parallel_cross_entropy_zloss(logits, target, tp_group=dist.group.WORLD)


def test_target_checked_against_the_global_vocab():
    run_on_ranks(2, _target_beyond_global_vocab)
