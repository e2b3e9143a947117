"""Vocab-parallel cross entropy + z-loss as one autograd Function.

Per token, with each tensor-parallel rank holding the vocab slice
``[rank*v_local, (rank+1)*v_local)``:

    l_r = log(sum(exp(x))) over rank r's slice (-inf for a slice that is -inf across the row)
    lse = logsumexp over ranks of l_r                           } one all-gather of every rank's
    t   = sum over ranks of the target logit on the owning rank } (l_r, t_r, slice width)
    loss = lse - (1-a)*t - a*mean(x over the global vocab) + c*lse**2
    dx   = g * (softmax * (1 + 2c*lse) - (1-a)*onehot - a/V)   (no collective)

With a ``logit_transform`` of scale s and soft cap C all of it is of ``z = C*tanh(s*x/C)`` (``z = s*x``
for C = 0), made per element inside the kernels; backward multiplies by ``dz/dx``
(``s*(1 - (z/C)**2)``, or ``s``).

The backends in ``mindspeed_cez.kernels`` do the per-row work (with one rank, the whole
forward is one kernel). This module holds, in reading order: the tensor-parallel steps (collectives
and host checks), :class:`VocabParallel` (one call's steps, which the fused output layer's Functions
reuse), the argument checks, the autograd Function and the public op.
"""

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mindspeed_cez import kernels
from mindspeed_cez.first_order import first_order_input, first_order_only
from mindspeed_cez.kernels import IDENTITY, LossSpec, VocabShard, as_rows, loss_spec
from mindspeed_cez.kernels.backends import CrossEntropyBackend


# ----------------------------------------------------------------------------------------------
# the tensor-parallel steps: collectives and host checks (every rank holds a vocab slice and, with
# sequence parallelism, a chunk of the sequence)
# ----------------------------------------------------------------------------------------------

# Ranks' tensors concatenated along dim 0 (torch 2.13 renames all_gather_into_tensor, now deprecated).
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def group_rank_and_size(tp_group):
    """(rank, world size) in ``tp_group``; (0, 1) without a group or without torch.distributed.
    Asked on every call (cheap), so no reference to the group is kept here."""
    if tp_group is None or not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


def vocab_shard(tp_group, v_local):
    """The ops' one vocab prologue: rank ``r`` of ``tp_group`` holds ids ``[r*v_local, (r+1)*v_local)``."""
    rank, world_size = group_rank_and_size(tp_group)
    return VocabShard(rank * v_local, v_local, v_local * world_size, rank, world_size)


def check_targets_on_host(target, shard, ignore_index):
    """A CPU ``target``'s range: every id in ``[0, shard.global_vocab)`` or ``ignore_index``, else a ``ValueError``."""
    valid = (target == ignore_index) | ((target >= 0) & (target < shard.global_vocab))
    if target.numel() and not bool(valid.all()):
        bad = target[~valid][0].item()
        raise ValueError(f"target holds {bad}, outside [0, {shard.global_vocab}) (the global vocab) and not "
                         f"ignore_index={ignore_index}")


def check_equal_widths(gathered, shard_name):
    """On the CPU (host memory: no sync): every rank's slice has the same width, else the same
    ``ValueError`` on every rank, naming ``shard_name``, the tensor whose last dim is the slice."""
    widths = kernels.widths(gathered)
    if min(widths) != max(widths):
        raise ValueError(
            f"{shard_name}: tensor-parallel ranks hold vocab shards of unequal width (from {min(widths)} to "
            f"{max(widths)}), by rank {widths}; pad the vocab so it divides evenly by the tensor-parallel size")


def gather_partials(partials, tp_group, tp_size, shard_name="logits"):
    """``[ranks, numel]``: every rank's partials (``shard_partials``'s layout), all-gathered over
    ``tp_group`` when it has more than one rank (the ops' one collective of the loss); on the CPU
    their widths compared (:func:`check_equal_widths`, naming ``shard_name``)."""
    if tp_size == 1:
        return partials[None]
    gathered = partials.new_empty(tp_size * partials.numel())  # flat: gloo takes no stacked output
    all_gather(gathered, partials, group=tp_group)
    gathered = gathered.view(tp_size, partials.numel())
    if gathered.device.type == "cpu":
        check_equal_widths(gathered, shard_name)
    return gathered


