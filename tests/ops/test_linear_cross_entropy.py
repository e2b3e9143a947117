"""linear_cross_entropy_zloss against float64, over real gloo processes for TP 1/2/4, with and without
sequence parallelism: loss, z-loss, dhidden (as ColumnParallelLinear gives it) and dweight; also of
scaled and soft-capped logits."""

import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from support.backends import triton_runs_on_cpu
from support import run_on_ranks
from support import cross_entropy_zloss_float64, relative_error, split_transform
from mindspeed_cez import kernels, linear_cross_entropy_zloss, vocab_parallel_cross_entropy_zloss
from mindspeed_cez import GradientPath, LinearCrossEntropyOptions, LogitTransform, TrainerInputs
from mindspeed_cez.linear_cross_entropy import DEFAULT_OPTIONS, RECOMPUTE
from mindspeed_cez.kernels import chunked_linear
from mindspeed_cez.kernels import LossSpec, VocabShard
from mindspeed_cez.patches.loss_wrappers import main_grad_target  # the adaptor's weight-gradient target
from mindspeed_cez import ForwardGradientLedger  # noqa: E402

LEDGER = ForwardGradientLedger()  # the forwards of these tests that owe a backward

SEQ, BATCH, HIDDEN, V_PER_RANK = 13, 3, 24, 53  # 39 tokens; chunks of 16 rows do not divide them
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def _problem(dtype, tp, gen):
    vocab = V_PER_RANK * tp
    hidden = torch.randn(SEQ * tp, BATCH, HIDDEN, generator=gen)  # sequence a multiple of tp (SP)
    weight = torch.randn(vocab, HIDDEN, generator=gen) / HIDDEN**0.5 * 3
    target = torch.randint(0, vocab, (SEQ * tp, BATCH), generator=gen)
    target[torch.rand(target.shape, generator=gen) < 0.15] = -100
    upstream = torch.randn(target.shape, generator=gen)
    return hidden.to(dtype), weight.to(dtype), target, upstream


def _float64(hidden, weight, target, upstream, z, a, **transform):
    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    loss, z_loss, _ = cross_entropy_zloss_float64(h @ w.t(), target, z_loss_coeff=z, label_smoothing=a, **transform)
    (loss * upstream.double()).sum().backward()
    return loss.detach(), z_loss.detach(), h.grad, w.grad


K = 0.37  # the upstream gradient of the token weights' tests: K * weights


def _token_weights(target, gen):
    """A loss mask with zeros (and a few halves) and its upstream gradient ``k * mask`` (Megatron's)."""
    mask = (torch.rand(target.shape, generator=gen) < 0.8).float()
    mask[torch.rand(target.shape, generator=gen) < 0.1] = 0.5
    return mask, K * mask


def _worker(rank, world_size, dtype, z, a, sequence_parallel, backend, forward_grads=False, transform=None):
    transform = transform or {}
    gen = torch.Generator().manual_seed(4321)  # every rank draws the same full problem
    hidden, weight, target, upstream = _problem(dtype, world_size, gen)
    token_weights = None
    if forward_grads:
        token_weights, upstream = _token_weights(target, gen)
    exp_loss, exp_z, exp_dh, exp_dw = _float64(hidden, weight, target, upstream, z, a, **transform)
    rows = slice(rank * V_PER_RANK, (rank + 1) * V_PER_RANK)
    seq = slice(rank * SEQ, (rank + 1) * SEQ) if sequence_parallel else slice(None)
    group = dist.group.WORLD
    h = hidden[seq].clone().requires_grad_()
    w = weight[rows].clone().requires_grad_()
    main_grad = forward_grads == "main_grad"  # the upstream gradient known in forward, dweight into main_grad
    if main_grad:
        w.main_grad = torch.full(w.shape, 0.25)
    backend, _, linear = backend.partition("+")  # "triton+gemm": Triton's CE kernels on GEMM chunks
    # chunks of 16 vocab rows / blocks of 16 tokens: several, the last one short
    _, logit_transform = split_transform(transform)
    options = LinearCrossEntropyOptions(logit_transform, GradientPath("forward" if forward_grads else "recompute",
                                                                      row_block=16),
                                        backend=backend, linear_backend=linear or None, chunk_cols=16)
    trainer = TrainerInputs(token_weights=token_weights, weight_grad=main_grad_target(w) if main_grad else None,
                            grad_scale=torch.tensor(K) if forward_grads == "main_grad" else
                            K if forward_grads == "scaled" else None, ledger=LEDGER)
    loss, z_loss = linear_cross_entropy_zloss(h, w, target, z_loss_coeff=z, label_smoothing=a, tp_group=group,
                                              sequence_parallel=sequence_parallel, options=options, trainer=trainer)
    if main_grad:  # the blocks before the last added during the forward, the last one in backward
        assert 0 < relative_error(w.main_grad - 0.25, exp_dw[rows]) < 1
    (loss * upstream).sum().backward()
    dweight = w.main_grad - 0.25 if main_grad else w.grad
    errors = {"loss": relative_error(loss, exp_loss), "dhidden": relative_error(h.grad, exp_dh[seq]),
              "dweight": relative_error(dweight, exp_dw[rows])}
    if z:
        errors["z_loss"] = relative_error(z_loss, exp_z)
    assert loss.dtype == torch.float32 and h.grad.dtype == dtype
    assert w.grad is None if main_grad else w.grad.dtype == dtype
    assert all(e < TOLERANCE[dtype] for e in errors.values()), errors

    if dtype == torch.bfloat16:  # no worse than the unfused bf16 path: logits in bf16, then the op
        hu = hidden.clone().requires_grad_()
        wu = weight[rows].clone().requires_grad_()
        lu, _ = vocab_parallel_cross_entropy_zloss(hu @ wu.t(), target, z, a, tp_group=group, backend=backend,
                                                   logit_transform=logit_transform)
        (lu * upstream).sum().backward()
        dist.all_reduce(hu.grad, group=group)  # what ColumnParallelLinear's backward does
        unfused = {"dhidden": relative_error(hu.grad[seq], exp_dh[seq]), "dweight": relative_error(wu.grad, exp_dw[rows])}
        for key, err in unfused.items():
            assert errors[key] <= 1.5 * err + 1e-3, (key, errors[key], err)


