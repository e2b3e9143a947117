"""``out += a @ b`` into fp32 from 16-bit operands (the fused output layer's weight gradient): which
way each device and torch takes, and each way's numbers against float64 on the CPU: the 16-bit GEMM
into a reused buffer plus an fp32 add, this package's Triton kernel under the interpreter, and
MindSpeed's ``npu_matmul_add_fp32`` through a stand-in of its contract (tests/support/stand_ins/) that
records its calls; then the op's paths (recompute, gradients in forward) on each."""

import contextlib
import os
import sys
import types

import pytest
import torch

from support import STAND_INS, relative_error
from support.backends import triton_runs_on_cpu
from mindspeed_cez import linear_forward_grads as acc
from mindspeed_cez import GradientPath, LinearCrossEntropyOptions, TrainerInputs
from mindspeed_cez import linear_cross_entropy_zloss
from mindspeed_cez.patches.loss_wrappers import main_grad_target  # the adaptor's weight-gradient target
from mindspeed_cez import ForwardGradientLedger  # noqa: E402

LEDGER = ForwardGradientLedger()  # the forwards of these tests that owe a backward

NPU = types.SimpleNamespace(type="npu")  # torch.device("npu") needs torch_npu
needs_interpreter = pytest.mark.skipif(not triton_runs_on_cpu(),
                                       reason="the Triton kernel takes CPU tensors only under TRITON_INTERPRET=1")


@contextlib.contextmanager
def mindspeed_stand_in():
    """MindSpeed's ``npu_matmul_add`` importable (the stand-in) while open; gone again after."""
    before = set(sys.modules)
    sys.path.insert(0, STAND_INS)
    acc.chosen_cache_clear()
    try:
        from mindspeed.ops import npu_matmul_add

        npu_matmul_add.CALLS.clear()
        yield npu_matmul_add.CALLS
    finally:
        sys.path.remove(STAND_INS)
        for name in set(sys.modules) - before:
            if name == "mindspeed" or name.startswith("mindspeed."):
                del sys.modules[name]
        acc.chosen_cache_clear()


def test_each_device_and_torch_gets_its_accumulation():
    assert acc.kind_for(torch.device("cpu")) == "gemm_add"
    assert acc.kind_for(NPU) == "gemm_add"  # MindSpeed not importable here
    cuda = "addmm_out_dtype" if acc.ADDMM_OUT_DTYPE else "triton" if acc._triton_kernel() else "gemm_add"
    assert acc.kind_for(torch.device("cuda")) == cuda
    newer = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 8)
    assert acc.ADDMM_OUT_DTYPE == newer  # read from the operator's schema, not the version
    with mindspeed_stand_in():
        assert acc.kind_for(NPU) == "npu_matmul_add" and acc.kind_for(torch.device("cpu")) == "gemm_add"
    assert acc.kind_for(NPU) == "gemm_add"
    assert acc.kind_for(torch.device("cuda"), "gemm_add") == "gemm_add"
    for kind, message in (("cublas", "accumulation must be None .automatic. or one of"),
                          ("npu_matmul_add", "needs MindSpeed")):
        with pytest.raises(ValueError, match=message):
            acc.check_accumulation(kind)
        with pytest.raises(ValueError, match=message):
            LinearCrossEntropyOptions(accumulation=kind)


def _operands(dtype, m, k, n, gen, transposed_a):
    a = torch.randn(k, m, generator=gen).to(dtype).t() if transposed_a else torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(k, n, generator=gen).to(dtype)
    out = torch.randn(m, n, generator=gen)
    return a, b, out, out.double() + a.double() @ b.double()


# bound of ||out - exact|| / ||exact||: the 16-bit product rounded once (gemm_add); else fp32 sums only
TOLERANCE = {"gemm_add": {torch.bfloat16: 6e-3, torch.float16: 8e-4}, "triton": 2e-6, "npu_matmul_add": 2e-7}


