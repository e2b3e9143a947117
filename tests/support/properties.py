"""What the property tests of both ops share (tests/ops/test_cross_entropy_zloss_properties.py, tests/ops/test_linear_cross_entropy_properties.py):
hypothesis settings, strategies for the arguments both ops take, and the contract check written once:
an input is either within tolerance of the float64 reference (tests/support/) or refused with a
``ValueError`` / ``TypeError`` that names the argument it is about; a valid input is never refused.

Tolerances follow from fp32 arithmetic on the logits: per row, lse and loss within
``K * eps * (1 + max|z| + log V)`` (the z-loss term times ``1 + 2c|lse|``), ``eps`` the precision of
the logits the loss reads (fp32 for given logits; the input dtype for logits made by a GEMM in it);
gradients within their dtype's rounding plus that term times the upstream gradient. A row whose
reference is not finite in fp32 (NaN or inf logits, a target at -inf) must not be finite either;
an ignored row's loss and z-loss are exactly 0, and its gradient too where its lse is finite.

Settings: the ``ci`` profile (the default) runs a fixed, derandomized set of examples per test with
no deadline, the same every run; ``HYPOTHESIS_PROFILE=explore`` draws fresh random examples, 20 times
as many, to hunt. A failure found either way becomes a plain regression test beside the property.
"""

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from support import RankPool