CASES = [
    # (world size, dtype, z-loss, label smoothing, sequence parallel, backend[, gradients in forward])
    (1, torch.float32, 1e-2, 0.0, False, "torch"),
    (1, torch.bfloat16, 1e-3, 0.1, False, "torch"),
    (2, torch.float32, 1e-2, 0.1, False, "torch"),
    (2, torch.bfloat16, 1e-3, 0.0, True, "torch"),
    (2, torch.float16, 0.0, 0.0, True, "torch"),
    (4, torch.float32, 1e-3, 0.2, True, "torch"),
    (4, torch.bfloat16, 1e-2, 0.0, False, "torch"),
    (1, torch.bfloat16, 1e-3, 0.1, False, "triton"),
    (2, torch.float32, 1e-2, 0.1, True, "triton"),
    (2, torch.float16, 0.0, 0.0, False, "triton"),
    (2, torch.bfloat16, 1e-3, 0.1, True, "triton+gemm"),
    (4, torch.bfloat16, 1e-2, 0.2, True, "triton"),
    # token_weights: the gradients made during the forward
    (1, torch.float32, 1e-2, 0.1, False, "torch", True),
    (1, torch.bfloat16, 1e-3, 0.0, False, "torch", True),
    (2, torch.bfloat16, 1e-3, 0.1, True, "torch", True),
    (2, torch.float16, 1e-2, 0.0, False, "torch", True),
    (4, torch.float32, 1e-3, 0.2, True, "torch", True),
    (2, torch.float32, 1e-2, 0.1, False, "triton", True),
    # grad_scale: the upstream gradient known in forward ("scaled"), dweight into main_grad ("main_grad")
    (1, torch.float32, 1e-2, 0.1, False, "torch", "scaled"),
    (1, torch.bfloat16, 1e-3, 0.0, False, "triton", "main_grad"),
    (2, torch.bfloat16, 1e-3, 0.1, True, "torch", "main_grad"),
    (2, torch.float16, 1e-2, 0.0, False, "torch", "scaled"),
    (4, torch.float32, 1e-3, 0.2, True, "torch", "main_grad"),
    (2, torch.float32, 1e-2, 0.1, False, "triton", "main_grad"),
]


@pytest.mark.parametrize("world_size,dtype,z,a,sequence_parallel,backend,forward_grads",
                         [c if len(c) == 7 else (*c, False) for c in CASES])
def test_matches_float64_over_tp(world_size, dtype, z, a, sequence_parallel, backend, forward_grads):
    if backend.startswith("triton") and not triton_runs_on_cpu():
        pytest.skip("the Triton kernels take CPU tensors only under TRITON_INTERPRET=1")
    run_on_ranks(world_size, _worker, dtype, z, a, sequence_parallel, backend, forward_grads)


# (world size, dtype, z-loss, smoothing, sequence parallel, backend, gradients in forward, scale, cap)
TRANSFORM_CASES = [
    (1, torch.float32, 1e-2, 0.1, False, "torch", False, 1.0, 5.0),
    (2, torch.bfloat16, 1e-3, 0.0, True, "torch", False, 0.5, 0.0),
    (4, torch.float32, 1e-3, 0.2, True, "torch", False, 2.0, 3.0),
    (2, torch.float16, 1e-2, 0.1, True, "torch", True, 1.0, 4.0),
    (4, torch.bfloat16, 1e-3, 0.1, False, "torch", True, 1.5, 6.0),
    (1, torch.bfloat16, 1e-3, 0.1, False, "triton", False, 1.0, 5.0),
    (2, torch.float32, 1e-2, 0.1, True, "triton", False, 2.0, 3.0),
    (4, torch.float16, 1e-3, 0.0, False, "triton", False, 0.8, 0.0),
    (2, torch.bfloat16, 1e-3, 0.1, True, "triton+gemm", False, 1.0, 4.0),
    (2, torch.float32, 1e-2, 0.1, False, "triton", True, 1.2, 5.0),
    (2, torch.bfloat16, 1e-3, 0.1, True, "torch", "main_grad", 1.5, 6.0),
    (1, torch.float32, 1e-2, 0.0, False, "triton", "main_grad", 0.6, 4.0),
]


@pytest.mark.parametrize("world_size,dtype,z,a,sequence_parallel,backend,forward_grads,logit_scale,logit_softcap",
                         TRANSFORM_CASES)
def test_transform_matches_float64_over_tp(world_size, dtype, z, a, sequence_parallel, backend, forward_grads,
                                           logit_scale, logit_softcap):
    """Scaled and soft-capped logits (cap 3-6 against logits of spread ~3: much of the tanh's range),
    every path: GEMM chunks and tl.dot tiles recomputed in backward, gradients in forward."""
    if backend.startswith("triton") and not triton_runs_on_cpu():
        pytest.skip("the Triton kernels take CPU tensors only under TRITON_INTERPRET=1")
    run_on_ranks(world_size, _worker, dtype, z, a, sequence_parallel, backend, forward_grads,
                 {"logit_scale": logit_scale, "logit_softcap": logit_softcap})


def test_grad_scale_needs_that_upstream_gradient():
    """With ``grad_scale`` the forward makes the gradients for ``grad_scale * token_weights``: any
    other upstream gradient (here a different scale) fails in backward, never a silent number."""
    gen = torch.Generator().manual_seed(12)
    hidden, weight, target, _ = _problem(torch.float32, 1, gen)
    mask, upstream = _token_weights(target, gen)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    w.main_grad = torch.zeros(w.shape)
    loss, _ = linear_cross_entropy_zloss(h, w, target,
                                         options=LinearCrossEntropyOptions(path=GradientPath("forward", row_block=16)),
                                         trainer=TrainerInputs(token_weights=mask, grad_scale=K, weight_grad=main_grad_target(w), ledger=LEDGER))
    assert w.main_grad.abs().sum() > 0  # the blocks before the last added during the forward
    with pytest.raises(RuntimeError, match="upstream gradient must be s \\* token_weights"):
        (loss * upstream * 1.01).sum().backward()
    for bad in (float("nan"), "1", torch.ones(2), torch.tensor(True)):
        with pytest.raises(ValueError, match="grad_scale must be"):
            linear_cross_entropy_zloss(h, w, target, options=LinearCrossEntropyOptions(path=GradientPath("forward")),
                                       trainer=TrainerInputs(token_weights=mask, grad_scale=bad))
    with pytest.raises(ValueError, match="grad_scale: .*pass token_weights with it"):
        linear_cross_entropy_zloss(h, w, target, trainer=TrainerInputs(grad_scale=1.0))


