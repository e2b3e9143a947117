"""CUDA at real sizes: run through the device tool (CI has no GPU; these skip there).

    python -m pytest tests -m gpu        # on a GPU machine; TP=2 needs two GPUs
"""

import pytest
import torch
import torch.distributed as dist

from support import (capture_cuda_graph, loss_and_grad_float64_chunked, relative_error, relative_error_chunked, run_on_ranks,
                     split_transform)
from mindspeed_cez import kernels, vocab_parallel_cross_entropy_zloss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize(
    "n,vocab,label_smoothing",
    [(8192, 151936, 0.0), (14200, 151936, 0.1)],  # the second has n*vocab = 2.16e9 > 2**31
    ids=["8192x151936", "int64-offsets-14200x151936"],
)
def test_real_sizes_bf16(n, vocab, label_smoothing):
    gen = torch.Generator(device="cuda").manual_seed(n)
    base = (torch.randn(n, vocab, device="cuda", generator=gen) * 4).to(torch.bfloat16)
    target = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    target[torch.rand(n, device="cuda", generator=gen) < 0.1] = -100
    target[-1] = vocab - 1  # the very last element of the tensor is a target
    upstream = torch.randn(n, device="cuda", generator=gen)
    exp_loss, exp_grads = loss_and_grad_float64_chunked(base, target, upstream, z_loss_coeff=1e-4,
                                                         label_smoothing=label_smoothing)
    leaf = base.clone().requires_grad_(True)
    logits = leaf * 1
    loss, z_loss = vocab_parallel_cross_entropy_zloss(logits, target, z_loss_coeff=1e-4, label_smoothing=label_smoothing)
    assert relative_error(loss, exp_loss) < 1e-5
    (grad,) = torch.autograd.grad(loss, logits, upstream)
    assert grad.data_ptr() == logits.data_ptr()  # written in place
    assert relative_error_chunked(grad, exp_grads) < 8e-3
    last = grad[-1, -1].double().item()
    assert abs(last - exp_grads[-1][-1, -1].item()) < 1e-2 * abs(exp_grads[-1][-1, -1].item()) + 1e-6


@pytest.mark.parametrize("logit_softcap", [0.0, 30.0], ids=["scale", "scale-softcap"])
def test_real_size_scaled_and_soft_capped_bf16(logit_softcap):
    """8192 x 151936 bf16 with a logit scale, with and without the soft cap: loss, z-loss and the
    in-place gradient through the transform against float64."""
    n, vocab = 8192, 151936
    gen = torch.Generator(device="cuda").manual_seed(31)
    base = (torch.randn(n, vocab, device="cuda", generator=gen) * 8).to(torch.bfloat16)
    target = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    target[torch.rand(n, device="cuda", generator=gen) < 0.1] = -100
    upstream = torch.randn(n, device="cuda", generator=gen)
    transform = {"logit_scale": 1.7, "logit_softcap": logit_softcap}
    exp_loss, exp_grads = loss_and_grad_float64_chunked(base, target, upstream, z_loss_coeff=1e-4, label_smoothing=0.1,
                                                         **transform)
    leaf = base.clone().requires_grad_(True)
    logits = leaf * 1
    loss, _ = vocab_parallel_cross_entropy_zloss(logits, target, 1e-4, 0.1, logit_transform=split_transform(transform)[1])
    assert relative_error(loss, exp_loss) < 1e-5
    (grad,) = torch.autograd.grad(loss, logits, upstream)
    assert grad.data_ptr() == logits.data_ptr()
    assert relative_error_chunked(grad, exp_grads) < 8e-3