@pytest.mark.parametrize("transposed_a", [False, True], ids=["a", "a.T view"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["gemm_add", "triton", "npu_matmul_add"])
def test_each_accumulation_matches_float64(kind, dtype, transposed_a):
    """Shapes that divide no tile (interpreter tiles 16 x 32 x 16), ``a`` as given and as a
    transposed view (the weight gradient's ``dlogits.T``); the buffer is reused for a smaller product."""
    if kind == "triton" and not triton_runs_on_cpu():
        pytest.skip("the Triton kernel takes CPU tensors only under TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(21)
    stand_in = mindspeed_stand_in() if kind == "npu_matmul_add" else contextlib.nullcontext([])
    with stand_in as calls:
        acc.check_accumulation(kind)
        accumulate = acc.Accumulator(torch.device("cpu"), kind)
        for m, k, n in ((37, 70, 45), (20, 33, 17)):
            a, b, out, expected = _operands(dtype, m, k, n, gen, transposed_a)
            accumulate(out, a, b)
            ran = "gemm_add" if kind == "npu_matmul_add" and not transposed_a else kind  # a.T not contiguous
            tol = TOLERANCE[ran][dtype] if ran == "gemm_add" else TOLERANCE[ran]
            assert relative_error(out, expected) < tol, (m, k, n, relative_error(out, expected))
        if kind == "gemm_add":  # one buffer, allocated for the first (larger) product
            assert accumulate._scratch.numel() == 37 * 45 and accumulate._scratch.dtype == dtype
        if kind == "npu_matmul_add":  # grad_output = a.T, taken only where it is contiguous
            expected_calls = [((70, 45), (70, 37), (37, 45), dtype), ((33, 17), (33, 20), (20, 17), dtype)]
            assert calls == (expected_calls if transposed_a else []), calls


def test_16_bit_out_and_fp32_operands_take_one_gemm_in_their_dtype():
    gen = torch.Generator().manual_seed(22)
    a, b = torch.randn(9, 7, generator=gen), torch.randn(7, 5, generator=gen)
    out = torch.randn(9, 5, generator=gen)
    expected = out.double() + a.double() @ b.double()
    acc.Accumulator(torch.device("cpu"))(out, a, b)
    assert relative_error(out, expected) < 1e-6
    out16 = torch.zeros(9, 5, dtype=torch.bfloat16)
    acc.Accumulator(torch.device("cpu"))(out16, a.bfloat16(), b.bfloat16())
    assert out16.dtype == torch.bfloat16 and relative_error(out16, a.double() @ b.double()) < 1.5e-2


@needs_interpreter
def test_triton_kernel_checks_its_arguments():
    from mindspeed_cez.kernels.triton_matmul_accumulate import matmul_accumulate

    a, b = torch.randn(4, 3).bfloat16(), torch.randn(3, 5).bfloat16()
    with pytest.raises(ValueError, match="do not fit"):
        matmul_accumulate(torch.zeros(4, 4), a, b)
    with pytest.raises(TypeError, match="16-bit a, b of one dtype and an fp32 c"):
        matmul_accumulate(torch.zeros(4, 5), a, b.half())
    with pytest.raises(ValueError, match="unit column stride"):
        matmul_accumulate(torch.zeros(5, 4).t(), a, b)


SEQ, BATCH, HIDDEN, VOCAB = 11, 3, 24, 70


@pytest.mark.parametrize("path", ["recompute", "forward", "forward, grad_scale"])
@pytest.mark.parametrize("kind", ["gemm_add", "triton", "npu_matmul_add"])
def test_the_op_on_each_accumulation(kind, path):
    """The fused op's weight gradient into an fp32 ``main_grad`` (and its fp32 ``dhidden`` sums)
    through each accumulation, bf16, against float64; several vocab chunks / token blocks."""
    if kind == "triton" and not triton_runs_on_cpu():
        pytest.skip("the Triton kernel takes CPU tensors only under TRITON_INTERPRET=1")
    from support import cross_entropy_zloss_float64

    gen = torch.Generator().manual_seed(23)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=gen).bfloat16()
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) / HIDDEN**0.5 * 3).bfloat16()
    target = torch.randint(0, VOCAB, (SEQ, BATCH), generator=gen)
    mask = (torch.rand(target.shape, generator=gen) < 0.8).float()
    scale = 0.37
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    loss64, _, _ = cross_entropy_zloss_float64(h64 @ w64.t(), target, z_loss_coeff=1e-3)
    (loss64 * scale * mask.double()).sum().backward()

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    w.main_grad = torch.full(w.shape, 0.5)
    w.grad_added_to_main_grad = False
    options = dict(path=GradientPath("recompute" if path == "recompute" else "forward", row_block=16), chunk_cols=32,
                   accumulation=kind)
    trainer = TrainerInputs(token_weights=None if path == "recompute" else mask, weight_grad=main_grad_target(w),
                            grad_scale=scale if path == "forward, grad_scale" else None, ledger=LEDGER)
    stand_in = mindspeed_stand_in() if kind == "npu_matmul_add" else contextlib.nullcontext([])
    with stand_in as calls:
        loss, _ = linear_cross_entropy_zloss(h, w, target, z_loss_coeff=1e-3,
                                             options=LinearCrossEntropyOptions(**options), trainer=trainer)
        (loss * scale * mask).sum().backward()
    assert relative_error(w.main_grad.double() - 0.5, w64.grad) < 1e-2
    assert relative_error(h.grad, h64.grad) < 1e-2
    if kind == "npu_matmul_add":  # the weight gradient's products went through MindSpeed's op
        wgrad = (32, HIDDEN) if path == "recompute" else (VOCAB, HIDDEN)  # a vocab chunk's rows / all rows
        assert any(c[2] == wgrad for c in calls) and all(c[3] == torch.bfloat16 for c in calls), calls
