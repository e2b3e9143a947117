"""``TransformedLogits`` records MindSpeed-LLM's scaling and soft cap of the logits for the kernels
(``x * s``, then ``x / C``, ``torch.tanh``, ``x * C``) and refuses every other use, naming the flags."""

import pytest
import torch
import triton
import triton.language as tl

from mindspeed_cez.kernels import triton_cross_entropy
from mindspeed_cez.kernels import IDENTITY, SCALE, SOFTCAP, TANH_SERIES_BELOW, LogitTransform
from mindspeed_cez.patches.model_context import LogitTransformError, TransformedLogits


def _as_mindspeed_llm_does(logits, scale, cap):
    """MindSpeed-LLM's GPTModel forward (master, gpt_model.py): the same statements, in order."""
    if scale:
        logits = logits * scale
    if cap:
        logits = logits / cap
        logits = torch.tanh(logits)
        logits = logits * cap
    return logits


@pytest.mark.parametrize("scale,cap", [(None, None), (0.5773502691896257, None), (None, 30.0), (0.5, 3.0)])
def test_records_the_transform_and_computes_nothing(scale, cap):
    x = torch.randn(3, 4)
    recorded = _as_mindspeed_llm_does(TransformedLogits(x), scale, cap)
    assert isinstance(recorded, TransformedLogits) and recorded.logits is x
    assert recorded.transform() == LogitTransform(scale or 1.0, cap or 0.0)
    s, c = recorded.transform().scale, recorded.transform().cap  # what the kernels compute: MindSpeed-LLM's numbers
    z = c * torch.tanh(s * x.double() / c) if c else s * x.double()
    torch.testing.assert_close(z, _as_mindspeed_llm_does(x.double(), scale, cap))


@pytest.mark.parametrize("use", [
    lambda t: t * torch.ones(()),  # a tensor factor
    lambda t: t + 1.0,
    lambda t: torch.exp(t),
    lambda t: t.shape,
    lambda t: t.float(),
    lambda t: torch.tanh(t),  # no division by the cap first
    lambda t: torch.tanh(t / 3.0) * 2.0,  # closed by another number
    lambda t: torch.tanh(t / 3.0) * 3.0 * 0.5,  # a scale after the cap
], ids=["tensor factor", "add", "exp", "attribute", "method", "bare tanh", "other cap", "scale after cap"])
def test_any_other_use_fails_naming_the_flags(use):
    with pytest.raises((LogitTransformError, TypeError), match="output-multiplier-scale|unsupported operand"):
        use(TransformedLogits(torch.randn(2, 2)))


def test_an_unfinished_cap_is_refused_at_the_loss():
    for partial in (lambda t: t / 3.0, lambda t: torch.tanh(t / 3.0)):
        with pytest.raises(LogitTransformError, match="unfinished soft cap"):
            partial(TransformedLogits(torch.randn(2, 2))).transform()


def test_the_value_checks_itself_and_names_the_kernel_variant():
    assert IDENTITY.is_identity and LogitTransform(2).kind == SCALE and LogitTransform(1, 30).kind == SOFTCAP
    assert (LogitTransform(2, 3).scale, LogitTransform(2, 3).cap, LogitTransform(2, 3).kind) == (2.0, 3.0, SOFTCAP)
    for bad, name in (((0,), "logit_scale"), ((float("inf"),), "logit_scale"), ((1, -1), "logit_softcap"),
                      ((True,), "logit_scale"), ((1, float("nan")), "logit_softcap")):
        with pytest.raises(ValueError, match=name):
            LogitTransform(*bad)
    x = torch.randn(5, 7, dtype=torch.float64)
    t = LogitTransform(0.5, 2.0)
    z, slope = t.apply_with_slope(x)
    torch.testing.assert_close(z, 2.0 * torch.tanh(0.5 * x / 2.0))
    torch.testing.assert_close(t.apply(x), z)
    torch.testing.assert_close(slope, 0.5 * (1 - torch.tanh(0.25 * x) ** 2))
    # saturated: tanh is +-1 and the slope 0 or a positive tiny number, never negative or NaN
    big = torch.tensor([-1e4, -80.0, 80.0, 1e4], dtype=torch.float32)
    z, slope = t.apply_with_slope(big)
    assert torch.equal(z.abs(), torch.full_like(z, 2.0)) and bool((slope >= 0).all())
    assert torch.equal(LogitTransform(3.0).apply_with_slope(x)[0], 3.0 * x) and IDENTITY.apply_with_slope(x)[0] is x