def test_forward_grads_dhidden_taken_without_a_copy():
    """With grad_scale the op's dhidden becomes the input's gradient as it is (no clone of N x h by
    autograd), and it is the float64 gradient."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    hidden, weight, target, _ = _problem(torch.float32, 1, gen)
    mask, upstream = _token_weights(target, gen)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    w.main_grad = torch.zeros(w.shape)
    loss = linear_cross_entropy_zloss(h, w, target, 1e-3,
                                      options=LinearCrossEntropyOptions(path=GradientPath("forward")),
                                      trainer=TrainerInputs(token_weights=mask, grad_scale=K, weight_grad=main_grad_target(w), ledger=LEDGER))[0]
    made = {}
    loss.grad_fn.register_hook(lambda grad_inputs, _: made.update(ptr=grad_inputs[0].data_ptr()))
    (loss * mask).sum().mul(K).backward()
    assert h.grad.data_ptr() == made["ptr"]
    ref_loss, _, ref_dh, ref_dw = _float64(hidden, weight, target, upstream, 1e-3, 0.0)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(h.grad.double(), ref_dh, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.main_grad.double(), ref_dw, rtol=1e-4, atol=1e-6)


def test_one_block_makes_its_gradient_gemms_in_backward():
    """One block (the default at small logits): the forward adds nothing into main_grad (its two GEMMs
    run in backward, as the unfused layer's do), so a forward dropped without its backward leaves
    main_grad as it was and owes nothing; with its backward main_grad gets the float64 gradient."""

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    hidden, weight, target, _ = _problem(torch.float32, 1, gen)
    mask, upstream = _token_weights(target, gen)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    w.main_grad = torch.full(w.shape, 0.25)

    def forward():
        return linear_cross_entropy_zloss(h, w, target, 1e-3,
                                          options=LinearCrossEntropyOptions(path=GradientPath("forward")),
                                          trainer=TrainerInputs(token_weights=mask, grad_scale=K, weight_grad=main_grad_target(w), ledger=LEDGER))[0]

    dropped = forward()
    assert torch.equal(w.main_grad, torch.full(w.shape, 0.25))
    del dropped
    LEDGER.check()  # nothing was added, nothing is owed
    loss = forward()
    assert torch.equal(w.main_grad, torch.full(w.shape, 0.25))
    (loss * upstream).sum().backward()
    _, _, ref_dh, ref_dw = _float64(hidden, weight, target, upstream, 1e-3, 0.0)
    torch.testing.assert_close((w.main_grad - 0.25).double(), ref_dw, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(h.grad.double(), ref_dh, rtol=1e-4, atol=1e-6)
    LEDGER.check()


def test_default_row_block():
    """The default: blocks whose logits take at most LOGITS_BUDGET_BYTES (4 GiB) at any token count,
    one block within it; ``block_bytes`` sets that bound; a fraction: ceil(1 / fraction) equal blocks.
    Blocks are a multiple of 128 rows, at least 1024, never more than the tokens; a bad dial names
    itself and its range."""
    from mindspeed_cez.linear_cross_entropy import LOGITS_BUDGET_BYTES, default_row_block
    tokens = (100, 3000, 8192, 12288, 16384, 20000, 32768)
    # 4 GiB of bf16 logits of a 151936 vocab: 14134 rows, 14080 as a multiple of 128
    assert [default_row_block(n, 151936) for n in tokens] == [100, 3000, 8192, 12288, 8192, 10112, 11008]
    assert [default_row_block(n, 151936, 0.5) for n in tokens] == [100, 1536, 4096, 6144, 8192, 10112, 16384]
    assert [default_row_block(n, 151936, 0.125) for n in tokens] == [100, 1024, 1024, 1536, 2048, 2560, 4096]
    assert [default_row_block(n, 151936, 1.0) for n in tokens] == list(tokens)
    assert [default_row_block(8192, 16160, f) for f in (1.0, 0.5, 0.25, 0.125, 0.01)] == [8192, 4096, 2048, 1024, 1024]
    at_limit = LOGITS_BUDGET_BYTES // (2 * 8192)  # 8192 rows of this vocab fill the bound in bf16
    assert default_row_block(8192, at_limit) == 8192 and default_row_block(8192, at_limit + 1) == 4096
    assert default_row_block(8192, at_limit, itemsize=4) == 4096  # fp32 logits: twice the bytes
    assert default_row_block(8192, 151936, block_bytes=1 << 30) == 8192 // 3 // 128 * 128 + 128  # 3 blocks of 1 GiB
    for n in (1, 1000, 3001, 8191, 20000, 65537, 262144, 524288, 1 << 22):  # the last never empty
        for fraction in (None, 1.0, 0.5, 0.3, 0.125):
            rows = default_row_block(n, 151936, fraction)
            assert 1 <= rows <= n and (n - 1) // rows + 1 == -(-n // rows)
            if fraction is not None and n >= 1024:
                assert rows <= max(1024, n * fraction) + 127
        for v, itemsize, budget in ((151936, 2, None), (37984, 2, None), (256000, 4, None), (151936, 2, 1 << 30),
                                    (16160, 2, 64 << 20), (151936, 2, 1)):
            rows = default_row_block(n, v, itemsize=itemsize, block_bytes=budget)
            bound = LOGITS_BUDGET_BYTES if budget is None else budget
            assert rows * v * itemsize <= max(bound, 1024 * v * itemsize)  # within the bound, or 1024 rows
            assert (rows == n) == (n <= max(1024, bound // (v * itemsize) // 128 * 128))  # one block iff it fits
    gen = torch.Generator().manual_seed(17)
    hidden, weight, target, _ = _problem(torch.float32, 1, gen)
    mask, _ = _token_weights(target, gen)
    for bad in (0, 1.5, "0.5", True, float("nan")):
        with pytest.raises(ValueError, match="block_fraction takes .* a number in \\(0, 1\\]"):
            linear_cross_entropy_zloss(hidden, weight, target,
                                       options=LinearCrossEntropyOptions(path=GradientPath("forward", block_fraction=bad)),
                                       trainer=TrainerInputs(token_weights=mask))
    for bad in (0, -5, 2.5, "1GiB", True):
        with pytest.raises(ValueError, match="block_bytes takes the most memory one block of logits may take, in "
                                             "bytes: an int >= 1"):
            linear_cross_entropy_zloss(hidden, weight, target,
                                       options=LinearCrossEntropyOptions(path=GradientPath("forward", block_bytes=bad)),
                                       trainer=TrainerInputs(token_weights=mask))
    with pytest.raises(ValueError, match="row_block and block_fraction"):
        linear_cross_entropy_zloss(hidden, weight, target,
                                   options=LinearCrossEntropyOptions(path=GradientPath("forward", block_fraction=0.5, row_block=16)),
                                   trainer=TrainerInputs(token_weights=mask))
    with pytest.raises(ValueError, match="row_block and block_bytes"):
        linear_cross_entropy_zloss(hidden, weight, target,
                                   options=LinearCrossEntropyOptions(path=GradientPath("forward", block_bytes=1 << 20, row_block=16)),
                                   trainer=TrainerInputs(token_weights=mask))
    with pytest.raises(ValueError, match="block_fraction and block_bytes both size the blocks"):
        linear_cross_entropy_zloss(hidden, weight, target,
                                   options=LinearCrossEntropyOptions(path=GradientPath("forward", block_fraction=0.5, block_bytes=1 << 20)),
                                   trainer=TrainerInputs(token_weights=mask))


def test_block_bytes_splits_the_tokens_and_keeps_the_float64_gradients():
    """A byte bound under the logits' size takes the tokens in blocks (3000 fp32 rows of a 64-column
    slice within 1024 rows' bytes: 3 blocks, two added into main_grad in forward, one in backward),
    each block's logits within the bound, with the float64 loss and gradients."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    n, v, h = 3000, 64, 16
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) / h**0.5 * 3
    target = torch.randint(0, v, (n,), generator=gen)
    target[torch.rand(n, generator=gen) < 0.1] = -100
    mask, upstream = _token_weights(target, gen)
    exp_loss, _, exp_dh, exp_dw = _float64(hidden, weight, target, upstream, 1e-3, 0.0)
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    w.main_grad = torch.zeros(w.shape)
    budget = 1024 * v * 4
    blocks, matmul = [], torch.matmul

    def spy(a, b, *args, **kwargs):
        if a.shape[-1] == h and b.shape == (h, v):  # a block's logits: rows x v_local
            blocks.append(a.shape[0])
        return matmul(a, b, *args, **kwargs)
    torch.matmul = spy
    try:
        loss, _ = linear_cross_entropy_zloss(x, w, target, 1e-3,
                                             options=LinearCrossEntropyOptions(path=GradientPath("forward", block_bytes=budget)),
                                             trainer=TrainerInputs(token_weights=mask, grad_scale=K, weight_grad=main_grad_target(w), ledger=LEDGER))
    finally:
        torch.matmul = matmul
    assert blocks == [1024, 1024, 952] and all(r * v * 4 <= budget for r in blocks)
    assert w.main_grad.abs().sum() > 0  # the first two blocks' weight gradients, added during the forward
    (loss * upstream).sum().backward()
    torch.testing.assert_close(loss.double(), exp_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), exp_dh, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.main_grad.double(), exp_dw, rtol=1e-4, atol=1e-6)
    LEDGER.check()  # the backward paid what the forward added


