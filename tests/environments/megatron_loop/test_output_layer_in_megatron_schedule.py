"""``--lm-fused-output-layer`` (gradients in forward, the default) in megatron-core's own training
step on CPU (real gloo processes, TP=1 x DP=2): Megatron's ``DistributedDataParallel`` (fp32
``main_grad`` buffers), its no-pipelining schedule and ``finalize_model_grads``, the loss function of
Megatron's ``pretrain_gpt`` (``sum(loss * mask)`` and the token count, which the schedule divides by,
clamped at 1), a loss scale (``config.grad_scale_func``). Against the unfused run of the same step:

* a micro-batch whose loss mask is all zeros (a prompt-only sample) gives what the unfused op
  gives: finite ``main_grad``, equal to the unfused one, no error;
* an extra forward with autograd on whose loss is dropped (a metric computed in training mode)
  fails before the gradients are used: at the next forward of the loss, or at Megatron's gradient
  sync (``finish_grad_sync``) when it was the last one, naming the cause and the fix; under
  ``torch.no_grad()`` the same extra forward writes nothing into ``main_grad`` and the step equals
  the unfused one.

Runs on every megatron-core of CI leg 1 (0.12.1 to 0.16.1); megatron-core's schedule needs
``megatron.core.pipeline_parallel.get_forward_backward_func``."""

import pytest
import torch

pytest.importorskip("megatron.core")

from mindspeed_cez.patches import cpu_mode, local_gpt  # noqa: E402
from support import run_on_ranks  # noqa: E402
from support.tiny_gpt import BATCH, COEFF, SEQ, VOCAB, build  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo test; GPU machines run tests/run_gpu_checks.sh"),
]
LOSS_SCALE = 4.0


def _schedule_clamps_token_count():
    """Whether this megatron-core's schedule divides by ``clamp(num_tokens, min=1)`` (newer lines);
    older ones divide by the count itself: an all-masked micro-batch is NaN there, fused or not."""
    import inspect

    from megatron.core.pipeline_parallel import schedules

    return "clamp(num_tokens, min=1)" in inspect.getsource(schedules)


def _batches(dp_rank, all_masked):
    out = []
    for mb in range(3):
        g = torch.Generator().manual_seed(2000 + 10 * dp_rank + mb)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        mask = (torch.rand(BATCH, SEQ, generator=g) < 0.7).float()
        if all_masked and mb == 1:
            mask.zero_()  # a prompt-only micro-batch
        out.append((tokens, labels, mask))
    return out


def _step(ddp, batches, extra_forward=None, after_last=False):
    """One training step through Megatron's schedule and finalize_model_grads; returns main_grads.
    ``extra_forward(model, *inputs)`` runs in each micro-batch's forward step before the model's forward,
    or with ``after_last`` only in the last one's loss function (after every forward of the loss)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func


    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    attention_mask = local_gpt.causal_attention_mask(SEQ)
    data = iter(batches)

    def loss_func(loss_mask, output):  # pretrain_gpt's: the schedule divides by the token count
        loss = torch.sum(output.float().view(-1) * loss_mask.view(-1))
        num_tokens = loss_mask.sum().clone().detach().to(torch.int)
        return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.float()])}

    seen = []

    def forward_step(data_iterator, model):
        tokens, labels, loss_mask = next(data_iterator)
        seen.append(1)
        inputs = (model, tokens, position_ids, attention_mask, labels, loss_mask)
        if extra_forward is not None and not after_last:
            extra_forward(*inputs)
        output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)

        def loss(out):
            if extra_forward is not None and after_last and len(seen) == len(batches):
                extra_forward(*inputs)
            return loss_func(loss_mask, out)
        return output, loss

    ddp.zero_grad_buffer()
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data, model=[ddp],
                                num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=BATCH,
                                decoder_seq_length=SEQ, forward_only=False)
    finalize_model_grads([ddp])
    return {n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()}


def _worker(rank, world_size):
    from megatron.core import num_microbatches_calculator as nmc
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    import mindspeed_cez.patches as patches

    cpu_mode.apply(training_loop=True)  # the schedule's and DDP's CUDA tensors on the CPU
    model = build(1)
    config = model.config
    config.grad_scale_func = lambda loss: loss * LOSS_SCALE
    config.finalize_model_grads_func = None
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    dp = ps.get_data_parallel_world_size()
    nmc.init_num_microbatches_calculator(0, None, BATCH * 3 * dp, BATCH, dp)
    dp_rank = ps.get_data_parallel_rank()
    try:
        for all_masked in (False, True) if _schedule_clamps_token_count() else (False,):
            batches = _batches(dp_rank, all_masked)
            patches.apply(z_loss_coeff=COEFF)
            unfused = _step(ddp, batches)
            patches.apply(z_loss_coeff=COEFF, fused_output_layer=True)
            fused = _step(ddp, batches)
            for name, grad in fused.items():
                assert torch.isfinite(grad).all(), (all_masked, name)
                torch.testing.assert_close(grad, unfused[name], rtol=1e-4, atol=1e-6,
                                           msg=f"all_masked={all_masked}: {name}")

        batches = _batches(dp_rank, False)
        patches.apply(z_loss_coeff=COEFF)
        unfused = _step(ddp, batches)
        patches.apply(z_loss_coeff=COEFF, fused_output_layer=True)

        def metric_under_no_grad(model, *args):
            with torch.no_grad():
                model(*args[:3], labels=args[3], loss_mask=args[4])

        fused = _step(ddp, batches, metric_under_no_grad)  # nothing added into main_grad
        for name, grad in fused.items():
            torch.testing.assert_close(grad, unfused[name], rtol=1e-4, atol=1e-6, msg=f"no_grad metric: {name}")

        def metric_with_autograd(model, *args):  # the loss of this forward is dropped
            model(*args[:3], labels=args[3], loss_mask=args[4])

        # One block at these sizes: its forward adds nothing into main_grad (the two gradient GEMMs run in
        # backward), so a dropped forward changes nothing. Blocks that add in forward and whose backward
        # never comes are caught (test_linear_cross_entropy.py: test_a_forward_without_its_backward_is_detected).
        for after_last in (False, True):
            fused = _step(ddp, batches, metric_with_autograd, after_last=after_last)
            for name, grad in fused.items():
                torch.testing.assert_close(grad, unfused[name], rtol=1e-4, atol=1e-6,
                                           msg=f"dropped forward (after_last={after_last}): {name}")
    finally:
        patches.remove()
        nmc.unset_num_microbatches_calculator()


def test_fused_output_layer_in_megatrons_schedule():
    run_on_ranks(2, _worker, timeout=600)
