"""The tensor-parallel steps the ops share, each written once: collectives and host checks only
(no backend is called here; :class:`mindspeed_cez.vocab_parallel.VocabParallel` puts them together
with a backend for one op call).

Every rank holds a slice of the vocab (and, with sequence parallelism, a chunk of the sequence):

* :func:`vocab_shard`: one call's vocab layout (this rank's slice of the global vocab), and
  :func:`check_targets_on_host`: the targets within that vocab or ignored (a CPU tensor's check);
* :func:`gather_partials`: every rank's partials (their layout: ``kernels/__init__.py``) in one all-gather, their
  widths compared on the CPU (a ``ValueError``; on CUDA the backend's merge asserts on the device);
* :func:`gather_sequence` / :func:`reduce_dhidden` (:func:`start_reduce_dhidden`: asynchronous):
  ``ColumnParallelLinear``'s input all-gather along the sequence and its ``dhidden`` reduction
  (reduce-scatter with sequence parallelism, else all-reduce).
"""

import torch.distributed as dist

from mindspeed_cez import kernels
from mindspeed_cez.kernels import VocabShard

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
