"""The partials layout: what one rank's vocab slice contributes to a row's loss.

An fp32 ``[PARTIAL_ROWS, n]`` tensor, one column per token row, written by every backend's
``shard_partials`` / ``linear_partials`` and merged over the tensor-parallel ranks by
``mindspeed_cez.tensor_parallel.merged_loss``:

``ROW_MAX``      this slice's row max; the global max after the MAX all-reduce
``SUM_EXP``      sum of exp(z - ROW_MAX) over the slice; rescaled to the global max, then SUM all-reduced
``TARGET_TERM``  ``(1-a)*z[target] + (a/V)*sum(z)`` (the z[target] part 0 where another rank owns the
                 target, NaN for an out-of-range target); SUM all-reduced together with SUM_EXP
``LOCAL_MAX``    this slice's row max again, kept for the rescale between the two all-reduces

``SUM_EXP`` and ``TARGET_TERM`` are adjacent, so one all-reduce of ``partials[SUM_EXP:TARGET_TERM + 1]``
carries both.
"""

ROW_MAX, SUM_EXP, TARGET_TERM, LOCAL_MAX = 0, 1, 2, 3
PARTIAL_ROWS = 4
