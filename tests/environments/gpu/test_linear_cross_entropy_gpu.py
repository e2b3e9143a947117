"""The fused output projection + CE + z-loss on a GPU at a real size, each of its paths (logits
recomputed in backward by the Triton ``tl.dot`` kernels or by GEMM chunks; gradients made in
forward with the loss mask as token weights, and with the upstream gradient known in forward, the
weight gradient into ``main_grad``), against float64 and no worse than the unfused path
of the same dtype (cuBLAS logits, then the op), also with a logit scale and soft cap; the Triton
path captured in a CUDA graph, with and without the cap. Skipped without CUDA."""

import pytest
import torch

from support import capture_cuda_graph, linear_loss_and_grads_float64, relative_error, split_transform
from mindspeed_cez import linear_cross_entropy_zloss, vocab_parallel_cross_entropy_zloss
from mindspeed_cez import GradientPath, LinearCrossEntropyOptions, TrainerInputs
from mindspeed_cez.patches.loss_wrappers import main_grad_target  # the adaptor's weight-gradient target
from mindspeed_cez import ForwardGradientLedger  # noqa: E402

LEDGER = ForwardGradientLedger()  # the forwards of these tests that owe a backward

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

N, H, V, Z = 4096, 2048, 32768, 1e-3


PATHS = [("triton", torch.bfloat16), ("triton", torch.float16), ("triton", torch.float32), ("gemm", torch.bfloat16),
         ("forward", torch.bfloat16), ("main_grad", torch.bfloat16), ("main_grad16", torch.bfloat16)]


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("path,dtype", PATHS, ids=[f"{p}-{str(d)[6:]}" for p, d in PATHS])
def test_matches_float64_at_a_real_size(path, dtype, label_smoothing):
    _compare_at_a_real_size(path, dtype, label_smoothing)


TRANSFORM_PATHS = [("triton", torch.bfloat16), ("triton", torch.float32), ("gemm", torch.bfloat16),
                   ("forward", torch.bfloat16), ("main_grad", torch.bfloat16)]


@pytest.mark.parametrize("path,dtype", TRANSFORM_PATHS, ids=[f"{p}-{str(d)[6:]}" for p, d in TRANSFORM_PATHS])
def test_scaled_and_soft_capped_at_a_real_size(path, dtype):
    """Logits of spread ~4 scaled by 2 and capped at 15: much of the tanh's curve, on every path."""
    _compare_at_a_real_size(path, dtype, 0.1, logit_scale=2.0, logit_softcap=15.0)


def _compare_at_a_real_size(path, dtype, label_smoothing, **transform):
    # main_grad: the upstream gradient known in forward; main_grad16: into a main_grad in the weight's
    # dtype (Megatron without fp32 gradient accumulation), one rounding per token block
    forward_grads = path in ("forward", "main_grad", "main_grad16")
    into_main_grad = path in ("main_grad", "main_grad16")
    g = torch.Generator(device="cuda").manual_seed(5)
    hidden = torch.randn(N, H, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(V, H, device="cuda", generator=g) * 4 / H**0.5).to(dtype)
    target = torch.randint(0, V, (N,), device="cuda", generator=g)
    target[torch.rand(N, device="cuda", generator=g) < 0.1] = -100
    mask = (torch.rand(N, device="cuda", generator=g) < 0.9).float()
    upstream = mask / mask.sum()
    exp_loss, exp_dh, exp_dw = linear_loss_and_grads_float64(hidden, weight, target, upstream, z_loss_coeff=Z,
                                                              label_smoothing=label_smoothing, **transform)

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    if into_main_grad:
        w.main_grad = torch.zeros(w.shape, dtype=dtype if path == "main_grad16" else torch.float32, device="cuda")
    options = LinearCrossEntropyOptions(split_transform(transform)[1],
                                        GradientPath("forward" if forward_grads else "recompute"),
                                        linear_backend=None if forward_grads else path)
    trainer = TrainerInputs(token_weights=mask if forward_grads else None,
                            grad_scale=1 / mask.sum() if into_main_grad else None,
                            weight_grad=main_grad_target(w) if into_main_grad else None, ledger=LEDGER)
    loss, _ = linear_cross_entropy_zloss(h, w, target, Z, label_smoothing, options=options, trainer=trainer)
    (loss * upstream).sum().backward()
    dweight = w.main_grad if into_main_grad else w.grad
    hu, wu = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lu, _ = vocab_parallel_cross_entropy_zloss(hu @ wu.t(), target, Z, label_smoothing,
                                               logit_transform=split_transform(transform)[1])
    (lu * upstream).sum().backward()

    # logits in the inputs' dtype bound the unfused path's error (the float64 reference takes exact products)
    for ours, unfused, exp in ((loss, lu, exp_loss), (h.grad, hu.grad, exp_dh), (dweight, wu.grad, exp_dw)):
        slack = 4e-3 if path == "main_grad16" and ours is dweight else 1e-4  # a bf16 sum over 4 blocks
        assert relative_error(ours, exp) <= 1.5 * relative_error(unfused, exp) + slack, (
            relative_error(ours, exp), relative_error(unfused, exp))


