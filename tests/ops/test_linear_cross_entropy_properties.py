"""``linear_cross_entropy_zloss`` on random inputs (hypothesis) against float64: every input within
tolerance or refused naming its argument (the contract: tests/support/properties.py).

Drawn: shapes (0 tokens included; ``[n, h]`` and ``[s, b, h]``), dtypes, z-loss, label smoothing, logit
scale / soft cap, ignore_index, targets (ignored, at the shard edges, out of range), the spread of the
logits, layouts of the hidden states (a slice of a wider tensor, transposed), the gradient path
(``recompute`` on GEMM chunks or the Triton ``tl.dot`` kernels, with and
without ``main_grad``; ``forward`` with ``token_weights`` alone, with ``grad_scale``, with the weight's
gradient into ``main_grad``), vocab chunks and row blocks, sequence parallelism, at times a bad
argument (a non-finite ``grad_scale`` tensor among them). TP 1 in this process; TP 2 and 4 on one pool of
4 gloo ranks spawned once for the module; the torch backend and the Triton kernels (under
TRITON_INTERPRET=1 on the CPU).
"""

import math

import pytest
import torch

pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from support.backends import triton_runs_on_cpu  # noqa: E402
from support.properties import ranks  # noqa: E402,F401 (a fixture: the module's pool of gloo ranks)
from support.properties import (DTYPES, K, check_refusal, check_rows, examples, loss_arguments, row_magnitude,  # noqa: E402
                        targets, transformed_float64)
from support import linear_loss_and_grads_float64, split_transform  # noqa: E402
from mindspeed_cez import linear_cross_entropy_zloss  # noqa: E402
from mindspeed_cez import GradientPath, LinearCrossEntropyOptions, TrainerInputs  # noqa: E402
from mindspeed_cez.patches.loss_wrappers import main_grad_target  # noqa: E402 (the adaptor's weight-gradient target)
from mindspeed_cez import ForwardGradientLedger  # noqa: E402

LEDGER = ForwardGradientLedger()  # the forwards of these tests that owe a backward

PATHS = ["recompute", "recompute-triton", "forward", "scaled", "main_grad"]
# examples per (backend, TP size) and path of the ci profile (the Triton interpreter is ~100x slower)
EXAMPLES = {("torch", 1): 80, ("torch", 2): 25, ("torch", 4): 12, ("triton", 1): 12, ("triton", 2): 6, ("triton", 4): 4}