def test_token_weights_need_an_upstream_gradient_proportional_to_them():
    """Gradients in forward hold ``dweight`` summed with the weights: any other upstream gradient
    fails in backward (on CUDA a device-side assert), never a silent wrong dweight."""
    gen = torch.Generator().manual_seed(11)
    hidden, weight, target, upstream = _problem(torch.float32, 1, gen)
    mask, _ = _token_weights(target, gen)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    loss, _ = linear_cross_entropy_zloss(h, w, target, z_loss_coeff=1e-3,
                                         options=LinearCrossEntropyOptions(path=GradientPath("forward")),
                                         trainer=TrainerInputs(token_weights=mask))
    with pytest.raises(RuntimeError, match="upstream gradient must be k"):
        (loss * upstream).sum().backward()
    # ignored tokens (loss 0, gradient 0) may get any upstream gradient
    loss, _ = linear_cross_entropy_zloss(h, w, target, z_loss_coeff=1e-3,
                                         options=LinearCrossEntropyOptions(path=GradientPath("forward")),
                                         trainer=TrainerInputs(token_weights=mask))
    g = torch.where(target == -100, 5.0, 0.37 * mask)
    (loss * g).sum().backward()
    exp = _float64(hidden.detach(), weight.detach(), target, 0.37 * mask, 1e-3, 0.0)
    assert relative_error(w.grad, exp[3]) < 1e-5 and relative_error(h.grad, exp[2]) < 1e-5
    with pytest.raises(ValueError, match="token_weights must be a tensor of target's shape"):
        linear_cross_entropy_zloss(h, w, target, options=LinearCrossEntropyOptions(path=GradientPath("forward")),
                                   trainer=TrainerInputs(token_weights=mask[:-1]))


