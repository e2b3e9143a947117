"""``vocab_parallel_cross_entropy_zloss`` on random inputs (hypothesis) against float64: every input
within tolerance or refused naming its argument (the contract: tests/support/properties.py).

Drawn: shapes (0 tokens included; ``[n, v]`` and ``[s, b, v]``), dtypes, z-loss, label smoothing, logit
scale / soft cap, ignore_index, targets (ignored, at the shard edges, out of range), -inf / NaN / +inf /
huge logits (whole shards and rows included), layouts (a slice of a wider tensor, transposed, the
logits an intermediate of the graph whose buffer takes the gradient), at times a bad argument. TP 1 in
this process; TP 2 and 4 on one pool of 4 gloo ranks spawned once for the module; the torch backend
and the Triton kernels (under TRITON_INTERPRET=1 on the CPU). Below them, the failures found on the
way as plain regression tests.
"""

import math

import pytest
import torch

pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from support.backends import triton_runs_on_cpu  # noqa: E402
from support.properties import ranks  # noqa: E402,F401 (a fixture: the module's pool of gloo ranks)
from support.properties import (DTYPES, check_logits_grad, check_refusal, check_rows, examples, logits_values,  # noqa: E402
                        loss_arguments, row_magnitude, targets, transformed_float64)
from support import loss_and_grad_float64, run_on_ranks, split_transform  # noqa: E402
from mindspeed_cez import vocab_parallel_cross_entropy_zloss  # noqa: E402

LAYOUTS = ["rows", "slice", "transposed"]
# (backend, TP size): examples per run of the ci profile (the Triton interpreter is ~100x slower)
EXAMPLES = {("torch", 1): 500, ("torch", 2): 120, ("torch", 4): 60,
            ("triton", 1): 60, ("triton", 2): 24, ("triton", 4): 14}