@st.composite
def cases(draw, tp, backend, path):
    sequence_parallel = tp > 1 and draw(st.booleans())
    rows = draw(st.sampled_from([0, 1, 3, 5]))  # per rank with sequence parallelism
    shape = draw(st.sampled_from([(rows * (tp if sequence_parallel else 1),), (rows * (tp if sequence_parallel else 1), 2)]))
    h, v_local = draw(st.sampled_from([1, 3, 8])), draw(st.sampled_from([1, 5, 16]))
    vocab = v_local * tp
    dtype = draw(st.sampled_from(DTYPES))
    kwargs, bad = draw(loss_arguments())
    target, valid = draw(targets(shape, vocab, tp, kwargs["ignore_index"]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    spread = draw(st.sampled_from([1.0, 3.0, 10.0]))  # the logits' spread: up to a few tens
    hidden = torch.randn((*shape, h), generator=gen)
    weight = torch.randn(vocab, h, generator=gen) * spread / math.sqrt(h)
    options = {"chunk_cols": draw(st.sampled_from([None, 1, 3]))} if path.startswith("recompute") else \
        {"row_block": draw(st.sampled_from([None, 1, 2]))}
    main_grad = path == "main_grad" or (path.startswith("recompute") and draw(st.booleans()))
    if path.startswith("recompute"):
        upstream, weights, grad_scale = torch.randn(shape, generator=gen), None, None
    else:  # what Megatron sends: a scale times the loss mask (zeros, ones, a few halves)
        weights = (torch.rand(shape, generator=gen) < 0.8).float()
        weights[torch.rand(shape, generator=gen) < 0.1] = 0.5
        scale = draw(st.sampled_from([0.37, 1.0, 3.0]))
        upstream = scale * weights
        grad_scale = None if path == "forward" else torch.tensor(scale) if path == "main_grad" else scale
        if path != "forward" and draw(st.integers(0, 9)) == 0:
            grad_scale = torch.tensor(draw(st.sampled_from([math.nan, math.inf])))
            bad = bad | {"grad_scale"}
    layout = draw(st.sampled_from(["contiguous", "strided", "transposed"] if len(shape) == 2 else ["contiguous", "strided"]))
    return dict(hidden=hidden.to(dtype), weight=weight.to(dtype), target=target, upstream=upstream, kwargs=kwargs,
                bad=bad, valid_targets=valid, path=path, token_weights=weights, grad_scale=grad_scale, layout=layout,
                main_grad=torch.randn(vocab, h, generator=gen) if main_grad else None, options=options,
                sequence_parallel=sequence_parallel, backend=backend, tp=tp)


def _laid_out(hidden, layout):
    """(the hidden states the op gets, a function giving their gradient): contiguous; ``strided``,
    the first columns of a wider tensor (row stride > h); ``transposed``, ``[s, b, h]`` stored as ``[b, s, h]``."""
    if layout == "strided":
        leaf = torch.cat([hidden, torch.zeros_like(hidden)], dim=-1).requires_grad_(True)
        return leaf[..., :hidden.shape[-1]], lambda: leaf.grad[..., :hidden.shape[-1]]
    if layout == "transposed":
        leaf = hidden.transpose(0, 1).contiguous().requires_grad_(True)
        return leaf.transpose(0, 1), lambda: leaf.grad.transpose(0, 1)
    leaf = hidden.clone().requires_grad_(True)
    return leaf, lambda: leaf.grad


def _linear_on_rank(rank, tp, group, case):
    """This rank's call of the op and its backward: loss, z-loss, lse, its dhidden and its weight rows'
    gradient (from ``main_grad`` where it went there), or the refusal ``(type name, message)``."""
    v_local = case["weight"].shape[0] // tp
    rows = slice(rank * v_local, (rank + 1) * v_local)
    hidden = case["hidden"]
    if case["sequence_parallel"]:
        chunk = hidden.shape[0] // tp
        hidden = hidden[rank * chunk:(rank + 1) * chunk]
    h, dhidden = _laid_out(hidden, case["layout"])
    w = case["weight"][rows].clone().requires_grad_(True)
    path, main_grad = case["path"], case["main_grad"]
    if main_grad is not None:
        w.main_grad = main_grad[rows].clone()
    grads = "recompute" if path.startswith("recompute") else "forward"
    try:
        kwargs, logit_transform = split_transform(case["kwargs"])
        options = LinearCrossEntropyOptions(
            logit_transform, GradientPath(grads, row_block=case["options"].get("row_block")), backend=case["backend"],
            linear_backend="triton" if path == "recompute-triton" else "gemm" if grads == "recompute" else None,
            chunk_cols=case["options"].get("chunk_cols"), return_lse=True)
        trainer = TrainerInputs(token_weights=case["token_weights"], grad_scale=case["grad_scale"],
                                weight_grad=main_grad_target(w) if main_grad is not None else None, ledger=LEDGER)
        loss, z_loss, lse = linear_cross_entropy_zloss(h, w, case["target"], tp_group=group,
                                                       sequence_parallel=case["sequence_parallel"], options=options,
                                                       trainer=trainer, **kwargs)
        loss.backward(case["upstream"])
    except (ValueError, TypeError) as err:
        return {"refused": (type(err).__name__, str(err))}
    dweight = w.main_grad - main_grad[rows] if main_grad is not None else w.grad
    return {"refused": None, "loss": loss.detach(), "z_loss": z_loss, "lse": lse, "dhidden": dhidden(), "dweight": dweight}


def _check_norm(name, actual, expected, tol):
    err = (actual.double() - expected).norm().item()
    assert err <= tol, f"{name}: ||error|| {err:.3g} > tolerance {tol:.3g} (||float64|| {expected.norm().item():.3g})"


def _check(case, results):
    if check_refusal([r["refused"] for r in results], case["bad"], case["valid_targets"]):
        return
    for r in results[1:]:
        for key in ("loss", "z_loss", "lse") + (() if case["sequence_parallel"] else ("dhidden",)):
            torch.testing.assert_close(r[key], results[0][key], rtol=0, atol=0, equal_nan=True)
    kwargs, dtype = case["kwargs"], case["hidden"].dtype
    hidden, weight, target, upstream = case["hidden"], case["weight"], case["target"], case["upstream"]
    ref_loss, ref_dh, ref_dw, ref_z, ref_lse = linear_loss_and_grads_float64(hidden, weight, target, upstream,
                                                                             return_lse=True, **kwargs)
    logits = hidden.double() @ weight.double().t()
    magnitude = row_magnitude(transformed_float64(logits, kwargs["logit_scale"], kwargs["logit_softcap"]))
    eps = torch.finfo(dtype).eps  # the logits are made in the input's dtype
    loss, z_loss, lse = (results[0][key] for key in ("loss", "z_loss", "lse"))
    ignored = target == kwargs["ignore_index"]
    check_rows(loss, z_loss, lse, (ref_loss, ref_z, ref_lse), ignored, magnitude, kwargs["z_loss_coeff"], eps)
    dhidden = torch.cat([r["dhidden"] for r in results]) if case["sequence_parallel"] else results[0]["dhidden"]
    dweight = torch.cat([r["dweight"] for r in results])
    assert dhidden.dtype == dtype and dhidden.shape == hidden.shape and dweight.shape == weight.shape
    # gradient norms: the logits' rounding times the size of what multiplies them, plus the outputs' rounding
    zterm = 1.0 + 2.0 * kwargs["z_loss_coeff"] * float(ref_lse.abs().max()) if target.numel() else 1.0
    rel = K * eps * float(magnitude.max() if target.numel() else 1.0) * zterm * max(kwargs["logit_scale"], 1.0)
    g = float(upstream.abs().max()) if target.numel() else 0.0
    _check_norm("dhidden", dhidden, ref_dh, rel * (ref_dh.norm().item() + g * weight.double().norm().item()))
    _check_norm("dweight", dweight, ref_dw, rel * (ref_dw.norm().item() + g * hidden.double().norm().item()))


def run_case(case, ranks=None):
    results = [_linear_on_rank(0, 1, None, case)] if case["tp"] == 1 else ranks.run(_linear_on_rank, case["tp"], case)
    _check(case, results)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_linear_op_within_tolerance_of_float64_or_refused(request, backend, tp, path):
    if backend == "triton" and not triton_runs_on_cpu():
        pytest.skip("the Triton kernels take CPU tensors only under TRITON_INTERPRET=1")
    if path == "recompute-triton" and backend != "triton":
        pytest.skip("the Triton linear kernels run with the Triton backend")
    pool = request.getfixturevalue("ranks") if tp > 1 else None

    @examples(EXAMPLES[backend, tp])
    @given(case=cases(tp, backend, path))
    def check(case):
        run_case(case, pool)

    check()