def test_chunks_bound_the_logits_and_cover_every_vocab_row(monkeypatch):
    """The torch backend, several vocab chunks, the last one short: no logits beyond one chunk's,
    each column once per pass."""
    gen = torch.Generator().manual_seed(7)
    hidden, weight, target, upstream = _problem(torch.float32, 1, gen)
    rows = hidden.reshape(-1, HIDDEN)  # the op's [n, h] view: its logits chunks are [n, <=16]
    hidden = hidden.requires_grad_()
    weight = weight.requires_grad_()
    shapes = []
    real_mm = torch.Tensor.__matmul__

    def spy(x, y):
        out = real_mm(x, y)
        shapes.append(tuple(out.shape))
        return out

    def spy_out(x, y, out=None):
        out = real_matmul(x, y, out=out)
        shapes.append(tuple(out.shape))
        return out

    real_matmul = torch.matmul
    monkeypatch.setattr(torch.Tensor, "__matmul__", spy)
    monkeypatch.setattr(torch, "matmul", spy_out)
    loss, _ = linear_cross_entropy_zloss(hidden, weight, target, z_loss_coeff=1e-2,
                                         options=LinearCrossEntropyOptions(chunk_cols=16))
    (loss * upstream).sum().backward()
    monkeypatch.undo()
    logits_shapes = [s for s in shapes if s[0] == rows.shape[0] and s[1] != HIDDEN]
    assert V_PER_RANK % 16 and max(s[1] for s in logits_shapes) == 16
    assert sum(s[1] for s in logits_shapes) == 2 * V_PER_RANK  # forward and backward, every column once
    exp_loss, _, exp_dh, exp_dw = _float64(hidden.detach(), weight.detach(), target, upstream, 1e-2, 0.0)
    assert relative_error(loss, exp_loss) < 1e-5 and relative_error(hidden.grad, exp_dh) < 1e-5
    assert relative_error(weight.grad, exp_dw) < 1e-5


@pytest.mark.parametrize("flag", [None, False, "zero_out"], ids=["no-flag", "grad_added_to_main_grad", "zero_out_wgrad"])
def test_gradient_accumulation_fusion_adds_into_main_grad(flag):
    """As Megatron's linear layers: dweight into main_grad; the weight's own gradient is None, or,
    where the weight carries ``grad_added_to_main_grad`` (Megatron's DDP), a placeholder so the
    DDP hook runs (zeros with ``zero_out_wgrad``) and the flag set."""
    gen = torch.Generator().manual_seed(8)
    hidden, weight, target, upstream = _problem(torch.bfloat16, 1, gen)
    weight = weight.requires_grad_()
    weight.main_grad = torch.full(weight.shape, 0.5)
    if flag is not None:
        weight.grad_added_to_main_grad = False
    if flag == "zero_out":
        weight.zero_out_wgrad = True
    loss, _ = linear_cross_entropy_zloss(hidden, weight, target, z_loss_coeff=1e-3,
                                         trainer=TrainerInputs(weight_grad=main_grad_target(weight)))
    (loss * upstream).sum().backward()
    _, _, _, exp_dw = _float64(hidden, weight.detach(), target, upstream, 1e-3, 0.0)
    assert relative_error(weight.main_grad - 0.5, exp_dw) < 2e-2
    if flag is None:
        assert weight.grad is None and not hasattr(weight, "grad_added_to_main_grad")
    else:
        assert weight.grad is not None and weight.grad.shape == weight.shape and weight.grad_added_to_main_grad
    if flag == "zero_out":
        assert not weight.grad.any()


@pytest.mark.parametrize("grads", ["recompute", "forward, grad_scale"])
def test_weight_grad_target_without_megatron(grads):
    """The op's own weight-gradient target, no Megatron attribute on the weight: ``dweight`` added into
    ``into``, autograd given what ``added`` returns (called once, in backward); the weight itself
    carries nothing new."""
    from mindspeed_cez.linear_cross_entropy import WeightGradTarget

    gen = torch.Generator().manual_seed(8)
    hidden, weight, target, _ = _problem(torch.float32, 1, gen)
    mask, upstream = _token_weights(target, gen)
    weight = weight.requires_grad_()
    into, calls = torch.full(weight.shape, 0.5), []
    given = torch.zeros(weight.shape)
    into_target = WeightGradTarget(into, lambda: calls.append(1) or given)
    if grads == "recompute":
        options, trainer = DEFAULT_OPTIONS, TrainerInputs(weight_grad=into_target)
    else:
        options = LinearCrossEntropyOptions(path=GradientPath("forward", row_block=16))
        trainer = TrainerInputs(token_weights=mask, grad_scale=K, weight_grad=into_target, ledger=LEDGER)
    loss, _ = linear_cross_entropy_zloss(hidden, weight, target, z_loss_coeff=1e-3, options=options, trainer=trainer)
    (loss * upstream).sum().backward()
    _, _, _, exp_dw = _float64(hidden, weight.detach(), target, upstream, 1e-3, 0.0)
    assert relative_error(into - 0.5, exp_dw) < 1e-5
    assert calls == [1] and torch.equal(weight.grad, given) and set(vars(weight)) <= {"grad"}
    with pytest.raises(ValueError, match="WeightGradTarget.into .* must have the weight's shape"):
        linear_cross_entropy_zloss(hidden, weight, target,
                                   trainer=TrainerInputs(weight_grad=WeightGradTarget(torch.zeros(3, 3))))