@pytest.mark.parametrize("transform", [{}, {"logit_scale": 0.5, "logit_softcap": 15.0}], ids=["plain", "softcap"])
def test_cuda_graph_captures_forward_and_backward(transform):
    n, vocab = 512, 32000
    static_logits = torch.randn(n, vocab, device="cuda", dtype=torch.bfloat16) * 3
    static_target = torch.randint(0, vocab, (n,), device="cuda")
    static_upstream = torch.randn(n, device="cuda")

    def step():
        leaf = static_logits.detach().requires_grad_(True)
        loss, z_loss = vocab_parallel_cross_entropy_zloss(leaf * 1, static_target, z_loss_coeff=1e-3,
                                                          logit_transform=split_transform(transform)[1])
        (grad,) = torch.autograd.grad(loss, leaf, static_upstream)
        return loss, z_loss, grad

    graph, out = capture_cuda_graph(step)  # warm-up compiles the kernels
    for seed in range(3):
        torch.manual_seed(seed)
        static_logits.copy_(torch.randn(n, vocab, device="cuda") * 3)
        static_target.copy_(torch.randint(0, vocab, (n,), device="cuda"))
        static_upstream.copy_(torch.randn(n, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        for replayed, expected in zip(out, eager):
            assert torch.equal(replayed, expected)


def _tp_nccl(rank, world_size, n, vocab):
    gen = torch.Generator(device="cuda").manual_seed(77)
    full = (torch.randn(n, vocab, device="cuda", generator=gen) * 4).to(torch.bfloat16)
    target = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    target[::7] = -100
    upstream = torch.randn(n, device="cuda", generator=gen)
    exp_loss, exp_grads = loss_and_grad_float64_chunked(full, target, upstream, z_loss_coeff=1e-4, label_smoothing=0.1)
    v_local = vocab // world_size
    shard = slice(rank * v_local, (rank + 1) * v_local)
    logits = full[:, shard].contiguous().requires_grad_(True)
    loss, _ = vocab_parallel_cross_entropy_zloss(
        logits * 1, target, z_loss_coeff=1e-4, label_smoothing=0.1, tp_group=dist.group.WORLD
    )
    loss.backward(upstream)
    assert relative_error(loss, exp_loss) < 1e-5
    assert relative_error_chunked(logits.grad, [g[:, shard] for g in exp_grads]) < 8e-3


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_over_nccl(tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    run_on_ranks(tp, _tp_nccl, 4096, 151936, backend="nccl")


def _tp_nccl_graph(rank, world_size):
    n, v_local = 1024, 8000
    static_logits = torch.empty(n, v_local, device="cuda", dtype=torch.bfloat16)
    static_target = torch.empty(n, device="cuda", dtype=torch.long)
    static_upstream = torch.empty(n, device="cuda")

    def refill(seed):  # the same target and upstream gradient on every rank, each rank its own shard
        gen = torch.Generator(device="cuda").manual_seed(seed)
        static_target.copy_(torch.randint(0, v_local * world_size, (n,), device="cuda", generator=gen))
        static_upstream.copy_(torch.randn(n, device="cuda", generator=gen))
        static_logits.copy_(torch.randn(n, v_local, device="cuda", generator=gen.manual_seed(seed + 100 + rank)) * 3)

    def step():
        leaf = static_logits.detach().requires_grad_(True)
        loss, z_loss = vocab_parallel_cross_entropy_zloss(leaf * 1, static_target, z_loss_coeff=1e-3,
                                                          tp_group=dist.group.WORLD)
        (grad,) = torch.autograd.grad(loss, leaf, static_upstream)
        return loss, z_loss, grad

    refill(0)
    step()  # eager first: NCCL's communicator and the kernels made before the capture
    graph, out = capture_cuda_graph(step)
    for seed in range(1, 4):
        refill(seed)
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        for replayed, expected in zip(out, eager):
            assert torch.equal(replayed, expected)


def test_tensor_parallel_forward_and_backward_capture_in_a_cuda_graph():
    """The TP forward's one collective and its width check make no host sync: forward + backward
    capture in a CUDA graph over NCCL, and replays equal eager calls."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    run_on_ranks(2, _tp_nccl_graph, backend="nccl")


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_unequal_shard_widths_are_a_device_assert(backend):
    """CUDA: the ranks' widths travel with the partials and are compared on the device (no host
    sync): partials of a 10- and a 12-column slice fail the stream (child process: the CUDA
    context is dead afterwards)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import sys
        import torch
        from mindspeed_cez import kernels
        from mindspeed_cez.kernels import LossSpec, VocabShard
        backend = kernels.get_backend(sys.argv[1])
        target = torch.randint(0, 20, (64,), device="cuda")
        spec = LossSpec(-100, 1e-3)
        parts = [backend.shard_partials(torch.randn(64, w, device="cuda"), target, spec, VocabShard(0, w, 20))
                 for w in (10, 12)]
        backend.loss_from_partials(torch.stack(parts), target, spec)
        torch.cuda.synchronize()
        print("no error")
        """
    )
    result = subprocess.run([sys.executable, "-c", code, backend], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "no error" not in result.stdout
    if backend == "triton":
        assert "vocab shards of unequal width" in result.stderr + result.stdout


def test_triton_is_the_cuda_backend():
    assert kernels.backend_for(torch.device("cuda")) is kernels.get_backend("triton")


def _op_fwd_bwd(base, target):
    logits = base.clone().requires_grad_(True)
    loss, z_loss = vocab_parallel_cross_entropy_zloss(logits, target, z_loss_coeff=1e-3)
    loss.sum().backward()
    return loss.detach(), z_loss, logits.grad


def test_compiled_kernels_launch_directly_with_triton_launch_results(monkeypatch):
    """After the first call the launcher skips Triton's ``run`` (no per-call specialization) and
    gives bit-identical results; with a profiler's launch hook set it goes through Triton."""
    import triton

    from mindspeed_cez.kernels import triton_cross_entropy as tce

    gen = torch.Generator(device="cuda").manual_seed(3)
    base = torch.randn(300, 5000, device="cuda", generator=gen).to(torch.bfloat16)
    target = torch.randint(0, 5000, (300,), device="cuda", generator=gen)
    for launcher in tce.LAUNCHERS:
        monkeypatch.setattr(launcher, "direct", False)
    expected = _op_fwd_bwd(base, target)
    for launcher in tce.LAUNCHERS:
        launcher.direct = True
    _op_fwd_bwd(base, target)  # compiles or finds the kernels, keeps them

    calls = []
    for kernel in (tce._forward_kernel, tce._grad_kernel):
        monkeypatch.setattr(kernel, "run", lambda *a, _run=kernel.run, **k: calls.append(1) or _run(*a, **k))
    got = _op_fwd_bwd(base, target)
    assert calls == [], "Triton's run was called: the compiled kernel was not reused"
    for a, b in zip(got, expected):
        assert torch.equal(a, b)

    hooked = []
    hook = triton.knobs.runtime.launch_enter_hook
    if hasattr(hook, "add"):  # Triton 3.6+: a chain of hooks
        hook.add(hooked.append)
    else:
        monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", hooked.append)
    try:
        _op_fwd_bwd(base, target)
    finally:
        if hasattr(hook, "remove"):
            hook.remove(hooked.append)
    assert len(calls) == 2 and len(hooked) == 2, (len(calls), len(hooked))


@pytest.mark.parametrize("after_a_good_call", [False, True], ids=["first-call", "compiled-kernel-reused"])
def test_out_of_range_target_is_a_device_assert(after_a_good_call):
    """CUDA: no host sync on the hot path, so a bad target fails the stream with the argument's
    name (the CUDA context is dead afterwards: run it in a child process). Also when the
    launcher reuses the compiled forward kernel."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import sys
        import torch
        from mindspeed_cez import vocab_parallel_cross_entropy_zloss
        logits = torch.randn(64, 1000, device="cuda")
        target = torch.randint(0, 1000, (64,), device="cuda")
        if sys.argv[1] == "1":
            vocab_parallel_cross_entropy_zloss(logits, target)
            torch.cuda.synchronize()
        target[5] = 1000
        loss, _ = vocab_parallel_cross_entropy_zloss(logits, target)
        torch.cuda.synchronize()
        print("no error")
        """
    )
    result = subprocess.run([sys.executable, "-c", code, str(int(after_a_good_call))], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode != 0 and "no error" not in result.stdout
    assert "target outside [0, vocab) and not ignore_index" in result.stderr + result.stdout
