"""Every Triton kernel variant the package launches runs under triton-ascend's interpreter with the
NPU launch settings (``support.npu_launch.launched_as(monkeypatch, "npu")``: Ascend's tiles, one slot per forward tile,
block sizes, warps, eviction, the 16-bit dot without the interpreter's fp32 widening) on CPU
tensors, and matches float64: loss, z-loss, lse and the logits' gradient, for the streaming kernels
(one rank: the finishing forward; two vocab shards: partials, loss from partials) and
the fused output projection's ``tl.dot`` kernels (partials, merge, gradient tiles), with and
without label smoothing, the logit scale and the soft cap; fp32 and bf16, and fp16 for the
fused layer, whose 16-bit ``tl.dot`` the interpreter executes as the NPU launch compiles it
(bf16's it cannot: it multiplies bf16's raw bits, so there the operands are widened to fp32,
the same exact products, as on the CPU setting).

Runs where ``triton`` is triton-ascend's (CI: ``.ci/leg_ascend.sh``, with ``numpy<2``, which its
interpreter needs); skipped elsewhere. The last test checks that the launches covered every
variant ``tests/support/kernel_variants.py`` lists for the NPU setting (the list the lowering leg compiles).
"""

import zlib

import pytest
import torch

pytest.importorskip("triton.backends.ascend", reason="needs triton-ascend (CI: .ci/leg_ascend.sh)")

from support import cross_entropy_zloss_float64, loss_and_grad_float64, relative_error  # noqa: E402
from support.npu_launch import launched_as  # noqa: E402

from mindspeed_cez import kernels  # noqa: E402
from mindspeed_cez.kernels import triton_cross_entropy as tce  # noqa: E402
from mindspeed_cez.kernels import LossSpec, VocabShard  # noqa: E402
from mindspeed_cez.kernels import triton_linear_cross_entropy as tlce  # noqa: E402
from mindspeed_cez.kernels import triton_matmul_accumulate as tma  # noqa: E402
from support.kernel_variants import linear_variants, variants  # noqa: E402

IGNORE = -100
C = 1e-3
# (label smoothing, logit scale, soft cap): the transforms the kernels compile, with the smoothing sum.
CASES = [(0.0, 1.0, 0.0), (0.1, 1.0, 0.0), (0.1, 0.7, 0.0), (0.1, 1.3, 5.0)]
SOFTCAP = CASES[-1]
# fp32 and fp16 (the fused layer's NPU dot) take every case; bf16 the soft cap with smoothing
# (its variants are fp16's), which keeps this leg to about two minutes on two cores.
STREAMING = [("fp32", *c) for c in CASES] + [("bf16", *SOFTCAP)]
LINEAR = [(d, *c) for d in ("fp32", "fp16") for c in CASES] + [("bf16", *SOFTCAP)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LINEAR_DTYPES = {**DTYPES, "fp16": torch.float16}
# (loss, gradient): 16-bit logits give fp32 losses; the gradient is written in the logits' dtype.
TOL = {"fp32": (1e-5, 1e-5), "bf16": (1e-5, 8e-3), "fp16": (1e-5, 1e-3)}
# 4100 columns: two forward tiles of the NPU's 4096 with a ragged tail (the constexprs of a
# 151936-wide slice); the fused layer's tiles do not depend on the width.
# 24 rows on the interpreter's 16 programs: one or two rows each.
N_ROWS, N_COLS, HIDDEN = 24, 4100, 48

LAUNCHED = []  # (kernel, {parameter: value}, options) of every launch in this module


@pytest.fixture(scope="module", autouse=True)
def record_launches():
    launcher = type(tce._launch_forward)  # the kernels' Launcher class, wherever it lives
    original = launcher.__call__

    def recording(self, grid, args, options):
        LAUNCHED.append((self.kernel, dict(zip(self.kernel.arg_names, args)), dict(options)))
        return original(self, grid, args, options)

    launcher.__call__ = recording
    try:
        yield
    finally:
        launcher.__call__ = original


def _spec(smoothing, scale=1.0, cap=0.0):
    """The backends' description of the loss."""
    return LossSpec(IGNORE, C, smoothing, kernels.LogitTransform(scale, cap))


def _inputs(dtype, seed, n_rows=N_ROWS, n_cols=N_COLS):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n_rows, n_cols, generator=gen) * 3).to(dtype)
    target = torch.randint(0, n_cols, (n_rows,), generator=gen)
    target[::7] = IGNORE
    upstream = torch.rand(n_rows, generator=gen) + 0.5
    return logits, target, upstream


