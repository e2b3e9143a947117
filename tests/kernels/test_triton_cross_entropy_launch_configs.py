"""The Triton kernels under each device type's launch settings, on the device at hand.

The kernel source is shared by CUDA and Ascend; what differs is the launch: CUDA views a tile as
many 8-column slots and runs several programs per core, Ascend one slot per tile and one
program per core. Both settings run here (under the interpreter on the CPU, compiled on CUDA),
so the Ascend shape of the kernels is exercised even without an Ascend machine. Row counts are
chosen so programs get ragged chunks of rows (and some none), vocab sizes so rows span several
tiles with a partial last one.
"""

import pytest
import torch

from support.backends import GRAD_TOLERANCE, LOSS_TOLERANCE, random_logits, triton_runs_on_cpu
from support import cross_entropy_zloss_float64, loss_and_grad_float64, relative_error
from mindspeed_cez import kernels, vocab_parallel_cross_entropy_zloss

pytestmark = pytest.mark.skipif(
    not (triton_runs_on_cpu() or (torch.cuda.is_available() and kernels.triton_available())),
    reason="needs Triton (CUDA, or the interpreter on the CPU)",
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SETTINGS = {
    # CUDA's shape at small sizes: 8-column slots, several programs per core.
    "cuda-like": {"fwd_block_v": 1024, "slot_width": 8, "fwd_warps": 4, "fwd_per_core": 2,
                  "bwd_block_v": 512, "bwd_warps": 4, "bwd_per_core": 2},
    # Ascend's: one slot per tile, one program per core, contiguous chunks of rows.
    "npu-like": {"fwd_block_v": 512, "slot_width": None, "fwd_warps": 4, "fwd_per_core": 1,
                 "bwd_block_v": 1024, "bwd_warps": 4, "bwd_per_core": 1},
}


@pytest.fixture(params=list(SETTINGS), ids=list(SETTINGS))
def launch_settings(request):
    from mindspeed_cez.kernels import triton_cross_entropy as tce

    shipped = tce.LAUNCH_CONFIG[DEVICE]
    tce.LAUNCH_CONFIG[DEVICE] = [(0, dict(SETTINGS[request.param]))]
    tce.launch_plans_changed()
    try:
        yield request.param
    finally:
        tce.LAUNCH_CONFIG[DEVICE] = shipped
        tce.launch_plans_changed()


@pytest.mark.parametrize(
    "n,vocab,dtype,z_loss_coeff,label_smoothing",
    [
        (50, 3000, torch.bfloat16, 1e-3, 0.0),  # 16 cores x 1-2 programs: chunks of 2-4 rows, some programs idle
        (37, 2049, torch.float32, 1e-2, 0.1),  # one column past a power of two
        (5, 700, torch.float16, 0.0, 0.2),  # fewer rows than programs
        (64, 128, torch.bfloat16, 1e-4, 0.0),  # one tile per row
    ],
)
def test_loss_and_grad(launch_settings, n, vocab, dtype, z_loss_coeff, label_smoothing):
    gen = torch.Generator().manual_seed(n * vocab)
    base = random_logits((n, vocab), dtype, DEVICE, gen)
    target = torch.randint(0, vocab, (n,), generator=gen)
    target[torch.rand(n, generator=gen) < 0.2] = -100
    target[0], target[-1] = vocab - 1, 0
    target = target.to(DEVICE)
    upstream = torch.randn(n, generator=gen).to(DEVICE)
    exp_loss, exp_z, exp_grad = loss_and_grad_float64(
        base, target, upstream, z_loss_coeff=z_loss_coeff, label_smoothing=label_smoothing
    )
    logits = base.clone().requires_grad_(True) * 1
    loss, z_loss = vocab_parallel_cross_entropy_zloss(
        logits, target, z_loss_coeff=z_loss_coeff, label_smoothing=label_smoothing, backend="triton"
    )
    assert relative_error(loss, exp_loss) < LOSS_TOLERANCE
    if z_loss_coeff:
        assert relative_error(z_loss, exp_z) < LOSS_TOLERANCE
    (grad,) = torch.autograd.grad(loss, logits, upstream)
    assert relative_error(grad, exp_grad) < GRAD_TOLERANCE[dtype]


@pytest.mark.parametrize("world_size", [2, 3])
def test_partials_of_shards_combine_to_the_full_vocab(launch_settings, world_size):
    """The multi-rank path's two kernels (partials, loss), the all-gather done by hand (a stack)."""
    from mindspeed_cez.kernels import triton_cross_entropy as tce
    from mindspeed_cez.kernels import LossSpec, VocabShard

    n, v_local, coeff, alpha = 45, 1500, 1e-3, 0.1
    spec = LossSpec(-100, coeff, alpha)
    vocab = v_local * world_size
    gen = torch.Generator().manual_seed(world_size)
    full = random_logits((n, vocab), torch.bfloat16, DEVICE, gen)
    full[:, :v_local] += 6.0  # the first shard holds the largest logits: the others get rescaled
    target = torch.randint(0, vocab, (n,), generator=gen)
    target[::5] = -100
    target = target.to(DEVICE)
    parts = [
        tce.shard_partials(full[:, r * v_local : (r + 1) * v_local], target, spec,
                           VocabShard(r * v_local, v_local, vocab, r, world_size))
        for r in range(world_size)
    ]
    out = tce.loss_from_partials(torch.stack(parts), target, spec)
    exp_loss, exp_z, exp_lse = cross_entropy_zloss_float64(full, target, z_loss_coeff=coeff, label_smoothing=alpha)
    assert relative_error(out[0], exp_loss) < LOSS_TOLERANCE
    assert relative_error(out[1], exp_z) < LOSS_TOLERANCE
    assert relative_error(out[2], exp_lse) < LOSS_TOLERANCE


def test_expanded_upstream_gradient_of_a_sum(launch_settings):
    """``loss.sum().backward()`` hands the op a stride-0 upstream gradient: read, not copied."""
    gen = torch.Generator().manual_seed(21)
    base = random_logits((6, 7, 300), torch.float32, DEVICE, gen)
    target = torch.randint(0, 300, (6, 7), generator=gen)
    target[1] = -100
    target = target.to(DEVICE)
    _, _, exp_grad = loss_and_grad_float64(base, target, torch.ones(6, 7, device=DEVICE), z_loss_coeff=1e-2)
    leaf = base.clone().requires_grad_(True)
    loss, _ = vocab_parallel_cross_entropy_zloss(leaf, target, z_loss_coeff=1e-2, backend="triton")
    loss.sum().backward()
    assert relative_error(leaf.grad, exp_grad) < GRAD_TOLERANCE[torch.float32]
    assert torch.count_nonzero(leaf.grad[1]) == 0
