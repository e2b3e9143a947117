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
from mindspeed_cez.first_order import first_order_only
from mindspeed_cez.fp32_accumulation import Accumulator
from mindspeed_cez.kernels import chunked_linear
from mindspeed_cez.kernels.rows import as_rows
from mindspeed_cez.linear_layer import LinearLossOptions, main_grad_placeholder
from mindspeed_cez.tensor_parallel import (check_target_range, gather_sequence, merged_loss, start_reduce_dhidden,
                                           vocab_shard)


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
        shard = vocab_shard(options.tp_group, weight.shape[0])
        full = gather_sequence(hidden, options.tp_group, shard.world_size, options.sequence_parallel)
        rows = as_rows(full)
        flat_target = target.reshape(-1)
        stats = options.linear.linear_partials(rows, weight, flat_target, options.loss, shard,
                                               ce_backend=options.backend, chunk_cols=options.chunk_cols)
        out = merged_loss(options.backend, stats, flat_target, options.loss, options.tp_group, shard.world_size,
                          shard_name="weight")
        # after the collective; the linear kernels do not assert on targets: the torch check does on CUDA
        check_target_range(flat_target, options.loss, shard, kernels.torch_reference)
        total, z_loss, lse = out.view(3, *target.shape).unbind(0)

        ctx.save_for_backward(hidden, weight, flat_target, lse)
        ctx.options, ctx.shard = options, shard
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(z_loss, lse)
        return total, z_loss, lse

    @staticmethod
    @first_order_only("linear_cross_entropy_zloss")
    def backward(ctx, grad_loss, _grad_z_loss, _grad_lse):
        hidden, weight, flat_target, lse = ctx.saved_tensors
        options, shard = ctx.options, ctx.shard
        tp_size = shard.world_size
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
            dlogits = options.linear.linear_grad(rows, w, chunk[:, :w.shape[0]], flat_target, lse, grad_loss,
                                                 options.loss, shard.chunk(c, w.shape[0]), ce_backend=options.backend)
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
