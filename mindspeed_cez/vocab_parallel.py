"""One op call's vocab-parallel steps, the same in each of the ops' autograd Functions.

:class:`VocabParallel` holds where this rank's vocab columns lie (:class:`~mindspeed_cez.kernels.VocabShard`),
the loss, and the backends the call uses, and gives the steps every Function repeats: the rows,
the sequence gathered (sequence parallelism), the partials merged into the loss over the global vocab
(the collective of :mod:`mindspeed_cez.tensor_parallel`, then the backend's ``loss_from_partials``),
and the targets' range check (after the collective: where ranks disagree on the vocab, the merge
refused on all of them).
"""

from mindspeed_cez.kernels import as_rows
from mindspeed_cez.tensor_parallel import check_targets_on_host, gather_partials, gather_sequence, vocab_shard


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