settings.register_profile("ci", deadline=None, derandomize=True, database=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("explore", deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)
SCALE = 20 if PROFILE == "explore" else 1

EPS32 = torch.finfo(torch.float32).eps
K = 16  # fp32 operations per result, with room: the bounds' constant
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HUGE = 6.0e4  # fp16's range: huge logits every dtype holds, whose transform fp32 holds


@pytest.fixture(scope="module")
def ranks():
    """4 gloo ranks for a test module's TP 2 and 4 examples (imported there as a fixture)."""
    pool = RankPool(4)
    yield pool
    pool.close()


def examples(n):
    """Hypothesis settings for ``n`` examples (times the profile's scale)."""
    return settings(max_examples=n * SCALE)


# --------------------------------------------------------------------------------- strategies
coefficients = st.sampled_from([0.0, 1e-4, 1e-2, 0.3])
smoothings = st.sampled_from([0.0, 0.1, 0.5, 0.95])
transforms = st.sampled_from([(1.0, 0.0), (0.5, 0.0), (2.5, 0.0), (1.0, 5.0), (1.5, 30.0)])  # (scale, soft cap)
ignore_indices = st.sampled_from([-100, -1, 0])  # 0: a vocab id ignored as padding

# one bad argument and the values that make it bad (each op names it in its error)
BAD_ARGUMENTS = {
    "z_loss_coeff": [-1e-3, math.nan, math.inf, "1e-3"],
    "label_smoothing": [1.0, -0.1, math.nan],
    "logit_scale": [0.0, -2.0, math.nan, math.inf],
    "logit_softcap": [-1.0, math.inf, math.nan],
    "ignore_index": [None, 1.5, True],
}


@st.composite
def loss_arguments(draw):
    """``(kwargs, bad)``: the loss's keyword arguments both ops take, at times one of them bad; ``bad``
    the set of names an error must name (empty: the arguments are valid)."""
    scale, cap = draw(transforms)
    kwargs = dict(z_loss_coeff=draw(coefficients), label_smoothing=draw(smoothings), ignore_index=draw(ignore_indices),
                  logit_scale=scale, logit_softcap=cap)
    bad = set()
    if draw(st.integers(0, 9)) == 0:
        name = draw(st.sampled_from(sorted(BAD_ARGUMENTS)))
        kwargs[name] = draw(st.sampled_from(BAD_ARGUMENTS[name]))
        bad.add(name)
    return kwargs, bad


@st.composite
def targets(draw, shape, vocab, tp, ignore_index):
    """Global vocab ids of ``shape``: uniform, ignored, at the shard edges (first and last id of every
    rank's slice), at times out of range. Returns ``(target, valid)``."""
    n = math.prod(shape)
    edges = sorted({0, vocab - 1, *(r * vocab // tp for r in range(1, tp)), *(r * vocab // tp - 1 for r in range(1, tp))})
    out_of_range = draw(st.integers(0, 7)) == 0
    kinds = draw(st.lists(st.sampled_from(["uniform", "uniform", "edge", "ignore"] + ["out"] * out_of_range),
                          min_size=n, max_size=n))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    values = []
    for kind in kinds:
        if kind == "uniform":
            values.append(int(torch.randint(0, vocab, (), generator=gen)))
        elif kind == "edge":
            values.append(edges[int(torch.randint(0, len(edges), (), generator=gen))])
        elif kind == "ignore":
            values.append(ignore_index if _an_int(ignore_index) else -100)
        else:
            values.append(draw(st.sampled_from([vocab, vocab + 7, -1, -101])))
    target = torch.tensor(values, dtype=torch.int64).reshape(shape)
    ignored = target == ignore_index if _an_int(ignore_index) else False
    valid = bool((ignored | ((target >= 0) & (target < vocab))).all())
    return target, valid


def _an_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


# value patterns of the logits: -inf entries, whole shards and rows at -inf, NaN, +inf, huge values
PATTERNS = ["-inf", "-inf shard", "-inf row", "nan", "+inf", "huge"]


@st.composite
def logits_values(draw, shape, vocab, tp, dtype):
    """Random logits ``[*shape, vocab]`` in ``dtype`` with a spread drawn, and at times some of
    :data:`PATTERNS` on random rows (``-inf shard``: one TP rank's whole slice)."""
    spread = draw(st.sampled_from([1.0, 4.0, 30.0]))
    patterns = set(draw(st.lists(st.sampled_from(["plain", *PATTERNS]), min_size=1, max_size=3))) - {"plain"}
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((*shape, vocab), generator=gen) * spread
    rows = x.view(-1, vocab)
    n, v_local = rows.shape[0], vocab // tp
    for pattern in sorted(patterns):
        if n == 0:
            break
        picked = torch.rand(n, generator=gen) < 0.5
        if pattern == "-inf":
            rows[(torch.rand(rows.shape, generator=gen) < 0.3) & picked[:, None]] = -math.inf
        elif pattern == "-inf shard":
            rank = int(torch.randint(0, tp, (), generator=gen))
            rows[picked, rank * v_local:(rank + 1) * v_local] = -math.inf
        elif pattern == "-inf row":
            rows[picked] = -math.inf
        else:
            value = {"nan": math.nan, "+inf": math.inf, "huge": HUGE}[pattern]
            hit = (torch.rand(rows.shape, generator=gen) < 0.1) & picked[:, None]
            sign = torch.where(torch.rand(rows.shape, generator=gen) < 0.5, -1.0, 1.0) if pattern == "huge" else 1.0
            rows[hit] = (sign * torch.full(rows.shape, value))[hit]
    return x.to(dtype)


# ---------------------------------------------------------------------------- the contract check
def check_refusal(refusals, bad, valid_targets=True):
    """``refusals``: each rank's ``(exception type name, message)`` or None where it computed. Refused
    exactly when an argument is bad (``bad``, or targets out of range): by every rank alike, with a
    ValueError / TypeError naming a bad argument. Returns whether the input was refused."""
    names = set(bad) | (set() if valid_targets else {"target"})
    if all(r is None for r in refusals):
        assert not names, f"accepted an input whose {sorted(names)} is bad"
        return False
    assert all(r is not None for r in refusals) and len(set(refusals)) == 1, f"ranks disagree: {refusals}"
    kind, message = refusals[0]
    assert names, f"refused a valid input: {kind}: {message}"
    assert kind in ("ValueError", "TypeError"), (kind, message)
    assert any(name in message for name in names), f"the error names none of {sorted(names)}: {message}"
    return True


def transformed_float64(logits, logit_scale=1.0, logit_softcap=0.0):
    """The reference's ``z`` of the logits, in float64."""
    z = logits.double() * logit_scale
    return logit_softcap * torch.tanh(z / logit_softcap) if logit_softcap else z


def row_magnitude(z):
    """``1 + max|z| + log V`` per row over the finite ``z``: the scale of a row's fp32 rounding."""
    finite = torch.where(torch.isfinite(z), z.abs(), torch.zeros((), dtype=z.dtype))
    return 1.0 + (finite.amax(-1) if z.shape[-1] else 0.0) + math.log(max(z.shape[-1], 1))


def _within(name, actual, expected, tol, rows):
    actual, expected, tol = actual.double(), expected.double(), tol.double()
    err = (actual - expected).abs()
    bad = rows & ~(err <= tol)  # NaN errors count as bad
    if bad.any():
        i = bad.nonzero()[0].tolist()
        raise AssertionError(f"{name}: {int(bad.sum())} element(s) outside tolerance, first at {i}: got "
                             f"{actual[tuple(i)].item()!r}, float64 {expected[tuple(i)].item()!r}, tolerance "
                             f"{tol[tuple(i)].item():.3g}")


def check_rows(loss, z_loss, lse, ref, ignored, magnitude, z_loss_coeff, eps=EPS32):
    """Per-token ``loss``, ``z_loss`` and ``lse`` against float64 ``ref`` = (loss, z_loss, lse)."""
    ref_loss, ref_z, ref_lse = (t.double() for t in ref)
    loss, z_loss, lse = (t.double() for t in (loss, z_loss, lse))
    counted = ~ignored
    assert (loss[ignored] == 0).all() and (z_loss[ignored] == 0).all(), "an ignored token's loss or z-loss is not 0"
    finite = torch.isfinite(ref_loss.float())  # what fp32 can hold
    assert not torch.isfinite(loss[counted & ~finite]).any(), "a finite loss where float64's is not finite in fp32"
    delta = K * eps * magnitude  # lse's absolute error bound per row
    lse_rows = torch.isfinite(ref_lse.float())
    _within("lse", lse, ref_lse, delta + 1e-6 * ref_lse.abs(), lse_rows)
    zterm = 2.0 * z_loss_coeff * ref_lse.abs().nan_to_num(0.0, 0.0, 0.0)
    _within("loss", loss, ref_loss, delta * (2.0 + zterm) + 1e-6 * ref_loss.abs(), counted & finite)
    _within("z_loss", z_loss, ref_z, delta * zterm + 1e-6 * ref_z.abs(), counted & torch.isfinite(ref_z.float()))


def check_logits_grad(grad, ref_grad, upstream, ref_loss, ref_lse, ignored, magnitude, z_loss_coeff, logit_scale, eps=EPS32):
    """The gradient of given logits ``[..., V]`` against float64, row by row: rows counted with a
    finite reference loss within their dtype's rounding plus the fp32 term; ignored rows with a
    finite lse exactly 0; other rows (non-finite) unconstrained."""
    dtype = grad.dtype
    eps_out = torch.finfo(dtype).eps
    ref_lse = ref_lse.double()
    g = upstream.double().abs()
    counted = ~ignored & torch.isfinite(ref_loss.float())
    scale = (K * eps * magnitude * g * (1.0 + 2.0 * z_loss_coeff * ref_lse.abs().nan_to_num(0.0, 0.0, 0.0))
             * max(logit_scale, 1.0))
    tol = 2 * eps_out * ref_grad.double().abs() + scale[..., None] + 2 * torch.finfo(dtype).tiny * eps_out
    rows = counted[..., None].expand(grad.shape)
    # beyond the dtype's range the gradient is +-inf: right as the dtype rounds it
    overflow = rows & (ref_grad.double().abs() >= torch.finfo(dtype).max) & torch.isinf(grad)
    assert (grad.double().sign() == ref_grad.double().sign())[overflow].all(), "a gradient overflows with the wrong sign"
    _within("grad", grad, ref_grad, tol, rows & ~overflow)
    zero_rows = ignored & torch.isfinite(ref_lse.float())
    assert (grad.double()[zero_rows] == 0).all(), "an ignored token's gradient is not 0"
