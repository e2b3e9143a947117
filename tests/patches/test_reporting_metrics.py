"""``lm_z_loss`` / ``lm_lse`` / ``lm_lse_max`` reduction over Megatron's parallel groups (real gloo
processes).

On two ranks laid out as data parallel, context parallel (the sequence split; attention itself
needs Transformer Engine, the reduction does not) or pipeline parallel, each rank records its
own micro-batches with different masks, and every rank must report
``sum(z * mask) / sum(mask)`` over the micro-batches of the ranks that hold the LM head (all of
them for DP and CP, the last pipeline stage for PP), in float64 within fp32 rounding, and the
largest lse among their counted tokens (the largest of all tokens is masked out on purpose).

And ``interval_maximum`` under Megatron's accumulation rule (sum unless skipped, print sum / count,
reset): the printed ``lm_lse_max`` is the interval's largest (Megatron's real ``training_log`` with
log interval 4: tests/examples/test_zloss_lr_sweep.py).
"""

import pytest
import torch

pytest.importorskip("megatron.core")

from support import run_on_ranks  # noqa: E402

TOKENS = 37


def _records(rank, micro_batch):
    g = torch.Generator().manual_seed(100 * rank + micro_batch)
    lse = 5 + torch.rand(TOKENS, generator=g, dtype=torch.float64)
    mask = (torch.rand(TOKENS, generator=g) < 0.3 + 0.4 * rank).double()
    lse[micro_batch % TOKENS] = 50.0  # the largest lse, on a token the mask drops
    mask[micro_batch % TOKENS] = 0.0
    return 1e-2 * lse**2, lse, mask


def _worker(rank, world_size, layout):
    from megatron.core import parallel_state as ps

    from mindspeed_cez.patches import reporting as metrics

    ps.initialize_model_parallel(**{"dp": {}, "cp": {"context_parallel_size": 2},
                                    "pp": {"pipeline_model_parallel_size": 2}}[layout])
    heads = [0, 1] if layout != "pp" else [1]  # ranks holding the LM head
    names = [metrics.LM_Z_LOSS, metrics.LM_LSE, metrics.LM_LSE_MAX]
    for iteration in range(2):  # sums are cleared between iterations
        if rank in heads:
            for mb in range(2 + iteration):
                z, lse, mask = _records(rank, 10 * iteration + mb)
                metrics.record_lm_z_loss(z.float(), mask.float(), lse_per_token=lse.float())
        values = metrics.reduce_iteration(names)
        num = torch.zeros(3, dtype=torch.float64)
        largest = -float("inf")
        for r in heads:
            for mb in range(2 + iteration):
                z, lse, mask = _records(r, 10 * iteration + mb)
                num += torch.stack([(z * mask).sum(), (lse * mask).sum(), mask.sum()])
                largest = max(largest, float(lse[mask > 0].max()))
        assert float(values[metrics.LM_Z_LOSS]) == pytest.approx(float(num[0] / num[2]), rel=1e-6), layout
        assert float(values[metrics.LM_LSE]) == pytest.approx(float(num[1] / num[2]), rel=1e-6), layout
        assert float(values[metrics.LM_LSE_MAX]) == pytest.approx(largest, rel=1e-6), layout
    ps.destroy_model_parallel()


@pytest.mark.parametrize("layout", ["dp", "cp", "pp"])
def test_token_weighted_over_the_groups(layout):
    run_on_ranks(2, _worker, layout, timeout=300)


def _megatron_log_interval(values, skipped, log_interval):
    """What Megatron's training_log prints for lm_lse_max with the wrapper's interval_maximum: its
    accumulation rule (sum unless skipped, count the advanced iterations, print sum / count, reset
    both after the line), the wrapper's adjustment before each call. Returns the printed values."""
    from mindspeed_cez.patches import reporting as metrics
    from mindspeed_cez.patches.reporting import ADVANCED_ITERS, interval_maximum

    total, printed = {}, []
    for iteration, (value, skip) in enumerate(zip(values, skipped), start=1):
        value = torch.tensor([value], dtype=torch.float32)
        interval_maximum(total, value, skip)
        if not skip:
            total[ADVANCED_ITERS] = total.get(ADVANCED_ITERS, 0) + 1
            total[metrics.LM_LSE_MAX] = total.get(metrics.LM_LSE_MAX, torch.zeros(1)) + value
        if iteration % log_interval == 0:
            printed.append(float(total[metrics.LM_LSE_MAX]) / max(1, total.get(ADVANCED_ITERS, 0)))
            total[metrics.LM_LSE_MAX] = torch.zeros(1)
            total[ADVANCED_ITERS] = 0
    return printed


def test_interval_maximum_on_megatrons_accumulation():
    """The printed value is the largest of the interval's non-skipped iterations, to fp32 rounding."""
    g = torch.Generator().manual_seed(7)
    values = (20 + 200 * torch.rand(40, generator=g, dtype=torch.float64)).tolist()
    skipped = [i % 7 == 3 for i in range(40)]
    values[9] = 1e4  # a spike in a skipped-free interval; the skipped iterations' values must not count
    for i in range(40):
        if skipped[i]:
            values[i] = 1e6
    printed = _megatron_log_interval(values, skipped, 5)
    for k, got in enumerate(printed):
        window = [v for v, s in zip(values[5 * k:5 * k + 5], skipped[5 * k:5 * k + 5]) if not s]
        assert got == pytest.approx(max(window), rel=1e-6), (k, got, window)