def test_soft_cap_tanh_in_fp32_within_torch_tanh_error():
    """The reference's (and the kernels') fp32 tanh against float64, from |u| 1e-9 to saturation, both
    signs: within 3.8e-7 relative (torch.tanh's own on CUDA; ``(1 - e) / (1 + e)`` alone loses all of u's
    digits below ~1e-8 and ~1e-6 of them near 0.1), below the series' bound |u| < 0.25 within 1.5e-7 (a series
    stopped at u**7 is 3.6e-7 off near 0.25), and the slope within 3e-7 relative."""
    gen = torch.Generator().manual_seed(63)
    u = torch.logspace(-9, 1.2, 20001, dtype=torch.float64) * (torch.rand(20001, generator=gen, dtype=torch.float64) + 0.5)
    u = torch.cat([u, -u]).float()
    for scale, cap in ((1.0, 1.0), (0.7, 30.0)):
        x = u * (cap / scale)
        z, slope = LogitTransform(scale, cap).apply_with_slope(x)
        v = (x * (scale / cap)).double()  # tanh's fp32 argument, as the transform rounds it
        exact = torch.tanh(v)
        relative = (z.double() / cap - exact).abs() / exact.abs()
        assert relative.max() < 3.8e-7 and relative[v.abs() < TANH_SERIES_BELOW].max() < 1.5e-7
        exact_slope = scale / torch.cosh(v) ** 2
        assert ((slope.double() - exact_slope).abs() <= 3e-7 * exact_slope + 1e-30).all()


SOFTCAP_KIND = tl.constexpr(SOFTCAP)  # a Triton kernel reads only constexpr globals (the interpreter reads any)


@triton.jit
def _soft_cap_kernel(x_ptr, z_ptr, slope_ptr, n, scale, cap, PRECISE: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n)
    z, slope = triton_cross_entropy.transform_logits_with_slope(x, scale, cap, SOFTCAP_KIND, PRECISE)
    tl.store(z_ptr + offsets, z, mask=offsets < n)
    tl.store(slope_ptr + offsets, slope, mask=offsets < n)


@pytest.mark.parametrize("precise", [True, False])
def test_the_kernels_soft_cap_is_the_references(precise):
    """The Triton kernels' soft cap (on a GPU, or Triton's interpreter) against float64 over |u| 1e-7 .. 20.
    scale / cap is a power of two, so tanh's argument ``u`` is exact on every backend (CUDA divides fp32
    scalars within 2 ulp) and the errors are the transform's own. In the series' range (fp32 logits,
    ``PRECISE``: FMAs only) tanh within the reference's 1.5e-7 relative; elsewhere exp2 and the division
    are the hardware's (CUDA: ``ex2.approx`` and ``div.full``, within 2 ulp each), so tanh within
    Liger-Kernel's rtol 1e-6 relative, and 16-bit logits' form (no series) within 4e-7 absolute, far below
    a bf16 logit's rounding; the slope within 1e-6 relative, 1e-6 |u| where |u| > 1 (exp2's fp32 argument
    ``-2|u| log2(e)`` rounds; the slope there is below 0.1 x scale)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(64)
    u = torch.logspace(-7, 1.3, 4096, dtype=torch.float64) * (torch.rand(4096, generator=gen, dtype=torch.float64) + 0.5)
    scale, cap = 0.5, 32.0
    x = (torch.cat([u, -u]) * (cap / scale)).float().to(device)
    z, slope = torch.empty_like(x), torch.empty_like(x)
    _soft_cap_kernel[(triton.cdiv(x.numel(), 1024),)](x, z, slope, x.numel(), scale, cap, PRECISE=precise, BLOCK=1024)
    v = x.double().cpu() * (scale / cap)  # tanh's argument: exact, scale / cap = 2**-6
    exact = torch.tanh(v)
    error = (z.double().cpu() / cap - exact).abs()
    if precise:
        relative, near_zero = error / exact.abs(), v.abs() < TANH_SERIES_BELOW
        worst = (relative.max().item(), relative[near_zero].max().item())
        assert worst[0] < 1e-6 and worst[1] < 1.5e-7, f"tanh's relative error (all, series range): {worst}"
    else:
        assert error.max() < 4e-7, f"tanh's absolute error {error.max().item():.3g}"
    exact_slope = scale / torch.cosh(v) ** 2
    relative_slope = (slope.double().cpu() - exact_slope).abs() / exact_slope
    excess = (relative_slope / v.abs().clamp(min=1)).max().item()  # exp2's argument rounds: ~|u| ulps far out
    assert excess <= 1e-6, f"the slope's relative error per max(|u|, 1): {excess:.3g}"