def test_a_removed_keyword_names_its_replacement():
    """``gradient_accumulation_fusion=`` is gone from the op (Megatron's ``main_grad`` is the patch layer's):
    a TypeError naming ``trainer=TrainerInputs(weight_grad=WeightGradTarget(...))``; an unknown keyword stays
    Python's TypeError."""
    gen = torch.Generator().manual_seed(8)
    hidden, weight, target, _ = _problem(torch.float32, 1, gen)
    with pytest.raises(TypeError, match="no longer takes gradient_accumulation_fusion=: pass "
                                        "trainer=TrainerInputs\\(weight_grad=WeightGradTarget"):
        linear_cross_entropy_zloss(hidden, weight, target, gradient_accumulation_fusion=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'grad_accumulation'"):
        linear_cross_entropy_zloss(hidden, weight, target, grad_accumulation=True)
    with pytest.raises(TypeError, match="weight_grad must be a"):
        linear_cross_entropy_zloss(hidden, weight, target, trainer=TrainerInputs(weight_grad=True))


@pytest.mark.parametrize("grads", ["recompute", "forward", "forward, grad_scale"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_16_bit_main_grad(dtype, grads):
    """Megatron without fp32 gradient accumulation (fp16 by default, ``--grad-reduce-in-bf16``): a
    ``main_grad`` in the weight's dtype takes the weight gradient too, within that dtype's rounding."""
    gen = torch.Generator().manual_seed(9)
    hidden, weight, target, _ = _problem(dtype, 1, gen)
    mask, upstream = _token_weights(target, gen)
    weight = weight.requires_grad_()
    weight.main_grad = torch.full(weight.shape, 0.25, dtype=dtype)
    weight.grad_added_to_main_grad = False
    path = GradientPath("recompute" if grads == "recompute" else "forward")
    trainer = TrainerInputs(token_weights=None if grads == "recompute" else mask, weight_grad=main_grad_target(weight),
                            grad_scale=K if grads == "forward, grad_scale" else None, ledger=LEDGER)
    loss, _ = linear_cross_entropy_zloss(hidden, weight, target, z_loss_coeff=1e-3,
                                         options=LinearCrossEntropyOptions(path=path), trainer=trainer)
    (loss * upstream).sum().backward()
    _, _, _, exp_dw = _float64(hidden, weight.detach(), target, upstream, 1e-3, 0.0)
    assert weight.main_grad.dtype == dtype and weight.grad_added_to_main_grad
    assert relative_error(weight.main_grad.double() - 0.25, exp_dw) < TOLERANCE[dtype]


def test_tied_embedding_and_output_weight():
    """The same weight as input embedding and output projection: both gradients add up."""
    gen = torch.Generator().manual_seed(9)
    _, weight, target, upstream = _problem(torch.float32, 1, gen)
    tokens = torch.randint(0, V_PER_RANK, (SEQ, BATCH), generator=gen)
    w = weight.clone().requires_grad_()
    loss, _ = linear_cross_entropy_zloss(torch.tanh(F.embedding(tokens, w)), w, target, z_loss_coeff=1e-2)
    (loss * upstream).sum().backward()
    w64 = weight.double().requires_grad_()
    ref, _, _ = cross_entropy_zloss_float64(torch.tanh(F.embedding(tokens, w64)) @ w64.t(), target, z_loss_coeff=1e-2)
    (ref * upstream.double()).sum().backward()
    assert relative_error(loss, ref) < 1e-5 and relative_error(w.grad, w64.grad) < 1e-5


def test_bad_input_names_the_argument():
    h = torch.randn(4, 2, 8)
    w = torch.randn(10, 8)
    t = torch.zeros(4, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="hidden width"):
        linear_cross_entropy_zloss(h, torch.randn(10, 7), t)
    with pytest.raises(TypeError, match="weight"):
        linear_cross_entropy_zloss(h, torch.randn(10, 8, 1), t)
    with pytest.raises(TypeError, match="must share dtype"):
        linear_cross_entropy_zloss(h, w.bfloat16(), t)
    with pytest.raises(ValueError, match="target"):
        linear_cross_entropy_zloss(h, w, torch.zeros(4, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="target"):
        linear_cross_entropy_zloss(h, w, t.float())
    with pytest.raises(TypeError, match="hidden"):
        linear_cross_entropy_zloss(h.long(), w, t)
    with pytest.raises(ValueError, match="z_loss_coeff"):
        linear_cross_entropy_zloss(h, w, t, z_loss_coeff=-1.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        linear_cross_entropy_zloss(h, w, t, label_smoothing=1.0)
    with pytest.raises(ValueError, match="outside"):
        linear_cross_entropy_zloss(h, w, torch.full((4, 2), 10))
    with pytest.raises(ValueError, match="weight has no vocab rows"):
        linear_cross_entropy_zloss(h, w[:0], t)
    with pytest.raises(ValueError, match="logit_scale must be a finite number > 0"):
        linear_cross_entropy_zloss(h, w, t,
                                   options=LinearCrossEntropyOptions(logit_transform=LogitTransform(scale=0.0)))
    with pytest.raises(ValueError, match="logit_softcap must be a finite number >= 0"):
        linear_cross_entropy_zloss(h, w, t, options=LinearCrossEntropyOptions(
            logit_transform=LogitTransform(cap=float("inf")), path=GradientPath("forward")),
            trainer=TrainerInputs(token_weights=t.float()))


def _sp_shape_worker(rank, world_size):
    h = torch.randn(3, 2, 8)  # this rank's chunk of a 6-token sequence
    with pytest.raises(ValueError, match="sequence_parallel"):
        linear_cross_entropy_zloss(h, torch.randn(5, 8), torch.zeros(5, 2, dtype=torch.long),
                                   tp_group=dist.group.WORLD, sequence_parallel=True)


def test_sequence_parallel_target_must_cover_the_gathered_sequence():
    run_on_ranks(2, _sp_shape_worker)


def _unequal_weight_rows_worker(rank, world_size):
    h, target = torch.randn(6, 8), torch.randint(0, 10, (6,))
    w = torch.randn(5 + rank, 8)  # 5 and 6 vocab rows
    for grads, trainer in (("recompute", None), ("forward", TrainerInputs(token_weights=torch.ones(6), grad_scale=1.0))):
        with pytest.raises(ValueError, match=r"weight: tensor-parallel ranks hold vocab shards of unequal width "
                                             r"\(from 5 to 6\).*pad the vocab"):
            linear_cross_entropy_zloss(h.requires_grad_(), w, target, tp_group=dist.group.WORLD,
                                       options=LinearCrossEntropyOptions(path=GradientPath(grads)), trainer=trainer)


def test_unequal_weight_rows_are_refused_on_every_rank():
    run_on_ranks(2, _unequal_weight_rows_worker, timeout=120)


def test_default_chunk_is_small_beside_the_logits():
    """The recompute path's vocab chunk: 1024-4096 columns up to 2**26 logits, and within
    LOGITS_BUDGET_BYTES at any token count (fewer columns, a multiple of 128, past 2M bf16 tokens)."""
    budget = chunked_linear.LOGITS_BUDGET_BYTES
    for n, v in ((8192, 151936), (8192, 37984), (65536, 151936), (16384, 16160), (39, 53), (524288, 151936),
                 (1 << 21, 151936), (1 << 22, 151936), (1 << 24, 151936)):
        step = chunked_linear.default_chunk_cols(n, v)
        assert 1 <= step <= v and (step == v or 128 <= step <= 4096) and (step == v or step % 128 == 0)
        assert n * step <= max(chunked_linear.CHUNK_LOGITS, 1024 * n)
        assert n * step * 2 <= max(budget, 128 * n * 2)
        assert step >= min(v, 1024) or n * 1024 * 2 > budget  # 1024 columns kept while they fit the bound
        assert chunked_linear.default_chunk_cols(n, v, itemsize=4) * n * 4 <= max(budget, 128 * n * 4)


@pytest.mark.skipif(not triton_runs_on_cpu(), reason="the Triton kernels take CPU tensors only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_linear_kernels_match_float64(label_smoothing):
    """The tl.dot kernels at shapes that divide no tile: rows, h and columns past the last block, a
    vocab slice that starts at 100, targets on other slices and ignored; partials and gradient."""
    from mindspeed_cez.kernels import triton_linear_cross_entropy as tlce

    gen = torch.Generator().manual_seed(12)
    n, h, cols, start, vocab = 37, 40, 150, 100, 300
    x, w = torch.randn(n, h, generator=gen), torch.randn(cols, h, generator=gen) * 0.5
    target = torch.randint(0, vocab, (n,), generator=gen)
    target[:3] = torch.tensor([-100, start, start + cols - 1])
    assert tlce.groups(cols, "cpu") > 1
    logits = x.double() @ w.double().t()
    spec, shard = LossSpec(-100, 1e-2, label_smoothing), VocabShard(start, cols, vocab)
    exp = kernels.torch_reference.shard_partials(logits, target, spec, shard)
    got = tlce.linear_partials(x, w, target, spec, shard)
    assert torch.allclose(got, exp, rtol=1e-5, atol=1e-5), (got - exp).abs().max()
    lse, g = torch.rand(n, generator=gen, dtype=torch.float64) + logits.amax(1), torch.randn(n, generator=gen)
    a, z, local = label_smoothing, 1e-2, target - start
    gd = torch.where(target == -100, 0.0, g.double())[:, None]
    exp_grad = gd * (torch.exp(logits - lse[:, None]) * (1 + 2 * z * lse[:, None]) - a / vocab)
    owned = (local >= 0) & (local < cols)
    exp_grad[owned, local[owned]] -= gd[owned, 0] * (1 - a)
    grad = torch.full((n, cols + 5), 7.0)[:, :cols]  # a row stride wider than the columns
    tlce.linear_grad(x, w, grad, target, lse.float(), g, spec, shard)
    assert relative_error(grad, exp_grad) < 1e-5 and not grad[0].any()  # ignored row: 0


def test_linear_backend_choice_and_bad_names():
    """CPU and CUDA default to GEMM chunks (reduced by the CE backend, with the chunk width asked for),
    other accelerators with the Triton CE backend to the tl.dot kernels; a named one is checked."""
    npu = types.SimpleNamespace(type="npu")  # torch.device("npu") needs torch_npu
    gemm = kernels.linear_backend_for(torch.device("cpu"), chunk_cols=2048)
    assert isinstance(gemm, chunked_linear.ChunkedLinear)
    assert gemm.ce_backend is kernels.torch_reference and gemm.chunk_cols == 2048
    if kernels.triton_available():
        cuda = kernels.linear_backend_for(torch.device("cuda"), backend="triton")
        assert isinstance(cuda, chunked_linear.ChunkedLinear) and cuda.ce_backend is kernels.get_backend("triton")
        assert kernels.linear_backend_for(npu, backend="triton").__name__.endswith("triton_linear_cross_entropy")
        assert isinstance(kernels.linear_backend_for(npu, "gemm", backend="triton"), chunked_linear.ChunkedLinear)
    with pytest.raises(ValueError, match="unknown linear backend 'cublas'"):
        kernels.linear_backend_for(npu, "cublas")


def test_settings_are_arguments_and_bad_ones_name_theirs():
    """The path is the options' ``GradientPath`` ("forward", the default, where the call has token weights; a
    call without them takes the recompute path); bad settings name theirs when the options are made."""
    gen = torch.Generator().manual_seed(13)
    hidden, weight, target, _ = _problem(torch.float32, 1, gen)
    mask, _ = _token_weights(target, gen)
    h = hidden.requires_grad_()
    assert GradientPath().grads == "forward" and DEFAULT_OPTIONS.path == GradientPath()
    loss, _ = linear_cross_entropy_zloss(h, weight, target)  # no token weights: the recompute path
    assert type(loss.grad_fn).__name__ == "LinearCrossEntropyZLossBackward"
    loss, _ = linear_cross_entropy_zloss(h, weight, target, trainer=TrainerInputs(token_weights=mask))
    assert type(loss.grad_fn).__name__ == "LinearCrossEntropyZLossForwardGradsBackward"
    with pytest.raises(ValueError, match="token_weights .*GradientPath\\('forward'\\)"):
        linear_cross_entropy_zloss(hidden, weight, target, options=LinearCrossEntropyOptions(path=RECOMPUTE),
                                   trainer=TrainerInputs(token_weights=mask))
    for make, message in ((lambda: GradientPath("backward"), "grads must be one of"),
                          (lambda: LinearCrossEntropyOptions(chunk_cols=0), "chunk_cols must be"),
                          (lambda: GradientPath(row_block=2.5), "row_block must be"),
                          (lambda: LinearCrossEntropyOptions(backend="cuda"), "unknown backend 'cuda'"),
                          (lambda: LinearCrossEntropyOptions(linear_backend="cublas"),
                           "unknown linear backend 'cublas'")):
        with pytest.raises(ValueError, match=message):
            make()
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        vocab_parallel_cross_entropy_zloss(hidden[..., :5], target.clamp(max=4), backend="cuda")


def _main_grad_problem(seed):
    gen = torch.Generator().manual_seed(seed)
    hidden, weight, target, _ = _problem(torch.float32, 1, gen)
    mask, upstream = _token_weights(target, gen)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    w.main_grad = torch.full(w.shape, 0.25)
    w.grad_added_to_main_grad = False
    return h, w, target, mask, upstream


def _forward_into_main_grad(h, w, target, mask):
    return linear_cross_entropy_zloss(h, w, target, z_loss_coeff=1e-3,
                                      options=LinearCrossEntropyOptions(path=GradientPath("forward", row_block=16)),
                                      trainer=TrainerInputs(token_weights=mask, grad_scale=K, weight_grad=main_grad_target(w), ledger=LEDGER))


def test_no_grad_never_writes_main_grad():
    """grads='forward' with grad_scale under torch.no_grad() (or with no input needing a gradient):
    the loss alone, as the recompute path's forward makes it; main_grad untouched."""

    h, w, target, mask, _ = _main_grad_problem(14)
    exp_loss = _float64(h.detach(), w.detach(), target, torch.ones(target.shape), 1e-3, 0.0)[0]
    with torch.no_grad():
        loss, _ = _forward_into_main_grad(h, w, target, mask)
    assert torch.equal(w.main_grad, torch.full(w.shape, 0.25)) and not loss.requires_grad
    assert relative_error(loss, exp_loss) < 1e-5
    loss, _ = _forward_into_main_grad(h.detach(), w.detach(), target, mask)
    assert torch.equal(w.main_grad, torch.full(w.shape, 0.25))
    LEDGER.check()  # nothing owed


def test_a_forward_without_its_backward_is_detected():
    """A forward that added the weight gradient into main_grad and whose loss was discarded (an
    extra forward with autograd on) fails at the op's next forward and at the check Megatron's
    gradient sync runs, naming the cause and the fix; one whose backward has not run yet fails only
    at that check (pipelined micro-batches run forwards ahead of backwards)."""
    from mindspeed_cez.linear_cross_entropy import ForwardGradientError

    h, w, target, mask, upstream = _main_grad_problem(15)
    loss, _ = _forward_into_main_grad(h, w, target, mask)
    del loss  # the graph goes without a backward
    with pytest.raises(ForwardGradientError, match="freed without a backward.*torch.no_grad.*GradientPath\\('recompute'\\)"):
        _forward_into_main_grad(h, w, target, mask)
    LEDGER.check()  # reported once

    first, _ = _forward_into_main_grad(h, w, target, mask)
    second, _ = _forward_into_main_grad(h, w, target, mask)  # a backward pending is fine here
    with pytest.raises(ForwardGradientError, match="backward has not run \\(2 such"):
        LEDGER.check()
    (first * upstream).sum().backward()
    (second * upstream).sum().backward()
    LEDGER.check()

    loss, _ = _forward_into_main_grad(h, w, target, mask)
    (loss * upstream).sum().backward()  # the normal case: nothing to report
    LEDGER.check()
    loss, _ = _forward_into_main_grad(h, w, target, mask)
    del loss
    with pytest.raises(ForwardGradientError, match="weight \\(53, 24\\)"):
        LEDGER.check()


def test_adding_into_the_target_in_forward_needs_a_ledger_and_ledgers_are_apart():
    """``grad_scale`` with ``weight_grad`` (the weight gradient added during the forward) without a ledger is
    refused naming the fix; a forward's debt is its own ledger's, never another's."""
    from mindspeed_cez.linear_cross_entropy import ForwardGradientError

    h, w, target, mask, upstream = _main_grad_problem(16)
    with pytest.raises(ValueError, match="pass ledger=mindspeed_cez.ForwardGradientLedger\(\)"):
        TrainerInputs(token_weights=mask, grad_scale=K, weight_grad=main_grad_target(w))
    with pytest.raises(TypeError, match="ledger must be a mindspeed_cez.ForwardGradientLedger"):
        TrainerInputs(ledger=object())
    other = ForwardGradientLedger()
    loss, _ = _forward_into_main_grad(h, w, target, mask)
    del loss  # LEDGER's forward goes without a backward
    other.check()  # not other's
    with pytest.raises(ForwardGradientError, match="freed without a backward"):
        LEDGER.check()


def test_the_mismatch_message_names_the_cause_and_the_fix(monkeypatch):
    """On the CPU an exception, on CUDA the device-side assert's text (under 255 characters, CUDA's
    limit on assert messages; tests/environments/gpu/test_linear_cross_entropy_gpu.py checks the device side)."""
    messages, real_assert = [], torch._assert_async

    def recording(condition, message):
        messages.append(message)
        return real_assert(condition, message)

    monkeypatch.setattr(torch, "_assert_async", recording)
    h, w, target, mask, upstream = _main_grad_problem(16)
    loss, _ = _forward_into_main_grad(h, w, target, mask)
    with pytest.raises(RuntimeError, match="loss was weighted otherwise. For custom loss weighting run with "
                                           "GradientPath\\('recompute'\\)"):
        (loss * upstream * 2).sum().backward()
    loss, _ = linear_cross_entropy_zloss(h, w, target,
                                         options=LinearCrossEntropyOptions(path=GradientPath("forward")),
                                         trainer=TrainerInputs(token_weights=mask))
    with pytest.raises(RuntimeError, match="must be k \\* w .*GradientPath\\('recompute'\\)"):
        (loss * torch.rand(mask.shape)).sum().backward()
    assert len(messages) == 2 and all(len(m) < 255 for m in messages), [len(m) for m in messages]
    remedy = "--lm-fused-output-layer recompute"  # what the adaptor passes: the flag, where the op has none
    loss, _ = linear_cross_entropy_zloss(h, w, target,
                                         options=LinearCrossEntropyOptions(path=GradientPath("forward")),
                                         trainer=TrainerInputs(token_weights=mask, remedy=remedy))
    with pytest.raises(RuntimeError, match="must be k \\* w .*run with --lm-fused-output-layer recompute$"):
        (loss * torch.rand(mask.shape)).sum().backward()
    assert len(messages) == 3 and len(messages[-1]) < 255, len(messages[-1])
