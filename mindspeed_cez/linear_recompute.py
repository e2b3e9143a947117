"""The fused output layer's recompute path (``grads="recompute"``, and any call without token weights).

The forward reduces the logits to the partials as they are made (Triton: ``tl.dot`` tiles in
registers, kernels/triton_linear_cross_entropy.py; torch: GEMMs on chunks of the vocab); backward
recomputes them one vocab chunk at a time into their gradient (a ``[tokens, chunk]`` buffer), then
one GEMM adds that chunk's share into an fp32 ``dhidden`` and one writes its rows of ``dweight``:
four GEMMs in all.
"""

from dataclasses import dataclass
from typing import Optional

import torch

from mindspeed_cez.first_order import first_order_only
from mindspeed_cez.kernels import chunked_linear
from mindspeed_cez.kernels.backends import LinearBackend
from mindspeed_cez.linear_forward_grads import Accumulator
from mindspeed_cez.linear_options import LinearLossOptions
from mindspeed_cez.cross_entropy_zloss import VocabParallel, start_reduce_dhidden


@dataclass(frozen=True, eq=False)
class RecomputeOptions(LinearLossOptions):
    """:class:`LinearCrossEntropyZLoss`'s options: the projection's backend and backward's vocab chunk."""

    linear: Optional[LinearBackend] = None  # kernels.linear_backend_for's
    chunk_cols: Optional[int] = None


class LinearCrossEntropyZLoss(torch.autograd.Function):
    """``(loss, z_loss, lse)`` of ``hidden @ weight.T`` without the logits; backward recomputes
    them one vocab chunk at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, target, options):
        vp = VocabParallel(options.tp_group, weight.shape[0], options.spec, options.backend, checker=options.linear,
                           shard_name="weight")
        rows = vp.rows(vp.gather_sequence(hidden, options.sequence_parallel))
        flat_target = target.reshape(-1)
        out = vp.merged_loss(options.linear.linear_partials(rows, weight, flat_target, options.spec, vp.shard),
                             flat_target)
        vp.check_targets(flat_target)  # after the collective
        total, z_loss, lse = out.view(3, *target.shape).unbind(0)

        ctx.save_for_backward(hidden, weight, flat_target, lse)
        ctx.options, ctx.vp = options, vp
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(z_loss, lse)
        return total, z_loss, lse

    @staticmethod
    @first_order_only("linear_cross_entropy_zloss")
    def backward(ctx, grad_loss, _grad_z_loss, _grad_lse):
        hidden, weight, flat_target, lse = ctx.saved_tensors
        options, vp = ctx.options, ctx.vp
        full = vp.gather_sequence(hidden, options.sequence_parallel)
        rows = vp.rows(full)
        lse = lse.reshape(-1)
        grad_loss = torch.zeros_like(lse) if grad_loss is None else grad_loss.reshape(-1)
        wgrad = options.weight_grad  # None: dweight goes back through autograd
        dweight = None if wgrad is not None else torch.empty_like(weight)
        drows = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
        n, v_local = rows.shape[0], weight.shape[0]
        step = chunked_linear.chunk_width(options.chunk_cols, n, v_local, rows.element_size())
        chunk = rows.new_empty((rows.shape[0], step))
        accumulate = Accumulator(rows.device, options.accumulation)
        for c in range(0, weight.shape[0], step):
            w = weight[c:c + step]
            dlogits = options.linear.linear_grad(rows, w, chunk[:, :w.shape[0]], flat_target, lse, grad_loss,
                                                 options.spec, vp.shard.chunk(c, w.shape[0]))
            accumulate(drows, dlogits, w)  # fp32 sum over vocab chunks
            if c + step >= v_local:  # dhidden complete: its collective overlaps the last weight-gradient GEMM
                reduction = start_reduce_dhidden(drows.to(rows.dtype).view(full.shape), options.tp_group, vp.tp_size,
                                                 options.sequence_parallel)
            if wgrad is not None:
                accumulate(wgrad.into[c:c + step], dlogits.t(), rows)
            else:
                torch.matmul(dlogits.t(), rows, out=dweight[c:c + step])
        dhidden = reduction.wait()
        if wgrad is not None:
            dweight = wgrad.finish()
        return dhidden, dweight, None, None
