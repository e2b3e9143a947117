"""The fused output layer's recompute path (``grads="recompute"``, the default).

The forward reduces the logits to the partials as they are made (Triton: ``tl.dot`` tiles in
registers, kernels/triton_linear_cross_entropy.py; torch: GEMMs on chunks of the vocab); backward
recomputes them one vocab chunk at a time into their gradient (a ``[tokens, chunk]`` buffer), then
one GEMM adds that chunk's share into an fp32 ``dhidden`` and one writes its rows of ``dweight``:
four GEMMs in all.
"""

from dataclasses import dataclass
from types import ModuleType
from typing import Optional

import torch

from mindspeed_cez import kernels
from mindspeed_cez.cross_entropy_zloss import _check_target_range
from mindspeed_cez.first_order import first_order_only
from mindspeed_cez.fp32_accumulation import Accumulator
from mindspeed_cez.kernels import chunked_linear
from mindspeed_cez.kernels.rows import as_rows
from mindspeed_cez.linear_layer import LinearLossOptions, main_grad_placeholder
from mindspeed_cez.tensor_parallel import gather_sequence, group_rank_and_size, merged_loss, start_reduce_dhidden


def _check_targets(target, global_vocab, ignore_index):
    """CPU: a Python exception; CUDA: an asynchronous device-side assert (the linear kernels do not
    assert themselves); elsewhere an out-of-range target gives a NaN loss."""
    _check_target_range(target, global_vocab, ignore_index, kernels.torch_reference)


@dataclass(frozen=True, eq=False)
class RecomputeOptions(LinearLossOptions):
    """:class:`LinearCrossEntropyZLoss`'s options: the projection's backend and its vocab chunk."""

    linear: Optional[ModuleType] = None  # kernels.linear_backend_for's module
    chunk_cols: Optional[int] = None


class LinearCrossEntropyZLoss(torch.autograd.Function):
    """``(loss, z_loss, lse)`` of ``hidden @ weight.T`` without the logits; backward recomputes
    them one vocab chunk at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, target, options):
        rank, tp_size = group_rank_and_size(options.tp_group)
        full = gather_sequence(hidden, options.tp_group, tp_size, options.sequence_parallel)
        rows = as_rows(full)
        flat_target = target.reshape(-1)
        v_local = weight.shape[0]
        global_vocab, vocab_start = v_local * tp_size, rank * v_local
        stats = options.linear.linear_partials(rows, weight, flat_target, vocab_start, global_vocab, options.ignore_index,
                                         options.label_smoothing, ce_backend=options.backend, chunk_cols=options.chunk_cols,
                                         transform=options.transform)
        out = merged_loss(options.backend, stats, flat_target, options.ignore_index, options.z_loss_coeff, options.tp_group,
                          tp_size, shard_name="weight")
        _check_targets(flat_target, global_vocab, options.ignore_index)  # after the collective: see the op's forward
        loss, z_loss, lse = out.view(3, *target.shape).unbind(0)

        ctx.save_for_backward(hidden, weight, flat_target, lse)
        ctx.options, ctx.tp_size, ctx.vocab_start, ctx.global_vocab = options, tp_size, vocab_start, global_vocab
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(z_loss, lse)
        return loss, z_loss, lse

    @staticmethod
    @first_order_only("linear_cross_entropy_zloss")
    def backward(ctx, grad_loss, _grad_z_loss, _grad_lse):
        hidden, weight, flat_target, lse = ctx.saved_tensors
        options, tp_size = ctx.options, ctx.tp_size
        full = gather_sequence(hidden, options.tp_group, tp_size, options.sequence_parallel)
        rows = as_rows(full)
        lse = lse.reshape(-1)
        grad_loss = torch.zeros_like(lse) if grad_loss is None else grad_loss.reshape(-1)
        into_main_grad = options.gradient_accumulation_fusion and hasattr(weight, "main_grad")
        dweight = None if into_main_grad else torch.empty_like(weight)
        drows = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
        n, v_local = rows.shape[0], weight.shape[0]
        step = chunked_linear.chunk_width(options.chunk_cols, n, v_local)
        chunk = rows.new_empty((rows.shape[0], step))
        accumulate = Accumulator(rows.device)
        for c in range(0, weight.shape[0], step):
            w = weight[c:c + step]
            dlogits = options.linear.linear_grad(rows, w, chunk[:, :w.shape[0]], flat_target, lse, grad_loss, options.ignore_index,
                                           ctx.vocab_start + c, options.z_loss_coeff, options.label_smoothing, ctx.global_vocab,
                                           ce_backend=options.backend, transform=options.transform)
            accumulate(drows, dlogits, w)  # fp32 sum over vocab chunks
            if c + step >= v_local:  # dhidden complete: its collective overlaps the last weight-gradient GEMM
                reduction = start_reduce_dhidden(drows.to(rows.dtype).view(full.shape), options.tp_group, tp_size,
                                                 options.sequence_parallel)
            if into_main_grad:
                accumulate(weight.main_grad[c:c + step], dlogits.t(), rows)
            else:
                torch.matmul(dlogits.t(), rows, out=dweight[c:c + step])
        dhidden = reduction.wait()
        if into_main_grad:
            dweight = main_grad_placeholder(weight)
        return dhidden, dweight, None, None