def _check(name, got_loss, got_grad, logits, target, upstream, tol, **kw):
    loss64, z64, grad64 = loss_and_grad_float64(logits, target, upstream, ignore_index=IGNORE, z_loss_coeff=C, **kw)
    _, _, lse64 = cross_entropy_zloss_float64(logits, target, C, ignore_index=IGNORE, **kw)
    loss, z_loss, lse = got_loss
    valid = target != IGNORE
    assert relative_error(loss, loss64) < tol[0], (name, relative_error(loss, loss64))
    assert relative_error(z_loss, z64) < tol[0], name
    assert relative_error(lse[valid], lse64[valid]) < tol[0], name
    assert relative_error(got_grad, grad64) < tol[1], (name, relative_error(got_grad, grad64))
    assert not got_grad[~valid].any(), f"{name}: ignored rows got a gradient"


@pytest.mark.parametrize("dtype, smoothing, scale, cap", STREAMING)
def test_streaming_kernels_one_rank_and_two_shards(dtype, smoothing, scale, cap, monkeypatch):
    logits, target, upstream = _inputs(DTYPES[dtype], seed=zlib.crc32(repr((dtype, smoothing, scale, cap)).encode()))
    spec = _spec(smoothing, scale, cap)
    kw = dict(label_smoothing=smoothing, logit_scale=scale, logit_softcap=cap)
    with monkeypatch.context() as patch:
        launched_as(patch, "npu")
        # one rank: the finishing forward, then the gradient
        out = tce.fused_loss(logits, target, spec)
        grad = torch.empty_like(logits)
        tce.write_grad(logits, grad, target, out[2].clone(), upstream, spec, VocabShard.whole(N_COLS))
        _check("one rank", out, grad, logits, target, upstream, TOL[dtype], **kw)

        # two vocab shards: partials, the all-gather done by hand (a stack), then the loss
        half = N_COLS // 2
        shards = (logits[:, :half].contiguous(), logits[:, half:].contiguous())
        parts = [tce.shard_partials(s, target, spec, VocabShard(r * half, half, N_COLS, r, 2))
                 for r, s in enumerate(shards)]
        merged = tce.loss_from_partials(torch.stack(parts), target, spec)
        grads = [torch.empty_like(s) for s in shards]
        for r, (s, g) in enumerate(zip(shards, grads)):
            tce.write_grad(s, g, target, merged[2].clone(), upstream, spec, VocabShard(r * half, half, N_COLS, r, 2))
        _check("two shards", merged, torch.cat(grads, 1), logits, target, upstream, TOL[dtype], **kw)