@st.composite
def cases(draw, tp, backend):
    """One call of the op over ``tp`` ranks: the full (unsharded) problem and how each rank calls it."""
    shape = draw(st.sampled_from([(0,), (1,), (5,), (9,), (0, 3), (3, 2), (2, 4)]))
    vocab = tp * draw(st.sampled_from([1, 2, 7, 16, 33]))
    dtype = draw(st.sampled_from(DTYPES))
    kwargs, bad = draw(loss_arguments())
    target, valid = draw(targets(shape, vocab, tp, kwargs["ignore_index"]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    upstream = torch.randn(shape, generator=gen) * (torch.rand(shape, generator=gen) < 0.9)
    return dict(logits=draw(logits_values(shape, vocab, tp, dtype)), target=target, upstream=upstream, kwargs=kwargs,
                bad=bad, valid_targets=valid, layout=draw(st.sampled_from(LAYOUTS)), intermediate=draw(st.booleans()),
                backend=backend, tp=tp)


def _laid_out(full, shard, layout, intermediate):
    """(leaf, the logits the op gets, a function giving the leaf's gradient of the shard)."""
    if layout == "slice":  # rows of the full vocab, this rank's columns: row stride > width
        leaf = full.clone().requires_grad_(True)
        logits = (leaf * 1 if intermediate else leaf)[..., shard]
        return leaf, logits, lambda: leaf.grad[..., shard]
    part = full[..., shard]
    if layout == "transposed":  # unit stride along the tokens, not the vocab
        leaf = part.movedim(-1, 0).contiguous().requires_grad_(True)
        logits = (leaf * 1 if intermediate else leaf).movedim(0, -1)
        return leaf, logits, lambda: leaf.grad.movedim(0, -1)
    leaf = part.clone().requires_grad_(True)
    return leaf, leaf * 1 if intermediate else leaf, lambda: leaf.grad


def _op_on_rank(rank, tp, group, case):
    """This rank's call of the op and its backward: loss, z-loss, lse and its slice's gradient, or the
    refusal ``(type name, message)``."""
    v_local = case["logits"].shape[-1] // tp
    leaf, logits, grad = _laid_out(case["logits"], slice(rank * v_local, (rank + 1) * v_local), case["layout"],
                                   case["intermediate"])
    try:
        kwargs, logit_transform = split_transform(case["kwargs"])
        loss, z_loss, lse = vocab_parallel_cross_entropy_zloss(logits, case["target"], tp_group=group,
                                                               backend=case["backend"], return_lse=True,
                                                               logit_transform=logit_transform, **kwargs)
        loss.backward(case["upstream"])
    except (ValueError, TypeError) as err:
        return {"refused": (type(err).__name__, str(err))}
    return {"refused": None, "loss": loss.detach(), "z_loss": z_loss, "lse": lse, "grad": grad()}


def _check(case, results):
    if check_refusal([r["refused"] for r in results], case["bad"], case["valid_targets"]):
        return
    for r in results[1:]:  # every rank gives the same per-token results
        for key in ("loss", "z_loss", "lse"):
            torch.testing.assert_close(r[key], results[0][key], rtol=0, atol=0, equal_nan=True)
    kwargs = case["kwargs"]
    full, target, upstream = case["logits"], case["target"], case["upstream"]
    loss, z_loss, lse = (results[0][key] for key in ("loss", "z_loss", "lse"))
    assert loss.dtype == z_loss.dtype == lse.dtype == torch.float32 and loss.shape == target.shape
    ref_loss, ref_z, ref_grad, ref_lse = loss_and_grad_float64(full, target, upstream, return_lse=True, **kwargs)
    ignored = target == kwargs["ignore_index"]
    magnitude = row_magnitude(transformed_float64(full, kwargs["logit_scale"], kwargs["logit_softcap"]))
    check_rows(loss, z_loss, lse, (ref_loss, ref_z, ref_lse), ignored, magnitude, kwargs["z_loss_coeff"])
    grad = torch.cat([r["grad"] for r in results], dim=-1)
    assert grad.dtype == full.dtype and grad.shape == full.shape
    check_logits_grad(grad, ref_grad, upstream, ref_loss, ref_lse, ignored, magnitude, kwargs["z_loss_coeff"],
                      kwargs["logit_scale"])


def run_case(case, ranks=None):
    """The op on ``case["tp"]`` ranks (1: this process; more: the pool), checked against float64."""
    if case["tp"] == 1:
        results = [_op_on_rank(0, 1, None, case)]
    else:
        results = ranks.run(_op_on_rank, case["tp"], case)
    _check(case, results)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_op_within_tolerance_of_float64_or_refused(request, backend, tp):
    if backend == "triton" and not triton_runs_on_cpu():
        pytest.skip("the Triton kernels take CPU tensors only under TRITON_INTERPRET=1")
    pool = request.getfixturevalue("ranks") if tp > 1 else None

    @examples(EXAMPLES[backend, tp])
    @given(case=cases(tp, backend))
    def check(case):
        run_case(case, pool)

    check()


# ------------------------------------------------------------------- regressions found on the way
def _case(logits, target, backend="torch", tp=1, upstream=None, layout="rows", intermediate=False, **kwargs):
    kwargs = {"z_loss_coeff": 0.0, "label_smoothing": 0.0, "ignore_index": -100, "logit_scale": 1.0,
              "logit_softcap": 0.0, **kwargs}
    return dict(logits=logits, target=target, upstream=torch.ones(target.shape) if upstream is None else upstream,
                kwargs=kwargs, bad=set(), valid_targets=True, layout=layout, intermediate=intermediate,
                backend=backend, tp=tp)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_whole_minus_inf_shard_is_right_at_tensor_parallel_sizes(ranks, backend, tp):
    """A row whose whole vocab slice is -inf on one rank (a padded vocab, a masked shard): the right loss
    and gradient on every rank, with and without z-loss and smoothing (the torch backend gave NaN)."""
    if backend == "triton" and not triton_runs_on_cpu():
        pytest.skip("the Triton kernels take CPU tensors only under TRITON_INTERPRET=1")
    full = torch.randn(3, 8 * tp, generator=torch.Generator().manual_seed(5))
    full[0, 8:] = -math.inf  # every rank but the first: the whole slice
    full[1, :8] = -math.inf  # the first rank's whole slice
    full[2, 8:16] = -math.inf  # the second rank's
    target = torch.tensor([3, 8 * tp - 1, 0])
    for kwargs in ({}, {"z_loss_coeff": 1e-2}, {"logit_softcap": 5.0}):
        run_case(_case(full, target, backend, tp, **kwargs), ranks)


def test_whole_minus_inf_rows_and_shards_at_one_rank():
    """Rows entirely -inf, ignored or not, beside finite ones: finite rows right, ignored rows 0."""
    full = torch.randn(4, 6)
    full[0] = -math.inf
    full[1] = -math.inf
    target = torch.tensor([2, -100, 1, -100])
    run_case(_case(full, target, z_loss_coeff=1e-3))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_gradient_beyond_the_dtype_range_is_inf_of_its_sign(backend):
    """fp16 logits at -6e4 with z-loss 0.3: the gradient (about 3.6e4 x the upstream) passes fp16's
    range, so it is +-inf with the float64 gradient's sign, as fp16 rounds it; the loss (fp32) stays finite."""
    if backend == "triton" and not triton_runs_on_cpu():
        pytest.skip("the Triton kernels take CPU tensors only under TRITON_INTERPRET=1")
    logits = torch.tensor([[0.8], [-6.0e4], [-6.0e4]], dtype=torch.float16)
    case = _case(logits, torch.tensor([0, 0, 0]), backend, upstream=torch.tensor([0.5, 2.0, -2.7]), z_loss_coeff=0.3)
    run_case(case)
    (grad,) = _op_on_rank(0, 1, None, case)["grad"].unbind(-1)
    assert grad[1] == -math.inf and grad[2] == math.inf


def _worker_changing_widths(rank, world_size):
    from mindspeed_cez import vocab_parallel_cross_entropy_zloss as op
    import torch.distributed as dist

    op(torch.randn(2, 8), torch.tensor([0, 1]), tp_group=dist.group.WORLD, backend="torch")  # equal widths: fine
    op(torch.randn(2, 6), torch.tensor([0, 1]), tp_group=dist.group.WORLD, backend="torch")  # equal again
    for widths in ((8, 6), (8, 10)):  # seen before by both ranks; seen before by rank 0 only
        width = widths[rank]
        with pytest.raises(ValueError, match="unequal width"):
            op(torch.randn(2, width), torch.tensor([0, 1]), tp_group=dist.group.WORLD, backend="torch")


def test_shard_width_check_is_one_collective_after_widths_seen_before():
    """Needs the single-collective shard-width check (no per-rank cache of widths checked): ranks that
    pass unequal widths they each checked before get one clear error on every rank, no hang."""
    run_on_ranks(2, _worker_changing_widths, timeout=60)