@pytest.mark.parametrize("transform", [{}, {"logit_softcap": 20.0}], ids=["plain", "softcap"])
def test_triton_path_captures_in_a_cuda_graph(transform):
    n, h, v = 1000, 256, 5000  # no dimension a multiple of the tiles
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(v, h, device="cuda") / h**0.5 * 4).bfloat16()
    target = torch.randint(0, v, (n,), device="cuda")
    upstream = torch.randn(n, device="cuda")

    def step():
        x, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        loss, z_loss = linear_cross_entropy_zloss(x, w, target, Z, 0.1,
                                                  options=LinearCrossEntropyOptions(split_transform(transform)[1],
                                                                                    linear_backend="triton"))
        return (loss, z_loss, *torch.autograd.grad(loss, (x, w), upstream))

    graph, out = capture_cuda_graph(step)
    for seed in range(2):
        torch.manual_seed(seed)
        hidden.copy_(torch.randn(n, h, device="cuda"))
        target.copy_(torch.randint(0, v, (n,), device="cuda"))
        upstream.copy_(torch.randn(n, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        for replayed, eager in zip(out, step()):
            assert torch.equal(replayed, eager)


CUDA_ACCUMULATIONS = ["addmm_out_dtype", "triton", "gemm_add"]


@pytest.mark.parametrize("kind", CUDA_ACCUMULATIONS)
def test_each_cuda_accumulation_matches_float64(kind):
    """``out += a @ b`` into fp32 through each CUDA way, forced in turn, at a weight gradient's shape
    (``a`` the transposed view ``dlogits.T``), against float64: fp32 sums where the product is not
    rounded (out_dtype, the Triton kernel's epilogue), one bf16 rounding of it (gemm_add)."""
    from mindspeed_cez import linear_forward_grads as acc

    if kind == "addmm_out_dtype" and not acc.ADDMM_OUT_DTYPE:
        pytest.skip("torch.addmm has no out_dtype before torch 2.8")
    g = torch.Generator(device="cuda").manual_seed(6)
    for n, v, h in ((4096, 5000, 1024), (1000, 32768, 2048)):  # tiles divide neither / the vocab
        dlogits = torch.randn(n, v, device="cuda", generator=g).bfloat16()
        x = torch.randn(n, h, device="cuda", generator=g).bfloat16()
        out = torch.randn(v, h, device="cuda", generator=g)
        expected = out.double() + dlogits.double().t() @ x.double()
        acc.Accumulator(out.device, kind)(out, dlogits.t(), x)
        assert relative_error(out, expected) < (5e-3 if kind == "gemm_add" else 1e-5), (kind, n, v, h)


@pytest.mark.parametrize("path", ["main_grad", "recompute_main_grad"])
@pytest.mark.parametrize("kind", CUDA_ACCUMULATIONS)
def test_the_op_on_each_cuda_accumulation(kind, path):
    """The fused op's weight gradient into fp32 main_grad with each CUDA accumulation forced (the
    torch < 2.8 path on this torch: ``triton``), against float64 and the unfused path."""
    from mindspeed_cez import linear_forward_grads as acc

    if kind == "addmm_out_dtype" and not acc.ADDMM_OUT_DTYPE:
        pytest.skip("torch.addmm has no out_dtype before torch 2.8")
    g = torch.Generator(device="cuda").manual_seed(7)
    hidden = torch.randn(N, H, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(V, H, device="cuda", generator=g) * 4 / H**0.5).bfloat16()
    target = torch.randint(0, V, (N,), device="cuda", generator=g)
    mask = (torch.rand(N, device="cuda", generator=g) < 0.9).float()
    upstream = mask / mask.sum()
    _, exp_dh, exp_dw = linear_loss_and_grads_float64(hidden, weight, target, upstream, z_loss_coeff=Z)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    w.main_grad = torch.zeros(w.shape, device="cuda")
    forward = path == "main_grad"
    loss, _ = linear_cross_entropy_zloss(h, w, target, Z,
                                         options=LinearCrossEntropyOptions(path=GradientPath("forward" if forward else "recompute"),
                                                                           accumulation=kind),
                                         trainer=TrainerInputs(token_weights=mask if forward else None, grad_scale=1 / mask.sum() if forward else None, weight_grad=main_grad_target(w), ledger=LEDGER))
    (loss * upstream).sum().backward()
    hu, wu = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lu, _ = vocab_parallel_cross_entropy_zloss(hu @ wu.t(), target, Z)
    (lu * upstream).sum().backward()
    for ours, unfused, exp in ((h.grad, hu.grad, exp_dh), (w.main_grad, wu.grad, exp_dw)):
        assert relative_error(ours, exp) <= 1.5 * relative_error(unfused, exp) + 1e-4, (
            kind, path, relative_error(ours, exp), relative_error(unfused, exp))


# the fused layer's forward path on 64 tokens, in a script for a fresh process (a device-side assert ends
# its CUDA context): hidden h, weight w, targets t, loss mask m
_FORWARD_PATH = (
    "import torch\n"
    "from mindspeed_cez import GradientPath, LinearCrossEntropyOptions, TrainerInputs, linear_cross_entropy_zloss\n"
    "h = torch.randn(64, 32, device='cuda').requires_grad_()\n"
    "w = torch.randn(100, 32, device='cuda').requires_grad_()\n"
    "t = torch.randint(0, 100, (64,), device='cuda')\n"
    "m = torch.ones(64, device='cuda')\n")


def _output_of_a_failing_script(script):
    """What ``python -c script`` printed, after checking it failed."""
    import os
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert run.returncode != 0, run.stdout[-3000:]
    return run.stderr + run.stdout


def test_the_device_assert_names_the_fix():
    """A loss weighted other than the forward assumed: the CUDA device-side assert's text names the
    cause and the fix, ``GradientPath('recompute')``."""
    output = _output_of_a_failing_script(
        _FORWARD_PATH
        + "loss, _ = linear_cross_entropy_zloss(h, w, t, trainer=TrainerInputs(token_weights=m, grad_scale=0.5))\n"
          "(loss * torch.rand(64, device='cuda')).sum().backward()\n"
          "torch.cuda.synchronize()\n")
    assert "For custom loss weighting run with GradientPath('recompute')" in output, output[-3000:]


def test_a_non_finite_grad_scale_tensor_is_a_device_assert():
    """A CUDA ``grad_scale`` tensor holding NaN: a device-side assert naming grad_scale (no host sync in the op)."""
    output = _output_of_a_failing_script(
        _FORWARD_PATH
        + "from mindspeed_cez import ForwardGradientLedger\n"
          "from mindspeed_cez.linear_cross_entropy import WeightGradTarget\n"
          "w.main_grad = torch.zeros(100, 32, device='cuda')\n"
          "s = torch.tensor(float('nan'), device='cuda')\n"
          "loss, _ = linear_cross_entropy_zloss(h, w, t, trainer=TrainerInputs(token_weights=m, grad_scale=s,\n"
          "                                     weight_grad=WeightGradTarget(w.main_grad),\n"
          "                                     ledger=ForwardGradientLedger()))\n"
          "torch.cuda.synchronize()\n")
    assert "grad_scale must be finite" in output, output[-3000:]


def _sequence_parallel_over_nccl(rank, world_size, grads):
    import torch.distributed as dist

    n, h, v = 2048, 1024, 16384
    g = torch.Generator(device="cuda").manual_seed(9)  # every rank draws the same full problem
    hidden = torch.randn(n, 1, h, device="cuda", generator=g).to(torch.bfloat16)
    weight = (torch.randn(v, h, device="cuda", generator=g) * 4 / h**0.5).to(torch.bfloat16)
    target = torch.randint(0, v, (n, 1), device="cuda", generator=g)
    target[torch.rand(n, 1, device="cuda", generator=g) < 0.1] = -100
    mask = (torch.rand(n, 1, device="cuda", generator=g) < 0.9).float()
    upstream = mask / mask.sum()
    exp_loss, exp_dh, exp_dw = linear_loss_and_grads_float64(hidden, weight, target, upstream, z_loss_coeff=Z)
    seq, rows = slice(rank * n // world_size, (rank + 1) * n // world_size), slice(rank * v // world_size,
                                                                                   (rank + 1) * v // world_size)
    hs, ws = hidden[seq].clone().requires_grad_(), weight[rows].clone().requires_grad_()
    if grads == "main_grad":
        ws.main_grad = torch.zeros(ws.shape, device="cuda")
    loss, _ = linear_cross_entropy_zloss(hs, ws, target, Z, tp_group=dist.group.WORLD, sequence_parallel=True,
                                         options=LinearCrossEntropyOptions(path=GradientPath("recompute" if grads == "recompute" else "forward")),
                                         trainer=TrainerInputs(token_weights=None if grads == "recompute" else mask, grad_scale=1 / mask.sum() if grads == "main_grad" else None, weight_grad=main_grad_target(ws) if grads == "main_grad" else None, ledger=LEDGER))
    (loss * upstream).sum().backward()
    dweight = ws.main_grad if grads == "main_grad" else ws.grad
    hu, wu = hidden.clone().requires_grad_(), weight.clone().requires_grad_()  # the unfused path on one rank
    lu, _ = vocab_parallel_cross_entropy_zloss(hu @ wu.t(), target, Z)
    (lu * upstream).sum().backward()
    for ours, unfused, exp in ((loss, lu, exp_loss), (hs.grad, hu.grad[seq], exp_dh[seq]),
                               (dweight, wu.grad[rows], exp_dw[rows])):
        assert relative_error(ours, exp) <= 1.5 * relative_error(unfused, exp) + 1e-4, (
            relative_error(ours, exp), relative_error(unfused, exp))


@pytest.mark.parametrize("grads", ["recompute", "forward", "main_grad"])
def test_sequence_parallel_over_nccl(grads):
    """TP over every GPU (at most four) with sequence parallelism over NCCL: hidden all-gathered,
    dhidden reduce-scattered (in forward, beside the last weight-gradient GEMM, where the upstream
    gradient is known), against float64 and no worse than the unfused path."""
    from support import run_on_ranks

    world_size = min(torch.cuda.device_count(), 4)
    if world_size < 2:
        pytest.skip("needs 2 GPUs")
    run_on_ranks(world_size, _sequence_parallel_over_nccl, grads, backend="nccl")


@pytest.mark.parametrize("budget_mib", [None, 256])
def test_the_output_layer_holds_at_most_its_block_of_logits(budget_mib):
    """At 65536 tokens of a 32768 vocabulary (4 GiB of bf16 logits), the gradients-in-forward path into
    main_grad holds at most one block of logits (its default 4 GiB, or ``block_bytes``) beyond its inputs,
    their gradients and small per-token vectors: the peak of forward + backward, measured by the allocator."""
    n, h, v = 65536, 1024, 32768
    g = torch.Generator(device="cuda").manual_seed(7)
    hidden = torch.randn(n, h, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h, device="cuda", generator=g) / h**0.5).to(torch.bfloat16).requires_grad_()
    weight.main_grad = torch.zeros(v, h, device="cuda")
    target = torch.randint(0, v, (n,), device="cuda", generator=g)
    mask = torch.ones(n, device="cuda")
    budget = 4 << 30 if budget_mib is None else budget_mib << 20
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss, _ = linear_cross_entropy_zloss(hidden, weight, target, Z,
                                         options=LinearCrossEntropyOptions(path=GradientPath("forward", block_bytes=None if budget_mib is None else budget)),
                                         trainer=TrainerInputs(token_weights=mask, grad_scale=1 / n, weight_grad=main_grad_target(weight), ledger=LEDGER))
    (loss * mask / n).sum().backward()
    torch.cuda.synchronize()
    beyond = torch.cuda.max_memory_allocated() - before
    # dhidden (n x h bf16, twice: the op's buffer and the gradient accumulated into hidden.grad), fp32 loss rows
    # and per-token vectors (~64 bytes a token); the logits themselves would be n x v x 2 = 4 GiB
    others = 2 * n * h * 2 + 64 * n
    assert beyond <= budget + others, (beyond / 2**20, budget / 2**20, others / 2**20)
    if budget_mib is not None:
        assert beyond < n * v * 2 / 4  # a quarter of the logits at most: the bound is what holds memory down
    assert torch.isfinite(loss).all() and weight.main_grad.abs().sum() > 0