@pytest.mark.parametrize("dtype, smoothing, scale, cap", LINEAR)
def test_fused_output_projection_kernels(dtype, smoothing, scale, cap, monkeypatch):
    gen = torch.Generator().manual_seed(7 + len(dtype) + int(10 * smoothing + scale + cap))
    n_cols = 300  # three of the NPU's 128-column tiles, ragged; two row blocks of 64, ragged
    hidden = (torch.randn(N_ROWS + 66, HIDDEN, generator=gen) * 0.5).to(LINEAR_DTYPES[dtype])
    weight = (torch.randn(n_cols, HIDDEN, generator=gen) * 0.5).to(LINEAR_DTYPES[dtype])
    target = torch.randint(0, n_cols, (hidden.shape[0],), generator=gen)
    target[::7] = IGNORE
    upstream = torch.rand(hidden.shape[0], generator=gen) + 0.5
    spec, shard = _spec(smoothing, scale, cap), VocabShard.whole(n_cols)
    with monkeypatch.context() as patch:
        launched_as(patch, "npu")
        partials = tlce.linear_partials(hidden, weight, target, spec, shard)
        out = tce.loss_from_partials(partials[None], target, spec)
        grad = torch.empty(hidden.shape[0], n_cols, dtype=hidden.dtype)
        tlce.linear_grad(hidden, weight, grad, target, out[2].clone(), upstream, spec, shard)
    logits = hidden.double() @ weight.double().t()  # the exact products of the 16-bit operands
    _check("fused output projection", out, grad, logits, target, upstream, TOL[dtype],
           label_smoothing=smoothing, logit_scale=scale, logit_softcap=cap)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("k", [128, 100])  # a multiple of the NPU's 64-wide k step, and a k tail
def test_fp32_accumulation_kernel(dtype, k, monkeypatch):
    """``main_grad += dlogits.T @ hidden`` as the fused layer calls it: ``a`` a transposed view."""
    gen = torch.Generator().manual_seed(11 + k + len(dtype))
    dlogits = torch.randn(k, 200, generator=gen).to(LINEAR_DTYPES[dtype])  # [tokens, vocab rows]
    hidden = torch.randn(k, 72, generator=gen).to(LINEAR_DTYPES[dtype])  # [tokens, h]
    main_grad = torch.randn(200, 72, generator=gen)
    expected = main_grad.double() + dlogits.double().t() @ hidden.double()
    with monkeypatch.context() as patch:
        launched_as(patch, "npu")
        tma.matmul_accumulate(main_grad, dlogits.t(), hidden)
    assert relative_error(main_grad, expected) < 1e-6


def test_launched_as_is_scoped_and_refused_on_accelerator_tensors(monkeypatch):
    logits, target, _ = _inputs(torch.float32, seed=3, n_rows=4)
    with monkeypatch.context() as patch:
        launched_as(patch, "npu")
        tce.fused_loss(logits, target, _spec(0.0))
    tce.fused_loss(logits, target, _spec(0.0))  # after the block: the CPU setting again
    npu, cpu = LAUNCHED[-2][1], LAUNCHED[-1][1]
    assert npu["SLOTS"] == 1 and npu["SLOT_WIDTH"] == 4096, "NPU: one slot per 4096-column tile"
    assert cpu["SLOT_WIDTH"] == 8, "CPU (the interpreter's own setting): 8-wide slots"
    with pytest.raises(ValueError, match="device_type must be one of"):
        launched_as(monkeypatch, "tpu")
    launched_as(monkeypatch, "npu")
    with pytest.raises(RuntimeError, match="CPU tensors"):
        tce.launch_type(torch.device("cuda", 0))


def _matches(variant, launches):
    for kernel, args, options in launches:
        if kernel is not variant.fn:
            continue
        if options.get("num_warps", 4) != variant.num_warps:
            continue
        if all(args.get(k) == v for k, v in variant.constexprs.items()):
            return True
    return False


def test_every_npu_variant_was_executed():
    """Runs last in this module: the launches above covered each variant of the NPU setting."""
    assert LAUNCHED, "no kernel launched"
    expected = []
    for dtype in LINEAR_DTYPES:
        expected += [v for v in variants(tce.launch_settings("npu", N_COLS), dtype, N_COLS) if not v.cuda_only]
        expected += linear_variants("npu", dtype)  # with the fp32 accumulation kernel's
    missing = sorted({v.name for v in expected if not _matches(v, LAUNCHED)})
    assert not missing, f"variants of the NPU setting never executed here: {missing}"