def gather_sequence(hidden, tp_group, tp_size, sequence_parallel):
    """The whole sequence: ``hidden`` all-gathered along dim 0 under sequence parallelism, else itself."""
    if not (sequence_parallel and tp_size > 1):
        return hidden
    out = hidden.new_empty((hidden.shape[0] * tp_size, *hidden.shape[1:]))
    all_gather(out, hidden.contiguous(), group=tp_group)
    return out


class StartedReduction:
    """:func:`start_reduce_dhidden`'s collective, running: :meth:`wait` makes the current stream wait
    for it and gives its result (again on later calls)."""

    __slots__ = ("result", "work")

    def __init__(self, result, work):
        self.result, self.work = result, work

    def wait(self):
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.result


def start_reduce_dhidden(dhidden, tp_group, tp_size, sequence_parallel):
    """This rank's ``dhidden`` of the whole sequence -> what ``ColumnParallelLinear`` returns: the
    sum over ranks, reduce-scattered to this rank's sequence chunk with sequence parallelism; the
    collective started asynchronously, so kernels queued before :meth:`StartedReduction.wait`
    overlap it (as ``ColumnParallelLinear`` overlaps it with its weight-gradient GEMM)."""
    if tp_size == 1:
        return StartedReduction(dhidden, None)
    if sequence_parallel:
        local = dhidden.new_empty((dhidden.shape[0] // tp_size, *dhidden.shape[1:]))
        return StartedReduction(local, dist.reduce_scatter_tensor(local, dhidden.contiguous(), group=tp_group,
                                                                  async_op=True))
    return StartedReduction(dhidden, dist.all_reduce(dhidden, group=tp_group, async_op=True))


def reduce_dhidden(dhidden, tp_group, tp_size, sequence_parallel):
    """:func:`start_reduce_dhidden`, waited for."""
    return start_reduce_dhidden(dhidden, tp_group, tp_size, sequence_parallel).wait()


# ----------------------------------------------------------------------------------------------
# one op call's vocab-parallel steps, the same in each of the ops' autograd Functions
# ----------------------------------------------------------------------------------------------

class VocabParallel:
    """The vocab-parallel steps of one op call over ``tp_group`` (None: one rank) for ``v_local`` columns
    per rank: ``backend`` (a ``CrossEntropyBackend``) merges the partials, ``checker`` (``backend`` by
    default; the linear backend on the recompute path) checks the targets off the CPU. ``shard_name``:
    the tensor an error about unequal vocab widths names."""

    __slots__ = ("tp_group", "shard", "spec", "backend", "checker", "shard_name")

    def __init__(self, tp_group, v_local, spec, backend, checker=None, shard_name="logits"):
        self.tp_group, self.spec, self.backend, self.shard_name = tp_group, spec, backend, shard_name
        self.shard = vocab_shard(tp_group, v_local)
        self.checker = backend if checker is None else checker

    @property
    def tp_size(self):
        return self.shard.world_size

    rows = staticmethod(as_rows)  # [..., k] -> [n, k], unit last-dim stride

    def gather_sequence(self, hidden, sequence_parallel):
        """The whole sequence: ``hidden`` all-gathered along dim 0 under sequence parallelism, else itself."""
        return gather_sequence(hidden, self.tp_group, self.tp_size, sequence_parallel)

    def merged_loss(self, partials, target, out=None):
        """fp32 ``[3, n]`` (loss, z-loss, lse) over the global vocab from this rank's partials (into ``out``)."""
        gathered = gather_partials(partials, self.tp_group, self.tp_size, self.shard_name)
        return self.backend.loss_from_partials(gathered, target, self.spec, out)

    def check_targets(self, target):
        """The targets' range: on the CPU a ``ValueError``; elsewhere the checker's device-side check
        (CUDA: an asynchronous assert, no host sync; on Ascend an out-of-range target is a NaN loss)."""
        if target.device.type == "cpu":
            check_targets_on_host(target, self.shard, self.spec.ignore_index)
        else:
            self.checker.check_targets(target, self.spec, self.shard)


# ----------------------------------------------------------------------------------------------
# the op
# ----------------------------------------------------------------------------------------------

def check_target(target):
    """The one type check of ``target`` (both ops)."""
    if not isinstance(target, torch.Tensor) or target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise TypeError(f"target must be an integer tensor of vocab ids, got {getattr(target, 'dtype', type(target))}")


def _check_tensors(logits, target):
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor (bf16/fp16/fp32), got {getattr(logits, 'dtype', type(logits))}")
    check_target(target)
    if logits.dim() < 2 or tuple(logits.shape[:-1]) != tuple(target.shape):
        raise ValueError(
            f"logits must be target's shape plus a vocab dimension: logits {tuple(logits.shape)}, target {tuple(target.shape)}"
        )
    if logits.shape[-1] == 0:
        raise ValueError("logits has an empty vocab dimension")
    if logits.device != target.device:
        raise ValueError(f"logits ({logits.device}) and target ({target.device}) are on different devices")


def refusing_removed(replacements, positional_hint=None):
    """``op`` with a ``TypeError`` for each keyword in ``replacements`` (a removed keyword: what replaced it)
    and, with ``positional_hint``, for positional arguments past the op's (what they became). The op's own
    signature stays the public one (``inspect.signature`` follows ``__wrapped__``)."""

    def decorate(op):
        positional = sum(p.kind is p.POSITIONAL_OR_KEYWORD for p in inspect.signature(op).parameters.values())

        @functools.wraps(op)
        def checked(*args, **kwargs):
            if len(args) > positional and positional_hint is not None:
                raise TypeError(f"{op.__name__}() takes at most {positional} positional arguments, got {len(args)}: "
                                f"{positional_hint}")
            if not replacements.keys().isdisjoint(kwargs):
                name = next(name for name in kwargs if name in replacements)
                raise TypeError(f"{op.__name__}() no longer takes {name}=: pass {replacements[name]}")
            return op(*args, **kwargs)

        return checked

    return decorate


REMOVED = {
    "logit_scale": "logit_transform=LogitTransform(scale=..., cap=...) (mindspeed_cez.kernels)",
    "logit_softcap": "logit_transform=LogitTransform(scale=..., cap=...) (mindspeed_cez.kernels)",
    "loss": "its fields as z_loss_coeff=, label_smoothing=, ignore_index= and logit_transform=",
}


@dataclass(frozen=True, eq=False)
class CallOptions:
    """Everything :class:`VocabParallelCrossEntropyZLoss` takes besides its tensors, checked by
    :func:`vocab_parallel_cross_entropy_zloss` before it is made."""

    spec: LossSpec
    tp_group: Any  # a resolved process group (None: a single rank)
    backend: CrossEntropyBackend  # kernels.backend_for's


class VocabParallelCrossEntropyZLoss(torch.autograd.Function):
    """``(loss, z_loss, lse)`` of this rank's vocab slice of the logits; ``z_loss`` and ``lse`` are
    detached. Backward writes the logits' gradient, into their own buffer where they are an
    intermediate of the graph."""

    @staticmethod
    def forward(ctx, logits, target, options):
        backend, spec = options.backend, options.spec
        vp = VocabParallel(options.tp_group, logits.shape[-1], spec, backend)
        rows = vp.rows(logits)
        flat_target = target.reshape(-1)
        if vp.tp_size == 1:
            out = backend.fused_loss(rows, flat_target, spec)
        else:
            out = vp.merged_loss(backend.shard_partials(rows, flat_target, spec, vp.shard), flat_target)
        vp.check_targets(flat_target)  # after the collective
        total, z_loss, lse = out.view(3, *target.shape).unbind(0)  # one view op for the three

        # The gradient goes into the logits' own buffer when they are an intermediate of the
        # graph (the output layer's result). A leaf's buffer, or a view into one, holds
        # parameters or user data, so those get a fresh gradient tensor.
        base = logits._base if logits._base is not None else logits
        ctx.in_place = logits.grad_fn is not None and base.grad_fn is not None
        ctx.grad_written = False
        ctx.options = options
        ctx.logits_shape = logits.shape
        ctx.shard = vp.shard
        ctx.save_for_backward(rows, flat_target, lse)
        ctx.set_materialize_grads(False)  # no zero tensors for the gradients of z_loss and lse
        ctx.mark_non_differentiable(z_loss, lse)
        return total, z_loss, lse

    @staticmethod
    @first_order_only("vocab_parallel_cross_entropy_zloss")
    def backward(ctx, grad_loss, _grad_z_loss, _grad_lse):
        if ctx.in_place and ctx.grad_written:
            raise RuntimeError(
                "vocab_parallel_cross_entropy_zloss: a second backward through the same graph (retain_graph=True) is "
                "not served: the first wrote the gradient over the logits' buffer (an intermediate of the graph); "
                "compute the loss again for another backward")
        rows, flat_target, lse = ctx.saved_tensors
        options = ctx.options
        lse = lse.reshape(-1)
        grad_loss = torch.zeros_like(lse) if grad_loss is None else grad_loss.reshape(-1)
        grad = rows if ctx.in_place else torch.empty_like(rows)
        options.backend.write_grad(rows, grad, flat_target, lse, grad_loss, options.spec, ctx.shard)
        if ctx.in_place:
            # The logits now hold their gradient: any later use of them in backward must fail loudly.
            torch.autograd.graph.increment_version(rows)
            ctx.grad_written = True
        return grad.view(ctx.logits_shape), None, None


@refusing_removed(REMOVED)
def vocab_parallel_cross_entropy_zloss(logits, target, z_loss_coeff=0.0, label_smoothing=0.0, ignore_index=-100,
                                       tp_group=None, *, logit_transform=IDENTITY, backend=None, return_lse=False):
    """Fused cross entropy + z-loss on this rank's vocab slice of the logits.

    Args:
        logits: ``[s, b, v_local]`` or ``[n, v_local]``, bf16/fp16/fp32; this rank's vocab slice
            (rank ``r`` of ``tp_group`` holds ids ``[r*v_local, (r+1)*v_local)``).
        target: ``[s, b]`` / ``[n]`` integer global vocab ids; may hold ``ignore_index``.
        z_loss_coeff: ``c >= 0``; the z-loss is ``c * logsumexp(logits)**2`` per token.
        label_smoothing: ``0 <= a < 1``; ``(1-a)*CE + a*mean(-log p)`` over the global vocab.
        ignore_index: target value whose tokens get loss 0 and gradient 0.
        tp_group: the tensor-parallel process group; ``None``: a single rank (no collective). Under
            the adaptor, the patch layer passes Megatron's.
        logit_transform: a :class:`~mindspeed_cez.kernels.LogitTransform` ``(scale, cap)``:
            the loss is of ``cap * tanh(scale * logits / cap)`` (``scale * logits`` for cap 0; MindSpeed-LLM's
            ``output_multiplier_scale`` and soft cap), made per tile inside the kernels, gradients through it
            exactly. ``IDENTITY`` (default): the loss of the logits themselves. With ``z_loss_coeff``,
            ``label_smoothing`` and ``ignore_index`` it makes the loss's
            :class:`~mindspeed_cez.kernels.LossSpec` (checked once per set of values).
        backend: ``"triton"`` or ``"torch"`` (the pure-torch reference); ``None`` (default): Triton on
            accelerators where it imports, else torch (``mindspeed_cez.kernels.backend_for``);
            ``"cann"``: torch_npu's ``npu_cross_entropy_loss`` on Ascend, tensor-parallel size 1, no
            scale / soft cap (:mod:`mindspeed_cez.kernels.cann`; its gradient is not written in place).
        return_lse: also return the per-token log-sum-exp the op computed anyway (detached, fp32,
            of the transformed logits): the adaptor logs its mean as ``lm_lse`` without another pass.

    Returns:
        ``(loss, z_loss)``, fp32, shape of ``target``: ``loss = CE + c*lse**2`` per token and the
        detached ``z_loss = c*lse**2`` (for logging), both 0 where ``target == ignore_index``; CE and
        lse of the transformed logits. ``(loss, z_loss, lse)`` with ``return_lse=True``.

    Raises:
        TypeError: for a keyword the op no longer takes (``logit_scale``, ``logit_softcap``, ``loss``),
            naming what replaced it.

    Backward writes d(loss)/d(logits) in the logits' dtype; when ``logits`` is an intermediate
    of the autograd graph (the usual case: the output layer's result) the gradient reuses the
    logits' buffer, so the logits must not be read after backward.
    """
    _check_tensors(logits, target)
    spec = loss_spec(ignore_index, z_loss_coeff, label_smoothing, logit_transform)
    whole = kernels.whole_loss_backend(backend)
    if whole is not None:  # a vendor's op (torch_npu), TP = 1: its own autograd
        whole.check_applies(group_rank_and_size(tp_group)[1], spec.logit_transform)
        VocabParallel(None, logits.shape[-1], spec, kernels.get_backend("torch")).check_targets(target.reshape(-1))
        total, z_loss, lse = whole.cross_entropy_zloss(
            first_order_input(logits, "vocab_parallel_cross_entropy_zloss"), target, spec)
    else:
        options = CallOptions(spec, tp_group, kernels.backend_for(logits.device, backend))
        total, z_loss, lse = VocabParallelCrossEntropyZLoss.apply(logits, target, options)
    return (total, z_loss, lse) if return_lse else (total, z_loss)
