"""Tensor parallel over real gloo processes: each rank's vocab shard gives the unsharded result."""

import re

import pytest
import torch
import torch.distributed as dist

from support.backends import GRAD_TOLERANCE, LOSS_TOLERANCE, random_logits, triton_runs_on_cpu
from support import loss_and_grad_float64, relative_error, run_on_ranks, split_transform
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
        logit_transform=split_transform(transform)[1],
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
# shard, merged by the same all-gather.
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


UNEQUAL = re.escape("logits: tensor-parallel ranks hold vocab shards of unequal width (from 10 to 12)") + \
    ".*pad the vocab so it divides evenly by the tensor-parallel size"


def _unequal_shards(rank, world_size, backend):
    logits = torch.randn(4, 10 + 2 * rank)
    target = torch.randint(0, 10, (4,))
    with pytest.raises(ValueError, match=UNEQUAL):
        vocab_parallel_cross_entropy_zloss(logits, target, tp_group=dist.group.WORLD, backend=backend)
    target[0] = 22  # in rank 1's idea of the vocab (2 x 12), outside rank 0's (2 x 10): still the widths' error
    with pytest.raises(ValueError, match=UNEQUAL):
        vocab_parallel_cross_entropy_zloss(logits, target, tp_group=dist.group.WORLD, backend=backend)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_unequal_shards_are_refused_on_every_rank(backend):
    if backend == "triton" and not triton_runs_on_cpu():
        pytest.skip("the Triton kernels take CPU tensors only under TRITON_INTERPRET=1")
    run_on_ranks(2, _unequal_shards, backend, timeout=120)


def _width_changes_between_calls(rank, world_size, backend):
    target = torch.randint(0, 16, (4,))
    for call, width in enumerate((8, 10 if rank == 1 else 8, 8)):  # rank 1 alone changes width in call 1
        logits = torch.randn(4, width)
        if call == 1:
            with pytest.raises(ValueError, match=re.escape("unequal width (from 8 to 10)")):
                vocab_parallel_cross_entropy_zloss(logits, target, tp_group=dist.group.WORLD, backend=backend)
        else:  # before and after: the ranks are still in step
            loss, _ = vocab_parallel_cross_entropy_zloss(logits, target, tp_group=dist.group.WORLD, backend=backend)
            assert torch.isfinite(loss).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_rank_changing_width_is_refused_on_every_rank(backend):
    if backend == "triton" and not triton_runs_on_cpu():
        pytest.skip("the Triton kernels take CPU tensors only under TRITON_INTERPRET=1")
    run_on_ranks(2, _width_changes_between_calls, backend, timeout=120)


def _target_beyond_global_vocab(rank, world_size):
    logits = torch.randn(3, 8)
    target = torch.tensor([0, 15, 16])  # 16 is outside the global vocab of 2 * 8
    with pytest.raises(ValueError, match=re.escape("target holds 16, outside [0, 16)")):
        vocab_parallel_cross_entropy_zloss(logits, target, tp_group=dist.group.WORLD)


def test_target_checked_against_the_global_vocab():
    run_on_ranks(2, _target_beyond_global_vocab)


def _whole_shards_minus_inf(rank, world_size, backend, dtype):
    gen = torch.Generator().manual_seed(99 + world_size)
    v_local = 40
    vocab = v_local * world_size
    full = random_logits((6, vocab), dtype, "cpu", gen)
    full[0, v_local:2 * v_local] = float("-inf")  # rank 1's whole shard (a padded or masked vocab slice)
    full[1, :v_local] = float("-inf")  # rank 0's
    full[2, v_local:] = float("-inf")  # every shard but rank 0's
    full[3, :] = float("-inf")
    full[3, vocab - 1] = 1.0  # every shard but the last rank's, which holds one finite logit
    target = torch.randint(0, v_local, (6,), generator=gen)  # ids in rank 0's shard
    target[1], target[3], target[4] = v_local + 3, vocab - 1, -100
    upstream = torch.randn(6, generator=gen)
    # float64 reference: -1e4 stands for -inf (exp underflows to 0 alike; the reference's label
    # smoothing term would make 0 * inf of -inf)
    exp_loss, exp_z, exp_grad = loss_and_grad_float64(full.double().clamp_min(-1e4), target, upstream,
                                                      z_loss_coeff=1e-3)
    shard = slice(rank * v_local, (rank + 1) * v_local)
    leaf = full[:, shard].clone().requires_grad_(True)
    loss, z_loss = vocab_parallel_cross_entropy_zloss(leaf * 1, target, z_loss_coeff=1e-3, tp_group=dist.group.WORLD,
                                                      backend=backend)
    loss.backward(upstream)
    assert torch.isfinite(loss).all() and torch.isfinite(leaf.grad).all(), (loss, leaf.grad)
    assert relative_error(loss, exp_loss) < LOSS_TOLERANCE
    assert relative_error(z_loss, exp_z) < LOSS_TOLERANCE
    assert relative_error(leaf.grad, exp_grad[:, shard]) < GRAD_TOLERANCE[dtype]


@pytest.mark.parametrize("backend,world_size,dtype", [("torch", 2, torch.float32), ("torch", 4, torch.bfloat16),
                                                      ("triton", 2, torch.bfloat16), ("triton", 4, torch.float32)])
def test_a_whole_shard_of_minus_inf_adds_nothing(backend, world_size, dtype):
    if backend == "triton" and not triton_runs_on_cpu():
        pytest.skip("the Triton kernels take CPU tensors only under TRITON_INTERPRET=1")
    run_on_ranks(world_size, _whole_shards_minus_inf, backend, dtype, timeout=240)
